"""The engine end to end: greedy tokens equal Hugging Face's, under every scheduling stress.

The reference is Hugging Face transformers' greedy decoding of one prompt at a time (batch of
one, fp32, the same weights), so nothing about labkit's batching, paging, chunking, prefix
caching or preemption may change a single token. For tiny-llama it is ``generate`` itself;
for SmolLM2 (33 prompts of 64 tokens, two minutes of ``generate`` on 2 cores) it is
:func:`hf_greedy_by_forcing`, which finds the same tokens in one forward pass per prompt, and
``tests/test_model.py`` holds the engine's runner to ``generate`` on the same model.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.model import load_model

from run_once import computed_once


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate``, one prompt at a time, ignoring EOS the way
    ``ignore_eos`` does: EOS may be generated, it just does not stop generation. (HF's
    ``min_new_tokens`` would instead forbid EOS, changing the tokens.)"""
    config = copy.deepcopy(hf_model.generation_config)
    config.update(eos_token_id=[], max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.no_grad():
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
        assert y.shape[1] == len(ids) + max_new_tokens
        outs.append(y[0, len(ids):].tolist())
    return outs


def hf_greedy_by_forcing(hf_model, prompts: list[list[int]], max_new_tokens: int,
                         guesses: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations of ``prompts`` (past EOS, as ``ignore_eos`` runs), found by
    checking a guess instead of decoding token by token.

    One causal forward pass over ``prompt + guess`` gives the model's argmax after every prefix
    of the guess. Where the guess is HF's argmax at every position, it *is* HF's greedy
    continuation; at the first position where it is not, HF's own token replaces the guess's,
    everything after it is dropped, and the check runs again on the mended guess (growing by
    HF's next argmax until it is ``max_new_tokens`` long). So the result does not depend on
    the guess, only the time it takes: a right guess costs one forward pass, a wrong one up to
    ``max_new_tokens``. (Greedy decoding is this argmax chain; ``generate`` computes it with a
    KV cache, the forward pass without, which differ by rounding only.)"""
    outs = []
    for ids, guess in zip(prompts, guesses, strict=True):
        guess = list(guess[:max_new_tokens])
        while True:
            with torch.no_grad():
                logits = hf_model(torch.tensor([ids + guess])).logits[0, len(ids) - 1:]
            best = logits.argmax(-1).tolist()          # best[j]: HF's token after prompt + guess[:j]
            wrong = next((j for j, (g, b) in enumerate(zip(guess, best)) if g != b), None)
            if wrong is not None:
                guess = guess[:wrong] + [best[wrong]]
            elif len(guess) < max_new_tokens:
                guess.append(best[len(guess)])
            else:
                break
        outs.append(guess)
    return outs


def assert_pool_whole(llm: LLM) -> None:
    alloc = llm.allocator
    alloc.check_invariants()
    assert alloc.num_used_blocks == 0, "blocks leaked"
    assert alloc.num_free_blocks == alloc.num_blocks
    assert not llm.scheduler.has_unfinished


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- tiny-llama: fast, random weights --------------------------------------------------
TINY_LEN = 24


@pytest.fixture(scope="module")
def tiny():
    loaded = load_model("tiny-llama")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, loaded.config.vocab_size) for _ in range(n)]
               for n in (1, 5, 16, 17, 33, 64, 90, 7, 48, 31)]
    system = [rng.randrange(3, loaded.config.vocab_size) for _ in range(40)]
    shared = [system + p[:12] for p in prompts[:6]]
    hf = loaded.hf_model()
    return {"prompts": prompts, "shared": shared,
            "ref": hf_greedy(hf, prompts, TINY_LEN), "ref_shared": hf_greedy(hf, shared, TINY_LEN)}


TINY_CONFIGS = {
    "default": dict(),
    "small-blocks": dict(block_size=4),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_blocks=24, block_size=8, max_num_batched_tokens=64),
    "static": dict(policy="static"),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "radix-prefix-cache": dict(enable_prefix_caching="radix"),
    "radix-preemption": dict(enable_prefix_caching="radix", num_blocks=24, block_size=8,
                             max_num_batched_tokens=64),
    "swap-preemption": dict(preemption_mode="swap", num_blocks=24, block_size=8,
                            max_num_batched_tokens=64),
}


@pytest.mark.parametrize("name", TINY_CONFIGS)
def test_tiny_greedy_equals_hf_under_every_config(tiny, name):
    options = dict(num_blocks=256, block_size=16)
    options.update(TINY_CONFIGS[name])
    llm = LLM("tiny-llama", **options)
    outs = llm.generate(tiny["prompts"], greedy(TINY_LEN), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny["ref"]
    if name.endswith("preemption"):
        assert llm.stats()["num_preemptions"] > 0
    if name == "swap-preemption":
        assert llm.stats()["num_swap_outs"] > 0 and llm.stats()["num_swap_ins"] > 0
    if name == "chunked-prefill":
        assert all(len(r.ran) and sum(n for *_, n, _ in r.ran) <= 16 for r in llm.engine.records)
    assert_pool_whole(llm)


def test_greedy_by_forcing_is_generate_whatever_the_guess(tiny):
    """The SmolLM2 reference's method against ``generate`` itself: no guess, the right one, one
    wrong from its first token, one right for 10 tokens then wrong, one too short, one too long."""
    hf = load_model("tiny-llama").hf_model()
    prompts, ref = tiny["prompts"][:5], tiny["ref"][:5]
    vocab = hf.config.vocab_size
    wrong = [[(t + 1) % vocab for t in r] for r in ref]
    for guesses in ([[]] * 5, ref, wrong, [r[:10] + w[10:] for r, w in zip(ref, wrong, strict=True)],
                    [r[:3] for r in ref], [r + r for r in ref]):
        assert hf_greedy_by_forcing(hf, prompts, TINY_LEN, guesses) == ref


def test_tiny_prefix_cache_hits_and_same_tokens(tiny):
    llm = LLM("tiny-llama", num_blocks=256, block_size=8)
    first = llm.generate(tiny["shared"][:1], greedy(TINY_LEN), use_tqdm=False)
    rest = llm.generate(tiny["shared"][1:], greedy(TINY_LEN), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == tiny["ref_shared"]
    assert all(o.num_cached_tokens == 40 for o in rest)       # five full blocks of the system prompt
    assert llm.stats()["prefix_cache_hit_rate"] > 0
    assert_pool_whole(llm)


def test_parallel_samples_are_seeded_distinct_and_share_the_prompt():
    llm = LLM("tiny-llama", num_blocks=128, block_size=4)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=4, ignore_eos=True)
    prompt = list(range(3, 13))                  # 10 tokens: the third block is partly full
    a = llm.generate([prompt], params, use_tqdm=False)[0]
    assert len(a.outputs) == 4
    samples = [tuple(c.token_ids) for c in a.outputs]
    assert len(set(samples)) == 4, "n samples should differ"
    b = llm.generate([prompt, list(range(50, 90))], [params, greedy(5)], use_tqdm=False)[0]
    assert [tuple(c.token_ids) for c in b.outputs] == samples, "same seed, same samples"
    copies = sum(r.num_copies for r in llm.engine.records)
    assert copies >= 3 * 2, "each fork copies the shared partial block on first write"
    assert_pool_whole(llm)


def test_sampling_params_validation_raises_before_anything_runs():
    llm = LLM("tiny-llama", num_blocks=32)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    bad = SamplingParams()
    bad.max_tokens = 0                           # mutated after construction
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(["a", "b"], [SamplingParams(), bad], use_tqdm=False)
    assert llm.stats()["num_steps"] == 0 and not llm.scheduler.has_unfinished


def test_bad_prompts_are_rejected_alone_and_the_rest_complete():
    llm = LLM("tiny-llama", num_blocks=16, block_size=8)       # 128 slots of KV in all
    prompts = [[5] * 10, [6] * 600, [7] * 120, [8] * 12, [10**6]]
    with pytest.warns(UserWarning, match="request rejected") as warned:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert len(warned) == 3, "one warning per rejected request"
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) > 0
    assert "too long" in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    assert "whole KV cache" in outs[2].error
    assert outs[3].error is None and outs[3].finished
    assert "out of range" in outs[4].error
    assert_pool_whole(llm)


def test_kv_cache_larger_than_memory_is_refused():
    with pytest.raises(ValueError, match="available"):
        LLM("tiny-llama", kv_cache_memory=1 << 50)


# ---- SmolLM2-135M-Instruct: the real default model ---------------------------------------
SMOL_NEW = 64
QUESTIONS = [
    "What is the capital of France?", "Write a haiku about memory.", "Explain paging in one sentence.",
    "List three prime numbers.", "Who wrote Hamlet?", "Translate 'good morning' into Spanish.",
    "What does a GPU do?", "Give me a tip for learning Python.",
    "Describe the water cycle for a ten-year-old, step by step, with an example from everyday life.",
    "Why is the sky blue?", "Summarize the plot of Cinderella.", "What is 17 times 23?",
    "Name a famous physicist and one discovery of theirs.", "How do vaccines work?",
    "Write two lines of a poem about the sea, then explain the imagery you used in detail.",
    "What is a block table?",
    "Read this and answer in one sentence. A serving engine keeps the keys and values of every "
    "token it has seen in a cache, split into blocks of sixteen tokens. Each request has a block "
    "table that maps its logical blocks to physical ones, so a request can grow one block at a "
    "time and finished requests give their blocks back at once. Requests that share a system "
    "prompt share its blocks, and a block is copied only when one of them must write into it. "
    "Question: why does paging waste less memory than reserving the maximum length up front?",
]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    loaded = load_model("smollm2-135m")
    tok = loaded.tokenizer
    system = ("You are a patient teacher of computer systems. Answer clearly, precisely and briefly; "
              "when a question is ambiguous, say which reading you answer. ") * 2

    def chat(q, sys_prompt=None):
        msgs = ([{"role": "system", "content": sys_prompt}] if sys_prompt else []) + [{"role": "user", "content": q}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    prompts = [list(chat(q)) for q in QUESTIONS]
    shared = [list(chat(q, system)) for q in QUESTIONS[:8]]

    def references():
        hf = loaded.hf_model()
        # the guesses only save time (see hf_greedy_by_forcing): the engine's own greedy tokens
        llm = LLM(loaded.path or "smollm2-135m", num_blocks=512, enable_prefix_caching=False)
        guess = [o.outputs[0].token_ids for o in llm.generate(prompts + shared, greedy(SMOL_NEW), use_tqdm=False)]
        return {"prompts": prompts, "shared": shared,
                "ref": hf_greedy_by_forcing(hf, prompts, SMOL_NEW, guess[:len(prompts)]),
                "ref_shared": hf_greedy_by_forcing(hf, shared, SMOL_NEW, guess[len(prompts):])}

    refs = computed_once(tmp_path_factory, "smollm2-hf-references", references)
    assert (refs["prompts"], refs["shared"]) == (prompts, shared), "another run's references"
    return {"loaded": loaded, **refs}


SMOL_CONFIGS = {
    "default": dict(),
    "chunked-prefill": dict(max_num_batched_tokens=48),
    "preemption": dict(num_blocks=40),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", SMOL_CONFIGS)
def test_smollm2_greedy_equals_hf(smol, name):
    lens = sorted(len(p) for p in smol["prompts"])
    assert len(lens) >= 16 and lens[0] < 40 and lens[-1] > 100, "the prompts should be of mixed lengths"
    llm = LLM(smol["loaded"].path or "smollm2-135m", num_blocks=SMOL_CONFIGS[name].get("num_blocks", 512),
              **{k: v for k, v in SMOL_CONFIGS[name].items() if k != "num_blocks"})
    outs = llm.generate(smol["prompts"], greedy(SMOL_NEW), use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == smol["ref"]
    if name.endswith("preemption"):
        assert llm.stats()["num_preemptions"] > 0
    if name == "swap-preemption":
        assert llm.stats()["num_swap_outs"] > 0 and llm.stats()["num_swap_ins"] > 0
    assert_pool_whole(llm)


@pytest.mark.slow
def test_smollm2_prefix_caching_on_a_shared_system_prompt(smol):
    llm = LLM("smollm2-135m", num_blocks=512, enable_prefix_caching=True)
    first = llm.generate(smol["shared"][:1], greedy(SMOL_NEW), use_tqdm=False)
    rest = llm.generate(smol["shared"][1:], greedy(SMOL_NEW), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == smol["ref_shared"]
    assert min(o.num_cached_tokens for o in rest) >= 48
    assert_pool_whole(llm)


@pytest.mark.slow
def test_smollm2_text_stop_strings_and_streaming(smol):
    llm = LLM("smollm2-135m", num_blocks=256)
    prompt = smol["prompts"][0]
    full = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in full.text
    streamed = "".join(o.delta[0] for o in llm.generate_stream([prompt], SamplingParams(max_tokens=32, temperature=0)))
    assert streamed == full.text
    cut = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, stop=["Paris"]), use_tqdm=False)[0]
    assert cut.outputs[0].finish_reason == "stop" and "Paris" not in cut.outputs[0].text
    assert full.text.startswith(cut.outputs[0].text)
    assert_pool_whole(llm)
