"""Benchmark the linear layers of one forward pass: ``python -m labkit.bench matmul``.

Every linear layer of the model (q/k/v, o, gate/up and down of each decoder layer, and the
LM head), each a weight matrix of its own so that the weights stream from memory as in a
real step (a model's 540 MB do not fit in any cache), multiplied by ``M`` rows for each ``M``
of ``--rows``, by each of:

* ``panels``: labkit's C++ loop on weights packed in panels (``kernels/linear_cpu.py``), the
  CPU backend's fp32 matmul; one build per ``--isa`` (default: this CPU's best);
* ``onednn``: oneDNN's packed linear (``torch.ops.mkldnn._linear_pointwise``), what vLLM's
  CPU build and IPEX run, the CPU backend's bf16 matmul;
* ``mkl``: ``x @ W.T`` on the plain weight (torch's default CPU matmul).

The LM head counts once, at ``min(M, 64)`` rows: a step computes logits only for the tokens
it samples. Reported per ``M``: milliseconds for the whole model (median of ``--repeats``
rounds; the methods timed in turn within each round, so a busy machine slows them alike),
the weight bytes read per second, and GFLOP/s. At few rows the work is bound by memory
(GB/s: compare with ``--bandwidth``, a plain sum over as many bytes); at many, by arithmetic.

    python -m labkit.bench matmul                          # SmolLM2-135M's shapes, rows 1 .. 512
    python -m labkit.bench matmul --rows 1 8 --isa avx512 avx2
    ONEDNN_MAX_CPU_ISA=AVX2 python -m labkit.bench matmul --isa avx2   # an AVX2 machine, roughly

fp32 only: the panels multiply fp32 (bf16 stays on oneDNN, which has bf16 dot-product
instructions). Random weights of the model's shapes: only its config is read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from labkit.bench import time_in_turn
from labkit.kernels import cpu_extension
from labkit.kernels.linear_cpu import linear_panels, pack_panels
from labkit.model.llama import ModelSpec

DEFAULT_ROWS = [1, 2, 4, 8, 16, 32, 64, 128, 512]
METHODS = ("panels", "onednn", "mkl")


def _config(model: str):
    """The model's Hugging Face config, without its weights where it can (a hub id loads them)."""
    from labkit.model import loader
    if model == loader.TINY_MODEL:
        return loader.tiny_config()
    if model in (loader.DEFAULT_MODEL, "smollm2", "smollm2-135m-instruct"):
        model = str(loader.fetch_default_model())
    if os.path.isdir(os.path.expanduser(model)):
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(os.path.expanduser(model))
    return loader.load_model(model).config


def model_shapes(model: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of every linear layer of ``model``, layer by layer, the LM head last."""
    spec = ModelSpec.from_config(_config(model))
    h, d = spec.hidden_size, spec.head_dim
    per_layer = [((spec.num_heads + 2 * spec.num_kv_heads) * d, h), (h, spec.num_heads * d),
                 (2 * spec.intermediate_size, h), (h, spec.intermediate_size)]
    return per_layer * spec.num_layers + [(spec.vocab_size, h)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench matmul", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="whose layer shapes (default: smollm2-135m)")
    p.add_argument("--rows", type=int, nargs="+", default=DEFAULT_ROWS, help="rows of x (tokens in the step)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--isa", nargs="+", default=None,
                   help="the panels' builds to time (avx512, avx2, portable, all; default: this CPU's best)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    return p


def _bandwidth(nbytes: int, repeats: int) -> float:
    """GB/s of a plain sum over ``nbytes`` of fp32: the rate memory delivers them here."""
    x = torch.ones(nbytes // 4)
    x.sum()
    t = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        t.append(time.perf_counter() - t0)
    return nbytes / statistics.median(t) / 1e9


def run(model: str, rows: list[int], methods: list[str], isas: list[str] | None, repeats: int) -> dict:
    if any(m < 1 for m in rows):
        raise SystemExit("--rows must be >= 1")
    shapes = model_shapes(model)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) * k ** -0.5 for n, k in shapes]
    fns: dict[str, object] = {}
    prepared: dict[str, list] = {}
    if "panels" in methods:
        isas = isas or [cpu_extension.build_isa()]
        for isa in cpu_extension.runnable_isas() if "all" in isas else dict.fromkeys(isas):
            module = cpu_extension.load(isa=isa)
            if module is None:
                raise SystemExit(f"--isa {isa}: {cpu_extension.status(isa)[1]}")
            prepared[f"panels-{isa}"] = [(module, pack_panels(w), w.shape[0]) for w in weights]
    if "onednn" in methods:
        prepared["onednn"] = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    if "mkl" in methods:
        prepared["mkl"] = [w.t().contiguous() for w in weights]
    weight_bytes = sum(n * k for n, k in shapes) * 4
    out = {"model": model, "threads": torch.get_num_threads(), "weight_mb": round(weight_bytes / 1e6, 1),
           "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
           "sum_gb_per_s": round(_bandwidth(weight_bytes, repeats), 1), "rows": {}}
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}
        head = torch.randn(min(m, 64), shapes[-1][1], generator=gen)
        flops = 2 * sum(n * k for n, k in shapes[:-1]) * m + 2 * shapes[-1][0] * shapes[-1][1] * head.shape[0]

        def inputs(i):
            return head if i == len(shapes) - 1 else xs[shapes[i][1]]

        for name, ws in prepared.items():
            if name.startswith("panels"):
                fns[name] = lambda ws=ws: [linear_panels(e, inputs(i), p, n) for i, (e, p, n) in enumerate(ws)]
            elif name == "onednn":
                fns[name] = lambda ws=ws: [torch.ops.mkldnn._linear_pointwise(inputs(i), w, None, "none", [], "")
                                           for i, w in enumerate(ws)]
            else:
                fns[name] = lambda ws=ws: [inputs(i) @ w for i, w in enumerate(ws)]
        ms = time_in_turn(fns, warmup=1, repeats=repeats)
        out["rows"][m] = {name: {"ms": round(t, 2), "gb_per_s": round(weight_bytes / t / 1e6, 1),
                                 "gflop_per_s": round(flops / t / 1e6, 1)}
                          for name, t in ms.items()}
    return out


def table(result: dict) -> str:
    names = list(next(iter(result["rows"].values())))
    lines = [f"{result['model']}: every linear layer, {result['weight_mb']} MB of fp32 weights, "
             f"{result['threads']} threads; a plain sum reads them at {result['sum_gb_per_s']} GB/s"
             + (f"; ONEDNN_MAX_CPU_ISA={result['onednn_max_cpu_isa']}" if result["onednn_max_cpu_isa"] else ""),
             "", "| rows | " + " | ".join(f"{n} ms (GB/s, GFLOP/s)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for m, row in result["rows"].items():
        lines.append(f"| {m} | " + " | ".join(f"{row[n]['ms']} ({row[n]['gb_per_s']}, {row[n]['gflop_per_s']})"
                                             for n in names) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = run(args.model, args.rows, args.methods, args.isa, args.repeats)
    print(json.dumps(result, indent=1) if args.json else table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
