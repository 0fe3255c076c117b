"""``python -m labkit.bench kv-dtype``: the quantized KV cache against the unquantized one, in one run.

For each ``--kv-dtypes`` value ("auto": the model's dtype, "int8", "fp8": labkit/kernels/kv_quant.py)
on the same workload (default: the bundled 64 requests, greedy, EOS ignored):

* **throughput**: each engine serves the whole workload once per KV cache dtype, each run in a
  process of its own (``python -m labkit.bench serve``'s children: load, compile and warm-up
  not timed), output tokens/s and the ratio to the same engine's "auto" run. ``--engines
  labkit,vllm`` adds vLLM's CPU build with its nearest KV cache (``labkit.vllm_port.
  vllm_kv_cache_dtype``: "fp8" with a per-tensor scale; it has no int8, reported as skipped);
* **greedy agreement**: how many requests' tokens equal the same engine's "auto" run (and the
  workload's reference tokens), and how many output tokens come before the first divergence;
* **logit distance** (labkit): every request's prompt and reference output teacher-forced in one
  pass through a runner with each KV cache dtype, the logits at every output position compared
  with the "auto" runner's: the largest |difference| (and relative to the largest logit), the
  mean of each position's largest, KL(auto || quantized) per position (mean and max), and how
  often the argmax agrees. ``--logit-requests N`` uses the first N requests (0: none).

    python -m labkit.bench kv-dtype                                   # labkit: auto, int8, fp8
    python -m labkit.bench kv-dtype --engines labkit,vllm --json      # and vLLM-CPU's fp8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from . import serve as S

KV_DTYPES = ("auto", "int8", "fp8")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench kv-dtype", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv-dtypes", default=",".join(KV_DTYPES), help="comma-separated, from auto,int8,fp8 "
                                                                     "(the first is the baseline: auto)")
    p.add_argument("--engines", default="labkit", help="comma-separated, from labkit,vllm")
    p.add_argument("--workload", default=None, help="as python -m labkit.bench serve takes it (default: "
                                                    f"{S.BUNDLED_DEFAULT} for the default model)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", choices=S.DTYPES, default="float32", help="weights (and the 'auto' KV cache)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-gib", type=float, default=2.0)
    p.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: .venv-vllm when present)")
    p.add_argument("--requests", type=int, default=None, help="only the workload's first N requests (a quick look)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: each engine runs its KV cache dtypes in turn, R times (on a busy machine the "
                        "load drifts: interleaved rounds and the best of them keep the ratios fair)")
    p.add_argument("--logit-requests", type=int, default=64, help="requests teacher-forced for the logit "
                                                                  "distance (0: skip it)")
    p.add_argument("--json", action="store_true")
    return p


def _serve_args(args, kv_dtype: str) -> argparse.Namespace:
    """The options of ``bench serve`` that its children read, for one KV cache dtype."""
    return S.build_parser().parse_args([
        "--model", args.model, "--dtype", args.dtype, "--kv-cache-dtype", kv_dtype,
        "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-gib", str(args.kv_gib), *(["--vllm-python", args.vllm_python] if args.vllm_python else [])])


def throughput(args, engines: list[str], kv_dtypes: list[str], workload: str, w: dict) -> dict:
    """``{engine: {kv_dtype: result}}``: wall time (the best of ``--repeat`` interleaved rounds;
    every round's in ``wall_s_rounds``), output tokens/s and outputs of each run, or ``skipped``
    with the reason."""
    results: dict[str, dict] = {}
    base = _serve_args(args, "auto")
    pythons = S.interpreters(base, engines)
    model_dir = S.model_dir(args.model) if "vllm" in engines else None
    output_tokens = sum(int(r["max_tokens"]) for r in w["requests"])
    with tempfile.TemporaryDirectory() as tmp:
        for engine in engines:
            results[engine] = {}
            for round_ in range(max(1, args.repeat)):
                for kv in kv_dtypes:
                    if "skipped" in results[engine].get(kv, {}):
                        continue
                    sargs = _serve_args(args, kv)
                    sargs.model_dir = model_dir
                    out = os.path.join(tmp, f"{engine}-{kv}-{round_}.json")
                    try:
                        cmd = S.child_command(engine, pythons.get(engine), sargs, os.path.abspath(workload), out)
                    except ValueError as e:         # vLLM's CPU build: no int8
                        results[engine][kv] = {"skipped": str(e)}
                        continue
                    print(f"[bench kv-dtype] {engine}, kv_cache_dtype {kv}, round {round_ + 1} ...", file=sys.stderr)
                    code, printed = S.run_child(cmd, capture=args.json, cwd=tmp if engine in pythons else None,
                                                env=S.child_env(engine, args.kv_gib))
                    if code != 0 or not os.path.exists(out):
                        results[engine][kv] = {"skipped": f"process exited with {code} {printed[-500:]}".strip()}
                        continue
                    with open(out) as f:
                        r = json.load(f)
                    if "wall_s" not in r:
                        results[engine][kv] = r
                        continue
                    best = results[engine].setdefault(kv, {**r, "wall_s_rounds": []})
                    best["wall_s_rounds"].append(r["wall_s"])
                    best["wall_s"] = min(best["wall_s_rounds"])
                    best["output_tok_per_s"] = output_tokens / best["wall_s"]
    return results


def agreement(outputs: list[list[int]], baseline: list[list[int]]) -> dict:
    """Requests whose tokens equal the baseline's, and output tokens before the first divergence."""
    return {"requests_equal": sum(a == b for a, b in zip(outputs, baseline, strict=True)),
            "tokens_before_first_divergence": sum(map(S.common_prefix, outputs, baseline)),
            "output_tokens": sum(len(b) for b in baseline)}


def logit_distance(args, kv_dtypes: list[str], w: dict) -> dict:
    """Per quantized KV cache dtype, its logits against the "auto" cache's with every request's
    prompt and reference output teacher-forced in one pass (one runner per dtype, the same weights)."""
    from labkit.model.runner import ModelRunner, SeqChunk
    reqs = [r for r in w["requests"][:args.logit_requests] if r.get("reference_output_token_ids")]
    if not reqs:
        return {}
    longest = max(len(r["prompt_token_ids"]) + len(r["reference_output_token_ids"]) for r in reqs)
    blocks = -(-longest // 16)
    runners = {kv: ModelRunner(args.model, num_blocks=blocks, dtype=args.dtype, kv_cache_dtype=kv)
               for kv in kv_dtypes}
    sums = {kv: dict(max_abs=0.0, sum_max_abs=0.0, max_logit=0.0, kl_sum=0.0, kl_max=0.0, argmax_equal=0, n=0)
            for kv in kv_dtypes if kv != "auto"}
    for r in reqs:
        prompt, ref = r["prompt_token_ids"], r["reference_output_token_ids"]
        tokens = prompt + ref[:-1]           # the logits at position p predict token p + 1
        chunk = SeqChunk(tokens, 0, list(range(blocks)), all_logits=True)
        logits = {kv: runner.execute([chunk])[len(prompt) - 1:] for kv, runner in runners.items()}
        want = logits["auto"]
        p = want.log_softmax(-1)
        for kv, s in sums.items():
            got = logits[kv]
            diff = (got - want).abs().amax(-1)
            kl = (p.exp() * (p - got.log_softmax(-1))).sum(-1)
            s["max_abs"] = max(s["max_abs"], float(diff.max()))
            s["sum_max_abs"] += float(diff.sum())
            s["max_logit"] = max(s["max_logit"], float(want.abs().max()))
            s["kl_sum"] += float(kl.sum())
            s["kl_max"] = max(s["kl_max"], float(kl.max()))
            s["argmax_equal"] += int((got.argmax(-1) == want.argmax(-1)).sum())
            s["n"] += len(ref)
        del logits
    out = {}
    for kv, s in sums.items():
        out[kv] = {"positions": s["n"], "requests": len(reqs), "max_abs_logit_diff": s["max_abs"],
                   "max_abs_logit_diff_rel": s["max_abs"] / s["max_logit"],
                   "mean_max_abs_logit_diff": s["sum_max_abs"] / s["n"], "kl_mean": s["kl_sum"] / s["n"],
                   "kl_max": s["kl_max"], "argmax_agreement": s["argmax_equal"] / s["n"]}
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [k for k in kv_dtypes if k not in KV_DTYPES] + [e for e in engines if e not in ("labkit", "vllm")]
    if bad or not kv_dtypes or kv_dtypes[0] != "auto" or not engines:
        print(f"bench kv-dtype: unknown {bad}, or 'auto' not first; kv dtypes: {', '.join(KV_DTYPES)}; "
              "engines: labkit, vllm", file=sys.stderr)
        return 2
    try:
        workload = S.resolve_workload(args.workload, args.model)
        if workload == "default":
            raise ValueError("kv-dtype needs a workload file (the bundled one, or --workload FILE)")
        w = S.load_workload(workload)
        with tempfile.TemporaryDirectory() as tmp:
            if args.requests:             # the first N, as a workload file of their own for the children
                w["requests"] = w["requests"][:args.requests]
                workload = os.path.join(tmp, "workload.json")
                with open(workload, "w") as f:
                    json.dump(w, f)
            runs = throughput(args, engines, kv_dtypes, workload, w)
    except ValueError as e:
        print(f"bench kv-dtype: {e}", file=sys.stderr)
        return 2
    reference = [r.get("reference_output_token_ids") for r in w["requests"]]
    report = {"workload": {"source": workload, "requests": len(w["requests"]),
                           "output_tokens": sum(int(r["max_tokens"]) for r in w["requests"])},
              "dtype": args.dtype, "machine": {"cpus": os.cpu_count(), "cpu": S._cpu_model(),
                                               "load_average": [round(x, 2) for x in os.getloadavg()]},
              "engines": {}}
    for engine, by_kv in runs.items():
        base = by_kv.get("auto", {})
        rows = {}
        for kv, r in by_kv.items():
            row = {k: v for k, v in r.items() if k != "outputs"}
            if "outputs" in r:
                if "outputs" in base:
                    row["vs_auto"] = agreement(r["outputs"], base["outputs"])
                    row["speedup_vs_auto"] = r["output_tok_per_s"] / base["output_tok_per_s"]
                if all(reference):
                    row["vs_reference"] = agreement(r["outputs"], reference)
            rows[kv] = row
        report["engines"][engine] = rows
    if "labkit" in engines and args.logit_requests > 0:
        print("[bench kv-dtype] logit distance, teacher-forced ...", file=sys.stderr)
        report["logit_distance"] = logit_distance(args, kv_dtypes, w)
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def format_report(report: dict) -> str:
    wl = report["workload"]
    lines = [f"workload {wl['source']}: {wl['requests']} requests, {wl['output_tokens']} output tokens; "
             f"weights {report['dtype']}; {report['machine']['cpus']} CPUs ({report['machine']['cpu']}), "
             f"load average {report['machine']['load_average']}", "",
             f"{'engine':<8} {'kv cache':<9} {'out tok/s':>10} {'x auto':>7} {'= auto':>7} {'tokens before div.':>19} "
             f"{'= reference':>11}"]
    for engine, rows in report["engines"].items():
        for kv, r in rows.items():
            if "output_tok_per_s" not in r:
                lines.append(f"{engine:<8} {kv:<9} skipped: {r.get('skipped', '?')[:160]}")
                continue
            va, vr = r.get("vs_auto"), r.get("vs_reference")
            equal = f"{va['requests_equal']}/{wl['requests']}" if va else "-"
            before = f"{va['tokens_before_first_divergence']}/{va['output_tokens']}" if va else "-"
            reference = f"{vr['requests_equal']}/{wl['requests']}" if vr else "-"
            lines.append(f"{engine:<8} {kv:<9} {r['output_tok_per_s']:>10.1f} {r.get('speedup_vs_auto', 1):>7.2f} "
                         f"{equal:>7} {before:>19} {reference:>11}")
    if report.get("logit_distance"):
        lines += ["", "logit distance against the 'auto' cache (teacher-forced, every output position):",
                  f"{'kv cache':<9} {'max |d|':>8} {'rel':>7} {'mean max |d|':>12} {'KL mean':>9} {'KL max':>8} "
                  f"{'argmax =':>9}"]
        for kv, d in report["logit_distance"].items():
            lines.append(f"{kv:<9} {d['max_abs_logit_diff']:>8.3f} {d['max_abs_logit_diff_rel']:>7.4f} "
                         f"{d['mean_max_abs_logit_diff']:>12.4f} {d['kl_mean']:>9.2e} {d['kl_max']:>8.2e} "
                         f"{d['argmax_agreement']:>9.4f}")
    for engine, rows in report["engines"].items():
        for kv, r in rows.items():
            if "config" in r:
                lines.append(f"  {engine} {kv}: {r['config']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
