"""Serving one generation request, from its body to its answer: what completions and chat share.

``Serving.serve`` takes a request through its life, in this order:

    parse the body -> check it (model, the server's caps) -> admit it (the gate, access.py)
    -> start it (tokenize every prompt, then queue them all) -> answer (one JSON body, or
    server-sent events) -> account (the gate's places back, the tokens under the client)

The subclasses say only what differs: how the body is parsed, what the prompt is called,
how a choice and a chunk look (``serving_completion.py``, ``serving_chat.py``).

Invariants: a request's prompts are queued all or none (each fits the context, or none is
queued); whatever ends a request (its last token, an error, a client that left), every
stream is aborted (a no-op once finished: an unfinished one frees its blocks now) and its
ticket is accounted exactly once. Errors leave through ``errors.api_error``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from ..errors import ContextLengthExceeded
from .access import Access
from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .errors import REFUSALS, api_error
from .fairness import Ticket
from .limits import STALLED_SCOPE_KEY, check_request
from .protocol import APIError, Parsed, TokenNames, bad_request, new_id, now, parse_json, sse, usage, \
    vllm_prompt_logprobs
from .streams import newest, watch_disconnect


@dataclass
class Job:
    """One HTTP request in flight: what every part of its answer reads."""

    request: Request                  # the HTTP request: its client, its connection
    rid: str                          # the id the client sees (X-Request-Id, or a fresh one)
    parsed: Parsed
    streams: list[RequestStream]      # one per prompt, in the request's order
    ticket: Ticket                    # its places at the admission gate
    created: int = field(default_factory=now)
    newest: dict[int, object] = field(default_factory=dict)   # stream index -> its newest output


class Serving:
    """The shared life of a generation request; a subclass per endpoint fills in the rest."""

    id_prefix = "cmpl"                    # a fresh request id is "<prefix>-<hex>"
    prompt_param = "prompt"               # the request's name for its prompt, in errors
    object = "text_completion"            # the answer's "object"
    chunk_object = "text_completion"      # a streamed chunk's "object"

    def __init__(self, engine: AsyncEngine, access: Access, model_name: str):
        self.engine, self.access, self.limits = engine, access, access.limits
        self.name = model_name
        self.aliases = {model_name, engine.model_name}     # the names a request may ask for
        self.names = TokenNames(engine.tokenizer)          # token texts and bytes, for logprobs

    # ---- what differs per endpoint -------------------------------------------------
    def parse(self, body: dict) -> Parsed:
        """The request's JSON body, checked field by field (``protocol.py``), or a 400."""
        raise NotImplementedError

    async def tokenize(self, prompt) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids, on the tokenizer's thread."""
        return await self.engine.tokenize(prompt)

    def too_long(self, limit: int, num_prompt: int, max_tokens: int | None = None) -> str:
        """OpenAI's words for a prompt (plus ``max_tokens``, if asked) over the context."""
        raise NotImplementedError

    def choice(self, parsed: Parsed, out, o) -> dict:
        """The body of a finished choice ``o`` of output ``out``, after its index."""
        raise NotImplementedError

    def finish_body(self, body: dict, parsed: Parsed, final: dict) -> None:
        """Add what this endpoint puts on the whole answer (nothing, by default)."""

    def stream(self, job: Job) -> AsyncIterator[str]:
        """The answer as server-sent events (``events`` with this endpoint's chunks)."""
        raise NotImplementedError

    # ---- a request's life ----------------------------------------------------------
    async def serve(self, request: Request, body: bytes):
        """Answer a request whose headers ``access.screen`` passed."""
        try:
            job = await self.begin(request, body)
        except REFUSALS as e:             # refused before any answer began: an error status
            raise api_error(e, self.prompt_param) from None
        if not job.parsed.stream:
            return await self.complete(job)
        # The cleanup runs after the response, and also when the client left before the
        # body began (the generator, never started, then has no finally to run).
        return StreamingResponse(self.stream(job), media_type="text/event-stream",
                                 background=BackgroundTask(self.close, job),
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": job.rid})

    async def begin(self, request: Request, body: bytes) -> Job:
        """Parse, check and admit the request, then queue its prompts: its ``Job``."""
        parsed = self.parse(parse_json(body))
        self.check(parsed)
        await self.compile_grammar(parsed)
        rid = request.headers.get("x-request-id") or new_id(self.id_prefix)
        ticket = await self.access.admit(request, len(parsed.prompts) * parsed.params.n)
        try:
            salt = self.access.salt(request.state.client, parsed.cache_salt)
            streams = await self.start(self.access.request_id(request, rid), parsed, salt)
        except BaseException:
            self.access.gate.release(ticket)
            raise
        return Job(request, rid, parsed, streams, ticket)

    def check(self, parsed: Parsed) -> None:
        """Refuse what the server will not serve: another model (404), an ask over the
        server's caps (``limits.py``), a ``logit_bias`` outside the vocabulary."""
        if parsed.model is not None and parsed.model not in self.aliases:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves {self.name!r}",
                           "invalid_request_error", "model", "model_not_found")
        check_request(parsed, self.limits)
        self.cap_max_tokens(parsed)
        bias, vocab = parsed.params.logit_bias or {}, self.engine.vocab_size
        if any(t >= vocab for t in bias):
            raise bad_request(f"'logit_bias' names token {max(bias)}, but the vocabulary has "
                              f"{vocab} tokens (ids 0..{vocab - 1})", param="logit_bias")

    def cap_max_tokens(self, parsed: Parsed) -> None:
        """Apply ``limits.max_tokens``: the most a chat request without max_tokens gets
        (``fit_context`` gives it what its prompt leaves of the context, up to this), and a
        400 for an explicit value over it (never a silent cut)."""
        cap, params = self.limits.max_tokens, parsed.params
        if cap is None:
            return
        if parsed.fill_context:
            if params.min_tokens > cap:
                raise bad_request(f"min_tokens={params.min_tokens} exceeds this server's limit of "
                                  f"{cap} tokens per request", param="min_tokens")
        elif params.max_tokens > cap:
            raise bad_request(f"max_tokens={params.max_tokens} exceeds this server's limit of {cap} "
                              "tokens per request (ask for fewer)", param="max_tokens",
                              code="max_tokens_limit")

    async def compile_grammar(self, parsed: Parsed) -> None:
        """Compile the request's grammar off the engine's thread (a schema may take seconds);
        a 400 naming the field it came from if it cannot be."""
        if parsed.params.structured_outputs is None:
            return
        field_name = parsed.extras.get("structured_field", "response_format")
        try:
            await self.engine.compile_grammar(parsed.params.structured_outputs)
        except ValueError as e:
            raise bad_request(f"'{field_name}': {e}", param=field_name, code=getattr(e, "code", None)) from None

    async def start(self, rid: str, parsed: Parsed, salt: str | None) -> list[RequestStream]:
        """Tokenize and queue every prompt, or none: a prompt over the context is refused
        before any is queued, and a refusal by the engine (the queue full) aborts those
        already queued."""
        streams: list[RequestStream] = []
        try:
            prompts = []               # every prompt fits in the context, or none is queued
            for prompt in parsed.prompts:
                text, ids = await self.tokenize(prompt)
                prompts.append((text, ids, self.fit_context(parsed, len(ids))))
            for i, (text, ids, params) in enumerate(prompts):
                request_id = rid if len(prompts) == 1 else f"{rid}-{i}"
                streams.append(await self.engine.add_request(text if text is not None else ids, params, request_id,
                                                             prompt_token_ids=ids, cache_salt=salt))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def fit_context(self, parsed: Parsed, num_prompt: int):
        """The request's SamplingParams for a prompt of ``num_prompt`` tokens: a chat
        request without max_tokens gets what the prompt leaves of the context (at most
        ``limits.max_tokens``). Over the context: ``ContextLengthExceeded``, in OpenAI's
        words, which say how many tokens were asked for and how many the model allows."""
        params, limit = parsed.params, self.engine.max_model_len
        if parsed.fill_context:
            room = limit - num_prompt
            if room < max(1, params.min_tokens):
                raise ContextLengthExceeded(self.too_long(limit, num_prompt))
            params = _copy(params)
            params.max_tokens = min(room, self.limits.max_tokens or room)
            return params
        if num_prompt + params.max_tokens > limit:
            raise ContextLengthExceeded(self.too_long(limit, num_prompt, params.max_tokens))
        return params if len(parsed.prompts) == 1 else _copy(params)   # each prompt its own copy

    # ---- the answer ----------------------------------------------------------------
    async def complete(self, job: Job) -> JSONResponse:
        """Wait for every stream to finish; answer with one JSON body."""
        final = job.newest
        try:
            async with watch_disconnect(job.request, job.streams):
                async for batch in newest(job.streams):
                    final.update(batch)
        except EngineDeadError as e:
            raise api_error(e) from None
        finally:
            await self.close(job)
        parsed, n = job.parsed, job.parsed.params.n
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for i in range(len(job.streams)):
            out = final[i]
            prompt_tokens += len(out.prompt_token_ids)
            cached_tokens += out.num_cached_tokens
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choice = {"index": i * n + o.index, **self.choice(parsed, out, o)}
                if parsed.return_token_ids:
                    choice["token_ids"] = list(o.token_ids)
                choices.append(choice)
        body = {"id": job.rid, "object": self.object, "created": job.created, "model": self.name, "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        self.finish_body(body, parsed, final)
        if parsed.return_token_ids:
            body["prompt_token_ids"] = [s.prompt_token_ids for s in job.streams]
        # Serialised by json.dumps directly: FastAPI's jsonable_encoder walks every value in
        # Python, which for 20 log-probabilities per token of a long answer holds the event
        # loop (and every stream it serves) for a noticeable while.
        return JSONResponse(body)

    async def events(self, job: Job, chunk: Callable, preamble: list[str],
                     first: Callable | None = None) -> AsyncIterator[str]:
        """Turn engine outputs into chunks: new text (held back while it could still
        become a stop string), new token ids with their logprobs when asked for, and each
        choice's finish reason. Outputs are cumulative, so when the client reads slower
        than the engine writes, the newest output alone makes the next chunk (``newest``).
        ``chunk(index, text, finish_reason, token_ids, steps)`` makes a chunk;
        ``first(index, out)``: a chunk to send before a choice's own, or None while it is
        not ready (completions' echo)."""
        parsed, n = job.parsed, job.parsed.params.n
        holdback = max((len(s) for s in parsed.params.stop), default=1) - 1
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        closed: set[int] = set()
        opened: set[int] = set()              # choices whose ``first`` chunk has gone
        prompt_tokens = completion_tokens = cached_tokens = 0
        try:
            for e in preamble:
                yield e
            async with watch_disconnect(job.request, job.streams):
                async for batch in newest(job.streams):
                    job.newest.update(batch)
                    if all(s.finished for s in job.streams):
                        self.account(job, job.newest)     # the engine is done with it
                    for i, out in batch:
                        for o in out.outputs:
                            index = i * n + o.index
                            if index in closed:
                                continue
                            if first is not None and index not in opened:
                                head = first(index, out)
                                if head is None:
                                    continue
                                opened.add(index)
                                yield head
                            done = o.finish_reason is not None
                            start = sent_text.get(index, 0)
                            upto = len(o.text) if done else max(start, len(o.text) - holdback)
                            text = o.text[start:upto]
                            tokens = o.token_ids[sent_tokens.get(index, 0):]
                            if text or tokens or done:
                                steps = None
                                if parsed.logprobs is not None and o.logprobs is not None:
                                    steps = o.logprobs[sent_tokens.get(index, 0):len(o.token_ids)]
                                sent_text[index] = upto
                                sent_tokens[index] = len(o.token_ids)
                                yield chunk(index, text, o.finish_reason, tokens, steps)
                            if done:
                                closed.add(index)
                                completion_tokens += len(o.token_ids)
                        if out.finished:
                            prompt_tokens += len(out.prompt_token_ids)
                            cached_tokens += out.num_cached_tokens
            if parsed.include_usage:
                yield sse({"id": job.rid, "object": self.chunk_object, "created": job.created, "model": self.name,
                           "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
            yield sse("[DONE]")
        except EngineDeadError as e:          # the status went out already: say it in the stream
            yield sse(api_error(e).body())
        finally:
            await self.close(job)
            if job.request.scope.get(STALLED_SCOPE_KEY):
                self.access.gate.usage(job.ticket.client).stalled += 1

    async def close(self, job: Job) -> None:
        """Abort every stream (a no-op for a finished one) and account the request."""
        for s in job.streams:
            s.abort()
        self.account(job, job.newest)

    def account(self, job: Job, outputs: dict) -> None:
        """Give the ticket's places back and count the request's tokens under its client
        (``outputs``: each stream's newest output), its cache hits included: a key's own
        hits, since its prompts only meet its own cached blocks. Once per ticket."""
        ticket, gate = job.ticket, self.access.gate
        if ticket.done:
            return
        gate.release(ticket)
        u = gate.usage(ticket.client)
        u.prompt_tokens += sum(len(s.prompt_token_ids) for s in job.streams)
        u.cached_tokens += sum(out.num_cached_tokens for out in outputs.values())
        u.generation_tokens += sum(len(o.token_ids) for out in outputs.values() for o in out.outputs)

    # ---- helpers the endpoints share ------------------------------------------------
    def prompt_logprobs(self, out, top: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of an output, ``top`` alternatives per position."""
        if out.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(self.names, out.prompt_token_ids[:len(out.prompt_logprobs)],
                                    out.prompt_logprobs, top)

    def prompt_text(self, out) -> str:
        return out.prompt if out.prompt is not None else self.engine.tokenizer.decode(out.prompt_token_ids)


def _copy(params):
    """A copy of ``params`` that shares no list or dict with it (the engine may change it)."""
    return replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                   logit_bias=dict(params.logit_bias) if params.logit_bias else None)
