"""Run the server: in the background of a notebook or a test, or in the foreground (CLI).

    with BackgroundServer(model="tiny-llama") as server:     # a free loopback port
        client = openai.OpenAI(base_url=server.base_url, api_key="labkit")
        ...
        server.engine.records()          # the same process: read the engine directly

Both bind the socket themselves before uvicorn starts, so ``port=0`` (a free port chosen
by the OS) works and the address is known at once. The default host is loopback.

For a class (``docs/classroom.md``): ``api_keys=`` (a ``KeyRing``, or key strings
``"key"``/``"name:key"``) and ``limits=Limits(max_concurrent_per_key=...)``. Listening on
an address other than loopback without a key is refused unless
``allow_unauthenticated=True``: exposing a server by accident must not be one flag away.
Connections are served by ``limits.guarded_protocol``: request-head and stall timers.
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
from .auth import ENV_VAR, KeyRing
from .limits import ConnectionStats, Limits, guarded_protocol

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


class ExposureError(ValueError):
    """Listening beyond loopback without a key, and without saying that is intended."""


def check_exposure(host: str, keys: KeyRing, allow_unauthenticated: bool = False) -> None:
    """Refuse a non-loopback ``host`` without keys unless ``allow_unauthenticated``."""
    if is_loopback(host) or keys or allow_unauthenticated:
        return
    raise ExposureError(
        f"refusing to listen on {host} without an API key: anyone who can reach this machine "
        f"could use the server. Add a key (--api-key KEY, --api-keys-file FILE with one 'name:key' "
        f"per line, or the environment variable {ENV_VAR}; in Python: api_keys=[...]), listen on "
        f"127.0.0.1, or accept the risk with --allow-unauthenticated (allow_unauthenticated=True)")


def describe_access(host: str, keys: KeyRing, limits: Limits) -> str:
    """Who can reach the server and what each may do, for the start-up banner."""
    if is_loopback(host):
        who = "from this machine only (loopback)"
    else:
        who = f"from the network: anyone who can reach {host}"
    auth = (f"with one of {len(keys)} API keys ({', '.join(keys.names[:4])}{', ...' if len(keys) > 4 else ''})"
            if keys else "with no API key (anyone who reaches it may use it)")
    cap = limits.max_concurrent_per_key
    share = (f"at most {cap} sequences running or waiting per {'key' if keys else 'client address'}, "
             "admitted round-robin" if cap is not None else "no per-client cap")
    tokens = f"max_tokens <= {limits.max_tokens}" if limits.max_tokens else "max_tokens up to the context"
    metrics = "/metrics open" if limits.metrics_public or not keys else "/metrics needs a key"
    cache = ("prefix cache private to each key" if keys and not limits.share_prefix_cache else
             "prefix cache shared by every key (--share-prefix-cache)" if keys else "prefix cache shared")
    return f"reachable {who}, {auth}; {share}; {tokens}; {cache}; {metrics}; /health open"


def _as_keys(api_keys) -> KeyRing:
    if api_keys is None or isinstance(api_keys, KeyRing):
        return api_keys or KeyRing()
    if isinstance(api_keys, str):
        raise ValueError("api_keys takes a list of keys (or a KeyRing), not one string")
    ring = KeyRing()
    for i, spec in enumerate(api_keys):
        ring.add_spec(spec, f"api_keys[{i}]")
    return ring


def _config(app, log_level: str, limits: Limits, connections: ConnectionStats):
    import uvicorn
    return uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="on",
                          timeout_graceful_shutdown=3, timeout_keep_alive=limits.keep_alive_timeout_s,
                          http=guarded_protocol(limits, connections),
                          limit_concurrency=limits.max_connections)


class BackgroundServer:
    """The OpenAI-compatible server on a thread of this process.

    Give an ``AsyncEngine`` (it stays yours) or the engine's options (``model=``,
    ``num_blocks=``, ``max_num_seqs=``, ``max_waiting=``, ``step_delay_s=``, ...: the
    engine then belongs to the server and stops with it). Starts at once unless
    ``start=False``; ``stop()`` (or leaving a ``with`` block) stops it.

    ``api_keys``: keys (``"key"`` or ``"name:key"``) or a ``KeyRing``; ``limits``: a
    ``Limits`` (default: no per-key cap, the in-process server of one user).
    """

    def __init__(self, engine: AsyncEngine | None = None, *, host: str = LOOPBACK, port: int = 0,
                 served_model_name: str | None = None, log_level: str = "warning",
                 start: bool = True, api_keys=None, limits: Limits | None = None,
                 allow_unauthenticated: bool = False, **engine_options):
        self.keys = _as_keys(api_keys)
        self.limits = limits or Limits()
        check_exposure(host, self.keys, allow_unauthenticated)
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
        self.connections = ConnectionStats()
        self.app = create_app(engine, served_model_name, keys=self.keys, limits=self.limits,
                              connections=self.connections)
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
        self._server = uvicorn.Server(_config(self.app, self._log_level, self.limits, self.connections))
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
          log_level: str = "info", keys: KeyRing | None = None, limits: Limits | None = None,
          allow_unauthenticated: bool = False) -> None:
    """Serve in the foreground until Ctrl-C (the CLI). Prints the address once listening,
    and who can reach it. Raises ``ExposureError`` for a non-loopback host without keys
    (unless ``allow_unauthenticated``)."""
    import uvicorn
    keys = keys or KeyRing()
    limits = limits or Limits()
    check_exposure(host, keys, allow_unauthenticated)
    if not is_loopback(host) and not keys:
        print(f"labkit: warning: listening on {host} with no API key (--allow-unauthenticated): "
              "anyone who can reach this machine can use the server", file=sys.stderr)
    sock = bind_socket(host, port)
    actual = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    name = served_model_name or engine.model_name

    def banner():
        print(f"labkit: serving {name} at http://{shown}:{actual}/v1 (OpenAI-compatible; "
              f"/health, /metrics)", flush=True)
        print(f"labkit: {describe_access(host, keys, limits)}", flush=True)

    connections = ConnectionStats()
    app = create_app(engine, served_model_name, owns_engine=True, on_startup=banner, keys=keys,
                     limits=limits, connections=connections)
    logging.getLogger("uvicorn.error").propagate = False
    uvicorn.Server(_config(app, log_level, limits, connections)).run(sockets=[sock])
