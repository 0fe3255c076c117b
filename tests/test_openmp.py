"""labkit/openmp.py: ``import labkit`` shortens OpenMP's spin-wait (a busy machine's
collapse, docs/benchmarks.md "--contend") only when it still can and the user has not chosen;
bench serve runs the peers with their own settings."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from labkit.openmp import DEFAULT_SPIN_COUNT, configure_openmp_wait


def test_sets_the_spin_count_before_torch_loads_and_only_then():
    assert configure_openmp_wait({}, {}) == DEFAULT_SPIN_COUNT
    env = {}
    configure_openmp_wait(env, {})
    assert env == {"GOMP_SPINCOUNT": DEFAULT_SPIN_COUNT}
    assert configure_openmp_wait({}, {"torch": object()}) is None       # too late: the runtime has read it


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"},
                                  {"GOMP_SPINCOUNT": "50000"}, {"LABKIT_GOMP_SPINCOUNT": "default"},
                                  {"LABKIT_GOMP_SPINCOUNT": ""}])
def test_a_users_choice_is_left_alone(user):
    env = dict(user)
    assert configure_openmp_wait(env, {}) is None and env == user


def test_another_count_can_be_asked_for_and_nonsense_is_named():
    env = {"LABKIT_GOMP_SPINCOUNT": "200"}
    assert configure_openmp_wait(env, {}) == "200" and env["GOMP_SPINCOUNT"] == "200"
    with pytest.raises(ValueError, match="LABKIT_GOMP_SPINCOUNT.*'fast'"):
        configure_openmp_wait({"LABKIT_GOMP_SPINCOUNT": "fast"}, {})


def _spin_count_seen(code: str, **extra) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                             "LABKIT_GOMP_SPINCOUNT")}
    env.update(extra)
    out = subprocess.run([sys.executable, "-c", code + "; import os; print(os.environ.get('GOMP_SPINCOUNT'))"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()[-1]


def test_import_labkit_first_sets_it_in_a_fresh_process():
    assert _spin_count_seen("import labkit") == DEFAULT_SPIN_COUNT
    assert _spin_count_seen("import torch, labkit") == "None"          # torch first: nothing changes
    assert _spin_count_seen("import labkit", OMP_WAIT_POLICY="PASSIVE") == "None"


def test_bench_serve_runs_the_peers_with_their_own_openmp_settings(monkeypatch):
    from labkit import openmp
    from labkit.bench.serve import child_env
    monkeypatch.setattr(openmp, "set_by_labkit", DEFAULT_SPIN_COUNT)
    monkeypatch.setenv("GOMP_SPINCOUNT", DEFAULT_SPIN_COUNT)
    assert child_env("labkit")["GOMP_SPINCOUNT"] == DEFAULT_SPIN_COUNT
    for peer in ("hf-static", "hf-cb", "vllm"):
        env = child_env(peer)
        assert "GOMP_SPINCOUNT" not in env and env["LABKIT_GOMP_SPINCOUNT"] == "default"
    monkeypatch.setenv("GOMP_SPINCOUNT", "77")                  # the user's own value goes to everyone
    assert child_env("hf-static")["GOMP_SPINCOUNT"] == "77"


# ---- whatever the import order: the lab's kernels, scripts, LLM()'s warning -------------------
_TWO_ENGINES = ("from labkit import LLM\n"
                "LLM('tiny-llama', num_blocks=8); LLM('tiny-llama', num_blocks=8)\n")


def _script_stderr(code: str, **extra) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY",
                                                             "LABKIT_GOMP_SPINCOUNT")}
    env.update({"OMP_NUM_THREADS": "2", **extra})
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GOMP_SPINCOUNT is GNU OpenMP's (Linux)")
@pytest.mark.slow
def test_a_script_importing_torch_first_is_told_once_what_to_do():
    """Too late to fix from inside: LLM() says so once per process, with both remedies."""
    err = _script_stderr("import torch\n" + _TWO_ENGINES)
    assert err.count("torch was imported before labkit") == 1, err
    assert "Import labkit before torch" in err and f"GOMP_SPINCOUNT={DEFAULT_SPIN_COUNT}" in err
    assert "RuntimeWarning" in err


@pytest.mark.slow
def test_labkit_first_needs_no_warning():
    assert "torch was imported before labkit" not in _script_stderr("import labkit, torch\n" + _TWO_ENGINES)


@pytest.mark.parametrize("env, threads, warns", [
    ({}, 2, True),
    ({"LABKIT_GOMP_SPINCOUNT": "default"}, 2, False),     # asked to leave OpenMP alone
    ({}, 1, False),                                       # one thread: nothing spins
])
def test_the_warning_rule(monkeypatch, env, threads, warns):
    from labkit import openmp
    monkeypatch.setattr(openmp, "too_late", True)
    monkeypatch.setattr(openmp, "_warned", False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.delenv("LABKIT_GOMP_SPINCOUNT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert openmp.warn_if_too_late(threads) is warns
        assert openmp.warn_if_too_late(threads) is False            # once per process
    assert len(seen) == warns
    monkeypatch.setattr(openmp, "too_late", False)                 # set in time, or chosen by the user
    monkeypatch.setattr(openmp, "_warned", False)
    assert openmp.warn_if_too_late(2) is False


@pytest.mark.slow
def test_import_labkit_records_whether_it_came_too_late():
    """``too_late`` only when torch was first and nothing was chosen: the case to warn about."""
    def too_late(**extra) -> str:
        env = {k: v for k, v in os.environ.items()
               if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "LABKIT_GOMP_SPINCOUNT")}
        code = "import torch, labkit.openmp as o; print(o.too_late)"
        return subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True,
                              text=True, check=True).stdout.strip()
    assert too_late() == "True"
    assert too_late(GOMP_SPINCOUNT="1000") == "False" and too_late(OMP_WAIT_POLICY="PASSIVE") == "False"


_KERNEL_PROBE = ("import torch, os\n"          # torch first, as a notebook might
                 "print(os.environ.get('GOMP_SPINCOUNT'), torch.get_num_threads())")


def _execute_in_new_kernel(url: str, token: str, code: str, timeout_s: float = 120.0) -> str:
    """Start a kernel on a running Jupyter server and run ``code`` in it over the kernel
    websocket, as a browser does; returns what it printed."""
    import asyncio
    import json
    import time
    import urllib.request
    import uuid

    from tornado.websocket import websocket_connect

    request = urllib.request.Request(f"{url}/api/kernels?token={token}", method="POST", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        kernel_id = json.load(r)["id"]

    async def run() -> str:
        session = uuid.uuid4().hex
        ws = await websocket_connect(f"{url.replace('http', 'ws', 1)}/api/kernels/{kernel_id}/channels"
                                     f"?token={token}&session_id={session}")
        msg_id, out = uuid.uuid4().hex, []
        ws.write_message(json.dumps({
            "header": {"msg_id": msg_id, "username": "test", "session": session,
                       "msg_type": "execute_request", "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
            "content": {"code": code, "silent": False, "store_history": False, "user_expressions": {},
                        "allow_stdin": False, "stop_on_error": True}}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = await asyncio.wait_for(ws.read_message(), deadline - time.monotonic())
            assert msg is not None, "the kernel websocket closed"
            msg = json.loads(msg)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                out.append(content["text"])
            elif kind == "error":
                raise AssertionError("\n".join(content["traceback"]))
            elif kind == "status" and content["execution_state"] == "idle":
                ws.close()
                return "".join(out)
        raise TimeoutError(f"the kernel did not answer within {timeout_s:.0f} s")

    return asyncio.run(run())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GOMP_SPINCOUNT is GNU OpenMP's (Linux)")
def test_make_labs_kernels_start_with_the_short_spin_and_without_a_terminal_warning(tmp_path, monkeypatch):
    """``make lab``'s server (``.jupyter/``) imports labkit: a notebook that imports torch
    first still runs with GOMP_SPINCOUNT set from its first line. Its kernels talk to the
    server over CurveZMQ, so ipykernel's "running over TCP without encryption" warning, which
    a student cannot act on, is not in the terminal."""
    import shutil
    pytest.importorskip("jupyterlab", reason="jupyterlab is not installed")
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    sys.path.insert(0, str(Path(__file__).parent / "browser"))
    from lab_server import running_make_lab, terminal_warnings
    for var in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "LABKIT_GOMP_SPINCOUNT"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "notebooks").mkdir()
    with running_make_lab(tmp_path / "notebooks", tmp_path / "home") as (url, token):
        spin, threads = _execute_in_new_kernel(url, token, _KERNEL_PROBE).split()
        terminal = (tmp_path / "home" / "make-lab.log").read_text()
    assert spin == DEFAULT_SPIN_COUNT and int(threads) >= 1
    assert "Kernel started" in terminal, terminal[-3000:]
    assert "without encryption" not in terminal and not terminal_warnings(terminal), terminal[-3000:]
