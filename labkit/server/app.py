"""An OpenAI-compatible HTTP server over the async engine (FastAPI).

    POST /v1/completions          prompt (text, token ids, or a batch) -> text
    POST /v1/chat/completions     messages -> the model's chat template -> reply
    GET  /v1/models               the served model
    GET  /health                  200 while the engine loop runs, 503 otherwise
    GET  /metrics                 Prometheus text: batch, KV blocks, tokens, requests

``"stream": true`` answers with server-sent events in OpenAI's chunk format, one chunk per
engine iteration that produced text, then ``data: [DONE]``. A client that goes away has
its request aborted and its KV blocks freed at once: the stream notices the disconnect
(Starlette cancels it, and a watcher polls ``request.is_disconnected()``) and aborts.

Errors have OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: 400 for
malformed requests and values the engine refuses (the prompt too long, say), 404 for an
unknown model, 429 when ``max_waiting`` requests wait already, 503 when the engine is down.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from .metrics import render_metrics
from .protocol import (APIError, Parsed, bad_request, error_body, new_id, now, parse_chat,
                       parse_completion, parse_json, sse, usage)

DISCONNECT_POLL_S = 0.25


def create_app(engine: AsyncEngine, served_model_name: str | None = None, *,
               owns_engine: bool = False, on_startup=None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name`` (default:
    the model's name). ``owns_engine``: shut the engine down when the app stops."""
    name = served_model_name or engine.model_name
    aliases = {name, engine.model_name}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_startup is not None:
            on_startup()
        yield
        if owns_engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)

    app = FastAPI(title="labkit", version="0.1.0", lifespan=lifespan,
                  description="A small real LLM server: PagedAttention, continuous batching.")
    app.state.engine = engine
    app.state.model_name = name
    http_errors: collections.Counter = collections.Counter()     # status code -> responses
    app.state.http_errors = http_errors

    # ---- errors in OpenAI's shape ---------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        http_errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        http_errors[exc.status_code] += 1
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        http_errors[400] += 1
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        http_errors[500] += 1
        return JSONResponse(error_body(f"internal error: {exc!r}", "internal_error"), status_code=500)

    # ---- plain endpoints --------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", "service_unavailable"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": now(), "owned_by": "labkit",
            "root": engine.model_name, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(engine.stats(), dict(http_errors)),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # ---- generation ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        parsed = parse_completion(parse_json(await request.body()))
        return await _serve(request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        parsed = parse_chat(parse_json(await request.body()))
        if getattr(engine.tokenizer, "chat_template", None) is None:
            raise bad_request(f"model {name!r} has no chat template: use /v1/completions", param="messages")
        try:
            prompt = engine.tokenizer.apply_chat_template(parsed.prompts[0], tokenize=False,
                                                          add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's own complaint (roles, order)
            raise bad_request(f"the chat template rejected the messages: {e}", param="messages") from None
        parsed.prompts = [prompt]
        return await _serve(request, parsed, chat=True)

    async def _serve(request: Request, parsed: Parsed, chat: bool):
        if parsed.model is not None and parsed.model not in aliases:
            raise APIError(404, f"the model {parsed.model!r} does not exist; this server serves {name!r}",
                           "invalid_request_error", "model", "model_not_found")
        rid = request.headers.get("x-request-id") or new_id("chatcmpl" if chat else "cmpl")
        streams = await _start(rid, parsed, chat)
        if parsed.stream:
            gen = _stream_chat(request, rid, parsed, streams) if chat else \
                _stream_completion(request, rid, parsed, streams)
            return StreamingResponse(gen, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
        return await _complete(request, rid, parsed, streams, chat)

    async def _start(rid: str, parsed: Parsed, chat: bool) -> list[RequestStream]:
        """Queue every prompt, or none: a refusal aborts those already queued."""
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(parsed.prompts):
                params = parsed.params if len(parsed.prompts) == 1 else _copy(parsed.params)
                request_id = rid if len(parsed.prompts) == 1 else f"{rid}-{i}"
                streams.append(await engine.add_request(prompt, params, request_id,
                                                        fill_context=parsed.fill_context))
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

    async def _complete(request: Request, rid: str, parsed: Parsed, streams: list[RequestStream], chat: bool):
        final: dict[int, object] = {}
        try:
            async with _watch_disconnect(request, streams):
                async for i, out in _merge(streams):
                    if out.finished:
                        final[i] = out
        except EngineDeadError as e:
            raise APIError(503, str(e), "service_unavailable") from None
        finally:
            for s in streams:
                s.abort()
        choices, prompt_tokens, completion_tokens = [], 0, 0
        n = parsed.params.n
        for i in range(len(streams)):
            out = final[i]
            prompt_tokens += len(out.prompt_token_ids)
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choice = {"index": i * n + o.index}
                if chat:
                    choice["message"] = {"role": "assistant", "content": o.text}
                else:
                    choice["text"] = o.text
                choice.update(logprobs=None, finish_reason=o.finish_reason)
                if parsed.return_token_ids:
                    choice["token_ids"] = list(o.token_ids)
                choices.append(choice)
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": now(),
                "model": name, "choices": choices, "usage": usage(prompt_tokens, completion_tokens)}
        if parsed.return_token_ids:
            body["prompt_token_ids"] = [s.prompt_token_ids for s in streams]
        return body

    async def _stream_completion(request, rid, parsed, streams) -> AsyncIterator[str]:
        created = now()

        def chunk(index, text, finish_reason, token_ids):
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
            if parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": rid, "object": "text_completion", "created": created, "model": name,
                        "choices": [choice]})

        async for event in _events(request, parsed, streams, chunk, [], rid, created, "text_completion"):
            yield event

    async def _stream_chat(request, rid, parsed, streams) -> AsyncIterator[str]:
        created = now()

        def event(index, delta, finish_reason, token_ids=None):
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if token_ids is not None and parsed.return_token_ids:
                choice["token_ids"] = token_ids
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                        "choices": [choice]})

        def chunk(index, text, finish_reason, token_ids):
            return event(index, {"content": text} if text or not finish_reason else {}, finish_reason, token_ids)

        # OpenAI's first chunk of each choice names the role, with empty content.
        preamble = [event(i, {"role": "assistant", "content": ""}, None, [])
                    for i in range(len(streams) * parsed.params.n)]
        async for e in _events(request, parsed, streams, chunk, preamble, rid, created, "chat.completion.chunk"):
            yield e

    async def _events(request, parsed, streams, chunk, preamble, rid, created, obj) -> AsyncIterator[str]:
        """Turn engine outputs into chunks: new text (held back while it could still
        become a stop string), new token ids, and each choice's finish reason."""
        n = parsed.params.n
        holdback = max((len(s) for s in parsed.params.stop), default=1) - 1
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        closed: set[int] = set()
        prompt_tokens = completion_tokens = 0
        try:
            for e in preamble:
                yield e
            async with _watch_disconnect(request, streams):
                async for i, out in _merge(streams):
                    for o in out.outputs:
                        index = i * n + o.index
                        if index in closed:
                            continue
                        done = o.finish_reason is not None
                        start = sent_text.get(index, 0)
                        upto = len(o.text) if done else max(start, len(o.text) - holdback)
                        text = o.text[start:upto]
                        tokens = o.token_ids[sent_tokens.get(index, 0):]
                        if text or tokens or done:
                            sent_text[index] = upto
                            sent_tokens[index] = len(o.token_ids)
                            yield chunk(index, text, o.finish_reason, tokens)
                        if done:
                            closed.add(index)
                            completion_tokens += len(o.token_ids)
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
            if parsed.include_usage:
                yield sse({"id": rid, "object": obj, "created": created, "model": name, "choices": [],
                           "usage": usage(prompt_tokens, completion_tokens)})
            yield sse("[DONE]")
        except EngineDeadError as e:
            yield sse(error_body(str(e), "service_unavailable"))
        finally:
            for s in streams:
                s.abort()

    return app


def _copy(params):
    from dataclasses import replace
    return replace(params, stop=list(params.stop), stop_token_ids=list(params.stop_token_ids))


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, object]]:
    """Outputs of several streams as ``(stream index, output)``, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - hand it to the consumer
            await queue.put((i, e))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
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
