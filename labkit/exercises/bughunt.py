"""Chapter 2's bug hunt (exercises 2.2-2.4): a naive paged block manager with three flaws,
and the graders of the tests that expose them.

The vLLM article ("Continuous Batching & PagedAttention: vLLM Memory Management
Architecture", a widely shared blog post) presents a "production-grade" block manager and
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

and the graders judge each test by behaviour alone. They run it against implementations
whose names and classes reveal nothing (every one is a fresh class named ``BlockManager``
or ``Scheduler``, related to no class a test could import, and has no ``name``): the naive
one and one with only the flaw in question (built on labkit's allocator, so it looks like
the correct one in every attribute) must make it fail with an ``AssertionError``; the
correct one must make it pass, every time it is run (a timing test that fails at random
on a correct manager is rejected). The runs come in a shuffled order, so a "test" that
counts its calls cannot know which implementation it is given.

Each grader comes in two halves, so that ``labkit.grade`` can run the student's test where
it lives (their kernel, in a sandbox) and judge it where their code cannot reach: ``probe``
runs the test in the order of a ``plan`` and returns what happened on each run as plain
data; ``judge`` reads that and gives the verdict. In a notebook the grader does both. A test's
answer is its code, so ``labkit.grade`` does not take the student's kernel's word for what it did
once that says it passes (``rerun``): it runs the test's source again on its own, in a clean
sandbox, under this module's ``probe``, and judges that run.
"""

from __future__ import annotations

import math
import random
import time
import types
from dataclasses import dataclass, field
from typing import Callable

from ..memory import BlockAllocator, NoFreeBlocksError
from ._grading import fail, graded, passed, shown


# ---- the shared record -------------------------------------------------------------------
@dataclass(slots=True)
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


# ---- the naive implementation (the vLLM article's design, flaws kept) ------------------------
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
        return list(self.allocator.free_block_ids)

    @property
    def ref_count(self) -> list[int]:
        return list(self.allocator.ref_counts)

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
class _FrontPopManager(PagedBlockManager):
    """Flaw 2 only: labkit's allocator, but every allocation first shifts a list as long as
    the pool, as ``list.pop(0)`` on the naive free list does, and puts it back as it was: the
    cost of the naive free list without its first-in-first-out order, so only a test of the
    cost catches it."""

    def allocate_block(self) -> int | None:
        if not hasattr(self, "shifted"):
            self.shifted = list(range(self.allocator.num_blocks))     # as long as the pool
        self.shifted.insert(0, self.shifted.pop(0))   # flaw 2: O(pool) on every allocation, order kept
        try:
            return self.allocator.allocate()
        except NoFreeBlocksError:
            return None


class _UncountedManager(PagedBlockManager):
    """Flaw 3 only: labkit's allocator, but a second holder of a block is never counted,
    so the first holder to free it frees it for everyone."""

    def fork_blocks(self, block_ids: list[int]) -> list[int]:
        return list(block_ids)                  # flaw 3: nobody counts the second holder

    def free_sequence_blocks(self, block_ids: list[int]) -> None:
        for bid in block_ids:
            if self.allocator.ref_count(bid) > 0:   # already freed by the other holder: nothing left
                self.allocator.free(bid)


#: For each flaw, the (block manager, scheduler) classes of an implementation that has
#: that flaw and no other. The mutants of flaws 2 and 3 are labkit's manager with one
#: method changed, so no attribute tells them from the correct one.
_FLAW_ONLY: dict[int, tuple[type, type]] = {
    1: (PagedBlockManager, NaiveScheduler),
    2: (_FrontPopManager, PagedScheduler),
    3: (_UncountedManager, PagedScheduler),
}
#: The same, as implementations to try a test on by hand: ``test_...(ONLY_FLAW[2])``.
ONLY_FLAW = {flaw: types.SimpleNamespace(name=f"flaw {flaw} only", BlockManager=manager, Scheduler=scheduler,
                                         SequenceRequest=SequenceRequest)
             for flaw, (manager, scheduler) in _FLAW_ONLY.items()}


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


# ---- implementations that reveal nothing but their behaviour ------------------------------
#: Scheduler iterations one run of a student's test may take before it is stopped (a test
#: that waits for a request that can never finish would otherwise hang the grader).
ITERATION_LIMIT = 100_000


class _Runaway(Exception):
    """A test ran more than ``ITERATION_LIMIT`` scheduler iterations."""


def _opaque(fn: Callable) -> Callable:
    """``fn`` behind a forwarder whose code, source and docstring are the same for every
    implementation: ``inspect.getsource`` on a method tells a test nothing."""
    def method(self, *args, **kwargs):
        return fn(self, *args, **kwargs)
    method.__name__ = method.__qualname__ = fn.__name__
    return method


def _fresh_class(cls: type, name: str, limit: list[int] | None = None) -> type:
    """A new class named ``name`` with the behaviour of ``cls`` (its whole MRO flattened)
    and no relation to it: ``isinstance``, ``type(x).__name__``, ``__module__`` or a
    method's source cannot tell which implementation a test was given. With ``limit`` (a
    one-item countdown), its ``schedule_iteration`` stops a test that never ends."""
    namespace: dict = {}
    for klass in reversed(cls.__mro__[:-1]):
        namespace.update(vars(klass))
    for key in ("__dict__", "__weakref__", "__doc__"):
        namespace.pop(key, None)
    for key, value in namespace.items():
        if isinstance(value, types.FunctionType):
            namespace[key] = _opaque(value)
        elif isinstance(value, property):
            namespace[key] = property(_opaque(value.fget))
    namespace.update(__module__="impl", __qualname__=name)
    if limit is not None:
        step = namespace["schedule_iteration"]

        def schedule_iteration(self):
            limit[0] -= 1
            if limit[0] < 0:
                raise _Runaway(f"more than {ITERATION_LIMIT:,} scheduler iterations")
            return step(self)

        namespace["schedule_iteration"] = schedule_iteration
    return type(name, (), namespace)


def _anonymous(manager: type, scheduler: type) -> types.SimpleNamespace:
    """An implementation that only its behaviour identifies: fresh ``BlockManager`` and
    ``Scheduler`` classes (like every other implementation's), no ``name``."""
    return types.SimpleNamespace(BlockManager=_fresh_class(manager, "BlockManager"),
                                 Scheduler=_fresh_class(scheduler, "Scheduler", [ITERATION_LIMIT]),
                                 SequenceRequest=SequenceRequest)


# ---- graders: run a test here (``probe``), judge what it did there (``judge``) ------------------
_NOT_A_TEST = ("NotImplementedError", "NameError", "TypeError", "AttributeError", "SyntaxError")
FLAWED, CORRECT = ("naive", "flaw"), "correct"
LABELS = {"naive": "the naive implementation", "flaw": "an implementation that has this flaw and no other",
          CORRECT: "the correct implementation"}


def run_plan(rng: random.Random, flawed_runs: int, correct_runs: int) -> dict:
    """The order a test is run in: ``flawed_runs`` times on each flawed implementation and
    ``correct_runs`` times on the correct one, shuffled (never all flawed ones first, nor all
    correct ones first), so that a test that counts its calls instead of testing cannot tell
    which run it is in."""
    kinds = [k for k in FLAWED for _ in range(flawed_runs)] + [CORRECT] * correct_runs
    while True:
        rng.shuffle(kinds)
        is_correct = [k == CORRECT for k in kinds]
        if is_correct not in (sorted(is_correct), sorted(is_correct, reverse=True)):   # not split in two
            return {"order": list(kinds)}


def _outcome(test: Callable, kind: str, number: int) -> dict:
    """What ``test`` did on a fresh, anonymous implementation of ``kind``, as plain data."""
    manager, scheduler = {"naive": (NaiveBlockManager, NaiveScheduler), "flaw": _FLAW_ONLY[number],
                          CORRECT: (PagedBlockManager, PagedScheduler)}[kind]
    try:
        result = test(_anonymous(manager, scheduler))
    except KeyboardInterrupt:
        raise
    except BaseException as e:    # noqa: BLE001 - the verdict depends on what was raised
        what = ("assertion" if isinstance(e, AssertionError) else "runaway" if isinstance(e, _Runaway)
                else "not implemented" if isinstance(e, NotImplementedError) else "error")
        return {"kind": kind, "result": what, "error": type(e).__name__, "message": str(e)[:300]}
    if result is not None:            # a check written as ``return ok``: nobody reads it
        return {"kind": kind, "result": "returned", "returned": shown(result)}
    return {"kind": kind, "result": "passed"}


def _probe(number: int):
    def probe(test: object, *, plan: dict) -> dict:
        """Run ``test`` in the plan's order (where the student's code lives: their kernel)."""
        if test is Ellipsis or test is None or not callable(test):
            return {"not a test": shown(test)}
        return {"name": str(getattr(test, "__name__", "your test"))[:80],
                "outcomes": [_outcome(test, kind, number) for kind in plan["order"]]}
    return probe


def _judge(flaw: str, concept: str):
    def judge(ran: object, *, plan: dict) -> None:
        """Accept the test if it failed with an ``AssertionError`` on every run on a flawed
        implementation and passed on every run on the correct one (``ran``: what ``probe``
        handed in, read as data)."""
        __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
        if not isinstance(ran, dict):
            fail(f"{flaw}: nothing was handed in for the test.")
        if "not a test" in ran:
            fail(f"{flaw}: pass your test function itself (e.g. check_...(test_name)), "
                 f"not {str(ran['not a test'])[:60]}.")
        outcomes = ran.get("outcomes")
        order = plan["order"]
        if not isinstance(outcomes, list) or len(outcomes) != len(order) or not all(
                isinstance(o, dict) and all(isinstance(v, str) for v in o.values()) for o in outcomes):
            fail(f"{flaw}: what the test did could not be read.")
        name = str(ran.get("name", "your test"))
        runs = list(zip(order, outcomes))                  # the plan's kinds, not what the kernel says
        on_naive = None
        for kind in FLAWED:
            label = LABELS[kind]
            for _, got in (r for r in runs if r[0] == kind):
                result = got.get("result")
                if result == "returned":
                    fail(f"{flaw}: {name} returned {got.get('returned')} on {label}. A test fails only by "
                         "raising: a returned value is ignored, so this test passes whatever it finds. "
                         "Turn the check into an `assert ..., \"message\"`.")
                if result == "not implemented":
                    fail(f"{flaw}: {name} still raises NotImplementedError: write the test.")
                if result == "runaway":
                    fail(f"{flaw}: on {label} {name} ran {got.get('message')}; does it wait for something that "
                         f"never happens? {concept}")
                if result == "passed":
                    fail(f"{flaw}: {name} passes on {label}, so it does not expose this flaw. {concept}")
                if result != "assertion":
                    hint = ("That looks like a bug in the test itself. " if got.get("error") in _NOT_A_TEST else
                            "A test should detect the flaw with an `assert ...`, not crash on it. ")
                    fail(f"{flaw}: on {label} {name} raised {got.get('error')}: {got.get('message')}. {hint}{concept}")
                on_naive = on_naive or got.get("message", "")
        correct = [got for kind, got in runs if kind == CORRECT]
        for run, got in enumerate(correct):
            if got.get("result") in ("passed", "returned"):
                continue
            what = f"{got.get('error')}: {got.get('message')}"
            if got.get("result") == "runaway":
                fail(f"{flaw}: on the correct implementation {name} ran {got.get('message')}. Does it wait for a "
                     "request that can never finish, say in a pool too small for it? (A correct manager makes a "
                     "request wait when no block is free.)")
            if run == 0:
                fail(f"{flaw}: {name} fails on the correct implementation too ({what}), which does not have "
                     "this flaw. A test must fail because of the flaw, not for reasons every implementation "
                     "shares (check the sizes and the steps you ran).")
            fail(f"{flaw}: {name} passed on the correct implementation {run} time(s), then failed ({what}). "
                 "A test that fails at random on a correct implementation is flaky: nobody can trust it. "
                 "Make the difference it measures large against the noise, and its margin generous.")
        message = (on_naive or "").strip() or "(no message: give your assert one)"
        passed(f"{name} fails on the naive manager ({message[:160]}) and passes on labkit's.")
    return judge


def _bughunt_grader(exercise: str, number: int, flaw: str, concept: str, flawed_runs: int, correct_runs: int):
    """The grader of one bug-hunt exercise, in its two halves: ``probe`` runs the student's
    test where it lives and hands in what it did, ``judge`` reads that (in ``labkit.grade``,
    outside the student's kernel); ``plan`` draws the order of the runs. Called in a notebook,
    it does all three itself, in a fresh random order each time."""
    probe, judge = _probe(number), _judge(flaw, concept)

    def plan(rng: random.Random) -> dict:
        return run_plan(rng, flawed_runs, correct_runs)

    @graded(exercise)
    def check(test: object) -> None:
        __tracebackhide__ = True     # tracebacks show the student's cell, not the grader
        order = plan(random.Random())
        judge(probe(test, plan=order), plan=order)

    check.probe, check.judge, check.plan = probe, judge, plan
    check.rerun = True           # labkit.grade runs the test's source again in a clean sandbox (module docstring)
    return check


check_generated_tokens_test = _bughunt_grader(
    "2.2", 1, "Exercise 2.2 (flaw 1, generated tokens)",
    "After every iteration, what must hold between the tokens a running request holds "
    "and the slots its block table gives it?", flawed_runs=2, correct_runs=3)
check_generated_tokens_test.__doc__ = "Exercise 2.2 (flaw 1): a test that fails when generated tokens get no slots."
check_generated_tokens_test.__name__ = check_generated_tokens_test.__qualname__ = "check_generated_tokens_test"

#: Runs of a timing test on the correct manager that must all pass.
TIMING_RUNS = 5
check_free_list_test = _bughunt_grader(
    "2.3", 2, "Exercise 2.3 (flaw 2, the O(n) free list)",
    "What does one allocation from the naive free list cost, and what does that cost "
    "grow with? A correct manager's cost does not.", flawed_runs=2, correct_runs=TIMING_RUNS)
check_free_list_test.__doc__ = ("Exercise 2.3 (flaw 2): a test that fails when allocation time grows with the pool "
                                f"size; it must pass on the correct manager {TIMING_RUNS} times out of as many.")
check_free_list_test.__name__ = check_free_list_test.__qualname__ = "check_free_list_test"

check_shared_blocks_test = _bughunt_grader(
    "2.4", 3, "Exercise 2.4 (flaw 3, no reference counts)",
    "What must happen to a block that two sequences hold when one of them finishes, and "
    "what may the manager hand out next?", flawed_runs=2, correct_runs=3)
check_shared_blocks_test.__doc__ = ("Exercise 2.4 (flaw 3): a test that fails when freeing one holder of a shared "
                                    "block frees it for all.")
check_shared_blocks_test.__name__ = check_shared_blocks_test.__qualname__ = "check_shared_blocks_test"


def answer_forms() -> dict[str, list[str]]:
    """The key expressions of the tests (for the leak scan): what would hand a student the
    check itself."""
    return {
        "2.2": ["len(req.block_table) * manager.block_size", "slots >= req.num_tokens"],
        "2.3": ["t_large < 10 * t_small", "time_allocations(large"],
        "2.4": ["set(new) & set(child.block_table)", "stolen = set("],
    }
