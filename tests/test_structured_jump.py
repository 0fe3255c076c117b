"""Jump-forward decoding: drafting the tokens a grammar forces never changes the output.

Every test compares an engine with jump-forward on against the same engine with it off
(step-by-step masked decoding): greedy tokens, seeded samples, log-probabilities and finish
reasons must be the same, under memory pressure, swapping, chunking, both policies, n > 1
and aborts, and every block must come back.

tiny-llama's byte tokenizer spells every text one way, so there its drafts are always
accepted. A second tokenizer here merges a few pairs (``{"``, ``":``, ``name``...): the grammar
then drafts one spelling of a forced text and the random model often prefers another, which
exercises rejection and the slots it gives back.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from labkit import SamplingParams, StructuredOutputsParams
from labkit.engine import Engine
from labkit.executor import ModelExecutor
from labkit.memory import BlockAllocator, BlockTable
from labkit.model.loader import BYTE_OF_CHAR, LoadedModel, random_state_dict, tiny_config, tiny_llama
from labkit.model.runner import ModelRunner
from labkit.scheduler import make_scheduler

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "role": {"enum": ["student", "teacher", "nurse"]},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age", "role", "tags"]}
PROMPTS = [[5 + i, 40 + 3 * i, 77, 100 + i] for i in range(6)]
MERGES = [("{", '"'), ('"', ":"), ('":', "Ġ"), ("n", "a"), ("m", "e"), ("na", "me"), ('"', "Ġ"), (",", "Ġ"),
          ("a", "g"), ("ag", "e"), ('{"', "name"), ("r", "o"), ("ro", "le"), ("l", "e"), ('"', ","), ("t", "a"),
          ("ta", "g"), ("tag", "s"), ("e", "a"), ("c", "h"), ("e", "r"), ("ch", "er")]


def merged_tokenizer():
    """A byte-level BPE tokenizer with a few merges, so that a text can be spelled several ways."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet(), key=lambda ch: BYTE_OF_CHAR[ch]))}
    for s in ["<s>", "</s>", "<pad>"]:
        vocab[s] = len(vocab)
    for a, b in MERGES:
        vocab.setdefault(a + b, len(vocab))
    tk = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


@pytest.fixture(scope="module")
def models():
    tok = merged_tokenizer()
    config = tiny_config(vocab_size=len(tok), bos_token_id=256, eos_token_id=257, pad_token_id=258)
    merged = LoadedModel("tiny-merged", config, random_state_dict(config, seed=5), tok)
    return {"bytes": tiny_llama(), "merged": merged}


def make_engine(loaded, jump: bool, *, num_blocks=256, block_size=4, policy="continuous", max_num_seqs=8,
                max_num_batched_tokens=512, prefix="hash", preemption_mode="recompute", num_host_blocks=0) -> Engine:
    runner = ModelRunner(loaded, block_size=block_size, num_blocks=num_blocks)
    allocator = BlockAllocator(num_blocks, block_size, prefix)
    scheduler = make_scheduler(policy, allocator, max_num_seqs=max_num_seqs, max_model_len=runner.max_model_len,
                               eos_token_ids=runner.eos_token_ids, max_num_batched_tokens=max_num_batched_tokens,
                               preemption_mode=preemption_mode, num_host_blocks=num_host_blocks)
    host = runner.kv_cache.host_pool(num_host_blocks) if num_host_blocks else None
    return Engine(scheduler, ModelExecutor(runner, host, jump_forward=jump), tokenizer=runner.tokenizer)


def run(engine: Engine, params, prompts=PROMPTS, abort_after: dict | None = None) -> list:
    """Serve ``prompts``; return per request (token ids per sample, finish reasons, logprobs)."""
    requests = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    steps = 0
    while engine.has_unfinished:
        engine.step()
        steps += 1
        for rid, at in (abort_after or {}).items():
            if steps == at:
                engine.abort(rid)
    out = []
    for r in requests:
        out.append([(s.output_token_ids, s.finish_reason,
                     None if s.logprobs is None else [{t: lp.logprob for t, lp in e.items()} for e in s.logprobs])
                    for s in r.seqs])
        engine.release(r)
    return out


def assert_same(got: list, reference: list) -> None:
    """The same tokens and finish reasons; the same logprobs up to float noise (a jump computes
    its positions in one chunk, a step-by-step run one at a time: the sums run in other orders)."""
    assert [[(t, r) for t, r, _ in req] for req in got] == [[(t, r) for t, r, _ in req] for req in reference]
    for req, ref in zip(got, reference):
        for (_, _, lp), (_, _, lp_ref) in zip(req, ref):
            if lp_ref is None:
                assert lp is None
                continue
            assert [set(e) for e in lp] == [set(e) for e in lp_ref]
            for e, e_ref in zip(lp, lp_ref):
                assert all(abs(e[t] - e_ref[t]) < 1e-3 for t in e)


def assert_whole(engine: Engine) -> None:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0, "blocks leaked"
    assert not engine.scheduler.has_unfinished


def json_params(**options) -> SamplingParams:
    return SamplingParams(max_tokens=options.pop("max_tokens", 60), temperature=options.pop("temperature", 0.0),
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **options)


def both(loaded, params, prompts=PROMPTS, **options):
    """(outputs without jump-forward, outputs with it, the jumping engine)."""
    plain = make_engine(loaded, False, **options)
    reference = run(plain, params, prompts)
    assert_whole(plain)
    jumping = make_engine(loaded, True, **options)
    got = run(jumping, params, prompts)
    assert_whole(jumping)
    return reference, got, jumping


# ---- the property: same output --------------------------------------------------------------
@pytest.mark.parametrize("model", ["bytes", "merged"])
def test_greedy_output_equals_step_by_step(models, model):
    reference, got, engine = both(models[model], json_params())
    assert_same(got, reference)
    stats = engine.executor.jump.stats
    assert stats.num_accepted > 0, "nothing was jumped: the test proves nothing"
    if model == "bytes":
        assert stats.num_accepted == stats.num_drafted   # one spelling: every draft is the model's only choice
    else:
        assert stats.num_accepted < stats.num_drafted, "no draft was rejected: the rejection path went untested"
    for samples in got:
        tokens, reason, _ = samples[0]
        if reason == "stop":
            text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), SCHEMA)


def test_jumps_take_fewer_steps(models):
    params = json_params()
    steps = {}
    for jump in (False, True):
        engine = make_engine(models["bytes"], jump)
        run(engine, params, PROMPTS[:1])
        steps[jump] = engine.num_steps
    assert steps[True] < steps[False]


@pytest.mark.parametrize("model", ["bytes", "merged"])
def test_seeded_samples_and_logprobs_equal_step_by_step(models, model):
    params = json_params(temperature=1.0, seed=11, logprobs=3, n=2, repetition_penalty=1.3)
    reference, got, _ = both(models[model], params)
    assert_same(got, reference)
    for samples in got:
        for tokens, _, logprobs in samples:
            assert len(logprobs) == len(tokens)


@pytest.mark.parametrize("options", [
    dict(num_blocks=40, block_size=4, max_num_seqs=6),                                   # preemption
    dict(num_blocks=40, block_size=4, max_num_seqs=6, preemption_mode="swap", num_host_blocks=200),
    dict(max_num_batched_tokens=8),                                                      # drafts cut by the budget
    dict(policy="static", num_blocks=400),
    dict(prefix="radix", block_size=2),
])
def test_same_output_under_pressure_and_policies(models, options):
    reference, got, engine = both(models["merged"], json_params(max_tokens=50), **options)
    assert_same(got, reference)
    stats = engine.scheduler.stats() if hasattr(engine.scheduler, "stats") else {}
    if options.get("num_blocks") == 40:
        assert engine.scheduler.num_preemptions > 0, "the pool was meant to be too small"
    if options.get("max_num_batched_tokens") == 8:
        assert engine.executor.jump.stats.num_dropped > 0, "no draft was cut by the token budget"
    del stats


def test_drafts_never_pass_max_tokens(models):
    for max_tokens in (1, 2, 3, 7, 13):
        reference, got, _ = both(models["merged"], json_params(max_tokens=max_tokens), PROMPTS[:2])
        assert_same(got, reference)
        for samples in got:
            assert len(samples[0][0]) <= max_tokens


def test_abort_leaves_no_draft_behind(models):
    engine = make_engine(models["merged"], True)
    params = json_params(max_tokens=60)
    requests = [engine.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    reference = run(make_engine(models["merged"], False), params)
    for step in range(40):
        if not engine.has_unfinished:
            break
        engine.step()
        if step == 3:
            engine.abort("r2")
        for r in requests:                      # between steps no sequence holds a draft
            for seq in r.seqs:
                assert seq.output_token_ids == reference[int(r.request_id[1:])][seq.index][0][:seq.num_output_tokens]
    while engine.has_unfinished:
        engine.step()
    assert requests[2].seqs[0].finish_reason == "abort"
    for r in requests:
        engine.release(r)
    assert_whole(engine)


def test_the_switch(models):
    engine = make_engine(models["bytes"], False)
    run(engine, json_params(), PROMPTS[:2])
    assert engine.executor.jump is None
    engine.executor.jump_forward = True
    run(engine, json_params(), PROMPTS[:2])
    assert engine.executor.jump.stats.num_accepted > 0
    assert_whole(engine)


def test_a_jump_shows_in_the_step_records_as_a_decode_of_several_tokens(models):
    engine = make_engine(models["bytes"], True)
    run(engine, json_params(), PROMPTS[:1])
    decodes = [n for r in engine.records for (_, _, n, phase) in r.ran if phase == "decode"]
    assert max(decodes) > 1
    assert engine.scheduler.num_prompt_tokens_computed == len(PROMPTS[0])


# ---- BlockTable.truncate ------------------------------------------------------------------------
def test_truncate_gives_back_slots_and_empty_blocks():
    alloc = BlockAllocator(16, 4)
    table = BlockTable(alloc)
    table.append_tokens(range(6), computed=False)
    table.append_tokens(range(7), computed=False)            # 13 tokens: 4 blocks
    assert table.num_blocks == 4
    table.truncate(9)
    assert table.num_tokens == 9 and table.num_blocks == 3 and alloc.num_used_blocks == 3
    assert alloc.fill(table.block_ids[-1]) == 1
    alloc.check_invariants()
    table.truncate(8)                                        # a block boundary: the third block goes
    assert table.num_blocks == 2 and alloc.fill(table.block_ids[-1]) == 4
    with pytest.raises(ValueError):
        table.truncate(9)
    table.free()
    assert alloc.num_used_blocks == 0
    alloc.check_invariants()


def test_truncate_keeps_reserved_blocks_when_asked_and_never_cuts_published_ones():
    alloc = BlockAllocator(16, 4)
    table = BlockTable(alloc)
    table.reserve(16)
    table.append_tokens(range(10), computed=False)
    table.truncate(5, free_empty_blocks=False)
    assert table.num_blocks == 4 and alloc.num_used_blocks == 4 and table.num_tokens == 5
    alloc.check_invariants()
    table.free()
    cached = BlockAllocator(16, 4, "hash")
    t = BlockTable(cached)
    t.append_tokens(range(10))                               # computed: two full blocks published
    with pytest.raises(ValueError, match="prefix cache"):
        t.truncate(6)
    t.truncate(8)
    t.free()
    cached.check_invariants()


def test_regex_with_forced_stretches_holds(models):
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured_outputs=StructuredOutputsParams(regex=r"name: [a-z]{2,5}; age: [0-9]{1,2};"))
    reference, got, engine = both(models["merged"], params)
    assert_same(got, reference)
    for samples in got:
        tokens, reason, _ = samples[0]
        assert reason == "stop"
        text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
        assert re.fullmatch(r"name: [a-z]{2,5}; age: [0-9]{1,2};", text)
