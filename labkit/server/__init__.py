"""Layer 4: online serving. An async engine loop and an OpenAI-compatible HTTP server.

* ``AsyncEngine``: the engine on a background thread; requests join at the next
  iteration, each with an async stream of outputs; cancel a stream and its blocks free;
* ``create_app``: the FastAPI app (``/v1/completions``, ``/v1/chat/completions``,
  ``/v1/models``, ``/health``, ``/metrics``), routes only (``app.py``): a request's life
  is ``serving.py`` (``serving_completion.py``, ``serving_chat.py``), its way in
  ``access.py``, and every error answer comes from one table, ``errors.py``;
* ``BackgroundServer``: the server on a thread (notebooks, tests), on a free loopback port;
* ``python -m labkit serve``: the same in the foreground;
* for a class sharing one server (``docs/classroom.md``): ``KeyRing``/``load_keys`` (API
  keys, ``auth.py``), ``Limits`` (per-key cap, max_tokens, what one request may ask for
  each iteration, body size, timeouts, ``limits.py``), the admission gate in front of the
  engine (``fairness.py``), a prefix-cache namespace per key (a cache salt, ``access.py``) and
  the startup heap kept out of the garbage collector's way (``heap.py``).

FastAPI and uvicorn come with ``pip install 'labkit[serve]'``; they load when the app is
first built, so ``AsyncEngine`` alone needs neither.
"""

from __future__ import annotations

from .async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestRecord, RequestStream
from .auth import KeyRing, load_keys
from .limits import Limits
from .metrics import parse_metrics, render_metrics

__all__ = ["AsyncEngine", "RequestStream", "RequestRecord", "QueueFullError", "EngineDeadError",
           "create_app", "BackgroundServer", "serve", "parse_metrics", "render_metrics",
           "KeyRing", "load_keys", "Limits"]


def __getattr__(name):
    if name == "create_app":
        from .app import create_app
        return create_app
    if name in ("BackgroundServer", "serve"):
        from . import background
        return getattr(background, name)
    raise AttributeError(f"module 'labkit.server' has no attribute {name!r}")
