"""Sandboxed answer verification: a pool of persistent, resource-limited worker processes.

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
- It imports math-verify and grades a few warm-up answers, then sends READY. The pool waits for
  READY at most ``start_timeout_s``; a worker that does not make it raises ``WorkerStartError``.

Wire protocol (private to this module; both ends live here)
- Two anonymous pipes per worker (``pass_fds``), each message a 4-byte big-endian length then
  ASCII JSON (``ensure_ascii`` keeps lone surrogates intact). The parent drops a worker whose
  message header announces more than ``_MAX_REPLY_BYTES`` before reading the body.
- worker -> pool ``{"kind": "ready", "v": PROTOCOL_VERSION, "pid", "startup_s"}``, once.
- pool -> worker ``{"items": [[index, response, answer], ...]}``: a chunk, graded in order.
- worker -> pool ``{"kind": "result", "i", "reason", "seconds", "detail"}``, one per item, sent as
  soon as that item is done.

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
- Before any IPC, non-``str`` inputs give "bad_input" and a response or answer longer than
  ``max_response_chars`` gives "too_long". ``verify`` raises only for a closed pool or a worker that
  cannot start (then the pool closes itself); never because of what a response contains.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import resource
import selectors
import shutil
import signal
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

REASONS = ("correct", "incorrect", "no_answer", "parse_error", "timeout", "crash", "too_long", "bad_input")
PROTOCOL_VERSION = 1

_HEADER = struct.Struct(">I")
_MAX_REPLY_BYTES = 1 << 20
_MAX_UNREAD_REQUEUES = 3
_EXIT_MEMORY_ERROR = 3
_READ_SIZE = 1 << 16
_ENV_WHITELIST = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])

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


@dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen[bytes]
    req_fd: int  # pool writes, non-blocking
    resp_fd: int  # pool reads, non-blocking
    tmpdir: str
    spawned_at: float
    deadline: float  # start deadline until READY, then the current item's deadline
    ready: bool = False
    startup_s: float = math.nan
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    writing: bool = False
    inflight: deque[int] = field(default_factory=deque)  # item indices sent, results pending, in order


class VerifierPool:
    """Grade model responses in sandboxed worker processes; see the module docstring.

    ``verify`` is thread-safe (calls are serialized). ``_test_hooks`` makes workers honour magic
    responses (``__hang__``, ``__hang_hard__``, ``__spin_hard__``, ``__crash__``, ``__oom__``,
    ``__probe__``; see ``_test_hook``) for the test suite only; never enable it for real traffic.
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
        try:
            for _ in range(num_workers):
                self._workers.append(self._spawn())
            self._wait_ready()
        except BaseException:
            self._close_unlocked()
            raise

    # ----------------------------------------------------------------------------------- public

    @classmethod
    def from_config(cls, v, *, num_workers: int | None = None) -> VerifierPool:
        """The pool of a ``VerifierConfig`` (``num_workers`` overrides its worker count)."""
        return cls(num_workers=num_workers or v.num_workers, timeout_s=v.timeout_s, memory_limit_mb=v.memory_limit_mb,
                   max_response_chars=v.max_response_chars, reward_correct=v.reward_correct,
                   reward_incorrect=v.reward_incorrect)

    def verify(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        """Grade ``(response, answer)`` pairs; results come back in input order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool is closed")
            try:
                return self._verify_unlocked(items)
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

    def _result(self, reason: str, seconds: float = 0.0, detail: str = "") -> VerifyResult:
        self._counts[reason] += 1
        return VerifyResult(self._rewards[reason], reason == "correct", reason, seconds, detail)

    def _verify_unlocked(self, items: Sequence[tuple[str, str]]) -> list[VerifyResult]:
        for w in list(self._workers):
            if w.inflight or w.outbuf:  # left over from a call interrupted mid-flight (KeyboardInterrupt)
                self._replace(w, [], deque(), None, "")
        results: list[VerifyResult | None] = [None] * len(items)
        payload: dict[int, tuple[str, str]] = {}
        self._unread_requeues.clear()
        pending: deque[int] = deque()
        for i, item in enumerate(items):
            try:
                if isinstance(item, str):
                    raise TypeError
                response, answer = item
            except (TypeError, ValueError):
                results[i] = self._result("bad_input", detail="item is not a (response, answer) pair")
                continue
            if not isinstance(response, str) or not isinstance(answer, str):
                results[i] = self._result("bad_input", detail="response and answer must be str")
            elif len(response) > self.max_response_chars or len(answer) > self.max_response_chars:
                results[i] = self._result("too_long", detail=f"over {self.max_response_chars} chars")
            else:
                payload[i] = (response, answer)
                pending.append(i)

        while pending or any(w.inflight for w in self._workers):
            now = time.monotonic()
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
            for key, events in self._selector.select(max(0.0, min(waits) - time.monotonic())):
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
            if kind == "ready" and not w.ready:
                if msg.get("v") != PROTOCOL_VERSION:
                    raise WorkerStartError(f"worker speaks protocol {msg.get('v')}, pool {PROTOCOL_VERSION}")
                w.ready = True
                w.deadline = math.inf
                w.startup_s = time.monotonic() - w.spawned_at
                self._last_start_s = w.startup_s
            elif kind == "result" and w.inflight and msg.get("i") == w.inflight[0]:
                reason = msg.get("reason")
                if reason not in ("correct", "incorrect", "no_answer", "parse_error", "timeout"):
                    raise _ProtocolError(f"unknown reason {reason!r}")
                i = w.inflight.popleft()
                results[i] = self._result(reason, float(msg.get("seconds", 0.0)), str(msg.get("detail", "")))
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
        self._workers[self._workers.index(w)] = self._spawn()
        self._workers_replaced += 1

    def _spawn(self) -> _Worker:
        tmpdir = tempfile.mkdtemp(prefix="async-vapo-verify-")
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
        ]  # fmt: skip
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
        w = _Worker(proc, req_w, resp_r, tmpdir, spawned_at=now, deadline=now + self.start_timeout_s)
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
        shutil.rmtree(w.tmpdir, ignore_errors=True)

    def _close_unlocked(self) -> None:
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            self._kill(w)
        self._workers = []
        self._selector.close()


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


def _test_hook(response: str, memory_limit_mb: int) -> tuple[str, str] | None:
    """Magic responses for the test suite, honoured only with --test-hooks."""
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
        import ctypes

        ctypes.string_at(0)  # SIGSEGV
    if response == "__oom__":
        block = bytearray(2 * (memory_limit_mb << 20))
        return "incorrect", f"allocated {len(block)} bytes despite RLIMIT_AS"
    if response == "__probe__":
        probe = {
            "env": sorted(os.environ),
            "cwd": os.getcwd(),
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
            "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[0],
            "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        }
        return "incorrect", json.dumps(probe)
    return None


def _serve(args: argparse.Namespace) -> int:
    global _armed
    t0 = time.monotonic()
    _apply_limits(args.memory_limit_mb)
    signal.signal(signal.SIGALRM, _on_alarm)
    logging.disable(logging.WARNING)  # math-verify warns per parse failure; results carry the reason

    from async_vapo.verify.check import check_answer

    for response, answer in _WARMUP:
        check_answer(response, answer)
    _write_all(
        args.resp_fd,
        _encode(
            {"kind": "ready", "v": PROTOCOL_VERSION, "pid": os.getpid(), "startup_s": time.monotonic() - t0}
        ),
    )
    while True:
        header = _read_exact(args.req_fd, _HEADER.size)
        if header is None:
            return 0  # pool closed the pipe
        body = _read_exact(args.req_fd, _HEADER.unpack(header)[0])
        if body is None:
            return 0
        for i, response, answer in json.loads(body)["items"]:
            start = time.perf_counter()
            detail = ""
            try:
                try:
                    _arm_cpu_limit(args.cpu_limit_s)
                    _armed = True
                    signal.setitimer(signal.ITIMER_REAL, args.soft_timeout_s)
                    hooked = _test_hook(response, args.memory_limit_mb) if args.test_hooks else None
                    if hooked is not None:
                        reason, detail = hooked
                    else:
                        reason = check_answer(response, answer)[1]
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
    parser.add_argument("--test-hooks", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not args.worker:
        parser.error("only --worker mode exists")
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
