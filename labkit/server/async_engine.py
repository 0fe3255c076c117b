"""The async engine: one engine loop on its own thread, requests from any coroutine.

``LLM.generate`` knows every request before it starts. A server does not: requests arrive
while others are half done. ``AsyncEngine`` runs ``Engine.step()`` in a loop on a background
thread and takes new requests at any moment: they queue in an inbox, and the loop admits
them at its next iteration. That is continuous batching made literal.

    engine = AsyncEngine(model="tiny-llama")
    async for out in engine.generate("Hello", SamplingParams(max_tokens=8, temperature=0)):
        print(out.delta[0], end="")          # the text gained in this iteration
    engine.shutdown()

Threads: the engine thread owns the ``Engine`` (scheduler, allocator, model, tokenizer).
Everything that changes it, adding a request, aborting one, happens on that thread: other
threads and event loops only put messages into a locked inbox and wake it. Prompts are
tokenized before they reach the inbox, on a thread of their own (``tokenize``): a 1 MiB
prompt takes the tokenizer most of a second, which every running request would otherwise
wait through. Each request's
outputs travel back to the event loop that asked, through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``. With nothing to do, the thread sleeps on a condition
variable: an idle server burns no CPU.

Admission control: at most ``max_waiting`` requests may wait for their first iteration;
one more raises ``QueueFullError`` at once (the server answers 429), rather than letting
the queue, and everyone's time to first token, grow without bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator

from ..errors import DuplicateRequestId, InvalidParameter, RequestError
from ..outputs import RequestOutput, request_output
from ..request import Request, check_cache_salt, encode_prompt, is_token_id, split_prompt
from ..sampling_params import SamplingParams

log = logging.getLogger("labkit.server")

Prompt = str | list[int]


#: The longest a request's grammar may take to compile before the server refuses it (400).
GRAMMAR_COMPILE_TIMEOUT_S = 30.0


class QueueFullError(RuntimeError):
    """Too many requests wait for their first iteration: try again later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down, or crashed): no request can be served."""


@dataclass(slots=True)
class RequestRecord:
    """A served request's timings on the engine's clock, kept for plots and exercises.

    Has ``request_id``, ``arrival_time`` and ``finished_time``, so it can stand in for a
    ``Request`` in ``labkit.viz.timeline_figure``.
    """

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


class RequestStream:
    """The outputs of one request, as an async iterator of ``RequestOutput``.

    Each item holds the text and tokens so far (``outputs[i].text``, ``.token_ids``) and
    the text gained in the last iteration (``delta[i]``); the last item has
    ``finished=True``. Leaving early (``break``, a cancelled task) does not stop the
    request by itself: call ``abort()``, or use ``async with stream:``, or iterate
    ``AsyncEngine.generate`` which does both.
    """

    def __init__(self, engine: "AsyncEngine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.prompt_token_ids: list[int] = []
        self.finished = False
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request and free its KV blocks (at the engine's next turn). Idempotent."""
        if not self.finished:
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncEngine:
    """An ``LLM``'s engine run by a background thread, fed by asyncio coroutines.

    Give an ``LLM`` (its engine then belongs to this object: do not call its
    ``generate`` meanwhile) or the ``LLM`` options (``model=``, ``num_blocks=``, ...).

    ``max_waiting``: how many requests may wait for their first iteration (None: no
    bound). ``step_delay_s``: a pause after each iteration, a teaching knob that slows a
    tiny model down to a pace people can watch. ``max_records``: how many step records
    and finished-request records to keep (oldest dropped first).
    """

    def __init__(self, llm=None, *, max_waiting: int | None = 256, step_delay_s: float = 0.0,
                 max_records: int = 20_000, start: bool = True, **llm_options):
        if llm is None:
            from ..llm import LLM
            llm = LLM(**llm_options)
        elif llm_options:
            raise ValueError(f"give an LLM or LLM options, not both: {sorted(llm_options)}")
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 0):
            raise ValueError(f"max_waiting must be an integer >= 0 or None, got {max_waiting!r}")
        if step_delay_s < 0:
            raise ValueError(f"step_delay_s must be >= 0, got {step_delay_s!r}")
        self.llm = llm
        self.engine = llm.engine
        self.tokenizer = llm.tokenizer
        self.model_name: str = llm.runner.name
        self.max_model_len: int = llm.max_model_len
        self.vocab_size: int = llm.runner.vocab_size
        self.max_waiting = max_waiting
        self.step_delay_s = step_delay_s
        self.max_records = max_records

        self._cond = threading.Condition()
        self._inbox: deque = deque()                         # ("add", ...) / ("abort", id)
        self._streams: dict[str, RequestStream] = {}         # live requests, by id
        self._unscheduled: set[str] = set()                  # not yet in an iteration
        self._requests: dict[str, Request] = {}              # engine thread only
        self._sent: dict[int, int] = {}                      # seq_id -> chars streamed (engine thread)
        self._finished: deque[RequestRecord] = deque(maxlen=max_records)
        # One thread tokenizes, in arrival order: big prompts queue here, not in the engine loop.
        self._tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="labkit-tokenize")
        # Grammars (structured outputs) compile on a thread of their own: a slow schema delays
        # other schemas, never the engine's iterations nor anybody's tokenization.
        self._grammar_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="labkit-grammar")
        self._ids = itertools.count()
        self._stopping = False
        self._error: BaseException | None = None
        self.counters = {"requests_finished": 0, "requests_aborted": 0, "rejected_queue_full": 0,
                         "rejected_invalid": 0, "prompt_tokens": 0}
        self._stats: dict = {}
        self._refresh_stats()
        self._thread: threading.Thread | None = None
        if start:
            self.start()

    # ---- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="labkit-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop: every unfinished request ends with ``finish_reason="abort"``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    close = shutdown

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine loop, if one did."""
        return self._error

    def now(self) -> float:
        """The engine's clock (seconds), the one request timings and step records use."""
        return self.engine.now

    # ---- requests -----------------------------------------------------------------
    async def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """``(text or None, token ids)`` of a prompt (text, token ids or a prompt dict, as
        ``add_request`` takes it), text tokenized on the tokenizer's thread, never on the
        engine's. Raises ``ValueError`` for something that is not a prompt."""
        text, _ = split_prompt(prompt)
        if not isinstance(text, str):
            return encode_prompt(text, self.tokenizer)          # token ids: only checked
        return await self._on_tokenizer_thread(encode_prompt, text, self.tokenizer)

    async def render_chat(self, messages: list[dict]) -> str:
        """A conversation as the model's chat template writes it (with the generation
        prompt), rendered on the tokenizer's thread. ``ValueError`` with the template's own
        complaint (roles, order) for messages it rejects."""
        def render() -> str:
            try:
                return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - a template raises what it likes
                raise InvalidParameter(f"the chat template rejected the messages: {e}", "messages") from None
        return await self._on_tokenizer_thread(render)

    async def compile_grammar(self, spec, timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S) -> None:
        """Compile a request's grammar (its ``StructuredOutputsParams``) for the model's
        vocabulary on the grammar thread, so that the engine's thread finds it in its cache
        (compiling can take seconds; a mask then takes microseconds). ``ValueError`` when it
        cannot be compiled, or not within ``timeout_s`` (the compilation goes on, off every
        request's path, and its result is cached)."""
        def compile_now() -> None:
            grammars = getattr(self.engine.executor, "grammars", None)
            if grammars is None:
                raise RequestError("this engine's executor cannot constrain its tokens (a simulator)",
                                   "structured_outputs", "unsupported_parameter")
            grammars.check(spec)
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(self._grammar_pool, compile_now)
        except RuntimeError as e:
            raise EngineDeadError(f"the engine is not running ({e})") from None
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except asyncio.TimeoutError:
            raise ValueError(f"the grammar did not compile within {timeout_s:g} s; a simpler schema, regex or "
                             "grammar will") from None

    async def _on_tokenizer_thread(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)
        except RuntimeError as e:
            if "shutdown" not in str(e):
                raise
            raise EngineDeadError(f"the engine is not running ({e})") from None

    async def add_request(self, prompt: Prompt | dict, params: SamplingParams | None = None,
                          request_id: str | None = None, *, fill_context: bool = False,
                          cache_salt: str | None = None, prompt_token_ids: list[int] | None = None) -> RequestStream:
        """Queue a request and return its stream once the engine has accepted it.

        ``prompt``: text (tokenized with special tokens, as ``LLM.generate`` does, on the
        tokenizer's thread), token ids, or vLLM's prompt dict (``{"prompt": text}`` or
        ``{"prompt_token_ids": ids}``, with an optional ``"cache_salt"``).
        ``prompt_token_ids``: the ids of the text ``prompt`` when the caller has them already
        (the server tokenizes first, to check the context). ``cache_salt``: the request's
        prefix-cache namespace (``Request``). ``fill_context``: ignore ``params.max_tokens``
        and generate up to the model's context length. Raises ``ValueError`` for a request
        that can never run (bad parameters, prompt too long, unknown tokens: the engine's
        message), ``QueueFullError`` when ``max_waiting`` requests wait already,
        ``EngineDeadError`` when the loop has stopped.
        """
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"expected SamplingParams, got {type(params).__name__}")
        params.validate()
        if request_id is not None and not isinstance(request_id, str):
            raise ValueError(f"request_id must be a string, got {type(request_id).__name__}")
        given, salt = split_prompt(prompt)
        cache_salt = cache_salt if cache_salt is not None else salt
        check_cache_salt(cache_salt)
        if prompt_token_ids is None:
            text, ids = await self.tokenize(given)
        else:
            if not (isinstance(prompt_token_ids, list) and all(is_token_id(t) for t in prompt_token_ids)):
                raise ValueError("prompt_token_ids must be a list of token ids (integers)")
            text, ids = (given if isinstance(given, str) else None), prompt_token_ids
        loop = asyncio.get_running_loop()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if self._error is not None or self._stopping or self._thread is None:
                raise EngineDeadError("the engine is not running" + (f": {self._error!r}" if self._error else ""))
            if self.max_waiting is not None and len(self._unscheduled) >= self.max_waiting:
                self.counters["rejected_queue_full"] += 1
                raise QueueFullError(f"the server is at capacity: {len(self._unscheduled)} requests are "
                                     f"waiting already (max_waiting={self.max_waiting}); retry later")
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
            if request_id in self._streams:
                self.counters["rejected_invalid"] += 1
                raise DuplicateRequestId(f"request id {request_id!r} is already in use")
            stream = RequestStream(self, request_id, loop)
            self._streams[request_id] = stream
            self._unscheduled.add(request_id)
            self._inbox.append(("add", request_id, text, ids, params, fill_context, cache_salt, future))
            self._cond.notify()
        try:
            stream.prompt_token_ids = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None,
                       request_id: str | None = None, **options) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; leaving the loop early aborts it."""
        stream = await self.add_request(prompt, params, request_id, **options)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Stop a request, wherever it is, from any thread; its stream ends with an output
        whose ``finish_reason`` is ``"abort"`` and its blocks are freed at once."""
        with self._cond:
            if request_id in self._streams:
                self._inbox.append(("abort", request_id))
                self._cond.notify()

    # ---- what the demo and /metrics read --------------------------------------------
    def stats(self) -> dict:
        """A consistent snapshot of the engine's counters, taken between iterations."""
        with self._cond:
            return dict(self._stats)

    def records(self, since_step: int = 0) -> list:
        """The engine's ``StepRecord``s with ``step > since_step`` (oldest first)."""
        records = list(self.engine.records)          # a copy: the engine thread appends
        return [r for r in records if r.step > since_step]

    def finished_requests(self, ids=None) -> list[RequestRecord]:
        """Timings of finished (or aborted) requests, optionally only those in ``ids``."""
        with self._cond:
            records = list(self._finished)
        if ids is not None:
            wanted = set(ids)
            records = [r for r in records if r.request_id in wanted]
        return records

    @property
    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._streams)

    # ---- the engine thread ----------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not (self._inbox or self._stopping or engine.has_unfinished):
                        self._cond.wait()           # idle: sleep until someone calls
                    inbox = list(self._inbox)
                    self._inbox.clear()
                    stopping = self._stopping
                for item in inbox:
                    if item[0] == "add":
                        self._admit(*item[1:])
                    else:
                        self._abort_now(item[1])
                if stopping:
                    break
                if engine.has_unfinished:
                    self._step()
                self._refresh_stats()
                if self.step_delay_s and engine.has_unfinished:
                    with self._cond:
                        self._cond.wait(self.step_delay_s)
        except BaseException as e:  # noqa: BLE001 - report to every waiting client
            log.exception("labkit: the engine loop failed")
            self._error = e
            with self._cond:
                pending = [i for i in self._inbox if i[0] == "add"]
                self._inbox.clear()
            for item in pending:
                item[-1].set_exception(EngineDeadError(f"the engine failed: {e!r}"))
            for rid in list(self._streams):
                self._fail(rid, EngineDeadError(f"the engine failed: {e!r}"))
        finally:
            with self._cond:
                self._stopping = True
                pending = [i for i in self._inbox if i[0] == "add"]
                self._inbox.clear()
            for item in pending:
                if not item[-1].done():
                    item[-1].set_exception(EngineDeadError("the engine has shut down"))
            for rid in list(self._requests):
                try:
                    self._abort_now(rid)
                except Exception:  # noqa: BLE001
                    self._fail(rid, EngineDeadError("the engine has shut down"))
            self._refresh_stats()

    def _admit(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams,
               fill_context: bool, cache_salt: str | None, future: concurrent.futures.Future) -> None:
        try:
            if fill_context:
                params.max_tokens = max(1, self.max_model_len - len(ids))
                params.min_tokens = min(params.min_tokens, params.max_tokens)
            request = self.engine.add_request(ids, params, request_id=request_id, prompt=text,
                                              cache_salt=cache_salt)
        except Exception as e:  # noqa: BLE001 - a bad request must not stop the loop
            with self._cond:
                self._streams.pop(request_id, None)
                self._unscheduled.discard(request_id)
                self.counters["rejected_invalid"] += 1
            future.set_exception(e if isinstance(e, ValueError) else ValueError(str(e)))
            return
        self._requests[request_id] = request
        with self._cond:
            self.counters["prompt_tokens"] += len(ids)
        future.set_result(list(ids))

    def _step(self) -> None:
        engine = self.engine
        before = engine.num_steps
        finished = engine.step()
        if engine.num_steps == before:          # nothing could be scheduled: do not spin
            with self._cond:
                self._cond.wait(0.002)
            return
        plan = engine.last_plan
        touched = {item.seq.request.request_id for item in plan.scheduled if item.num_samples}
        touched.update(r.request_id for r in finished)
        for rid in touched:
            request = self._requests.get(rid)
            if request is not None:
                self._publish(request)
        with self._cond:
            for rid in list(self._unscheduled):
                request = self._requests.get(rid)
                if request is not None and (request.first_scheduled_time is not None or request.finished):
                    self._unscheduled.discard(rid)
        if len(engine.records) > self.max_records + self.max_records // 4:
            del engine.records[:len(engine.records) - self.max_records]

    def _abort_now(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is None:
            return
        self.engine.abort(request_id)
        self._publish(request)

    def _publish(self, request: Request) -> None:
        """Send the request's output so far to its stream; retire it if it finished."""
        rid = request.request_id
        with self._cond:
            stream = self._streams.get(rid)
        out = self._output(request)
        if stream is not None:
            try:
                stream._loop.call_soon_threadsafe(stream._queue.put_nowait, out)
            except RuntimeError:                 # its event loop is gone: nobody listens
                if not request.finished:
                    self.engine.abort(rid)
                    out = self._output(request)
        if request.finished:
            self._retire(request, out)

    def _retire(self, request: Request, out: RequestOutput) -> None:
        self.engine.release(request)
        for seq in request.seqs:
            self._sent.pop(seq.seq_id, None)
        self._requests.pop(request.request_id, None)
        aborted = any(o.finish_reason == "abort" for o in out.outputs)
        m = out.metrics
        record = RequestRecord(request.request_id, m.arrival_time, len(request.prompt_token_ids),
                               m.first_scheduled_time, m.first_token_time, m.finished_time,
                               sum(len(o.token_ids) for o in out.outputs), out.num_cached_tokens,
                               out.outputs[0].finish_reason if out.outputs else None)
        with self._cond:
            self._streams.pop(request.request_id, None)
            self._unscheduled.discard(request.request_id)
            self._finished.append(record)
            self.counters["requests_aborted" if aborted else "requests_finished"] += 1

    def _fail(self, request_id: str, error: BaseException) -> None:
        with self._cond:
            stream = self._streams.pop(request_id, None)
            self._unscheduled.discard(request_id)
        self._requests.pop(request_id, None)
        if stream is not None:
            try:
                stream._loop.call_soon_threadsafe(stream._queue.put_nowait, error)
            except RuntimeError:
                pass

    def _output(self, r: Request) -> RequestOutput:
        texts = [self.engine.text_of(s) for s in r.seqs]
        delta = []
        for s, text in zip(r.seqs, texts, strict=True):   # the text no earlier output of this stream had
            sent = self._sent.get(s.seq_id, 0)
            delta.append(text[sent:])
            self._sent[s.seq_id] = max(sent, len(text))
        return request_output(r, texts, delta)

    def _refresh_stats(self) -> None:
        """Snapshot the engine's numbers (engine thread, between iterations)."""
        engine = self.engine
        s = engine.stats()
        sched = engine.scheduler
        running = {seq.request.request_id for seq in sched.running}
        waiting = {seq.request.request_id for seq in sched.waiting} - running
        with self._cond:
            s.update(self.counters)
            s.update(num_requests_running=len(running), num_requests_waiting=len(waiting),
                     num_requests_pending=len(self._unscheduled), num_requests_unfinished=len(self._streams),
                     max_waiting=self.max_waiting, model=self.model_name, max_model_len=self.max_model_len,
                     engine_alive=self._error is None and not self._stopping, time_s=engine.now)
            self._stats = s
