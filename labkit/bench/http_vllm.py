"""``python -m labkit.bench http --vs-vllm``: ``labkit serve`` and ``vllm serve`` side by side,
measured by vLLM's own benchmark client, in one run.

    python -m labkit.bench http --vs-vllm                           # concurrency 1, 8, 32 (minutes)
    python -m labkit.bench http --vs-vllm --concurrency 8 --json    # one level, one JSON document
    python -m labkit.bench http --vs-vllm --quick --model tiny-llama --no-vllm   # the labkit half, seconds

Each server runs alone on loopback (never both at once: on a small machine they would share
its cores), started from scratch and stopped after its levels: ``python -m labkit serve`` from
this interpreter, then ``vllm serve`` from vLLM's (``make vllm-venv`` builds ``.venv-vllm``;
``labkit.vllm_port`` finds it). At every concurrency level the same client runs against each:
``vllm bench serve`` (random prompts of ``--input-len`` tokens, ``--output-len`` tokens each,
``ignore_eos`` so every request produces exactly that many, greedy, ``--num-prompts`` requests
at most ``concurrency`` in flight), which reports output tokens/s, time to first token (TTFT)
and time per output token after the first (TPOT), mean and p99. The report gives both servers'
figures and labkit / vLLM for each (higher is better for tok/s, lower for TTFT and TPOT).

Both servers get the same settings: the dtype (``--dtype``, fp32 by default), no prefix
caching (random prompts share nothing, and a repeated level must not find the previous one's
prompts cached), a 2048-token context. vLLM runs as ``vllm serve`` runs by default (compiled
with torch.compile; ``--vllm-eager`` skips that, to start faster), with every core bound
(``vllm_port.vllm_env``).

Without vLLM (no ``.venv-vllm``, or ``--no-vllm``, or ``LABKIT_VLLM_PYTHON=``) the vLLM half is
skipped with the reason printed, and labkit is measured by labkit's own client
(``labkit.bench.http.run_level``: the same request shape, TTFT and TPOT defined alike), so that
the labkit half still runs, e.g. on a CI machine. ``--quick`` is a small workload for tests.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

from .. import vllm_port
from . import checkout

DEFAULT_LEVELS = (1, 8, 32)
METRICS = ("output_tok_per_s", "ttft_mean_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms")
SERVER_START_TIMEOUT_S = 900          # vLLM compiles its model at start-up: minutes on a busy machine


@dataclass(slots=True)
class Workload:
    """What every level sends: ``num_prompts`` random prompts of ``input_len`` tokens, each
    asking for exactly ``output_len`` tokens (greedy, ``ignore_eos``), ``concurrency`` at a time."""

    levels: tuple[int, ...] = DEFAULT_LEVELS
    num_prompts: int = 32
    input_len: int = 128
    output_len: int = 32
    dtype: str = "float32"
    seed: int = 0


QUICK = Workload(levels=(1, 2), num_prompts=4, input_len=16, output_len=4)


@dataclass(slots=True)
class ServerRun:
    """One server's levels: ``levels[i]`` holds ``METRICS`` (and counts) at ``concurrency[i]``,
    or ``skipped`` says why the server did not run."""

    name: str
    client: str = ""
    version: str = ""
    load_before: tuple | None = None
    start_s: float | None = None
    levels: list[dict] = field(default_factory=list)
    skipped: str | None = None
    attempted: bool = True                # False: not run at all (vLLM unavailable, or --no-vllm)


# ---- the client ------------------------------------------------------------------------------
def vllm_client_command(python: str, base_url: str, model: str, tokenizer: str, w: Workload, concurrency: int,
                        result_dir: str, result_file: str) -> list[str]:
    """``vllm bench serve`` against ``base_url`` (``http://host:port``) for one level."""
    return vllm_port.cli_command(
        python, "bench", "serve", "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", model, "--tokenizer", tokenizer, "--dataset-name", "random",
        "--random-input-len", str(w.input_len), "--random-output-len", str(w.output_len),
        "--num-prompts", str(w.num_prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
        "--temperature", "0", "--seed", str(w.seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,99", "--disable-tqdm", "--save-result", "--result-dir", result_dir,
        "--result-filename", result_file)


def parse_vllm_result(data: dict, concurrency: int) -> dict:
    """One level's figures from ``vllm bench serve --save-result``'s JSON, in this module's names."""
    return {"concurrency": concurrency, "completed": data.get("completed"), "failed": data.get("failed", 0),
            "duration_s": data.get("duration"), "output_tokens": data.get("total_output_tokens"),
            "output_tok_per_s": data.get("output_throughput"),
            "ttft_mean_ms": data.get("mean_ttft_ms"), "ttft_p99_ms": data.get("p99_ttft_ms"),
            "tpot_mean_ms": data.get("mean_tpot_ms"), "tpot_p99_ms": data.get("p99_tpot_ms")}


def run_vllm_client(python: str, base_url: str, model: str, tokenizer: str, w: Workload,
                    concurrency: int, timeout_s: float = 1800) -> dict:
    """Run ``vllm bench serve`` for one level and return its figures (``parse_vllm_result``).
    Raises RuntimeError with the end of the client's log when it fails."""
    with tempfile.TemporaryDirectory(prefix="labkit-vs-vllm-") as tmp, \
            tempfile.TemporaryFile("w+", dir=tmp, errors="replace") as log:
        cmd = vllm_client_command(python, base_url, model, tokenizer, w, concurrency, tmp, "result.json")
        with vllm_port.process_group(cmd, log, env=_client_env(), cwd=tmp) as proc:
            try:
                code = proc.wait(timeout_s)
            except Exception:       # noqa: BLE001 - a timeout; process_group takes the client down
                code = None
        path = os.path.join(tmp, "result.json")
        if code != 0 or not os.path.exists(path):
            log.seek(0)
            raise RuntimeError(f"vllm bench serve failed (exit {code}); the end of its log:\n{log.read()[-3000:]}")
        with open(path) as f:
            return parse_vllm_result(json.load(f), concurrency)


def _client_env() -> dict[str, str]:
    """The client's environment: no proxy for loopback, and no OpenMP pool bound to the
    cores the server uses (the client runs no model)."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_labkit_client(base_url: str, w: Workload, concurrency: int) -> dict:
    """labkit's own client (``labkit.bench.http.run_level``) for one level, in the same names."""
    import asyncio

    from .http import _server_info, run_level
    model, vocab, _ = _server_info(base_url)
    r = asyncio.run(run_level(base_url, model, concurrency, w.num_prompts, w.input_len, w.output_len, vocab, w.seed))
    return {"concurrency": concurrency, "completed": r["num_ok"], "failed": r["num_errors"],
            "duration_s": r["duration_s"], "output_tokens": r["output_tokens"],
            "output_tok_per_s": r["output_tok_per_s"], "ttft_mean_ms": r["ttft_mean_ms"],
            "ttft_p99_ms": r["ttft_p99_ms"], "tpot_mean_ms": r["tpot_mean_ms"], "tpot_p99_ms": r["tpot_p99_ms"]}


# ---- the servers ---------------------------------------------------------------------------
def labkit_command(src: str | None = None) -> list[str]:
    """The command that starts ``python -m labkit``: this checkout's, or ``src``'s (another
    checkout, its Python and its C++ kernels both: ``labkit.bench.checkout``)."""
    if src is None:
        return [sys.executable, "-m", "labkit"]
    return checkout.command(src, "labkit")


@contextmanager
def labkit_server(model: str, w: Workload, extra_args=(), src: str | None = None):
    """``python -m labkit serve`` on a free loopback port, answering to ``model``; yields its root URL.
    ``src``: run the labkit of that directory (another checkout, its kernels included) instead of
    this one."""
    port = vllm_port.free_port()
    cmd = [*labkit_command(src), "serve", "--model", model, "--served-model-name", model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", w.dtype, "--no-prefix-caching",
           "--max-model-len", "2048", "--log-level", "warning", *extra_args]
    with vllm_port.server_process(cmd, port, name="labkit serve", timeout_s=SERVER_START_TIMEOUT_S,
                                  cwd=src) as base:
        yield base.removesuffix("/v1")


@contextmanager
def vllm_server(model: str, python: str, w: Workload, eager: bool):
    """``vllm serve`` with the comparison's settings, answering to ``model``; yields its root URL."""
    with vllm_port.serve(model, python=python, timeout_s=SERVER_START_TIMEOUT_S, dtype=w.dtype, seed=w.seed,
                         enforce_eager=eager, extra_args=["--no-enable-prefix-caching"]) as base:
        yield base.removesuffix("/v1")


def measure(run: ServerRun, server, client, w: Workload) -> ServerRun:
    """Start ``server`` (a context manager yielding its root URL), warm it up, run
    ``client(url, concurrency)`` at each of ``w.levels``, stop it. A server that fails to
    start, or a client that fails, ends the run with ``skipped`` saying why (the levels
    measured before it are kept)."""
    run.load_before = _load()
    t0 = time.perf_counter()
    try:
        with server as url:
            run.start_s = round(time.perf_counter() - t0, 1)
            _warm_up(url, w)
            for c in w.levels:
                run.levels.append(client(url, c))
                print(f"  {run.name} at concurrency {c}: {_brief(run.levels[-1])}", file=sys.stderr, flush=True)
    except (RuntimeError, OSError, vllm_port.VLLMUnavailable) as e:
        run.skipped = f"{type(e).__name__}: {e}"
    return run


def _warm_up(url: str, w: Workload) -> None:
    """A few requests of the workload's shape before anything is timed (first-call costs:
    kernel builds, allocator growth, a compiled graph's first shapes)."""
    run_labkit_client(url, Workload(num_prompts=4, input_len=w.input_len, output_len=w.output_len, seed=-1), 2)


def _brief(level: dict) -> str:
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    return (f"{f(level['output_tok_per_s'], '.1f')} tok/s, TTFT {f(level['ttft_mean_ms'], '.0f')} ms, "
            f"TPOT {f(level['tpot_mean_ms'], '.1f')} ms")


def _load() -> tuple | None:
    try:
        return tuple(round(x, 2) for x in os.getloadavg())
    except OSError:
        return None


# ---- one run, both servers ---------------------------------------------------------------------
def compare(model: str, w: Workload, *, with_vllm: bool = True, eager: bool = False,
            labkit_args=(), other_srcs=(), rounds: int = 1) -> dict:
    """Measure labkit, then vLLM (unless ``with_vllm`` is false or vLLM cannot run here: its
    half is then skipped, with the reason), at every level; return the report (``report``).
    ``other_srcs``: first, also measure the labkit of each of these directories (another
    checkout, e.g. an older commit's files from ``git archive``), as ``labkit@DIRNAME``: a
    before and after in the same run. ``rounds``: do it all that many times, the servers in
    the opposite order every other round (on a shared machine the load drifts: a round's
    ratios compare servers measured minutes apart, not an hour)."""
    python, why_not = _vllm_python(with_vllm)
    tokenizer = None
    if python is not None:
        try:
            tokenizer = vllm_port.model_dir(model)
        except (ValueError, OSError) as e:
            python, why_not = None, f"vLLM needs a checkpoint directory: {e}"
    if python is None:
        print(f"vLLM half skipped: {why_not}", file=sys.stderr, flush=True)

    def client(url: str, c: int) -> dict:
        if python is None:
            return run_labkit_client(url, w, c)
        return run_vllm_client(python, url, model, tokenizer, w, c)

    client_name = "vllm bench serve" if python is not None else "labkit.bench http (vLLM's client not available)"
    servers = [(ServerRun(f"labkit@{os.path.basename(os.path.abspath(src))}", client_name, os.path.abspath(src)),
                lambda src=src: labkit_server(model, w, labkit_args, src)) for src in other_srcs]
    servers.append((ServerRun("labkit", client_name, _labkit_version()), lambda: labkit_server(model, w, labkit_args)))
    if python is not None:
        servers.append((ServerRun("vllm", client_name, vllm_port.find_python()[1]),
                        lambda: vllm_server(model, python, w, eager)))
    done = []
    for i in range(rounds):
        order = servers if i % 2 == 0 else servers[::-1]
        runs = {run.name: measure(_fresh(run), start(), client, w) for run, start in order}
        done.append([runs[run.name] for run, _ in servers])       # the same order in every round's report
    if python is None:
        for runs in done:
            runs.append(ServerRun("vllm", skipped=why_not, attempted=False))
    return report(model, w, done, eager)


def _fresh(run: ServerRun) -> ServerRun:
    return ServerRun(run.name, run.client, run.version)


def _vllm_python(wanted: bool) -> tuple[str | None, str]:
    """(vLLM's interpreter, "") or (None, why vLLM's half does not run)."""
    if not wanted:
        return None, "--no-vllm"
    try:
        return vllm_port.find_python()[0], ""
    except vllm_port.VLLMUnavailable as e:
        return None, str(e)


def _labkit_version() -> str:
    from .. import __version__
    return __version__


def report(model: str, w: Workload, rounds: list[list[ServerRun]], eager: bool) -> dict:
    """Every round's servers and levels and, where both ran a level, labkit / vLLM for each
    metric (the ratios of one round: servers measured in the same run); then the median of
    each ratio over the rounds."""
    out = {"model": model, "workload": asdict(w), "vllm_compiled": not eager, "machine": _machine(),
           "rounds": [_round(runs) for runs in rounds]}
    out["median_ratios_labkit_over_vllm"] = _median_ratios([r["ratios_labkit_over_vllm"] for r in out["rounds"]])
    out["issue35_bar_at_8"] = [r["issue35_bar_at_8"] for r in out["rounds"]]
    return out


def _round(runs: list[ServerRun]) -> dict:
    by_name = {r.name: r for r in runs}
    vll = by_name.get("vllm")
    ratios = _ratios(by_name["labkit"], vll)
    others = {r.name: _ratios(r, vll) for r in runs if r.name.startswith("labkit@")}
    return {"servers": [asdict(r) for r in runs], "ratios_labkit_over_vllm": ratios,
            "ratios_other_labkits_over_vllm": others, "issue35_bar_at_8": _bar(ratios.get("8"))}


def _median_ratios(per_round: list[dict]) -> dict:
    import statistics
    out = {}
    for c in per_round[0] if per_round else {}:
        out[c] = {}
        for m in METRICS:
            values = [r[c][m] for r in per_round if c in r and r[c][m] is not None]
            out[c][m] = round(statistics.median(values), 3) if values else None
    return out


def _ratios(a: ServerRun, b: ServerRun | None) -> dict:
    """``a / b`` for every metric at every level both measured (``{}`` without ``b``)."""
    if b is None or not b.levels:
        return {}
    return {str(x["concurrency"]): {m: _ratio(x[m], y[m]) for m in METRICS} for x, y in zip(a.levels, b.levels)}


def _ratio(a, b) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _bar(r: dict | None) -> bool | None:
    """Issue 35's bar at concurrency 8: labkit's tok/s >= vLLM's, mean TTFT and TPOT <= vLLM's."""
    if r is None or None in (r["output_tok_per_s"], r["ttft_mean_ms"], r["tpot_mean_ms"]):
        return None
    return r["output_tok_per_s"] >= 1.0 and r["ttft_mean_ms"] <= 1.0 and r["tpot_mean_ms"] <= 1.0


def _machine() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = platform.processor()
    return f"{name}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


def format_report(r: dict) -> str:
    """The report as a table per round (one row per server and level, then the ratios), and
    the median ratios when there are several rounds."""
    w = r["workload"]
    lines = [f"{r['model']}, {w['dtype']}: {w['num_prompts']} random prompts of {w['input_len']} tokens, "
             f"{w['output_len']} output tokens each (greedy, ignore_eos); {r['machine']}"]
    for i, one in enumerate(r["rounds"], 1):
        if len(r["rounds"]) > 1:
            lines.append(f"round {i}:")
        lines += _round_lines(one)
    if len(r["rounds"]) > 1:
        for c, q in r["median_ratios_labkit_over_vllm"].items():
            lines.append(f"median over {len(r['rounds'])} rounds, labkit / vLLM at {c:>2}: " + _ratio_text(q))
    bars = [b for b in r["issue35_bar_at_8"] if b is not None]
    if bars:
        lines.append(f"at concurrency 8, labkit >= vLLM in tok/s and <= in mean TTFT and TPOT: "
                     f"{'yes' if all(bars) else 'no'} ({sum(bars)} of {len(bars)} rounds)")
    return "\n".join(lines)


def _round_lines(one: dict) -> list[str]:
    lines = [f"{'server':<15} {'conc':>4} {'ok':>4} {'fail':>4} {'out tok/s':>9} {'TTFT mean':>9} {'TTFT p99':>9} "
             f"{'TPOT mean':>9} {'TPOT p99':>9}  (ms)"]
    f = lambda x, spec: f"{'-':>9}" if x is None else format(x, spec)  # noqa: E731
    for s in one["servers"]:
        if s["skipped"] and not s["levels"]:
            lines.append(f"{s['name']:<15} skipped: {s['skipped']}")
            continue
        for lv in s["levels"]:
            lines.append(f"{s['name']:<15} {lv['concurrency']:>4} {lv['completed'] or 0:>4} {lv['failed'] or 0:>4} "
                         f"{f(lv['output_tok_per_s'], '9.1f')} {f(lv['ttft_mean_ms'], '9.1f')} "
                         f"{f(lv['ttft_p99_ms'], '9.1f')} {f(lv['tpot_mean_ms'], '9.2f')} "
                         f"{f(lv['tpot_p99_ms'], '9.2f')}")
        lines.append(f"  {s['name']} {s['version']}, client: {s['client']}; load before {s['load_before']}; "
                     f"started in {s['start_s']} s" + (f"; stopped early: {s['skipped']}" if s["skipped"] else ""))
    for who, ratios in [("labkit", one["ratios_labkit_over_vllm"]), *one["ratios_other_labkits_over_vllm"].items()]:
        for c, q in ratios.items():
            lines.append(f"{who} / vLLM at {c:>2}: " + _ratio_text(q))
    return lines


def _ratio_text(q: dict) -> str:
    return (f"tok/s {_x(q['output_tok_per_s'])}, TTFT mean {_x(q['ttft_mean_ms'])} p99 {_x(q['ttft_p99_ms'])}, "
            f"TPOT mean {_x(q['tpot_mean_ms'])} p99 {_x(q['tpot_p99_ms'])}")


def succeeded(r: dict) -> bool:
    """Every server that was run measured every level in every round, with no failed request."""
    levels = len(r["workload"]["levels"])
    return all(len(s["levels"]) == levels and not any(lv["failed"] for lv in s["levels"])
               for one in r["rounds"] for s in one["servers"] if s["attempted"])


def _x(v) -> str:
    return "-" if v is None else f"{v:.2f}x"
