"""A code answer run again on its own: a bug-hunt test, from its source, in a clean sandbox.

A test's answer is its code. What the student's kernel reports that the test did (``probe``'s
outcomes) can be forged by any cell of the notebook: a replaced ``probe``, a patched
implementation, a kernel rewritten against labkit's grading. So for a grader marked ``rerun``
(chapter 2's bug hunt), once the kernel's report would pass, the grading process does not take
its word for it:

1. it reads the source the kernel handed in with the report (``probe.source_of``: the test's
   ``def`` and what it uses of the notebook: its helpers' source, imports, literal constants).
   A forged source is no gain: it is what gets run;
2. it reads that source as ``integrity`` reads a student's cells: a test that reaches for the
   machinery (closures, code objects, frames, ``gc``, the graders' internals, ``exec``, ...)
   reads the implementations instead of testing what they do. It fails, and is not run;
3. it runs the source in a fresh process in the class's sandbox (a scratch folder of its own,
   the notebook's limits, the guard): labkit's grader is imported there before the source is
   executed, the test's prints go nowhere, and the outcome comes back on a line marked with a
   nonce the test's code is never given;
4. it judges that run with the grader's ``judge``, as a kernel's report would have been.

A test that passes in its kernel and not here fails, flagged. What stays possible is in the
threat model (docs/grading.md): a test hidden from the static reading (a name assembled at run
time) that tells the implementations apart by their code still runs in the same process as
them, and can pass.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .checks import Check
from .guard import Guard
from .integrity import forbidden
from .judge import FAIL, MAX_BYTES, PASS, Verdict, judge
from .sandbox import Sandbox, kernel_env

#: Runs inside the sandbox: reads the job on stdin, runs the grader's probe on the test.
RUNNER = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
result = os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)
os.dup2(quiet, 2)
nonce = job.pop("nonce")


def report(value):
    result.write(nonce + json.dumps(value) + "\n")
    result.flush()
    os._exit(0)


try:
    import importlib
    module, name = job["grader"].split(":")
    probe = getattr(importlib.import_module(module), name).probe
except BaseException as e:
    report({"error": f"labkit's grader did not load ({type(e).__name__}: {e})"[:1000]})
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
try:
    exec(compile(job["source"], "<your test, run again>", "exec"), namespace)
    test = namespace[job["name"]]
except BaseException as e:
    report({"error": f"its source did not run on its own ({type(e).__name__}: {e})"[:1000]})
try:
    text = json.dumps({"ran": probe(test, plan=job["plan"])})
except BaseException as e:
    report({"error": f"it could not be run ({type(e).__name__}: {e})"[:1000]})
result.write(nonce + text + "\n")
result.flush()
os._exit(0)
"""

#: ``run(grader, source, name, plan)``: what the re-run did (a probe's outcomes), or why it has none.
Runner = Callable[[str, str, str, dict], "dict | str"]


def run_source(box: Sandbox, guard: Guard, workroot: Path | None, job: int, timeout: float,
               grader: str, source: str, name: str, plan: dict) -> dict | str:
    """Run ``source``'s function ``name`` under ``grader``'s probe (``module:function``) in a fresh
    process in ``box``, with ``plan``: the probe's outcomes, or a sentence saying why there are none."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{job}-again-", dir=workroot))
    watch = None
    try:
        box.prepare(workdir, job)
        if box.kind == "none":
            env = kernel_env(box.plan, home=str(workdir / "home"))
            cwd = workdir / "home" / "notebook"
            cwd.mkdir(parents=True)
        else:
            env, cwd = kernel_env(box.plan), workdir
        nonce = secrets.token_hex(16)
        request = json.dumps({"grader": grader, "source": source, "name": name, "plan": plan, "nonce": nonce})
        cmd = box.command([sys.executable, "-I", "-c", RUNNER], workdir, env, job)
        with open(workdir / "out", "wb") as out:               # (its size capped by the file-size rlimit)
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.DEVNULL, cwd=cwd,
                                    env=env if box.kind == "none" else None, start_new_session=True)
            watch = guard.watch(proc.pid, box.limits, workdir / "conn")
            try:
                proc.communicate(request.encode(), timeout=timeout)
            except subprocess.TimeoutExpired:
                return f"ran past the {timeout:g} s timeout"
            finally:
                for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass
                proc.wait()
                guard.forget(watch)
        if watch.reason:
            return f"was stopped: it {watch.reason}"
        path = workdir / "out"
        if path.stat().st_size > 2 * MAX_BYTES:
            return "printed too much"
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.startswith(nonce)]
        if len(lines) != 1:
            return f"ended without a result (exit status {proc.returncode})"
        said = json.loads(lines[0][len(nonce):])
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return f"could not be run ({type(e).__name__}: {e})"[:300]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if isinstance(said, dict) and isinstance(said.get("error"), str):
        return said["error"]
    if not isinstance(said, dict) or "ran" not in said:
        return "ended without a result"
    return said["ran"]


def again(check: Check, kernel: Verdict, handed: list[str], plan: dict, distributed_cells: list[str],
          graders: set[str], run: Runner | None) -> Verdict:
    """The verdict on ``check``'s code answer: ``kernel`` (the judge's, on what the kernel reported)
    unless it is a pass for a grader marked ``rerun``; then the verdict on the test run again on
    its own (module docstring). ``handed``: the kernel's answer texts, ``run``: how to run it."""
    if kernel.status != PASS or not getattr(check.function(), "rerun", False) or run is None:
        return kernel
    payload = json.loads(handed[0])                     # (read and checked by the judge already)
    source = payload.get("source")
    title = f"Exercise {check.exercise}"
    if not (isinstance(source, dict) and isinstance(source.get("source"), str) and isinstance(source.get("name"), str)):
        if isinstance(source, dict) and isinstance(source.get("error"), str):
            return Verdict(FAIL, f"{title}: your test could not be run again on its own: {source['error']}",
                           kernel.seen)
        return Verdict(FAIL, f"{title}: the test's source was not handed in, so it could not be run again on its own",
                       kernel.seen + ["handed in no source of its test"])
    name = source["name"][:80]
    reaches = forbidden([(0, source["source"])], distributed_cells, graders)
    if reaches:
        what = ", ".join(f"{u.how} {u.what}" for u in reaches[:3])
        return Verdict(FAIL, f"{title}: {name} {what}: it reads the implementations instead of testing what they do. "
                       "A test finds a flaw by what the implementation does.",
                       kernel.seen + [f"its test, run again on its own, {what}"])
    ran = run(check.grader, source["source"], source["name"], plan)
    if isinstance(ran, str):
        return Verdict(FAIL, f"{title}: {name}, run again on its own in a clean sandbox, {ran}",
                       kernel.seen + ["passed in its own kernel, not when run again on its own"])
    verdict = judge(check, [json.dumps({"exercise": check.exercise, "ran": ran})], plan)
    if verdict.status == PASS:
        return Verdict(PASS, verdict.hint, kernel.seen)
    return Verdict(verdict.status, f"run again on its own in a clean sandbox: {verdict.hint}",
                   kernel.seen + ["passed in its own kernel, not when run again on its own"])
