"""Chapter 2's bug hunt: a naive paged block manager with three flaws, and the graders of
the tests that expose them.

A widely shared article on PagedAttention presents a "production-grade" block manager and
continuous-batching scheduler. Its code does not even parse (``def allocate_block((self)``),
and once that is fixed it still has three flaws that a real engine cannot afford:

1. **Only the prompt gets blocks.** Admission allocates ``ceil(prompt / block_size)`` blocks
   and nothing is ever allocated for generated tokens: a sequence that outgrows its last
   block writes its K/V past the end of its block table, into memory it does not own.
2. **An O(n) free list.** ``free_blocks.pop(0)`` shifts every remaining id of a Python list
   on each allocation: allocation slows down in proportion to the pool (tens of thousands
   of blocks on a real GPU), inside the scheduler's hot loop.
3. **No reference counts.** A block's ``ref_count`` is set to 1 or 0, never counted. When
   two sequences share a block (a forked sample, a shared system prompt), the first to
   finish puts it back on the free list while the other still reads it; the next
   allocation hands it to a third sequence, which overwrites its K/V.

``naive`` rewrites that design (same names, the syntax error fixed, sharing made explicit
with ``fork_blocks``), flaws included. ``paged`` is the same interface over labkit's real
``BlockAllocator`` (an O(1) free stack, reference counts) with a scheduler that gives every
token a slot. Students write one test per flaw, as a function of an implementation::

    def test_generated_tokens_have_slots(impl):
        manager = impl.BlockManager(num_gpu_blocks=8, block_size=4)
        scheduler = impl.Scheduler(manager)
        ...
        assert ..., "what went wrong"

and the graders run each test against both: a good test fails (``AssertionError``) on
``naive`` and passes on ``paged``.
"""

from __future__ import annotations

import math
import time
import types
from dataclasses import dataclass, field
from typing import Callable

from ..memory import BlockAllocator, NoFreeBlocksError
from ._grading import fail, passed


# ---- the shared record -------------------------------------------------------------------
@dataclass
class SequenceRequest:
    """A request as the article's scheduler sees it (a plain dataclass instead of pydantic)."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int = 32
    generated_tokens: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    is_finished: bool = False

    @property
    def num_tokens(self) -> int:
        """Tokens whose K/V the sequence holds: prompt + generated."""
        return len(self.prompt_tokens) + len(self.generated_tokens)


# ---- the naive implementation (the article's design, flaws kept) ------------------------------
class NaiveBlockManager:
    """The article's block manager: a Python list as free list, no reference counting."""

    def __init__(self, num_gpu_blocks: int = 8, block_size: int = 16):
        self.block_size = block_size
        self.free_blocks: list[int] = list(range(num_gpu_blocks))
        self.ref_count: list[int] = [0] * num_gpu_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def allocate_block(self) -> int | None:
        if not self.free_blocks:
            return None                         # out of blocks
        bid = self.free_blocks.pop(0)           # flaw 2: shifts every remaining element
        self.ref_count[bid] = 1
        return bid

    def fork_blocks(self, block_ids: list[int]) -> list[int]:
        """Let a second sequence use ``block_ids`` too (a forked sample, a shared prompt)."""
        return list(block_ids)                  # flaw 3: nobody counts the second holder

    def free_sequence_blocks(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self.ref_count[bid] = 0             # flaw 3: free whatever the count says
            self.free_blocks.append(bid)


class NaiveScheduler:
    """The article's iteration-level scheduler: admit, generate one token each, free."""

    def __init__(self, block_manager):
        self.block_manager = block_manager
        self.waiting_queue: list[SequenceRequest] = []
        self.running_batch: list[SequenceRequest] = []

    def add_request(self, req: SequenceRequest) -> None:
        self.waiting_queue.append(req)

    def fork(self, req: SequenceRequest, request_id: str) -> SequenceRequest:
        """A running copy of ``req`` sharing its blocks (what parallel sampling does)."""
        child = SequenceRequest(request_id, list(req.prompt_tokens), req.max_tokens,
                                list(req.generated_tokens),
                                self.block_manager.fork_blocks(req.block_table))
        self.running_batch.append(child)
        return child

    def _admit(self) -> None:
        bm = self.block_manager
        while self.waiting_queue:
            req = self.waiting_queue[0]
            needed = math.ceil(len(req.prompt_tokens) / bm.block_size)   # flaw 1: the prompt only
            allocated = []
            for _ in range(needed):
                bid = bm.allocate_block()
                if bid is None:
                    break
                allocated.append(bid)
            if len(allocated) < needed:
                bm.free_sequence_blocks(allocated)   # roll back a partial allocation
                break
            req.block_table.extend(allocated)
            self.running_batch.append(self.waiting_queue.pop(0))

    def _append_token(self, req: SequenceRequest, token: int) -> None:
        req.generated_tokens.append(token)       # flaw 1: no block for it, ever

    def schedule_iteration(self) -> list[SequenceRequest]:
        """One iteration: admit waiting requests, give each running one a token, free the
        finished. Returns the requests that finished."""
        self._admit()
        finished = []
        for req in list(self.running_batch):
            self._append_token(req, 1000 + len(req.generated_tokens))
            if len(req.generated_tokens) >= req.max_tokens:
                req.is_finished = True
                finished.append(req)
        for req in finished:
            self.running_batch.remove(req)
            self.block_manager.free_sequence_blocks(req.block_table)
            req.block_table = []
        return finished


# ---- the same interface over labkit's allocator ---------------------------------------------
class PagedBlockManager:
    """The interface above over ``labkit.memory.BlockAllocator``: a stack of free ids
    (O(1)) and real reference counts."""

    def __init__(self, num_gpu_blocks: int = 8, block_size: int = 16):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_gpu_blocks, block_size)

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def free_blocks(self) -> list[int]:
        return list(self.allocator._free)

    @property
    def ref_count(self) -> list[int]:
        return list(self.allocator._ref_counts)

    def allocate_block(self) -> int | None:
        try:
            return self.allocator.allocate()
        except NoFreeBlocksError:
            return None

    def fork_blocks(self, block_ids: list[int]) -> list[int]:
        for bid in block_ids:
            self.allocator.incref(bid)
        return list(block_ids)

    def free_sequence_blocks(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self.allocator.free(bid)


class PagedScheduler(NaiveScheduler):
    """The naive scheduler with flaw 1 fixed: a token that starts a new block gets one
    first (a request that cannot get one sits the iteration out)."""

    def schedule_iteration(self) -> list[SequenceRequest]:
        self._admit()
        finished = []
        bm = self.block_manager
        for req in list(self.running_batch):
            if req.num_tokens >= len(req.block_table) * bm.block_size:
                bid = bm.allocate_block()
                if bid is None:
                    continue                      # no memory: wait (a real engine preempts)
                req.block_table.append(bid)
            req.generated_tokens.append(1000 + len(req.generated_tokens))
            if len(req.generated_tokens) >= req.max_tokens:
                req.is_finished = True
                finished.append(req)
        for req in finished:
            self.running_batch.remove(req)
            bm.free_sequence_blocks(req.block_table)
            req.block_table = []
        return finished


naive = types.SimpleNamespace(name="naive", BlockManager=NaiveBlockManager, Scheduler=NaiveScheduler,
                              SequenceRequest=SequenceRequest)
paged = types.SimpleNamespace(name="paged", BlockManager=PagedBlockManager, Scheduler=PagedScheduler,
                              SequenceRequest=SequenceRequest)


# ---- one flaw at a time (the graders' mutants) -------------------------------------------------
class _CountingQueueManager(NaiveBlockManager):
    """Flaw 2 only: the O(n) ``pop(0)`` free list, with real reference counts."""

    def fork_blocks(self, block_ids: list[int]) -> list[int]:
        for bid in block_ids:
            self.ref_count[bid] += 1
        return list(block_ids)

    def free_sequence_blocks(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            self.ref_count[bid] -= 1
            if self.ref_count[bid] == 0:
                self.free_blocks.append(bid)


class _UncountedStackManager(NaiveBlockManager):
    """Flaw 3 only: an O(1) free stack, without reference counts."""

    def allocate_block(self) -> int | None:
        if not self.free_blocks:
            return None
        bid = self.free_blocks.pop()
        self.ref_count[bid] = 1
        return bid


#: For each flaw, an implementation with that flaw and no other.
ONLY_FLAW = {
    1: types.SimpleNamespace(name="flaw 1 only", BlockManager=PagedBlockManager, Scheduler=NaiveScheduler,
                             SequenceRequest=SequenceRequest),
    2: types.SimpleNamespace(name="flaw 2 only", BlockManager=_CountingQueueManager, Scheduler=PagedScheduler,
                             SequenceRequest=SequenceRequest),
    3: types.SimpleNamespace(name="flaw 3 only", BlockManager=_UncountedStackManager, Scheduler=PagedScheduler,
                             SequenceRequest=SequenceRequest),
}


def time_allocations(manager, count: int) -> float:
    """Seconds ``manager`` takes to hand out ``count`` blocks (best of three rounds, freeing
    them in between)."""
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        ids = [manager.allocate_block() for _ in range(count)]
        best = min(best, time.perf_counter() - t0)
        manager.free_sequence_blocks([b for b in ids if b is not None])
    return best


# ---- graders --------------------------------------------------------------------------------
_NOT_A_TEST = (NotImplementedError, NameError, TypeError, AttributeError, SyntaxError)


def _run(test: Callable, impl) -> BaseException | None:
    try:
        test(impl)
    except Exception as e:        # noqa: BLE001 - the verdict depends on what was raised
        return e
    return None


def _grade_test(test: object, number: int, flaw: str, what: str) -> None:
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    if test is Ellipsis or test is None or not callable(test):
        fail(f"{flaw}: pass your test function itself (e.g. check_...(test_name)), not {test!r}.")
    name = getattr(test, "__name__", "your test")
    for impl, label in ((naive, "the naive implementation"),
                        (ONLY_FLAW[number], "an implementation that has this flaw and no other")):
        got = _run(test, impl)
        if isinstance(got, NotImplementedError):
            fail(f"{flaw}: {name} still raises NotImplementedError: write the test.")
        if got is None:
            fail(f"{flaw}: {name} passes on {label}, so it does not expose this flaw. {what}")
        if not isinstance(got, AssertionError):
            hint = ("That looks like a bug in the test itself. " if isinstance(got, _NOT_A_TEST) else
                    "A test should detect the flaw with an `assert ...`, not crash on it. ")
            fail(f"{flaw}: on {label} {name} raised {type(got).__name__}: {got}. {hint}{what}")
        if impl is naive:
            on_naive = got
    on_paged = _run(test, paged)
    if on_paged is not None:
        fail(f"{flaw}: {name} fails on the paged implementation too ({type(on_paged).__name__}: "
             f"{on_paged}), which does not have this flaw. A test must fail because of the flaw, not "
             "for reasons every implementation shares (check the sizes and the steps you ran).")
    message = str(on_naive).strip() or "(no message: give your assert one)"
    passed(f"{name} fails on the naive manager ({message[:160]}) and passes on labkit's.")


def check_generated_tokens_test(test: object) -> None:
    """Flaw 1: a test that fails when generated tokens get no slots (``impl`` -> None)."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _grade_test(test, 1, "flaw 1 (generated tokens)",
                "Run a request whose prompt plus generated tokens outgrow the blocks of its prompt, "
                "and assert after every iteration that len(block_table) * block_size >= the tokens "
                "the request holds (prompt + generated).")


def check_free_list_test(test: object) -> None:
    """Flaw 2: a test that fails when allocation time grows with the pool size."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _grade_test(test, 2, "flaw 2 (O(n) free list)",
                "Time the same number of allocations (time_allocations) from a small pool and from "
                "a large one (e.g. 1,000 and 1,000,000 blocks) and assert the large pool is not "
                "much slower (say, less than 10×).")


def check_shared_blocks_test(test: object) -> None:
    """Flaw 3: a test that fails when freeing one holder of a shared block frees it for all."""
    __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
    _grade_test(test, 3, "flaw 3 (no reference counts)",
                "Fork a running request (scheduler.fork), let one of the two finish, allocate new "
                "blocks, and assert that none of them is a block the survivor still holds.")
