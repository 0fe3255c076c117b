"""``python -m labkit.bench gpu-check`` (``make gpu-check``): everything that needs a GPU, in one go.

On one CUDA GPU of compute capability 7.5+ (a T4 included), within a time budget
(``--budget``, 600 s), each step in its own process:

0. ``compile``: ``python -m labkit.bench gpu-compile --quick``, every Triton kernel built for
   sm_75, sm_80, sm_89 and sm_90 on the CI test's three shapes and checked against each GPU's
   limits (it needs no GPU itself: the full matrix, about 33 min of CPU, would not fit the
   step's cap on a T4 runtime's 2 cores; run it alone, anywhere).
1. ``tests``: the ``gpu``-marked tests (the Triton kernels compiled, against their torch
   references, split decode included).
2. ``kernels``: the kernel benchmark (``python -m labkit.bench kernels``): achieved bandwidth
   of the decode kernel, unsplit and split (flash-decoding), as a fraction of the device's
   measured copy bandwidth.
3. ``equality``: the engine on CUDA with the Triton backend, fp32, greedy, on requests of the
   bundled ``smollm2-64req`` workload, against Transformers ``generate`` on the same GPU and
   against the workload's reference tokens; the engine's throughput on all 64 requests; and
   the same requests in fp16 (a T4's default) against Transformers in fp16: how many agree
   token for token, and the share of tokens before the first difference.
4. ``notebooks``: chapters 5 and 6 (solutions) under ``pytest --nbval-lax``.

Then a short summary; ``--json`` prints it as JSON, ``--out FILE`` keeps it (docs/gpu.md
says where the figures go). Exit status 1 when a step failed or ran out of time.
Without a CUDA GPU it says so and exits 0: there is nothing to check.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the repository (tests/, solutions/)
STEPS = ("compile", "tests", "kernels", "equality", "notebooks")
# Each step's share of the budget at most (seconds); a step also stops at what is left.
STEP_CAPS = {"compile": 240, "tests": 120, "kernels": 120, "equality": 180, "notebooks": 240}
NOTEBOOKS = ("solutions/05_triton_kernel.ipynb", "solutions/06_end_to_end.ipynb")
KERNEL_SHAPES = ["--batch", "1", "8", "64", "256", "--context", "512", "2048", "8192", "--head-dim", "64", "128",
                 "--repeats", "10"]
EQUALITY_REQUESTS = 16                                   # every 4th request of the 64: all lengths


@dataclass(slots=True)
class StepResult:
    """One step of the check: passed / failed / skipped / timeout, its time and its figures."""

    name: str
    status: str
    seconds: float = 0.0
    summary: str = ""
    figures: dict = field(default_factory=dict)


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check (None when it can)."""
    import torch
    if not torch.cuda.is_available():
        return (f"no CUDA GPU on this machine (torch {torch.__version__}, CUDA build "
                f"{torch.version.cuda or 'none'}): nothing to check. Run it where an NVIDIA GPU of "
                "compute capability 7.5+ is at hand (docs/gpu.md). The compile check needs none: "
                "python -m labkit.bench gpu-compile")
    from labkit.kernels import MIN_COMPUTE_CAPABILITY
    if torch.cuda.get_device_capability() < MIN_COMPUTE_CAPABILITY:
        name, cc = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
        return (f"{name} has compute capability {cc[0]}.{cc[1]}; labkit's Triton kernels are built for 7.5+ "
                "(T4, A100, L4, H100...): the engine falls back to the torch backend there, and there is no "
                "kernel to check")
    return None


def child_env() -> dict[str, str]:
    """The steps' environment: the kernels compiled, never the interpreter."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env


def parse_pytest(output: str) -> dict[str, int]:
    """Counts from pytest's last line, e.g. ``3 failed, 40 passed, 2 skipped in 9.1s``."""
    counts = {}
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", output):
        counts["error" if word.startswith("error") else word] = int(n)
    return counts


def run_step(name: str, cmd: list[str], timeout: float) -> tuple[subprocess.CompletedProcess | StepResult, float]:
    """Run one step's process from the repository root: (its completed process, or the
    step's timeout result; seconds taken)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        took = time.perf_counter() - t0
        return StepResult(name, "timeout", took, f"still running after {timeout:.0f} s"), took
    return proc, time.perf_counter() - t0


def pytest_step(name: str, args: list[str], timeout: float) -> StepResult:
    proc, took = run_step(name, [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                                 *args], timeout)
    if isinstance(proc, StepResult):
        return proc
    counts = parse_pytest(proc.stdout)
    ok = proc.returncode == 0 or (proc.returncode == 5 and not counts.get("failed"))   # 5: nothing collected
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr.strip()[-300:]
    result = StepResult(name, "passed" if ok else "failed", took, last, counts)
    if not ok:
        result.figures["output_tail"] = proc.stdout[-3000:] + proc.stderr[-1000:]
    return result


def kernels_step(timeout: float) -> StepResult:
    proc, took = run_step("kernels", [sys.executable, "-m", "labkit.bench", "kernels", "--json", *KERNEL_SHAPES],
                          timeout)
    if isinstance(proc, StepResult):
        return proc
    if proc.returncode != 0:
        return StepResult("kernels", "failed", took, proc.stderr.strip()[-500:])
    figures = kernel_figures(json.loads(proc.stdout))
    return StepResult("kernels", "passed", took, describe_kernels(figures), figures)


def kernel_figures(bench: dict) -> dict:
    """The benchmark's headline: copy bandwidth, the best fraction of it the decode kernel
    reaches (unsplit, split), and what splitting buys at the smallest batch, longest context."""
    rows = [r for r in bench["results"] if "triton_ms" in r]
    figures = {"device": bench["meta"]["device"], "copy_gbps": bench["meta"]["copy_gbps"], "rows": rows}
    if rows:
        figures["best_of_copy"] = max(r["triton_of_copy"] for r in rows)
        figures["best_split_of_copy"] = max(r["split_of_copy"] for r in rows)
        small = min(rows, key=lambda r: (r["batch"], -r["context"], -r["head_dim"]))
        figures["split_speedup_small_batch"] = {"batch": small["batch"], "context": small["context"],
                                                "head_dim": small["head_dim"],
                                                "speedup": small["triton_ms"] / small["split_ms"]}
    return figures


def describe_kernels(f: dict) -> str:
    if "best_of_copy" not in f:
        return f"{f['device']}: no Triton timings (is the Triton backend available?)"
    s = f["split_speedup_small_batch"]
    return (f"{f['device']}: copy {f['copy_gbps']:.0f} GB/s; decode kernel at best {f['best_of_copy']:.0%} of it "
            f"(split {f['best_split_of_copy']:.0%}); split at batch {s['batch']}, context {s['context']}: "
            f"{s['speedup']:.1f}x")


def compile_step(timeout: float) -> StepResult:
    """``python -m labkit.bench gpu-compile --quick`` (the CI subset, about 190 builds, every core), summarised:
    the full matrix needs no GPU, and ~33 min of CPU would not fit STEP_CAPS["compile"] on 2 cores."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "compile.json")
        command = [sys.executable, "-m", "labkit.bench", "gpu-compile", "--quick", "--out", out]
        proc, took = run_step("compile", command, timeout)
        if isinstance(proc, StepResult):
            return proc
        if not os.path.exists(out):
            return StepResult("compile", "failed", took, proc.stderr.strip()[-800:])
        with open(out) as f:
            report = json.load(f)
    rows = report["builds"]
    figures = {"triton": report["meta"]["triton"], "entries": len(rows), "failures": report["failures"],
               "summary": report["summary"]}
    spills = sum(r["status"] == "spills" for r in rows)
    summary = (f"{len(rows)} kernel x GPU x dtype x shape builds (Triton {report['meta']['triton']}): "
               + (f"{len(report['failures'])} do not compile or launch" if report["failures"] else
                  f"all compile and fit their GPU; {spills} spill registers"))
    return StepResult("compile", "failed" if proc.returncode else "passed", took, summary, figures)


def equality_step(timeout: float) -> StepResult:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "equality.json")
        proc, took = run_step("equality", [sys.executable, "-m", "labkit.bench", "gpu-check", "--step", "equality",
                                           "--out", out], timeout)
        if isinstance(proc, StepResult):
            return proc
        if proc.returncode != 0 or not os.path.exists(out):
            return StepResult("equality", "failed", took, proc.stderr.strip()[-800:])
        with open(out) as f:
            figures = json.load(f)
    n = figures["requests"]
    ok = figures["labkit_equal_hf"] == n
    summary = (f"labkit (triton, fp32) = Transformers on {figures['labkit_equal_hf']}/{n} requests; "
               f"= reference: labkit {figures['labkit_equal_reference']}/{n}, Transformers "
               f"{figures['hf_equal_reference']}/{n}; whole workload: {figures['output_tok_per_s']:.0f} "
               f"output tok/s ({figures['all_equal_reference']}/{figures['all_requests']} equal to the reference); "
               f"fp16: {figures['fp16_labkit_equal_hf']}/{n} equal to Transformers fp16, "
               f"{figures['fp16_common_prefix']:.0%} of tokens before the first difference")
    return StepResult("equality", "passed" if ok else "failed", took, summary, figures)


def common_prefix(a: list[int], b: list[int]) -> int:
    """Tokens before the first difference of two outputs."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, float]:
    """(outputs equal token for token, share of all tokens before each pair's first difference)."""
    total = sum(len(b) for b in theirs)
    return sum(a == b for a, b in zip(ours, theirs)), sum(map(common_prefix, ours, theirs)) / max(1, total)


def run_equality(out: str, model: str = "smollm2-135m", device: str = "cuda", backend: str = "triton",
                 workload: str | None = None, num_requests: int = EQUALITY_REQUESTS) -> int:
    """The ``equality`` step's body, run in its own process on the GPU: ``num_requests`` of
    the workload (spread over it) through labkit and Transformers, then all of it through labkit;
    then the same requests in fp16 through both."""
    import types

    from labkit import LLM, SamplingParams
    from labkit.bench.serve import BUNDLED_DEFAULT, DATA_DIR, load_workload, run_hf_static, timed

    w = load_workload(workload or str(DATA_DIR / f"{BUNDLED_DEFAULT}.json"))
    reqs = w["requests"]
    subset = {"requests": reqs[::max(1, len(reqs) // num_requests)][:num_requests]}
    llm = LLM(model, attention_backend=backend, device=device, dtype="float32", enable_prefix_caching=False)

    def serve(rs: list[dict]) -> list[list[int]]:
        params = [SamplingParams(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True) for r in rs]
        return [o.outputs[0].token_ids for o in llm.generate([r["prompt_token_ids"] for r in rs], params,
                                                              use_tqdm=False)]

    ours = serve(subset["requests"])
    hf = run_hf_static(subset, types.SimpleNamespace(model=model, hf_batch_size=16, device=device))
    wall, everything = timed(lambda: serve(reqs))
    del llm
    llm = LLM(model, attention_backend=backend, device=device, dtype="float16", enable_prefix_caching=False)
    ours16 = serve(subset["requests"])
    hf16 = run_hf_static(subset, types.SimpleNamespace(model=model, hf_batch_size=16, device=device, dtype="float16"))
    fp16_equal, fp16_prefix = agreement(ours16, hf16["outputs"])
    reference = [r["reference_output_token_ids"] for r in subset["requests"]]
    figures = {"requests": len(ours), "backend": llm.stats()["attention_backend"],
               "labkit_equal_hf": sum(a == b for a, b in zip(ours, hf["outputs"])),
               "labkit_equal_reference": sum(a == b for a, b in zip(ours, reference)),
               "hf_equal_reference": sum(a == b for a, b in zip(hf["outputs"], reference)),
               "output_tok_per_s": sum(r["max_tokens"] for r in reqs) / wall,
               "all_equal_reference": sum(a == r["reference_output_token_ids"] for a, r in zip(everything, reqs)),
               "all_requests": len(reqs), "fp16_labkit_equal_hf": fp16_equal, "fp16_common_prefix": fp16_prefix}
    with open(out, "w") as f:
        json.dump(figures, f)
    return 0


def run_check(budget: float, steps: tuple[str, ...] = STEPS) -> list[StepResult]:
    """Every step in turn, each stopped at its cap or at what is left of ``budget``."""
    deadline = time.monotonic() + budget
    results = []
    for name in steps:
        left = deadline - time.monotonic()
        if left < 10:
            results.append(StepResult(name, "timeout", 0.0, "not started: the budget is spent"))
            continue
        timeout = min(STEP_CAPS[name], left)
        if name == "compile":
            results.append(compile_step(timeout))
        elif name == "tests":
            results.append(pytest_step(name, ["-m", "gpu", "tests/"], timeout))
        elif name == "kernels":
            results.append(kernels_step(timeout))
        elif name == "equality":
            results.append(equality_step(timeout))
        else:
            results.append(pytest_step(name, ["--nbval-lax", "--nbval-current-env", *NOTEBOOKS], timeout))
        r = results[-1]
        print(f"[gpu-check] {r.name}: {r.status} ({r.seconds:.0f} s) {r.summary}", file=sys.stderr)
    return results


def format_summary(device: str, results: list[StepResult]) -> str:
    lines = [f"gpu-check on {device}:"]
    for r in results:
        lines.append(f"  {r.name:<10} {r.status:<8} {r.seconds:6.0f} s  {r.summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m labkit.bench gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=600.0, help="seconds for all steps together (default 600)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {','.join(STEPS)}")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--out", help="also write the summary (JSON) to this file")
    p.add_argument("--step", choices=["equality"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step == "equality":
        return run_equality(args.out)
    steps = tuple(s.strip() for s in args.steps.split(",") if s.strip())
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        print(f"gpu-check: unknown step(s) {unknown}; choose from {', '.join(STEPS)}", file=sys.stderr)
        return 2
    reason = no_gpu_reason()
    if reason:
        print(f"gpu-check: {reason}")
        return 0
    import torch
    device = f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    results = run_check(args.budget, steps)
    report = {"device": device, "steps": [asdict(r) for r in results]}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report) if args.json else format_summary(device, results))
    return 0 if all(r.status in ("passed", "skipped") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
