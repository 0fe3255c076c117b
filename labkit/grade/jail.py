"""The sandbox where bubblewrap is missing: a minimal ``bwrap`` for ``unshare``, in plain Python.

``sandbox.py`` runs this file as a script (``python -I jail.py SPEC -- KERNEL ARGV``) inside
``unshare --user --map-root-user --mount --pid --net --ipc --uts --fork --kill-child``: it is
pid 1 of a new PID namespace, root of a new user namespace (which is the caller's uid outside,
with no power there), in new mount, network, IPC and UTS namespaces. Before any student code
runs it builds what the kernel will see, the way bubblewrap does:

1. a new root on a small tmpfs, holding read-only binds of the host paths the spec names
   (the system, Python, labkit, the model cache), empty tmpfs over the paths it masks, a
   private ``/proc`` (its ``meminfo`` showing the sandbox's memory limit), a minimal ``/dev``,
   size-capped tmpfs for ``/tmp`` and the home folder, and the one read-write bind of the
   kernel's connection folder;
2. ``pivot_root`` into it, the host's tree detached;
3. loopback up (the lab's own servers listen there), no other interface;
4. every capability dropped for good (empty bounding set, no ambient or inheritable
   capabilities, ``SECBIT_NOROOT`` locked, ``no_new_privs``): the kernel can neither remount
   its binds read-write nor leave its namespaces;
5. the kernel is started as this process's child, in a session of its own; this process
   stays as the namespace's init, reaping orphans, and exits with the kernel. When it exits,
   the kernel (``--kill-child``) and every process left in the namespace are killed.

It imports nothing of labkit's (nothing outside the standard library runs before the kernel)
and is only ever started by the grader, with a spec the grader wrote.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import json
import os
import socket
import struct
import sys

libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = 32, 1024, 2048, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP, PR_SET_SECUREBITS, PR_CAP_AMBIENT = 38, 24, 28, 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
SECBIT_ALL_LOCKED_NOROOT = 0x2F      # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED and their locks
#: (pivot_root, capset) syscall numbers: libc wraps neither everywhere.
SYSCALLS = {"x86_64": (155, 126), "aarch64": (41, 91), "riscv64": (41, 91)}   # elsewhere: bwrap, or none
SYS_PIVOT_ROOT, SYS_CAPSET = SYSCALLS.get(os.uname().machine, (None, None))
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
#: statvfs flags of a bind's source that a remount must keep (the kernel locks them).
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: s.encode() if s is not None else None)
    _check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source or fstype} on {target}")


def _make(path: str, is_dir: bool) -> None:
    """An empty directory or file at ``path`` to mount on."""
    if is_dir:
        os.makedirs(path, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not os.path.exists(path):
            open(path, "w").close()


def bind(source: str, target: str, readonly: bool) -> None:
    """Bind ``source`` on ``target`` (non-recursive: mounts below ``source`` stay out of sight);
    read-only binds are remounted so, keeping the flags the kernel locks on the source."""
    _make(target, os.path.isdir(source))
    mount(source, target, None, MS_BIND)
    if readonly:
        kept = os.statvfs(source).f_flag
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV
        flags |= sum(ms for st, ms in KEPT_FLAGS if kept & st)
        mount(None, target, None, flags)


def tmpfs(target: str, size_mb: int, mode: str) -> None:
    _make(target, True)
    mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size_mb}m,mode={mode}")


def build_root(spec: dict) -> None:
    """Steps 1 and 2 of the module docstring."""
    root = spec["root"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)            # nothing we mount propagates to the host
    tmpfs(root, 16, "0755")
    inside = (lambda path: root + path)
    for path in spec["readonly"]:
        bind(path, inside(path), readonly=True)
    for target, link in spec["symlinks"]:
        os.symlink(target, inside(link))
    for path in spec["masked"]:                             # hidden: an empty folder, or an empty file
        if os.path.isdir(inside(path)):
            tmpfs(inside(path), 1, "0755")
        elif os.path.exists(inside(path)):
            bind("/dev/null", inside(path), readonly=True)
    for path, size_mb, mode in spec["tmpfs"]:
        tmpfs(inside(path), size_mb, mode)
    os.makedirs(inside(spec["cwd"]), exist_ok=True)
    for path in spec["writable"]:
        bind(path, inside(path), readonly=False)
    for source, target in spec.get("readonly_at", []):
        bind(source, inside(target), readonly=True)
    os.makedirs(inside("/dev"), exist_ok=True)
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            bind(f"/dev/{name}", inside(f"/dev/{name}"), readonly=False)
    tmpfs(inside("/dev/shm"), spec["shm_mb"], "1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, inside(f"/dev/{name}"))
    os.makedirs(inside("/proc"), exist_ok=True)
    mount("proc", inside("/proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if spec.get("meminfo"):
        bind(spec["meminfo"], inside("/proc/meminfo"), readonly=True)
    mount(None, root, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)   # the skeleton itself
    os.chdir(root)
    # pivot_root(".", "."): the host's root ends up stacked on the new one, and is detached
    # from there (pivot_root(2), "NOTES"): no directory for it needed in the read-only skeleton.
    _check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the host's tree")
    os.chdir("/")


def loopback_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def drop_privileges() -> None:
    """Step 4: no capability left, none to be regained by exec."""
    _check(libc.prctl(PR_SET_SECUREBITS, SECBIT_ALL_LOCKED_NOROOT, 0, 0, 0), "lock securebits")
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:
        cap += 1
    if ctypes.get_errno() != errno.EINVAL:                 # EINVAL: past the last capability
        raise OSError(ctypes.get_errno(), f"drop capability {cap} from the bounding set")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = struct.pack("II", 0x20080522, 0)              # _LINUX_CAPABILITY_VERSION_3, this process
    data = ctypes.create_string_buffer(24)                 # two all-zero __user_cap_data_struct
    _check(libc.syscall(SYS_CAPSET, ctypes.c_char_p(header), data), "capset")
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")


def run(argv: list[str], spec: dict) -> int:
    """Step 5: the kernel as a child in its own session; this process reaps until it exits."""
    child = os.fork()
    if child == 0:
        try:
            os.setsid()
            os.chdir(spec["cwd"])
            os.execve(argv[0], argv, spec["env"])
        finally:
            os._exit(127)
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if pid == child:
            return os.waitstatus_to_exitcode(status) & 0xFF


def main(args: list[str]) -> int:
    if len(args) < 3 or args[1] != "--":
        print("usage: jail.py SPEC.json -- ARGV...", file=sys.stderr)
        return 2
    if SYS_PIVOT_ROOT is None:
        print(f"labkit sandbox (unshare): no syscall table for {os.uname().machine}", file=sys.stderr)
        return 125
    with open(args[0], encoding="utf-8") as f:
        spec = json.load(f)
    try:
        build_root(spec)
        loopback_up()
        drop_privileges()
    except OSError as e:
        print(f"labkit sandbox (unshare): {e}", file=sys.stderr)
        return 125
    return run(args[2:], spec)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
