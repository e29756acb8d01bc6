"""A real supervisord with the config start_cluster.sh gets (async_vapo.deploy.supervise) and the crash-loop listener
(async_vapo.deploy.crashloop), on three small programs instead of the services: one that keeps crashing after it
counts as running (restarted with doubling backoff until the limit trips, then left stopped with the reason written
down), one SIGKILLed by the test while a child runs in its process group (the child is killed, the program
restarted, its PID file rewritten), one that exits 0 (stopped on purpose: not restarted), and one that dies before
``startsecs`` while a child runs in its group (supervisord retries it itself; the listener kills each dead attempt's
leftovers). Then a shutdown: nothing is restarted, nothing is left. About 20 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import group_alive

from async_vapo.config import load_config
from async_vapo.deploy.supervise import status, write_conf

REPO = Path(__file__).resolve().parents[2]


def _launcher(run: Path, name: str, body: str) -> None:
    """A launcher like start_cluster.sh's: PID file, log, one line per start, then the program."""
    (run / "supervisor" / f"{name}.sh").write_text(
        f"echo $$ > {run}/pids/{name}.pid\nexec >> {run}/logs/{name}.log 2>&1 < /dev/null\n"
        f"echo $$ >> {run}/supervisor/{name}.starts\n{body}\n")


def _events(run: Path) -> list[dict]:
    path = run / "supervisor" / "events-local.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _runs_sleep(pid: int) -> bool:
    """Whether ``pid`` is a live ``sleep`` (a zombie has an empty command line)."""
    try:
        return b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _wait(what: str, cond, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def _ints(path: Path) -> list[int]:
    """The pids in a file another process writes (``echo $! > f``): [] while it is missing or not yet written (the
    shell creates the file before it writes the number, and supervisord its pidfile likewise)."""
    try:
        return [int(x) for x in path.read_text().split()]
    except (FileNotFoundError, ValueError):
        return []


def _pid(what: str, path: Path, timeout_s: float = 10) -> int:
    _wait(what, lambda: _ints(path), timeout_s)
    return _ints(path)[0]


def test_restarts_backoff_crash_loop_limit_and_shutdown(tmp_path):
    run = tmp_path / "run"
    for d in ("supervisor", "pids", "logs"):
        (run / d).mkdir(parents=True)
    deploy = load_config([], ["cluster.deploy.start_s=1", "cluster.deploy.crash_loop_max_restarts=2",
                              "cluster.deploy.crash_loop_window_s=60", "cluster.deploy.restart_backoff_s=0.5",
                              "cluster.deploy.stop_grace_s=5"]).cluster.deploy
    _launcher(run, "crashy", "sleep 1.5; exit 3")  # dies after startsecs: supervisord alone would restart it forever
    _launcher(run, "worker", f"sleep 300 & echo $! > {run}/worker.child\nwait")
    _launcher(run, "quitter", "sleep 1.5; exit 0")
    # dies before startsecs (supervisord's BACKOFF, retried by supervisord itself) while a child runs in its group
    _launcher(run, "early", f"sleep 300 & echo $! >> {run}/early.children\nsleep 0.2; exit 1")
    conf = write_conf(run, "local", ["crashy", "worker", "quitter", "early"], deploy, sys.executable, REPO)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "supervisor.supervisord", "-c", str(conf)], check=True, env=env)
    sup_pid = None
    try:
        sup_pid = _pid("supervisord's pidfile", run / "supervisor" / "local.pid")

        # worker: SIGKILL its main process while its child runs in the same process group
        child = _pid("the worker's child", run / "worker.child")
        first = _pid("the worker's pid", run / "pids" / "worker.pid")
        assert os.getpgid(first) == first and os.getpgid(child) == first  # a process group of its own
        _wait("the worker running", lambda: any(e["name"] == "worker" and e["event"] == "running"
                                                 for e in _events(run)), 15)  # past startsecs: an EXITED death
        os.kill(first, signal.SIGKILL)
        _wait("the worker restarted", lambda: _ints(run / "pids" / "worker.pid") not in ([], [first]), 10)
        assert not _runs_sleep(child)
        assert not group_alive(first)

        # early: each attempt's child is killed with its dead attempt, though supervisord restarts it on its own
        early_first = _pid("the early child", run / "early.children")
        _wait("early's first child killed", lambda: not _runs_sleep(early_first), 10)

        # crashy: restarted after 0.5 s, then 1 s; the third crash within 60 s exceeds the limit of 2
        gave_up = run / "supervisor" / "crashy.gave_up"
        _wait("crashy given up", gave_up.exists, 30)
        assert "crash loop: 3 crashes within 60 s" in gave_up.read_text()
        assert len((run / "supervisor" / "crashy.starts").read_text().split()) == 3
        crashy = [e for e in _events(run) if e["name"] == "crashy"]
        assert [e["delay_s"] for e in crashy if e["event"] == "restart_scheduled"] == [0.5, 1.0]
        assert [e["event"] for e in crashy].count("restarted") == 2 and crashy[-1]["event"] == "gave_up"
        starts = [e["t"] for e in crashy if e["event"] in ("exited", "restarted")]
        assert starts[1] - starts[0] >= 0.5 and starts[3] - starts[2] >= 1.0  # the backoff was waited

        # quitter: exit 0 is a deliberate stop
        _wait("quitter recorded", (run / "supervisor" / "quitter.gave_up").exists, 10)
        assert "status 0" in (run / "supervisor" / "quitter.gave_up").read_text()
        time.sleep(2.0)  # nothing starts crashy or quitter again
        assert len((run / "supervisor" / "crashy.starts").read_text().split()) == 3
        assert len((run / "supervisor" / "quitter.starts").read_text().split()) == 1
        text = status(run)
        assert "services:crashy" in text and "GAVE UP: crash loop" in text and "services:worker" in text

        # shutdown: the worker is stopped as a group and not restarted; supervisord exits
        worker = _pid("the worker's pid", run / "pids" / "worker.pid")
        os.kill(sup_pid, signal.SIGTERM)
        _wait("supervisord gone", lambda: not Path(f"/proc/{sup_pid}").exists(), 15)
        assert not group_alive(worker)
        assert int((run / "pids" / "worker.pid").read_text()) == worker
        early = [int(x) for x in (run / "early.children").read_text().split()]
        assert len(early) >= 2 and not [c for c in early if _runs_sleep(c)]  # every attempt's child went with it
    finally:
        if sup_pid and Path(f"/proc/{sup_pid}").exists():
            os.kill(sup_pid, signal.SIGKILL)
        for name in ("crashy", "worker", "quitter", "early"):
            f = run / "pids" / f"{name}.pid"
            if f.exists() and group_alive(int(f.read_text())):
                os.killpg(int(f.read_text()), signal.SIGKILL)
