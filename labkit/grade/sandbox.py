"""Each notebook's kernel in a sandbox of its own: what it sees, what it may use, how it starts.

Three kinds, tried in this order by ``detect("auto")`` (each one for real, by starting a probe
in it that imports labkit and checks the walls; the first that passes is used for the class):

``bwrap``
    Debian's bubblewrap: new user, PID, network, IPC, UTS and cgroup namespaces; a root made of
    read-only binds; ``--die-with-parent``; ``--new-session`` (no terminal to inject keys into).
``unshare``
    util-linux's ``unshare`` for the same namespaces, and ``jail.py`` (run inside it, before
    any student code) to build the same root and drop every capability.
``none``
    no sandbox: the kernel runs as the grader's user in a scratch folder. Said loudly, and in
    the gradebook's ``sandbox`` column.

What a sandboxed kernel sees (``Plan``): the system (``/usr``, ``/etc``, ...), Python and its
packages, labkit's own two package folders, the model cache, all read-only; nothing of the
checkout beyond the package (no ``solutions/``, no ``.git``), no other submission, no other
kernel's files, not the grader's home; a home folder and ``/tmp`` of its own, in memory and
size-capped; its own ``/proc`` (only its own processes) and a minimal ``/dev``; no network but
loopback; its connection folder (the Jupyter sockets) read-write; a ``/proc/meminfo`` that
shows its memory limit as the machine's memory. Its environment is an allowlist (no API key of
the instructor's reaches it).

Where the grader runs as root, each parallel job's kernels run as their own unprivileged uid
(``UID_BASE + job``): files the host protects from users stay protected, and the per-user
process limit is per job. Limits (``Limits``) are rlimits set before the sandbox starts
(memory per process, file size, processes) plus what ``guard.py`` watches from outside
(memory of the whole sandbox, output, wall time).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("bwrap", "unshare", "none")
HOME = "/home/student"
WORK = HOME + "/notebook"          # the kernel's working folder (a notebook may empty it: its home stays)
INSIDE_UID = 1000
UID_BASE = 1_900_000_000            # far from any real account; one uid per parallel job
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: Variables a kernel may inherit from the grader (prefixes end in "_"); everything else is
#: dropped: an instructor's API keys or tokens never reach a student's code.
KEPT_ENV = ("PATH", "LANG", "LANGUAGE", "TZ", "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_",
            "NUMBA_", "TRITON_", "PYTHONHASHSEED", "PYDEVD_DISABLE_FILE_VALIDATION", "CUDA_VISIBLE_DEVICES",
            "LABKIT_GOMP_SPINCOUNT", "LABKIT_CPU_EXTENSION")
EXTENSION_INSIDE = "/opt/labkit-extension"     # the prebuilt C++ kernels, copied into HOME at start


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-notebook limits. ``memory_mb`` caps each process's data (an rlimit) and the whole
    sandbox's resident memory (watched); ``output_mb`` what its cells print; ``scratch_mb`` its
    home folder and ``/tmp`` (each); ``processes`` its processes and threads; ``wall_s`` the
    whole notebook (each cell has the grader's ``--timeout`` on top)."""
    memory_mb: int = 4096
    output_mb: int = 16
    scratch_mb: int = 1024
    processes: int = 512
    wall_s: float = 3600.0

    def __post_init__(self):
        for name in ("memory_mb", "output_mb", "scratch_mb", "processes", "wall_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Plan:
    """What a sandbox shows of this machine: host paths bound read-only at the same place,
    symlinks of the root (``/bin -> usr/bin``), paths inside those that are hidden, and the
    prebuilt C++ extension to copy in (or None)."""
    readonly: tuple[str, ...]
    symlinks: tuple[tuple[str, str], ...] = ()
    masked: tuple[str, ...] = ()
    extension: str | None = None
    env: dict[str, str] = field(default_factory=dict)


def _inside(path: str, tree: str) -> bool:
    return path == tree or path.startswith(tree.rstrip("/") + "/")


def _python_paths(checkout: Path | None) -> list[str]:
    """Where this Python and its packages live, and labkit's own package folders (an editable
    install maps them to the checkout). Not shown: the current folder (``python -m`` puts it on
    ``sys.path``), and nothing else of ``checkout`` (its tests, say, when pytest runs)."""
    import labkit
    import labkit.kernels
    prefixes = [os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)]
    cwd, tree = os.path.realpath(os.getcwd()), os.path.realpath(checkout) if checkout else None
    paths = [*prefixes, os.path.dirname(os.path.realpath(sys.executable))]
    for entry in (os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)):
        if any(_inside(entry, p) for p in prefixes) or (entry != cwd and not (tree and _inside(entry, tree))):
            paths.append(entry)
    return paths + list(labkit.__path__) + list(labkit.kernels.__path__)


def make_plan(hidden: list[Path], extension: str | None = None, checkout: Path | None = None) -> Plan:
    """The plan for this machine. ``hidden``: what no kernel may see even where a bound tree
    holds it (the checkout's ``solutions/`` and ``.git``, the submissions, the grading folder);
    ``checkout``: the labkit checkout, of which only the package is shown."""
    from ..model.loader import cache_root
    readonly: list[str] = []
    symlinks: list[tuple[str, str]] = []
    for path in SYSTEM:
        if os.path.islink(path):
            symlinks.append((os.readlink(path), path))
        elif os.path.isdir(path):
            readonly.append(path)
    env = {}
    cache = cache_root()
    extra = _python_paths(checkout)
    if cache.is_dir():
        extra.append(str(cache))
        env["LABKIT_CACHE_DIR"] = str(cache.resolve())
    hf = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    if hf.is_dir():
        extra.append(str(hf))
        env["HF_HOME"] = str(hf.resolve())
    for path in map(os.path.realpath, extra):
        if not any(_inside(path, r) for r in readonly):
            readonly = [r for r in readonly if not _inside(r, path)] + [path]
    masked = {str(h) for h in map(os.path.realpath, map(str, hidden)) if any(_inside(h, r) for r in readonly)}
    masked |= set(_private("/etc"))
    return Plan(tuple(sorted(readonly)), tuple(symlinks), tuple(sorted(masked)), extension, env)


def _private(tree: str) -> list[str]:
    """Files and folders under ``tree`` that other users may not read (``/etc/shadow``, private
    keys): hidden in the sandbox, whose uid may be root's outside."""
    hidden = []
    for folder, dirs, files in os.walk(tree):
        for name in list(dirs):
            path = os.path.join(folder, name)
            if not os.path.islink(path) and os.stat(path).st_mode & 0o005 != 0o005:
                hidden.append(path)
                dirs.remove(name)
        hidden += [os.path.join(folder, f) for f in files if not os.path.islink(os.path.join(folder, f))
                   and os.stat(os.path.join(folder, f)).st_mode & 0o004 == 0]
    return hidden


def kernel_env(plan: Plan, extra: dict[str, str] | None = None, home: str = HOME) -> dict[str, str]:
    """The environment a kernel starts with: the allowlisted part of this one, then the
    sandbox's own (home, caches, offline), then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if any(k == p or (p.endswith("_") and k.startswith(p)) for p in KEPT_ENV)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(HOME=home, USER="student", LOGNAME="student", TMPDIR="/tmp" if home == HOME else home,
               XDG_CACHE_HOME=f"{home}/.cache", MPLCONFIGDIR=f"{home}/.cache/matplotlib",
               TORCH_EXTENSIONS_DIR=f"{home}/.cache/torch_extensions",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(plan.env)
    env.update(extra or {})
    return env


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A way to start a kernel: ``kind`` (one of ``KINDS``) and what ``detect`` learnt."""
    kind: str
    plan: Plan
    limits: Limits = Limits()
    drop_uid: bool = False          # run as UID_BASE + job (only when the grader is root)
    detail: str = ""                # e.g. "bubblewrap 0.8.0, as uid 1900000000"

    def uid(self, job: int) -> int | None:
        return UID_BASE + job if self.drop_uid else None

    def command(self, argv: list[str], workdir: Path, env: dict[str, str], job: int = 0) -> list[str]:
        """The command that starts ``argv`` (the kernel) in this sandbox. ``workdir`` is the
        notebook's scratch folder on the host (its ``conn/`` holds the Jupyter sockets)."""
        conn = str(workdir / "conn")
        if self.kind == "none":
            return (self._outer(job) if shutil.which("setpriv") else []) + self._limited(argv, job)
        argv = self._with_extension(argv)
        if self.kind == "bwrap":
            body = self._bwrap(argv, conn, env)
        else:
            body = self._unshare(argv, workdir, conn, env, job)
        return self._outer(job) + self._limited(body, job)

    # ---- the pieces -------------------------------------------------------------------------
    def _outer(self, job: int) -> list[str]:
        """setpriv: the sandbox dies with the grader, and runs as its job's uid when dropped."""
        cmd = [_tool("setpriv"), "--pdeathsig", "KILL"]
        uid = self.uid(job)
        if uid is not None:
            cmd += ["--reuid", str(uid), "--regid", str(uid), "--clear-groups"]
        return cmd + ["--"]

    def _limited(self, argv: list[str], job: int) -> list[str]:
        prlimit = shutil.which("prlimit")
        if prlimit is None:
            return argv
        limits = [f"--data={self.limits.memory_mb << 20}", f"--fsize={self.limits.scratch_mb << 20}",
                  "--core=0"]
        if self.uid(job) is not None:                # the count is per uid: only meaningful for our own
            limits.append(f"--nproc={self.limits.processes}")
        return [prlimit, *limits, "--", *argv]

    def _with_extension(self, argv: list[str]) -> list[str]:
        """Copy the prebuilt C++ kernels into the kernel's cache first (torch's extension loader
        wants to write beside them; a read-only copy would be rebuilt, for half a minute)."""
        if self.plan.extension is None or self.kind == "none":
            return argv
        script = 'mkdir -p "$TORCH_EXTENSIONS_DIR" && cp -a "$1" "$TORCH_EXTENSIONS_DIR"/ 2>/dev/null; shift; exec "$@"'
        return ["/bin/sh", "-c", script, "sh", self._extension_inside(), *argv]

    def _extension_inside(self) -> str:
        """Where the build folder is shown: under its own name, which torch's loader looks for."""
        return f"{EXTENSION_INSIDE}/{os.path.basename(self.plan.extension)}"

    def _bwrap(self, argv: list[str], conn: str, env: dict[str, str]) -> list[str]:
        cmd = [_tool("bwrap"), "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
               "--disable-userns", "--uid", str(INSIDE_UID), "--gid", str(INSIDE_UID),
               "--hostname", "sandbox", "--clearenv"]
        for key, value in env.items():
            cmd += ["--setenv", key, value]
        for path in self.plan.readonly:
            cmd += ["--ro-bind", path, path]
        for target, link in self.plan.symlinks:
            cmd += ["--symlink", target, link]
        for path in self.plan.masked:
            cmd += ["--tmpfs", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
        if self.plan.extension:
            cmd += ["--ro-bind", self.plan.extension, self._extension_inside()]
        size = str(self.limits.scratch_mb << 20)
        cmd += ["--proc", "/proc", "--ro-bind", str(Path(conn).parent / "meminfo"), "/proc/meminfo",
                "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                "--size", size, "--tmpfs", HOME, "--dir", WORK, "--size", size, "--tmpfs", "/dev/shm",
                "--bind", conn, conn, "--chdir", WORK, "--"]
        return cmd + argv

    def _unshare(self, argv: list[str], workdir: Path, conn: str, env: dict[str, str], job: int) -> list[str]:
        spec = {"root": str(workdir / "root"), "readonly": list(self.plan.readonly),
                "symlinks": [list(s) for s in self.plan.symlinks], "masked": list(self.plan.masked),
                "tmpfs": [["/tmp", self.limits.scratch_mb, "1777"], [HOME, self.limits.scratch_mb, "0755"]],
                "writable": [conn], "shm_mb": self.limits.scratch_mb, "cwd": WORK, "env": env,
                "meminfo": str(workdir / "meminfo"),
                "readonly_at": [[self.plan.extension, self._extension_inside()]] if self.plan.extension else []}
        (workdir / "root").mkdir(exist_ok=True)
        path = workdir / "jail.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        if self.uid(job) is not None:
            os.chown(path, self.uid(job), self.uid(job))
        jail = str(Path(__file__).with_name("jail.py"))
        return [_tool("unshare"), "--user", "--map-root-user", "--mount", "--pid", "--net", "--ipc", "--uts",
                "--fork", "--kill-child", "--", sys.executable, "-I", jail, str(path), "--", *argv]

    def prepare(self, workdir: Path, job: int = 0) -> None:
        """Make ``workdir`` usable by the job's uid (its connection folder its own), and write the
        ``/proc/meminfo`` the sandbox shows: the machine's, with its memory no larger than the
        limit (the engine sizes its KV cache from what is free: a sandbox must size it from its own)."""
        (workdir / "conn").mkdir(mode=0o700, exist_ok=True)
        (workdir / "meminfo").write_text(meminfo(self.limits.memory_mb), encoding="ascii")
        uid = self.uid(job)
        if uid is not None:
            os.chmod(workdir, 0o711)
            os.chown(workdir / "conn", uid, uid)


def meminfo(limit_mb: int, text: str | None = None) -> str:
    """``/proc/meminfo`` (``text``, else this machine's) with its total, free and available memory
    each at most ``limit_mb``."""
    if text is None:
        try:
            text = Path("/proc/meminfo").read_text(encoding="ascii")
        except OSError:
            text = ""
    lines = []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemFree", "MemAvailable") and value.split():
            line = f"{key}:{min(int(value.split()[0]), limit_mb * 1024):>16} kB"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise FileNotFoundError(f"{name} not found")
    return path


# ---- finding out what works here ------------------------------------------------------------------
#: Run inside a candidate sandbox: exits 0 and prints "ok" only if labkit imports and the walls hold.
PROBE = r"""
import errno, json, os, socket, sys
forbidden, readonly, grader = json.loads(sys.argv[1])
import labkit, ipykernel                       # the kernel's own imports must work
problems = []
home = os.environ["HOME"]
open(os.path.join(home, "probe"), "w").write("x")                      # a home of its own
try:
    open(os.path.join(readonly, "labkit-probe"), "w").write("x")
    problems.append(f"{readonly} is writable")
except OSError as e:
    if e.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        raise
for path in forbidden:
    if os.path.exists(path) and os.listdir(path):
        problems.append(f"{path} is visible")
pids = [p for p in os.listdir("/proc") if p.isdigit()]
if str(grader) in pids or len(pids) > 20:
    problems.append(f"{len(pids)} processes visible: not a PID namespace of its own")
try:
    socket.create_connection(("1.1.1.1", 53), timeout=2).close()
    problems.append("the network is reachable")
except OSError:
    pass
print("; ".join(problems) or "ok")
"""


def _probe(box: Sandbox, forbidden: list[str], readonly: str, timeout: float = 120) -> str:
    """'ok' when a kernel-like process starts in ``box`` and finds the walls in place, else why not."""
    workdir = Path(tempfile.mkdtemp(prefix="labkit-probe-"))
    try:
        box.prepare(workdir)
        env = kernel_env(box.plan) if box.kind != "none" else kernel_env(box.plan, home=str(workdir))
        argv = [sys.executable, "-c", PROBE, json.dumps([forbidden, readonly, os.getpid()])]
        cmd = box.command(argv, workdir, env)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir,
                              env=env if box.kind == "none" else None, start_new_session=True)
        lines = (done.stdout.strip() or done.stderr.strip() or f"exit status {done.returncode}").splitlines()
        return lines[-1] if done.returncode == 0 else f"exit status {done.returncode}: {lines[-1][:200]}"
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _version(kind: str) -> str:
    try:
        tool = "bwrap" if kind == "bwrap" else "unshare"
        out = subprocess.run([tool, "--version"], capture_output=True, text=True, timeout=10).stdout
        return out.strip().splitlines()[0] if out.strip() else tool
    except (OSError, subprocess.SubprocessError):
        return kind


def detect(wanted: str = "auto", *, plan: Plan, limits: Limits, forbidden: list[str],
           readonly: str) -> tuple[Sandbox, list[str]]:
    """The sandbox to grade with, and what was tried (one line per candidate that failed).
    ``wanted``: "auto" or one of ``KINDS``; a kind asked for by name that does not work here
    raises ``RuntimeError`` with the reason. ``forbidden``: paths a sandbox must not show;
    ``readonly``: a path it must show read-only (labkit's package)."""
    if wanted not in ("auto", *KINDS):
        raise ValueError(f"sandbox must be auto or one of {', '.join(KINDS)}, got {wanted!r}")
    kinds = [k for k in KINDS if wanted in ("auto", k) and k != "none"]
    tried = []
    root = hasattr(os, "geteuid") and os.geteuid() == 0
    for kind in kinds:
        if sys.platform != "linux" or shutil.which("setpriv") is None or \
                shutil.which("bwrap" if kind == "bwrap" else "unshare") is None:
            tried.append(f"{kind}: {'not Linux' if sys.platform != 'linux' else 'not installed'}")
            continue
        for drop in ((True, False) if root else (False,)):
            box = Sandbox(kind, plan, limits, drop)
            said = _probe(box, forbidden, readonly)
            who = f"as uid {UID_BASE}+job" if drop else ("as root (mapped)" if root else "as this user")
            if said == "ok":
                return Sandbox(kind, plan, limits, drop, f"{_version(kind)}, {who}"), tried
            tried.append(f"{kind} {who}: {said}")
    if wanted not in ("auto", "none"):
        raise RuntimeError(f"the {wanted} sandbox does not work here: " + "; ".join(tried))
    return Sandbox("none", plan, limits, False, "no sandbox: " + ("; ".join(tried) or "asked for")), tried
