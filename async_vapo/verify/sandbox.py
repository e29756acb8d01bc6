"""Sandboxed answer verification: a pool of persistent, resource-limited, isolated worker processes.

Model responses are untrusted input to sympy, which can hang (``9^{9^{9^{9}}}``), exhaust memory or
crash the interpreter. Every check therefore runs in a worker process, never in the caller's.

Process model
- Each worker is ``python -m async_vapo.verify.sandbox --worker``, started with
  ``start_new_session=True`` (its own process group, killed as a group), stdin/stdout on /dev/null,
  stderr to a log file in a private temp dir that is also its cwd, HOME and TMPDIR, and an
  environment built from a whitelist (``_ENV_WHITELIST``), so tokens and keys in the parent's
  environment never reach it.
- At start the worker limits itself with ``setrlimit``: RLIMIT_AS = ``memory_limit_mb``,
  RLIMIT_CORE = 0, RLIMIT_NOFILE = 64, RLIMIT_FSIZE = 16 MiB; before each check RLIMIT_CPU is set
  to the CPU already used plus a per-check budget (``cpu_limit_s``, or ``2 * timeout_s + 1`` as a
  backstop that also ends an orphan spinning after its parent died).
- It isolates itself (below), imports math-verify and grades a few warm-up answers, drops its
  privileges, grades one answer again under them, then sends READY with a report of the isolation
  that holds. The pool waits for READY at most ``start_timeout_s``; a worker that does not make it
  raises ``WorkerStartError``.

Isolation (``VerifierPool.isolation`` says what holds; it is logged once per pool, as a warning when
something below does not hold)
- Pool started as root (euid 0, with the uid range mapped in its user namespace): every worker gets
  a uid of its own, ``uid == gid`` from ``[sandbox_uid_base, sandbox_uid_base + 4096)``, leased
  with an exclusive ``flock`` on ``/run/async-vapo/sandbox-uids/<uid>.lock`` (or the same under the
  temp dir) so pools in other processes never share one, and skipping uids that name an account.
  The worker enters a new network namespace (``unshare(CLONE_NEWNET)``: only a loopback device
  that is down, so no socket reaches anything outside it), imports as root, then sets
  ``PR_SET_NO_NEW_PRIVS``, ``setgroups([])``, ``setgid``, ``setuid``, clears its capabilities and
  sets RLIMIT_NPROC = ``max_processes``. RLIMIT_NPROC counts the tasks (threads too) of a real
  uid; as the uid is the worker's alone, a fork bomb inside sympy stops at ``max_processes``
  tasks, the worker included. Its temp dir is mode 0700 and owned by its uid, so neither other
  workers nor other users can read it. Import paths the uid cannot reach (an interpreter under a
  0700 ``/root``) stay importable through directory descriptors opened before the drop.
  Each time a worker goes (replacement or ``close``), after its process group, every process of
  its uid is SIGKILLed (``kill(-1)`` from a shell running as that uid), so a child that left the
  group with ``setsid`` goes too; the next lease of the uid starts the same way. Nothing else on
  the machine may run under that uid range.
- Pool not started as root: no uid drop is possible. Workers run as the pool's user and can do to
  that user's other processes and files what it can (signal them, read its files). The worker
  tries ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` (unprivileged user namespaces, mapping its own
  uid and gid to themselves), then ``CLONE_NEWUSER`` alone; in a user namespace of its own,
  RLIMIT_NPROC counts only that namespace's tasks, so ``max_processes`` is still per worker, and
  the namespace's capabilities are cleared before any check. Where no user namespace can be made
  (``kernel.unprivileged_userns_clone=0``, a seccomp profile), RLIMIT_NPROC = ``max_processes``
  counts every task of the user: the worker cannot fork once the user holds that many, which
  still bounds a fork bomb (``nproc_scope`` "user"). A child that left the process group
  survives its worker here (no uid to kill by).
- Not covered: filesystem reads (a worker reads what its uid may read), and system calls
  (no seccomp filter). Orphans of a killed worker are reaped by PID 1; where PID 1 does not reap
  (a container without an init), they stay zombies and count against their uid's RLIMIT_NPROC.

Wire protocol (private to this module; both ends live here)
- Two anonymous pipes per worker (``pass_fds``), each message a 4-byte big-endian length then
  ASCII JSON (``ensure_ascii`` keeps lone surrogates intact). The parent drops a worker whose
  message header announces more than ``_MAX_REPLY_BYTES`` before reading the body.
- worker -> pool ``{"kind": "ready", "v": PROTOCOL_VERSION, "pid", "startup_s", "isolation"}``, once; or, when
  ``reward_fn`` does not load, ``{"kind": "start_error", "v", "error"}`` and the worker exits (the pool raises
  ``WorkerStartError`` with that error: a configuration mistake stops the start, never a check).
- pool -> worker ``{"items": [[index, response, answer(, context)], ...]}``: a chunk, graded in order; ``context``
  (``{"prompt", "extra"}``, only with a ``reward_fn``) is what the function may take besides the pair.
- worker -> pool ``{"kind": "result", "i", "reason", "seconds", "detail"}``, one per item, sent as
  soon as that item is done. With a ``reward_fn`` (:mod:`async_vapo.verify.reward_fn`) the reason is "scored"
  with ``"reward"`` (a finite number or a bool), which the pool turns into "correct" (reward at least
  ``reward_correct``) or "incorrect", or "reward_error" (the function raised or returned no finite number).

Deadlines and failure policy
- One check at a time per worker. Each item has its own wall-clock deadline of ``timeout_s``,
  starting when its chunk was written or when the previous item's result arrived. Inside the
  worker a SIGALRM timer at ``soft_timeout_s`` (default ``0.75 * timeout_s``) interrupts Python-level work and
  reports "timeout" without losing the warm worker.
- Past the hard deadline (code stuck in C, signals blocked) the pool SIGKILLs the worker's process
  group: the item in progress gets "timeout". A worker that exits mid-check (segfault, MemoryError
  -> exit code 3, ``os._exit``) gives "crash" (or "timeout" when it died of SIGXCPU). Either way a
  fresh worker is started in the background and the unfinished rest of the chunk goes back to the
  front of the queue; each failure settles the item that caused it, so a batch always finishes.
- A worker that dies before it has read its whole chunk (EPIPE, or EOF with bytes still unsent)
  started no item, so nothing is blamed and the whole chunk is requeued. An item requeued that way
  ``_MAX_UNREAD_REQUEUES`` times is settled as "crash", so a pool whose workers die on receipt
  still finishes the batch.
- A whole ``verify`` call has a wall-clock budget (``budget_s``, default ``message_budget_s``):
  when it is spent, every item not graded yet gets "over_budget" (the item in progress too, as its
  own ``timeout_s`` had not passed: the batch, not the response, ran out of time), busy workers are
  killed and replaced in the background, and ``verify`` returns. So one call never takes much more
  than its budget, whatever the responses hold.
- Before any IPC, non-``str`` inputs give "bad_input" and a response or answer longer than
  ``max_response_chars`` gives "too_long". ``verify`` raises only for a closed pool or a worker that
  cannot start (then the pool closes itself); never because of what a response contains.
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import importlib
import json
import logging
import math
import os
import pwd
import resource
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["REASONS", "VerifierPool", "VerifyResult", "WorkerStartError", "main"]

REASONS = (
    "correct", "incorrect", "no_answer", "parse_error", "timeout", "crash", "too_long", "bad_input", "over_budget",
    "reward_error",
)  # fmt: skip
PROTOCOL_VERSION = 4  # 4: items may carry a reward function's context

log = logging.getLogger(__name__)

_HEADER = struct.Struct(">I")
_MAX_REPLY_BYTES = 1 << 20
_MAX_UNREAD_REQUEUES = 3
_EXIT_MEMORY_ERROR = 3
_READ_SIZE = 1 << 16
_ENV_WHITELIST = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

DEFAULT_UID_BASE = 1_900_000_000
"""First sandbox uid: systemd's UIDS-GIDS.md leaves 1879048192-2147483647 unused by any allocator."""
UID_SLOTS = 4096
_UID_LOCK_DIRS = ("/run/async-vapo/sandbox-uids", "async-vapo-sandbox-uids")  # the second under the temp dir
_CLONE_NEWUSER = 0x10000000
_CLONE_NEWNET = 0x40000000
_PR_SET_NO_NEW_PRIVS = 38
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Warm-up covers the lazily initialised paths of latex2sympy/sympy (first parse ~1 s, first
# symbolic and set comparisons ~0.1-0.3 s each) so the first real check costs milliseconds.
_WARMUP = (
    ("\\boxed{1/2}", "0.5"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),
    ("\\boxed{2.0}", "2"),
    ("\\boxed{x^2+1}", "1+x^2"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("\\boxed{\\sin x}", "\\sin(x)"),
    ("\\boxed{\\text{(A)}}", "A"),
)


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of grading one response.

    ``reason`` is one of ``REASONS``; ``seconds`` is the wall time of the check (0.0 when it never
    reached a worker); ``detail`` says more for failures (signal name, exception type).
    """

    reward: float
    correct: bool
    reason: str
    seconds: float
    detail: str = ""


class WorkerStartError(RuntimeError):
    """A verifier worker did not send READY within ``start_timeout_s`` or exited before it."""


class _ProtocolError(Exception):
    """A worker sent a message the pool did not expect; the worker is treated as crashed."""


_WORKER_REASONS = frozenset({"correct", "incorrect", "no_answer", "parse_error", "timeout", "reward_error", "scored"})
_ISOLATION_KEYS = frozenset({"uid", "netns", "userns", "nproc", "nproc_scope", "no_new_privs", "capabilities"})


def _check_budget(budget_s: float | None) -> None:
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"a verification budget must be > 0 seconds (math.inf: none) or None, got {budget_s}")


def _encode(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode("ascii")
    return _HEADER.pack(len(body)) + body


def _signal_name(returncode: int | None) -> str:
    if returncode is None:
        return "running"
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    if returncode == _EXIT_MEMORY_ERROR:
        return "MemoryError"
    return f"exit code {returncode}"


def _uid_range_mapped(base: int) -> bool:
    """Whether uids and gids ``[base, base + UID_SLOTS)`` exist in this process's user namespace (all of them in
    the initial one; only a few in a rootless container, where root cannot become them)."""
    for table in ("/proc/self/uid_map", "/proc/self/gid_map"):
        try:
            with open(table) as f:
                extents = [tuple(map(int, line.split())) for line in f if line.strip()]
        except OSError:
            return False
        if not any(inside <= base and base + UID_SLOTS <= inside + count for inside, _outside, count in extents):
            return False
    return True


def _uid_lock_dir() -> str:
    """A directory only root can write, for the uid leases; raises when none can be had."""
    errors = []
    for path in (_UID_LOCK_DIRS[0], os.path.join(tempfile.gettempdir(), _UID_LOCK_DIRS[1])):
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != 0 or st.st_mode & 0o022:
                raise PermissionError(f"{path} is not a directory owned and only writable by root")
            return path
        except OSError as e:
            errors.append(str(e))
    raise RuntimeError(f"no directory for the verifier's uid leases: {'; '.join(errors)}")


def _lease_uids(base: int, n: int) -> dict[int, int]:
    """Lease ``n`` sandbox uids: {uid: descriptor holding its lock}. A uid is taken when its lock file can be
    locked (the lock goes with the descriptor, so with the process that holds it) and no account has it."""
    lock_dir = _uid_lock_dir()
    leases: dict[int, int] = {}
    try:
        for uid in range(base, base + UID_SLOTS):
            if len(leases) == n:
                break
            try:
                pwd.getpwuid(uid)
                continue  # an account: never run workers as someone
            except KeyError:
                pass
            fd = os.open(os.path.join(lock_dir, f"{uid}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            leases[uid] = fd
            _kill_uid(uid)  # whatever a crashed earlier holder left behind
        if len(leases) < n:
            raise RuntimeError(f"only {len(leases)} of {n} sandbox uids free in [{base}, {base + UID_SLOTS})")
    except BaseException:
        _release_uids(leases)
        raise
    return leases


def _release_uids(leases: dict[int, int]) -> None:
    for fd in leases.values():
        try:
            os.close(fd)
        except OSError:
            pass
    leases.clear()


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: ``kill(-1)`` as that uid reaches all of them and nothing else (Linux
    spares the caller). The kernel walks the task list under the lock that fork takes, so none escapes."""
    try:
        subprocess.run(["/bin/sh", "-c", "kill -s KILL -- -1 2>/dev/null; exit 0"], user=uid, group=uid,
                       extra_groups=[], env={}, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("could not kill the processes of sandbox uid %d: %s", uid, e)


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    req_fd: int  # pool writes, non-blocking
    resp_fd: int  # pool reads, non-blocking
    tmpdir: str
    uid: int | None  # its own uid when the pool runs as root, else None (the pool's)
    spawned_at: float
    deadline: float  # start deadline until READY, then the current item's deadline
    ready: bool = False
    startup_s: float = math.nan
    isolation: dict[str, Any] = field(default_factory=dict)  # what the worker reported in READY
    killed: bool = False
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    writing: bool = False
    inflight: deque[int] = field(default_factory=deque)  # item indices sent, results pending, in order


class VerifierPool:
    """Grade model responses in sandboxed worker processes; see the module docstring.

    ``verify`` is thread-safe (calls are serialized). ``message_budget_s`` is the default wall-clock budget
    of one ``verify`` call (None: none). ``max_processes`` is each worker's RLIMIT_NPROC (itself included)
    and ``sandbox_uid_base`` the first of the uids leased to workers when the pool runs as root.
    ``reward_fn`` ("module:function", :mod:`async_vapo.verify.reward_fn`) grades with the user's function instead of
    ``check_answer`` (``answer_format`` is then unused). ``_test_hooks`` makes workers honour magic responses
    (``__hang__``, ``__crash__``, ``__probe__``, ``__net__:PORT``, ``__forkbomb__``, ...; see ``_test_hook``) for the
    test suite only; never enable it for real traffic.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 2.0,
        memory_limit_mb: int = 1024,
        cpu_limit_s: float | None = None,
        max_response_chars: int = 20_000,
        reward_correct: float = 1.0,
        reward_incorrect: float = -1.0,
        *,
        reason_rewards: Mapping[str, float] | None = None,
        chunk_size: int = 16,
        start_timeout_s: float = 60.0,
        soft_timeout_s: float | None = None,
        message_budget_s: float | None = None,
        max_processes: int = 4,
        sandbox_uid_base: int = DEFAULT_UID_BASE,
        answer_format: str = "boxed",
        reward_fn: str | None = None,
        _test_hooks: bool = False,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if memory_limit_mb < 128:
            raise ValueError(f"memory_limit_mb must be >= 128 (sympy must import), got {memory_limit_mb}")
        if cpu_limit_s is not None and not cpu_limit_s > 0:
            raise ValueError(f"cpu_limit_s must be > 0 or None, got {cpu_limit_s}")
        if max_response_chars < 1 or chunk_size < 1 or not start_timeout_s > 0:
            raise ValueError("max_response_chars, chunk_size and start_timeout_s must be positive")
        if soft_timeout_s is None:
            soft_timeout_s = timeout_s * 0.75
        if not 0 < soft_timeout_s <= timeout_s:
            raise ValueError(f"soft_timeout_s must be in (0, timeout_s], got {soft_timeout_s}")
        _check_budget(message_budget_s)
        if max_processes < 1:
            raise ValueError(f"max_processes must be >= 1 (the worker itself), got {max_processes}")
        if not 1000 <= sandbox_uid_base <= 2**31 - 1 - UID_SLOTS:
            raise ValueError(f"sandbox_uid_base must be in [1000, {2**31 - 1 - UID_SLOTS}], got {sandbox_uid_base}")
        unknown = set(reason_rewards or ()) - set(REASONS)
        if unknown:
            raise ValueError(f"reason_rewards has unknown reasons {sorted(unknown)}; known: {REASONS}")

        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.cpu_limit_s = cpu_limit_s
        self.max_response_chars = max_response_chars
        self.chunk_size = chunk_size
        self.start_timeout_s = float(start_timeout_s)
        self.soft_timeout_s = float(soft_timeout_s)
        self.message_budget_s = message_budget_s
        self.max_processes = max_processes
        from async_vapo.verify.check import ANSWER_FORMATS

        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        self.answer_format = answer_format
        from async_vapo.verify.reward_fn import REWARD_FN_RE

        if reward_fn is not None and not REWARD_FN_RE.match(reward_fn):
            raise ValueError(f"reward_fn must be 'module:function', got {reward_fn!r}")
        self.reward_fn = reward_fn
        self._test_hooks = _test_hooks
        self._rewards = {r: (reward_correct if r == "correct" else reward_incorrect) for r in REASONS}
        self._rewards.update(reason_rewards or {})

        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._closed = False
        self._workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()
        self._counts: Counter[str] = Counter()
        self._workers_replaced = 0
        self._items_redispatched = 0
        self._unread_requeues: Counter[int] = Counter()  # per verify() call, by item index
        self._last_start_s = math.nan
        self._uid_leases: dict[int, int] = {}
        self._isolation_seen: dict[str, Any] = {}
        self._drop_uid = os.geteuid() == 0
        try:
            if self._drop_uid and not _uid_range_mapped(sandbox_uid_base):
                raise RuntimeError(
                    f"the pool runs as root but uids [{sandbox_uid_base}, {sandbox_uid_base + UID_SLOTS}) are not "
                    "mapped in its user namespace (a rootless container?): set sandbox_uid_base to a mapped range "
                    "(/proc/self/uid_map)"
                )
            if self._drop_uid:
                self._uid_leases = _lease_uids(sandbox_uid_base, num_workers)
            uids: list[int | None] = list(self._uid_leases) if self._drop_uid else [None] * num_workers
            for uid in uids:
                self._workers.append(self._spawn(uid))
            self._wait_ready()
        except BaseException:
            self._close_unlocked()
            raise
        self._log_isolation()

    # ----------------------------------------------------------------------------------- public

    @classmethod
    def from_config(cls, v, *, num_workers: int | None = None) -> VerifierPool:
        """The pool of a ``VerifierConfig`` (``num_workers`` overrides its worker count)."""
        return cls(num_workers=num_workers or v.num_workers, timeout_s=v.timeout_s, memory_limit_mb=v.memory_limit_mb,
                   max_response_chars=v.max_response_chars, reward_correct=v.reward_correct,
                   reward_incorrect=v.reward_incorrect, message_budget_s=v.message_budget_s,
                   max_processes=v.max_processes, sandbox_uid_base=v.sandbox_uid_base, answer_format=v.answer_format,
                   reward_fn=v.reward_fn)

    def verify(self, items: Sequence[tuple], budget_s: float | None = None) -> list[VerifyResult]:
        """Grade ``(response, answer)`` pairs, or ``(response, answer, context)`` triples whose ``context``
        (``{"prompt": str, "extra": JSON object text}``) a ``reward_fn`` may take (:mod:`async_vapo.verify.reward_fn`;
        the maths check ignores it); results come back in input order.

        ``budget_s``: wall-clock seconds the whole call may take (None: ``message_budget_s``; ``math.inf``:
        no budget); items not graded when it is spent get "over_budget"."""
        _check_budget(budget_s)
        if budget_s is None:
            budget_s = self.message_budget_s
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            try:
                return self._verify_unlocked(items, budget_s)
            except WorkerStartError:
                self._close_unlocked()
                raise

    def wait_ready(self) -> None:
        """Block until every worker, replacements included, has sent READY.

        ``verify`` never needs this; it is for callers that want a warm pool before timing work.
        Raises ``WorkerStartError`` (and closes the pool) when a worker misses ``start_timeout_s``.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            try:
                self._wait_ready()
            except WorkerStartError:
                self._close_unlocked()
                raise

    @property
    def stats(self) -> dict[str, float]:
        """Cumulative counts per reason, worker replacements, re-dispatched items, workers held and
        ready, and the READY time of the most recently started worker (``worker_start_seconds``)."""
        out: dict[str, float] = {r: self._counts[r] for r in REASONS}
        out["workers_replaced"] = self._workers_replaced
        out["items_redispatched"] = self._items_redispatched
        out["workers"] = len(self._workers)
        out["workers_ready"] = sum(1 for w in self._workers if w.ready)
        out["worker_start_seconds"] = self._last_start_s
        return out

    @property
    def worker_pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def isolation(self) -> dict[str, Any]:
        """What the ready workers reported holds (see the module docstring), e.g. ``{"uid_drop": True,
        "uids": [1900000000, 1900000001], "netns": True, "userns": False, "nproc": 4, "nproc_scope": "worker",
        "no_new_privs": True, "capabilities": False}``: ``uid_drop`` each worker runs under a uid other than
        the pool's, its own; ``netns`` each is in a network namespace of its own; ``nproc`` the least
        RLIMIT_NPROC, counting the worker's own tasks (``nproc_scope`` "worker") or every task of the pool's
        user ("user"); ``capabilities`` whether any worker holds a capability. While no worker is ready (all being
        replaced), the last report."""
        reports = [w.isolation for w in self._workers if w.ready]
        if not reports:
            return dict(self._isolation_seen)
        self._isolation_seen = {
            "uid_drop": all(r["uid"] != os.geteuid() for r in reports) and self._drop_uid,
            "uids": sorted({r["uid"] for r in reports}),
            "netns": all(r["netns"] for r in reports),
            "userns": all(r["userns"] for r in reports),
            "nproc": min(r["nproc"] for r in reports),
            "nproc_scope": "worker" if all(r["nproc_scope"] == "worker" for r in reports) else "user",
            "no_new_privs": all(r["no_new_privs"] for r in reports),
            "capabilities": any(r["capabilities"] for r in reports),
        }
        return dict(self._isolation_seen)

    def close(self) -> None:
        """Kill every worker and its process group; idempotent."""
        with self._lock:
            self._close_unlocked()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._close_unlocked()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # ------------------------------------------------------------------------------ dispatching

    def _result(self, reason: str, seconds: float = 0.0, detail: str = "", reward: float | None = None) -> VerifyResult:
        self._counts[reason] += 1
        return VerifyResult(self._rewards[reason] if reward is None else reward, reason == "correct", reason, seconds,
                            detail)

    def _scored(self, reward: Any) -> tuple[str, float]:
        """A reward_fn's "scored" result as (reason, reward); _ProtocolError when it is no finite number or bool."""
        if isinstance(reward, bool):
            return ("correct", self._rewards["correct"]) if reward else ("incorrect", self._rewards["incorrect"])
        if not isinstance(reward, int | float) or not math.isfinite(reward):
            raise _ProtocolError(f"scored result with reward {reward!r}")
        return ("correct" if reward >= self._rewards["correct"] else "incorrect"), float(reward)

    def _log_isolation(self) -> None:
        iso = self.isolation
        missing = [what for what, holds in (
            ("no uid drop (the pool does not run as root)", iso["uid_drop"]),
            ("no network namespace", iso["netns"]),
            ("RLIMIT_NPROC counts every task of the user, not the worker's", iso["nproc_scope"] == "worker"),
            ("workers hold capabilities", not iso["capabilities"]),
        ) if not holds]  # fmt: skip
        if missing:
            log.warning("verifier sandbox isolation is partial: %s; %s", "; ".join(missing), iso)
        else:
            log.info("verifier sandbox isolation: %s", iso)

    def _verify_unlocked(self, items: Sequence[tuple[str, str]], budget_s: float | None) -> list[VerifyResult]:
        batch_deadline = math.inf if budget_s is None else time.monotonic() + budget_s
        for w in list(self._workers):
            if w.inflight or w.outbuf:  # left over from a call interrupted mid-flight (KeyboardInterrupt)
                self._replace(w, [], deque(), None, "")
        results: list[VerifyResult | None] = [None] * len(items)
        payload: dict[int, tuple] = {}
        self._unread_requeues.clear()
        pending: deque[int] = deque()
        for i, item in enumerate(items):
            try:
                if isinstance(item, str):
                    raise TypeError
                response, answer, *context = item
                if len(context) > 1:
                    raise ValueError
            except (TypeError, ValueError):
                results[i] = self._result("bad_input", detail="item is not a (response, answer[, context]) tuple")
                continue
            if not isinstance(response, str) or not isinstance(answer, str):
                results[i] = self._result("bad_input", detail="response and answer must be str")
            elif context and not (context[0] is None or isinstance(context[0], Mapping)):
                results[i] = self._result("bad_input", detail="context must be a mapping or None")
            elif len(response) > self.max_response_chars or len(answer) > self.max_response_chars:
                results[i] = self._result("too_long", detail=f"over {self.max_response_chars} chars")
            else:
                ctx = dict(context[0]) if context and context[0] and self.reward_fn is not None else None
                payload[i] = (response, answer) if ctx is None else (response, answer, ctx)
                pending.append(i)

        while pending or any(w.inflight for w in self._workers):
            now = time.monotonic()
            if now >= batch_deadline:
                self._settle_over_budget(results, pending, f"budget of {budget_s:g}s for the batch spent")
                break
            idle = [w for w in self._workers if w.ready and not w.inflight]
            for w in idle:
                if not pending:
                    break
                size = min(self.chunk_size, -(-len(pending) // len(idle)))
                chunk: list[int] = []
                while pending and len(chunk) < size:
                    i = pending.popleft()
                    if self._unread_requeues[i] >= _MAX_UNREAD_REQUEUES:
                        results[i] = self._result("crash", detail="workers kept dying before reading it")
                        continue
                    chunk.append(i)
                if chunk:
                    w.inflight.extend(chunk)
                    w.deadline = now + self.timeout_s
                    w.outbuf += _encode({"items": [[i, *payload[i]] for i in chunk]})
                    self._flush(w, results, pending)

            waits = [w.deadline for w in self._workers if w.inflight or not w.ready]
            if not waits:
                continue  # every item just dispatched was settled without a worker
            for key, events in self._selector.select(max(0.0, min(*waits, batch_deadline) - time.monotonic())):
                w = key.data
                if w not in self._workers:
                    continue  # replaced earlier in this round
                if events & selectors.EVENT_WRITE and key.fd == w.req_fd:
                    self._flush(w, results, pending)
                elif events & selectors.EVENT_READ and key.fd == w.resp_fd:
                    self._on_readable(w, results, pending)

            now = time.monotonic()
            for w in list(self._workers):
                if now < w.deadline:
                    continue
                if not w.ready:
                    raise WorkerStartError(
                        f"verifier worker pid {w.proc.pid} sent no READY within {self.start_timeout_s:.0f}s"
                        f"{self._log_tail(w)}"
                    )
                if w.inflight:
                    self._replace(w, results, pending, "timeout", f"no result within {self.timeout_s:g}s")

        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    def _settle_over_budget(self, results: list[VerifyResult | None], pending: deque[int], detail: str) -> None:
        """Settle every ungraded item as "over_budget" and replace the workers still busy with one."""
        now = time.monotonic()
        for w in list(self._workers):
            if not w.inflight:
                continue
            running = w.inflight.popleft()
            results[running] = self._result("over_budget", max(0.0, now - (w.deadline - self.timeout_s)), detail)
            pending.extend(w.inflight)
            w.inflight.clear()
            self._respawn(w)
        while pending:
            results[pending.popleft()] = self._result("over_budget", 0.0, detail)

    def _flush(self, w: _Worker, results: list[VerifyResult | None], pending: deque[int]) -> None:
        try:
            while w.outbuf:
                n = os.write(w.req_fd, w.outbuf)
                del w.outbuf[:n]
        except BlockingIOError:
            pass
        except OSError:  # EPIPE: the worker died before reading the chunk, so no item is to blame
            self._replace(w, results, pending, None, "")
            return
        want = bool(w.outbuf)
        if want != w.writing:
            if want:
                self._selector.register(w.req_fd, selectors.EVENT_WRITE, w)
            else:
                self._selector.unregister(w.req_fd)
            w.writing = want

    def _on_readable(self, w: _Worker, results: list[VerifyResult | None], pending: deque[int]) -> None:
        eof = False
        try:
            while True:
                data = os.read(w.resp_fd, _READ_SIZE)
                if not data:
                    eof = True
                    break
                w.inbuf += data
        except BlockingIOError:
            pass
        try:
            self._consume(w, results)
        except _ProtocolError as e:
            self._replace(w, results, pending, "crash", f"protocol error: {e}")
            return
        if eof:
            if not w.ready:
                try:
                    w.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
                raise WorkerStartError(
                    f"verifier worker pid {w.proc.pid} exited ({_signal_name(w.proc.returncode)}) "
                    f"before READY{self._log_tail(w)}"
                )
            # Unsent bytes mean the worker had not read the whole chunk, so had started no item.
            self._replace(w, results, pending, None if w.outbuf else "crash", "")

    def _consume(self, w: _Worker, results: list[VerifyResult | None]) -> None:
        while len(w.inbuf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(w.inbuf)
            if size > _MAX_REPLY_BYTES:
                raise _ProtocolError(f"message of {size} bytes")
            if len(w.inbuf) < _HEADER.size + size:
                return
            body = bytes(w.inbuf[_HEADER.size : _HEADER.size + size])
            del w.inbuf[: _HEADER.size + size]
            try:
                msg = json.loads(body)
                kind = msg["kind"]
            except (ValueError, KeyError, TypeError) as e:
                raise _ProtocolError(f"undecodable message: {e!r}") from None
            if kind == "start_error" and not w.ready:
                raise WorkerStartError(str(msg.get("error", "the worker could not start"))[:2000])
            if kind == "ready" and not w.ready:
                if msg.get("v") != PROTOCOL_VERSION:
                    raise WorkerStartError(f"worker speaks protocol {msg.get('v')}, pool {PROTOCOL_VERSION}")
                isolation = msg.get("isolation")
                if not isinstance(isolation, dict) or not _ISOLATION_KEYS <= isolation.keys():
                    raise _ProtocolError(f"READY without an isolation report: {isolation!r}")
                w.isolation = isolation
                w.ready = True
                w.deadline = math.inf
                w.startup_s = time.monotonic() - w.spawned_at
                self._last_start_s = w.startup_s
            elif kind == "result" and w.inflight and msg.get("i") == w.inflight[0]:
                reason = msg.get("reason")
                if reason not in _WORKER_REASONS:
                    raise _ProtocolError(f"unknown reason {reason!r}")
                reward = None
                if reason == "scored":
                    reason, reward = self._scored(msg.get("reward"))
                i = w.inflight.popleft()
                results[i] = self._result(reason, float(msg.get("seconds", 0.0)), str(msg.get("detail", "")), reward)
                w.deadline = time.monotonic() + self.timeout_s if w.inflight else math.inf
            else:
                raise _ProtocolError(f"unexpected {kind!r} message")

    # --------------------------------------------------------------------------- worker lifecycle

    def _replace(
        self,
        w: _Worker,
        results: list[VerifyResult | None],
        pending: deque[int],
        reason: str | None,
        detail: str,
    ) -> None:
        """Kill ``w``, settle its current item with ``reason`` (``None``: no item was running),
        requeue the rest of its chunk, and start a new worker in its place."""
        started = w.deadline - self.timeout_s
        self._kill(w)
        w.outbuf.clear()
        if reason is not None and w.proc.returncode == -signal.SIGXCPU:
            reason, detail = "timeout", "cpu time limit"
        elif not detail:
            detail = f"worker died: {_signal_name(w.proc.returncode)}"
        if w.inflight and reason is not None:
            culprit = w.inflight.popleft()
            results[culprit] = self._result(reason, max(0.0, time.monotonic() - started), detail)
        else:
            self._unread_requeues.update(w.inflight)
        self._items_redispatched += len(w.inflight)
        pending.extendleft(reversed(w.inflight))
        w.inflight.clear()
        self._respawn(w)

    def _respawn(self, w: _Worker) -> None:
        """Kill ``w`` (every process of its uid too) and start a new worker, under the same uid, in its place."""
        self._kill(w)
        self._workers[self._workers.index(w)] = self._spawn(w.uid)
        self._workers_replaced += 1

    def _spawn(self, uid: int | None) -> _Worker:
        tmpdir = tempfile.mkdtemp(prefix="async-vapo-verify-")  # mode 0700
        if uid is not None:
            os.chown(tmpdir, uid, uid)
        env = {k: os.environ[k] for k in _ENV_WHITELIST if k in os.environ}
        inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *inherited])
        env.update(HOME=tmpdir, TMPDIR=tmpdir, PYTHONDONTWRITEBYTECODE="1")
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        cmd = [
            sys.executable, "-m", "async_vapo.verify.sandbox", "--worker",
            "--req-fd", str(req_r), "--resp-fd", str(resp_w),
            "--memory-limit-mb", str(self.memory_limit_mb),
            "--soft-timeout-s", repr(self.soft_timeout_s),
            "--cpu-limit-s", repr(self.cpu_limit_s if self.cpu_limit_s else 2 * self.timeout_s + 1),
            "--max-processes", str(self.max_processes),
            "--answer-format", self.answer_format,
        ]  # fmt: skip
        if self.reward_fn is not None:
            cmd += ["--reward-fn", self.reward_fn]
        if uid is not None:
            cmd += ["--uid", str(uid), "--gid", str(uid)]
        if self._test_hooks:
            cmd.append("--test-hooks")
        try:
            with open(os.path.join(tmpdir, "stderr.log"), "wb") as log:
                proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=log,
                    pass_fds=(req_r, resp_w),
                    cwd=tmpdir,
                    env=env,
                    start_new_session=True,
                )
        except BaseException:
            for fd in (req_w, resp_r):
                os.close(fd)
            shutil.rmtree(tmpdir, ignore_errors=True)
            raise
        finally:
            os.close(req_r)
            os.close(resp_w)
        os.set_blocking(req_w, False)
        os.set_blocking(resp_r, False)
        now = time.monotonic()
        w = _Worker(proc, req_w, resp_r, tmpdir, uid, spawned_at=now, deadline=now + self.start_timeout_s)
        self._selector.register(resp_r, selectors.EVENT_READ, w)
        return w

    def _wait_ready(self) -> None:
        while not all(w.ready for w in self._workers):
            waits = [w.deadline for w in self._workers if not w.ready]
            for key, _ in self._selector.select(max(0.0, min(waits) - time.monotonic())):
                if key.data in self._workers:
                    self._on_readable(key.data, [], deque())
            now = time.monotonic()
            for w in self._workers:
                if not w.ready and now >= w.deadline:
                    raise WorkerStartError(
                        f"verifier worker pid {w.proc.pid} sent no READY within {self.start_timeout_s:.0f}s"
                        f"{self._log_tail(w)}"
                    )

    def _log_tail(self, w: _Worker) -> str:
        try:
            with open(os.path.join(w.tmpdir, "stderr.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 2000))
                tail = f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""
        return f"; worker stderr:\n{tail}" if tail else ""

    def _kill(self, w: _Worker) -> None:
        if w.killed:  # its descriptors may already be someone else's
            return
        w.killed = True
        # A forked child must not kill its parent's workers. Once reaped, the pid may be reused, so
        # signal the group only while this Popen has not collected the exit status.
        if os.getpid() == self._owner_pid:
            if w.proc.returncode is None:
                try:
                    os.killpg(w.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            try:
                w.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:  # uninterruptible sleep; leave it to the kernel
                pass
        for fd in (w.req_fd, w.resp_fd):
            try:
                self._selector.unregister(fd)
            except (KeyError, ValueError):
                pass
            try:
                os.close(fd)
            except OSError:
                pass
        w.writing = False
        if w.uid is not None and os.getpid() == self._owner_pid:
            _kill_uid(w.uid)  # children that left the process group (setsid)
        shutil.rmtree(w.tmpdir, ignore_errors=True)

    def _close_unlocked(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            self._kill(w)
        self._workers = []
        self._selector.close()
        _release_uids(self._uid_leases)


# --------------------------------------------------------------------------------- worker side


class _SoftTimeout(BaseException):
    """Raised by SIGALRM inside a check; BaseException so library ``except Exception`` lets it pass."""


_armed = False


def _on_alarm(signum: int, frame: object) -> None:
    if _armed:
        raise _SoftTimeout


def _apply_limits(memory_limit_mb: int) -> None:
    limits = {
        resource.RLIMIT_AS: memory_limit_mb << 20,
        resource.RLIMIT_CORE: 0,
        resource.RLIMIT_NOFILE: 64,
        resource.RLIMIT_FSIZE: 16 << 20,
    }
    for which, value in limits.items():
        _soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a full log file fails the write, not the worker


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _enter_namespaces() -> tuple[bool, bool]:
    """Enter a network namespace of the worker's own; returns (netns, userns) as they hold. As root
    ``unshare(CLONE_NEWNET)``; otherwise with a user namespace (which needs no privilege where unprivileged
    user namespaces are allowed), or a user namespace alone (RLIMIT_NPROC then still counts per worker)."""
    libc = _libc()
    if os.geteuid() == 0:
        return libc.unshare(_CLONE_NEWNET) == 0, False
    uid, gid = os.getuid(), os.getgid()
    for flags in (_CLONE_NEWUSER | _CLONE_NEWNET, _CLONE_NEWUSER):
        if libc.unshare(flags) == 0:
            _map_own_ids(uid, gid)
            return bool(flags & _CLONE_NEWNET), True
    return False, False


def _map_own_ids(uid: int, gid: int) -> None:
    """Map uid and gid to themselves in the new user namespace: unmapped, the worker is "nobody" there and
    cannot create files. Where that is refused (restricted user namespaces), checks still run without."""
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/gid_map", f"{gid} {gid} 1"),
                       ("/proc/self/uid_map", f"{uid} {uid} 1")):
        try:
            with open(path, "w") as f:
                f.write(text)
        except OSError:
            return


def _hold_import_paths() -> list[tuple[int, str, int]]:
    """A descriptor on each directory of ``sys.path`` (opened while privileged): see _release_import_paths."""
    held = []
    for i, path in enumerate(sys.path):
        if path and os.path.isdir(path):
            try:
                held.append((i, path, os.open(path, os.O_RDONLY | os.O_DIRECTORY)))
            except OSError:
                pass
    return held


def _release_import_paths(held: list[tuple[int, str, int]]) -> None:
    """After the drop, an import path the worker can no longer search (an interpreter under a 0700 /root) is
    replaced by ``/proc/self/fd/N`` of the descriptor opened before, in ``sys.path`` and in the ``__path__`` of
    packages already imported from it: a process may always follow its own descriptor links, so modules that
    the warm-up did not import still import. The other descriptors are closed."""
    moved: dict[str, str] = {}
    for i, path, fd in held:
        if os.access(path, os.R_OK | os.X_OK):
            os.close(fd)
        else:
            sys.path[i] = moved[path] = f"/proc/self/fd/{fd}"
    if not moved:
        return
    for module in list(sys.modules.values()):
        search = getattr(module, "__path__", None)
        if isinstance(search, list):  # a regular package (namespace packages recompute theirs from sys.path)
            search[:] = [_moved(entry, moved) for entry in search]
    importlib.invalidate_caches()


def _moved(entry: str, moved: dict[str, str]) -> str:
    for old, new in moved.items():
        if entry == old or entry.startswith(old + os.sep):
            return new + entry[len(old) :]
    return entry


def _capabilities() -> int:
    """The worker's permitted capability set, from /proc/self/status (0: none)."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1], 16) for line in f if line.startswith("CapPrm:")), 0)


def _drop_privileges(uid: int | None, gid: int | None, max_processes: int) -> dict[str, Any]:
    """No new privileges, the sandbox uid/gid (``uid`` None: the pool's own), no supplementary groups, no
    capabilities, RLIMIT_NPROC = ``max_processes``; returns what holds. Raises (the worker then fails to
    start) when the drop did not take."""
    held = _hold_import_paths()
    libc = _libc()
    no_new_privs = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid) or os.getgroups():
            raise RuntimeError(f"privilege drop to {uid}:{gid} did not take")
    header, data = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:  # zero sets: effective, permitted, inheritable, ambient
        raise OSError(ctypes.get_errno(), "capset")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
    nproc = max_processes if hard == resource.RLIM_INFINITY else min(max_processes, hard)
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    _release_import_paths(held)
    return {"uid": os.getuid(), "nproc": nproc, "no_new_privs": no_new_privs, "capabilities": _capabilities() != 0}


def _arm_cpu_limit(cpu_budget_s: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_budget_s)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd: int, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _probe() -> dict[str, Any]:
    with open("/proc/self/status") as f:
        status = dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)
    cwd = os.stat(".")
    return {
        "env": sorted(os.environ),
        "cwd": os.getcwd(),
        "pid": os.getpid(),
        "pgid": os.getpgid(0),
        "uid": os.getresuid(),
        "gid": os.getresgid(),
        "groups": os.getgroups(),
        "cap_eff": int(status["CapEff"], 16),
        "cap_prm": int(status["CapPrm"], 16),
        "no_new_privs": status.get("NoNewPrivs", "").strip() == "1",
        "cwd_mode": cwd.st_mode & 0o7777,
        "cwd_uid": cwd.st_uid,
        "interfaces": [name for _index, name in socket.if_nameindex()],
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[0],
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "rlimit_nproc": resource.getrlimit(resource.RLIMIT_NPROC)[0],
    }


def _outcome(action: Any) -> str:
    try:
        action()
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _fork_bomb(attempts: int = 200, sleep_s: float = 0.5) -> dict[str, Any]:
    """Fork up to ``attempts`` children that each sleep ``sleep_s`` (so they are all alive while the rest are
    forked), then reap them."""
    children, error = [], ""
    for _ in range(attempts):
        try:
            pid = os.fork()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            break
        if pid == 0:
            try:
                time.sleep(sleep_s)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    return {"forked": len(children), "error": error}


def _orphan() -> int:
    """A child that leaves the worker's process group and session and sleeps a minute; returns its pid once
    it has left."""
    left_r, left_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            os.write(left_w, b"x")
            time.sleep(60)
        finally:
            os._exit(0)
    os.close(left_w)
    os.read(left_r, 1)
    os.close(left_r)
    return pid


def _connect(port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        s.connect(("127.0.0.1", port))


def _test_hook(response: str, memory_limit_mb: int) -> tuple[str, str] | None:
    """Magic responses for the test suite, honoured only with --test-hooks. ``__name__:arg`` passes an argument."""
    name, _, arg = response.partition(":") if response.startswith("__") else (response, "", "")
    if name == "__net__":  # outcome of a TCP connect to 127.0.0.1:arg, and the network interfaces seen
        outcome = _outcome(lambda: _connect(int(arg)))
        return "incorrect", json.dumps({"connect": outcome, "interfaces": [n for _i, n in socket.if_nameindex()]})
    if name == "__peek__":  # outcome of listing the directory arg
        return "incorrect", _outcome(lambda: os.listdir(arg))
    if name == "__import__":  # outcome of importing module arg
        return "incorrect", _outcome(lambda: importlib.import_module(arg))
    if name == "__forkbomb__":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # counted to the end, not cut by the timer
        try:
            return "incorrect", json.dumps(_fork_bomb())
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    if name == "__orphan__":
        return "incorrect", str(_orphan())
    if response == "__hang__":  # pure Python: the soft timer ends it
        while True:
            pass
    if response == "__hang_hard__":  # signals blocked and no CPU used: only the pool's kill ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if response == "__spin_hard__":  # signals blocked, burning CPU: RLIMIT_CPU or the kill ends it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        while True:
            pass
    if response == "__crash__":
        ctypes.string_at(0)  # SIGSEGV
    if response == "__oom__":
        block = bytearray(2 * (memory_limit_mb << 20))
        return "incorrect", f"allocated {len(block)} bytes despite RLIMIT_AS"
    if response == "__probe__":
        return "incorrect", json.dumps(_probe())
    return None


def _serve(args: argparse.Namespace) -> int:
    global _armed
    t0 = time.monotonic()
    _apply_limits(args.memory_limit_mb)
    netns, userns = _enter_namespaces()
    signal.signal(signal.SIGALRM, _on_alarm)
    logging.disable(logging.WARNING)  # math-verify warns per parse failure; results carry the reason

    from async_vapo.verify.check import check_answer

    # Imports and warm-up run before the drop: they read only installed code and these fixed answers.
    for response, answer in _WARMUP:
        check_answer(response, answer, answer_format=args.answer_format)
    reward_fn = None
    if args.reward_fn is not None:  # the operator's code, imported like math-verify (see verify.reward_fn)
        from async_vapo.verify.reward_fn import RewardFnError, load_reward_fn, reward_call, score

        try:
            reward_fn = reward_call(load_reward_fn(args.reward_fn), args.reward_fn)
        except RewardFnError as e:
            _write_all(args.resp_fd, _encode({"kind": "start_error", "v": PROTOCOL_VERSION, "error": str(e)}))
            return 2
    isolation = _drop_privileges(args.uid, args.gid, args.max_processes)
    isolation.update(netns=netns, userns=userns, nproc_scope="worker" if args.uid is not None or userns else "user")
    if check_answer(*_WARMUP[0]) != (True, "correct"):
        raise RuntimeError("grading fails once privileges are dropped")
    ready = {"kind": "ready", "v": PROTOCOL_VERSION, "pid": os.getpid(), "startup_s": time.monotonic() - t0}
    _write_all(args.resp_fd, _encode({**ready, "isolation": isolation}))
    while True:
        header = _read_exact(args.req_fd, _HEADER.size)
        if header is None:
            return 0  # pool closed the pipe
        body = _read_exact(args.req_fd, _HEADER.unpack(header)[0])
        if body is None:
            return 0
        for i, response, answer, *context in json.loads(body)["items"]:
            start = time.perf_counter()
            detail, reward = "", None
            try:
                try:
                    _arm_cpu_limit(args.cpu_limit_s)
                    _armed = True
                    signal.setitimer(signal.ITIMER_REAL, args.soft_timeout_s)
                    hooked = _test_hook(response, args.memory_limit_mb) if args.test_hooks else None
                    if hooked is not None:
                        reason, detail = hooked
                    elif reward_fn is not None:
                        reason, reward, detail = score(reward_fn, response, answer, *context)
                    else:
                        reason = check_answer(response, answer, answer_format=args.answer_format)[1]
                finally:
                    _armed = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _SoftTimeout:
                reason, detail = "timeout", f"soft limit {args.soft_timeout_s:g}s"
            except MemoryError:
                os._exit(_EXIT_MEMORY_ERROR)  # a half-failed allocation may have left state behind
            except Exception as e:
                reason, detail = "parse_error", f"{type(e).__name__}: {e}"[:500]
            reply = {"kind": "result", "i": i, "reason": reason, "seconds": time.perf_counter() - start}
            reply["detail"] = detail
            if reason == "scored":
                reply["reward"] = reward
            _write_all(args.resp_fd, _encode(reply))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m async_vapo.verify.sandbox", description="async-vapo verifier worker"
    )
    parser.add_argument("--worker", action="store_true", help="run the worker loop (started by VerifierPool)")
    parser.add_argument("--req-fd", type=int, required=True, help="pipe fd the pool writes chunks to")
    parser.add_argument("--resp-fd", type=int, required=True, help="pipe fd results are written to")
    parser.add_argument("--memory-limit-mb", type=int, default=1024)
    parser.add_argument("--soft-timeout-s", type=float, default=1.5)
    parser.add_argument("--cpu-limit-s", type=float, default=5.0, help="CPU seconds per check")
    parser.add_argument("--max-processes", type=int, default=4, help="RLIMIT_NPROC (tasks, the worker included)")
    parser.add_argument("--answer-format", default="boxed", choices=("boxed", "answer_line", "auto", "solution"),
                        help="which part of a response is its answer (verify.check)")
    parser.add_argument("--reward-fn", help="grade with this 'module:function' instead (verify.reward_fn)")
    parser.add_argument("--uid", type=int, help="run checks as this uid (the pool runs as root)")
    parser.add_argument("--gid", type=int, help="and this gid")
    parser.add_argument("--test-hooks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("only --worker mode exists")
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
