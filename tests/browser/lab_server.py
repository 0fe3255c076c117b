"""A throw-away JupyterLab server for browser tests: loopback, no token, isolated dirs.

``running_jupyterlab(root_dir)`` starts ``jupyter lab`` headless on a free loopback port in
its own process group (so that stopping the group also stops its kernels), with every
JUPYTER_* directory inside ``root_dir/.jupyter-home`` (the user's own config, workspaces
and news pop-ups stay out of it), waits for ``/api/status``, yields the base URL, and
kills the whole group on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isolated_env(home: Path) -> dict[str, str]:
    """Environment with every Jupyter/IPython directory under ``home``; news checks off."""
    env = dict(os.environ)
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
            "IPYTHONDIR": "ipython", "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
            "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces"}
    for var, name in dirs.items():
        path = home / name
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    notify = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
    notify.mkdir(parents=True, exist_ok=True)
    (notify / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env.pop("JUPYTER_TOKEN", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def running_jupyterlab(root_dir: Path, startup_timeout: float = 60.0):
    """Serve ``root_dir`` with JupyterLab; yield ``http://127.0.0.1:PORT``."""
    root_dir = Path(root_dir)
    port = free_port()
    home = root_dir / ".jupyter-home"
    log = open(root_dir / "jupyterlab.log", "w")
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser",
           "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
           "--IdentityProvider.token=", "--PasswordIdentityProvider.hashed_password=",
           "--ServerApp.allow_root=True", f"--ServerApp.root_dir={root_dir}",
           "--expose-app-in-browser", "--LabApp.news_url=None",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    proc = subprocess.Popen(cmd, cwd=root_dir, env=isolated_env(home), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)   # setsid
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited with {proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"jupyter lab did not answer within {startup_timeout:.0f} s; see {log.name}")
            time.sleep(0.3)
        yield url
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen, grace: float = 8.0) -> None:
    """TERM the server's process group (server and kernels), then KILL what is left."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
