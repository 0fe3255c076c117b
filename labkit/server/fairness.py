"""A fair share per client: a cap per key, and round-robin admission across keys.

The engine's scheduler admits waiting requests first come, first served. That is fair
between requests, not between people: one student whose loop sends 80 requests puts 80
requests ahead of everyone else's next one. The gate in front of the engine fixes that
with two rules, in the vocabulary of the vLLM paper's scheduler:

1. **A cap per client** (``cap``): a client (an API key's name, or a client address when
   the server has no keys) may have at most ``cap`` sequences running or waiting. One more
   is refused at once (HTTP 429 with ``Retry-After``), never queued silently, so a runaway
   loop learns it is over its share instead of piling up work nobody will read.
   Sequences, not HTTP requests, are counted: a request with 3 prompts and ``n=2`` holds
   6 places in the batch, so it counts 6.
2. **Round-robin admission** (``budget``): at most ``budget`` sequences (the engine's
   ``max_num_seqs``) are handed to the engine at once. Beyond that, requests wait here, in
   one FIFO queue per client, and each freed place goes to the *next client in turn*, not
   to the oldest request. A client with 8 requests queued and a client with 1 both get
   their next request in within one turn of the ring: one client's backlog cannot delay
   another client's admission by more than one request per client ahead of it.

Why round robin and not, say, weighted fair queueing by tokens: every student here has the
same weight, requests are short, and a ring of FIFO queues is a few lines that a student
can check by hand. (FCFS holds *within* a client, so one student's requests keep their order.)

Everything here runs on the server's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from ..errors import LimitExceeded


@dataclass(slots=True)
class ClientUsage:
    """One client's numbers, as ``/metrics`` shows them (labelled by its name)."""

    requests: int = 0                     # requests admitted into the engine
    prompt_tokens: int = 0
    cached_tokens: int = 0                # of those, served by the prefix cache (the key's own hits)
    generation_tokens: int = 0
    errors: dict[int, int] = field(default_factory=dict)    # HTTP status -> error responses
    active: int = 0                       # sequences handed to the engine, not finished
    queued: int = 0                       # sequences waiting here for their turn
    stalled: int = 0                      # streams aborted: the client stopped reading
    last_seen: float = 0.0

    @property
    def concurrency(self) -> int:
        """Sequences running or waiting (in the engine or in the gate): what the cap bounds."""
        return self.active + self.queued


class OverCapError(Exception):
    """A client asked for more than its share (HTTP 429, ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(slots=True, eq=False)
class Ticket:
    """A request's places in the engine, held from admission until its end."""

    client: str
    cost: int                             # sequences: prompts x n
    future: asyncio.Future | None = None
    released: bool = False                # handed to the engine
    done: bool = False                    # finished or withdrawn: places given back


class AdmissionGate:
    """Per-client caps in front of the engine, and round-robin release into it.

    ``cap``: most sequences one client may have running or waiting (None: no cap).
    ``budget``: most sequences handed to the engine at once (None: hand over at once;
    the gate then only counts). Invariants: ``in_flight`` is the sum of the costs of
    released, unfinished tickets, and stays <= ``budget`` except for a single request
    larger than the budget (released alone); each client's ``concurrency`` <= ``cap``.
    """

    def __init__(self, cap: int | None = None, budget: int | None = None, max_clients: int = 4096):
        for what, value in (("cap", cap), ("budget", budget)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{what} must be an integer >= 1 or None, got {value!r}")
        self.cap = cap
        self.budget = budget
        self.max_clients = max_clients
        self.clients: dict[str, ClientUsage] = {}
        self.in_flight = 0
        self._queues: dict[str, deque[Ticket]] = {}
        self._ring: deque[str] = deque()        # clients with queued tickets, next turn first

    def usage(self, client: str) -> ClientUsage:
        """``client``'s record (created on first sight; idle ones are forgotten when there
        are more than ``max_clients``, e.g. many addresses on a server without keys)."""
        u = self.clients.get(client)
        if u is None:
            if len(self.clients) >= self.max_clients:
                self._forget_idle()
            u = self.clients[client] = ClientUsage()
        u.last_seen = time.monotonic()
        return u

    def check_room(self, client: str) -> None:
        """Raise ``OverCapError`` if ``client`` is at its cap already, so that a request
        that cannot be admitted is refused before its body is read and parsed."""
        if self.cap is not None and self.usage(client).concurrency >= self.cap:
            raise self._over_cap(client)

    def _over_cap(self, client: str) -> OverCapError:
        return OverCapError(
            f"too many requests at once: {client!r} has {self.usage(client).concurrency} sequences "
            f"running or waiting, and the limit per client is {self.cap}; retry when one finishes")

    async def acquire(self, client: str, cost: int) -> Ticket:
        """Places for a request of ``cost`` sequences: at once if the engine has room and
        nobody waits, else after this client's turn comes. Raises ``OverCapError`` at once
        when the client would exceed its cap, ``LimitExceeded`` if the request alone exceeds
        it. Cancelling the wait withdraws the request."""
        u = self.usage(client)
        if self.cap is not None:
            if cost > self.cap:
                raise LimitExceeded(f"this request asks for {cost} sequences (prompts x n) but each "
                                    f"client may have at most {self.cap} running or waiting; split it", None)
            if u.concurrency + cost > self.cap:
                raise self._over_cap(client)
        ticket = Ticket(client, cost)
        if not self._ring and self._has_room(cost):
            self._release(ticket)
            return ticket
        ticket.future = asyncio.get_running_loop().create_future()
        u.queued += cost
        queue = self._queues.setdefault(client, deque())
        if not queue:
            self._ring.append(client)
        queue.append(ticket)
        try:
            await ticket.future
        except BaseException:
            self._withdraw(ticket)
            raise
        return ticket

    def release(self, ticket: Ticket) -> None:
        """The ticket's sequences have finished (or were aborted): give its places back
        and let the next clients in turn go. Idempotent."""
        if ticket.done:
            return
        ticket.done = True
        if ticket.released:
            self.in_flight -= ticket.cost
            self.usage(ticket.client).active -= ticket.cost
        self._pump()

    @property
    def num_queued(self) -> int:
        return sum(len(q) for q in self._queues.values())

    # ---- internals ------------------------------------------------------------------
    def _has_room(self, cost: int) -> bool:
        return self.budget is None or self.in_flight == 0 or self.in_flight + cost <= self.budget

    def _release(self, ticket: Ticket) -> None:
        ticket.released = True
        self.in_flight += ticket.cost
        u = self.usage(ticket.client)
        u.active += ticket.cost
        u.requests += 1

    def _pump(self) -> None:
        """Hand queued tickets over, one per client in ring order, while there is room."""
        while self._ring:
            client = self._ring[0]
            queue = self._queues[client]
            ticket = queue[0]
            if not self._has_room(ticket.cost):
                return
            queue.popleft()
            self._ring.popleft()
            if queue:
                self._ring.append(client)         # its next request waits for the next turn
            else:
                del self._queues[client]
            self.usage(client).queued -= ticket.cost
            self._release(ticket)
            ticket.future.set_result(None)

    def _withdraw(self, ticket: Ticket) -> None:
        """A queued request whose client gave up (or a released one cancelled on the way)."""
        queue = self._queues.get(ticket.client)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            self.usage(ticket.client).queued -= ticket.cost
            if not queue:
                del self._queues[ticket.client]
                self._ring.remove(ticket.client)
            ticket.done = True
            self._pump()                          # it may have been the turn that did not fit
        else:
            self.release(ticket)

    def _forget_idle(self) -> None:
        idle = sorted((u.last_seen, c) for c, u in self.clients.items() if u.concurrency == 0)
        for _, client in idle[:max(1, len(self.clients) - self.max_clients + 1)]:
            del self.clients[client]
