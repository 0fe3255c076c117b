"""Structured outputs: the grammar's mask holds under every way the engine can run a request.

tiny-llama (random weights, a byte-level tokenizer) samples nearly at random among the tokens
a grammar allows, which is the hardest case for a mask: whatever it picks must keep the text
valid. Each test ends with the pool whole (every block back, invariants hold).
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from labkit import LLM, SamplingParams, StructuredOutputsParams
from labkit.structured.bitmask import allocate_bitmask, allowed_tokens, apply_bitmask, apply_bitmask_reference, unpack

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["student", "teacher"]},
                         "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
                                  "maxItems": 3}},
          "required": ["name", "age", "role", "tags"]}
REGEX = r"[A-Z][a-z]{2,6}-\d{2,4}"
CHOICES = ["red", "green", "blue", 'say "hi"']
PROMPTS = ["Describe a person:", "x", "A longer prompt that fills more than one block of the cache, surely"]


def constrained(kind: str, max_tokens: int = 64, **options) -> SamplingParams:
    spec = {"json": StructuredOutputsParams(json=PERSON), "regex": StructuredOutputsParams(regex=REGEX),
            "choice": StructuredOutputsParams(choice=CHOICES),
            "object": StructuredOutputsParams(json_object=True)}[kind]
    return SamplingParams(max_tokens=max_tokens, temperature=options.pop("temperature", 0.0),
                          structured_outputs=spec, **options)


def assert_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def assert_pool_whole(llm: LLM) -> None:
    alloc = llm.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0, "blocks leaked"
    assert not llm.scheduler.has_unfinished
    grammars = llm.engine.executor._grammars
    if grammars is not None:
        grammars.forget_finished()
        assert grammars.num_tracked_requests == 0, "matchers of finished requests kept"


# ---- params ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, says", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "exactly one"),
    ({"regex": "[a-z"}, "regex: Regex parsing error"),
    ({"regex": ""}, "non-empty string"),
    ({"json": '{"type": "foo"}'}, 'json: Unsupported type "foo"'),
    ({"json": "{not json"}, "json: not valid JSON"),
    ({"json": "[1, 2]"}, "a JSON Schema is an object"),
    ({"json": 3}, "must be a JSON Schema"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty list"),
    ({"grammar": 'root ::= "a" | '}, "grammar: EBNF parser error"),
    ({"grammar": "start: undefined_rule"}, "grammar: Lark error"),
    ({"json_object": "yes"}, "json_object"),
    ({"regex": "a", "disable_any_whitespace": "no"}, "disable_any_whitespace"),
])
def test_bad_specs_name_the_problem(kwargs, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("field, value", [("stop", ["}"]), ("stop_token_ids", [5]), ("min_tokens", 3),
                                          ("ignore_eos", True)])
def test_options_that_would_cut_or_extend_the_grammar_are_refused(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}=.*cannot be combined with structured_outputs"):
        SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"), **{field: value})


def test_keys_are_canonical_and_keep_property_order():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type":"object",  "properties": {"b": {}, "a": {}}}')
    c = StructuredOutputsParams(json={"type": "object", "properties": {"a": {}, "b": {}}})
    assert a.key() == b.key() != c.key()
    assert StructuredOutputsParams(choice=("x", "y")).key() == StructuredOutputsParams(choice=["x", "y"]).key()
    assert a.key() != StructuredOutputsParams(json=a.json, disable_any_whitespace=False).key()


def test_choice_grammar_keeps_quotes_backslashes_and_newlines_literal():
    import xgrammar as xgr

    from labkit.model.loader import byte_tokenizer
    from labkit.structured.compiler import GrammarCache

    choices = ['a "quoted" word', "back\\slash", "two\nlines", "ünïcode"]
    compiled = GrammarCache(byte_tokenizer(), 384, [257]).compile(StructuredOutputsParams(choice=choices))
    for text in choices:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert m.accept_string(text) and m.is_completed(), text
    for text in ['a "quoted', 'a \\"quoted\\" word', "two\\nlines"]:
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert not (m.accept_string(text) and m.is_completed()), text


# ---- the bitmask ---------------------------------------------------------------------------
def test_bitmask_kernel_equals_the_torch_reference():
    torch.manual_seed(0)
    vocab = 100                                     # not a multiple of 32: the last word is partial
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, 4), dtype=torch.int32)
    logits = torch.randn(5, vocab)
    ref, ker = logits.clone(), logits.clone()
    apply_bitmask_reference(ref, bitmask, [0, 2, 4])
    apply_bitmask(ker, bitmask, [0, 2, 4])
    assert torch.equal(ref, ker)
    assert torch.equal(ref[1], logits[1]) and torch.equal(ref[3], logits[3]), "rows not asked were touched"
    allowed = unpack(bitmask, vocab)
    assert torch.equal(torch.isinf(ref[0]), ~allowed[0])
    assert allowed_tokens(bitmask[2], vocab) == torch.nonzero(allowed[2]).flatten().tolist()


def test_bitmask_bit_order():
    bitmask = allocate_bitmask(1, 70)
    bitmask.zero_()
    bitmask[0, 0] = 1 << 5
    bitmask[0, 2] = 1 << 1                          # token 65 = word 2, bit 1
    assert allowed_tokens(bitmask[0], 70) == [5, 65]


# ---- the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    llm = LLM("tiny-llama", num_blocks=128, block_size=8, max_num_seqs=16)
    yield llm
    assert_pool_whole(llm)


@pytest.mark.parametrize("kind", ["json", "regex", "choice", "object"])
def test_every_output_that_stops_is_valid(tiny, kind):
    # Random weights write long strings; a bias towards closing them lets some outputs end.
    closing = {ord(c): 6.0 for c in '"}]'} if kind == "object" else None
    outs = tiny.generate(PROMPTS, constrained(kind, max_tokens=96, temperature=1.0, n=4, seed=0, logit_bias=closing),
                         use_tqdm=False)
    stopped = 0
    for c in (c for out in outs for c in out.outputs):
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            assert_valid(kind, c.text)
            stopped += 1
    assert stopped, "no output stopped: the test proves nothing"
    assert_pool_whole(tiny)


def test_cut_by_max_tokens_is_length_and_a_prefix_of_valid_text(tiny):
    out = tiny.generate("x", constrained("json", max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    assert '{"name": "'.startswith(out.text) and out.text   # the schema's forced opening, cut short


def test_mixed_batch_rows_that_do_not_ask_are_untouched(tiny):
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, plain, use_tqdm=False)]
    mixed = tiny.generate(PROMPTS * 2, [plain] * 3 + [constrained("regex")] * 3, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        assert_valid("regex", o.outputs[0].text)


def test_unconstrained_requests_never_load_the_grammar_engine():
    llm = LLM("tiny-llama", num_blocks=32)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4), use_tqdm=False)
    assert llm.engine.executor._grammars is None


def test_the_mask_comes_before_bias_and_penalties(tiny):
    # A +100 bias on every letter the regex forbids, and a repetition penalty: neither can
    # bring a forbidden token back (byte-level tokenizer: token id = byte value).
    bias = {b: 100.0 for b in range(ord("a"), ord("z") + 1) if b not in (ord("q"), ord("z"))}
    params = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=bias, repetition_penalty=1.5,
                            structured_outputs=StructuredOutputsParams(regex="[qz]{3,8}"))
    for o in tiny.generate(PROMPTS, params, use_tqdm=False):
        assert re.fullmatch("[qz]{3,8}", o.outputs[0].text), o.outputs[0].text


def test_n_samples_and_seeds(tiny):
    params = constrained("regex", temperature=1.0, n=4, seed=7)
    first = tiny.generate(PROMPTS[:2], params, use_tqdm=False)
    again = tiny.generate(PROMPTS[:2], params, use_tqdm=False)
    for a, b in zip(first, again):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len(a.outputs) == 4
        for c in a.outputs:
            if c.finish_reason == "stop":
                assert_valid("regex", c.text)
    texts = {c.text for o in first for c in o.outputs}
    assert len(texts) > 1, "n samples with temperature 1 all equal: the samples do not sample"
    assert_pool_whole(tiny)


def test_logprobs_are_read_after_the_mask(tiny):
    # choice between two words that differ in their first byte: the first step allows
    # exactly two tokens, so their masked probabilities sum to one.
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5,
                            structured_outputs=StructuredOutputsParams(choice=["apple", "berry"]))
    c = tiny.generate("pick", params, use_tqdm=False)[0].outputs[0]
    first = c.logprobs[0]
    assert set(first) == {ord("a"), ord("b")}, "a token the grammar forbids was reported"
    assert math.isclose(sum(math.exp(lp.logprob) for lp in first.values()), 1.0, rel_tol=1e-5)
    assert all(math.isfinite(lp.logprob) for step in c.logprobs for lp in step.values())
    assert all(lp.logprob == 0.0 for step in c.logprobs[1:] for lp in step.values()), \
        "after the first letter every token is forced: probability 1"


@pytest.mark.parametrize("options", [
    dict(num_blocks=24, block_size=4),                                         # preemption by recompute
    dict(num_blocks=24, block_size=4, preemption_mode="swap", num_host_blocks=64),
    dict(num_blocks=64, block_size=4, enable_prefix_caching="radix"),
    dict(num_blocks=64, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=8),  # chunked prefill
    dict(num_blocks=128, block_size=4, policy="static"),
])
def test_outputs_do_not_depend_on_memory_pressure_or_policy(tiny, options):
    prompts = [f"person {i}" for i in range(6)]
    params = constrained("json", max_tokens=40)
    reference = [o.outputs[0].text for o in tiny.generate(prompts, params, use_tqdm=False)]
    llm = LLM("tiny-llama", max_num_seqs=6, **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == reference
    if options["num_blocks"] == 24:
        assert llm.stats()["num_preemptions"] > 0, "the pool was meant to be too small"
    if options.get("preemption_mode") == "swap":
        assert llm.stats()["num_swap_ins"] > 0, "nothing was swapped"
    assert_pool_whole(llm)


def test_streaming_deltas_add_up_to_the_valid_text(tiny):
    pieces: dict[str, list[str]] = {}
    finals = {}
    for out in tiny.generate_stream(PROMPTS, constrained("choice")):
        pieces.setdefault(out.request_id, []).append(out.delta[0])
        if out.finished:
            finals[out.request_id] = out.outputs[0].text
    for rid, text in finals.items():
        assert "".join(pieces[rid]) == text
        assert_valid("choice", text)
    assert_pool_whole(tiny)


def test_abort_frees_blocks_and_forgets_the_matcher(tiny):
    engine = tiny.engine
    ids = tiny.tokenizer.encode("hello")
    req = engine.add_request(ids, constrained("json", max_tokens=200), request_id="gone")
    keep = engine.add_request(ids, constrained("regex"), request_id="kept")
    for _ in range(4):
        engine.step()
    assert engine.abort("gone")
    while engine.has_unfinished:
        engine.step()
    assert req.seqs[0].finish_reason == "abort"
    assert keep.seqs[0].finish_reason in ("stop", "length")
    engine.release(req)
    engine.release(keep)
    assert_pool_whole(tiny)


def test_a_bad_spec_is_refused_at_add_request_and_others_keep_running(tiny):
    engine = tiny.engine
    ids = tiny.tokenizer.encode("hello")
    running = engine.add_request(ids, constrained("regex"))
    engine.step()
    params = SamplingParams(max_tokens=8)
    params.structured_outputs = StructuredOutputsParams(regex="a+")
    params.structured_outputs.regex = "(unclosed"           # mutated after it was checked
    with pytest.raises(ValueError, match="regex"):
        engine.add_request(ids, params)
    while engine.has_unfinished:
        engine.step()
    assert running.seqs[0].finish_reason in ("stop", "length")
    engine.release(running)
    assert_pool_whole(tiny)


def test_the_simulator_refuses_a_grammar():
    from labkit.engine import Engine
    from labkit.memory import BlockAllocator
    from labkit.scheduler import Scheduler
    from labkit.sim.executor import SimExecutor

    engine = Engine(Scheduler(BlockAllocator(16, 4)), SimExecutor())
    with pytest.raises(ValueError, match="simulator"):
        engine.add_request([1, 2, 3], constrained("regex"))
    assert not engine.has_unfinished


@pytest.mark.gpu
def test_on_a_gpu_the_mask_holds_and_jumps_change_nothing():
    """The bitmask is filled on the CPU and applied on the GPU (XGrammar's Triton kernel)."""
    outs = {}
    for jump in (False, True):
        llm = LLM("tiny-llama", num_blocks=128, device="cuda", jump_forward=jump)
        outs[jump] = llm.generate(PROMPTS, constrained("json", max_tokens=64), use_tqdm=False)
        for o in outs[jump]:
            if o.outputs[0].finish_reason == "stop":
                assert_valid("json", o.outputs[0].text)
        assert_pool_whole(llm)
    assert [o.outputs[0].token_ids for o in outs[True]] == [o.outputs[0].token_ids for o in outs[False]]


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    {"method": "draft_layers", "num_layers": 1, "num_speculative_tokens": 3},
], ids=["ngram", "draft_layers"])
def test_speculation_keeps_to_the_grammar(tiny, spec):
    """With speculation on, a constrained sequence's guesses are cut before the first token its
    grammar forbids: the outputs are the constrained outputs without speculation, every
    stopped one valid, and guesses were both drafted and kept (else this proves nothing)."""
    prompts = [f"person {i}: " + "ab " * i for i in range(4)]
    for kind in ("json", "regex", "choice"):
        params = constrained(kind, max_tokens=40)
        reference = [o.outputs[0] for o in tiny.generate(prompts, params, use_tqdm=False)]
        # jump-forward off: the guesses checked against the mask are the method's own
        llm = LLM("tiny-llama", num_blocks=128, block_size=8, max_num_seqs=16, speculative_config=spec,
                  jump_forward=False)
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        assert [(c.token_ids, c.finish_reason) for c in outs] == [(c.token_ids, c.finish_reason) for c in reference]
        for c in outs:
            if c.finish_reason == "stop":
                assert_valid(kind, c.text)
        if kind != "choice":           # a few words: nothing in them for a guess to find
            stats = llm.stats()
            assert stats["spec_decode_num_draft_tokens"] > 0, f"{kind}: nothing was guessed"
            assert stats["spec_decode_num_accepted_tokens"] > 0, f"{kind}: no guess was kept"
        assert_pool_whole(llm)
