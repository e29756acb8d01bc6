"""One supervisord per host for the cluster's services: its configuration, and a status view.

deploy/start_cluster.sh writes, in ``RUN_DIR/supervisor/`` of each host that runs services:

* ``NAME.sh`` per service: the launcher supervisord runs as program ``NAME``. It writes its PID (= the service's:
  it ends in ``exec``; supervisord gives each program a process group of its own, so the PID is also the group id)
  to ``RUN_DIR/pids/NAME.pid`` at every start, appends it to ``NAME.starts`` (one line per start), sends its output
  to ``RUN_DIR/logs/NAME.log`` with a ``[supervise] NAME: start N`` line, and runs the service. A restarted learner
  resumes from the newest checkpoint this cluster run wrote.
* ``TAG.conf`` (tag ``local`` for this machine, else the host's name), written here (:func:`write_conf`): the
  services in one group ``services`` (so a shutdown stops them all at once: SIGTERM to each process group — to a
  continuous rollout service alone, which shuts its engine down itself — SIGKILL to the group after
  ``cluster.deploy.stop_grace_s``), ``autorestart=false`` with restarts, backoff and the crash-loop limit left
  to the event listener :mod:`async_vapo.deploy.crashloop`; supervisord's log ``RUN_DIR/logs/supervisord-TAG.log``,
  the listener's ``RUN_DIR/logs/supervisor-TAG.log``; its pidfile ``TAG.pid`` and control socket ``TAG.sock`` here
  (a socket path longer than a UNIX socket allows moves to ``/tmp/async-vapo-supervisor-<hash>.sock``).

Why supervisord (PyPI ``supervisor``, 4.3): a small, long-maintained process manager that runs as an ordinary user
with no system service manager (no systemd in containers, none over a plain ssh login), speaks XML-RPC for control
and an event-listener protocol for policies, and is a pure-Python wheel that installs into the project's venv on every
host. Measured here: it starts a service's launcher in a few milliseconds after a restart is requested, and a
program that dies after ``startsecs`` is restarted at once and without limit by supervisord itself, which is why
restarts go through the listener.

``python -m async_vapo.deploy.supervise conf ...`` writes a host's config (called by start_cluster.sh);
``python -m async_vapo.deploy.supervise status RUN_DIR`` prints every local supervisor's programs, their starts and
what the crash-loop listener decided.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from async_vapo.config import load_config
from async_vapo.config.schema import DeployConfig

GROUP = "services"
MAX_SOCKET_PATH = 100
"""Longest UNIX socket path used as is (the kernel's limit is 107 bytes)."""


def socket_path(sup_dir: Path, tag: str) -> str:
    path = str(sup_dir / f"{tag}.sock")
    if len(path) <= MAX_SOCKET_PATH:
        return path
    return f"/tmp/async-vapo-supervisor-{hashlib.sha1(path.encode()).hexdigest()[:16]}.sock"


def _ini(value: str | Path) -> str:
    """A value for supervisord's config: ``%`` starts an expansion there."""
    return str(value).replace("%", "%%")


def write_conf(run_dir: Path, tag: str, programs: Sequence[str], deploy: DeployConfig, python: str,
               repo: Path, extra: Sequence[str] = (), weights_dir: str | None = None,
               rollout_stops_engine: bool = False) -> Path:
    """``RUN_DIR/supervisor/TAG.conf`` running ``programs`` (each ``RUN_DIR/supervisor/NAME.sh``) and the crash-loop
    listener. ``extra``: programs outside the services group (prometheus), restarted by supervisord itself.
    ``weights_dir``: where a learner's weight slots live (the listener removes a dead learner's).
    ``rollout_stops_engine`` (``rollout.generation = "continuous"``, whose service sees its stop flag between engine
    steps): a rollout service gets the stop's SIGTERM alone and shuts its engine down itself (requests aborted, the
    engine core idle), instead of its engine's processes being signalled mid-step with it; its group is SIGKILLed if
    it is not gone after ``stop_grace_s``. A lock-step service may be inside a long ``generate`` call: its group is
    signalled at once, as every other service's."""
    sup = run_dir / "supervisor"
    sock = socket_path(sup, tag)
    stop_wait = max(1, int(round(deploy.stop_grace_s)))
    # supervisord's own retries of a program dying before startsecs; the listener's limit applies on top
    start_retries = max(deploy.crash_loop_max_restarts, 0) if deploy.restart else 0
    lines = [
        f"; the supervisord of host tag {tag!r} of the async-vapo cluster in {run_dir} (async_vapo.deploy.supervise)",
        "[supervisord]",
        f"logfile={_ini(run_dir / 'logs' / f'supervisord-{tag}.log')}",
        "logfile_maxbytes=0",
        f"pidfile={_ini(sup / f'{tag}.pid')}",
        f"childlogdir={_ini(sup)}",
        f"directory={_ini(repo)}",
        f"identifier=async-vapo-{tag}",
        "loglevel=info",
        "",
        "[unix_http_server]",
        f"file={_ini(sock)}",
        "chmod=0700",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{_ini(sock)}",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
    ]
    for name in [*programs, *extra]:
        in_group = name in programs
        lines += [
            f"[program:{name}]",
            f"command=/bin/bash {_ini(shlex.quote(str(sup / f'{name}.sh')))}",
            "autostart=true",
            # services: the listener restarts them (backoff, crash-loop limit); others: supervisord, at once
            f"autorestart={'false' if in_group else 'unexpected'}",
            f"startsecs={deploy.start_s}",
            f"startretries={start_retries}",
            "exitcodes=0",
            "stopsignal=TERM",
            f"stopwaitsecs={stop_wait}",
            # SIGTERM to the whole group ends an engine's worker mid-step (vLLM's "RuntimeError: cancelled")
            f"stopasgroup={'false' if rollout_stops_engine and name.startswith('rollout') else 'true'}",
            "killasgroup=true",
            "stdout_logfile=NONE",  # the launcher writes RUN_DIR/logs/NAME.log itself: no pipe through supervisord
            "stderr_logfile=NONE",
            "priority=100",
            "",
        ]
    if programs:
        lines += [f"[group:{GROUP}]", f"programs={','.join(programs)}", "priority=100", ""]
    listener = [python, "-m", "async_vapo.deploy.crashloop", "--run-dir", str(run_dir), "--tag", tag,
                "--group", GROUP, "--max-restarts", str(deploy.crash_loop_max_restarts),
                "--window-s", f"{deploy.crash_loop_window_s:g}", "--backoff-s", f"{deploy.restart_backoff_s:g}",
                "--backoff-max-s", f"{deploy.restart_backoff_max_s:g}"]
    if not deploy.restart:
        listener.append("--no-restart")
    if weights_dir:
        listener += ["--weights-dir", weights_dir]
    lines += [
        "[eventlistener:crashloop]",
        f"command={_ini(shlex.join(listener))}",
        "events=PROCESS_STATE",
        "autostart=true",
        "autorestart=true",
        "startsecs=1",
        "buffer_size=100",
        "stdout_logfile=NONE",  # its stdout is the event protocol
        f"stderr_logfile={_ini(run_dir / 'logs' / f'supervisor-{tag}.log')}",
        "stderr_logfile_maxbytes=0",
        "priority=1",  # started first, stopped last
        "",
    ]
    sup.mkdir(parents=True, exist_ok=True)
    path = sup / f"{tag}.conf"
    path.write_text("\n".join(lines))
    return path


def _conf(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser(prog="supervise conf")
    p.add_argument("--config", action="append", default=[])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--tag", required=True)
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--programs", nargs="*", default=[])
    p.add_argument("--extra", nargs="*", default=[], help="programs outside the services group (prometheus)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    repo = Path(__file__).resolve().parents[2]
    weights = cfg.cluster.weights.dir
    weights = str(Path(weights).expanduser()) if weights else "/dev/shm"  # as weights.sync.default_weights_dir
    path = write_conf(Path(args.run_dir).resolve(), args.tag, args.programs, cfg.cluster.deploy, args.python, repo,
                      args.extra, weights, rollout_stops_engine=cfg.rollout.generation == "continuous")
    print(path)
    return 0


def status(run_dir: Path) -> str:
    """Every local supervisor's programs (state, pid, uptime), their starts and the listener's decisions."""
    from supervisor import xmlrpc
    from supervisor.compat import xmlrpclib

    sup = run_dir / "supervisor"
    out = []
    for conf in sorted(sup.glob("*.conf")):
        tag = conf.stem
        out.append(f"== supervisor {tag} ({conf})")
        sock = socket_path(sup, tag)
        try:
            proxy = xmlrpclib.ServerProxy("http://127.0.0.1", xmlrpc.SupervisorTransport("", "", f"unix://{sock}"))
            infos = proxy.supervisor.getAllProcessInfo()
        except Exception as exc:
            out.append(f"   not running ({exc.__class__.__name__}: {exc})")
            infos = []
        for info in infos:
            name = info["name"]
            starts = sup / f"{name}.starts"
            n = len(starts.read_text().split()) if starts.exists() else 0
            gave_up = sup / f"{name}.gave_up"
            why = f"  GAVE UP: {gave_up.read_text().strip()}" if gave_up.exists() else ""
            out.append(f"   {info['group'] + ':' + name:24s} {info['statename']:9s} {info['description']:28s} "
                       f"starts {n}{why}")
        events = sup / f"events-{tag}.jsonl"
        if events.exists():
            tail = [json.loads(x) for x in events.read_text().splitlines()[-8:]]
            out.append("   last events: " + "; ".join(f"{e['name']} {e['event']}" for e in tail))
    return "\n".join(out) if out else f"no supervisor config in {sup}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["conf"]:
        return _conf(argv[1:])
    if argv[:1] == ["status"] and len(argv) == 2:
        print(status(Path(argv[1])))
        return 0
    print("usage: python -m async_vapo.deploy.supervise {conf --run-dir D --tag T --programs NAME... [--config F]"
          " [-- overrides] | status RUN_DIR}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
