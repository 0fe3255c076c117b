"""The engine under random use: a hypothesis state machine over ``Engine`` with a real model
(``tiny-llama`` through ``LLM``) and with the simulator.

Rules do what users do, in any order: add a request (n 1-3, stop strings, stop token ids,
min/max tokens, seeds, greedy or not, prompts from 1 token to past the model's limit),
abort one, fork a decoding sequence, step, open a stream and abandon it. Every
configuration runs: both policies, chunked prefill on and off, prefix caching on and off,
on pools small enough that preemption happens.

After every rule:
* the allocator's invariants hold, and each block's reference count is the number of live
  tables holding it;
* every running sequence's block table holds exactly its computed tokens; waiting and
  finished sequences hold no blocks (the static policy's finished ones until their batch ends);
* the batch never exceeds ``max_num_seqs``;
* a finish reason, once set, never changes.

At the end, the engine drains within a bound of steps; then no block is held, no request
or per-sequence text is left, and every greedy request that was not aborted or forked has
the tokens the same request gets run alone.
"""

from __future__ import annotations

import collections
import copy
import string
import warnings

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from labkit import LLM, SamplingParams
from labkit.engine import Engine
from labkit.memory import BlockAllocator
from labkit.request import Request, Status
from labkit.scheduler import make_scheduler
from labkit.sim import SimExecutor

BLOCK_SIZE = 4
MAX_MODEL_LEN = 40          # prompts are drawn up to past it: the limit itself is exercised
VOCAB = 384                 # tiny-llama's (the simulator maps ids into a smaller one)
NUM_BLOCKS = 11             # 44 slots: a few requests fill it, preemption follows

# (policy, chunked prefill, prefix caching): every combination the policies have.
CONFIGS = {
    "continuous-chunked-cached": ("continuous", True, True),
    "continuous-chunked": ("continuous", True, False),
    "continuous-whole-cached": ("continuous", False, True),
    "continuous-whole": ("continuous", False, False),
    "static-cached": ("static", False, True),
    "static": ("static", False, False),
}


def scheduler_options(config: str) -> dict:
    _, chunked, _ = CONFIGS[config]
    return dict(max_num_seqs=4, max_num_batched_tokens=24, enable_chunked_prefill=chunked,
                max_model_len=MAX_MODEL_LEN, watermark=0.0)


# Prompts share a prefix often, so prefix-cache hits (and forks of cached blocks) happen.
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
prompts = st.one_of(
    st.one_of(st.integers(1, 12), st.integers(13, MAX_MODEL_LEN + 1)).flatmap(
        lambda n: st.lists(st.integers(3, VOCAB - 1), min_size=n, max_size=n)),
    st.builds(lambda n, tail: SHARED[:n] + tail, st.integers(4, len(SHARED)),
              st.lists(st.integers(3, VOCAB - 1), max_size=12)),
)
# Single characters the random model's byte-level output contains now and then; U+FFFD,
# the replacement character, is in a fifth of its text (random bytes are rarely UTF-8).
stop_strings = st.lists(st.sampled_from(list(string.ascii_letters + string.digits + " .,:;") + ["\ufffd"]),
                        max_size=3, unique=True)
# A few ids, or one id in eight: samples then stop at different steps.
stop_token_ids = st.one_of(st.lists(st.integers(3, VOCAB - 1), max_size=3), st.just(list(range(3, VOCAB, 8))))


@st.composite
def sampling_params(draw) -> SamplingParams:
    max_tokens = draw(st.integers(1, 10))
    greedy = draw(st.booleans())
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=draw(st.integers(0, max_tokens)),
        temperature=0.0 if greedy else draw(st.sampled_from([0.7, 1.0, 1.5])),
        top_p=draw(st.sampled_from([1.0, 0.9])), top_k=draw(st.sampled_from([0, 20])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**16))), n=draw(st.sampled_from([1, 1, 2, 3])),
        stop=draw(stop_strings), stop_token_ids=draw(stop_token_ids),
        ignore_eos=draw(st.booleans()))


# What the runs reached, per machine class: the tests check every rule did its work.
EVENTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


class EngineMachine(RuleBasedStateMachine):
    """Drives one engine; subclasses pick the configuration and the executor."""

    CONFIG = "continuous-chunked-cached"

    def __init__(self):
        super().__init__()
        self.events = EVENTS[type(self).__name__]
        self.engine = self.make_engine()
        self.scheduler = self.engine.scheduler
        self.preemptions_before = self.scheduler.num_preemptions   # the LLM is shared by examples
        self.requests: list[Request] = []        # every request this machine added
        self.reasons: dict[int, str] = {}        # seq_id -> the finish reason first seen
        self.forked: set[str] = set()            # requests with a forked child
        self.aborted: set[str] = set()
        self.num_ids = 0

    # ---- configuration ------------------------------------------------------------------
    def make_engine(self) -> Engine:
        raise NotImplementedError

    def run_alone(self, request: Request) -> list[list[int]]:
        """The output tokens of each sample of ``request``, run alone on a fresh engine."""
        raise NotImplementedError

    # ---- rules ----------------------------------------------------------------------------
    @initialize()
    def starts_idle(self):
        assert not self.scheduler.has_unfinished
        assert self.scheduler.allocator.num_used_blocks == 0

    def adapt(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The request this executor's vocabulary can take (a hook)."""
        return prompt, params

    @rule(prompt=prompts, params=sampling_params())
    def add(self, prompt, params):
        prompt, params = self.adapt(prompt, params)
        before = (len(self.scheduler.waiting), self.scheduler.allocator.num_free_blocks)
        self.num_ids += 1
        try:
            request = self.engine.add_request(prompt, params, request_id=f"m{self.num_ids}")
        except ValueError:
            # Too long for the model or the pool, or n > 1 under the static policy: refused,
            # and nothing changed.
            assert (len(self.scheduler.waiting), self.scheduler.allocator.num_free_blocks) == before
            assert f"m{self.num_ids}" not in self.scheduler.requests
            self.events["add refused"] += 1
            return
        self.requests.append(request)
        self.events["add"] += 1

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        assert self.engine.abort(rid)
        self.aborted.add(rid)
        self.events["abort"] += 1
        assert not self.engine.abort(rid), "a second abort finds nothing"

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def fork(self, data):
        """Fork a running sequence, mostly; sometimes one that is waiting or finished."""
        candidates = self.scheduler.running or [s for r in self.requests for s in r.seqs]
        parent = data.draw(st.sampled_from(candidates))
        self.events["fork tried"] += 1
        width = sum(s.request.width for s in self.scheduler.running)
        num_seqs = len(parent.request.seqs)
        try:
            child = self.scheduler.fork(parent)
        except ValueError:
            # Not running, not decoding yet, a full batch, or the static policy: refused,
            # and nothing changed.
            assert sum(s.request.width for s in self.scheduler.running) == width
            assert len(parent.request.seqs) == num_seqs
            self.events["fork refused"] += 1
            return
        self.events["fork"] += 1
        assert parent.status is Status.RUNNING and width < self.scheduler.max_num_seqs
        assert child.token_ids == parent.token_ids and child.status is Status.RUNNING
        self.forked.add(parent.request.request_id)

    @precondition(lambda self: self.scheduler.has_unfinished)
    @rule()
    def step(self):
        before = self.engine.num_steps
        self.engine.step()
        assert self.engine.num_steps == before + 1, "unfinished requests, yet nothing was scheduled"
        self.events["step"] += 1

    # ---- invariants -----------------------------------------------------------------------
    @invariant()
    def memory_is_consistent(self):
        sched = self.scheduler
        alloc = sched.allocator
        alloc.check_invariants()
        holders = collections.Counter()
        for seq in sched.sequences_holding_blocks():
            assert seq.block_table is not None and not seq.block_table.freed
            holders.update(seq.block_table.block_ids)
        for block_id in range(alloc.num_blocks):
            assert alloc.ref_count(block_id) == holders[block_id], block_id
        for seq in sched.running:
            assert seq.status is Status.RUNNING
            assert seq.block_table.num_tokens == seq.num_computed_tokens, seq
        for seq in sched.waiting:
            assert seq.status is Status.WAITING and seq.block_table is None, seq
        assert len(sched.running) <= sum(s.request.width for s in sched.running) <= sched.max_num_seqs

    @invariant()
    def finish_reasons_never_change(self):
        for request in self.requests:
            for seq in request.seqs:
                if seq.finish_reason is None:
                    assert seq.status is not Status.FINISHED
                    continue
                assert seq.status is Status.FINISHED
                assert self.reasons.setdefault(seq.seq_id, seq.finish_reason) == seq.finish_reason, seq
                assert seq.finish_reason in ("stop", "length", "abort")

    # ---- the end ----------------------------------------------------------------------------
    def teardown(self):
        sched = self.scheduler
        # Each step computes at least one token of some sequence; preemption may recompute a
        # sequence's tokens once per preemption. This bound is generous and still finite.
        bound = 20 + 4 * sum((len(r.prompt_token_ids) + r.params.max_tokens) * max(r.params.n, len(r.seqs))
                             for r in sched.requests.values())
        steps = 0
        while sched.has_unfinished:
            assert steps < bound, f"the engine did not drain in {bound} steps"
            self.step()
            self.memory_is_consistent()
            self.finish_reasons_never_change()
            steps += 1
        assert not sched.running and not sched.waiting and not sched.requests
        assert not sched.sequences_holding_blocks()
        assert sched.allocator.num_used_blocks == 0, "blocks leaked"
        for request in self.requests:
            assert request.finished and request.finished_time is not None
            if request.request_id not in self.aborted:
                assert "abort" not in {s.finish_reason for s in request.seqs}
                assert len(request.seqs) >= request.params.n
            if (request.params.greedy and request.request_id not in self.aborted
                    and request.request_id not in self.forked):
                got = [s.output_token_ids for s in request.seqs]
                assert got == self.run_alone(request), request
                self.events["greedy = alone"] += 1
            self.events.update(f"finish {s.finish_reason}" for s in request.seqs)
            self.engine.release(request)
        assert self.engine.num_tracked_sequences == 0, "per-sequence text state leaked"
        self.events["preemption"] += sched.num_preemptions - self.preemptions_before
        assert not self.engine.deltas


class SimMachine(EngineMachine):
    """The simulator's executor: dummy tokens, a function of (request, sample, position).
    Its vocabulary is small, so stop token ids end samples often, at different steps."""

    VOCAB = 24

    def adapt(self, prompt, params):
        params = copy.copy(params)
        params.stop_token_ids = [t % self.VOCAB for t in params.stop_token_ids]
        return [t % self.VOCAB for t in prompt], params

    def make_engine(self) -> Engine:
        policy, _, caching = CONFIGS[self.CONFIG]
        alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=caching)
        return Engine(make_scheduler(policy, alloc, **scheduler_options(self.CONFIG)),
                      SimExecutor(vocab_size=self.VOCAB), keep_records=False)

    def run_alone(self, request: Request) -> list[list[int]]:
        engine = self.make_engine()
        alone = engine.add_request(request.prompt_token_ids, request.params, request_id=request.request_id)
        while engine.has_unfinished:
            engine.step()
        return [s.output_token_ids for s in alone.seqs]


_LLMS: dict[str, LLM] = {}


def tiny_llm(config: str) -> LLM:
    """One ``LLM`` per configuration, shared by the examples: each starts it idle with an
    empty prefix cache, as a fresh one, so that a failing example replays the same way."""
    llm = _LLMS.get(config)
    if llm is not None and (llm.scheduler.has_unfinished or llm.allocator.num_used_blocks
                            or llm.engine.num_tracked_sequences):
        llm = None                       # a failed example left it dirty: start over
    if llm is not None:
        llm.reset_prefix_cache()
    else:
        policy, chunked, caching = CONFIGS[config]
        options = scheduler_options(config)
        _LLMS[config] = LLM("tiny-llama", policy=policy, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS,
                            enable_prefix_caching=caching, max_num_seqs=options["max_num_seqs"],
                            max_num_batched_tokens=options["max_num_batched_tokens"],
                            enable_chunked_prefill=chunked, max_model_len=MAX_MODEL_LEN, watermark=0.0)
    return _LLMS[config]


class ModelMachine(EngineMachine):
    """The real engine path: ``LLM`` with ``tiny-llama``, its tokenizer, its stop strings."""

    def make_engine(self) -> Engine:
        torch.manual_seed(0)                # unseeded samples draw from the global generator
        self.llm = tiny_llm(self.CONFIG)
        return self.llm.engine

    def run_alone(self, request: Request) -> list[list[int]]:
        out = self.llm.generate([request.prompt_token_ids], request.params, use_tqdm=False)[0]
        return [c.token_ids for c in out.outputs]

    @rule(prompt=prompts, params=sampling_params(), take=st.integers(0, 3))
    def abandon_a_stream(self, prompt, params, take):
        """Open a stream, read a few outputs, walk away: its request ends, nothing is kept."""
        mine = set(self.scheduler.requests)
        stream = self.llm.generate_stream([prompt], params)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "labkit: request rejected")   # an unservable prompt
            for _ in range(take):
                if next(stream, None) is None:
                    break
        stream.close()
        assert set(self.scheduler.requests) <= mine, "the stream's request outlived it"
        self.events["stream"] += 1


SIM_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
MODEL_SETTINGS = settings(max_examples=12, stateful_step_count=25, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def check_reached_everything(events: collections.Counter, config: str, *, model: bool) -> None:
    """Fail when the examples were too few to exercise what the machine exists for: every
    rule, in every configuration. The simulator's runs (deterministic: dummy tokens) must
    also reach every outcome; a model's tokens depend on float rounding, so only its rules
    are required of it."""
    wanted = ["add", "abort", "fork tried", "step", "greedy = alone"]
    if model:
        wanted.append("stream")
    else:
        wanted += ["add refused", "finish length", "finish abort", "finish stop", "fork refused"]
        if CONFIGS[config][0] == "continuous":    # static batching neither forks nor preempts
            wanted += ["fork", "preemption"]
    missing = [w for w in wanted if not events[w]]
    assert not missing, f"{config}: never reached {missing} ({dict(events)})"


@pytest.mark.parametrize("config", CONFIGS)
def test_simulated_engine_under_random_use(config):
    machine = type(f"Sim_{config}", (SimMachine,), {"CONFIG": config})
    run_state_machine_as_test(machine, settings=SIM_SETTINGS)
    check_reached_everything(EVENTS[machine.__name__], config, model=False)


@pytest.mark.parametrize("config", CONFIGS)
def test_model_engine_under_random_use(config):
    machine = type(f"Model_{config}", (ModelMachine,), {"CONFIG": config})
    run_state_machine_as_test(machine, settings=MODEL_SETTINGS)
    check_reached_everything(EVENTS[machine.__name__], config, model=True)
