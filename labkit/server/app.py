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
import contextlib

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .access import Access
from .async_engine import AsyncEngine
from .auth import KeyRing
from .errors import install_error_handlers
from .heap import freeze_startup_heap
from .limits import ConnectionStats, Limits, read_body
from .metrics import render_client_metrics, render_metrics
from .protocol import error_body, now
from .serving_chat import ChatServing
from .serving_completion import CompletionServing


def create_app(engine: AsyncEngine, served_model_name: str | None = None, *,
               owns_engine: bool = False, on_startup=None, keys: KeyRing | None = None,
               limits: Limits | None = None, connections: ConnectionStats | None = None) -> FastAPI:
    """The FastAPI application serving ``engine`` under ``served_model_name`` (default:
    the model's name). ``owns_engine``: shut the engine down when the app stops.

    ``keys``: the API keys it accepts (None or empty: anyone). ``limits``: per-request
    and per-key limits (default ``Limits()``: no per-key gate). ``connections``: the
    counters of the connection guards (``limits.guarded_protocol``), shown in /metrics."""
    name = served_model_name or engine.model_name
    keys, limits = keys or KeyRing(), limits or Limits()
    access = Access(keys, limits, engine.engine.scheduler.max_num_seqs)
    completion, chat = CompletionServing(engine, access, name), ChatServing(engine, access, name)

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
    app.state.engine, app.state.model_name = engine, name
    app.state.http_errors, app.state.gate = access.http_errors, access.gate      # status -> responses
    app.state.keys, app.state.limits = keys, limits
    install_error_handlers(app, access.count_error)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return JSONResponse(error_body("the engine is not running", "service_unavailable"),
                                status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        access.authorize(request)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": now(), "owned_by": "labkit",
            "root": engine.model_name, "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size}]}

    @app.get("/metrics")
    async def metrics(request: Request):
        if not limits.metrics_public:
            access.authorize(request)
        text = render_metrics(engine.stats(), dict(access.http_errors)) + render_client_metrics(
            access.gate, access.auth_failures, connections or ConnectionStats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    # The headers are screened before the body is read: a refusal then costs no read.
    @app.post("/v1/completions")
    async def completions(request: Request):
        access.screen(request)
        return await completion.serve(request, await read_body(request, limits))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        access.screen(request)
        return await chat.serve(request, await read_body(request, limits))

    return app
