"""``python -m labkit.bench http --breakdown``: where an online step's time goes, beside the
same engine offline at the same batch size.

    python -m labkit.bench http --breakdown                      # concurrency 1, 8, 32 (minutes)
    python -m labkit.bench http --breakdown --quick --model tiny-llama

For each concurrency level ``c`` it runs the same shape of work twice, on two engines of the same weights and settings:

* **offline**: the engine alone, stepped in a loop that keeps ``c`` requests in flight (a new
  one joins as one finishes), as ``LLM.generate`` steps it, with no server in the process;
* **online**: the same engine behind the OpenAI server (uvicorn's event loop on one thread, the
  engine loop on another: ``AsyncEngine``), driven by a client in another process at
  concurrency ``c`` (``vllm bench serve`` when vLLM's venv is there, which sends text prompts
  that the server tokenizes; labkit's own client otherwise, which sends token ids).

Both runs send ``--num-requests`` prompts of ``--prompt-len`` random tokens for exactly
``--max-tokens`` output tokens (greedy, ``ignore_eos``). While they run, ``Timers`` time the
engine's phases (each a method wrapped on its instance, on the wall clock and in the calling
thread's CPU time) and, online, the event loop's: HTTP parsing and writes (uvicorn's h11
protocol), JSON parsing and checks, the admission gate, SSE chunks, and the loop's time
blocked in ``select`` (idle). The report gives each phase in ms per engine step, offline and
online. What no timer sees is derived: the engine thread's time off its CPU within the forward
pass (wall - CPU: waiting for the GIL, for a core, or at an OpenMP barrier; offline it is the
barrier alone), and the event loop's busy time outside every timed phase (asyncio, Starlette,
the streams' queues and tasks).

The timers cost about a microsecond per call (a few hundred calls per step): they are on in
both runs, so they cancel in the comparison. Throughput figures for the record come from
``--vs-vllm`` (no timers), not from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections import defaultdict

from .http_vllm import Workload, run_labkit_client, run_vllm_client


class Timers:
    """Wall and thread-CPU seconds per phase, summed over calls; ``wrap`` installs a timer
    around a method of one object (or a function of a module) and ``undo`` removes them all.
    A phase's calls may come from any thread: each call adds its own thread's CPU time."""

    def __init__(self):
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = True
        self._undo: list = []

    def reset(self) -> None:
        self.wall.clear()
        self.cpu.clear()
        self.calls.clear()

    def wrap(self, owner, name: str, phase: str) -> None:
        """Time ``owner.name(...)`` as ``phase`` (an async method: time from the call until it returns)."""
        original = getattr(owner, name)
        if asyncio.iscoroutinefunction(original):
            async def timed(*args, **kwargs):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self._add(phase, t, c)
        else:
            def timed(*args, **kwargs):
                t, c = time.perf_counter(), time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    self._add(phase, t, c)
        had = name in getattr(owner, "__dict__", {})
        setattr(owner, name, timed)
        self._undo.append((owner, name, original if had or isinstance(owner, type) else None))

    def wrap_everywhere(self, function, phase: str, package: str = "labkit.server") -> None:
        """Time ``function`` wherever a module of ``package`` holds it by name (``from x import
        f`` copies the name: the function must be replaced in each module that imported it)."""
        for module in [m for n, m in sys.modules.items() if n.startswith(package) and m is not None]:
            for name, value in list(vars(module).items()):
                if value is function:
                    self.wrap(module, name, phase)

    def _add(self, phase: str, t: float, c: float) -> None:
        if self.on:
            self.wall[phase] += time.perf_counter() - t
            self.cpu[phase] += time.thread_time() - c
            self.calls[phase] += 1

    def undo(self) -> None:
        for owner, name, original in reversed(self._undo):
            if original is None:
                delattr(owner, name)          # the instance's timer hid the class's method
            else:
                setattr(owner, name, original)
        self._undo.clear()


# ---- the engine's phases -----------------------------------------------------------------------
def time_engine(timers: Timers, engine) -> None:
    """Timers on one ``Engine``'s phases: scheduling, building the batch's tensors, the forward
    pass, sampling, the scheduler's update, detokenization."""
    runner = engine.executor.runner
    timers.wrap(engine, "step", "step")
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(engine.executor, "execute", "execute")
    timers.wrap(runner, "execute", "runner")
    timers.wrap(runner, "prepare", "prepare")
    timers.wrap(engine.scheduler, "update", "update")
    timers.wrap(engine, "_detokenize", "detokenize")
    timers.wrap(engine, "_collect_deltas", "deltas")


def time_async_engine(timers: Timers, async_engine) -> None:
    """Timers on the engine thread's work around each step (``AsyncEngine``)."""
    timers.wrap(async_engine, "_step", "loop_step")
    timers.wrap(async_engine, "_admit", "admit")
    timers.wrap(async_engine, "_publish", "publish")
    timers.wrap(async_engine, "_refresh_stats", "stats")


def time_server(timers: Timers, app) -> None:
    """Timers on the event loop's phases: uvicorn's h11 protocol (request parsing, response
    writes), JSON parsing and checks, the admission gate, SSE chunk building; and
    tokenization (on the tokenizer's thread)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

    from ..request import encode_prompt
    from ..server import limits, protocol
    timers.wrap(H11Protocol, "data_received", "http_parse")
    timers.wrap(RequestResponseCycle, "send", "http_send")
    for f in (protocol.parse_json, protocol.parse_completion, protocol.parse_chat, limits.check_request):
        timers.wrap_everywhere(f, "parse")
    timers.wrap_everywhere(protocol.sse, "sse")
    timers.wrap_everywhere(encode_prompt, "tokenize")
    gate = app.state.gate
    for name in ("check_room", "usage", "release", "admit", "enter"):
        if callable(getattr(gate, name, None)):
            timers.wrap(gate, name, "gate")


class LoopClock:
    """The event loop's busy and idle time: its selector's ``select`` is timed (the loop is
    idle there, blocked until a socket or another thread wakes it), and the loop thread's CPU
    time read at ``start`` and ``stop`` (on that thread)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.idle = 0.0
        self.cpu0 = self.cpu = 0.0
        self.t0 = self.wall = 0.0
        selector = loop._selector                  # noqa: SLF001 - a measurement hook, removed by undo
        original = selector.select

        def select(timeout=None):
            t = time.perf_counter()
            try:
                return original(timeout)
            finally:
                self.idle += time.perf_counter() - t
        selector.select = select
        self._undo = lambda: delattr(selector, "select")

    def _on_loop(self, fn):
        future = asyncio.run_coroutine_threadsafe(_call(fn), self.loop)
        return future.result(10)

    def start(self) -> None:
        self.idle = 0.0
        self.t0 = time.perf_counter()
        self.cpu0 = self._on_loop(time.thread_time)

    def stop(self) -> None:
        self.cpu = self._on_loop(time.thread_time) - self.cpu0
        self.wall = time.perf_counter() - self.t0

    def undo(self) -> None:
        self._undo()


async def _call(fn):
    return fn()


# ---- the two runs ------------------------------------------------------------------------------
def random_prompts(vocab_size: int, w: Workload, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(w.input_len)] for _ in range(w.num_prompts)]


def run_offline(engine, prompts: list[list[int]], w: Workload, concurrency: int) -> float:
    """Step ``engine`` with ``concurrency`` requests in flight until every prompt is served;
    returns the wall time."""
    from ..sampling_params import SamplingParams
    params = SamplingParams(max_tokens=w.output_len, temperature=0.0, ignore_eos=True)
    todo, live = list(prompts), 0
    t0 = time.perf_counter()
    while todo or engine.has_unfinished:
        while todo and live < concurrency:
            engine.add_request(todo.pop(), params)
            live += 1
        for request in engine.step():
            engine.release(request)
            live -= 1
    return time.perf_counter() - t0


def level_phases(t: Timers, steps: int, loop: LoopClock | None = None) -> dict[str, float]:
    """The phases of one run in ms per engine step (``steps`` of them)."""
    w, c = t.wall, t.cpu
    ms = lambda x: round(1e3 * x / max(steps, 1), 3)  # noqa: E731
    forward = w["runner"] - w["prepare"]
    out = {
        "schedule": ms(w["schedule"]),
        "prepare (tensors)": ms(w["prepare"]),
        "forward": ms(forward),
        "  of which off-CPU (GIL, a core, OpenMP barrier)": ms(forward - (c["runner"] - c["prepare"])),
        "sampling": ms(w["execute"] - w["runner"]),
        "update (scheduler)": ms(w["update"] - w["detokenize"]),
        "detokenize": ms(w["detokenize"] + w["deltas"]),
        "engine step, other": ms(w["step"] - w["schedule"] - w["execute"] - w["update"] - w["deltas"]),
        "engine step, total": ms(w["step"]),
    }
    if loop is None:
        return out
    # The event loop's phases in CPU time: their wall time also holds the loop's own waits
    # for the GIL, which the engine thread holds meanwhile.
    loop_timed = c["http_parse"] + c["http_send"] + c["parse"] + c["sse"] + c["gate"]
    out.update({
        "admission (engine thread)": ms(w["admit"]),
        "publish outputs (engine thread)": ms(w["publish"]),
        "engine loop, other": ms(w["loop_step"] - w["step"] - w["publish"] + w["stats"]),
        "tokenization (tokenizer thread, CPU)": ms(c["tokenize"]),
        "HTTP parsing (h11, CPU)": ms(c["http_parse"]),
        "JSON parsing and checks (CPU)": ms(c["parse"]),
        "admission gate (CPU)": ms(c["gate"]),
        "SSE chunks (json, CPU)": ms(c["sse"]),
        "HTTP writes (h11 + socket, CPU)": ms(c["http_send"]),
        "event loop, other (asyncio, Starlette, streams; CPU)": ms(loop.cpu - loop_timed),
        "event loop CPU, total": ms(loop.cpu),
        "event loop busy (wall)": ms(loop.wall - loop.idle),
    })
    return out


def run_breakdown(model: str, w: Workload, use_vllm_client: bool = True, dtype: str = "float32") -> dict:
    """At each level of ``w``: offline, then online, one after the other
    (on a shared machine the load drifts: the runs compared are minutes apart, not the whole
    benchmark). Returns the report."""
    from .. import vllm_port
    from ..llm import LLM
    from ..server import AsyncEngine
    from ..server.background import BackgroundServer
    # Two engines on the same weights and settings: offline steps one from this thread, the server's
    # engine thread owns the other (an engine belongs to one thread).
    offline, llm = (LLM(model=model, dtype=dtype, enable_prefix_caching=False, max_model_len=2048,
                        num_blocks=NUM_BLOCKS) for _ in range(2))
    engine = llm.engine
    timers = Timers()
    time_engine(timers, offline.engine)
    time_engine(timers, engine)
    vocab = llm.runner.vocab_size
    python = None
    if use_vllm_client:
        with contextlib.suppress(vllm_port.VLLMUnavailable):
            python = vllm_port.find_python()[0]
    tokenizer = vllm_port.model_dir(model) if python is not None else None
    async_engine = AsyncEngine(llm, max_waiting=None)
    time_async_engine(timers, async_engine)
    server = BackgroundServer(async_engine, served_model_name=model)
    levels = []
    try:
        time_server(timers, server.app)
        run_offline(offline.engine, random_prompts(vocab, Workload(num_prompts=4, input_len=w.input_len,
                                                                   output_len=4), -1), w, 2)    # warm-up
        run_labkit_client(server.url, Workload(num_prompts=4, input_len=w.input_len, output_len=4), 2)  # warm-up
        clock = LoopClock(_loop_of(server))
        for c in w.levels:
            timers.reset()
            steps0 = offline.engine.num_steps
            wall = run_offline(offline.engine, random_prompts(vocab, w, w.seed), w, c)
            steps = offline.engine.num_steps - steps0
            level = {"concurrency": c, "offline": {"steps": steps, "wall_s": round(wall, 3), "load": _load1(),
                                                   "output_tok_per_s": round(w.num_prompts * w.output_len / wall, 1),
                                                   "phases": level_phases(timers, steps)}}
            timers.reset()
            steps0 = engine.num_steps
            clock.start()
            if python is not None:
                figures = run_vllm_client(python, server.url, model, tokenizer, w, c)
            else:
                figures = _client_in_child(server.url, w, c)
            clock.stop()
            steps = engine.num_steps - steps0
            level["online"] = {"steps": steps, "client": figures, "load": _load1(),
                               "phases": level_phases(timers, steps, clock)}
            levels.append(level)
            print(f"  concurrency {c} done", file=sys.stderr, flush=True)
        clock.undo()
    finally:
        server.stop()
        async_engine.shutdown()
        timers.undo()
    return {"model": model, "dtype": dtype, "workload": {"num_prompts": w.num_prompts, "input_len": w.input_len,
                                                         "output_len": w.output_len},
            "client": "vllm bench serve (text prompts)" if python is not None
            else "labkit.bench http in a child process (token-id prompts: no tokenization)",
            "load_before": os.getloadavg(), "levels": levels}


def _load1() -> float:
    """The 1-minute load average after a run (other work on the machine slows every figure)."""
    return round(os.getloadavg()[0], 2)


NUM_BLOCKS = 1024          # KV blocks of each engine: 16,384 tokens, for at most 32 x 160 in flight

def _loop_of(server) -> asyncio.AbstractEventLoop:
    """The event loop of a ``BackgroundServer``'s thread: its listening socket's asyncio
    ``Server`` knows it (``get_loop``)."""
    return server._server.servers[0].get_loop()     # noqa: SLF001 - uvicorn keeps it there


def _client_in_child(url: str, w: Workload, concurrency: int) -> dict:
    """labkit's client at ``concurrency``, in a child process: in this one it would share the
    server's GIL and distort what is measured."""
    import json
    import subprocess
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        code = ("import json, sys; from labkit.bench.http_vllm import Workload, run_labkit_client; "
                f"w = Workload(num_prompts={w.num_prompts}, input_len={w.input_len}, output_len={w.output_len}, "
                f"seed={w.seed}); json.dump(run_labkit_client({url!r}, w, {concurrency}), open({out!r}, 'w'))")
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        with open(out) as f:
            return json.load(f)


def format_breakdown(r: dict) -> str:
    """The report as one markdown table per level: each phase in ms per engine step, offline
    and in each online run."""
    w = r["workload"]
    lines = [f"{r['model']}, {r['dtype']}: {w['num_prompts']} prompts of {w['input_len']} random tokens, "
             f"{w['output_len']} output tokens each; client: {r['client']}; load before "
             f"{tuple(round(x, 2) for x in r['load_before'])}", ""]
    for lv in r["levels"]:
        runs = {"offline": lv["offline"], "online": lv["online"]}
        lines.append(f"**concurrency {lv['concurrency']}**: offline {lv['offline']['steps']} steps, "
                     f"{lv['offline']['output_tok_per_s']} tok/s (load after {lv['offline'].get('load')})")
        cl = lv["online"]["client"]
        lines.append(f"- online: {lv['online']['steps']} steps, {cl['output_tok_per_s']:.1f} tok/s, TTFT mean "
                     f"{cl['ttft_mean_ms']:.0f} ms, TPOT mean {cl['tpot_mean_ms']:.1f} ms (load after "
                     f"{lv['online'].get('load')})")
        lines += ["", "| ms per engine step | " + " | ".join(runs) + " |", "|---|" + "---|" * len(runs)]
        names = list(dict.fromkeys(k for run in runs.values() for k in run["phases"]))
        for name in names:
            cells = [run["phases"].get(name) for run in runs.values()]
            lines.append(f"| {name} | " + " | ".join("" if x is None else f"{x:.2f}" for x in cells) + " |")
        lines.append("")
    return "\n".join(lines)
