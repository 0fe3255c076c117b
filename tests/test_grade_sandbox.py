"""The sandbox each submitted notebook is graded in, attacked directly (a plain process in it,
no Jupyter kernel): in every kind this machine offers (bubblewrap, ``unshare`` with
``labkit/grade/jail.py``), the walls of docs/grading.md hold; the guard stops what adds up over
a sandbox's processes; where no sandbox works, the fallback says so.

A kind this machine cannot run is skipped with the reason (``detect`` tries it for real).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import labkit
from labkit.grade import sandbox as sb
from labkit.grade.guard import Guard
from labkit.grade.sandbox import Limits, Plan, Sandbox, detect, kernel_env, make_plan

pytestmark = pytest.mark.slow         # each kind is tried for real first (a few seconds each)

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(labkit.__path__[0])
LIMITS = Limits(memory_mb=512, scratch_mb=16, processes=64, output_mb=1, wall_s=600)
SECRET = "LABKIT-HOSTILE-instructor-secret"


@pytest.fixture(scope="module")
def hidden(tmp_path_factory) -> Path:
    """A folder of "other students' submissions": no sandbox may show it."""
    folder = tmp_path_factory.mktemp("submissions")
    (folder / "alice").mkdir()
    (folder / "alice" / "02_paging.ipynb").write_text("{}")
    return folder


@pytest.fixture(scope="module")
def plan(hidden):
    return make_plan([ROOT / "solutions", ROOT / ".git", hidden], checkout=ROOT)


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def box(request, plan, hidden) -> Sandbox:
    try:
        found, _ = detect(request.param, plan=plan, limits=LIMITS, forbidden=[str(ROOT / "solutions"), str(hidden)],
                          readonly=str(PACKAGE))
    except RuntimeError as e:
        pytest.skip(f"the {request.param} sandbox does not work on this machine: {e}")
    return found


def run(box: Sandbox, code: str, tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -c code`` in ``box``, with a secret in this process's environment."""
    workdir = tmp_path / "work"
    workdir.mkdir(exist_ok=True)
    box.prepare(workdir)
    os.environ["INSTRUCTOR_TOKEN"] = SECRET
    try:
        cmd = box.command([sys.executable, "-c", code], workdir, kernel_env(box.plan))
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir,
                              start_new_session=True)
    finally:
        del os.environ["INSTRUCTOR_TOKEN"]


def test_the_installation_is_read_only_and_the_rest_is_out_of_sight(box, tmp_path, hidden):
    code = f"""
import errno, os, labkit.exercises.memory
for target in ({str(PACKAGE / "exercises" / "memory.py")!r}, {str(PACKAGE / "PWNED")!r}):
    try:
        open(target, "a").write("LABKIT-HOSTILE")
        print("WROTE", target)
    except OSError as e:
        assert e.errno in (errno.EROFS, errno.EACCES, errno.EPERM), e
for path in ({str(ROOT / "solutions")!r}, {str(ROOT / ".git")!r}, {str(ROOT / "notebooks")!r}, {str(hidden)!r},
             {str(Path.home())!r} + "/.ssh"):
    if os.path.exists(path) and os.listdir(path):
        print("SEES", path)
print(sorted(os.listdir({str(ROOT)!r})))
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "WROTE" not in done.stdout and "SEES" not in done.stdout, done.stdout
    shown = set(eval(done.stdout.strip().splitlines()[-1]))       # the package (and what sys.path names), no more
    assert {"labkit", "kernels"} <= shown <= {"labkit", "kernels", ".venv"}, shown   # (.venv: where Python is)


def test_no_secret_no_network_no_root_files(box, tmp_path):
    code = f"""
import os, socket
print("ENV", any({SECRET!r} in v for v in os.environ.values()))
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2)
    print("NET yes")
except OSError:
    print("NET no")
try:
    print("SHADOW", len(open("/etc/shadow").read()))
except OSError:
    print("SHADOW unreadable")
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "ENV False" in done.stdout and "NET no" in done.stdout, done.stdout
    assert "SHADOW 0" in done.stdout or "SHADOW unreadable" in done.stdout, done.stdout


def test_it_sees_and_signals_only_its_own_processes(box, tmp_path):
    grader = hashlib.sha256(Path("/proc/self/cmdline").read_bytes()).hexdigest()   # how this process shows
    code = f"""
import hashlib, os, signal
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
seen = [hashlib.sha256(open(f"/proc/{{p}}/cmdline", "rb").read()).hexdigest() for p in pids]
print("PIDS", len(pids), {grader!r} in seen)
try:
    os.kill({os.getpid()}, 0)
    print("REACHES", {os.getpid()} in pids)
except ProcessLookupError:
    print("REACHES no")
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0, done.stderr
    count, sees_pytest = done.stdout.split("PIDS ")[1].split()[:2]
    assert int(count) <= 3 and sees_pytest == "False", done.stdout
    assert "REACHES no" in done.stdout or "REACHES True" in done.stdout   # a pid of its own namespace at most


def test_its_processes_die_with_it(box, tmp_path):
    marker = "987.654321"                                     # a sleep nobody else runs
    code = f"""
import subprocess
subprocess.Popen(["setsid", "sleep", "{marker}"], start_new_session=True)
subprocess.Popen("nohup sleep {marker} &", shell=True)
print("left")
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0 and "left" in done.stdout, done.stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _running(marker):
        time.sleep(0.1)
    assert not _running(marker), "a process of the sandbox outlived it"


def _running(marker: str) -> bool:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                return True
        except OSError:
            pass
    return False


def test_it_cannot_get_write_access_back(box, tmp_path):
    code = f"""
import subprocess
for cmd in (["mount", "-o", "remount,rw,bind", {str(PACKAGE)!r}],
            ["unshare", "-Urm", "sh", "-c", "mount -o remount,rw,bind {PACKAGE} && touch {PACKAGE}/PWNED"],
            ["umount", "-l", {str(PACKAGE)!r}]):
    subprocess.run(cmd, capture_output=True)
try:
    open({str(PACKAGE / "PWNED")!r}, "w").write("LABKIT-HOSTILE")
    print("WRITABLE")
except OSError:
    print("still read-only")
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "still read-only" in done.stdout and not (PACKAGE / "PWNED").exists(), done.stdout


def test_scratch_space_and_memory_are_capped(box, tmp_path):
    code = """
import errno, os
print("MEMINFO", open("/proc/meminfo").read().split("MemAvailable:")[1].split()[0])
written = 0
try:
    with open(os.path.join(os.environ["HOME"], "fill"), "wb") as f:
        for _ in range(64):
            f.write(b"x" * (1 << 20))
            f.flush()
            written += 1
except OSError as e:
    print("FULL", e.errno in (errno.ENOSPC, errno.EFBIG), written)
try:
    blob = b"x" * (1 << 30)
    print("ALLOCATED")
except MemoryError:
    print("NO MEMORY")
"""
    done = run(box, code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "FULL True" in done.stdout and int(done.stdout.split("FULL True ")[1].split()[0]) <= LIMITS.scratch_mb
    assert "NO MEMORY" in done.stdout, done.stdout
    assert f"MEMINFO {LIMITS.memory_mb * 1024}" in done.stdout, done.stdout   # what the engine sizes its cache by


# ---- the guard: what adds up over a sandbox's processes --------------------------------------------
GREEDY = {
    "memory": "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n        blob = b'x' * (220 << 20)\n"
              "        time.sleep(60)\nblob = b'x' * (100 << 20)\ntime.sleep(60)",
    "processes": "import threading, time\nthreading.stack_size(1 << 16)\nfor _ in range(200):\n"
                 "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)",
    "connection folder": "import os\nopen(os.environ['CONN'] + '/junk', 'wb').write(b'LABKIT-HOSTILE' * 200_000)\n"
                         "import time\ntime.sleep(60)",
    "limit": "import time\ntime.sleep(60)",
}


@pytest.mark.parametrize("what", list(GREEDY))
def test_the_guard_stops_a_sandbox_that_goes_over_a_limit(box, tmp_path, what):
    workdir = tmp_path / "work"
    workdir.mkdir()
    box.prepare(workdir)
    limits = Limits(memory_mb=512, processes=64, wall_s=3 if what == "limit" else 600)
    env = kernel_env(box.plan, {"CONN": str(workdir / "conn")})
    cmd = Sandbox(box.kind, box.plan, Limits(memory_mb=1024), box.drop_uid).command(
        [sys.executable, "-c", GREEDY[what]], workdir, env)
    guard = Guard(period=0.1)
    started = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=workdir, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    watch = guard.watch(proc.pid, limits, workdir / "conn")
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        guard.close()
    assert watch.reason and what in watch.reason, watch.reason
    assert time.monotonic() - started < 25


# ---- no sandbox here -----------------------------------------------------------------------------------
def test_without_bwrap_or_unshare_grading_falls_back_to_none_and_says_why(monkeypatch, plan):
    which = shutil.which
    monkeypatch.setattr(sb.shutil, "which", lambda name: None if name in ("bwrap", "unshare") else which(name))
    box, tried = detect("auto", plan=plan, limits=LIMITS, forbidden=[], readonly=str(PACKAGE))
    assert box.kind == "none" and tried == ["bwrap: not installed", "unshare: not installed"]
    assert "no sandbox" in box.detail
    with pytest.raises(RuntimeError, match="the bwrap sandbox does not work here: bwrap: not installed"):
        detect("bwrap", plan=plan, limits=LIMITS, forbidden=[], readonly=str(PACKAGE))
    with pytest.raises(ValueError, match="sandbox must be"):
        detect("docker", plan=plan, limits=LIMITS, forbidden=[], readonly=str(PACKAGE))


def test_the_plan_shows_no_secret_of_this_machine(plan, hidden):
    assert str(ROOT / "solutions") not in plan.readonly and str(hidden) not in plan.readonly
    assert not any(str(ROOT) == p for p in plan.readonly), "the whole checkout is bound"
    assert "/etc/shadow" in plan.masked or not os.path.exists("/etc/shadow")
    env = kernel_env(plan, {"X": "1"})
    assert env["HOME"] == sb.HOME and env["HF_HUB_OFFLINE"] == "1" and "INSTRUCTOR_TOKEN" not in env


@pytest.mark.notebook
def test_a_class_graded_without_a_sandbox_says_so_everywhere(tmp_path, capsys):
    """``--sandbox none`` (what ``auto`` falls back to where nothing works): graded all the same,
    with a warning on the terminal, in the summary, and in every row's ``sandbox`` column."""
    import csv

    import nbformat

    from labkit.grade.__main__ import main
    from labkit.notebooks import read
    nb = read(ROOT / "solutions" / "02_paging.ipynb")
    nb.cells = [c for c in nb.cells if c.cell_type == "code" and ("SOLUTION" in c.source or "CHECK" in c.source
                                                                   or "from labkit" in c.source)]
    (tmp_path / "subs" / "alice").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "subs" / "alice" / "02_paging.ipynb")
    out = tmp_path / "grades.csv"
    assert main([str(tmp_path / "subs"), "--out", str(out), "--sandbox", "none", "--jobs", "1",
                 "--root", str(ROOT)]) == 0
    said = capsys.readouterr()
    assert "WARNING: NO SANDBOX" in said.err and "WARNING: NO SANDBOX" in said.out
    (row,) = list(csv.DictReader(out.open()))
    assert (row["student"], row["points"], row["sandbox"]) == ("alice", "10", "none")


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="only a grader running as root drops uids")
@pytest.mark.parametrize("kind", ["bwrap", "unshare"])
def test_a_grader_running_as_root_runs_each_job_as_its_own_uid(kind, request):
    """As root, job k's sandboxes run as uid 1900000000 + k: its connection folder is its own
    (and reachable through the class's folder), other jobs' folders are out of sight. (A plan of
    the system alone: this machine's Python may sit where no other uid can read it.)"""
    plan = Plan(tuple(p for p in ("/usr", "/etc") if os.path.isdir(p)),
                tuple((os.readlink(p), p) for p in ("/bin", "/sbin", "/lib", "/lib64") if os.path.islink(p)))
    box = Sandbox(kind, plan, LIMITS, drop_uid=True)
    if shutil.which(kind) is None or shutil.which("setpriv") is None:
        pytest.skip(f"{kind} or setpriv not installed")
    if kind == "unshare" and not _reachable_by_anyone(sys.executable):
        pytest.skip(f"the jail runs {sys.executable}, which other users cannot reach here")
    room = Path(tempfile.mkdtemp(prefix="labkit-uid-test-"))  # in /tmp, as grade_class's own folder
    os.chmod(room, 0o711)                                     # as grade_class does
    request.addfinalizer(lambda: shutil.rmtree(room, ignore_errors=True))
    mine, other = room / "1-mine", room / "0-other"
    for folder, job in ((mine, 1), (other, 0)):
        folder.mkdir()
        box.prepare(folder, job)
    probe = (f'id -u; touch "{mine}/conn/ok" && echo WROTE; ls "{room}" 2>&1 | head -1; '
             f'ls "{other}/conn" >/dev/null 2>&1 && echo SEES-OTHER; head -1 /proc/meminfo')
    env = {"PATH": "/usr/bin:/bin", "HOME": sb.HOME}
    try:
        cmd = box.command(["/bin/sh", "-c", probe], mine, env, job=1)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=mine)
    except OSError as e:
        pytest.skip(f"{kind} cannot start as another uid here: {e}")
    if done.returncode != 0 and "Operation not permitted" in done.stderr:
        pytest.skip(f"{kind} cannot start as another uid here: {done.stderr.strip()[:200]}")
    lines = done.stdout.split("\n")
    assert lines[0] in ("1000", "0"), done.stdout + done.stderr        # the uid inside its user namespace
    assert "WROTE" in done.stdout and "SEES-OTHER" not in done.stdout, done.stdout + done.stderr
    assert "0-other" not in done.stdout, done.stdout          # the class's folder shows its own job only
    assert (mine / "conn" / "ok").stat().st_uid == sb.UID_BASE + 1
    assert f"{LIMITS.memory_mb * 1024} kB" in done.stdout


def _reachable_by_anyone(path: str) -> bool:
    """Whether a user with no rights of its own can run ``path`` (every folder above it open)."""
    real = Path(os.path.realpath(path))
    return all(p.stat().st_mode & 0o001 for p in real.parents) and bool(real.stat().st_mode & 0o001)
