"""``python -m labkit.bench costs``: what one request's options cost every other request, per
engine iteration.

    python -m labkit.bench costs                         # tiny-llama, 16 polite decoders beside it
    python -m labkit.bench costs --model smollm2-135m --batch 8 --rounds 3

Every iteration, the engine thread does the work each running request asks for: match its
stop strings, add its logit bias, apply its penalties, read its log-probabilities, copy
its output so far for its stream. Every request in the batch waits for all of it. This
measures, for each option a request may set, the wall time of an iteration (``Engine.step``
plus building the outputs of the requests it touched, which is what the server's engine
loop does) with ``--batch`` plain greedy decoders running beside one request that sets the
option, against the same batch beside a plain request. The costly request is resubmitted
as soon as it finishes, so that it is always in flight, prompt steps included.

The heap is frozen after the model loads, as the server freezes it (``labkit.server.heap``).
The options are set at the server's default limits (``labkit.server.limits.Limits``), and
a few beyond them for comparison (those rows say so: the server refuses such requests).
Scenarios run interleaved, round by round, and the table reports medians over the rounds,
so that a machine busy with other work disturbs them alike.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from ..sampling_params import SamplingParams
from ..server.heap import freeze_startup_heap
from ..utils import percentile


@dataclass(slots=True)
class Scenario:
    """One row: the options of the costly request (``SamplingParams`` fields) and its
    prompt length (None: the longest that leaves room for ``max_tokens``)."""

    name: str
    options: dict = field(default_factory=dict)
    beyond_limits: bool = False           # the server would refuse this request (a reference row)
    prompt_len: int | None = None
    max_tokens: int | None = None         # None: the run's --max-tokens
    # min_tokens = max_tokens: its stop token ids are checked every token but never end it
    # early (which would make it resubmit, and cost prefills instead).
    hold_stops: bool = False


def scenarios(vocab: int, limits) -> list[Scenario]:
    """The rows, at ``limits`` (a ``Limits``): each option alone, then every per-token
    option at once (the prompt-side ones are the scoring rows)."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"

    def stops(count: int, length: int) -> list[str]:
        # Distinct strings that share their first characters with ordinary text, so the
        # automaton walks deep and follows fail links rather than idling at its root.
        return [" " + "".join(rng.choice(letters) for _ in range(length - 1)) for _ in range(count)]

    bias = {t: -1.0 for t in rng.sample(range(vocab), min(vocab, limits.max_logit_bias))}
    full_bias = {t: -1.0 for t in range(vocab)}
    sampled = {"temperature": 1.0, "seed": 1, "top_p": 0.95, "top_k": 50, "min_p": 0.01}
    penalties = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}
    stop_ids = rng.sample(range(vocab), min(vocab, limits.max_stop_token_ids))
    worst = {"stop": stops(limits.max_stop_strings, limits.max_stop_string_length), "logit_bias": bias,
             "logprobs": limits.max_logprobs, "stop_token_ids": stop_ids,
             **sampled, **penalties}
    return [
        Scenario("plain (greedy)"),
        Scenario(f"stop: {limits.max_stop_strings} x {limits.max_stop_string_length} chars",
                 {"stop": stops(limits.max_stop_strings, limits.max_stop_string_length)}),
        Scenario("stop: 20,000 x 8 chars", {"stop": stops(20_000, 8)}, beyond_limits=True),
        Scenario(f"stop_token_ids: {len(stop_ids)}", {"stop_token_ids": stop_ids}, hold_stops=True),
        Scenario(f"logit_bias: {len(bias)} entries", {"logit_bias": bias}),
        Scenario(f"logit_bias: all {vocab} tokens", {"logit_bias": full_bias}, beyond_limits=True),
        Scenario("sampled: seed, top-p, top-k, min-p", sampled),
        Scenario("penalties: presence, frequency, repetition", penalties),
        Scenario(f"logprobs: {limits.max_logprobs}", {"logprobs": limits.max_logprobs}),
        Scenario("scoring: longest prompt, max_tokens 1", max_tokens=1),
        Scenario(f"scoring with prompt_logprobs: {limits.max_prompt_logprobs}",
                 {"prompt_logprobs": limits.max_prompt_logprobs}, max_tokens=1),
        Scenario("scoring with prompt_logprobs: 5", {"prompt_logprobs": 5}, beyond_limits=True, max_tokens=1),
        Scenario("scoring with prompt_logprobs: 20", {"prompt_logprobs": 20}, beyond_limits=True, max_tokens=1),
        Scenario(f"n: {limits.max_concurrent_per_key or 8}", {"n": limits.max_concurrent_per_key or 8}),
        Scenario(f"every per-token option at its cap, n={limits.max_concurrent_per_key or 8}",
                 {**worst, "n": limits.max_concurrent_per_key or 8}, hold_stops=True),
    ]


class Runner:
    """Keeps ``batch`` plain decoders and one costly request in flight on one engine and
    times iterations the way the server's engine loop runs them."""

    def __init__(self, llm, batch: int, max_tokens: int, seed: int = 0):
        self.llm, self.engine = llm, llm.engine
        self.batch, self.max_tokens = batch, max_tokens
        self.vocab = llm.runner.vocab_size
        self.rng = random.Random(seed)
        self.ids = 0

    def _prompt(self, length: int) -> list[int]:
        lo = min(3, self.vocab - 1)
        return [self.rng.randrange(lo, self.vocab) for _ in range(length)]

    def _add(self, prompt_len: int, params: SamplingParams):
        self.ids += 1
        return self.engine.add_request(self._prompt(prompt_len), params, request_id=f"c{self.ids}")

    def run(self, scenario: Scenario, steps: int, warmup: int = 5) -> list[float]:
        """Iteration times (seconds) with ``scenario``'s request in flight."""
        from ..outputs import request_output
        engine, limit = self.engine, self.llm.max_model_len
        plain = SamplingParams(max_tokens=limit, temperature=0.0, ignore_eos=True)
        max_tokens = scenario.max_tokens or self.max_tokens
        costly = SamplingParams(**{"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0,
                                   "min_tokens": max_tokens if scenario.hold_stops else 0, **scenario.options})
        prompt_len = scenario.prompt_len or max(1, limit - max_tokens - 1)
        polite = [self._add(32, plain) for _ in range(self.batch)]
        heavy = self._add(prompt_len, costly)
        times: list[float] = []
        try:
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                finished = engine.step()
                plan = engine.last_plan
                touched = {item.seq.request.request_id for item in plan.scheduled if item.num_samples}
                for r in [*polite, heavy]:
                    if r.request_id in touched or r in finished:
                        request_output(r, [engine.text_of(s) for s in r.seqs])
                t1 = time.perf_counter()
                if i >= warmup:
                    times.append(t1 - t0)
                for r in finished:                        # keep the batch as it was
                    engine.release(r)
                    if r is heavy:
                        heavy = self._add(prompt_len, costly)
                    else:
                        polite[polite.index(r)] = self._add(32, plain)
        finally:
            for r in [*polite, heavy]:
                engine.abort(r.request_id)
                engine.release(r)
        return times


def measure(model: str, batch: int, steps: int, rounds: int, max_tokens: int, num_blocks: int | None) -> dict:
    from ..llm import LLM
    from ..server.limits import SHARED_MAX_PROMPT_LOGPROBS, Limits
    llm = LLM(model, num_blocks=num_blocks, max_num_seqs=max(batch + 16, 64))
    freeze_startup_heap()                 # as the server does once its model is loaded
    limits = Limits(max_concurrent_per_key=8, max_prompt_logprobs=SHARED_MAX_PROMPT_LOGPROBS)    # a shared server's
    rows = scenarios(llm.runner.vocab_size, limits)
    runner = Runner(llm, batch, max_tokens)
    per_round: dict[str, list[dict]] = {s.name: [] for s in rows}
    for _ in range(rounds):
        for s in rows:                                   # interleaved: noise hits every row alike
            t = runner.run(s, steps)
            per_round[s.name].append({"p50": percentile(t, 50), "p99": percentile(t, 99), "mean": statistics.mean(t)})
    assert llm.allocator.num_used_blocks == 0, "a scenario left blocks held"
    base = statistics.median(r["p50"] for r in per_round[rows[0].name])
    out = []
    for s in rows:
        rs = per_round[s.name]
        p50 = statistics.median(r["p50"] for r in rs)
        out.append({"scenario": s.name, "beyond_limits": s.beyond_limits, "step_p50_ms": p50 * 1e3,
                    "step_p99_ms": statistics.median(r["p99"] for r in rs) * 1e3,
                    "step_mean_ms": statistics.median(r["mean"] for r in rs) * 1e3,
                    "vs_plain": p50 / base if base else None})
    return {"model": llm.runner.name, "batch": batch, "steps_per_round": steps, "rounds": rounds,
            "max_tokens": max_tokens, "max_model_len": llm.max_model_len, "rows": out}


def table(result: dict) -> str:
    lines = [f"{result['model']}: {result['batch']} plain decoders + 1 request with the option "
             f"({result['max_tokens']} tokens after the longest prompt that fits, resubmitted); "
             f"{result['rounds']} rounds x {result['steps_per_round']} iterations, medians",
             f"{'the request sets':<48} {'step p50':>9} {'step p99':>9} {'mean':>8} {'x plain':>8}  (ms)"]
    for r in result["rows"]:
        name = r["scenario"] + (" [beyond limits]" if r["beyond_limits"] else "")
        lines.append(f"{name:<48} {r['step_p50_ms']:>9.2f} {r['step_p99_ms']:>9.2f} {r['step_mean_ms']:>8.2f} "
                     f"{r['vs_plain']:>7.2f}x")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m labkit.bench costs", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-llama", help="tiny-llama (default), smollm2-135m, or an HF path/dir")
    p.add_argument("--batch", type=int, default=16, help="plain decoders running beside the costly request")
    p.add_argument("--steps", type=int, default=60, help="timed iterations per scenario and round")
    p.add_argument("--rounds", type=int, default=5, help="rounds over all scenarios (medians are reported)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens the costly request generates each time")
    p.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: sized by LLM)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.batch, args.steps, args.rounds, args.max_tokens) < 1:
        p.error("--batch, --steps, --rounds and --max-tokens must be >= 1")
    result = measure(args.model, args.batch, args.steps, args.rounds, args.max_tokens, args.num_blocks)
    print(json.dumps(result, indent=2) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
