"""Run the server: in the background of a notebook or a test, or in the foreground (CLI).

    with BackgroundServer(model="tiny-llama") as server:     # a free loopback port
        client = openai.OpenAI(base_url=server.base_url, api_key="labkit")
        ...
        server.engine.records()          # the same process: read the engine directly

Both bind the socket themselves before uvicorn starts, so ``port=0`` (a free port chosen
by the OS) works and the address is known at once. The default host is loopback.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time

from .app import create_app
from .async_engine import AsyncEngine

LOOPBACK = "127.0.0.1"


def bind_socket(host: str = LOOPBACK, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _config(app, log_level: str):
    import uvicorn
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=3, timeout_keep_alive=30)


class BackgroundServer:
    """The OpenAI-compatible server on a thread of this process.

    Give an ``AsyncEngine`` (it stays yours) or the engine's options (``model=``,
    ``num_blocks=``, ``max_num_seqs=``, ``max_waiting=``, ``step_delay_s=``, ...: the
    engine then belongs to the server and stops with it). Starts at once unless
    ``start=False``; ``stop()`` (or leaving a ``with`` block) stops it.
    """

    def __init__(self, engine: AsyncEngine | None = None, *, host: str = LOOPBACK, port: int = 0,
                 served_model_name: str | None = None, log_level: str = "warning",
                 start: bool = True, **engine_options):
        if engine is None:
            engine_options.setdefault("model", "smollm2-135m")
            engine = AsyncEngine(**engine_options)
            self._owns_engine = True
        elif engine_options:
            raise ValueError(f"give an AsyncEngine or engine options, not both: {sorted(engine_options)}")
        else:
            self._owns_engine = False
        self.engine = engine
        self.host = host
        self.app = create_app(engine, served_model_name)
        self._sock = bind_socket(host, port)
        self.port: int = self._sock.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None
        self._log_level = log_level
        if start:
            self.start()

    @property
    def url(self) -> str:
        """``http://host:port`` (the root: /health, /metrics)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``: what the ``openai`` client takes as ``base_url``."""
        return self.url + "/v1"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        import uvicorn
        if self._thread is not None:
            return self
        self._server = uvicorn.Server(_config(self.app, self._log_level))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name=f"labkit-http-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (open streams end), then the engine if the server owns it."""
        if self._server is not None:
            self._server.should_exit = True
        if self._owns_engine:
            self.engine.shutdown()           # unfinished requests end now ("abort")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        try:
            self._sock.close()
        except OSError:
            pass

    close = stop

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self._thread is not None else "stopped"
        return f"BackgroundServer({self.engine.model_name!r} at {self.base_url}, {state})"


def serve(engine: AsyncEngine, host: str = LOOPBACK, port: int = 8000, served_model_name: str | None = None,
          log_level: str = "info") -> None:
    """Serve in the foreground until Ctrl-C (the CLI). Prints the address once listening."""
    import uvicorn
    if not is_loopback(host):
        print(f"labkit: warning: listening on {host}, not loopback: anyone who can reach this "
              "machine can use the server (there is no authentication)", file=sys.stderr)
    sock = bind_socket(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    name = served_model_name or engine.model_name

    def banner():
        print(f"labkit: serving {name} at http://{shown}:{actual}/v1 (OpenAI-compatible; "
              f"/health, /metrics)", flush=True)

    app = create_app(engine, served_model_name, owns_engine=True, on_startup=banner)
    logging.getLogger("uvicorn.error").propagate = False
    uvicorn.Server(_config(app, log_level)).run(sockets=[sock])
