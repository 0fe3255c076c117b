"""Limits that protect a shared server from its clients, careless or hostile.

What one client can cost the server, and where each cost is bounded:

| a client that ...                        | bounded by                              | answer              |
| ---------------------------------------- | --------------------------------------- | ------------------- |
| asks for very long outputs               | ``max_tokens`` (``--max-tokens-limit``) | 400 naming the cap  |
| sends many or long stop strings          | ``max_stop_strings``, ``max_stop_string_length`` | 400 naming the cap |
| sends a large logit_bias                 | ``max_logit_bias``                      | 400 naming the cap  |
| asks for many log-probabilities          | ``max_logprobs`` (vLLM's name) per      | 400 naming the cap  |
|                                          | generated token, ``max_prompt_logprobs`` |                     |
|                                          | per prompt token                        |                     |
| sends many stop token ids                | ``max_stop_token_ids``                  | 400 naming the cap  |
| sends a huge body                        | ``max_body_bytes``                      | 413, connection closed |
| connects and sends nothing, or a request | ``header_timeout_s`` (slowloris)        | 408, connection closed |
|   head one byte at a time                |                                         |                     |
| sends its body very slowly               | ``body_timeout_s``                      | 408                 |
| streams and stops reading                | ``write_buffer_bytes`` per connection   | the request aborted, its |
|                                          | then ``stall_timeout_s``                | KV blocks freed; counted |
| opens very many requests                 | the per-key cap (``fairness.py``)       | 429 + Retry-After   |
| opens very many connections              | ``max_connections``                     | 503                 |
| keeps a connection open and idle         | ``keep_alive_timeout_s``                | connection closed   |
| is refused (401, 413, 429) mid-upload    | the refusal closes the connection       | the body is not read |

Each per-request cap bounds work the engine does for that request on *every* iteration,
on the thread every other request waits for (``docs/server_api.md``, "What a request may
cost", has the measured costs).

A stream's buffering is bounded at two levels. In the server, a stream keeps only the
engine's *newest* output per sequence (outputs are cumulative: each holds all the text so
far), however far the client lags. On the connection, the kernel's send buffer is fixed at
``write_buffer_bytes`` (Linux doubles it for bookkeeping) and uvicorn stops the response
writer once as much again waits in its own buffer; if the client then reads nothing for
``stall_timeout_s``, the connection is cut, which aborts the request and frees its blocks.
(A client's own receive buffer, in its kernel, is its memory, not the server's: a client
with a large one can hold a whole short stream unread, which costs the server nothing.)

The two timers on a connection live in ``GuardedH11Protocol``, a subclass of uvicorn's h11
protocol: they act before a request exists (slowloris) or below the application (a full
socket), where an ASGI app cannot see.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from dataclasses import dataclass

from ..sampling_params import MAX_LOGPROBS
from .protocol import APIError, Parsed, bad_request

DEFAULT_MAX_BODY_BYTES = 1 << 20
# Defaults of the per-request caps (``docs/server_api.md`` justifies each).
DEFAULT_MAX_STOP_STRINGS = 32          # OpenAI allows 4; evaluation harnesses and agents send more
DEFAULT_MAX_STOP_STRING_LENGTH = 128   # characters; also what a stream may hold back
DEFAULT_MAX_STOP_TOKEN_IDS = 64
DEFAULT_MAX_LOGIT_BIAS = 300           # entries (token ids)
# Prompt-side log-probabilities: vLLM's 20 by default; a shared server (keys, or beyond
# loopback) takes 1 unless told otherwise: a token's own logprob and whether it was the
# most likely, what evaluation clients ask to score a text (echo + logprobs 1). More, on
# every prompt token, was measured to cost the other students' first tokens 2-4x.
SHARED_MAX_PROMPT_LOGPROBS = 1
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0     # uvicorn's own default; labkit used 30 s before


def default_max_concurrent_per_key(max_num_seqs: int) -> int:
    """The per-key cap when none is given: an eighth of the batch (at least 1), so that
    one key can never hold more than 1/8 of ``max_num_seqs`` and at least eight keys
    can have their full share running at the same time (8 for the default 64)."""
    return max(1, max_num_seqs // 8)


@dataclass(slots=True)
class Limits:
    """What one request or connection may cost. ``None``: no bound.

    ``max_concurrent_per_key``: sequences per client running or waiting (the gate; None:
    no gate, the engine's FCFS alone). ``max_tokens``: a cap on each request's
    ``max_tokens`` (chat requests without one get it as their default).
    ``max_stop_strings``/``max_stop_string_length``/``max_stop_token_ids``/``max_logit_bias``/
    ``max_logprobs``/``max_prompt_logprobs``: caps on what one request may ask for
    (``check_request``).
    ``keep_alive_timeout_s``: how long an idle kept-alive connection stays open.
    ``metrics_public``: serve ``/metrics`` without a key even when keys are set.
    ``share_prefix_cache``: with keys, let every key's requests hit each other's cached
    prompts (default: each key has its own namespace, a cache salt; ``docs/classroom.md``).
    """

    max_concurrent_per_key: int | None = None
    max_tokens: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    stall_timeout_s: float = 15.0
    write_buffer_bytes: int = 32 * 1024
    max_connections: int | None = None
    metrics_public: bool = False
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_length: int = DEFAULT_MAX_STOP_STRING_LENGTH
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_logprobs: int = MAX_LOGPROBS
    max_prompt_logprobs: int = MAX_LOGPROBS
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    share_prefix_cache: bool = False

    def __post_init__(self):
        for name in ("max_concurrent_per_key", "max_tokens", "max_connections"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        for name in ("max_stop_strings", "max_stop_token_ids", "max_logit_bias"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.max_stop_string_length, int) or self.max_stop_string_length < 1:
            raise ValueError(f"max_stop_string_length must be an integer >= 1, got {self.max_stop_string_length!r}")
        for name in ("max_logprobs", "max_prompt_logprobs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] (the engine computes at most "
                                 f"{MAX_LOGPROBS}), got {value!r}")
        if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be an integer >= 1024, got {self.max_body_bytes!r}")
        if not isinstance(self.write_buffer_bytes, int) or self.write_buffer_bytes < 1024:
            raise ValueError(f"write_buffer_bytes must be an integer >= 1024, got {self.write_buffer_bytes!r}")
        for name in ("header_timeout_s", "body_timeout_s", "stall_timeout_s", "keep_alive_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")


@dataclass(slots=True)
class ConnectionStats:
    """Connections cut by the protocol's timers (``/metrics``)."""

    header_timeouts: int = 0              # no complete request head in time (slowloris)
    stalled: int = 0                      # the client stopped reading a response


def check_request(parsed: Parsed, limits: Limits) -> None:
    """Refuse (400, naming the field, the cap and the option that sets it) a request that
    asks for more per-iteration work than ``limits`` allow: every cap here bounds something
    the engine does for the request at each of its steps, on the thread all requests share."""
    params = parsed.params

    def over(param: str, what: str, cap: int, option: str) -> APIError:
        return bad_request(f"{what}; this server allows at most {cap} ({option})", param=param,
                           code=f"{param}_limit")

    if len(params.stop) > limits.max_stop_strings:
        raise over("stop", f"'stop' has {len(params.stop)} strings", limits.max_stop_strings,
                   "--max-stop-strings")
    for i, stop in enumerate(params.stop):
        if len(stop) > limits.max_stop_string_length:
            raise over("stop", f"'stop' string {i} is {len(stop)} characters long",
                       limits.max_stop_string_length, "--max-stop-string-length")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise over("stop_token_ids", f"'stop_token_ids' has {len(params.stop_token_ids)} token ids",
                   limits.max_stop_token_ids, "--max-stop-token-ids")
    if params.logit_bias and len(params.logit_bias) > limits.max_logit_bias:
        raise over("logit_bias", f"'logit_bias' has {len(params.logit_bias)} entries", limits.max_logit_bias,
                   "--max-logit-bias")
    # Per generated token: n x (k + 1) entries an iteration. Per prompt token: every prompt
    # position's k + 1 entries at once, in its prefill and its one answer.
    if parsed.logprobs is not None and parsed.logprobs > limits.max_logprobs:
        name = "top_logprobs" if parsed.chat else "logprobs"
        raise over(name, f"'{name}' is {parsed.logprobs}", limits.max_logprobs, "--max-logprobs")
    if parsed.prompt_logprobs is not None and parsed.prompt_logprobs > limits.max_prompt_logprobs:
        raise over("prompt_logprobs", f"'prompt_logprobs' is {parsed.prompt_logprobs}", limits.max_prompt_logprobs,
                   "--max-prompt-logprobs")
    if parsed.echo and parsed.logprobs is not None and parsed.logprobs > limits.max_prompt_logprobs:
        raise over("logprobs", f"'echo' with 'logprobs' {parsed.logprobs} scores every prompt token with that many "
                   "alternatives", limits.max_prompt_logprobs, "--max-prompt-logprobs")


def check_length(request, limits: Limits) -> None:
    """Refuse a declared ``Content-Length`` over the limit (413) from the headers alone."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.strip().isdigit():
            raise APIError(400, f"invalid Content-Length header {declared[:40]!r}", headers=_CLOSE)
        if int(declared) > limits.max_body_bytes:
            raise _too_large(int(declared), limits.max_body_bytes)


async def read_body(request, limits: Limits) -> bytes:
    """The request body, at most ``limits.max_body_bytes`` (else 413) read within
    ``limits.body_timeout_s`` (else 408). A declared ``Content-Length`` over the limit is
    refused before a byte of the body is read."""
    limit = limits.max_body_bytes
    check_length(request, limits)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit)
            chunks.append(chunk)
        return b"".join(chunks)

    from starlette.requests import ClientDisconnect
    try:
        return await asyncio.wait_for(read(), limits.body_timeout_s)
    except ClientDisconnect:
        raise APIError(499, "the client closed the connection before its body arrived",
                       code="client_closed_request") from None
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {limits.body_timeout_s:g} s",
                       "invalid_request_error", None, "request_timeout", headers=_CLOSE) from None


_CLOSE = {"Connection": "close"}


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({size} > {limit} bytes)",
                    "invalid_request_error", None, "request_too_large", headers=_CLOSE)


STALLED_SCOPE_KEY = "labkit.stalled"      # set in the ASGI scope of a request cut for stalling


def guarded_protocol(limits: Limits, stats: ConnectionStats):
    """uvicorn's h11 protocol class with the header and stall timers of ``limits``,
    counting what they cut in ``stats``."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """A connection must deliver each request head within ``header_timeout_s`` (from
        connecting, or from the first byte of a kept-alive connection's next request); a
        response whose client reads nothing for ``stall_timeout_s`` while
        ``write_buffer_bytes`` wait to be sent is cut."""

        def connection_made(self, transport):
            super().connection_made(transport)
            # What may wait for a client that does not read: this much in uvicorn's buffer,
            # and a fixed kernel send buffer (no autotuning up to megabytes) beneath it.
            transport.set_write_buffer_limits(high=limits.write_buffer_bytes)
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limits.write_buffer_bytes)
            self._stall_timer = None
            self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and self.conn.their_state is h11.IDLE:
                self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)
            super().data_received(data)
            if self._head_timer is not None and self.conn.their_state is not h11.IDLE:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            stats.header_timeouts += 1
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\n"
                                 b"connection: close\r\n\r\n")
            self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(limits.stall_timeout_s, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            if self.transport.is_closing():
                return
            stats.stalled += 1
            if self.scope is not None:
                self.scope[STALLED_SCOPE_KEY] = True
            self.transport.abort()            # drop what is buffered: the client reads nothing

        def connection_lost(self, exc) -> None:
            for timer in (self._head_timer, self._stall_timer):
                if timer is not None:
                    timer.cancel()
            self._head_timer = self._stall_timer = None
            super().connection_lost(exc)

    return GuardedH11Protocol
