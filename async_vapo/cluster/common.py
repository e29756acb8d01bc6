"""What every service of the cluster shares: arguments, config, logging, metrics server, signals, pipes.

A service process is ``services/<name>.py``: it parses :func:`service_arg_parser`'s arguments, calls
:func:`make_context` (config with the run directory applied, logging to stderr, which start_cluster.sh
sends to ``RUN_DIR/logs/<service>.log``, a :class:`~async_vapo.metrics.prom.MetricsServer`, SIGTERM /
SIGINT turned into ``ctx.stop``) and runs one loop from this package. Loops poll with timeouts and
check ``ctx.stop`` between polls, so a signal ends a service within about one poll period (plus the
step in progress: a generate call or a learner update).

Policies at the service boundary (STYLE.md "errors propagate, except at a service boundary"):

* a frame a decoder rejects is counted in ``async_vapo_<service>_wire_rejects_total{reason}`` and
  logged (rate-limited) by the transport; the service keeps serving;
* a message that decodes but fails while being processed (one bad group) is counted in
  ``async_vapo_<service>_processing_errors_total{stage}`` and logged with its traceback; the service
  keeps serving;
* a push into a full pipe (``BackpressureFull``) is retried until it goes through or the service is
  stopped, counted in ``async_vapo_<service>_backpressure_total`` — the sender holds its own work
  meanwhile, which is how backpressure travels upstream instead of queues growing.

``python -m async_vapo.cluster.common plan ...`` and ``... wait-health ...`` are the two helpers that
``deploy/start_cluster.sh`` calls (no torch import: they take well under a second).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from async_vapo.cluster.placement import PlacementError, parse_hostfile, place, shell_assignments
from async_vapo.config import Config, load_config, save_resolved
from async_vapo.config.loader import ConfigError
from async_vapo.metrics.prom import MetricsServer, ServiceMetrics, render_prometheus_config, write_file_sd_targets
from async_vapo.transport import BackpressureFull, Decoder, Envelope, RejectCounter, Sender

SERVICES = ("replay", "verifier", "rollout", "learner")
T0_ENV = "ASYNC_VAPO_T0"
"""Unix time the cluster was started (set by start_cluster.sh): the origin of every ``wall_s``."""


def service_arg_parser(service: str, doc: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"services/{service}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], help="TOML file (repeat to layer several)")
    p.add_argument("--run-dir", help="run directory (default: the config's train.output_dir)")
    p.add_argument("--instance", type=int, default=0, help="replica index (rollout engines: 0..N-1)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics and /health (default: from cluster.*)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (ports: cluster.ports.replay_port=...)")
    return p


def metrics_port(cfg: Config, service: str, instance: int = 0) -> int:
    c = cfg.cluster
    return {"replay": c.ports.replay_metrics_port, "verifier": c.ports.verifier_metrics_port,
            "learner": c.ports.learner_metrics_port + instance,
            "rollout": c.ports.rollout_metrics_port + instance}[service]


def service_host(cfg: Config, service: str, instance: int = 0) -> str:
    """The address other machines (and Prometheus) reach ``service`` replica ``instance`` at."""
    c = cfg.cluster
    if service == "rollout":
        return c.hosts.rollout_hosts[instance % len(c.hosts.rollout_hosts)] if c.hosts.rollout_hosts else "127.0.0.1"
    return {"replay": c.hosts.replay_host, "verifier": c.hosts.verifier_host, "learner": c.hosts.learner_host}[service]


def wall_origin() -> float:
    try:
        return float(os.environ[T0_ENV])
    except (KeyError, ValueError):
        return time.time()


@dataclass
class ServiceContext:
    cfg: Config
    run_dir: Path
    service: str
    instance: int
    metrics: ServiceMetrics
    server: MetricsServer | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    t0: float = field(default_factory=wall_origin)
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("async_vapo.cluster"))
    _children_seen: dict = field(default_factory=dict)
    serving: bool = False
    """Set by :meth:`ready`; before it a stop signal exits at once (e.g. in the middle of an engine start)."""

    @property
    def name(self) -> str:
        return f"{self.service}-{self.instance}"

    def elapsed(self) -> float:
        return time.time() - self.t0

    def endpoint(self, host: str, port: int | str) -> str:
        return f"tcp://{host}:{port}"

    def decoder(self, allowed: tuple[type, ...], socket_name: str) -> Decoder:
        """The socket's decoder; its rejects feed ``wire_rejects_total{reason}``."""
        counter = self.metrics.wire_rejects_total
        rejects = RejectCounter(f"{self.name}/{socket_name}", callback=lambda r: counter.labels(reason=r).inc())
        return Decoder(allowed, self.cfg.cluster.wire.max_message_bytes, rejects=rejects,
                       name=f"{self.name}/{socket_name}")

    def processing_error(self, stage: str, what: str) -> None:
        """Count and log one message whose processing failed; the caller goes on with the next one."""
        self.metrics.counter("processing_errors_total", "Messages that decoded but failed while being processed.",
                             labels=("stage",)).labels(stage=stage).inc()
        self.log.error("%s: %s failed (skipped):\n%s", self.name, what, traceback.format_exc())

    def send(self, sender: Sender, env: Envelope, what: str) -> bool:
        """Push ``env``, holding on while the pipe is full; False only if the service was stopped first."""
        backpressure = self.metrics.counter("backpressure_total",
                                            "Sends that found the downstream pipe full for a whole timeout.")
        while not self.stop.is_set():
            try:
                sender.send(env, self.cfg.cluster.wire.send_timeout_s)
                return True
            except BackpressureFull as exc:
                backpressure.inc()
                self.log.warning("%s: %s held: %s", self.name, what, exc)
        return False

    def ready(self, **health) -> None:
        """The service is up: /health answers 200 from now on; a stop signal now ends the loop gracefully."""
        self.serving = True
        self.metrics.set_health(status="ok", **health)

    @contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        """Time spent doing ``stage``'s work (generate, verify, learn, ...): added to
        ``busy_seconds_total{stage}`` and appended as ``[stage, start, end]`` (seconds since the cluster
        started) to ``RUN_DIR/stats/<service>-<i>.busy.jsonl``, so overlap between stages can be measured
        over any window afterwards. Meanwhile ``/health`` says ``"busy": stage`` (fault injection aims by it)."""
        t0 = time.time()
        self.metrics.set_health(busy=stage)
        try:
            yield
        finally:
            self.metrics.set_health(busy="")
            t1 = time.time()
            self.metrics.counter("busy_seconds_total", "Wall-clock seconds spent working, by stage.",
                                 labels=("stage",)).labels(stage=stage).inc(t1 - t0)
            try:
                with (self.stats_dir() / f"{self.name}.busy.jsonl").open("a") as f:
                    f.write(f'["{stage}", {t0 - self.t0:.4f}, {t1 - self.t0:.4f}]\n')
            except OSError:  # statistics never stop a service
                pass

    def stats_dir(self) -> Path:
        d = self.run_dir / "stats"
        d.mkdir(exist_ok=True)
        return d

    def write_stats(self) -> None:
        """``RUN_DIR/stats/<service>-<i>.json``: peak resident memory of this process and of its child
        processes (a vLLM engine core, verifier workers), CPU seconds, wall seconds."""
        import resource

        import psutil

        for c in psutil.Process().children(recursive=True):  # children seen by earlier calls are kept
            try:
                with open(f"/proc/{c.pid}/status") as f:
                    hwm = next((int(x.split()[1]) for x in f if x.startswith("VmHWM:")), 0)
                self._children_seen[c.pid] = {"pid": c.pid, "name": c.name(), "peak_rss_mib": hwm / 1024}
            except (OSError, psutil.Error):
                pass
        children = list(self._children_seen.values())
        ru = resource.getrusage(resource.RUSAGE_SELF)
        stats = {"service": self.name, "peak_rss_mib": ru.ru_maxrss / 1024, "children": children,
                 "peak_rss_with_children_mib": ru.ru_maxrss / 1024 + sum(c["peak_rss_mib"] for c in children),
                 "cpu_s": ru.ru_utime + ru.ru_stime, "wall_s": self.elapsed()}
        try:
            (self.stats_dir() / f"{self.name}.json").write_text(json.dumps(stats, indent=2) + "\n")
        except OSError:
            pass

    def close(self) -> None:
        try:
            self.write_stats()
        except Exception:  # statistics never stop a shutdown
            self.log.exception("%s: writing stats failed", self.name)
        if self.server is not None:
            self.server.stop()


def keys_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the cluster's CURVE keys are: ``cluster.security.keys_dir``, or RUN_DIR/keys."""
    d = cfg.cluster.security.keys_dir
    return Path(d).expanduser() if d else Path(run_dir) / "keys"


def make_transport(ctx: ServiceContext):
    """The service's ZeroMQ transport: CURVE with this service's role key and ZAP role checks
    (``transport.security``) unless ``cluster.security.curve`` is off. Refused handshakes count in
    ``auth_failures_total``."""
    from async_vapo.transport import ZmqTransport, shared_context

    if not ctx.cfg.cluster.security.curve:
        ctx.log.warning("%s: CURVE is off: every socket is unauthenticated plaintext", ctx.name)
        return ZmqTransport()
    from async_vapo.transport.security import CurveKeys, Security

    keys = CurveKeys.load(keys_dir(ctx.cfg, ctx.run_dir), ctx.service)
    refused = ctx.metrics.counter("auth_failures_total", "Connections refused by CURVE/ZAP: an unknown key, or a "
                                  "key of a role that socket does not admit.")

    def on_refused(reason: str) -> None:
        refused.inc()
        ctx.log.warning("%s: refused a connection: %s", ctx.name, reason)

    return ZmqTransport(security=Security(keys, shared_context(), on_refused=on_refused))


def make_context(service: str, args: argparse.Namespace | None = None, *, cfg: Config | None = None,
                 run_dir: str | Path | None = None, instance: int = 0, serve_metrics: bool = True,
                 install_signals: bool = True) -> ServiceContext:
    """Load the config (``args`` from :func:`service_arg_parser`, or ``cfg`` directly in tests), apply the run
    directory, set up logging, start /metrics + /health (status "starting") and the signal handlers."""
    if args is not None:
        cfg = load_config(args.config, args.overrides)
        run_dir, instance = args.run_dir, args.instance
        logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                            format=f"%(asctime)s {service}-{instance} %(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
    if cfg is None:
        raise ValueError("make_context needs args or cfg")
    if run_dir is not None:
        cfg.train.output_dir = str(Path(run_dir).resolve())
    rd = cfg.run_dir()
    rd.mkdir(parents=True, exist_ok=True)
    if service == "learner" and instance == 0:
        save_resolved(cfg, rd)
    metrics = ServiceMetrics(service, str(instance))
    ctx = ServiceContext(cfg=cfg, run_dir=rd, service=service, instance=instance, metrics=metrics)
    if serve_metrics:
        port = args.metrics_port if args is not None and args.metrics_port is not None else metrics_port(
            cfg, service, instance)
        ctx.server = MetricsServer.from_config(metrics, cfg.cluster.metrics_http, cfg.cluster.hosts.bind_host, port)
        ctx.server.start()
        ctx.log.info("%s: /metrics and /health on %s", ctx.name, ctx.server.url)
    metrics.set_health(status="starting", pid=os.getpid())
    if install_signals and threading.current_thread() is threading.main_thread():
        def _stop(signum: int, frame: object) -> None:
            ctx.log.info("%s: %s received, stopping", ctx.name, signal.Signals(signum).name)
            ctx.stop.set()
            if not ctx.serving:
                raise SystemExit(128 + signum)
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
    return ctx


def run_service(service: str, argv: Sequence[str] | None, body: Callable[[ServiceContext, argparse.Namespace], None],
                parser: argparse.ArgumentParser | None = None) -> int:
    """Entry point shared by ``services/*.py``: parse, build the context, run ``body``; exit code 1 on a crash
    (logged with its traceback, health set to degraded first so a scrape sees it)."""
    args = (parser or service_arg_parser(service)).parse_args(argv)
    ctx = make_context(service, args)
    try:
        body(ctx, args)
        return 0
    except Exception:
        ctx.log.exception("%s: crashed", ctx.name)
        ctx.metrics.set_health(status="degraded", reason="crashed")
        return 1
    finally:
        ctx.close()


# -- start_cluster.sh helpers ----------------------------------------------------------------------------------

def _plan(argv: Sequence[str]) -> int:
    """Print the cluster plan as shell assignments and write RUN_DIR/prometheus/{targets.json,prometheus.yml}."""
    p = argparse.ArgumentParser(prog="plan")
    p.add_argument("--config", action="append", default=[])
    p.add_argument("--run-dir")
    p.add_argument("--scrape-interval", default="5s")
    p.add_argument("--resume", help="a checkpoint, or 'auto' (the run directory's newest)")
    p.add_argument("--new-run", action="store_true")
    p.add_argument("--hostfile", help="lines 'host role' (async_vapo.cluster.placement)")
    p.add_argument("--gpus-per-host", type=int, default=0, help="0: no GPU placement (CPU)")
    p.add_argument("--local-name", action="append", default=[], help="a name of this machine in the hostfile")
    p.add_argument("--local-addr", default="127.0.0.1", help="what the other hosts reach this machine at")
    p.add_argument("--dry-run", action="store_true", help="write nothing")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.run_dir:
        cfg.train.output_dir = str(Path(args.run_dir).resolve())
    cfg, resume = _choose_run_dir(cfg, args.resume, args.new_run, dry_run=args.dry_run)
    rd = cfg.run_dir().resolve()
    c = cfg.cluster
    n_roll = cfg.rollout_engines()
    try:
        hostfile = parse_hostfile(Path(args.hostfile).read_text(), args.hostfile) if args.hostfile else []
        placement = place(cfg.async_.rollout_devices, cfg.async_.learner_devices,
                          tensor_parallel_size=cfg.rollout.tensor_parallel_size, gpus_per_host=args.gpus_per_host,
                          hostfile=hostfile)
    except PlacementError as e:
        print(f"placement: {e}", file=sys.stderr)
        return 2
    rollout_hosts_override = ""
    local = {"localhost", "127.0.0.1", *args.local_name}
    if hostfile:
        c.hosts.rollout_hosts = [args.local_addr if e.host in local else e.host for e in placement.engines]
        rollout_hosts_override = "cluster.hosts.rollout_hosts=[" + ",".join(
            f'"{h}"' for h in c.hosts.rollout_hosts) + "]"
    targets = {s: [f"{service_host(cfg, s, i)}:{metrics_port(cfg, s, i)}"
                   for i in range(n_roll if s == "rollout" else 1)] for s in SERVICES}
    prom = rd / "prometheus"
    if not args.dry_run:
        write_file_sd_targets(prom / "targets.json", targets)
    interval = args.scrape_interval
    # Prometheus durations are integers with a unit: 80 % of an interval in seconds, in milliseconds
    timeout = f"{max(500, int(float(interval[:-1]) * 800))}ms" if interval[-1:] == "s" and interval[-2:] != "ms" \
        else interval
    tmpl = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml.tmpl"
    http = c.metrics_http
    ca_file, password_file = (_absolute(x) for x in (http.tls_ca_file, http.basic_auth_password_file))
    if not args.dry_run:
        render_prometheus_config(tmpl, prom / "prometheus.yml", scrape_interval=interval, scrape_timeout=timeout,
                                 run_name=cfg.train.name, tls=http.tls_cert is not None, tls_ca_file=ca_file,
                                 basic_auth_user=http.basic_auth_user, basic_auth_password_file=password_file)
    out = {"RUN_DIR": str(rd), "RESUME": resume, "TOTAL_STEPS": cfg.train.total_steps,
           "N_ROLLOUT": n_roll, "N_LEARNER": cfg.async_.learner_devices,
           "ROLLOUT_HOSTS_OVERRIDE": rollout_hosts_override, "PLACEMENT_TABLE": placement.describe(),
           "HEALTH_TIMEOUT": int(math.ceil(c.deploy.health_timeout_s)),
           "STOP_GRACE": int(math.ceil(c.deploy.stop_grace_s)),
           "POLICY_PATH": cfg.model.path or "", "CURVE": int(c.security.curve), "KEYS_DIR": str(keys_dir(cfg, rd)),
           "LEARNER_RDZV_PORT": c.ports.learner_rdzv_port}
    for agent in placement.learners:  # what the other learner hosts reach each learner agent at
        out[f"ADDR_{agent.name.upper().replace('-', '_')}"] = args.local_addr if agent.host in local else agent.host
    scheme = "https" if http.tls_cert is not None else "http"
    for s in SERVICES:
        for i, t in enumerate(targets[s]):
            out[f"HEALTH_{s.upper()}_{i}"] = f"{scheme}://{t}/health"
    for k, v in out.items():
        print(f"{k}={_shell_quote(str(v))}")
    print("\n".join(shell_assignments(placement)))
    # wait-health's options for these services (a bash array: paths may hold spaces)
    opts = (["--ca-file", ca_file] if ca_file else ["--insecure"] if http.tls_cert is not None else []) + (
        ["--user", http.basic_auth_user, "--password-file", password_file] if password_file else [])
    print(f"HEALTH_OPTS=({' '.join(_shell_quote(str(o)) for o in opts)})")
    return 0


def _choose_run_dir(cfg: Config, resume: str | None, new_run: bool, *, dry_run: bool = False) -> tuple[Config, str]:
    """The run directory by ``async_vapo.learner.rundir``'s rule, said on stderr, and the checkpoint the learner
    resumes from ("" for none). A directory whose cluster still runs here is kept, so that start_cluster.sh
    refuses to start a second one in it. ``dry_run``: decide and say, but create and record nothing."""
    from async_vapo.learner.rundir import RunDirError, RunPlan, claim, plan_run, run_dirs

    rd = cfg.run_dir().resolve()
    for d in run_dirs(rd):
        if _cluster_alive(d):
            cfg.train.output_dir = str(d)
            return cfg, ""
    if resume and resume != "auto":
        plan = RunPlan(rd, Path(resume).resolve(), f"resuming {rd} from {resume}")
    else:
        try:
            plan = plan_run(cfg, "cluster", "resume" if resume else "new" if new_run else "auto", rd)
        except RunDirError as e:
            raise SystemExit(f"start_cluster: {e}") from None
    print(f"[start_cluster] {plan.message}", file=sys.stderr)
    resume_from = "" if plan.resume is None else str(plan.resume)
    if dry_run:
        cfg = cfg.model_copy(deep=True)
        cfg.train.output_dir = str(plan.run_dir)
        return cfg, resume_from
    return claim(plan, cfg, "cluster"), resume_from


def _cluster_alive(run_dir: Path) -> bool:
    """Whether a service started in ``run_dir`` on this machine still runs (its process group exists)."""
    for f in (run_dir / "pids").glob("*.pid"):
        if f.with_suffix(".host").exists():
            return True  # on another host: start_cluster.sh checks it over ssh
        try:
            os.killpg(int(f.read_text().strip()), 0)
            return True
        except PermissionError:
            return True
        except (ValueError, ProcessLookupError):
            continue
    return False


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _wait_health(argv: Sequence[str]) -> int:
    """``wait-health [--ca-file F | --insecure] [--user U --password-file F] URL TIMEOUT_S [PID]``: 0 once URL
    answers 200; 1 on timeout or when PID has exited. The options are the plan's ``HEALTH_OPTS``: how to verify
    an https server, and the basic auth credentials."""
    import base64
    import ssl
    import urllib.error
    import urllib.request

    p = argparse.ArgumentParser(prog="wait-health")
    p.add_argument("url")
    p.add_argument("timeout_s", type=float)
    p.add_argument("pid", type=int, nargs="?")
    p.add_argument("--ca-file", help="verify an https server against this CA (or self-signed certificate)")
    p.add_argument("--insecure", action="store_true", help="https without verifying the server")
    p.add_argument("--user", help="basic auth user (with --password-file)")
    p.add_argument("--password-file", help="file holding the basic auth password (surrounding whitespace ignored)")
    args = p.parse_args(argv)
    context = None
    if args.url.startswith("https:"):
        context = ssl.create_default_context(cafile=args.ca_file)
        if args.insecure:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    headers = {}
    if args.user is not None:
        password = Path(args.password_file).read_text().strip()
        headers["Authorization"] = "Basic " + base64.b64encode(f"{args.user}:{password}".encode()).decode()
    url, timeout_s, pid = args.url, args.timeout_s, args.pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2,
                                        context=context) as r:
                if r.status == 200:
                    return 0
        except (urllib.error.URLError, OSError):
            pass
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"process {pid} exited before {url} became healthy", file=sys.stderr)
                return 1
            except PermissionError:
                pass
        time.sleep(0.5)
    print(f"{url} not healthy after {timeout_s:g} s", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("plan", "wait-health"):
        print("usage: python -m async_vapo.cluster.common {plan [--config F] [--run-dir D] [overrides]"
              " | wait-health [--ca-file F | --insecure] [--user U --password-file F] URL TIMEOUT_S [PID]}",
              file=sys.stderr)
        return 2
    return _plan(argv[1:]) if argv[0] == "plan" else _wait_health(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
