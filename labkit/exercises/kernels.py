"""Graders for chapter 5: the paged decode attention kernel, in pieces.

Students write three functions in torch, each checked on random inputs against labkit:

* ``decode_slot_mapping(block_tables, context_lens, block_size)``: where each sequence's new
  token's K/V goes (checked against ``BlockTable.slot`` on real block tables);
* ``online_softmax_step(m, l, acc, s, v)``: fold one tile of scores into the running max,
  denominator and output, as the Triton kernel's ``online_softmax_step`` does (checked
  against a plain softmax over all tiles);
* ``paged_decode_one(q, k_cache, v_cache, block_table, context_len, scale)``: one
  sequence's decode attention, walking its block table tile by tile with the step above
  (checked against ``labkit.kernels.paged_decode_attention_ref``).

The kernel works in base 2 (``exp2``, with log2(e) folded into the scale); the exercises use
natural ``exp``: the algebra is the same.

Each grader comes in two halves, so that ``labkit.grade`` can run the student's function where
it lives (their kernel, in a sandbox) and judge it where their code cannot reach: ``probe``
calls the function on the grader's inputs (the same fixed cases on both sides) and returns
its outputs as plain numbers; ``judge`` rebuilds them and gives the verdict. In a notebook the
grader does both.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
from typing import Callable

import torch

from ._grading import fail, graded, passed

_ATOL = 1e-5
_RTOL = 1e-4


def _call(fn: object, name: str, *args):
    __tracebackhide__ = True        # IPython and pytest show the student's cell, not this frame
    if fn is Ellipsis or fn is None or not callable(fn):
        fail(f"{name}: pass your function itself, not {fn!r}.")
    try:
        return fn(*args)
    except NotImplementedError:
        problem = f"{name}: your function still raises NotImplementedError: write it."
    except AssertionError:
        raise
    except Exception as e:   # noqa: BLE001 - report the student's error as a hint
        problem = f"{name}: calling it raised {type(e).__name__}: {e}"
    fail(problem)            # outside the except block: no "during handling" chain


def _as_tensor(name: str, x, shape, dtype=None) -> torch.Tensor:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    if not isinstance(x, torch.Tensor):
        try:
            x = torch.as_tensor(x)
        except Exception:     # noqa: BLE001
            fail(f"{name}: expected a tensor of shape {tuple(shape)}, got {type(x).__name__}.")
    if tuple(x.shape) != tuple(shape):
        fail(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}.")
    return x if dtype is None else x.to(dtype)


#: Element types an output may come back as, and the most elements one may have.
_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
_MAX_ELEMENTS = 1 << 20


def _to_data(x) -> dict:
    """A function's output as plain data (shape, element type, numbers), or what it was instead."""
    try:
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    except Exception:     # noqa: BLE001 - described to the judge instead
        return {"type": type(x).__name__}
    if t.numel() > _MAX_ELEMENTS:
        return {"type": f"tensor of {t.numel():,} elements"}
    t = t.detach().cpu()
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "data": (t.float() if t.dtype == torch.bfloat16 else t).flatten().tolist()}


def _received(name: str, out: object, shape, dtype=None) -> torch.Tensor:
    """An output handed in as ``_to_data`` made it, as a tensor of ``shape`` (the judge's
    ``_as_tensor``: anything else fails, saying what it was)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    if not isinstance(out, dict) or "type" in out:
        what = out.get("type") if isinstance(out, dict) else type(out).__name__
        fail(f"{name}: expected a tensor of shape {tuple(shape)}, got {what}.")
    got_shape, kind, data = out.get("shape"), out.get("dtype"), out.get("data")
    if not (isinstance(got_shape, list) and all(isinstance(n, int) and n >= 0 for n in got_shape)
            and kind in _DTYPES and isinstance(data, list) and len(data) == math.prod(got_shape)
            and all(isinstance(v, (int, float)) for v in data)):
        fail(f"{name}: the output handed in could not be read.")
    if tuple(got_shape) != tuple(shape):
        fail(f"{name}: expected shape {tuple(shape)}, got {tuple(got_shape)}.")
    t = torch.tensor(data, dtype=torch.float32 if kind == "bfloat16" else getattr(torch, kind)).reshape(got_shape)
    return t if dtype is None else t.to(dtype)


def _cases_run(name: str, ran: object, count: int) -> list:
    """The per-case outputs a probe handed in, or the failure it recorded."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    if not isinstance(ran, list) or not ran or len(ran) > count or not all(isinstance(r, dict) for r in ran):
        fail(f"{name}: what the function returned could not be read.")
    for r in ran:
        if "fail" in r:
            fail(str(r["fail"]))
    if len(ran) != count:
        fail(f"{name}: what the function returned could not be read.")
    return ran


def _probe_cases(fn: object, name: str, calls) -> list:
    """Each case's output of ``fn`` (``calls`` yields one call per case), as plain data; the
    first failure (a stub, an exception, a wrong shape) is recorded and ends the list."""
    out = []
    for call in calls:
        try:
            out.append(call(fn))
        except AssertionError as e:
            out.append({"fail": str(e)})
            break
    return out


def _two_halves(grader, probe, judge):
    """Give a grader the halves ``labkit.grade`` runs apart (module docstring)."""
    grader.probe, grader.judge = probe, judge
    return grader


# ---- exercise 5.1: slot mapping ------------------------------------------------------------
def random_block_tables(num_seqs: int = 5, block_size: int = 4, num_blocks: int = 64, seed: int = 0):
    """Real block tables from a real allocator, grown in turns so that their blocks
    interleave: ``(block_tables [S, max_blocks] int32, context_lens [S] int32, tables)``."""
    from ..memory import BlockAllocator, BlockTable
    rng = random.Random(seed)
    alloc = BlockAllocator(num_blocks, block_size)
    for _ in range(3):
        alloc.allocate()                  # held elsewhere: no table starts at block 0
    tables = [BlockTable(alloc) for _ in range(num_seqs)]
    for table in tables:
        table.append_tokens(range(rng.randint(1, 3 * block_size)))
    for _ in range(4 * block_size):
        t = rng.choice(tables)
        t.append_tokens([1])
    width = max(t.num_blocks for t in tables) + 1
    bt = torch.zeros(num_seqs, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :t.num_blocks] = torch.tensor(t.block_ids, dtype=torch.int32)
    lens = torch.tensor([t.num_tokens for t in tables], dtype=torch.int32)
    return bt, lens, tables


def _slot_cases() -> list:
    return [(bs, *random_block_tables(num_seqs=6, block_size=bs, num_blocks=256, seed=seed))
            for seed, bs in ((0, 4), (1, 16), (2, 8), (3, 1))]


def _probe_slot_mapping(decode_slot_mapping: object, *, plan: dict | None = None) -> list:
    return _probe_cases(decode_slot_mapping, "decode_slot_mapping", [
        (lambda fn, bs=bs, bt=bt, lens=lens: _to_data(_call(fn, "decode_slot_mapping", bt.clone(), lens.clone(), bs)))
        for bs, bt, lens, _ in _slot_cases()])


def _judge_slot_mapping(ran: object, *, plan: dict | None = None) -> None:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    cases = _slot_cases()
    for (bs, bt, lens, tables), out in zip(cases, _cases_run("decode_slot_mapping", ran, len(cases))):
        got = _received("decode_slot_mapping(...)", out, (len(tables),)).long()
        expected = torch.tensor([t.slot(t.num_tokens - 1) for t in tables])
        if torch.equal(got, expected):
            continue
        if torch.equal(got, lens.long() - 1):
            fail("decode_slot_mapping: those are positions in the sequence, not slots in the pool. "
                 "Look the position's logical block up in the block table.")
        wrong_pos = torch.tensor([t.slot(t.num_tokens) if t.num_tokens % bs else -1 for t in tables])
        if torch.equal(got[wrong_pos >= 0], wrong_pos[wrong_pos >= 0]):
            fail("decode_slot_mapping: the newest token sits at position context_len - 1, not context_len.")
        blocks = torch.tensor([t.block_ids[(t.num_tokens - 1) // bs] for t in tables])
        if torch.equal(got, blocks):
            fail("decode_slot_mapping: those are block ids; a slot is block_id * block_size + offset.")
        bad = int((got != expected).nonzero()[0, 0])
        slot, table = int(got[bad]), tables[bad]
        where = (f"sequence {bad} (block size {bs}, context length {int(lens[bad])}, block table "
                 f"{table.block_ids}) got slot {slot}")
        block, offset = divmod(slot, bs)
        right_block = table.block_ids[(table.num_tokens - 1) // bs]
        if block not in table.block_ids:
            fail(f"decode_slot_mapping: {where}, which lies in block {block}: not one of this sequence's "
                 "blocks. The physical block comes from the sequence's row of the block table.")
        if block != right_block:
            fail(f"decode_slot_mapping: {where}, in block {block}: one of its blocks, but not the one "
                 "holding its newest token. Which logical block does that position fall in?")
        fail(f"decode_slot_mapping: {where}: the right block ({block}) but the wrong offset in it "
             f"({offset}). Where in its block does the newest position fall?")
    passed("Slots match BlockTable.slot on real block tables (block sizes 1, 4, 8, 16): "
           "slot = block_tables[s, pos // block_size] * block_size + pos % block_size.")


@graded("5.1")
def check_slot_mapping(decode_slot_mapping: Callable) -> None:
    """Exercise 5.1: ``decode_slot_mapping(block_tables, context_lens, block_size)`` returns
    the slot of each sequence's newest token (position ``context_lens[s] - 1``)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _judge_slot_mapping(_probe_slot_mapping(decode_slot_mapping))


_two_halves(check_slot_mapping, _probe_slot_mapping, _judge_slot_mapping)


# ---- exercise 5.2: the online softmax step -------------------------------------------------
def _reference_step(m, denom, acc, s, v, rescale_acc=True, rescale_l=True, accumulate=True):
    """The step, or one of the mistakes students make (a flag switched off). ``denom`` is the
    running denominator, the exercise's ``l``."""
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    if not accumulate:
        return m_new, p.sum(dim=1), p @ v
    denom_new = (denom * alpha if rescale_l else denom) + p.sum(dim=1)
    acc_new = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    return m_new, denom_new, acc_new


def _fold(step: Callable, s_tiles, v_tiles, rows: int, d: int, name: str):
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    denom = torch.zeros(rows, dtype=torch.float64)     # the running denominator, the exercise's l
    acc = torch.zeros(rows, d, dtype=torch.float64)
    for s, v in zip(s_tiles, v_tiles):
        if name:
            out = _call(step, name, m.clone(), denom.clone(), acc.clone(), s.clone(), v.clone())
        else:
            out = step(m, denom, acc, s, v)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail(f"{name}: return the three updated values (m, l, acc), got {type(out).__name__}.")
        m = _as_tensor(f"{name}: m", out[0], (rows,), torch.float64)
        denom = _as_tensor(f"{name}: l", out[1], (rows,), torch.float64)
        acc = _as_tensor(f"{name}: acc", out[2], (rows, d), torch.float64)
    return m, denom, acc


def _softmax_cases():
    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, d, tiles, tile in ((3, 8, 4, 16), (5, 4, 7, 8), (2, 16, 1, 32)):
        s = [torch.randn(rows, tile, generator=g, dtype=torch.float64) * 4 for _ in range(tiles)]
        v = [torch.randn(tile, d, generator=g, dtype=torch.float64) for _ in range(tiles)]
        cases.append((rows, d, s, v, "random scores"))
    # Rising scores: every tile raises the maximum, so a missing rescale shows.
    rows, d, tile = 2, 4, 8
    s = [torch.full((rows, tile), 3.0 * k, dtype=torch.float64)
         + torch.randn(rows, tile, generator=g, dtype=torch.float64)
         for k in range(4)]
    v = [torch.randn(tile, d, generator=g, dtype=torch.float64) for _ in range(4)]
    cases.append((rows, d, s, v, "scores that grow from tile to tile"))
    # A masked (partly filled) last tile: -inf scores must contribute nothing.
    s = [torch.randn(rows, tile, generator=g, dtype=torch.float64) for _ in range(3)]
    s[-1][:, 3:] = float("-inf")
    v = [torch.randn(tile, d, generator=g, dtype=torch.float64) for _ in range(3)]
    cases.append((rows, d, s, v, "a last tile with masked (-inf) scores"))
    # Large scores: exp without subtracting the max would overflow.
    s = [torch.randn(rows, tile, generator=g, dtype=torch.float64) * 5 + 800 for _ in range(2)]
    v = [torch.randn(tile, d, generator=g, dtype=torch.float64) for _ in range(2)]
    cases.append((rows, d, s, v, "large scores (around 800)"))
    return cases


def _probe_online_softmax(online_softmax_step: object, *, plan: dict | None = None) -> list:
    def fold(step, case):
        rows, d, s_tiles, v_tiles, _ = case
        m, denom, acc = _fold(step, s_tiles, v_tiles, rows, d, "online_softmax_step")
        return {"m": _to_data(m), "l": _to_data(denom), "acc": _to_data(acc)}
    return _probe_cases(online_softmax_step, "online_softmax_step",
                        [lambda step, case=case: fold(step, case) for case in _softmax_cases()])


def _judge_online_softmax(ran: object, *, plan: dict | None = None) -> None:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    name = "online_softmax_step"
    cases = _softmax_cases()
    for (rows, d, s_tiles, v_tiles, what), out in zip(cases, _cases_run(name, ran, len(cases))):
        m = _received(f"{name}: m", out.get("m"), (rows,), torch.float64)
        denom = _received(f"{name}: l", out.get("l"), (rows,), torch.float64)
        acc = _received(f"{name}: acc", out.get("acc"), (rows, d), torch.float64)
        s_all, v_all = torch.cat(s_tiles, dim=1), torch.cat(v_tiles, dim=0)
        expected = torch.softmax(s_all, dim=1) @ v_all
        out = acc / denom[:, None]
        if torch.isfinite(out).all() and torch.allclose(out, expected, rtol=_RTOL, atol=_ATOL):
            if not torch.allclose(m, s_all.max(dim=1).values):
                fail(f"{name}: the output is right but m is not the running maximum of the scores.")
            continue
        if not torch.isfinite(out).all():
            fail(f"{name}: NaN or inf in the result on {what}. Are the exponentials taken relative to "
                 "the running maximum, so that none can overflow, and do masked (-inf) scores "
                 "contribute exactly nothing?")
        for kwargs, hint in (({"rescale_acc": False}, "acc is not rescaled: what it holds was weighted "
                                                      "relative to the old maximum, and the new terms "
                                                      "relative to the new one."),
                             ({"rescale_l": False}, "l is not rescaled: the sum it holds is relative to the "
                                                    "old maximum, the new terms to the new one."),
                             ({"rescale_acc": False, "rescale_l": False},
                              "neither l nor acc is brought from the old maximum to the new one when a "
                              "tile raises it."),
                             ({"accumulate": False}, "the step forgets the earlier tiles: l and acc must "
                                                     "carry everything folded in so far."),
                             ):
            rm, rl, racc = _fold(lambda *a: _reference_step(*a, **kwargs), s_tiles, v_tiles, rows, d, "")
            if torch.allclose(out, racc / rl[:, None], rtol=_RTOL, atol=_ATOL):
                fail(f"{name}: wrong on {what}: {hint}")
        fail(f"{name}: acc / l differs from softmax(s) @ v on {what}. Go through section 4 again: "
             "the running maximum, what changes for l and acc when a tile raises it, and what the "
             "tile itself adds.")
    passed("online softmax matches softmax(s) @ v over every tiling tried, including growing maxima, "
           "masked slots and scores near 800 (where a plain exp would overflow).")


@graded("5.2")
def check_online_softmax(online_softmax_step: Callable) -> None:
    """Exercise 5.2: ``online_softmax_step(m, l, acc, s, v) -> (m, l, acc)`` folds one tile
    of scores ``s`` [rows, T] and values ``v`` [T, d] into the running max ``m`` [rows],
    denominator ``l`` [rows] and unnormalized output ``acc`` [rows, d]. After the last
    tile, ``acc / l[:, None]`` must equal ``softmax(all scores) @ all values``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _judge_online_softmax(_probe_online_softmax(online_softmax_step))


_two_halves(check_online_softmax, _probe_online_softmax, _judge_online_softmax)


# ---- exercise 5.3: one sequence's paged decode --------------------------------------------------
def _decode_variant(q, k_cache, v_cache, block_table, context_len, scale, *, use_table=True,
                    whole_blocks=False, head_map="group"):
    """One sequence's decode attention, right or with one of the usual mistakes: logical block
    ``i`` read as physical block ``i`` (``use_table=False``), every slot of the last block read
    (``whole_blocks``), query head ``h`` sent to KV head ``h % kv_heads`` (``head_map="modulo"``)."""
    num_heads, d = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = num_heads // kv_heads
    n_blocks = -(-context_len // bs)
    ids = [int(block_table[i]) if use_table else i for i in range(n_blocks)]
    k = torch.cat([k_cache[b] for b in ids])            # [n_blocks * bs, kv_heads, d]
    v = torch.cat([v_cache[b] for b in ids])
    if not whole_blocks:
        k, v = k[:context_len], v[:context_len]
    out = torch.empty_like(q)
    for h in range(num_heads):
        kv = h // group if head_map == "group" else h % kv_heads
        out[h] = torch.softmax(k[:, kv] @ q[h] * scale, dim=0) @ v[:, kv]
    return out


_DECODE_MISTAKES = (
    ({"use_table": False}, "it reads logical block i from physical block i of the cache. A sequence's "
                           "blocks lie wherever the allocator put them: its block table says which "
                           "physical block holds its logical block i."),
    ({"whole_blocks": True}, "it reads every slot of the last block, past the end of the context. The "
                             "last block is only partly filled: how many of its tokens belong to the "
                             "sequence?"),
    ({"head_map": "modulo"}, "query heads are paired with the wrong KV heads. Under GQA, consecutive "
                             "query heads form a group that shares one KV head."),
)


def _step_of(fn: object):
    """The student's own ``online_softmax_step`` that ``fn`` calls (the notebook's
    ``paged_decode_one`` does), or None."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    step = scope.get("online_softmax_step") if isinstance(scope, dict) else None
    if code is None or "online_softmax_step" not in code.co_names or not callable(step):
        return None
    return step


def _broken_step(ran: object) -> str | None:
    """Why 5.3 fails because of the student's 5.2 (``ran``: what 5.2's probe handed in for the
    step ``paged_decode_one`` calls), or None when it calls none or that one is right."""
    if ran is None:
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            _judge_online_softmax(ran)
    except AssertionError as e:
        return (f"paged_decode_one: it calls your online_softmax_step, which does not pass exercise 5.2 "
                f"yet ({str(e)[:160]}). Make 5.2 pass first.")
    return None


def _decode_cases() -> list:
    """The cases 5.3 is checked on: (q, k_cache, v_cache, block_table, context_len, scale, what)."""
    g = torch.Generator().manual_seed(1)
    cases = []
    for num_blocks, bs, kv_heads, group, d in ((24, 4, 2, 2, 8), (16, 16, 1, 3, 16), (40, 8, 3, 1, 4)):
        k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        for context_len in (1, bs, 3 * bs + 1):
            n = -(-context_len // bs)
            blocks = torch.randperm(num_blocks, generator=g)[: n + 2].to(torch.int32)  # extra: unused
            q = torch.randn(kv_heads * group, d, generator=g)
            what = (f"block size {bs}, context length {context_len}, {kv_heads} KV heads × {group} "
                    f"query heads each, block table {blocks[:n].tolist()}")
            cases.append((q, k_cache, v_cache, blocks, context_len, d ** -0.5, what))
    return cases


def _probe_paged_decode(paged_decode_one: object, *, plan: dict | None = None) -> dict:
    def call(fn, case):
        q, k_cache, v_cache, blocks, context_len, scale, _ = case
        got = _call(fn, "paged_decode_one", q.clone(), k_cache, v_cache, blocks.clone(), context_len, scale)
        return _to_data(got)
    step = _step_of(paged_decode_one)
    return {"cases": _probe_cases(paged_decode_one, "paged_decode_one",
                                  [lambda fn, case=case: call(fn, case) for case in _decode_cases()]),
            "step": _probe_online_softmax(step) if step is not None else None}


def _judge_paged_decode(ran: object, *, plan: dict | None = None) -> None:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..kernels import paged_decode_attention_ref
    name = "paged_decode_one"
    if not isinstance(ran, dict):
        fail(f"{name}: what the function returned could not be read.")
    cases = _decode_cases()
    try:
        outputs = _cases_run(name, ran.get("cases"), len(cases))
        error = None
    except AssertionError as e:
        error = str(e)
    if error is not None:     # outside the except block: no "during handling" chain
        fail(_broken_step(ran.get("step")) or error)
    for (q, k_cache, v_cache, blocks, context_len, scale, case), out in zip(cases, outputs):
        expected = paged_decode_attention_ref(q[None], k_cache, v_cache, blocks[None],
                                              torch.tensor([context_len], dtype=torch.int32), scale)[0]
        try:
            got = _received(f"{name}(...)", out, tuple(q.shape), torch.float32)
            error = None
        except AssertionError as e:
            error = str(e)
        if error is not None:
            fail(_broken_step(ran.get("step")) or error)
        if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
            broken = _broken_step(ran.get("step"))
            if broken:
                fail(broken)
            for kwargs, hint in _DECODE_MISTAKES:
                wrong = _decode_variant(q, k_cache, v_cache, blocks, context_len, scale, **kwargs)
                if not torch.allclose(wrong, expected, rtol=1e-4, atol=1e-5) and \
                        torch.allclose(got, wrong, rtol=1e-4, atol=1e-5):
                    fail(f"{name}: wrong on {case}: {hint}")
            err = (got - expected).abs().max().item()
            fail(f"{name}: differs from the reference by up to {err:.3g} ({case}). Check each "
                 "step: which physical block holds logical block i, how many of its tokens "
                 "belong to the sequence, and which KV head each query head reads.")
    passed("paged_decode_one equals paged_decode_attention_ref for block sizes 4, 8, 16, GQA groups "
           "1-3, and contexts that end mid-block: the kernel's algorithm, in torch.")


@graded("5.3")
def check_paged_decode(paged_decode_one: Callable) -> None:
    """Exercise 5.3: ``paged_decode_one(q, k_cache, v_cache, block_table, context_len, scale)``
    for one sequence (q [num_heads, d], block_table a 1-D tensor of block ids) must equal
    ``paged_decode_attention_ref`` on that sequence."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _judge_paged_decode(_probe_paged_decode(paged_decode_one))


_two_halves(check_paged_decode, _probe_paged_decode, _judge_paged_decode)


def answer_forms() -> dict[str, list[str]]:
    """What would give each exercise's answer away before its check: chapter 5's answers are
    code, so the forms are the solution's key expressions (the formula a hint must not state)."""
    return {
        "5.1": ["pos // block_size] * block_size + pos % block_size",
                "blocks * block_size + pos % block_size"],
        "5.2": ["l * exp(m - m_new) + sum(p)", "acc * exp(m - m_new) + p @ v",
                "l * alpha + p.sum(dim=1)", "acc * alpha[:, None] + p @ v",
                "l = l * torch.exp(m - m_new) + p.sum(dim=1)"],
        "5.3": ["block = int(block_table[i])", "n = min(block_size, context_len - i * block_size)"],
    }
