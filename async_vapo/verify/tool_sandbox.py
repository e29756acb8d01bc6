"""Run model-written Python in a fresh, isolated, resource-limited process: one process tree per call.

Model-written code is hostile input. The verifier's pool (:mod:`async_vapo.verify.sandbox`) grades answers in
persistent workers; a tool call never goes there. ``run_python(code)`` starts a new sandbox for each call, feeds
the code to ``python3 -I -S -`` on its stdin, collects stdout and stderr (each kept up to ``output_bytes``) and
returns a :class:`ToolResult`. A hang, a crash, a limit or a sandbox that fails to start is a result (``status``),
never an exception: ``run_python`` raises only :class:`ToolSandboxUnavailable` (this host cannot sandbox at all:
not root, bubblewrap missing) and ``ValueError`` for a bad argument.

What holds, for both backends (the attack tests in tests/integration/test_tool_sandbox.py check each):
- **Its own uid.** The caller must be root: each call leases a uid from the verifier's range
  (``sandbox._lease_uids``, an exclusive lock per uid, shared with the verifier's pools) and the tool runs under
  it with no supplementary groups, no capabilities and ``PR_SET_NO_NEW_PRIVS``. It can neither read the service's
  files (its CURVE keys are 0600) nor signal the service's processes.
- **Its own file system view** (a mount namespace): a read-only ``/usr`` and ``/bin``, ``/sbin``, ``/lib*``
  (symlinks where the host has symlinks, as on a merged-/usr system), the interpreter's prefix if elsewhere, a
  minimal ``/dev`` (null, zero, full, random, urandom), a ``/proc`` of its own pid namespace, and a writable
  ``/scratch`` (cwd, HOME, TMPDIR): a tmpfs of ``scratch_bytes``, gone with the call. ``/tmp``, ``/dev/shm``,
  ``/etc``, ``/root``, ``/home``, the repository and every run directory are absent; the root is read-only.
- **No network**: a network namespace of its own (no route anywhere; bubblewrap brings its loopback up, ours
  leaves it down: either way only the sandbox's own sockets are reachable).
- **Its own pid, IPC and UTS namespaces**: it sees and can signal only its own processes; when its first
  process ends, the kernel kills the rest (pid namespace teardown), so nothing outlives the call.
- **Limits** (:class:`ToolLimits`): wall seconds (the caller kills the whole tree), CPU seconds (RLIMIT_CPU per
  process), memory (RLIMIT_AS per process), processes (RLIMIT_NPROC of the leased uid, the sandbox's own helper
  processes included: ours 1, bubblewrap's 1), file size (RLIMIT_FSIZE), open files (64), no core dumps, scratch
  size, code size and output bytes. Output beyond ``output_bytes`` per stream is read and dropped; past
  ``drain_bytes`` in all the process is killed (``status="output_limit"``).
- **Nothing left for the next call**: a new process tree, new namespaces, a new tmpfs, and a clean environment
  (``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` only); after a kill every process of the uid is killed again.

Backends (``backend=``; results in docs/guides/security.md, ``benchmarks/tool_sandbox.py``):
- ``"own"``: ``python -I -S -c`` of :func:`_launch` as root: ``unshare`` of the mount, pid, network, IPC and UTS
  namespaces, a fork that becomes the namespace's pid 1, which builds the root from bind mounts, ``pivot_root``s
  into it, forks the tool process (limits from ``sandbox._apply_limits``, privileges dropped by
  ``sandbox._drop_privileges``, then ``execve`` of the interpreter), drops its own privileges, makes itself
  non-dumpable (the tool cannot ptrace it) and reaps until the tool process ends, then reports its wait status on
  a pipe the tool does not hold.
- ``"bwrap"``: Debian's bubblewrap, started as the leased uid through ``prlimit`` (limits set before it runs), in
  its unprivileged mode (a user namespace mapping the uid to itself, ``--disable-userns`` so the tool makes no
  further one), ``--unshare-pid/net/ipc/uts/cgroup-try``, ``--die-with-parent``, ``--new-session``,
  ``--clearenv``. It reports the child's status on ``--json-status-fd``; a death by signal comes back as exit code
  128 + signal, read as that signal. ``--as-pid-1``: the tool itself is its namespace's pid 1, because
  bubblewrap's own pid 1 is left a zombie of the host's init when the call ends (its monitor exits on the exit
  code without reaping it), and where the host's init does not reap (this project's VMs) the zombies count against
  the uid's RLIMIT_NPROC until a call cannot start (measured: the 7th call on a uid with ``max_processes=8``). As
  pid 1 the tool ignores signals it sends itself without a handler, SIGXCPU included: the CPU limit ends it with
  the hard limit's SIGKILL one second later, read as "timeout" (nothing else may SIGKILL a pid 1 from inside).
  Running unprivileged, bubblewrap cannot reach an interpreter under a directory the uid may not search (a pyenv
  under a 0700 ``/root``): the tool's interpreter is the system's ``/usr/bin/python3`` for both backends.

Not covered: system calls (no seccomp filter: the kernel's whole syscall surface is reachable, from an
unprivileged uid in its own namespaces), memory summed over processes (RLIMIT_AS is per process: at most
``max_processes * memory_mb``), CPU shares (no cgroup: a tool competes with the service for cores until its
limits end it) and tmpfs inodes under bubblewrap (``--size`` bounds bytes, not files; ours caps both).
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from async_vapo.verify.sandbox import (
    DEFAULT_UID_BASE,
    _apply_limits,
    _drop_privileges,
    _kill_uid,
    _lease_uids,
    _libc,
    _release_uids,
    _uid_range_mapped,
)

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "STATUSES", "ToolLimits", "ToolResult", "ToolSandboxUnavailable", "run_python",
    "unavailable_reason",
]  # fmt: skip

BACKENDS = ("own", "bwrap")
DEFAULT_BACKEND = "bwrap"
STATUSES = ("ok", "error", "killed", "timeout", "output_limit", "too_long", "sandbox_error")
PYTHON = "/usr/bin/python3"
SCRATCH = "/scratch"
_TOOL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": SCRATCH, "TMPDIR": SCRATCH, "LANG": "C.UTF-8"}
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEV_LINKS = (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
              ("stderr", "/proc/self/fd/2"))
log = logging.getLogger(__name__)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_READ_SIZE = 1 << 16
_EXIT_SETUP = 70  # the launcher could not build the sandbox (its reason is on the status pipe)

_CLONE_NEWNS = 0x00020000
_CLONE_NEWUTS = 0x04000000
_CLONE_NEWIPC = 0x08000000
_CLONE_NEWPID = 0x20000000
_CLONE_NEWNET = 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_MNT_DETACH = 2
_PR_SET_DUMPABLE = 4
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}


class ToolSandboxUnavailable(RuntimeError):
    """This host cannot run the tool sandbox at all (not root, bubblewrap or the interpreter missing)."""


@dataclass(frozen=True)
class ToolLimits:
    """What one tool call may use. Process limits are per process (RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE) or per
    uid (RLIMIT_NPROC); the wall clock covers the whole call, start-up included."""

    wall_s: float = 5.0
    cpu_s: int = 3
    memory_mb: int = 256
    max_processes: int = 8
    file_bytes: int = 1 << 20
    scratch_bytes: int = 16 << 20
    scratch_files: int = 1024  # own backend only (tmpfs nr_inodes)
    output_bytes: int = 16 << 10  # kept per stream
    drain_bytes: int = 16 << 20  # read in all before the call is killed
    code_bytes: int = 256 << 10

    def __post_init__(self) -> None:
        if not self.wall_s > 0 or self.cpu_s < 1:
            raise ValueError(f"wall_s must be > 0 and cpu_s >= 1, got {self.wall_s}, {self.cpu_s}")
        if self.memory_mb < 32:
            raise ValueError(f"memory_mb must be >= 32 (the interpreter must start), got {self.memory_mb}")
        if self.max_processes < 3:
            raise ValueError(f"max_processes must be >= 3 (the sandbox's own processes count), got "
                             f"{self.max_processes}")
        if min(self.file_bytes, self.scratch_bytes, self.scratch_files, self.output_bytes, self.code_bytes) < 1:
            raise ValueError("file_bytes, scratch_bytes, scratch_files, output_bytes and code_bytes must be >= 1")
        if self.drain_bytes < 2 * self.output_bytes:
            raise ValueError(f"drain_bytes must be >= 2 * output_bytes, got {self.drain_bytes}")


@dataclass(frozen=True)
class ToolResult:
    """One tool call. ``status``: "ok" (exit 0), "error" (another exit code: an exception, ``MemoryError``
    included), "killed" (a signal), "timeout" (the wall clock or the CPU limit), "output_limit" (more than
    ``drain_bytes`` written), "too_long" (the code itself), "sandbox_error" (the sandbox did not start; ``detail``
    says why). ``stdout``/``stderr`` are the first ``output_bytes`` of each stream, decoded as UTF-8."""

    status: str
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    signal: str | None = None
    seconds: float = 0.0
    output_bytes: int = 0
    truncated: bool = False
    backend: str = ""
    detail: str = ""
    uid: int | None = None  # the uid the call ran under (leased for the call only)


def unavailable_reason(backend: str = DEFAULT_BACKEND, uid_base: int = DEFAULT_UID_BASE) -> str | None:
    """Why ``run_python`` cannot run here with ``backend``, or None when it can."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if os.geteuid() != 0:
        return "the tool sandbox runs each call as a uid of its own, which needs root"
    if not _uid_range_mapped(uid_base):
        return f"uids from {uid_base} are not mapped in this user namespace (a rootless container?)"
    if not os.access(PYTHON, os.X_OK):
        return f"no interpreter at {PYTHON} for the tool"
    if backend == "own" and platform.machine() not in _SYS_PIVOT_ROOT:
        return f"pivot_root's system call number is not known for {platform.machine()}"
    if backend == "bwrap":
        for tool in ("bwrap", "prlimit"):
            if shutil.which(tool) is None:
                return f"{tool} is not installed (.ci/install_bubblewrap.sh installs bubblewrap)"
    return None


def run_python(
    code: str,
    *,
    backend: str = DEFAULT_BACKEND,
    limits: ToolLimits | None = None,
    uid_base: int = DEFAULT_UID_BASE,
    _mount_ns: bool = True,
) -> ToolResult:
    """Run ``code`` as a Python program in a fresh sandbox (see the module docstring). ``_mount_ns=False`` (own
    backend, tests only) leaves out the mount namespace: the tool then sees and writes the host's file system as
    its uid, which the attack tests use to show that they can fail."""
    limits = limits or ToolLimits()
    reason = unavailable_reason(backend, uid_base)
    if reason is not None:
        raise ToolSandboxUnavailable(reason)
    if not isinstance(code, str):
        raise ValueError(f"code must be str, got {type(code).__name__}")
    if not _mount_ns and backend != "own":
        raise ValueError("only the own backend can leave out its mount namespace")
    data = code.encode("utf-8", "replace")
    if len(data) > limits.code_bytes:
        return ToolResult("too_long", backend=backend, detail=f"{len(data)} bytes of code, over {limits.code_bytes}")
    start = time.monotonic()
    try:
        leases = _lease_uids(uid_base, 1)
    except (OSError, RuntimeError) as e:
        return ToolResult("sandbox_error", backend=backend, detail=f"no sandbox uid: {e}")
    uid = next(iter(leases))
    workdir = tempfile.mkdtemp(prefix="async-vapo-tool-")  # 0700 root: the own backend's mount point
    status_r, status_w = os.pipe()
    try:
        if backend == "own":
            argv, kwargs = _own_command(uid, limits, workdir, status_w, _mount_ns)
        else:
            argv, kwargs = _bwrap_command(uid, limits, status_w)
        result = _supervise(argv, kwargs, data, status_r, status_w, limits, backend, start, uid)
        if result.status in ("timeout", "output_limit", "sandbox_error"):
            _clear_uid(uid)  # the tree was killed from outside: no process of the uid may outlive the lease
        return result
    finally:  # _supervise closed status_w
        os.close(status_r)
        shutil.rmtree(workdir, ignore_errors=True)
        _release_uids(leases)


# ------------------------------------------------------------------------------------------- caller side


def _ro_paths() -> list[str]:
    """What the tool may read: /usr, the merged-/usr symlinks, and the interpreter's prefix when outside /usr."""
    paths = ["/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if os.path.lexists(top):
            paths.append(top)
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(PYTHON)))
    if not any(prefix == p or prefix.startswith(p + "/") for p in paths):
        paths.append(prefix)
    return paths


def _own_command(uid: int, limits: ToolLimits, workdir: str, status_w: int, mount_ns: bool) -> tuple[list, dict]:
    spec = {
        "uid": uid, "status_fd": status_w, "root": workdir, "mount_ns": mount_ns, "ro": _ro_paths(),
        "python": PYTHON, "env": _TOOL_ENV, "memory_mb": limits.memory_mb, "cpu_s": limits.cpu_s,
        "max_processes": limits.max_processes, "file_bytes": limits.file_bytes,
        "scratch_bytes": limits.scratch_bytes, "scratch_files": limits.scratch_files,
    }  # fmt: skip
    boot = (f"import sys; sys.path.insert(0, {_PACKAGE_ROOT!r}); "
            "from async_vapo.verify.tool_sandbox import _launch; sys.exit(_launch(sys.argv[1]))")
    return [sys.executable, "-I", "-S", "-c", boot, json.dumps(spec)], {}


def _bwrap_command(uid: int, limits: ToolLimits, status_w: int) -> tuple[list, dict]:
    argv = [
        "prlimit", f"--as={limits.memory_mb << 20}", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
        f"--nproc={limits.max_processes}", f"--fsize={limits.file_bytes}", "--nofile=64", "--core=0", "--",
        "bwrap", "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc",
        "--unshare-uts", "--unshare-cgroup-try", "--as-pid-1", "--die-with-parent", "--new-session", "--clearenv",
    ]  # fmt: skip
    for key, value in _TOOL_ENV.items():
        argv += ["--setenv", key, value]
    for path in _ro_paths():
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        else:
            argv += ["--ro-bind", path, path]
    # not --dev: it mounts a writable /dev/shm of half the machine's memory
    argv += ["--size", str(64 << 10), "--tmpfs", "/dev"]
    for name in _DEVICES:
        argv += ["--dev-bind", f"/dev/{name}", f"/dev/{name}"]
    for name, target in _DEV_LINKS:
        argv += ["--symlink", target, f"/dev/{name}"]
    argv += ["--remount-ro", "/dev", "--proc", "/proc", "--size", str(limits.scratch_bytes), "--tmpfs", SCRATCH,
             "--chdir", SCRATCH, "--remount-ro", "/", "--json-status-fd", str(status_w), PYTHON, "-I", "-S", "-"]
    return argv, {"user": uid, "group": uid, "extra_groups": []}


def _supervise(argv: list, kwargs: dict, code: bytes, status_r: int, status_w: int, limits: ToolLimits,
               backend: str, start: float, uid: int) -> ToolResult:
    """Start the sandbox, write the code to its stdin, read its output and status until all its pipes close or a
    limit ends it, and make a result of it. Closes ``status_w`` (the sandbox holds the only write end)."""
    deadline = start + limits.wall_s
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(status_w,), env=dict(_TOOL_ENV), cwd="/", start_new_session=True, **kwargs)
    except OSError as e:
        return ToolResult("sandbox_error", backend=backend, detail=f"could not start {argv[0]}: {e}",
                          seconds=time.monotonic() - start, uid=uid)
    finally:
        os.close(status_w)
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    streams = {out_fd: bytearray(), err_fd: bytearray(), status_r: bytearray()}
    caps = {out_fd: limits.output_bytes, err_fd: limits.output_bytes, status_r: 1 << 16}
    total = 0
    stopped = ""  # why the tree was killed from here
    pending = memoryview(code)
    stdin = proc.stdin.fileno()
    os.set_blocking(stdin, False)
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        sel.register(stdin, selectors.EVENT_WRITE)
        open_fds = len(streams)
        while open_fds:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                stopped = "timeout"
                break
            for key, _events in sel.select(timeout):
                fd = key.fd
                if fd == stdin:
                    try:
                        pending = pending[os.write(stdin, pending):]
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: it exited without reading all of its code
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(stdin)
                        proc.stdin.close()
                    continue
                try:
                    chunk = os.read(fd, _READ_SIZE)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(fd)
                    open_fds -= 1
                    continue
                buf = streams[fd]
                buf += chunk[: max(0, caps[fd] - len(buf))]
                if fd != status_r:
                    total += len(chunk)
                    if total > limits.drain_bytes:
                        stopped = "output_limit"
                        break
            if stopped:
                break
    if stopped:
        _kill_tree(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stopped = "timeout"
            _kill_tree(proc)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None and not pipe.closed:
            pipe.close()
    out, err = bytes(streams[out_fd]), bytes(streams[err_fd])
    common = {"stdout": out.decode("utf-8", "replace"), "stderr": err.decode("utf-8", "replace"),
              "seconds": time.monotonic() - start, "output_bytes": total,
              "truncated": total > len(out) + len(err), "backend": backend, "uid": uid}
    if stopped == "timeout":
        return ToolResult("timeout", detail=f"wall clock limit of {limits.wall_s:g}s", **common)
    if stopped == "output_limit":
        return ToolResult("output_limit", detail=f"over {limits.drain_bytes} bytes of output", **common)
    return _from_status(bytes(streams[status_r]), proc.returncode, backend, common)


def _uid_pids(uid: int) -> list[int]:
    """Host pids whose real uid is ``uid``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status", "rb") as f:
                    line = next((line for line in f if line.startswith(b"Uid:")), b"Uid: -1")
            except OSError:  # gone meanwhile
                continue
            if int(line.split()[1]) == uid:
                pids.append(int(entry))
    return pids


def _clear_uid(uid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL every process of ``uid`` until none is left (a killed pid namespace's tasks take a moment to exit);
    logs when some outlive ``timeout_s`` (uninterruptible sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _kill_uid(uid)
        left = _uid_pids(uid)
        if not left:
            return
        if time.monotonic() > deadline:
            log.warning("processes %s of tool sandbox uid %d outlived %.0fs of SIGKILLs", left, uid, timeout_s)
            return
        time.sleep(0.01)


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the sandbox's process group (its launcher or bubblewrap, whose death ends the pid namespace) and
    collect it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # uninterruptible sleep: left to the kernel
        pass


def _from_status(status: bytes, returncode: int | None, backend: str, common: dict) -> ToolResult:
    """The result from the sandbox's status report: ours ``{"exit": N}``, ``{"signal": N}`` or ``{"error": ...}``;
    bubblewrap's JSON documents, ``{"child-pid": ...}`` once the tool started, then ``{"exit-code": N}``."""
    docs = []
    for line in status.decode("utf-8", "replace").splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict):
            docs.append(doc)
    report: dict = {}
    for doc in docs:
        report.update(doc)
    if backend == "bwrap":
        if "child-pid" not in report or "exit-code" not in report:
            return ToolResult("sandbox_error", exit_code=returncode,
                              detail=f"bubblewrap did not run the tool: {common['stderr'][-500:]}", **common)
        code = int(report["exit-code"])
        report = {"signal": code - 128} if code > 128 else {"exit": code}
        if report.get("signal") == signal.SIGKILL:  # pid 1 gets SIGKILL only from the kernel: RLIMIT_CPU's hard one
            return ToolResult("timeout", signal="SIGKILL", detail="cpu time limit", **common)
    if "error" in report or not ("exit" in report or "signal" in report):
        detail = str(report.get("error", f"no status from the sandbox (launcher {returncode})"))
        return ToolResult("sandbox_error", exit_code=returncode, detail=detail[:2000], **common)
    if "signal" in report:
        sig = int(report["signal"])
        name = _signal_name(sig)
        status = "timeout" if sig == signal.SIGXCPU else "killed"
        detail = "cpu time limit" if sig == signal.SIGXCPU else f"killed by {name}"
        return ToolResult(status, signal=name, detail=detail, **common)
    code = int(report["exit"])
    return ToolResult("ok" if code == 0 else "error", exit_code=code, **common)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# ------------------------------------------------------------------------------------- sandbox side (own)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = (lambda s: None if s is None else s.encode())  # noqa: E731
    if _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def _bind_ro(path: str, target: str) -> None:
    if os.path.isdir(path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(path, target, None, _MS_BIND | _MS_REC)
    _mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)


def _build_root(spec: dict) -> None:
    """Make the sandbox's root from bind mounts on a tmpfs over ``spec["root"]`` (in this mount namespace only)
    and ``pivot_root`` into it; the host's tree is then unmounted from view."""
    root, uid = spec["root"], spec["uid"]
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)  # nothing below propagates back to the host
    _mount("tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
    for path in spec["ro"]:
        target = root + path
        if os.path.islink(path):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(path), target)
        else:
            _bind_ro(path, target)
    dev = root + "/dev"
    os.makedirs(dev)
    _mount("tmpfs", dev, "tmpfs", _MS_NOSUID | _MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in _DEVICES:
        open(f"{dev}/{name}", "a").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, _MS_BIND)
    for name, target in _DEV_LINKS:
        os.symlink(target, f"{dev}/{name}")
    _mount(None, dev, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NOEXEC)
    os.makedirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    os.makedirs(root + SCRATCH)
    _mount("tmpfs", root + SCRATCH, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={spec['scratch_bytes']},nr_inodes={spec['scratch_files']},mode=0700,uid={uid},gid={uid}")
    _mount(None, root, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chdir(root)
    libc = _libc()
    if libc.syscall(_SYS_PIVOT_ROOT[platform.machine()], b".", b".") != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pivot_root: {os.strerror(err)}")
    if libc.umount2(b".", _MNT_DETACH) != 0:  # the old root, stacked under the new one
        err = ctypes.get_errno()
        raise OSError(err, f"umount of the old root: {os.strerror(err)}")
    os.chdir("/")


def _exec_tool(spec: dict, status_fd: int) -> None:
    """In the tool's process: limits, the uid, no privileges, then the interpreter reading the code from stdin."""
    os.set_inheritable(status_fd, False)  # closed by execve: the tool cannot write a status of its own
    _apply_limits(spec["memory_mb"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (spec["file_bytes"], spec["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_CPU, (spec["cpu_s"], spec["cpu_s"] + 1))
    _drop_privileges(spec["uid"], spec["uid"], spec["max_processes"])
    os.chdir(SCRATCH if spec["mount_ns"] else spec["root"])
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-"], spec["env"])


def _report(status_fd: int, doc: dict) -> None:
    try:
        os.write(status_fd, (json.dumps(doc) + "\n").encode())
    except OSError:
        pass


def _launch(spec_json: str) -> int:
    """The own backend's launcher (as root, in the caller's namespaces); returns its exit code. See the module
    docstring for the process tree."""
    spec = json.loads(spec_json)
    status_fd, libc = spec["status_fd"], _libc()
    flags = _CLONE_NEWPID | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS
    if spec["mount_ns"]:
        flags |= _CLONE_NEWNS
    if libc.unshare(flags) != 0:
        _report(status_fd, {"error": f"unshare: {os.strerror(ctypes.get_errno())}"})
        return _EXIT_SETUP
    init = os.fork()
    if init:  # outside: wait for the namespace's pid 1, holding none of the tool's pipes
        os.close(status_fd)
        for fd in (0, 1, 2):
            os.close(fd)
        _pid, wstatus = os.waitpid(init, 0)
        return os.waitstatus_to_exitcode(wstatus) if os.WIFEXITED(wstatus) else _EXIT_SETUP
    try:
        if spec["mount_ns"]:
            _build_root(spec)
        else:
            os.chown(spec["root"], spec["uid"], spec["uid"])
        tool = os.fork()
        if tool == 0:
            try:
                _exec_tool(spec, status_fd)
            except BaseException as e:  # noqa: BLE001 - any failure before execve is the sandbox's
                _report(status_fd, {"error": f"tool process: {type(e).__name__}: {e}"})
            os._exit(_EXIT_SETUP)
        _drop_privileges(spec["uid"], spec["uid"], spec["max_processes"])
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # the tool (same uid) cannot ptrace or open this process
        for fd in (0, 1, 2):
            os.close(fd)
        report: dict = {}
        while True:  # pid 1: reap every orphan until the tool's own process ends
            try:
                pid, wstatus = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            except InterruptedError:
                continue
            if pid == tool:
                if os.WIFSIGNALED(wstatus):
                    report = {"signal": os.WTERMSIG(wstatus)}
                else:
                    report = {"exit": os.WEXITSTATUS(wstatus)}
                break
        if report:
            _report(status_fd, report)
        os._exit(0)
    except BaseException as e:  # noqa: BLE001
        _report(status_fd, {"error": f"{type(e).__name__}: {e}"})
        os._exit(_EXIT_SETUP)

