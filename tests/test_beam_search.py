"""Beam search on shared blocks: the beams, in order, of Transformers' beam search, and
nothing lost in the engine (preemption, chunked prefill, prefix caching, aborts, policies).

The anchor: ``LLM.beam_search`` equals ``generate(num_beams=k, do_sample=False,
num_return_sequences=k, length_penalty=..., early_stopping=...)`` in fp32: on the random
``tiny-llama`` (fast, with EOS ignored and live, every early-stopping mode) and on
SmolLM2-135M-Instruct with chat prompts (``slow``: CI runs it).
"""

from __future__ import annotations

import random

import pytest
import torch

from labkit import LLM, BeamSearchOutput, BeamSearchParams, SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.model import load_model
from labkit.scheduler import make_scheduler
from labkit.sim.executor import SimExecutor


def hf_beams(hf, prompt: list[int], k: int, new: int, *, length_penalty: float = 1.0,
             early_stopping=False, eos: int | list[int] | None = None) -> list[tuple[list[int], float]]:
    """Transformers' beam search: (output tokens, score) per returned beam, best first,
    each cut to the tokens it generated (HF pads beams that ended early)."""
    with torch.inference_mode():
        g = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                        max_new_tokens=new, num_beams=k, num_return_sequences=k, do_sample=False,
                        length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
                        pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    lengths = (g.beam_indices >= 0).sum(dim=1).tolist()
    return [(row[len(prompt):len(prompt) + n].tolist(), score)
            for row, n, score in zip(g.sequences, lengths, g.sequences_scores.tolist())]


def assert_same_beams(out: BeamSearchOutput, ref: list[tuple[list[int], float]]) -> None:
    assert [s.output_token_ids for s in out.sequences] == [tokens for tokens, _ in ref]
    for seq, (_, score) in zip(out.sequences, ref):
        # The same tokens exactly; scores as sums of fp32 log-probabilities, divided by a
        # length ** penalty (for -1.0, multiplied by up to 13): float noise of the kernels'
        # reductions shows at ~1e-6 of the score, so 1e-5 relative (or 1e-4) holds it.
        assert seq.score == pytest.approx(score, rel=1e-5, abs=1e-4)
        assert seq.tokens == out.prompt_token_ids + seq.output_token_ids


def assert_pool_whole(llm_or_scheduler) -> None:
    scheduler = getattr(llm_or_scheduler, "scheduler", llm_or_scheduler)
    alloc = scheduler.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0, "blocks leaked"
    assert not scheduler.has_unfinished and not scheduler.running and not scheduler.waiting


# ---- the parameters ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    (dict(beam_width=0, max_tokens=4), "beam_width"), (dict(beam_width=11, max_tokens=4), "beam_width"),
    (dict(beam_width=True, max_tokens=4), "beam_width"), (dict(beam_width=2, max_tokens=0), "max_tokens"),
    (dict(beam_width=2, max_tokens=4, length_penalty=float("nan")), "length_penalty"),
    (dict(beam_width=2, max_tokens=4, ignore_eos=1), "ignore_eos"),
    (dict(beam_width=2, max_tokens=4, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, max_tokens=4, early_stopping=1), "early_stopping"),
])
def test_bad_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}"):
        BeamSearchParams(**kwargs)


def sim_engine(num_blocks=64, block_size=4, policy="continuous", prefix=False, **kw) -> Engine:
    alloc = BlockAllocator(num_blocks, block_size, enable_prefix_caching=prefix)
    return Engine(make_scheduler(policy, alloc, max_model_len=512, **kw), SimExecutor(vocab_size=1000))


@pytest.mark.parametrize("kw, params, match", [
    (dict(max_num_seqs=2), BeamSearchParams(3, 8), "max_num_seqs"),
    (dict(num_blocks=10), BeamSearchParams(4, 8), "blocks"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=40), BeamSearchParams(4, 8), "chunked prefill is off"),
    (dict(max_num_batched_tokens=2), BeamSearchParams(3, 8), "max_num_batched_tokens"),
])
def test_requests_that_could_never_run_are_refused(kw, params, match):
    engine = sim_engine(**kw)
    with pytest.raises(ValueError, match=match):
        engine.add_request(list(range(10)), params)
    assert not engine.scheduler.requests and not engine.scheduler.waiting
    tiny = Engine(make_scheduler("continuous", BlockAllocator(64, 4)), SimExecutor(vocab_size=6))
    with pytest.raises(ValueError, match="vocabulary"):
        tiny.add_request([1, 2], BeamSearchParams(4, 3))


# ---- equal to Transformers, on tiny-llama --------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("tiny-llama")
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 13, 22)]
    return {"loaded": loaded, "hf": loaded.hf_model(), "prompts": prompts}


@pytest.mark.parametrize("k", [2, 4])
def test_tiny_equals_transformers_eos_ignored(tiny, k):
    llm = LLM("tiny-llama", num_blocks=128, block_size=4)
    outs = llm.beam_search(tiny["prompts"], BeamSearchParams(k, 16, ignore_eos=True))
    for prompt, out in zip(tiny["prompts"], outs):
        assert_same_beams(out, hf_beams(tiny["hf"], prompt, k, 16))
        assert all(s.finish_reason == "length" for s in out.sequences)
    assert llm.scheduler.num_beam_forks > 0 and llm.scheduler.num_beam_deaths > 0
    assert_pool_whole(llm)


def _likely_token(hf, prompt: list[int], rank: int) -> int:
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    return int(logits.topk(rank + 1).indices[rank])


@pytest.mark.parametrize("length_penalty, early_stopping", [(1.0, False), (0.0, True), (2.0, "never"), (-1.0, False)])
def test_tiny_equals_transformers_with_eos_live(tiny, length_penalty, early_stopping):
    """EOS is a token the model likes (its second choice after the prompt), so hypotheses
    finish early and the length penalty and the stop rule decide."""
    k, new = 3, 12
    llm = LLM("tiny-llama", num_blocks=128, block_size=4)
    ended = []
    for prompt in tiny["prompts"]:
        eos = _likely_token(tiny["hf"], prompt, 1)
        llm.scheduler.eos_token_ids = frozenset({eos})     # the engine's EOS, read per request
        out = llm.beam_search(prompt, BeamSearchParams(k, new, length_penalty=length_penalty,
                                                       early_stopping=early_stopping))[0]
        ref = hf_beams(tiny["hf"], prompt, k, new, length_penalty=length_penalty,
                       early_stopping=early_stopping, eos=eos)
        assert_same_beams(out, ref)
        for s in out.sequences:
            assert (s.finish_reason == "stop") == (s.output_token_ids[-1] == eos and len(s.output_token_ids) <= new)
            ended.append(s.finish_reason == "stop" and len(s.output_token_ids) < new)
    assert any(ended), "no hypothesis ended early: the case does not test EOS"
    assert_pool_whole(llm)


def test_tiny_equals_transformers_with_several_eos_ids(tiny):
    """Three EOS ids, the model's 2nd to 4th choices: with 2k = 4 candidates, three would end
    and one beam of two go on; Transformers keeps (1 + 3) x k and runs two."""
    k, new = 2, 8
    llm = LLM("tiny-llama", num_blocks=128, block_size=4)
    for prompt in tiny["prompts"]:
        eos = [_likely_token(tiny["hf"], prompt, rank) for rank in (1, 2, 3)]
        llm.scheduler.eos_token_ids = frozenset(eos)
        out = llm.beam_search(prompt, BeamSearchParams(k, new))[0]
        assert_same_beams(out, hf_beams(tiny["hf"], prompt, k, new, eos=eos))
        req = llm.engine.add_request(prompt, BeamSearchParams(k, new))
        while req.first_token_time is None:          # up to the first beam step
            llm.engine.step()
        assert len(req.live_beams) == k, "fewer than k beams went on"
        while llm.engine.has_unfinished:
            llm.engine.step()
        llm.engine.release(req)
    assert_pool_whole(llm)


def test_beam_width_one_is_greedy(tiny):
    llm = LLM("tiny-llama", num_blocks=128, block_size=4)
    beams = llm.beam_search(tiny["prompts"], BeamSearchParams(1, 10, ignore_eos=True))
    greedy = llm.generate(tiny["prompts"], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                          use_tqdm=False)
    assert [b.sequences[0].output_token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]
    assert llm.scheduler.num_beam_forks == 0
    assert_pool_whole(llm)


# ---- the engine under pressure: same beams, nothing lost ------------------------------------
CONFIGS = {
    "tiny pool, recompute": dict(num_blocks=30),
    "tiny pool, swap": dict(num_blocks=30, preemption_mode="swap", num_host_blocks=64),
    "tiny pool, swap, host pool full": dict(num_blocks=30, preemption_mode="swap", num_host_blocks=4),
    "chunked prefill, small budget": dict(max_num_batched_tokens=6),
    "prefix caching, tiny pool": dict(num_blocks=30, enable_prefix_caching=True, max_num_batched_tokens=9),
    "static policy": dict(policy="static"),
}


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM("tiny-llama", num_blocks=256, block_size=4)
    return [[s.output_token_ids for s in o.sequences]
            for o in llm.beam_search(tiny["prompts"] * 2, BeamSearchParams(3, 14, ignore_eos=True))]


@pytest.mark.parametrize("name", CONFIGS)
def test_tiny_beams_survive_pressure(tiny, reference, name):
    kw = dict(num_blocks=256, block_size=4) | CONFIGS[name]
    llm = LLM("tiny-llama", **kw)
    outs = llm.beam_search(tiny["prompts"] * 2, BeamSearchParams(3, 14, ignore_eos=True))
    assert [[s.output_token_ids for s in o.sequences] for o in outs] == reference
    if "pool" in name:
        assert llm.scheduler.num_preemptions > 0
    if "host pool full" in name:
        assert llm.scheduler.num_swap_fallbacks > 0
    elif "swap" in name:
        assert llm.scheduler.num_swap_outs > 0 and llm.scheduler.num_swap_ins > 0
    assert_pool_whole(llm)


# ---- the simulator: beams fork and die, blocks are shared and come back ----------------------
def run_sim(engine: Engine, requests: list[tuple[list[int], object]], abort_at: int | None = None):
    reqs = [engine.add_request(p, params) for p, params in requests]
    while engine.has_unfinished:
        engine.step()
        engine.scheduler.allocator.check_invariants()
        if abort_at is not None and engine.num_steps == abort_at:
            for r in reqs:
                engine.abort(r.request_id)
    return reqs


def sim_requests(num: int = 6, width: int = 4):
    rng = random.Random(3)
    return [([rng.randrange(1000) for _ in range(rng.randrange(5, 30))],
             BeamSearchParams(width, rng.randrange(10, 40), ignore_eos=True)) for _ in range(num)]


@pytest.mark.parametrize("policy, kw", [("continuous", dict(num_blocks=70)),
                                        ("continuous", dict(num_blocks=70, prefix=True, max_num_batched_tokens=7)),
                                        ("continuous", dict(num_blocks=70, preemption_mode="swap", num_host_blocks=30)),
                                        ("static", dict(num_blocks=400))])
def test_sim_beams_equal_an_unpressed_run(policy, kw):
    """Beam requests among plain ones (greedy; n = 2 where the policy allows it)."""
    def requests():
        plain = [(list(range(3, 20)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
        if policy == "continuous":
            plain.append((list(range(9)), SamplingParams(max_tokens=9, n=2, temperature=1, ignore_eos=True)))
        return sim_requests()[:3] + plain + sim_requests()[3:]

    def results(reqs):
        return [[(h.output_token_ids, h.score) for h in r.beam_search.outputs()] if r.beam is not None
                else [s.output_token_ids for s in r.seqs] for r in reqs]

    ref = results(run_sim(sim_engine(num_blocks=2000), requests()))
    engine = sim_engine(policy=policy, **kw)
    assert results(run_sim(engine, requests())) == ref
    if policy == "continuous" and not kw.get("prefix"):
        assert engine.scheduler.num_preemptions > 0
    assert_pool_whole(engine.scheduler)


def test_sim_sharing_is_counted_and_copies_only_the_written_last_block():
    engine = sim_engine(num_blocks=200, block_size=4)
    prompt = list(range(10))                       # 3 blocks, the last one half full
    (req,) = run_sim(engine, [(prompt, BeamSearchParams(4, 1, ignore_eos=True))])
    assert len(req.beam_search.outputs()) == 4
    engine = sim_engine(num_blocks=200, block_size=4)
    req = engine.add_request(prompt, BeamSearchParams(4, 8, ignore_eos=True))
    engine.step()                                  # prefill, then the first step forks 1 -> 4 beams
    rec = engine.records[-1]
    assert len(req.live_beams) == 4 and engine.scheduler.num_beam_forks == 3
    assert (rec.num_used_blocks, rec.num_logical_blocks) == (3, 12)
    engine.step()                                  # 4 children write into the shared last block:
    rec = engine.records[-1]                       # 3 copy it, the last writer keeps it
    assert rec.num_copies == 3
    # Then the step: parents with no surviving child died, freeing their private last
    # block; the others' children share it again. The first two blocks stay shared by all.
    lasts = {b.block_table.block_ids[-1] for b in req.live_beams}
    assert rec.num_logical_blocks == 12 and rec.num_used_blocks == 2 + len(lasts)
    assert all(engine.scheduler.allocator.ref_count(b) == 4 for b in req.live_beams[0].block_table.block_ids[:2])
    while engine.has_unfinished:
        engine.step()
        rec = engine.records[-1]
        assert rec.num_logical_blocks >= rec.num_used_blocks
    sched = engine.scheduler
    assert sched.num_beam_deaths > 0
    assert sched.num_beam_forks - sched.num_beam_deaths == 3   # 1 beam became 4; 4 finished
    assert_pool_whole(sched)


@pytest.mark.parametrize("policy", ["continuous", "static"])
@pytest.mark.parametrize("abort_at", [1, 2, 5])
def test_sim_aborts_mid_search_free_everything(policy, abort_at):
    engine = sim_engine(num_blocks=400 if policy == "static" else 60, policy=policy)
    reqs = run_sim(engine, sim_requests(4, 3), abort_at=abort_at)
    assert all(r.finished and r.finished_time is not None for r in reqs)
    assert_pool_whole(engine.scheduler)


def test_eos_hypotheses_and_max_model_len_in_the_simulator():
    """With EOS live, beams that end are kept as hypotheses (no blocks) while the others
    go on; a model length shorter than max_tokens caps the beams."""
    engine = sim_engine(num_blocks=200)
    engine.scheduler.max_model_len = 24
    (req,) = run_sim(engine, [(list(range(10)), BeamSearchParams(3, 50, ignore_eos=True))])
    assert all(len(h.output_token_ids) == 14 for h in req.beam_search.outputs())
    assert_pool_whole(engine.scheduler)


def test_several_eos_ids_keep_enough_candidates_as_transformers():
    """Transformers keeps max(2, 1 + number of EOS ids) x k candidates per step, so that k
    beams go on even when every EOS id ranks first; 2k were too few with 3 EOS ids."""
    from labkit.beam_search import BeamSearch
    search = BeamSearch(BeamSearchParams(2, 10), eos_token_ids=frozenset({11, 12, 13}))
    assert search.num_candidates == 8
    top = {10: -0.1, 11: -1.0, 12: -1.1, 13: -1.2, 14: -1.3, 15: -1.4, 16: -1.5, 17: -1.6}
    step = search.step([([], 0.0, top)], length=1)
    assert [c.token for c in step.running] == [10, 14]          # k beams go on
    assert [h.output_token_ids for h in search.finished] == [[11]]  # EOS among the first k
    assert BeamSearch(BeamSearchParams(2, 10, ignore_eos=True), frozenset({11, 12, 13})).num_candidates == 4
    # The executor is asked for as many log-probabilities per beam; beyond the 20 it reports
    # per token, or the vocabulary, the request is refused with the reason.
    engine = Engine(make_scheduler("continuous", BlockAllocator(64, 4), eos_token_ids=(11, 12, 13)),
                    SimExecutor(vocab_size=1000))
    assert engine.add_request([1, 2, 3], BeamSearchParams(2, 4)).params.logprobs == 8
    assert engine.add_request([1, 2, 3], BeamSearchParams(2, 4, ignore_eos=True)).params.logprobs == 4
    with pytest.raises(ValueError, match="3 EOS ids needs the 24 best tokens"):
        engine.add_request([1, 2, 3], BeamSearchParams(6, 4))
    while engine.has_unfinished:
        engine.step()
    assert_pool_whole(engine.scheduler)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_beam_search_max_new_tokens_must_be_positive(bad):
    from labkit.beam_search import BeamSearch
    with pytest.raises(ValueError, match="max_new_tokens"):
        BeamSearch(BeamSearchParams(2, 10), max_new_tokens=bad)
    assert BeamSearch(BeamSearchParams(2, 10)).max_new_tokens == 10


# ---- SmolLM2-135M-Instruct, chat prompts: the CI anchor --------------------------------------
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.",
             "Explain paging in one sentence."]


@pytest.fixture(scope="module")
def smol():
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)) for q in QUESTIONS]
    llm = LLM(loaded.path or "smollm2-135m", num_blocks=256, block_size=16)
    return {"loaded": loaded, "hf": loaded.hf_model(), "prompts": prompts, "llm": llm}


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_smollm2_equals_transformers_eos_ignored(smol, k):
    outs = smol["llm"].beam_search(smol["prompts"], BeamSearchParams(k, 24, ignore_eos=True))
    for prompt, out in zip(smol["prompts"], outs):
        assert_same_beams(out, hf_beams(smol["hf"], prompt, k, 24))
    assert_pool_whole(smol["llm"])


@pytest.mark.slow
def test_smollm2_equals_transformers_with_eos_live(smol):
    """The chat model ends its answers with <|im_end|>: finished hypotheses, early stop."""
    eos = smol["loaded"].eos_token_ids[0]
    prompt = smol["prompts"][0]
    out = smol["llm"].beam_search(prompt, BeamSearchParams(4, 32, length_penalty=1.0))[0]
    assert_same_beams(out, hf_beams(smol["hf"], prompt, 4, 32, eos=eos))
    assert out.sequences[0].finish_reason == "stop" and "Paris" in out.sequences[0].text
    assert_pool_whole(smol["llm"])
