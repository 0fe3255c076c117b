"""``python -m labkit.bench spec``: what speculative decoding buys, by workload and batch size.

Two workloads, through the chat template, served greedily:

* **grounded**: the answer largely copies the prompt (repeat a passage, fix its typos, rename a
  variable in a function): what prompt lookup (``ngram``) is made for;
* **free**: open questions, where nothing in the prompt predicts the answer.

Each is served at several batch sizes (default 1, 4, 16, 64; batch 1 serves its requests one
after another) three ways, one engine each, in one run: speculation **off**, **ngram** (prompt
lookup) and **draft_layers** (self-speculation from the target's first layers, whose KV is the
target's own). Reported per run: output tokens per second, mean TPOT (time per output token
after the first, per request), steps, the drafted and accepted tokens, the acceptance rate and
the mean acceptance length (tokens gained per verifying step, vLLM's name), and the speedup
over **off** at the same batch size. Greedy tokens must equal **off**'s: the run checks it.

Why the gain fades with the batch: a decode step reads every weight once whatever the batch,
so verifying k + 1 tokens of one sequence costs about as much as decoding one, while the batch
is small; a large batch already fills the matmuls, and each guessed token then costs about
what a real one does, while rejected guesses are paid for and thrown away.

vLLM's CPU build is not run by this command: its n-gram speculation on the same workload is
a run of vLLM's own (``docs/speculative_decoding.md`` says what was and was not compared).

Examples::

    python -m labkit.bench spec                                  # both workloads, batch 1-64 (minutes)
    python -m labkit.bench spec --workloads grounded --batch-sizes 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass

#: Passages the grounded requests copy or edit (ordinary English and Python, a few hundred
#: tokens each).
PASSAGES = [
    "The library opens at nine in the morning and closes at six in the evening. Visitors may borrow "
    "up to five books at a time for three weeks. Books can be renewed twice, online or at the front "
    "desk, unless another reader has reserved them. Late returns cost ten cents a day.",
    "To make the bread, mix the flour, the salt and the yeast in a large bowl. Add the warm water "
    "slowly and knead the dough for ten minutes until it is smooth. Leave it to rise for an hour, "
    "shape it into a loaf, and bake it at two hundred degrees for thirty five minutes.",
    "The meeting is moved from Tuesday to Thursday at two o'clock in room four. Please bring the "
    "quarterly figures and the draft of the new budget. If you cannot attend, send your comments "
    "to the secretary before Wednesday evening so that they can be read out.",
    "Our train leaves the central station at seven fifteen and arrives in the mountains around "
    "noon. From the last stop a bus climbs to the village, where the hotel is a short walk from "
    "the square. Dinner is served from seven, and breakfast from half past six.",
]
CODE = [
    "def total(xs):\n    s = 0\n    for x in xs:\n        s = s + x\n    return s\n",
    "def largest(xs):\n    best = xs[0]\n    for x in xs:\n        if x > best:\n"
    "            best = x\n    return best\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def mean(xs):\n    n = 0\n    s = 0\n    for x in xs:\n        n = n + 1\n        s = s + x\n    return s / n\n",
]
FREE = [
    "What are three good habits for staying healthy?", "Why is the sky blue? Explain simply.",
    "Give me some ideas for a birthday party.", "How do plants grow from seeds?",
    "What should I pack for a trip to the beach?", "Describe how a bicycle works.",
    "What is the difference between weather and climate?", "How can I learn to cook?",
]


def workload(name: str, num_requests: int) -> list[str]:
    """``num_requests`` user messages of workload ``name``, cycling through its templates."""
    if name == "grounded":
        messages = ([f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
                    + [f"Rewrite this Python function, renaming the function to `compute`:\n\n{c}" for c in CODE]
                    + [f"Copy this paragraph, replacing every 'the' with 'a':\n\n{p}" for p in PASSAGES])
    elif name == "free":
        messages = list(FREE)
    else:
        raise ValueError(f"unknown workload {name!r}: grounded or free")
    return [messages[i % len(messages)] for i in range(num_requests)]


#: Room in the KV cache per sequence for the longest prompt of either workload (about 250
#: tokens through the chat template), with margin.
PROMPT_TOKENS = 512

#: The engines compared, as ``speculative_config`` values (None: no speculation).
CONFIGS: dict[str, dict | None] = {
    "off": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "draft_layers": {"method": "draft_layers", "num_layers": 20, "num_speculative_tokens": 3},
}


@dataclass(slots=True)
class Run:
    """One (workload, batch, config)'s figures."""

    workload: str
    batch: int
    config: str
    requests: int
    output_tokens: int
    wall_s: float
    steps: int
    tpot_ms: float
    drafted: int = 0
    accepted: int = 0
    drafts: int = 0
    same_as_off: bool | None = None

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tok_s": self.tok_s, "acceptance_rate": self.acceptance_rate,
                "mean_acceptance_length": self.mean_acceptance_length}


def _counters(llm) -> tuple[int, int, int]:
    s = llm.stats()
    return (s.get("spec_decode_num_draft_tokens", 0), s.get("spec_decode_num_accepted_tokens", 0),
            s.get("spec_decode_num_drafts", 0))


def serve(llm, prompts: list[str], params, batch: int) -> tuple[list, float, int, float]:
    """Serve ``prompts`` ``batch`` at a time. Returns (outputs, wall seconds, steps, mean TPOT ms)."""
    steps0, t0 = llm.engine.num_steps, time.perf_counter()
    outs = []
    for i in range(0, len(prompts), batch):
        outs += llm.generate(prompts[i:i + batch], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tpots = [1e3 * (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
             for o in outs if len(o.outputs[0].token_ids) > 1 and o.metrics.finished_time is not None
             and o.metrics.first_token_time is not None]
    return outs, wall, llm.engine.num_steps - steps0, statistics.mean(tpots) if tpots else 0.0


def measure(engines: dict, workloads: list[str], sizes: list[int], num_requests: int | None,
            max_tokens: int) -> list[Run]:
    from ..sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = []
    for name in workloads:
        for batch in sizes:
            n = num_requests or max(4, batch)
            tok = next(iter(engines.values())).tokenizer
            prompts = [tok.apply_chat_template([{"role": "user", "content": m}], tokenize=False,
                                               add_generation_prompt=True) for m in workload(name, n)]
            reference = None
            for config, llm in engines.items():
                llm.generate(prompts[:batch], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm
                before = _counters(llm)
                outs, wall, steps, tpot = serve(llm, prompts, params, batch)
                after = _counters(llm)
                tokens = [o.outputs[0].token_ids for o in outs]
                run = Run(name, batch, config, n, sum(map(len, tokens)), wall, steps, tpot,
                          *(a - b for a, b in zip(after, before, strict=True)))
                if reference is None:
                    reference = tokens
                else:
                    run.same_as_off = tokens == reference
                runs.append(run)
    return runs


def table(runs: list[Run], load: str) -> str:
    head = (f"{'workload':<9} {'batch':>5}  {'config':<13} {'tok/s':>7} {'speedup':>8} {'TPOT ms':>8} "
            f"{'steps':>6} {'drafted':>8} {'accepted':>8} {'accept':>7} {'mean len':>8}  same as off")
    lines = [head, "-" * len(head)]
    off = {(r.workload, r.batch): r for r in runs if r.config == "off"}
    for r in runs:
        base = off.get((r.workload, r.batch))
        speedup = r.tok_s / base.tok_s if base and base.tok_s else float("nan")
        same = "" if r.same_as_off is None else ("yes" if r.same_as_off else "NO")
        lines.append(f"{r.workload:<9} {r.batch:>5}  {r.config:<13} {r.tok_s:>7.1f} {speedup:>7.2f}x "
                     f"{r.tpot_ms:>8.1f} {r.steps:>6} {r.drafted:>8} {r.accepted:>8} {r.acceptance_rate:>6.1%} "
                     f"{r.mean_acceptance_length:>8.2f}  {same}")
    lines += ["", f"load average while measuring: {load}"]
    return "\n".join(lines)


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise SystemExit(f"spec: {what} must be positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench spec",
                                description=(__doc__ or "").split("\n\n")[0].replace("``", ""))
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workloads", default="grounded,free", help="comma-separated: grounded, free (default both)")
    p.add_argument("--batch-sizes", default="1,4,16,64", help="comma-separated (default 1,4,16,64)")
    p.add_argument("--configs", default=",".join(CONFIGS),
                   help=f"comma-separated, off first (default {','.join(CONFIGS)})")
    p.add_argument("--num-requests", type=int, default=None,
                   help="requests per batch size (default: the batch size, at least 4)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--draft-layers", type=int, default=None,
                   help="draft_layers: how many of the target's first layers draft (default 20 of SmolLM2's 30)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    sizes = _ints(args.batch_sizes, "--batch-sizes")
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [w for w in workloads if w not in ("grounded", "free")] + [c for c in configs if c not in CONFIGS]
    if bad or not workloads or configs[:1] != ["off"]:
        print(f"spec: unknown workload/config {bad}, or --configs does not start with off", file=sys.stderr)
        return 2
    from ..llm import LLM

    configs_used = dict(CONFIGS)
    if args.draft_layers is not None:
        configs_used["draft_layers"] = {**CONFIGS["draft_layers"], "num_layers": args.draft_layers}
    longest = max(sizes)
    # One engine per config, each with a KV cache just big enough for the largest batch.
    engines = {c: LLM(args.model, max_num_seqs=longest, enable_prefix_caching=False,
                      num_blocks=longest * (PROMPT_TOKENS + args.max_tokens) // 16 + 16,
                      speculative_config=configs_used[c])
               for c in configs}
    runs = measure(engines, workloads, sizes, args.num_requests, args.max_tokens)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        print(json.dumps({"runs": [r.as_dict() for r in runs], "configs": {c: configs_used[c] for c in configs},
                          "loadavg": load, "model": engines["off"].runner.name}))
    else:
        print(table(runs, load))
    return 0 if all(r.same_as_off in (None, True) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
