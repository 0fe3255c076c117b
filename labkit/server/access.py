"""Who is asking, and whether they may come in: the server's front door.

Every ``/v1`` request passes here before the engine sees it: ``authorize`` names the
client (its key's name; without keys, its address), ``screen`` refuses what the headers
alone can refuse, ``admit`` waits for the client's turn at the admission gate
(``fairness.py``), and ``salt`` and ``request_id`` give the request a namespace of its
key's own. The invariant it keeps: with keys, no client can use, occupy or probe another
key's prefix cache or request ids, and every request the gate admitted gives its places
back exactly once (``Serving.account``).
"""

from __future__ import annotations

import asyncio
import collections
import hashlib

from fastapi import Request

from .auth import KeyRing
from .errors import api_error
from .fairness import AdmissionGate, OverCapError, Ticket
from .limits import Limits, check_length
from .protocol import APIError

DISCONNECT_POLL_S = 0.25      # how often a waiting request looks whether its client left


class Access:
    """The keys, the limits and the admission gate of one server, and the counters of
    what they refused (``/metrics``)."""

    def __init__(self, keys: KeyRing, limits: Limits, max_num_seqs: int):
        self.keys, self.limits = keys, limits
        cap = limits.max_concurrent_per_key
        # With a cap, release into the engine round-robin, at most a batch (max_num_seqs)
        # at a time; without one the gate only counts, and the engine's FCFS decides alone.
        self.gate = AdmissionGate(cap, max_num_seqs if cap is not None else None)
        self.auth_failures = {"missing": 0, "invalid": 0}
        self.http_errors: collections.Counter = collections.Counter()     # status -> responses

    def count_error(self, request: Request, status: int) -> None:
        """Count an error response, in all and under its client (once it is known)."""
        self.http_errors[status] += 1
        client = getattr(request.state, "client", None)
        if client is not None:
            errors = self.gate.usage(client).errors
            errors[status] = errors.get(status, 0) + 1

    def authorize(self, request: Request) -> str:
        """The client's name: its key's name, or its address when the server has no keys.
        Raises a 401 (OpenAI's body and wording) without a valid key."""
        if not self.keys:
            client = request.client.host if request.client else "unknown"
        else:
            header = request.headers.get("authorization")
            client = self.keys.name_of(header)
            if client is None:
                self.auth_failures["missing" if not header else "invalid"] += 1
                message = ("You didn't provide an API key. Send it in the Authorization header: "
                           "'Authorization: Bearer YOUR_KEY' (OpenAI clients: api_key=YOUR_KEY)."
                           if not header else "Incorrect API key provided.")
                raise APIError(401, message, "invalid_request_error", None, "invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        request.state.client = client
        return client

    def screen(self, request: Request) -> None:
        """What the headers alone can refuse, before the body is read (refusing stays
        cheap): no valid key (401), a declared body over the limit (413), a key at its
        cap already (429). The refusal closes the connection: otherwise the server would
        go on reading (and discarding) the body to reach the connection's next request,
        at whatever size the client declared."""
        try:
            client = self.authorize(request)
            check_length(request, self.limits)
            self.gate.check_room(client)
        except (APIError, OverCapError) as e:
            error = api_error(e)
            error.headers = {**error.headers, "Connection": "close"}
            raise error from None

    async def admit(self, request: Request, cost: int) -> Ticket:
        """Places in the engine for a request of ``cost`` sequences: at once, or after the
        client's turn comes. Raises ``OverCapError`` over the client's cap, and a 499 if
        the client leaves while it waits."""
        wait = asyncio.ensure_future(self.gate.acquire(request.state.client, cost))
        try:
            while True:                  # poll the client while it waits for its turn
                done, _ = await asyncio.wait({wait}, timeout=DISCONNECT_POLL_S)
                if done:
                    return wait.result()
                if await request.is_disconnected():
                    raise APIError(499, "the client closed the connection while waiting for its turn",
                                   code="client_closed_request")
        finally:
            if not wait.done():
                wait.cancel()            # withdraws the queued request (or gives a fresh ticket back)

    def salt(self, client: str, asked: str | None) -> str | None:
        """The request's prefix-cache namespace. With keys (unless the operator shares the
        cache), its key's name: a prompt is then found in the cache only by requests of the
        same key, so no student can test, by the cached-token count or the time to first
        token, whether another sent it. A request's own ``cache_salt`` narrows it further;
        the engine gets its digest, a fixed 64 characters however long the salt sent."""
        digest = None if asked is None else hashlib.sha256(asked.encode("utf-8")).hexdigest()
        if not self.keys or self.limits.share_prefix_cache:
            return digest
        return f"key:{client}" + ("" if digest is None else f"/{digest}")

    def request_id(self, request: Request, rid: str) -> str:
        """The engine's id for a request the client calls ``rid``. With keys, a client's
        own id (``X-Request-Id``) lives in its key's namespace: no student can occupy, or
        probe, the ids another student's client sends."""
        if self.keys and "x-request-id" in request.headers:
            return f"{request.state.client}:{rid}"
        return rid
