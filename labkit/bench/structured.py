"""``python -m labkit.bench structured``: what grammar-constrained decoding costs, and what
jump-forward decoding gives back.

A workload of realistic JSON schemas (nested objects, arrays, enums, numbers and integers
with bounds, strings with patterns and lengths), each asked for through the chat template,
is served greedily at batch 1 (one request at a time) and at batch 64, three ways in one
run on one engine:

* **free**: the same prompts without a grammar, each generating exactly as many tokens as its
  constrained twin did (``ignore_eos``), so the two runs do the same work but for the mask;
* **grammar**: ``structured_outputs=StructuredOutputsParams(json=schema)``, jump-forward off;
* **grammar + jump**: the same with jump-forward decoding on.

Reported per run: output tokens per second, engine steps, mean step time, the mask's time
per step and per masked row (filling the bitmask with XGrammar and applying it), its share
of the step, and for the constrained runs how many outputs finished (``stop``), were cut
(``length``) and are valid against their schema (``jsonschema``). Jump-forward adds the
tokens drafted and accepted. Greedy outputs with and without jump-forward must be the same
tokens: the run checks it and says so.

Examples::

    python -m labkit.bench structured                     # batch 1 and 64, the default model
    python -m labkit.bench structured --batch-sizes 64 --json
    python -m labkit.bench structured --model tiny-llama --num-requests 8   # a quick smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

#: The workload's schemas: what applications ask a model for.
SCHEMAS: dict[str, dict] = {
    "contact": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "pattern": "^[a-z0-9.]{1,20}@[a-z]{2,12}\\.(com|org|net)$"},
            "languages": {"type": "array", "items": {"enum": ["english", "french", "german", "spanish", "chinese"]},
                          "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "email", "languages"],
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"product": {"type": "string", "maxLength": 30},
                               "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                               "unit_price": {"type": "number", "minimum": 0}},
                "required": ["product", "quantity", "unit_price"]}},
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "status", "items", "gift"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "location": {"type": "object",
                         "properties": {"city": {"type": "string", "maxLength": 30},
                                        "country": {"type": "string", "maxLength": 30}},
                         "required": ["city", "country"]},
            "attendees": {"type": "integer", "minimum": 0, "maximum": 100000},
        },
        "required": ["title", "date", "location", "attendees"],
    },
    "review": {
        "type": "object",
        "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "summary": {"type": "string", "maxLength": 80},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
        },
        "required": ["sentiment", "score", "summary", "keywords"],
    },
}

#: What each request asks for, per schema: the subjects vary so that the outputs do.
SUBJECTS: dict[str, list[str]] = {
    "contact": ["a retired French teacher who speaks three languages", "a young software engineer in Berlin",
                "a Spanish chef who moved to London", "a Chinese student of physics in Paris"],
    "order": ["two notebooks and a pen, shipped", "a birthday cake ordered as a gift", "three bicycle tyres, pending",
              "a cancelled order for a desk lamp"],
    "event": ["a jazz concert in Montreal next summer", "a conference on compilers in Tokyo",
              "a marathon in Boston", "a small book club meeting in Dublin"],
    "review": ["a hotel with a broken heater but friendly staff", "a phone whose battery lasts two days",
               "a restaurant that served cold soup", "a film that was long but moving"],
}


def workload(num_requests: int) -> list[tuple[str, str]]:
    """``num_requests`` (schema name, user message) pairs, cycling through schemas and subjects."""
    pairs = [(name, f"Describe {subject} as JSON with the fields: {', '.join(SCHEMAS[name]['properties'])}.")
             for k in range(max(len(s) for s in SUBJECTS.values())) for name, subjects in SUBJECTS.items()
             for subject in subjects[k:k + 1]]
    return [pairs[i % len(pairs)] for i in range(num_requests)]


@dataclass(slots=True)
class Run:
    """One configuration's figures."""

    config: str
    batch: int
    requests: int
    output_tokens: int
    wall_s: float
    steps: int
    mask_s: float
    masked_rows: int
    stopped: int = 0
    cut: int = 0
    valid: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * self.wall_s / self.steps if self.steps else 0.0

    @property
    def mask_ms_per_step(self) -> float:
        return 1e3 * self.mask_s / self.steps if self.steps else 0.0

    @property
    def mask_us_per_row(self) -> float:
        return 1e6 * self.mask_s / self.masked_rows if self.masked_rows else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s, "step_ms": self.step_ms,
                "mask_ms_per_step": self.mask_ms_per_step, "mask_us_per_row": self.mask_us_per_row}


def _valid(name: str, text: str) -> bool:
    import jsonschema
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def serve(llm, prompts: list[str], params: list, batch: int) -> tuple[list, float, int]:
    """Serve ``prompts`` ``batch`` at a time (batch 1: one after the other). Returns (outputs,
    wall seconds, engine steps)."""
    engine = llm.engine
    steps0, t0 = engine.num_steps, time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
    return outs, time.perf_counter() - t0, engine.num_steps - steps0


def measure(llm, pairs: list[tuple[str, str]], batch: int, max_tokens: int) -> tuple[list[Run], bool]:
    """The three runs of the module docstring on ``pairs``; and whether greedy tokens with
    jump-forward equal those without."""
    from ..sampling_params import SamplingParams
    from ..structured import StructuredOutputsParams

    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                       add_generation_prompt=True) for _, message in pairs]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                  structured_outputs=StructuredOutputsParams(json=SCHEMAS[name])) for name, _ in pairs]
    executor = llm.engine.executor
    grammars = executor.grammars
    for p in constrained:                         # compile outside the timings: a server caches them
        grammars.check(p.structured_outputs)
    warm = [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)] * min(batch, len(prompts))
    llm.generate(prompts[:len(warm)], warm, use_tqdm=False)     # first steps of a shape cost more: not timed
    runs, tokens = [], {}
    for config, jump in (("grammar", False), ("grammar + jump", True)):
        executor.jump_forward = jump
        jump_stats = executor.jump.stats if jump and executor.jump is not None else None
        drafted0, accepted0 = (jump_stats.num_drafted, jump_stats.num_accepted) if jump_stats else (0, 0)
        mask0, rows0 = grammars.mask_s, grammars.num_masked_rows
        outs, wall, steps = serve(llm, prompts, constrained, batch)
        run = Run(config, batch, len(pairs), sum(len(o.outputs[0].token_ids) for o in outs), wall, steps,
                  grammars.mask_s - mask0, grammars.num_masked_rows - rows0)
        for (name, _), o in zip(pairs, outs):
            c = o.outputs[0]
            run.stopped += c.finish_reason == "stop"
            run.cut += c.finish_reason == "length"
            run.valid += c.finish_reason == "stop" and _valid(name, c.text)
        if jump:
            stats = executor.jump.stats
            run.drafted, run.accepted = stats.num_drafted - drafted0, stats.num_accepted - accepted0
        tokens[config] = [o.outputs[0].token_ids for o in outs]
        runs.append(run)
    executor.jump_forward = False
    # Free decoding doing the same work: each request generates as many tokens as it did constrained.
    lengths = [max(1, len(t)) for t in tokens["grammar"]]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    outs, wall, steps = serve(llm, prompts, free, batch)
    runs.insert(0, Run("free", batch, len(pairs), sum(len(o.outputs[0].token_ids) for o in outs), wall, steps, 0.0, 0))
    return runs, tokens["grammar"] == tokens["grammar + jump"]


def table(runs: list[Run], same: dict[int, bool], load: str) -> str:
    head = (f"{'batch':>5}  {'config':<15} {'tok/s':>7} {'vs free':>8} {'steps':>6} {'step ms':>8} "
            f"{'mask ms/step':>12} {'mask us/row':>11} {'mask share':>10}  {'stop/cut':>8} {'valid':>7}  "
            f"{'drafted':>7} {'accepted':>8}")
    lines = [head, "-" * len(head)]
    free = {r.batch: r for r in runs if r.config == "free"}
    for r in runs:
        ratio = r.tok_s / free[r.batch].tok_s if free.get(r.batch) and free[r.batch].tok_s else float("nan")
        share = r.mask_s / r.wall_s if r.wall_s else 0.0
        constrained = r.config != "free"
        lines.append(
            f"{r.batch:>5}  {r.config:<15} {r.tok_s:>7.1f} {ratio:>7.2f}x {r.steps:>6} {r.step_ms:>8.1f} "
            f"{r.mask_ms_per_step:>12.3f} {r.mask_us_per_row:>11.1f} {share:>9.1%}  "
            + (f"{r.stopped:>3}/{r.cut:<4} {r.valid:>3}/{r.requests:<3}" if constrained else f"{'':>8} {'':>7}")
            + (f"  {r.drafted:>7} {r.accepted:>8}" if r.config.endswith("jump") else ""))
    lines.append("")
    lines += [f"batch {b}: greedy tokens with jump-forward {'equal' if ok else 'DIFFER FROM'} those without"
              for b, ok in same.items()]
    lines.append(f"load average while measuring: {load}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench structured",
                                description=(__doc__ or "").split("\n\n")[0].replace("``", ""))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch-sizes", default="1,64", help="comma-separated (default 1,64)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per batch size (default: 4 at batch 1, the batch size otherwise)")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    import os

    args = build_parser().parse_args(argv)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
        if not sizes or min(sizes) < 1:
            raise ValueError
    except ValueError:
        print(f"structured: --batch-sizes must be positive integers, got {args.batch_sizes!r}", file=sys.stderr)
        return 2
    from ..llm import LLM

    llm = LLM(args.model, max_num_seqs=max(sizes), enable_prefix_caching=False)
    runs, same = [], {}
    for batch in sizes:
        n = args.num_requests or (4 if batch == 1 else batch)
        batch_runs, same[batch] = measure(llm, workload(n), batch, args.max_tokens)
        runs += batch_runs
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        print(json.dumps({"runs": [r.as_dict() for r in runs], "jump_equal": same, "loadavg": load,
                          "model": llm.runner.name}))
    else:
        print(table(runs, same, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
