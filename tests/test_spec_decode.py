"""Speculative decoding never changes the output, and gives every slot back.

Every engine test compares an engine with speculation on against the same engine with it
off: greedy tokens, seeded samples, log-probabilities, penalties and finish reasons must be
the same (float noise aside for logprobs), for each method (prompt lookup, the target's
first layers, a separate draft model), under preemption, swapping, a tiny token budget,
prefix caching (hash and radix), the static policy, n > 1, stop strings and tokens, and
aborts; every block must be free after each run. The tests assert that guesses were both
kept and rejected, so that neither path goes untested.

With temperature > 0 and guesses *sampled* from the draft's distribution, the tokens differ
from decoding's but their distribution must not: a two-sample test over many seeds cannot
tell them apart, and the same test catches a deliberately broken rule.

The real model's greedy equality, for each method, is at the end (one shared load).
"""

from __future__ import annotations

import math

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine import Engine
from labkit.executor import ModelExecutor
from labkit.memory import BlockAllocator
from labkit.model.loader import LoadedModel, tiny_llama
from labkit.model.runner import ModelRunner
from labkit.scheduler import make_scheduler
from labkit.server.metrics import parse_metrics, render_metrics
from labkit.spec_decode import SpeculativeConfig, lookup, rejection, speculative_sample
from test_structured_jump import assert_same, assert_whole, run

# Prompts with repeats (prompt lookup finds them) and without.
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [40, 41, 42, 43, 40, 41, 42], [100, 101, 102, 103, 104],
           [7, 7, 7, 7, 7, 7], [200 + i for i in range(20)] + [200, 201, 202], [33, 34]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
LAYERS = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def models():
    """tiny-llama, and a draft for it: the same weights with noise (it agrees often, not always)."""
    target = tiny_llama()
    g = torch.Generator().manual_seed(7)
    noisy = {k: v + 0.15 * v.std() * torch.randn(v.shape, generator=g) for k, v in target.state_dict.items()}
    draft = LoadedModel("tiny-draft", target.config, noisy, target.tokenizer)
    return {"target": target, "draft": draft}


def methods(models) -> dict[str, dict]:
    return {"ngram": NGRAM, "draft_layers": LAYERS,
            "draft_model": {"model": models["draft"], "num_speculative_tokens": 3}}


def make_engine(model: LoadedModel | ModelRunner, spec: dict | None, *, num_blocks=256, block_size=4,
                policy="continuous", max_num_seqs=8, max_num_batched_tokens=512, prefix="hash",
                preemption_mode="recompute", num_host_blocks=0) -> Engine:
    """An engine on ``model`` (a runner is shared: its geometry wins over the arguments)."""
    if isinstance(model, ModelRunner):
        runner, num_blocks, block_size = model, model.num_blocks, model.block_size
    else:
        runner = ModelRunner(model, block_size=block_size, num_blocks=num_blocks)
    allocator = BlockAllocator(num_blocks, block_size, prefix)
    scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=runner.max_model_len,
                               eos_token_ids=runner.eos_token_ids, max_num_batched_tokens=max_num_batched_tokens,
                               preemption_mode=preemption_mode, num_host_blocks=num_host_blocks)
    host = runner.kv_cache.host_pool(num_host_blocks) if num_host_blocks else None
    return Engine(scheduler, ModelExecutor(runner, host, speculative_config=spec), tokenizer=runner.tokenizer)


def both(loaded, spec, params, prompts=PROMPTS, **options):
    """(outputs without speculation, outputs with it, the speculating engine); both end whole."""
    plain = make_engine(loaded, None, **options)
    reference = run(plain, params, prompts)
    assert_whole(plain)
    engine = make_engine(loaded, spec, **options)
    got = run(engine, params, prompts)
    assert_whole(engine)
    return reference, got, engine


def stats(engine):
    return engine.executor.speculator.stats


def assert_both_paths(engine) -> None:
    s = stats(engine)
    assert s.num_accepted_tokens > 0, "no guess was kept: the test proves nothing"
    assert s.num_accepted_tokens < s.num_draft_tokens, "no guess was rejected: the rejection path went untested"


def greedy(**options) -> SamplingParams:
    return SamplingParams(max_tokens=options.pop("max_tokens", 24), temperature=0.0, ignore_eos=True, **options)


# ---- the configuration ------------------------------------------------------------------------
def test_config_reads_vllms_dict_and_refuses_what_cannot_work():
    c = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)          # vLLM: the one bound given, both
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 5
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert SpeculativeConfig.from_dict({"model": "tiny-llama", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.from_dict(None) is None
    for bad, words in [({"method": "ngram"}, "num_speculative_tokens"),
                       ({"method": "eagle", "num_speculative_tokens": 2}, "method must be"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                         "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "num_layers": 3}, "do not apply"),
                       ({"method": "draft_layers", "num_speculative_tokens": 2}, "num_layers"),
                       ({"num_speculative_tokens": 2}, "needs a 'method'"),
                       ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
                       ({"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 2,
                         "draft_sampling": "greedy"}, "draft_sampling"),
                       ("ngram", "must be a dict")]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.from_dict(bad)


def test_a_draft_that_cannot_serve_the_target_is_refused(models):
    with pytest.raises(ValueError, match="shallower"):
        make_engine(models["target"], {"method": "draft_layers", "num_layers": 2, "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tokenizer"):
        make_engine(models["target"], {"model": tiny_llama(vocab_size=300), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):        # before any model loads
        LLM("no-such-model", speculative_config={"method": "ngram"})


# ---- prompt lookup ----------------------------------------------------------------------------
def test_lookup_finds_the_longest_recent_tail():
    assert lookup([1, 2, 3, 4, 1, 2], k=3, min_n=1, max_n=3) == [3, 4, 1]
    assert lookup([1, 2, 9, 5, 2, 7, 1, 2], k=2, min_n=1, max_n=2) == [9, 5]     # "1 2" beats the later "2"
    assert lookup([1, 2, 9, 5, 2, 7, 1, 2], k=2, min_n=1, max_n=1) == [7, 1]     # "2" alone: its latest
    assert lookup([1, 2, 3], k=3, min_n=1, max_n=3) == []
    assert lookup([4, 5, 6, 4, 5], k=4, min_n=3, max_n=3) == []                  # only shorter tails occur
    assert lookup([7, 7, 7, 7], k=5, min_n=1, max_n=2) == [7]                    # overlapping the tail
    assert lookup([3], k=2, min_n=1, max_n=2) == []


# ---- rejection sampling, the arithmetic -------------------------------------------------------
def chi_square_p(counts_a: list[int], counts_b: list[int]) -> float:
    """Two-sample chi-square test of homogeneity; the p-value by Wilson and Hilferty's cube-root
    normal approximation of the chi-square law (accurate to ~1e-3 for these degrees of freedom)."""
    na, nb = sum(counts_a), sum(counts_b)
    stat, df = 0.0, -1
    for a, b in zip(counts_a, counts_b):
        if a + b == 0:
            continue
        df += 1
        ea, eb = (a + b) * na / (na + nb), (a + b) * nb / (na + nb)
        stat += (a - ea) ** 2 / ea + (b - eb) ** 2 / eb
    if df < 1:
        return 1.0
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def draws(p, q, n, seed=0) -> list[int]:
    """The first token the rule keeps or substitutes, ``n`` times, for one guess drawn from q."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = int(torch.multinomial(q[0], 1, generator=g))
        kept, token = speculative_sample(p, q, [x], [g, g])
        out.append(x if kept else token)
    return out


def histogram(tokens, size) -> list[int]:
    return torch.bincount(torch.tensor(tokens), minlength=size).tolist()


def test_rejection_sampling_gives_the_targets_distribution(monkeypatch):
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(2, 6, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 6, generator=g) * 1.5, -1)
    exact = torch.multinomial(p[0], 4000, replacement=True, generator=g).tolist()
    assert chi_square_p(histogram(draws(p, q, 4000), 6), histogram(exact, 6)) > 1e-3
    monkeypatch.setattr(rejection, "residual", lambda p, q: p)           # resample from p: biased
    assert chi_square_p(histogram(draws(p, q, 4000), 6), histogram(exact, 6)) < 1e-6


def test_a_point_mass_is_kept_with_the_targets_probability():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
    one_hot = torch.tensor([[0.0, 1.0, 0.0]])
    kept = [speculative_sample(p, one_hot, [1], [None, None])[0] for _ in range(3000)]
    assert abs(sum(kept) / 3000 - 0.3) < 0.04
    assert float(rejection.residual(p[0], one_hot[0])[1]) == 0.0          # a rejected guess never comes back


# ---- greedy: the same tokens, every method ------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_layers", "draft_model"])
def test_greedy_output_equals_decoding(models, method):
    reference, got, engine = both(models["target"], methods(models)[method], greedy())
    assert_same(got, reference)
    assert_both_paths(engine)
    assert sequence_steps(engine) < sequence_steps(make_engine(models["target"], None), greedy())


def sequence_steps(engine, params=None) -> int:
    """Decode chunks the engine ran (one per sequence per step): what speculation saves."""
    if params is not None:
        run(engine, params)
    return sum(phase == "decode" for r in engine.records for (_, _, _, phase) in r.ran)


@pytest.mark.parametrize("method", ["ngram", "draft_layers", "draft_model"])
@pytest.mark.parametrize("options", [
    dict(num_blocks=24, block_size=4, max_num_seqs=6),                                   # preemption
    dict(num_blocks=24, block_size=4, max_num_seqs=6, preemption_mode="swap", num_host_blocks=200),
    dict(max_num_batched_tokens=10),                                                     # guesses cut by the budget
    dict(policy="static", num_blocks=400),
    dict(prefix="radix", block_size=2),
    dict(prefix=None, block_size=8),
], ids=["preempt", "swap", "budget", "static", "radix", "no-cache"])
def test_same_output_under_pressure_and_policies(models, method, options):
    reference, got, engine = both(models["target"], methods(models)[method], greedy(max_tokens=20), **options)
    assert_same(got, reference)
    if options.get("num_blocks") == 24:
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    if options.get("num_host_blocks"):
        assert engine.scheduler.num_swap_outs > 0, "nothing was swapped"
    if options.get("max_num_batched_tokens") == 10:
        assert stats(engine).num_dropped > 0, "no guess was cut by the token budget"


# ---- sampling: seeds, logprobs, penalties, n > 1 -------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft_layers", "draft_model"])
def test_seeded_samples_logprobs_and_penalties_equal_decoding(models, method):
    """Point-mass guesses: each position draws from the generator decoding would use there, so
    a seeded request gets the very same tokens, logprobs and finish reasons."""
    params = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=11, logprobs=2, n=2,
                            repetition_penalty=1.2, frequency_penalty=0.3, ignore_eos=True)
    reference, got, engine = both(models["target"], methods(models)[method], params)
    assert_same(got, reference)
    assert stats(engine).num_accepted_tokens > 0
    for samples in got:
        assert len(samples) == 2
        for tokens, _, logprobs in samples:
            assert len(logprobs) == len(tokens)


def test_stop_strings_and_stop_tokens_end_inside_a_run_of_kept_guesses(models):
    """A kept guess that would end the sequence ends the step there, as decoding would stop."""
    target = models["target"]
    plain = make_engine(target, None)
    long = run(plain, greedy(max_tokens=30))
    stops = [target.tokenizer.decode(req[0][0][8:10]) for req in long]          # text from each output's middle
    for params in [greedy(max_tokens=30, stop=[s for s in stops if s.strip()][:3]),
                   greedy(max_tokens=30, stop_token_ids=[req[0][0][9] for req in long]),
                   SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[req[0][0][5] for req in long],
                                  min_tokens=7, ignore_eos=True)]:
        for method in ("ngram", "draft_model"):
            reference, got, engine = both(target, methods(models)[method], params)
            assert_same(got, reference)
            assert any(s[1] == "stop" for req in got for s in req), "no sequence stopped: the test proves nothing"
            for req_got, req_ref in zip(got, reference):   # the same text too: cut at the same place
                assert [s[0] for s in req_got] == [s[0] for s in req_ref]


def test_abort_leaves_no_guess_behind(models):
    engine = make_engine(models["target"], methods(models)["draft_model"])
    params = greedy(max_tokens=40)
    reference = run(make_engine(models["target"], None), params, PROMPTS)
    requests = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    for step in range(60):
        if not engine.has_unfinished:
            break
        engine.step()
        if step == 3:
            engine.abort("r2")
        alloc = engine.scheduler.allocator
        alloc.check_invariants()
        for seq in engine.scheduler.running:      # between steps: no guess, no lookahead slot
            assert seq.block_table.num_tokens == seq.num_computed_tokens
            assert seq.block_table.num_blocks == -(-seq.num_computed_tokens // alloc.block_size)
        for r in requests:
            for seq in r.seqs:
                want = reference[int(r.request_id[1:])][seq.index][0]
                assert seq.output_token_ids == want[:seq.num_output_tokens]
    assert requests[2].seqs[0].finish_reason == "abort"
    for r in requests:
        engine.release(r)
    assert_whole(engine)


def test_max_tokens_and_model_length_are_never_passed(models):
    for max_tokens in (1, 2, 3, 5):
        reference, got, _ = both(models["target"], methods(models)["draft_model"], greedy(max_tokens=max_tokens))
        assert_same(got, reference)
        assert all(len(s[0]) == max_tokens for req in got for s in req)


# ---- sampled guesses: the same distribution -------------------------------------------------------
DIST_PROMPT = [60, 61, 62, 63]
DIST_PARAMS = dict(max_tokens=4, temperature=1.0, top_k=4, ignore_eos=True)


def outputs_over_seeds(engine, num_seeds: int) -> list[tuple[int, ...]]:
    requests = [engine.add_request(DIST_PROMPT, SamplingParams(seed=s, **DIST_PARAMS), request_id=f"s{s}")
                for s in range(num_seeds)]
    engine.run()
    out = [tuple(r.seqs[0].output_token_ids[1:]) for r in requests]     # the tokens verification chose
    for r in requests:
        engine.release(r)
    assert_whole(engine)
    return out


def joint_counts(a: list[tuple], b: list[tuple]) -> tuple[list[int], list[int]]:
    cells = sorted(set(a) | set(b))
    index = {c: i for i, c in enumerate(cells)}
    ca, cb = [0] * len(cells), [0] * len(cells)
    for t in a:
        ca[index[t]] += 1
    for t in b:
        cb[index[t]] += 1
    return ca, cb


@pytest.fixture(scope="module")
def decoded_over_seeds(models):
    return outputs_over_seeds(make_engine(models["target"], None, max_num_seqs=256, num_blocks=2048), 3000)


SAMPLED = {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 2, "draft_sampling": "sample"}


@pytest.mark.slow
def test_sampled_guesses_keep_the_distribution(models, decoded_over_seeds):
    engine = make_engine(models["target"], SAMPLED, max_num_seqs=256, num_blocks=2048)
    spec = outputs_over_seeds(engine, 3000)
    s = stats(engine)
    assert 0.2 < s.acceptance_rate < 0.9, "the draft must be kept often, and rejected often"
    assert spec != decoded_over_seeds, "sampled guesses give other tokens per seed, the same distribution"
    assert chi_square_p(*joint_counts(spec, decoded_over_seeds)) > 1e-3


@pytest.mark.parametrize("broken", ["accept-always", "resample-from-p"])
@pytest.mark.slow
def test_a_broken_rule_changes_the_distribution(models, decoded_over_seeds, monkeypatch, broken):
    if broken == "accept-always":
        monkeypatch.setattr(rejection, "acceptance_probability", lambda p_x, q_x: torch.ones_like(p_x))
    else:
        monkeypatch.setattr(rejection, "residual", lambda p, q: p)
    spec = outputs_over_seeds(make_engine(models["target"], SAMPLED, max_num_seqs=256, num_blocks=2048), 3000)
    assert chi_square_p(*joint_counts(spec, decoded_over_seeds)) < 1e-4


# ---- numbers ----------------------------------------------------------------------------------
def test_stats_records_and_metrics_count_guesses(models):
    engine = make_engine(models["target"], NGRAM)
    run(engine, greedy())
    s = engine.stats()
    spec = stats(engine)
    assert s["spec_decode_method"] == "ngram" and s["num_speculative_tokens"] == 3
    assert s["spec_decode_num_draft_tokens"] == spec.num_draft_tokens > 0
    assert s["spec_decode_num_accepted_tokens"] == sum(r.num_accepted_tokens for r in engine.records)
    assert s["spec_decode_num_draft_tokens"] == sum(r.num_draft_tokens for r in engine.records)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(spec.num_accepted_tokens / spec.num_draft_tokens)
    assert s["spec_decode_mean_acceptance_length"] == pytest.approx(1 + spec.num_accepted_tokens / spec.num_drafts)
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens
    assert s["num_generated_tokens"] == len(PROMPTS) * 24       # kept guesses count as generated
    metrics = parse_metrics(render_metrics(s))
    assert metrics["labkit_spec_decode_num_accepted_tokens_total"] == spec.num_accepted_tokens
    assert metrics["labkit_spec_decode_num_draft_tokens_total"] == spec.num_draft_tokens
    assert "labkit_spec_decode_num_drafts_total" not in parse_metrics(render_metrics(make_engine(models["target"],
                                                                                                None).stats()))


def test_disable_by_batch_size_rests_the_proposer_in_big_batches(models):
    engine = make_engine(models["target"], {**NGRAM, "disable_by_batch_size": 2})
    for i, prompt in enumerate(PROMPTS):                    # six at once, leaving one by one
        engine.add_request(prompt, greedy(max_tokens=4 + 6 * i))
    engine.run()
    drafting = [r for r in engine.records if r.num_draft_tokens]
    assert drafting, "no guesses even when the batch was small"
    assert all(len(r.ran) <= 2 for r in drafting)
    assert any(len(r.ran) > 2 for r in engine.records)
    assert_whole(engine)


# ---- the default model -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    from labkit.model.loader import load_model
    return load_model("smollm2-135m")


def first_layers(loaded: LoadedModel, n: int) -> LoadedModel:
    """A separate, shallower model with the same tokenizer: the first ``n`` layers of ``loaded``
    (its own weights and its own KV cache once served)."""
    import copy
    config = copy.deepcopy(loaded.config)
    config.num_hidden_layers = n
    keep = {k: v for k, v in loaded.state_dict.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    return LoadedModel(f"{loaded.name}-first{n}", config, keep, loaded.tokenizer)


@pytest.mark.slow
def test_greedy_equality_on_the_default_model_every_method(smol):
    tok = smol.tokenizer
    text = ("Rain fell on the old harbour town. Fishing boats rocked at their moorings, and the gulls "
            "waited on the roofs for the weather to turn.")
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}], tokenize=False,
                                       add_generation_prompt=True),
               tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                       add_generation_prompt=True)]
    ids = [tok.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    runner = ModelRunner(smol, block_size=16, num_blocks=64)
    reference = run(make_engine(runner, None), params, ids)
    for spec in [{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                 {"method": "draft_layers", "num_layers": 24, "num_speculative_tokens": 2},
                 {"model": first_layers(smol, 26), "num_speculative_tokens": 2}]:
        engine = make_engine(runner, spec)
        got = run(engine, params, ids)
        assert [[s[0] for s in r] for r in got] == [[s[0] for s in r] for r in reference], spec
        assert stats(engine).num_accepted_tokens > 0, spec
        assert_whole(engine)


# ---- labkit serve --speculative-config ------------------------------------------------------------
def test_serve_takes_vllms_speculative_config(monkeypatch, capsys):
    """``labkit serve --speculative-config JSON``, as ``vllm serve``: the engine speculates, a
    bad value is refused before any model loads (exit 2, naming the problem)."""
    import labkit.__main__ as cli
    import labkit.server.background as background

    served = {}

    def fake_serve(engine, *args, **kwargs):
        served["stats"] = engine.stats()
    monkeypatch.setattr(background, "serve", fake_serve)
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'
    assert cli.main(["serve", "--model", "tiny-llama", "--num-blocks", "32", "--speculative-config", config]) == 0
    assert served["stats"]["spec_decode_method"] == "ngram" and served["stats"]["num_speculative_tokens"] == 3
    for bad, words in (("{not json", "is not JSON"), ("[1, 2]", "must be a JSON object"),
                       ('{"method": "ngram", "num_speculative_tokens": 3, "colour": 1}', "unknown key")):
        assert cli.main(["serve", "--model", "tiny-llama", "--num-blocks", "32", "--speculative-config", bad]) == 2
        assert words in capsys.readouterr().err


@pytest.mark.slow
def test_spec_benchmark_runs_every_method_on_both_workloads_and_checks_equality():
    """``python -m labkit.bench spec`` (the README runs its grounded workload at batch 1 on
    SmolLM2), here on tiny-llama: every method beside off, on both workloads at two batch
    sizes; the run itself checks each method's greedy tokens against off's (exit 1 if not)."""
    import json
    import subprocess
    import sys
    from dataclasses import fields

    from labkit.bench import spec
    run = subprocess.run([sys.executable, "-m", "labkit.bench", "spec", "--model", "tiny-llama",
                          "--workloads", "grounded,free", "--batch-sizes", "1,2", "--num-requests", "2",
                          "--max-tokens", "16", "--configs", "off,ngram,draft_layers", "--draft-layers", "1",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["model"] == "tiny-llama" and out["configs"]["draft_layers"]["num_layers"] == 1
    runs = {(r["workload"], r["batch"], r["config"]): r for r in out["runs"]}
    assert sorted(runs) == sorted((w, b, c) for w in ("grounded", "free") for b in (1, 2)
                                  for c in ("off", "ngram", "draft_layers"))
    for (workload, batch, config), r in runs.items():
        off = runs[workload, batch, "off"]
        assert r["requests"] == 2 and r["output_tokens"] == off["output_tokens"] > 0
        if config == "off":
            assert r["same_as_off"] is None and r["drafted"] == r["accepted"] == 0
            continue
        # Each verifying step keeps at least one token: speculation never takes more steps.
        assert r["same_as_off"] is True and r["steps"] <= off["steps"], (workload, batch, config, r)
        assert 0 <= r["accepted"] <= r["drafted"], r
        if config == "draft_layers":                 # the shallow model drafts at every step
            assert r["drafts"] > 0 and r["drafted"] > 0, r
    names = {f.name for f in fields(spec.Run)}
    printed = spec.table([spec.Run(**{k: v for k, v in r.items() if k in names}) for r in out["runs"]], out["loadavg"])
    assert printed.count(" yes") == 8 and " NO" not in printed                 # what it prints without --json
    bad = subprocess.run([sys.executable, "-m", "labkit.bench", "spec", "--configs", "ngram"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "does not start with off" in bad.stderr
