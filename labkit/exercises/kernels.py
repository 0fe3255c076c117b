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
"""

from __future__ import annotations

import contextlib
import io
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


@graded("5.1")
def check_slot_mapping(decode_slot_mapping: Callable) -> None:
    """Exercise 5.1: ``decode_slot_mapping(block_tables, context_lens, block_size)`` returns
    the slot of each sequence's newest token (position ``context_lens[s] - 1``)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    for seed, bs in ((0, 4), (1, 16), (2, 8), (3, 1)):
        bt, lens, tables = random_block_tables(num_seqs=6, block_size=bs, num_blocks=256, seed=seed)
        got = _call(decode_slot_mapping, "decode_slot_mapping", bt.clone(), lens.clone(), bs)
        got = _as_tensor("decode_slot_mapping(...)", got, (len(tables),)).long()
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


# ---- exercise 5.2: the online softmax step -------------------------------------------------
def _reference_step(m, l, acc, s, v, rescale_acc=True, rescale_l=True, accumulate=True):
    """The step, or one of the mistakes students make (a flag switched off)."""
    m_new = torch.maximum(m, s.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(s - m_new[:, None])
    if not accumulate:
        return m_new, p.sum(dim=1), p @ v
    l_new = (l * alpha if rescale_l else l) + p.sum(dim=1)
    acc_new = (acc * alpha[:, None] if rescale_acc else acc) + p @ v
    return m_new, l_new, acc_new


def _fold(step: Callable, s_tiles, v_tiles, rows: int, d: int, name: str):
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    m = torch.full((rows,), float("-inf"), dtype=torch.float64)
    l = torch.zeros(rows, dtype=torch.float64)
    acc = torch.zeros(rows, d, dtype=torch.float64)
    for s, v in zip(s_tiles, v_tiles):
        out = _call(step, name, m.clone(), l.clone(), acc.clone(), s.clone(), v.clone()) if name else step(m, l, acc, s, v)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            fail(f"{name}: return the three updated values (m, l, acc), got {type(out).__name__}.")
        m = _as_tensor(f"{name}: m", out[0], (rows,), torch.float64)
        l = _as_tensor(f"{name}: l", out[1], (rows,), torch.float64)
        acc = _as_tensor(f"{name}: acc", out[2], (rows, d), torch.float64)
    return m, l, acc


def _softmax_cases():
    g = torch.Generator().manual_seed(0)
    cases = []
    for rows, d, tiles, tile in ((3, 8, 4, 16), (5, 4, 7, 8), (2, 16, 1, 32)):
        s = [torch.randn(rows, tile, generator=g, dtype=torch.float64) * 4 for _ in range(tiles)]
        v = [torch.randn(tile, d, generator=g, dtype=torch.float64) for _ in range(tiles)]
        cases.append((rows, d, s, v, "random scores"))
    # Rising scores: every tile raises the maximum, so a missing rescale shows.
    rows, d, tile = 2, 4, 8
    s = [torch.full((rows, tile), 3.0 * k, dtype=torch.float64) + torch.randn(rows, tile, generator=g, dtype=torch.float64)
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


@graded("5.2")
def check_online_softmax(online_softmax_step: Callable) -> None:
    """Exercise 5.2: ``online_softmax_step(m, l, acc, s, v) -> (m, l, acc)`` folds one tile
    of scores ``s`` [rows, T] and values ``v`` [T, d] into the running max ``m`` [rows],
    denominator ``l`` [rows] and unnormalized output ``acc`` [rows, d]. After the last
    tile, ``acc / l[:, None]`` must equal ``softmax(all scores) @ all values``."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    name = "online_softmax_step"
    for rows, d, s_tiles, v_tiles, what in _softmax_cases():
        m, l, acc = _fold(online_softmax_step, s_tiles, v_tiles, rows, d, name)
        s_all, v_all = torch.cat(s_tiles, dim=1), torch.cat(v_tiles, dim=0)
        expected = torch.softmax(s_all, dim=1) @ v_all
        out = acc / l[:, None]
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


def _broken_step_in(fn: object) -> str | None:
    """Why ``fn`` fails because of the student's own ``online_softmax_step`` (the notebook's
    ``paged_decode_one`` calls it), or None when it does not call one or that one is right."""
    code, scope = getattr(fn, "__code__", None), getattr(fn, "__globals__", {})
    step = scope.get("online_softmax_step")
    if code is None or "online_softmax_step" not in code.co_names or not callable(step):
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            check_online_softmax(step)
    except AssertionError as e:
        return (f"paged_decode_one: it calls your online_softmax_step, which does not pass exercise 5.2 "
                f"yet ({str(e)[:160]}). Make 5.2 pass first.")
    return None


@graded("5.3")
def check_paged_decode(paged_decode_one: Callable) -> None:
    """Exercise 5.3: ``paged_decode_one(q, k_cache, v_cache, block_table, context_len, scale)``
    for one sequence (q [num_heads, d], block_table a 1-D tensor of block ids) must equal
    ``paged_decode_attention_ref`` on that sequence."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    from ..kernels import paged_decode_attention_ref
    name = "paged_decode_one"
    g = torch.Generator().manual_seed(1)
    for num_blocks, bs, kv_heads, group, d in ((24, 4, 2, 2, 8), (16, 16, 1, 3, 16), (40, 8, 3, 1, 4)):
        k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=g)
        for context_len in (1, bs, 3 * bs + 1):
            n = -(-context_len // bs)
            blocks = torch.randperm(num_blocks, generator=g)[: n + 2].to(torch.int32)  # extra: unused
            q = torch.randn(kv_heads * group, d, generator=g)
            scale = d ** -0.5
            expected = paged_decode_attention_ref(q[None], k_cache, v_cache, blocks[None],
                                                  torch.tensor([context_len], dtype=torch.int32), scale)[0]
            try:
                got = _call(paged_decode_one, name, q.clone(), k_cache, v_cache, blocks.clone(), context_len, scale)
                got = _as_tensor(f"{name}(...)", got, tuple(q.shape), torch.float32)
                error = None
            except AssertionError as e:
                error = str(e)
            if error is not None:     # outside the except block: no "during handling" chain
                fail(_broken_step_in(paged_decode_one) or error)
            if not torch.allclose(got, expected, rtol=1e-4, atol=1e-5):
                broken = _broken_step_in(paged_decode_one)
                if broken:
                    fail(broken)
                case = (f"block size {bs}, context length {context_len}, {kv_heads} KV heads × {group} "
                        f"query heads each, block table {blocks[:n].tolist()}")
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
