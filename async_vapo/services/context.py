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

``python -m async_vapo.deploy.launch plan ...`` and ``... wait-health ...`` are the two helpers that
``deploy/start_cluster.sh`` calls (no torch import: they take well under a second).
"""

from __future__ import annotations

import argparse
import json
import logging
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

from async_vapo.config import Config, load_config, save_resolved
from async_vapo.config.cluster import SERVICES, keys_dir, metrics_port, service_host  # noqa: F401  (re-exported)
from async_vapo.metrics.prom import MetricsServer, ServiceMetrics
from async_vapo.transport import BackpressureFull, Decoder, Envelope, RejectCounter, Sender

T0_ENV = "ASYNC_VAPO_T0"
"""Unix time the cluster was started (set by start_cluster.sh): the origin of every ``wall_s``."""


def service_arg_parser(service: str, doc: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m async_vapo.services.{service}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], help="TOML file (repeat to layer several)")
    p.add_argument("--run-dir", help="run directory (default: the config's train.output_dir)")
    p.add_argument("--instance", type=int, default=0, help="replica index (rollout engines: 0..N-1)")
    p.add_argument("--metrics-port", type=int, help="port of /metrics and /health (default: from cluster.*)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (ports: cluster.ports.replay_port=...)")
    return p


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
    log: logging.Logger = field(default_factory=lambda: logging.getLogger("async_vapo.services"))
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
        self.metrics.get("processing_errors_total").labels(stage=stage).inc()
        self.log.error("%s: %s failed (skipped):\n%s", self.name, what, traceback.format_exc())

    def send(self, sender: Sender, env: Envelope, what: str) -> bool:
        """Push ``env``, holding on while the pipe is full; False only if the service was stopped first."""
        backpressure = self.metrics.get("backpressure_total")
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
            self.record_busy(stage, t0, time.time())

    def record_busy(self, stage: str, t0: float, t1: float) -> None:
        """``busy``'s record of [t0, t1] (``time.time()`` seconds) for work that is not one block of code, e.g. the
        continuous engine's time with requests in flight."""
        self.metrics.get("busy_seconds_total").labels(stage=stage).inc(t1 - t0)
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
    refused = ctx.metrics.get("auth_failures_total")

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
    """Entry point shared by the services' ``main`` (``python -m async_vapo.services.NAME``): parse, build the
    context, run ``body``; exit code 1 on a crash (logged with its traceback, health set to degraded first so a
    scrape sees it)."""
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
