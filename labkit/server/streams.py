"""Reading a request's output streams on the event loop: newest output only, and abort on
disconnect.

The engine's outputs are cumulative (each holds all the text so far), so a reader that
falls behind needs only the newest one: ``newest`` keeps one output per stream, however
many iterations the engine runs while the reader waits. ``watch_disconnect`` aborts the
streams the moment the client goes away, so its KV blocks free at once, not when the
answer would have ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator

from fastapi import Request

from .access import DISCONNECT_POLL_S
from .async_engine import RequestStream


async def newest(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, object]]]:
    """The streams' outputs as batches of ``(stream index, newest output)``.

    A task per stream drains it into one slot that keeps only the newest output, so what
    waits for a slow reader is one output per stream, however many iterations the engine
    runs meanwhile (outputs are cumulative: the newest holds everything). Ends when every
    stream has finished; re-raises a stream's error."""
    latest: dict[int, object] = {}
    errors: list[BaseException] = []
    ready = asyncio.Event()

    async def drain(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                latest[i] = out
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
            if latest:
                batch = sorted(latest.items(), key=lambda item: item[0])
                latest.clear()
                yield batch
            if errors:
                raise errors[0]
            if all(t.done() for t in tasks) and not latest:
                return
    finally:
        for t in tasks:
            t.cancel()


@contextlib.asynccontextmanager
async def watch_disconnect(request: Request, streams: list[RequestStream]):
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
