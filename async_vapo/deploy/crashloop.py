"""Restarts with backoff and the crash-loop limit of the supervised services: a supervisord event listener.

supervisord (one per host, config written by :mod:`async_vapo.deploy.supervise`) starts the services with
``autorestart=false`` and runs this program as an ``[eventlistener]`` on ``PROCESS_STATE`` events. supervisord's own
restart policy does not suffice: its backoff and ``startretries`` apply only while a program is *starting* (before
``startsecs``); a program that dies after it counts as running is restarted at once and without limit. So this
listener makes the decisions, per program of the services group:

* ``EXITED`` with an unexpected status (non-zero, or killed by a signal): first whatever is left of the dead
  process's group is killed (a vLLM engine core, torchrun's ranks) and so are its sandbox workers listed in
  ``RUN_DIR/pids/NAME.children`` (they run in sessions of their own), and a dead learner's weight slots are removed
  from /dev/shm (:func:`kill_leftovers`); then the crash is counted. A program with
  more than ``max_restarts`` crashes within ``window_s`` seconds is given up; otherwise it is started again over
  supervisord's XML-RPC interface after ``backoff_s * 2**(k-1)`` seconds (k: its crashes within the window), at
  most ``backoff_max_s``.
* ``EXITED`` with status 0: the service was stopped on purpose (SIGTERM ends a service's loop with status 0). Not
  restarted.
* ``BACKOFF`` (it died before ``startsecs``; supervisord retries it, 1, 2, 3 ... s apart): what is left of the dead
  attempt is killed as for ``EXITED`` (its group is the PID its launcher wrote, once that process is gone:
  :func:`dead_attempt_group`; a service dying while its vLLM engine starts would otherwise leave the engine's
  processes running), and it is counted as a crash too; over the limit, the program is stopped over XML-RPC.
* ``FATAL`` (supervisord gave up after ``startretries``): given up.

Giving up is never silent: the reason is logged (this listener's stderr, ``RUN_DIR/logs/supervisor-TAG.log``) and
written to ``RUN_DIR/supervisor/NAME.gave_up``, which start_cluster.sh checks while it waits for health and for
the learner's DONE. Every event and decision is appended as one JSON line to ``RUN_DIR/supervisor/events-TAG.jsonl``
(``t`` = Unix time): ``running`` (with the pid), ``exited``, ``backoff``, ``fatal``, ``restart_scheduled`` (with
``delay_s``), ``restarted``, ``gave_up`` (with ``reason``).

Nothing is restarted while supervisord itself is shutting down (deploy/stop_cluster.sh), and with
``--no-restart`` (``cluster.deploy.restart = false``) every death is final.

The decision arithmetic is :class:`CrashLoopPolicy` (pure, unit-tested); :func:`main` is the listener protocol.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("async_vapo.crashloop")


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float = 0.0
    reason: str = ""
    crashes_in_window: int = 0


@dataclass
class CrashLoopPolicy:
    """When to restart a crashed program, and when to give up on it (see the module docstring)."""

    max_restarts: int
    window_s: float
    backoff_s: float
    backoff_max_s: float
    restart: bool = True
    crashes: dict[str, deque] = field(default_factory=dict)

    def on_crash(self, name: str, now: float) -> Decision:
        """Count one crash of ``name`` at ``now`` (seconds, any monotonic origin) and decide."""
        q = self.crashes.setdefault(name, deque())
        q.append(now)
        while q and q[0] <= now - self.window_s:
            q.popleft()
        k = len(q)
        if not self.restart:
            return Decision(False, reason="restarts are disabled (cluster.deploy.restart = false)", crashes_in_window=k)
        if k > self.max_restarts:
            return Decision(False, reason=f"crash loop: {k} crashes within {self.window_s:g} s "
                                          f"(cluster.deploy.crash_loop_max_restarts = {self.max_restarts})",
                            crashes_in_window=k)
        return Decision(True, delay_s=min(self.backoff_max_s, self.backoff_s * 2 ** (k - 1)), crashes_in_window=k)


def parse_payload(payload: str) -> dict[str, str]:
    """``processname:x groupname:y from_state:RUNNING expected:0 pid:12`` -> dict (the header line of a
    PROCESS_STATE event's payload)."""
    return dict(token.split(":", 1) for token in payload.split("\n", 1)[0].split() if ":" in token)


def kill_leftovers(run_dir: Path, name: str, pgid: int | None, weights_dir: Path | None = None) -> list[str]:
    """SIGKILL what is left of a dead service: its process group (its leader is gone, its children may not be) and
    the sandbox workers it listed in RUN_DIR/pids/NAME.children (only PIDs that still run the sandbox); and remove
    the weight slots a dead learner left in ``weights_dir`` (``async-vapo-<run name>-<its pid>``: memory in
    /dev/shm that nothing else would free; an engine still mapping one keeps its pages until it unmaps)."""
    killed = []
    if pgid and weights_dir is not None:
        for d in weights_dir.glob(f"async-vapo-*-{pgid}"):
            shutil.rmtree(d, ignore_errors=True)
            killed.append(f"weights {d}")
    if pgid:
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed.append(f"group {pgid}")
        except (ProcessLookupError, PermissionError):
            pass
    children = run_dir / "pids" / f"{name}.children"
    try:
        pids = [int(x) for x in children.read_text().split()]
    except (OSError, ValueError):
        pids = []
    for pid in pids:
        try:
            if b"async_vapo.verify.sandbox" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGKILL)
            killed.append(f"sandbox worker {pid}")
        except (OSError, ProcessLookupError):
            pass
    return killed


def dead_attempt_group(run_dir: Path, name: str) -> int | None:
    """The process group of a start attempt that died before ``startsecs`` (supervisord's BACKOFF event carries no
    PID): the PID its launcher wrote to RUN_DIR/pids/NAME.pid, which leads its own group, when that leader is gone.
    None when the file is missing or its process still runs (a newer attempt already wrote its own PID: nothing of
    it may be killed)."""
    try:
        pid = int((run_dir / "pids" / f"{name}.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return pid
    except PermissionError:
        return None
    return None


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Whether process group ``pgid`` is empty within ``timeout_s`` (a killed process with GiBs of memory takes
    a moment to be reaped, and holds its ports until then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


class Listener:
    """The listener's state: the policy, where to write, and how to reach supervisord."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str]):
        self.run_dir = Path(args.run_dir)
        self.tag, self.group = args.tag, args.group
        self.sup_dir = self.run_dir / "supervisor"
        self.events_path = self.sup_dir / f"events-{self.tag}.jsonl"
        self.env = env
        self.weights_dir = Path(args.weights_dir) if args.weights_dir else None
        self.policy = CrashLoopPolicy(args.max_restarts, args.window_s, args.backoff_s, args.backoff_max_s,
                                      restart=args.restart)
        self._lock = threading.Lock()

    def rpc(self):
        from supervisor import childutils  # a fresh proxy per call: ServerProxy is not thread-safe

        return childutils.getRPCInterface(self.env).supervisor

    def record(self, event: str, name: str, **fields) -> None:
        line = json.dumps({"t": round(time.time(), 3), "host": self.tag, "name": name, "event": event, **fields})
        with self._lock, self.events_path.open("a") as f:
            f.write(line + "\n")

    def give_up(self, name: str, reason: str, stop: bool) -> None:
        log.error("%s: not restarted again: %s", name, reason)
        (self.sup_dir / f"{name}.gave_up").write_text(reason + "\n")
        self.record("gave_up", name, reason=reason)
        if stop:
            try:
                self.rpc().stopProcess(f"{self.group}:{name}", False)
            except Exception as exc:  # already stopped, or supervisord is going away
                log.warning("%s: stopProcess: %s", name, exc)

    def shutting_down(self) -> bool:
        try:
            return self.rpc().getState()["statename"] != "RUNNING"
        except Exception:
            return True

    def restart_later(self, name: str, pgid: int | None, delay_s: float) -> None:
        t0 = time.monotonic()
        if pgid:
            wait_group_gone(pgid, 15.0)
        time.sleep(max(0.0, delay_s - (time.monotonic() - t0)))
        if self.shutting_down():
            log.info("%s: supervisord is stopping: not restarted", name)
            return
        try:
            self.rpc().startProcess(f"{self.group}:{name}", False)
        except Exception as exc:
            log.error("%s: restart failed: %s", name, exc)
            self.record("restart_failed", name, error=str(exc))
            return
        log.info("%s: restarted", name)
        self.record("restarted", name)

    def kill_dead_attempt(self, name: str) -> list[str]:
        """What is left of a start attempt that died before ``startsecs`` (:func:`dead_attempt_group`)."""
        pgid = dead_attempt_group(self.run_dir, name)
        return kill_leftovers(self.run_dir, name, pgid, self.weights_dir) if pgid else []

    def handle(self, eventname: str, payload: str) -> None:
        h = parse_payload(payload)
        name = h.get("processname", "")
        if h.get("groupname") != self.group or not name:
            return
        pid = int(h["pid"]) if h.get("pid", "").isdigit() else None
        if eventname == "PROCESS_STATE_RUNNING":
            self.record("running", name, pid=pid)
        elif eventname == "PROCESS_STATE_EXITED":
            expected = h.get("expected") == "1"
            killed = kill_leftovers(self.run_dir, name, pid, self.weights_dir)
            self.record("exited", name, pid=pid, expected=expected, killed=killed)
            if expected:
                self.give_up(name, "exited with status 0 (stopped on purpose)", stop=False)
                return
            if self.shutting_down():
                return
            d = self.policy.on_crash(name, time.monotonic())
            if not d.restart:
                self.give_up(name, d.reason, stop=False)
                return
            log.warning("%s (pid %s) died; crash %d within the window: restart in %.1f s%s", name, pid,
                        d.crashes_in_window, d.delay_s, f" (killed {', '.join(killed)})" if killed else "")
            self.record("restart_scheduled", name, pid=pid, delay_s=d.delay_s, crashes_in_window=d.crashes_in_window)
            threading.Thread(target=self.restart_later, args=(name, pid, d.delay_s), daemon=True).start()
        elif eventname == "PROCESS_STATE_BACKOFF":
            # died before startsecs: supervisord retries it itself, and what its process group started lives on
            self.record("backoff", name, tries=h.get("tries"), killed=self.kill_dead_attempt(name))
            if self.shutting_down():
                return
            d = self.policy.on_crash(name, time.monotonic())
            if not d.restart:
                self.give_up(name, d.reason, stop=True)
        elif eventname == "PROCESS_STATE_FATAL":  # the last attempt died before startsecs too
            self.record("fatal", name, killed=self.kill_dead_attempt(name))
            self.give_up(name, "could not be started (supervisord: FATAL after startretries)", stop=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m async_vapo.deploy.crashloop", description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--tag", required=True, help="this host's supervisor tag (RUN_DIR/supervisor/TAG.conf)")
    p.add_argument("--group", default="services", help="the supervisord group of the services")
    p.add_argument("--max-restarts", type=int, required=True)
    p.add_argument("--window-s", type=float, required=True)
    p.add_argument("--backoff-s", type=float, required=True)
    p.add_argument("--backoff-max-s", type=float, required=True)
    p.add_argument("--no-restart", dest="restart", action="store_false")
    p.add_argument("--weights-dir", help="where a learner's weight slots live (cluster.weights.dir, or /dev/shm)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s crashloop-{args.tag} %(levelname)s: %(message)s")
    from supervisor import childutils

    listener = Listener(args, dict(os.environ))
    log.info("watching group %r: restart %s, at most %d crashes per %g s, backoff %g s doubling up to %g s",
             args.group, "on" if args.restart else "off", args.max_restarts, args.window_s, args.backoff_s,
             args.backoff_max_s)
    while True:  # stdout is supervisord's protocol channel: nothing else may be written to it
        headers, payload = childutils.listener.wait(sys.stdin, sys.stdout)
        try:
            listener.handle(headers.get("eventname", ""), payload)
        except Exception:  # one bad event never takes the listener down
            log.exception("handling %s failed", headers.get("eventname"))
        childutils.listener.ok(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
