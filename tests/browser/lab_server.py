"""A throw-away JupyterLab server for browser tests: loopback, no token, isolated dirs.

``running_jupyterlab(root_dir)`` starts ``jupyter lab`` headless on a free loopback port in
its own process group (so that stopping the group also stops its kernels), with every
JUPYTER_* directory inside ``root_dir/.jupyter-home`` (the user's own config, workspaces
and news pop-ups stay out of it), waits for ``/api/status``, yields the base URL, and
kills the whole group on exit, whatever happened.

``running_make_lab(notebooks, home)`` starts the README's ``make lab`` itself (its setup and
model steps taken as done), on a copy of the notebooks, and yields its URL and token: what
a student's browser opens.
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


def isolated_env(home: Path, quiet_news: bool = True) -> dict[str, str]:
    """Environment with every Jupyter/IPython directory under ``home``; news checks off
    unless ``quiet_news`` is false (to see what a new user's JupyterLab would show)."""
    env = dict(os.environ)
    dirs = {"JUPYTER_CONFIG_DIR": "config", "JUPYTER_DATA_DIR": "data", "JUPYTER_RUNTIME_DIR": "runtime",
            "IPYTHONDIR": "ipython", "JUPYTERLAB_SETTINGS_DIR": "lab-settings",
            "JUPYTERLAB_WORKSPACES_DIR": "lab-workspaces"}
    for var, name in dirs.items():
        path = home / name
        path.mkdir(parents=True, exist_ok=True)
        env[var] = str(path)
    if quiet_news:
        notify = home / "lab-settings" / "@jupyterlab" / "apputils-extension"
        notify.mkdir(parents=True, exist_ok=True)
        (notify / "notification.jupyterlab-settings").write_text(
            json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    for var in ("JUPYTER_TOKEN", "JUPYTER_CONFIG_PATH", "JUPYTER_PATH"):
        env.pop(var, None)
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
        wait_until_answers(proc, f"{url}/api/status", startup_timeout, f"jupyter lab (see {log.name})")
        yield url
    finally:
        stop_group(proc)
        log.close()


@contextlib.contextmanager
def running_make_lab(notebooks: Path, home: Path, startup_timeout: float = 90.0):
    """``make lab`` from the repository root, serving ``notebooks`` with this interpreter's
    environment (``-o setup -o model``: installing is not what is tested). Jupyter's own
    directories live under ``home`` and nothing silences the news: what the lab shows is what
    the Makefile and ``.jupyter/`` make it show. Yields ``(url, token)``."""
    root = Path(__file__).resolve().parents[2]
    port, token = free_port(), os.urandom(12).hex()
    env = isolated_env(Path(home), quiet_news=False)
    env.update(JUPYTER_TOKEN=token, BROWSER="true")           # no browser window: `true URL`
    env.pop("CONDA_DEFAULT_ENV", None)
    cmd = ["make", "--no-print-directory", "-C", str(root), "-o", "setup", "-o", "model", "lab",
           f"PORT={port}", f"NOTEBOOKS={notebooks}", f"VENV={Path(sys.executable).parent.parent}",
           "LAB_OPTS=--ServerApp.ip=127.0.0.1 --ServerApp.port_retries=0 --expose-app-in-browser"]
    log = open(Path(home) / "make-lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(proc, f"{url}/api/status?token={token}", startup_timeout, f"make lab (see {log.name})")
        yield url, token
    finally:
        stop_group(proc)
        log.close()


def terminal_warnings(log: str) -> list[str]:
    """The warnings in a Jupyter server's terminal output: its own (``[W ...]``) and those of
    Python and of its kernels (``WARNING``, ``...Warning:``). A student should see none."""
    return [line for line in log.splitlines()
            if line.startswith("[W ") or "WARNING" in line or "Warning" in line]


def wait_until_answers(proc: subprocess.Popen, url: str, timeout_s: float, what: str) -> None:
    """Poll ``url`` until it answers 200; raise, naming ``what``, if ``proc`` exits first or
    ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout_s:.0f} s")
        time.sleep(0.3)


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
