"""The sampling API: log-probabilities, penalties, logit bias and min-p (issue 19).

References are Transformers in fp32 on the same weights: ``log_softmax`` of its logits for
logprobs, its ``generate`` with the matching logits processor for greedy under a penalty,
and a plain per-step loop (``reference_greedy``) for what no Transformers processor does
(OpenAI's presence/frequency penalties). tiny-llama (random, fast) runs everywhere; the
real model (SmolLM2-135M) runs in CI under ``slow``.
"""

from __future__ import annotations

import copy
import math
import random

import numpy as np
import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.model import load_model
from labkit.model.runner import SeqChunk, pack_chunks
from labkit.model.sampler import PenaltyRow, SamplingRow, apply_penalties, probabilities

from test_engine import QUESTIONS, assert_pool_whole

TOL = 1e-4          # abs tolerance on a logprob: fp32 paged attention vs Transformers' eager
NEW = 16


# ---- references -------------------------------------------------------------------------
def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """``log_softmax`` of Transformers' logits over ``ids``: row p predicts token p + 1."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def hf_generate(hf, ids: list[int], max_new_tokens: int, **processors) -> list[int]:
    """Transformers' greedy ``generate`` with EOS ignored and the given processor settings."""
    config = copy.deepcopy(hf.generation_config)
    config.update(eos_token_id=[], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **processors)
    x = torch.tensor([ids])
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
    return y[0, len(ids):].tolist()


def reference_greedy(hf, ids: list[int], max_new_tokens: int, *, presence=0.0, frequency=0.0,
                     repetition=1.0, bias=None) -> list[int]:
    """Greedy decoding with Transformers' model (the whole sequence each step: no cache API, which
    Transformers 5 renames), the logit processing written out token by token in plain Python: the
    definition of the order in docs/sampling.md."""
    seq, out = list(ids), []
    for _ in range(max_new_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([seq])).logits[0, -1].float().tolist()
        for t, b in (bias or {}).items():
            logits[t] += b
        for t in set(seq):
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):
            logits[t] -= presence + frequency * out.count(t)
        nxt = max(range(len(logits)), key=logits.__getitem__)
        seq.append(nxt)
        out.append(nxt)
    return out


def check_logprobs_against(lp: torch.Tensor, chosen: int, entry: dict, k: int) -> None:
    """One position's entry vs the reference distribution ``lp`` [V]."""
    assert chosen in entry and len(entry) in (k, k + 1)
    got = entry[chosen]
    assert abs(got.logprob - lp[chosen].item()) < TOL
    # rank: 1 + tokens strictly more likely, within the tolerance either way
    assert int((lp > lp[chosen] + TOL).sum()) + 1 <= got.rank <= int((lp > lp[chosen] - TOL).sum()) + 1
    assert sum(e.rank <= k for e in entry.values()) == k, "the k most likely tokens, each ranked"
    top = lp.topk(k).values if k else lp[:0]
    for t, e in entry.items():
        assert abs(e.logprob - lp[t].item()) < TOL
        if e.rank <= k:     # the rank-r entry holds Transformers' r-th largest logprob
            assert abs(e.logprob - top[e.rank - 1].item()) < TOL


def check_request(hf, out, k_sample: int | None, k_prompt: int | None) -> None:
    """Every prompt and generated logprob of ``out`` equals Transformers' at that position."""
    for sample in out.outputs:
        ids = out.prompt_token_ids + sample.token_ids
        lp = hf_logprobs(hf, ids)
        P = len(out.prompt_token_ids)
        if k_prompt is None:
            assert out.prompt_logprobs is None
        else:
            assert len(out.prompt_logprobs) == P and out.prompt_logprobs[0] is None
            for i in range(1, P):
                check_logprobs_against(lp[i - 1], ids[i], out.prompt_logprobs[i], k_prompt)
        if k_sample is None:
            assert sample.logprobs is None and sample.cumulative_logprob is None
            continue
        assert len(sample.logprobs) == len(sample.token_ids)
        for j, t in enumerate(sample.token_ids):
            check_logprobs_against(lp[P + j - 1], t, sample.logprobs[j], k_sample)
        assert math.isclose(sample.cumulative_logprob, sum(e[t].logprob for e, t in
                                                           zip(sample.logprobs, sample.token_ids)), abs_tol=1e-6)


# ---- fixtures ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("tiny-llama")
    rng = random.Random(1)
    V = loaded.config.vocab_size
    system = [rng.randrange(3, V) for _ in range(40)]
    prompts = [system + [rng.randrange(3, V) for _ in range(n)] for n in (3, 17, 30)] + \
              [[rng.randrange(3, V) for _ in range(n)] for n in (1, 9, 50)]
    return {"loaded": loaded, "hf": loaded.hf_model(), "prompts": prompts, "system": system}


@pytest.fixture(scope="module")
def smol():
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    system = ("You are a patient teacher of computer systems. Answer clearly, precisely and briefly. ") * 2

    def chat(q, sys_prompt=None):
        msgs = ([{"role": "system", "content": sys_prompt}] if sys_prompt else []) + [{"role": "user", "content": q}]
        return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))

    prompts = [chat(q, system) for q in QUESTIONS[:3]] + [chat(QUESTIONS[5])]
    return {"loaded": loaded, "hf": loaded.hf_model(), "prompts": prompts, "system": chat("", system)[:40]}


def _mixed_batch_logprobs(data, path, new_tokens):
    """A mixed batch (chunked prefill on, prefix cache warm): requests with and without
    logprobs / prompt_logprobs, checked position by position against Transformers."""
    llm = LLM(path, num_blocks=256, block_size=8, max_num_batched_tokens=24, enable_prefix_caching=True)
    prompts = data["prompts"]
    # Warm the prefix cache with the shared system prompt.
    llm.generate([prompts[0]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    kinds = [(5, 3), (None, None), (0, 0), (2, None), (None, 4)]
    params = [SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=ks, prompt_logprobs=kp)
              for ks, kp in kinds]
    chosen = [prompts[i % len(prompts)] for i in range(len(kinds))]
    outs = llm.generate(chosen, params, use_tqdm=False)
    for out, (ks, kp) in zip(outs, kinds):
        check_request(data["hf"], out, ks, kp)
        if kp is not None:
            assert out.num_cached_tokens == 0, "prompt_logprobs must not read its prompt from the cache"
    assert outs[1].num_cached_tokens > 0, "a request without prompt_logprobs reads the prefix cache"
    assert llm.stats()["num_cached_prompt_tokens"] > 0
    assert_pool_whole(llm)


def test_tiny_logprobs_equal_hf_in_a_mixed_chunked_cached_batch(tiny):
    _mixed_batch_logprobs(tiny, "tiny-llama", 12)


@pytest.mark.slow
def test_smollm2_logprobs_equal_hf_in_a_mixed_chunked_cached_batch(smol):
    _mixed_batch_logprobs(smol, smol["loaded"].path or "smollm2-135m", NEW)


# ---- penalties under greedy ------------------------------------------------------------
def _penalty_cases(prompt: list[int]):
    favourite = prompt[-1]
    return [
        ("repetition", dict(repetition_penalty=1.5), dict(repetition_penalty=1.5), dict(repetition=1.5)),
        ("repetition<1", dict(repetition_penalty=0.7), dict(repetition_penalty=0.7), dict(repetition=0.7)),
        ("bias", dict(logit_bias={favourite: 4.0, 5: -100.0}),
         dict(sequence_bias=[[[favourite], 4.0], [[5], -100.0]]), dict(bias={favourite: 4.0, 5: -100.0})),
        ("presence", dict(presence_penalty=1.5), None, dict(presence=1.5)),
        ("frequency", dict(frequency_penalty=0.8), None, dict(frequency=0.8)),
        ("all", dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2, logit_bias={favourite: 2.0}),
         None, dict(presence=0.5, frequency=0.5, repetition=1.2, bias={favourite: 2.0})),
    ]


def _greedy_penalties(data, path, new_tokens, num_prompts):
    """Every penalty case on every prompt, all in one batch (each row processed its own way)."""
    hf = data["hf"]
    prompts = data["prompts"][:num_prompts]
    cases = _penalty_cases(prompts[0])
    llm = LLM(path, num_blocks=256, block_size=8, max_num_batched_tokens=32)
    batch = [(None, p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)) for p in prompts]
    batch += [(case, p, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=1, **case[1]))
              for case in cases for p in prompts]
    outs = llm.generate([b[1] for b in batch], [b[2] for b in batch], use_tqdm=False)
    plain = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    for (case, prompt, _), out in zip(batch[len(prompts):], outs[len(prompts):]):
        name, _, hf_kw, ref_kw = case
        got = out.outputs[0].token_ids
        ref = (hf_generate(hf, prompt, new_tokens, **hf_kw) if hf_kw is not None
               else reference_greedy(hf, prompt, new_tokens, **ref_kw))
        assert got == ref, name
        if prompt is prompts[0]:
            assert got != plain[tuple(prompt)], f"{name}: the penalty changed nothing, so this test could not fail"
            # logprobs stay raw: the penalty changes the choice, not the reported distribution
            check_request(hf, out, 1, None)
    assert_pool_whole(llm)


def test_tiny_greedy_under_each_penalty_equals_transformers(tiny):
    _greedy_penalties(tiny, "tiny-llama", 32, 3)   # random weights repeat after ~25 tokens


@pytest.mark.slow
def test_smollm2_greedy_under_each_penalty_equals_transformers(smol):
    _greedy_penalties(smol, smol["loaded"].path or "smollm2-135m", NEW, 2)


def test_penalties_as_tensor_ops_match_the_plain_reference():
    torch.manual_seed(0)
    V = 50
    logits = torch.randn(3, V) * 3
    rows = [PenaltyRow([1, 2, 2, 7, 7, 7], 2, 1.3, 0.4, 0.6, {3: 1.5, 7: -2.0}),
            PenaltyRow([4, 4], 2, 1.0, 0.0, 0.0, None),
            PenaltyRow([9, 1, 9, 9], 1, 0.8, -0.5, 0.25, {0: 100.0})]
    got = apply_penalties(logits, rows)
    for i, r in enumerate(rows):
        ref = logits[i].tolist()
        for t, b in (r.logit_bias or {}).items():
            ref[t] += b
        for t in set(r.token_ids):
            ref[t] = ref[t] / r.repetition_penalty if ref[t] > 0 else ref[t] * r.repetition_penalty
        out = r.token_ids[r.num_prompt_tokens:]
        for t in set(out):
            ref[t] -= r.presence_penalty + r.frequency_penalty * out.count(t)
        assert torch.allclose(got[i], torch.tensor(ref), atol=1e-5)
    assert torch.equal(got[1], logits[1]), "a row with nothing asked is unchanged"


# ---- min-p --------------------------------------------------------------------------------
def test_min_p_draws_only_allowed_tokens(tiny):
    llm = LLM("tiny-llama", num_blocks=256, block_size=8)
    prompts = tiny["prompts"][3:6]

    def ratios(min_p, temperature):
        params = SamplingParams(max_tokens=24, temperature=temperature, min_p=min_p, seed=7, n=4,
                                ignore_eos=True, logprobs=1)
        out = []
        for o in llm.generate(prompts, params, use_tqdm=False):
            for s in o.outputs:
                for t, e in zip(s.token_ids, s.logprobs):
                    top = max(v.logprob for v in e.values())
                    out.append(math.exp((e[t].logprob - top) / temperature))  # p / p_max after temperature
        return out

    for temperature in (1.0, 0.7):
        allowed = ratios(0.3, temperature)
        assert min(allowed) >= 0.3 - 1e-4
        assert any(r < 1 for r in allowed), "all draws were the argmax: min-p was not exercised"
        assert min(ratios(0.0, temperature)) < 0.3, "without min-p some draws fall below: the test can fail"
    assert_pool_whole(llm)


def test_min_p_in_the_sampler_masks_below_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, [SamplingRow(1.0, min_p=0.5)])
    assert p[0, 2:].sum() == 0 and torch.allclose(p[0, :2], torch.tensor([0.625, 0.375]))


# ---- the engine paths keep working with logprobs on --------------------------------------
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_n_seeds_preemption_and_pool_with_logprobs(tiny, policy):
    prompts = tiny["prompts"]
    base = dict(max_tokens=16, temperature=0.9, seed=3, n=3 if policy == "continuous" else 1, ignore_eos=True)
    roomy = LLM("tiny-llama", num_blocks=256, block_size=8, policy=policy)
    tight = LLM("tiny-llama", num_blocks=24, block_size=8, max_num_batched_tokens=24, policy=policy)
    plain = roomy.generate(prompts, SamplingParams(**base), use_tqdm=False)
    asked = SamplingParams(**base, logprobs=2, prompt_logprobs=1)
    a = roomy.generate(prompts, asked, use_tqdm=False)
    b = tight.generate(prompts, asked, use_tqdm=False)
    if policy == "continuous":
        assert tight.stats()["num_preemptions"] > 0, "the tight pool should preempt"
    for p, x, y in zip(plain, a, b):
        assert [s.token_ids for s in x.outputs] == [s.token_ids for s in p.outputs], "logprobs changed tokens"
        assert [s.token_ids for s in y.outputs] == [s.token_ids for s in x.outputs]
        assert len(x.prompt_logprobs) == len(y.prompt_logprobs) == len(x.prompt_token_ids)
        for ex, ey in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert ex.keys() == ey.keys()
            assert all(abs(ex[t].logprob - ey[t].logprob) < TOL for t in ex)
        for sx, sy in zip(x.outputs, y.outputs):
            assert len(sx.logprobs) == len(sy.logprobs) == len(sx.token_ids)
            assert abs(sx.cumulative_logprob - sy.cumulative_logprob) < 1e-3
            assert all(1 <= len(e) <= 3 for e in sx.logprobs)
        assert p.prompt_logprobs is None and all(s.logprobs is None for s in p.outputs)
    assert_pool_whole(roomy)
    assert_pool_whole(tight)


def test_stop_strings_and_abort_with_logprobs(tiny):
    llm = LLM("tiny-llama", num_blocks=64, block_size=8, max_num_batched_tokens=16)
    prompt = tiny["prompts"][4]
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    text = free[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 1]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop],
                                                logprobs=1, prompt_logprobs=0), use_tqdm=False)[0]
    s = out.outputs[0]
    assert s.finish_reason == "stop" and len(s.logprobs) == len(s.token_ids) < 12
    # abort mid-generation, with a second request still running beside it
    engine = llm.engine
    asked = SamplingParams(max_tokens=40, temperature=0.5, seed=1, n=2, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    gone = engine.add_request(tiny["prompts"][5], asked)
    kept = engine.add_request(tiny["prompts"][3], asked)
    for _ in range(6):
        engine.step()
    assert engine.abort(gone.request_id)
    engine.run()
    for r in (gone, kept):
        for seq in r.seqs:
            assert len(seq.logprobs) == seq.num_output_tokens
    assert all(seq.num_output_tokens == 40 for seq in kept.seqs)
    assert len(kept.prompt_logprobs) == len(kept.prompt_token_ids)
    assert_pool_whole(llm)


def test_all_logits_chunks_return_every_token_in_order():
    chunks = [SeqChunk([1, 2, 3, 4], 0, [0], compute_logits=False, all_logits=True),
              SeqChunk([5, 6, 7], 4, [0, 1], compute_logits=True),
              SeqChunk([8, 9], 0, [2], compute_logits=True, all_logits=True),
              SeqChunk([10], 5, [3, 4], compute_logits=True, is_prefill=False)]
    b = pack_chunks(chunks, 4, 8, 64)
    assert b.logits_indices.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]
    plain = pack_chunks([SeqChunk(c.token_ids, c.num_computed_tokens, c.block_ids, c.compute_logits,
                                  c.is_prefill) for c in chunks], 4, 8, 64)
    assert plain.logits_indices.tolist() == [6, 8, 9]
    assert np.array_equal(plain.slot_mapping, b.slot_mapping)


# ---- bad values -----------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.5), ("logprobs", True),
    ("prompt_logprobs", 21), ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("presence_penalty", "1"), ("repetition_penalty", 0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("min_p", -0.1), ("min_p", 1.5),
    ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {"x": 1.0}), ("logit_bias", [1, 2]),
])
def test_bad_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_logit_bias_keys_from_json_and_vocabulary_check():
    assert SamplingParams(logit_bias={"12": 3}).logit_bias == {12: 3}
    llm = LLM("tiny-llama", num_blocks=32, block_size=8)
    V = llm.runner.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.engine.add_request([1, 2, 3], SamplingParams(logit_bias={V: 1.0}))
    assert not llm.scheduler.has_unfinished


def test_streamed_outputs_carry_logprobs_matching_their_tokens(tiny):
    llm = LLM("tiny-llama", num_blocks=64, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=5, n=2, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    final = None
    for out in llm.generate_stream([tiny["prompts"][5]], params):
        for s in out.outputs:
            assert len(s.logprobs) == len(s.token_ids)      # never ahead of or behind its tokens
        final = out
    assert final.finished and len(final.prompt_logprobs) == len(final.prompt_token_ids)
    done = llm.generate([tiny["prompts"][5]], params, use_tqdm=False)[0]
    assert [s.token_ids for s in done.outputs] == [s.token_ids for s in final.outputs]
    assert [s.cumulative_logprob for s in done.outputs] == pytest.approx([s.cumulative_logprob for s in final.outputs])
    assert_pool_whole(llm)
