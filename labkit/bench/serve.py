"""``python -m labkit.bench serve``: the real engine against its peers, same requests, one run.

Every engine gets the same token-id prompts and fixed output lengths (greedy, EOS ignored:
each request produces exactly its ``max_tokens``). Each engine runs in its own process so
that its peak memory is its own; model loading, compilation and a short warm-up are not
timed. Reported per engine: wall time, output tokens/s, total (prompt + output) tokens/s,
peak RSS, and how many requests' tokens equal the workload's reference tokens; then every
ratio between engines, all from the same run.

    python -m labkit.bench serve --engines labkit,hf-static --json
    python -m labkit.bench serve --engines labkit,hf-static,vllm --vllm-python .venv-vllm/bin/python
    python -m labkit.bench serve --engines labkit,vllm --dtype bfloat16 --vllm-python .venv-vllm/bin/python
    python -m labkit.bench serve --engines labkit,hf-static --contend

Engines: ``labkit``; ``labkit-numba`` (labkit with its C++ CPU kernels off,
``LABKIT_CPU_EXTENSION=0``: the Numba decode loop, unfused element-wise ops); ``hf-static``
(transformers ``generate`` on left-padded batches, ``--hf-batch-size``, default 16);
``hf-cb`` (transformers' own continuous batching, ``generate_batch``, when this transformers
has it); ``vllm`` (its CPU build lives in its own venv, ``make vllm-venv``, whose
``.venv-vllm`` is found; elsewhere pass its interpreter with ``--vllm-python PATH``).
``--python ENGINE=PATH`` runs any engine with another interpreter. An engine that fails is
reported as skipped, with the reason.

``--dtype float32|bfloat16`` goes to every engine (weights and KV cache). ``--kv-cache-dtype
auto|fp8|int8`` quantizes labkit's KV cache and vLLM's (its CPU build: fp8 with a per-tensor
scale, no int8: the engine is then skipped with the reason; ``labkit.vllm_port``;
``python -m labkit.bench kv-dtype`` runs them side by side with accuracy). ``--contend`` times
each engine a second time with one competing CPU-bound process running (a busy machine), and
reports quiet and contended throughput and the ratios under each.

Workloads: ``smollm2-64req`` (the default for the default model; bundled in
``labkit/bench/data/``: 64 chat-templated requests, 18,336 prompt and 9,588 output tokens,
with reference greedy tokens that Transformers and vLLM both reproduce in fp32);
``default`` generates 64 requests (prompts 16-512 tokens, outputs 16-256, seeded; the default
for other models); or a JSON file ``{"requests": [{"prompt_token_ids": [...], "max_tokens": N,
"reference_output_token_ids": [...] (optional)}, ...]}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ENGINES = ("labkit", "labkit-numba", "hf-static", "hf-cb", "vllm")
DTYPES = ("float32", "bfloat16")
DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_DEFAULT = "smollm2-64req"          # made for SmolLM2-135M-Instruct: its references are its tokens
VLLM_VENV_PYTHON = ".venv-vllm/bin/python"   # make vllm-venv; found without --vllm-python
DEFAULT_MODEL_NAMES = ("smollm2-135m", "smollm2", "smollm2-135m-instruct")
# A child run by another interpreter (vLLM's venv) loads this file by path, with nothing of
# labkit importable there, from a scratch directory: the repository root holds `kernels/`,
# which transformers would take for Hugging Face's package of that name.
_CHILD_BOOT = ("import importlib.util, sys; "
               "spec = importlib.util.spec_from_file_location('labkit_bench_serve_child', sys.argv[1]); "
               "m = importlib.util.module_from_spec(spec); sys.modules[spec.name] = m; "
               "spec.loader.exec_module(m); sys.exit(m.main(sys.argv[2:]))")


# ---- workloads -------------------------------------------------------------------------
def default_workload(model: str = "smollm2-135m", num_requests: int = 64, seed: int = 0,
                     prompt_range=(16, 512), output_range=(16, 256)) -> dict:
    """Chat-templated prompts of seeded random lengths, built from real text so the model
    sees language, not noise. Lengths are uniform in the given ranges (in tokens)."""
    from ..model import load_model
    tok = load_model(model).tokenizer
    rng = random.Random(seed)
    words = ("the memory of a server holds keys and values for every token it has seen so far "
             "and a scheduler decides at each step which requests may run while others wait "
             "paging splits that memory into blocks like an operating system splits its pages").split()
    requests = []
    for i in range(num_requests):
        target = rng.randint(*prompt_range)
        text = " ".join(rng.choice(words) for _ in range(target))
        msgs = [{"role": "user", "content": f"Request {i}: continue this text. {text}"}]
        ids = list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        if len(ids) > target:      # keep the template's head and tail, trim the middle text
            head, tail = ids[:8], ids[-6:]
            ids = head + ids[8:len(ids) - 6][: max(0, target - 14)] + tail
        requests.append({"id": i, "prompt_token_ids": ids, "max_tokens": rng.randint(*output_range)})
    return {"description": f"default workload: {num_requests} requests, seed {seed}", "seed": seed,
            "requests": requests}


def load_workload(path: str) -> dict:
    with open(path) as f:
        w = json.load(f)
    if not isinstance(w, dict) or not isinstance(w.get("requests"), list) or not w["requests"]:
        raise ValueError(f"{path}: expected a JSON object with a non-empty 'requests' list")
    for i, r in enumerate(w["requests"]):
        if not r.get("prompt_token_ids") or int(r.get("max_tokens", 0)) < 1:
            raise ValueError(f"{path}: request {i} needs prompt_token_ids and max_tokens >= 1")
    return w


def bundled_workloads() -> list[str]:
    """Names of the workloads shipped in ``labkit/bench/data/`` (``--workload NAME``)."""
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def resolve_workload(name: str | None, model: str) -> str:
    """What ``--workload`` names: ``"default"`` (generate one), or the path of a JSON file.

    None means the documented default: the bundled ``smollm2-64req`` for the default model
    (its reference tokens are that model's), a generated workload for any other.
    """
    if name is None:
        name = BUNDLED_DEFAULT if model in DEFAULT_MODEL_NAMES else "default"
    if name == "default" or os.path.isfile(name):
        return name
    if name in bundled_workloads():
        return str(DATA_DIR / f"{name}.json")
    raise ValueError(f"no workload {name!r}: not a file, nor 'default', nor one of the bundled "
                     f"{', '.join(bundled_workloads())}")


# ---- engines (each runs in a child process) ---------------------------------------------
@dataclass(slots=True)
class Prepared:
    """An engine loaded and warmed up: ``serve()`` runs the whole workload once and returns
    each request's output token ids, in workload order. ``after`` says what the engine saw
    once the runs are over (labkit: its preemptions); ``close`` releases what it holds."""

    serve: Callable[[], list[list[int]]]
    version: str
    config: str
    after: Callable[[], str] | None = None
    close: Callable[[], None] | None = None


def _dtype(args) -> str:
    return getattr(args, "dtype", None) or "float32"


def prepare_labkit(w: dict, args) -> Prepared:
    from labkit import LLM, SamplingParams
    import labkit
    kv_cache_dtype = getattr(args, "kv_cache_dtype", None) or "auto"
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, kv_cache_memory=int(args.kv_gib * 2**30), dtype=_dtype(args),
              kv_cache_dtype=kv_cache_dtype)
    reqs = w["requests"]
    prompts = [r["prompt_token_ids"] for r in reqs]
    logprobs = getattr(args, "logprobs", None)
    params = [SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True,
                             logprobs=logprobs) for r in reqs]
    llm.runner.kv_cache.populate()     # pages in now, as vLLM's zero-filled cache has them: not timed below
    warm = prompts[:4]
    llm.generate(warm, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * len(warm), use_tqdm=False)

    def serve() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return Prepared(serve, labkit.__version__,
                    f"{_dtype(args)}{'' if kv_cache_dtype == 'auto' else ', KV ' + kv_cache_dtype}, "
                    f"{llm.stats()['attention_backend']} attention, block 16, max_num_seqs "
                    f"{args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}"
                    + (f", logprobs {logprobs}" if logprobs is not None else ""),
                    after=lambda: f"preemptions {llm.stats()['num_preemptions']}")


def prepare_labkit_numba(w: dict, args) -> Prepared:
    """labkit with its C++ CPU kernels switched off (``LABKIT_CPU_EXTENSION=0``, in this child
    process only): the Numba decode loop and the unfused torch element-wise ops. Beside
    ``labkit`` in one run, it measures what the C++ kernels bring."""
    os.environ["LABKIT_CPU_EXTENSION"] = "0"
    return prepare_labkit(w, args)


def _hf_model(args):
    import torch
    from labkit.model import load_model
    loaded = load_model(args.model)
    model = loaded.hf_model(getattr(torch, _dtype(args))).to(getattr(args, "device", None) or "cpu")
    return model, loaded.tokenizer


def prepare_hf_static(w: dict, args) -> Prepared:
    import torch
    import transformers
    model, tok = _hf_model(args)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    reqs = w["requests"]
    bs = args.hf_batch_size

    def run_batch(batch):
        width = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):           # left padding: every prompt ends at the same column
            p = r["prompt_token_ids"]
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config = copy.deepcopy(model.generation_config)
        # EOS ignored as ignore_eos does: it may be generated, it does not stop the batch.
        # (min_new_tokens would forbid it instead, and change the tokens.)
        config.update(eos_token_id=[], max_new_tokens=max(int(r["max_tokens"]) for r in batch),
                      do_sample=False, pad_token_id=pad)
        with torch.no_grad():
            y = model.generate(ids.to(model.device), attention_mask=mask.to(model.device), generation_config=config)
        return [y[i, width:width + int(r["max_tokens"])].tolist() for i, r in enumerate(batch)]

    def serve() -> list[list[int]]:
        return [out for s in range(0, len(reqs), bs) for out in run_batch(reqs[s:s + bs])]

    run_batch(reqs[:2])                       # warm-up
    return Prepared(serve, transformers.__version__,
                    f"generate, static batches of {bs}, left padding, {_dtype(args)}, sdpa")


def prepare_hf_cb(w: dict, args) -> Prepared:
    import torch
    import transformers
    from transformers import GenerationConfig
    model, tok = _hf_model(args)
    if not hasattr(model, "generate_batch"):
        raise RuntimeError(f"transformers {transformers.__version__} has no generate_batch")
    reqs = w["requests"]
    longest = max(int(r["max_tokens"]) for r in reqs)
    cfg = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           eos_token_id=-1, pad_token_id=tok.pad_token_id or 0, use_cuda_graph=False,
                           num_blocks=args.hf_cb_blocks, block_size=256, max_batch_tokens=args.max_num_batched_tokens)

    def serve() -> list[list[int]]:
        with torch.no_grad():
            res = model.generate_batch(inputs=[r["prompt_token_ids"] for r in reqs], generation_config=cfg,
                                       progress_bar=False)
        by_id = {key: list(out.generated_tokens) for key, out in res.items()}
        keys = sorted(by_id, key=lambda k: int(str(k).rsplit("_", 1)[-1]))
        # generate_batch has one max_new_tokens for all: it computes every request to the longest
        # length. Only each request's own max_tokens count as output.
        return [by_id[k][: int(r["max_tokens"])] for k, r in zip(keys, reqs)]

    return Prepared(serve, transformers.__version__,
                    f"generate_batch (continuous batching), {_dtype(args)}, every request run to {longest} tokens")


def prepare_vllm(w: dict, args) -> Prepared:
    """vLLM's offline ``LLM`` with its CPU defaults, except prefix caching (off, as labkit's
    here: a timed run repeated under contention must not hit the first run's cache)."""
    # Its CPU settings (every core bound, KV space in GiB) come in this process's environment:
    # child_env("vllm") sets them, with labkit/vllm_port.py's rule.
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(f"vllm is not importable by {sys.executable} ({e}); its CPU build lives in its own "
                           "venv: make vllm-venv, then --vllm-python .venv-vllm/bin/python "
                           "(docs/benchmarks.md)") from None
    from vllm import LLM as VLLM, SamplingParams as VSP
    if not args.model_dir:
        raise RuntimeError("vllm needs the model's checkpoint directory (--model-dir)")
    kv_cache_dtype = getattr(args, "kv_cache_dtype", None) or "auto"     # vLLM's name: the parent mapped it
    llm = VLLM(args.model_dir, dtype=_dtype(args), max_model_len=2048, seed=0, enable_prefix_caching=False,
               kv_cache_dtype=kv_cache_dtype)
    reqs = w["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [VSP(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)

    def serve() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    # Without an explicit shutdown its ~6 GB of worker processes outlive this one.
    return Prepared(serve, vllm.__version__,
                    f"{_dtype(args)}{'' if kv_cache_dtype == 'auto' else ', kv_cache_dtype ' + kv_cache_dtype}, "
                    "V1 engine defaults, prefix caching off, "
                    f"VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(vLLM default)')}, "
                    f"VLLM_CPU_KVCACHE_SPACE={os.environ.get('VLLM_CPU_KVCACHE_SPACE', '(vLLM default)')}",
                    close=llm.llm_engine.engine_core.shutdown)


PREPARERS = {"labkit": prepare_labkit, "labkit-numba": prepare_labkit_numba, "hf-static": prepare_hf_static,
             "hf-cb": prepare_hf_cb, "vllm": prepare_vllm}


@contextlib.contextmanager
def contention(active: bool = True):
    """One competing CPU-bound process (a Python busy loop) for as long as the block runs:
    what a student's laptop with a browser or a build running looks like to the engine."""
    if not active:
        yield
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def tree_rss_mib() -> float | None:
    """Resident memory of this process and all its descendants, summed, in MiB (vLLM serves
    from worker processes that ru_maxrss does not see); None without psutil."""
    try:
        import psutil
    except ImportError:
        return None
    me = psutil.Process()
    total = 0
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total / 2**20


def timed(serve: Callable[[], list[list[int]]], contend: bool = False) -> tuple[float, list[list[int]]]:
    """(wall seconds, outputs) of one run of the workload, quiet or under contention."""
    with contention(contend):
        t0 = time.perf_counter()
        outputs = serve()
        return time.perf_counter() - t0, outputs


def run_hf_static(w: dict, args) -> dict:
    """One timed run of transformers' static batching (chapter 6 calls it): wall_s, outputs."""
    prepared = prepare_hf_static(w, args)
    wall, outputs = timed(prepared.serve)
    return {"wall_s": wall, "outputs": outputs, "version": prepared.version, "config": prepared.config}


def _child(args) -> int:
    w = load_workload(args.workload)
    result: dict = {}
    prepared = None
    try:
        prepared = PREPARERS[args.child](w, args)
        result.update(version=prepared.version, config=prepared.config)
        result["wall_s"], result["outputs"] = timed(prepared.serve)
        if args.contend:
            result["contended_wall_s"], result["contended_outputs"] = timed(prepared.serve, contend=True)
        if prepared.after is not None:
            result["config"] += f", {prepared.after()}"
        result["rss_tree_mib"] = tree_rss_mib()         # before close: vLLM's workers still live
    except Exception as e:           # reported as a skipped engine, with the reason
        result = {"skipped": f"{type(e).__name__}: {e}"}
    finally:
        if prepared is not None and prepared.close is not None:
            prepared.close()
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # vLLM serves from worker processes: the largest of them, once they have exited.
    result["peak_rss_children_mib"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


# ---- the comparison ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default=None,
                   help=f"a bundled workload ({', '.join(bundled_workloads())}), 'default' (generated) or a "
                        f"JSON file; default: {BUNDLED_DEFAULT} for the default model, else 'default'")
    p.add_argument("--engines", default="labkit,hf-static", help=f"comma-separated, from {','.join(ENGINES)}")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and KV cache, for every engine")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the --dtype), fp8 or int8: labkit's quantized KV cache, and vLLM's nearest "
                        "(labkit.vllm_port.vllm_kv_cache_dtype; its CPU build has fp8 only)")
    p.add_argument("--vllm-python", metavar="PATH", default=None,
                   help="the interpreter of vLLM's venv (make vllm-venv: .venv-vllm/bin/python)")
    p.add_argument("--python", metavar="ENGINE=PATH", action="append", default=[],
                   help="run ENGINE's process with this interpreter (repeatable)")
    p.add_argument("--contend", action="store_true",
                   help="also time each engine with one competing CPU-bound process running")
    p.add_argument("--num-requests", type=int, default=64, help="for the generated workload")
    p.add_argument("--seed", type=int, default=0, help="for the generated workload")
    p.add_argument("--save-workload", default=None, help="write the workload used to this file")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0, help="KV cache size of labkit and of vLLM")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-cb-blocks", type=int, default=200)
    p.add_argument("--logprobs", type=int, default=None,
                   help="labkit only: ask every request for its top-K log-probabilities (what they cost)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def interpreters(args, engines: list[str]) -> dict[str, str]:
    """Which engines run under another interpreter: ``{engine: path}`` from ``--python`` and
    ``--vllm-python``, else ``.venv-vllm`` for vllm when it is not importable here. Raises
    ValueError naming the problem (bad form, unknown engine, no such file), and when vllm is
    asked for with neither an interpreter for it nor vllm importable here."""
    chosen: dict[str, str] = {}
    for item in args.python:
        engine, sep, path = item.partition("=")
        if not sep or not engine or not path:
            raise ValueError(f"--python {item!r}: expected ENGINE=PATH, e.g. vllm=.venv-vllm/bin/python")
        if engine not in ENGINES:
            raise ValueError(f"--python {item!r}: unknown engine {engine!r}; choose from {', '.join(ENGINES)}")
        chosen[engine] = path
    if args.vllm_python:
        chosen["vllm"] = args.vllm_python
    for engine, path in chosen.items():
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ValueError(f"the interpreter for {engine}, {path!r}, is not an executable file"
                             + (" (make vllm-venv builds .venv-vllm/bin/python)" if engine == "vllm" else ""))
    if "vllm" in engines and "vllm" not in chosen and importlib.util.find_spec("vllm") is None:
        from ..vllm_port import find_venv_python        # where make vllm-venv puts it
        venv = find_venv_python(VLLM_VENV_PYTHON)
        if venv is not None:
            chosen["vllm"] = venv
            return chosen
        raise ValueError("engine vllm: vllm is not importable here and no --vllm-python was given. Its CPU "
                         "build lives in its own venv: make vllm-venv, then add --vllm-python "
                         ".venv-vllm/bin/python (docs/benchmarks.md)")
    return chosen


def model_dir(model: str) -> str:
    """The checkpoint directory an engine outside labkit (vLLM) loads ``model`` from."""
    if os.path.isdir(os.path.expanduser(model)):
        return os.path.expanduser(model)
    if model in DEFAULT_MODEL_NAMES:
        from ..model.loader import fetch_default_model
        return str(fetch_default_model(quiet=True))
    raise ValueError(f"model {model!r} has no checkpoint directory for vllm; give one (or the default model)")


def child_command(engine: str, python: str | None, args, workload: str, out: str) -> list[str]:
    """The command line of ``engine``'s process: this interpreter runs ``-m labkit.bench``;
    another one (where labkit need not be installed) loads this file by its path."""
    rest = ["--child", engine, "--out", out, "--workload", workload, "--model", args.model,
            "--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-gib", str(args.kv_gib),
            "--hf-batch-size", str(args.hf_batch_size), "--hf-cb-blocks", str(args.hf_cb_blocks)]
    kv_cache_dtype = getattr(args, "kv_cache_dtype", "auto")
    if kv_cache_dtype != "auto":      # vLLM gets its own name for it (ValueError where it has none)
        if engine == "vllm":
            from ..vllm_port import vllm_kv_cache_dtype
            kv_cache_dtype = vllm_kv_cache_dtype(kv_cache_dtype, cpu=True)
        rest += ["--kv-cache-dtype", kv_cache_dtype]
    if args.model_dir:
        rest += ["--model-dir", args.model_dir]
    if args.logprobs is not None:
        rest += ["--logprobs", str(args.logprobs)]
    if args.contend:
        rest += ["--contend"]
    if python is None:
        return [sys.executable, "-m", "labkit.bench", "serve", *rest]
    return [python, "-c", _CHILD_BOOT, str(Path(__file__).resolve()), *rest]


def child_env(engine: str, kv_gib: float = 2.0) -> dict[str, str]:
    """The environment of ``engine``'s process. The peers run with their own OpenMP settings,
    as their users run them: the ``GOMP_SPINCOUNT`` that ``import labkit`` set in this process
    (labkit/openmp.py) is not passed on to them, and Transformers' children, which import
    labkit (this file) before torch, are told not to set it again. vLLM's also gets its CPU
    settings, as chapter 6 runs it (``vllm_port.vllm_env``: every core bound, ``kv_gib`` of
    KV cache), unless the caller set them."""
    from labkit import openmp
    if engine == "vllm":
        from ..vllm_port import vllm_env
        env = vllm_env(kv_gib)
    else:
        env = dict(os.environ)
    if not engine.startswith("labkit"):
        if openmp.set_by_labkit is not None and env.get("GOMP_SPINCOUNT") == openmp.set_by_labkit:
            del env["GOMP_SPINCOUNT"]
        env["LABKIT_GOMP_SPINCOUNT"] = "default"
    return env


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two outputs share (where greedy decoding first diverged)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def score(result: dict, reqs: list[dict], reference: list[list[int]] | None) -> None:
    """Add rates and agreement with the reference to one engine's result, in place."""
    if "wall_s" not in result:
        return
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
    output_tokens = sum(int(r["max_tokens"]) for r in reqs)
    for prefix in ("", "contended_"):
        if f"{prefix}wall_s" not in result:
            continue
        result[f"{prefix}output_tok_per_s"] = output_tokens / result[f"{prefix}wall_s"]
        result[f"{prefix}total_tok_per_s"] = (prompt_tokens + output_tokens) / result[f"{prefix}wall_s"]
        outputs = result.pop(f"{prefix}outputs")
        if reference:
            result[f"{prefix}requests_matching_reference"] = sum(a == b for a, b in zip(outputs, reference))
            if not prefix:   # how far apart: output tokens generated before the first divergence
                result["tokens_before_first_divergence"] = sum(map(common_prefix, outputs, reference))
    if "contended_output_tok_per_s" in result:
        result["contended_over_quiet"] = result["contended_output_tok_per_s"] / result["output_tok_per_s"]


def ratios(results: dict[str, dict], key: str = "output_tok_per_s") -> dict[str, float]:
    """``{"a/b": rate_a / rate_b}`` for every pair of engines that ran, a listed before b."""
    ran = [e for e, r in results.items() if key in r]
    return {f"{a}/{b}": results[a][key] / results[b][key] for i, a in enumerate(ran) for b in ran[i + 1:]}


def build_report(w: dict, source: str, results: dict[str, dict], args, load_before: tuple | None) -> dict:
    """Score every engine against the workload's reference tokens (or labkit's, when the
    workload has none) and put every ratio of the run in one report."""
    reqs = w["requests"]
    reference = [r.get("reference_output_token_ids") for r in reqs]
    reference_source = "workload"
    if not all(reference):
        reference, reference_source = results.get("labkit", {}).get("outputs"), "labkit"
    for r in results.values():
        score(r, reqs, reference)
    report = {"workload": {"source": source, "requests": len(reqs),
                           "prompt_tokens": sum(len(r["prompt_token_ids"]) for r in reqs),
                           "output_tokens": sum(int(r["max_tokens"]) for r in reqs),
                           "reference": reference_source if reference else None},
              "dtype": args.dtype,
              "machine": {"cpus": os.cpu_count(), "cpu": _cpu_model(), "torch_threads": _torch_threads(),
                          "load_average_before": load_before},
              "engines": results,
              "ratios": ratios(results)}
    if args.contend:
        contended = ratios(results, "contended_output_tok_per_s")
        report["ratios_contended"] = contended
        report["ratio_change_under_contention"] = {k: contended[k] / v - 1 for k, v in report["ratios"].items()
                                                   if k in contended}
    return report


def format_report(report: dict) -> str:
    """The report as a table for a terminal."""
    wl, m = report["workload"], report["machine"]
    contend = "ratios_contended" in report
    lines = [f"workload {wl['source']}: {wl['requests']} requests, {wl['prompt_tokens']} prompt + "
             f"{wl['output_tokens']} output tokens; {report['dtype']}; {m['cpus']} CPUs ({m['cpu']}), "
             f"load average before {m['load_average_before']}", ""]
    head = f"{'engine':<12} {'version':<16} {'wall s':>8} {'out tok/s':>10} {'equal':>7} {'RSS MiB':>8}"
    lines.append(head + (f" {'contended tok/s':>16} {'x quiet':>8}" if contend else ""))
    for name, r in report["engines"].items():
        if "wall_s" not in r:
            lines.append(f"{name:<12} skipped: {r.get('skipped', '?')}")
            continue
        equal = f"{r['requests_matching_reference']}/{wl['requests']}" if "requests_matching_reference" in r else "-"
        rss = max(r.get("peak_rss_mib", 0), r.get("peak_rss_children_mib", 0), r.get("rss_tree_mib") or 0)
        line = (f"{name:<12} {str(r.get('version', '?'))[:16]:<16} {r['wall_s']:>8.1f} {r['output_tok_per_s']:>10.1f} "
                f"{equal:>7} {rss:>8.0f}")
        if "contended_output_tok_per_s" in r:
            line += f" {r['contended_output_tok_per_s']:>16.1f} {r['contended_over_quiet']:>8.2f}"
        lines.append(line)
    lines.append("")
    for key, title in (("ratios", "ratios (output tok/s, this run)"),
                       ("ratios_contended", "ratios under contention")):
        if report.get(key):
            lines.append(f"{title}: " + ", ".join(f"{k} {v:.2f}x" for k, v in report[key].items()))
    if report.get("ratio_change_under_contention"):
        lines.append("change under contention: " + ", ".join(
            f"{k} {v:+.1%}" for k, v in report["ratio_change_under_contention"].items()))
    for name, r in report["engines"].items():
        if "config" in r:
            lines.append(f"  {name}: {r['config']}")
    return "\n".join(lines)


def run_child(cmd: list[str], capture: bool, cwd: str | None, env: dict | None = None) -> tuple[int, str]:
    """Run one engine's process in a process group of its own and take the whole group down
    when it ends, however this one ends (Ctrl-C, SIGTERM, an exception): vLLM's engine and
    worker processes, ~6 GB, must never outlive the benchmark. Returns (exit status, what it
    printed when ``capture``). A child's results go to its --out file; what it prints (vLLM
    logs to stdout) goes to our stderr, or when captured into a skipped engine's reason."""
    # A file, not a pipe: a process left behind holding a pipe's end open would make us wait
    # for it instead of ending it.
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log if capture else sys.stderr,
                                stderr=subprocess.STDOUT if capture else None, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            proc.wait()
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)          # whatever the child left behind
            proc.wait()
        log.seek(0)
        return proc.returncode, log.read()


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)       # unwinds through run_child's cleanup


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _child(args)
    if threading.current_thread() is not threading.main_thread():
        return compare(args)
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        return compare(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def compare(args) -> int:
    """The comparison: every engine in turn, each in its own process, then one report."""
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        print(f"unknown engine(s) {unknown}; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    try:
        pythons = interpreters(args, engines)
        source = args.workload or (BUNDLED_DEFAULT if args.model in DEFAULT_MODEL_NAMES else "default")
        workload = resolve_workload(args.workload, args.model)
        if "vllm" in engines:
            args.model_dir = model_dir(args.model)
    except ValueError as e:
        print(f"bench serve: {e}", file=sys.stderr)
        return 2
    load_before = tuple(round(x, 2) for x in os.getloadavg()) if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory() as tmp:
        if workload == "default":
            w = default_workload(args.model, args.num_requests, args.seed)
            workload = os.path.join(tmp, "workload.json")
            with open(workload, "w") as f:
                json.dump(w, f)
        else:
            w = load_workload(workload)
        if args.save_workload:
            with open(args.save_workload, "w") as f:
                json.dump(w, f)
        results = {}
        for engine in engines:
            out = os.path.join(tmp, f"{engine}.json")
            try:
                cmd = child_command(engine, pythons.get(engine), args, os.path.abspath(workload), out)
            except ValueError as e:     # e.g. a kv_cache_dtype this engine does not have
                results[engine] = {"skipped": str(e)}
                continue
            print(f"[bench serve] running {engine}{' with ' + pythons[engine] if engine in pythons else ''} ...",
                  file=sys.stderr)
            returncode, printed = run_child(cmd, capture=args.json, cwd=tmp if engine in pythons else None,
                                            env=child_env(engine, args.kv_gib))
            if returncode != 0 or not os.path.exists(out):
                results[engine] = {"skipped": f"process exited with {returncode} {printed[-500:]}".strip()}
                continue
            with open(out) as f:
                results[engine] = json.load(f)
    report = build_report(w, source, results, args, load_before)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def _torch_threads() -> int | None:
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
