"""An OpenAI-compatible HTTP server over the async engine (FastAPI).

    POST /v1/completions          prompt (text, token ids, or a batch) -> text
    POST /v1/chat/completions     messages -> the model's chat template -> reply
    GET  /v1/models               the served model
    GET  /health                  200 while the engine loop runs, 503 otherwise
    GET  /metrics                 Prometheus text: batch, KV blocks, tokens, requests

``"stream": true`` answers with server-sent events in OpenAI's chunk format, one chunk per
engine iteration that produced text, then ``data: [DONE]``. Log-probabilities (chat
``logprobs``/``top_logprobs``, completions ``logprobs``) ride on the chunk that carries
their tokens; completions' ``echo`` sends the prompt (and, with ``logprobs``, its tokens'
logprobs, the first null) as each choice's first chunk. A client that goes away has
its request aborted and its KV blocks freed at once: the stream notices the disconnect
(Starlette cancels it, and a watcher polls ``request.is_disconnected()``) and aborts.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed requests, values the engine refuses, asks over the server's per-request caps
(``limits.check_request``) and a prompt plus ``max_tokens`` beyond the model's context
(OpenAI's wording, ``context_length_exceeded``), 401 without a valid key (when the server
has keys), 404 for an unknown model, 408 for a body that does not arrive in time, 413 for a
body over the size limit, 429 when the client is over its share (``Retry-After``) or
``max_waiting`` requests wait already, 503 when the engine is down. A 401, 413 or 429
decided from the headers closes the connection: the body, however large, is never read.
``usage.prompt_tokens_details.cached_tokens`` counts the prompt tokens the prefix cache
served.

A server a class shares (``auth.py``, ``fairness.py``, ``limits.py``): with keys, every
``/v1`` route needs ``Authorization: Bearer <key>``, and so does ``/metrics`` unless
``limits.metrics_public``; ``/health`` is always open, and ``/docs``, ``/redoc`` and
``/openapi.json`` are off. Each request is counted under its key's name (without keys: the
client address), passes the admission gate (a cap per key, then round-robin release into
the engine), and runs in its key's own prefix-cache namespace (a cache salt: no key can hit,
or time, another key's cached prompt) unless ``limits.share_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from .auth import KeyRing
from .fairness import AdmissionGate, OverCapError, Ticket
from .heap import freeze_startup_heap
from .limits import STALLED_SCOPE_KEY, ConnectionStats, Limits, check_length, check_request, read_body
from .metrics import render_client_metrics, render_metrics
from .protocol import (APIError, Parsed, TokenNames, bad_request, chat_logprobs, completion_logprobs,
                       error_body, new_id, now, parse_chat, parse_completion, parse_json, sse, usage,
                       vllm_prompt_logprobs)

DISCONNECT_POLL_S = 0.25


def create_app(engine: AsyncEngine, served_model_name: str | None = None, *,
               owns_engine: bool = False, on_startup=None, keys: KeyRing | None = None,
               limits: Limits | None = None, connections: ConnectionStats | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name`` (default:
    the model's name). ``owns_engine``: shut the engine down when the app stops.

    ``keys``: the API keys it accepts (None or empty: anyone). ``limits``: per-request
    and per-key limits (default ``Limits()``: no per-key gate). ``connections``: the
    counters of the connection guards (``limits.guarded_protocol``), shown in /metrics."""
    name = served_model_name or engine.model_name
    aliases = {name, engine.model_name}
    keys = keys or KeyRing()
    limits = limits or Limits()
    cap = limits.max_concurrent_per_key
    # With a cap, release into the engine round-robin, at most a batch (max_num_seqs) at
    # a time; without one the gate only counts, and the engine's FCFS decides alone.
    gate = AdmissionGate(cap, engine.engine.scheduler.max_num_seqs if cap is not None else None)
    auth_failures = {"missing": 0, "invalid": 0}
    names = TokenNames(engine.tokenizer)             # token texts and bytes for logprobs

    @contextlib.asynccontextmanager
    async def lifespan(app):
        freeze_startup_heap()
        if on_startup is not None:
            on_startup()
        yield
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    # With keys, the API's self-description would be the one page open to anyone: off.
    docs = not keys
    app = FastAPI(title="labkit", version="0.1.0", lifespan=lifespan,
                  description="A small real LLM server: PagedAttention, continuous batching.",
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.engine = engine
    app.state.model_name = name
    http_errors: collections.Counter = collections.Counter()     # status code -> responses
    app.state.http_errors = http_errors
    app.state.gate = gate
    app.state.keys = keys
    app.state.limits = limits

    def count_error(request: Request, status: int) -> None:
        http_errors[status] += 1
        client = getattr(request.state, "client", None)
        if client is not None:
            errors = gate.usage(client).errors
            errors[status] = errors.get(status, 0) + 1

    # ---- errors in OpenAI's shape ---------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        count_error(request, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        count_error(request, exc.status_code)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        count_error(request, 400)
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        count_error(request, 500)
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_error"), status_code=500)

    # ---- who is asking ----------------------------------------------------------------
    def authorize(request: Request) -> str:
        """The client's name: its key's name, or its address when the server has no keys.
        Raises a 401 (OpenAI's body and wording) without a valid key."""
        if not keys:
            client = request.client.host if request.client else "unknown"
        else:
            header = request.headers.get("authorization")
            client = keys.name_of(header)
            if client is None:
                auth_failures["missing" if not header else "invalid"] += 1
                message = ("You didn't provide an API key. Send it in the Authorization header: "
                           "'Authorization: Bearer YOUR_KEY' (OpenAI clients: api_key=YOUR_KEY)."
                           if not header else "Incorrect API key provided.")
                raise APIError(401, message, "invalid_request_error", None, "invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        request.state.client = client
        return client

    # ---- plain endpoints --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", "service_unavailable"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": now(), "owned_by": "labkit",
            "root": engine.model_name, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        if not limits.metrics_public:
            authorize(request)
        text = render_metrics(engine.stats(), dict(http_errors)) + render_client_metrics(
            gate, auth_failures, connections or ConnectionStats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        _screen(request)
        parsed = parse_completion(parse_json(await read_body(request, limits)))
        return await _serve(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        _screen(request)
        parsed = parse_chat(parse_json(await read_body(request, limits)))
        if getattr(engine.tokenizer, "chat_template", None) is None:
            raise bad_request(f"model {name!r} has no chat template: use /v1/completions", param="messages")
        return await _serve(request, parsed, chat=True)

    async def _serve(request: Request, parsed: Parsed, chat: bool):
        if parsed.model is not None and parsed.model not in aliases:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves {name!r}",
                           "invalid_request_error", "model", "model_not_found")
        check_request(parsed, limits)
        _cap_max_tokens(parsed)
        bias = parsed.params.logit_bias or {}
        if any(t >= engine.vocab_size for t in bias):
            raise bad_request(f"'logit_bias' names token {max(bias)}, but the vocabulary has "
                              f"{engine.vocab_size} tokens (ids 0..{engine.vocab_size - 1})", param="logit_bias")
        if parsed.params.structured_outputs is not None:
            field = parsed.extras.get("structured_field", "response_format")
            try:                                # off the engine's thread: a schema may take seconds
                await engine.compile_grammar(parsed.params.structured_outputs)
            except ValueError as e:
                raise bad_request(f"'{field}': {e}", param=field) from None
        rid = request.headers.get("x-request-id") or new_id("chatcmpl" if chat else "cmpl")
        # With keys, a client's own request id lives in its key's namespace: no student can
        # occupy, or probe, the ids another student's client sends.
        engine_rid = f"{request.state.client}:{rid}" if keys and "x-request-id" in request.headers else rid
        ticket = await _admit(request, len(parsed.prompts) * parsed.params.n)
        try:
            streams = await _start(engine_rid, parsed, _salt(request.state.client, parsed.cache_salt))
        except BaseException:
            gate.release(ticket)
            raise
        if parsed.stream:
            newest: dict[int, object] = {}         # each stream's newest output, for _account

            async def cleanup():
                # After the response, and also when the client left before the body began
                # (the generator, never started, then has no finally to run).
                for s in streams:
                    s.abort()
                _account(ticket, streams, newest)

            gen = _stream_chat(request, rid, parsed, streams, ticket, newest) if chat else \
                _stream_completion(request, rid, parsed, streams, ticket, newest)
            return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(cleanup),
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await _complete(request, rid, parsed, streams, chat, ticket)

    def _cap_max_tokens(parsed: Parsed) -> None:
        """Apply ``limits.max_tokens``: the most a chat request without max_tokens gets
        (``_fit_context`` gives it what its prompt leaves of the context, up to this), and a
        400 for an explicit value over it (never a silent cut)."""
        cap = limits.max_tokens
        if cap is None:
            return
        params = parsed.params
        if parsed.fill_context:
            if params.min_tokens > cap:
                raise bad_request(f"min_tokens={params.min_tokens} exceeds this server's limit of "
                                  f"{cap} tokens per request", param="min_tokens")
        elif params.max_tokens > cap:
            raise bad_request(f"max_tokens={params.max_tokens} exceeds this server's limit of {cap} "
                              "tokens per request (ask for fewer)", param="max_tokens",
                              code="max_tokens_limit")

    def _screen(request: Request) -> None:
        """What the headers alone can refuse, before the body is read (refusing stays
        cheap): no valid key (401), a declared body over the limit (413), a key at its
        cap already (429). The refusal closes the connection: otherwise the server would
        go on reading (and discarding) the body to reach the connection's next request,
        at whatever size the client declared."""
        try:
            client = authorize(request)
            check_length(request, limits)
            try:
                gate.check_room(client)
            except OverCapError as e:
                raise _too_many(e) from None
        except APIError as e:
            e.headers = {**e.headers, "Connection": "close"}
            raise

    def _salt(client: str, asked: str | None) -> str | None:
        """The request's prefix-cache namespace. With keys (unless the operator shares the
        cache), its key's name: a prompt is then found in the cache only by requests of the
        same key, so no student can test, by the cached-token count or the time to first
        token, whether another sent it. A request's own ``cache_salt`` narrows it further;
        the engine gets its digest, a fixed 64 characters however long the salt sent."""
        digest = None if asked is None else hashlib.sha256(asked.encode("utf-8")).hexdigest()
        if not keys or limits.share_prefix_cache:
            return digest
        return f"key:{client}" + ("" if digest is None else f"/{digest}")

    async def _tokenize(prompt, chat: bool) -> tuple[str | None, list[int]]:
        """The prompt's text and token ids: chat messages through the model's template,
        text through the tokenizer, both on the tokenizer's thread (neither the engine's
        nor the event loop's: a large body takes them a while)."""
        try:
            if chat:
                prompt = await engine.render_chat(prompt)
            return await engine.tokenize(prompt)
        except ValueError as e:
            raise bad_request(str(e), param="messages" if chat else "prompt") from None

    def _fit_context(parsed: Parsed, num_prompt: int):
        """The request's SamplingParams for a prompt of ``num_prompt`` tokens: a chat
        request without max_tokens gets what the prompt leaves of the context (at most
        ``limits.max_tokens``). Over the context: 400 in OpenAI's words, which say how many
        tokens were asked for and how many the model allows."""
        params, limit = parsed.params, engine.max_model_len
        if parsed.fill_context:
            room = limit - num_prompt
            if room < max(1, params.min_tokens):
                if parsed.chat:
                    raise _context_error(f"This model's maximum context length is {limit} tokens. However, "
                                         f"your messages resulted in {num_prompt} tokens. Please reduce the "
                                         "length of the messages.", parsed)
                raise _context_error(f"This model's maximum context length is {limit} tokens, however your prompt "
                                     f"has {num_prompt} tokens. Please reduce your prompt.", parsed)
            params = _copy(params)
            params.max_tokens = min(room, limits.max_tokens or room)
            return params
        total = num_prompt + params.max_tokens
        if total > limit:
            if parsed.chat:
                raise _context_error(f"This model's maximum context length is {limit} tokens. However, you "
                                     f"requested {total} tokens ({num_prompt} in the messages, {params.max_tokens} "
                                     "in the completion). Please reduce the length of the messages or "
                                     "completion.", parsed)
            raise _context_error(f"This model's maximum context length is {limit} tokens, however you requested "
                                 f"{total} tokens ({num_prompt} in your prompt; {params.max_tokens} for the "
                                 "completion). Please reduce your prompt; or completion length.", parsed)
        return params if len(parsed.prompts) == 1 else _copy(params)

    def _context_error(message: str, parsed: Parsed) -> APIError:
        return bad_request(message, param="messages" if parsed.chat else "prompt", code="context_length_exceeded")

    def _too_many(e: OverCapError) -> APIError:
        return APIError(429, str(e), "rate_limit_error", None, "too_many_concurrent_requests",
                        headers={"Retry-After": str(e.retry_after_s)})

    async def _admit(request: Request, cost: int) -> Ticket:
        """Places in the engine for this request: 429 at once over the client's cap, else
        (maybe after waiting for the client's turn) a ticket to give back at the end."""
        client = request.state.client
        wait = asyncio.ensure_future(gate.acquire(client, cost))
        try:
            while True:                  # poll the client while it waits for its turn
                done, _ = await asyncio.wait({wait}, timeout=DISCONNECT_POLL_S)
                if done:
                    return wait.result()
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection while waiting for its turn",
                                   code="client_closed_request")
        except OverCapError as e:
            raise _too_many(e) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        finally:
            if not wait.done():
                wait.cancel()            # withdraws the queued request (or gives a fresh ticket back)

    def _account(ticket: Ticket, streams: list[RequestStream], newest: dict) -> None:
        """Give the ticket's places back and count the request's tokens under its client
        (``newest``: each stream's newest output), its cache hits included: a key's own
        hits, since its prompts only meet its own cached blocks. Once per ticket."""
        if ticket.done:
            return
        gate.release(ticket)
        u = gate.usage(ticket.client)
        u.prompt_tokens += sum(len(s.prompt_token_ids) for s in streams)
        u.cached_tokens += sum(out.num_cached_tokens for out in newest.values())
        u.generation_tokens += sum(len(o.token_ids) for out in newest.values() for o in out.outputs)

    async def _start(rid: str, parsed: Parsed, salt: str | None) -> list[RequestStream]:
        """Tokenize and queue every prompt, or none: a prompt over the context is refused
        before any is queued, and a refusal by the engine (the queue full) aborts those
        already queued."""
        chat = parsed.chat
        streams: list[RequestStream] = []
        try:
            prompts = []               # every prompt fits in the context, or none is queued
            for prompt in parsed.prompts:
                text, ids = await _tokenize(prompt, chat)
                prompts.append((text, ids, _fit_context(parsed, len(ids))))
            for i, (text, ids, params) in enumerate(prompts):
                request_id = rid if len(parsed.prompts) == 1 else f"{rid}-{i}"
                streams.append(await engine.add_request(text if text is not None else ids, params, request_id,
                                                        prompt_token_ids=ids, cache_salt=salt))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), "rate_limit_error", None, "queue_full",
                               headers={"Retry-After": "1"}) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "service_unavailable") from None
            if isinstance(e, ValueError):
                text = str(e)
                code = "context_length_exceeded" if "too long" in text or "KV cache holds" in text else None
                param = None if "already in use" in text else "messages" if chat else "prompt"
                raise bad_request(text, param, code) from None
            raise
        return streams

    async def _complete(request: Request, rid: str, parsed: Parsed, streams: list[RequestStream], chat: bool,
                        ticket: Ticket):
        final: dict[int, object] = {}
        try:
            async with _watch_disconnect(request, streams):
                async for batch in _newest(streams):
                    final.update(batch)
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        finally:
            for s in streams:
                s.abort()
            _account(ticket, streams, final)
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        n = parsed.params.n
        for i in range(len(streams)):
            out = final[i]
            prompt_tokens += len(out.prompt_token_ids)
            cached_tokens += out.num_cached_tokens
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choice = {"index": i * n + o.index}
                logprobs = None
                if chat:
                    choice["message"] = {"role": "assistant", "content": o.text}
                    if parsed.logprobs is not None:
                        logprobs = chat_logprobs(names, o.token_ids, o.logprobs or [], parsed.logprobs)
                else:
                    choice["text"] = (_prompt_text(out) if parsed.echo else "") + o.text
                    if parsed.logprobs is not None:
                        prompt_ids, prompt_steps = (out.prompt_token_ids, out.prompt_logprobs) if parsed.echo \
                            else ([], [])
                        logprobs = completion_logprobs(names, prompt_ids + o.token_ids,
                                                       list(prompt_steps or []) + list(o.logprobs or []),
                                                       top=parsed.logprobs)
                choice.update(logprobs=logprobs, finish_reason=o.finish_reason)
                if parsed.prompt_logprobs is not None and not chat:
                    choice["prompt_logprobs"] = _prompt_logprobs(out, parsed.prompt_logprobs)
                if parsed.return_token_ids:
                    choice["token_ids"] = list(o.token_ids)
                choices.append(choice)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": name, "choices": choices, "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        if parsed.prompt_logprobs is not None and chat:      # vLLM: chat's are the response's
            body["prompt_logprobs"] = _prompt_logprobs(final[0], parsed.prompt_logprobs)
        if parsed.return_token_ids:
            body["prompt_token_ids"] = [s.prompt_token_ids for s in streams]
        # Serialised by json.dumps directly: FastAPI's jsonable_encoder walks every value in
        # Python, which for 20 log-probabilities per token of a long answer holds the event
        # loop (and every stream it serves) for a noticeable while.
        return JSONResponse(body)

    def _prompt_logprobs(out, top: int) -> list | None:
        if out.prompt_logprobs is None:
            return None
        return vllm_prompt_logprobs(names, out.prompt_token_ids[:len(out.prompt_logprobs)],
                                    out.prompt_logprobs, top)

    def _prompt_text(out) -> str:
        return out.prompt if out.prompt is not None else engine.tokenizer.decode(out.prompt_token_ids)

    async def _stream_completion(request, rid, parsed, streams, ticket, newest) -> AsyncIterator[str]:
        created = now()
        offsets: dict[int, int] = {}          # choice -> text_offset of its next token

        def logprobs_of(index, token_ids, steps):
            lp = completion_logprobs(names, token_ids, steps, offsets.get(index, 0), parsed.logprobs)
            offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1]) if token_ids else offsets.get(index, 0)
            return lp

        def chunk(index, text, finish_reason, token_ids, steps=None, scored=None):
            """``steps``: the logprobs of ``scored`` (default: ``token_ids``), or None."""
            lp = logprobs_of(index, token_ids if scored is None else scored, steps) if steps is not None else None
            choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}
            if parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                        "choices": [choice]})

        def echo(index, out):
            """The prompt, as the choice's first chunk (once its logprobs are all there)."""
            if parsed.logprobs is None:
                return chunk(index, _prompt_text(out), None, [])
            steps = out.prompt_logprobs or []
            if len(steps) < len(out.prompt_token_ids) and not out.finished:
                return None
            return chunk(index, _prompt_text(out), None, [], list(steps), out.prompt_token_ids[:len(steps)])

        async for event in _events(request, parsed, streams, ticket, newest, chunk, [], rid, created,
                                   "text_completion", echo if parsed.echo else None):
            yield event

    async def _stream_chat(request, rid, parsed, streams, ticket, newest) -> AsyncIterator[str]:
        created = now()

        def event(index, delta, finish_reason, token_ids=None, logprobs=None):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            if token_ids is not None and parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": [choice]})

        def chunk(index, text, finish_reason, token_ids, steps=None):
            lp = chat_logprobs(names, token_ids, steps, parsed.logprobs) if steps is not None else None
            return event(index, {"content": text} if text or not finish_reason else {}, finish_reason, token_ids,
                         lp)

        # OpenAI's first chunk of each choice names the role, with empty content.
        preamble = [event(i, {"role": "assistant", "content": ""}, None, [])
                    for i in range(len(streams) * parsed.params.n)]
        async for e in _events(request, parsed, streams, ticket, newest, chunk, preamble, rid, created,
                               "chat.completion.chunk"):
            yield e

    async def _events(request, parsed, streams, ticket, newest, chunk, preamble, rid, created,
                      obj, first=None) -> AsyncIterator[str]:
        """Turn engine outputs into chunks: new text (held back while it could still
        become a stop string), new token ids with their logprobs when asked for, and each
        choice's finish reason. Outputs are cumulative, so when the client reads slower
        than the engine writes, the newest output alone makes the next chunk
        (``_newest``). ``first(index, out)``: a chunk to send before a choice's own, or
        None while it is not ready (completions' echo)."""
        n = parsed.params.n
        holdback = max((len(s) for s in parsed.params.stop), default=1) - 1
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        closed: set[int] = set()
        opened: set[int] = set()              # choices whose ``first`` chunk has gone
        prompt_tokens = completion_tokens = cached_tokens = 0
        try:
            for e in preamble:
                yield e
            async with _watch_disconnect(request, streams):
                async for batch in _newest(streams):
                    newest.update(batch)
                    if all(s.finished for s in streams):
                        _account(ticket, streams, newest)     # the engine is done with it
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
                yield sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
            yield sse("[DONE]")
        except EngineDeadError as e:
            yield sse(error_body(str(e), "service_unavailable"))
        finally:
            for s in streams:
                s.abort()
            _account(ticket, streams, newest)
            if request.scope.get(STALLED_SCOPE_KEY):
                gate.usage(ticket.client).stalled += 1

    return app


def _copy(params):
    from dataclasses import replace
    return replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids),
                   logit_bias=dict(params.logit_bias) if params.logit_bias else None)


async def _newest(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, object]]]:
    """The streams' outputs as batches of ``(stream index, newest output)``.

    A task per stream drains it into one slot that keeps only the newest output, so what
    waits for a slow reader is one output per stream, however many iterations the engine
    runs meanwhile (outputs are cumulative: the newest holds everything). Ends when every
    stream has finished; re-raises a stream's error."""
    newest: dict[int, object] = {}
    errors: list[BaseException] = []
    ready = asyncio.Event()

    async def drain(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                newest[i] = out
                ready.set()
        except Exception as e:  # noqa: BLE001 - hand it to the reader
            errors.append(e)

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    for t in tasks:
        t.add_done_callback(lambda _: ready.set())
    try:
        while True:
            await ready.wait()
            ready.clear()
            if newest:
                batch = sorted(newest.items(), key=lambda item: item[0])
                newest.clear()
                yield batch
            if errors:
                raise errors[0]
            if all(t.done() for t in tasks) and not newest:
                return
    finally:
        for t in tasks:
            t.cancel()


@contextlib.asynccontextmanager
async def _watch_disconnect(request: Request, streams: list[RequestStream]):
    """Abort ``streams`` as soon as the client has gone (polled), whatever they wait for."""
    async def watch():
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                for s in streams:
                    s.abort()
                return

    task = asyncio.ensure_future(watch())
    try:
        yield
    finally:
        task.cancel()
