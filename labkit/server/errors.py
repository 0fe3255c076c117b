"""From an exception to its HTTP answer: the one table the server's error responses come from.

Every error answer has OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``
(``protocol.APIError``). The server's own checks raise an ``APIError`` with its status
straight away; everything else a route can raise is translated here, by its class:

    APIError                      as it is (its own status, type, param, code)
    RequestError (ValueError)     400: the engine can never serve it; param and code read
                                  from the exception (``labkit/errors.py``)
    OverCapError                  429 ``too_many_concurrent_requests``, Retry-After: the key's share
    QueueFullError                429 ``queue_full``, Retry-After: 1; ``max_waiting`` wait already
    EngineDeadError               503: the engine loop has stopped
    HTTPException (Starlette)     its own status: an unknown path (404), a wrong method (405)
    RequestValidationError        400 (FastAPI's own parsing; labkit parses by hand)
    anything else                 500: a bug of the server's

The engine names the prompt ``"prompt"``; a chat request's prompt is its ``"messages"``,
so ``api_error`` takes the name the route uses. No message is ever read to classify an
error: the class, ``param`` and ``code`` say it all.
"""

from __future__ import annotations

import logging
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import EngineDeadError, QueueFullError
from .fairness import OverCapError
from .protocol import APIError

log = logging.getLogger(__name__)

#: What a serving route turns into an ``APIError`` (``api_error``): refusals, not bugs.
#: A ``ValueError`` is the engine's word for "this request can never run" (a
#: ``RequestError`` names its field; an untyped one names none).
REFUSALS = (ValueError, OverCapError, QueueFullError, EngineDeadError)


def api_error(exc: Exception, prompt_param: str = "prompt") -> APIError:
    """The HTTP answer to ``exc`` (see the table above). ``prompt_param``: what the route
    calls the prompt (``"messages"`` for chat)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        param = getattr(exc, "param", None)
        return APIError(400, str(exc), "invalid_request_error", prompt_param if param == "prompt" else param,
                        getattr(exc, "code", None))
    if isinstance(exc, OverCapError):
        return APIError(429, str(exc), "rate_limit_error", None, "too_many_concurrent_requests",
                        headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), "rate_limit_error", None, "queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), "service_unavailable")
    if isinstance(exc, StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), kind)
    if isinstance(exc, RequestValidationError):
        return APIError(400, str(exc))
    # The exception's text stays in the server's log: it may hold another request's data.
    log.error("labkit: a route failed", exc_info=exc)
    return APIError(500, f"internal error ({type(exc).__name__}): see the server's log", "internal_error")


def install_error_handlers(app: FastAPI, count: Callable[[Request, int], None]) -> None:
    """Answer every exception a route lets out through ``api_error``, and ``count`` each
    answer by status (``/metrics``)."""
    async def answer(request: Request, exc: Exception) -> JSONResponse:
        error = api_error(exc)
        count(request, error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    # Exception last: Starlette hands it only what no other handler takes (and logs it).
    for kind in (APIError, StarletteHTTPException, RequestValidationError, Exception):
        app.add_exception_handler(kind, answer)
