"""Prometheus metrics for the async-vapo services: one registry per process, `/metrics` and `/health`.

Every name is ``async_vapo_<service>_<quantity>_<unit>`` (see STYLE.md, "Prometheus habits"):

* base units only (``_seconds``, ``_bytes``; ratios are plain 0–1 values, never percent);
* counters end in ``_total``, nothing else does;
* lower-case ``[a-z0-9_]``, no colons (colons are reserved for recording rules);
* labels are low-cardinality enums (``reason``, ``kind``, ``side``, ``gpu``): never ids, prompts or versions.

:class:`ServiceMetrics` owns a private :class:`CollectorRegistry` (the global default registry is never
touched, so two services in one pytest process do not collide). Metrics are created lazily through
:meth:`ServiceMetrics.counter` / :meth:`~ServiceMetrics.gauge` / :meth:`~ServiceMetrics.histogram`, which
prefix the service name and validate the convention; asking twice for the same name returns the same
metric. The per-service sets (:class:`RolloutMetrics`, :class:`VerifierMetrics`, :class:`ReplayMetrics`,
:class:`LearnerMetrics`) are built on first access of the matching attribute.

Always present on every service: process CPU seconds / resident memory (prometheus_client's
``ProcessCollector`` under the service prefix), ``process_cpu_ratio``, ``up``, ``info`` and
``wire_rejects_total{reason}``. GPU utilisation and memory per device come from NVML (``nvidia-ml-py``)
and are only registered when a GPU is visible; on a CPU machine they are absent, not zero.

:class:`MetricsServer` serves the registry on a daemon ``ThreadingHTTPServer``: ``/metrics`` in the
Prometheus text format, ``/health`` as JSON (HTTP 200 when the status is ``ok``, 503 otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import string
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

PREFIX = "async_vapo"
HEALTH_STATUSES = ("ok", "starting", "degraded")

_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_]*$")
# Units that have a base-unit spelling (seconds, bytes, 0–1 ratio) and so must not appear in a name.
_NON_BASE_UNITS = {
    "ms": "seconds", "millis": "seconds", "milliseconds": "seconds", "us": "seconds", "microseconds": "seconds",
    "ns": "seconds", "nanoseconds": "seconds", "minutes": "seconds", "mins": "seconds", "hours": "seconds",
    "secs": "seconds", "sec": "seconds", "kb": "bytes", "mb": "bytes", "gb": "bytes", "kib": "bytes",
    "mib": "bytes", "gib": "bytes", "kilobytes": "bytes", "megabytes": "bytes", "gigabytes": "bytes",
    "bits": "bytes", "percent": "a 0-1 ratio", "pct": "a 0-1 ratio", "percentage": "a 0-1 ratio",
}
# Sample suffixes the exposition format adds itself.
_RESERVED_SUFFIXES = ("_bucket", "_count", "_sum", "_created", "_info")
_RESERVED_LABELS = {"le", "quantile", "job", "instance", "service", "replica"}
# Label names whose values are unbounded by nature.
_HIGH_CARDINALITY_LABELS = {"id", "uid", "uuid", "message_id", "request_id", "sample_id", "group_id", "trace_id",
                            "prompt", "response", "step", "version", "policy_version", "timestamp", "path", "url"}

MetricKind = Literal["counter", "gauge", "histogram"]

# Buckets (seconds) for the latency histograms: 1 ms up to 10 minutes.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                   600.0)
# Buckets (seconds) for weight loads and broadcasts: tens of ms (tiny model) to minutes (7B over NCCL/disk).
TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Policy versions between generation and consumption; max_staleness is small, 16 catches anything pathological.
SAMPLE_AGE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
LOSS_KINDS = ("policy", "value", "pos_lm")
CLIP_SIDES = ("low", "high")


def validate_metric_name(name: str, kind: MetricKind) -> str:
    """Return ``name`` if it follows the async-vapo convention for a metric of ``kind``; else ValueError.

    ``name`` is the full name (``async_vapo_<service>_...``)."""
    if kind not in ("counter", "gauge", "histogram"):
        raise ValueError(f"unknown metric kind {kind!r}")
    if ":" in name:
        raise ValueError(f"metric name {name!r}: colons are reserved for recording rules")
    if not _NAME_RE.match(name):
        raise ValueError(f"metric name {name!r}: use lower-case [a-z0-9] words joined by single underscores")
    if not name.startswith(PREFIX + "_"):
        raise ValueError(f"metric name {name!r}: must start with {PREFIX}_<service>_")
    words = name.split("_")
    for w in words[2:]:
        if w in _NON_BASE_UNITS:
            raise ValueError(f"metric name {name!r}: {w!r} is not a base unit, use {_NON_BASE_UNITS[w]}")
    if kind == "counter" and not name.endswith("_total"):
        raise ValueError(f"counter {name!r}: counter names end in _total")
    if kind != "counter" and name.endswith("_total"):
        raise ValueError(f"{kind} {name!r}: only counters end in _total")
    for suffix in _RESERVED_SUFFIXES:
        if name.endswith(suffix) and not (suffix == "_info" and kind == "gauge"):
            raise ValueError(f"{kind} {name!r}: the suffix {suffix} is added by the exposition format")
    return name


def validate_label_names(labels: Iterable[str]) -> tuple[str, ...]:
    """Return the label names as a tuple if each is a valid, low-cardinality name; else ValueError."""
    if isinstance(labels, str):
        raise ValueError(f"labels must be a sequence of names, not the string {labels!r}")
    out = tuple(labels)
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate label names in {out}")
    for label in out:
        if not _LABEL_RE.match(label) or label.startswith("__"):
            raise ValueError(f"label name {label!r}: use lower-case [a-z0-9_]")
        if label in _RESERVED_LABELS:
            raise ValueError(f"label name {label!r} is reserved (set by Prometheus or by the scrape target)")
        if label in _HIGH_CARDINALITY_LABELS:
            raise ValueError(f"label name {label!r} has unbounded values; put it in a log, not a label")
    return out


@dataclass(frozen=True)
class RolloutMetrics:
    """Generation service (vLLM engine behind the admission queue)."""

    generated_tokens_total: Counter
    generated_samples_total: Counter
    inflight_groups: Gauge
    served_version: Gauge
    weight_load_seconds: Histogram
    weight_transfers_total: Counter  # labels: via = shm | zmq | file
    admission_rejects_total: Counter  # labels: reason

    @classmethod
    def create(cls, m: ServiceMetrics) -> RolloutMetrics:
        return cls(
            generated_tokens_total=m.counter("generated_tokens_total", "Response tokens generated."),
            generated_samples_total=m.counter("generated_samples_total", "Responses (samples) generated."),
            inflight_groups=m.gauge("inflight_groups", "Prompt groups admitted and not yet finished."),
            served_version=m.gauge("served_version", "Policy version whose weights the engine is serving."),
            weight_load_seconds=m.histogram("weight_load_seconds", "Time to load one policy version into the engine.",
                                            TRANSFER_BUCKETS),
            weight_transfers_total=m.counter("weight_transfers_total",
                                             "Policy versions loaded, by the way the weights came (shm, zmq, file).",
                                             labels=("via",)),
            admission_rejects_total=m.counter("admission_rejects_total", "Requests refused at admission.",
                                              labels=("reason",)),
        )


@dataclass(frozen=True)
class VerifierMetrics:
    """Sandboxed answer checker."""

    checks_total: Counter  # labels: reason (the verdict: one of async_vapo.verify.REASONS)
    timeouts_total: Counter
    rejects_total: Counter  # labels: reason (requests refused before checking: oversize, bad message, ...)
    queue_depth: Gauge
    check_seconds: Histogram

    @classmethod
    def create(cls, m: ServiceMetrics) -> VerifierMetrics:
        return cls(
            checks_total=m.counter("checks_total", "Responses checked, by verdict.", labels=("reason",)),
            timeouts_total=m.counter("timeouts_total", "Checks killed at the per-check time limit."),
            rejects_total=m.counter("rejects_total", "Check requests refused before checking.", labels=("reason",)),
            queue_depth=m.gauge("queue_depth", "Check requests waiting for a worker."),
            check_seconds=m.histogram("check_seconds", "Wall time of one check.", LATENCY_BUCKETS),
        )


@dataclass(frozen=True)
class ReplayMetrics:
    """Replay buffer between rollout and learner.

    Invariant it reports on: a batch never holds a trajectory older than ``max_staleness`` versions;
    what would break it is dropped and counted in ``stale_drops_total``."""

    stored_groups: Gauge
    stale_drops_total: Counter
    batch_assembly_seconds: Histogram
    sample_age_versions: Histogram
    batches_total: Counter

    @classmethod
    def create(cls, m: ServiceMetrics) -> ReplayMetrics:
        return cls(
            stored_groups=m.gauge("stored_groups", "Prompt groups held in the buffer."),
            stale_drops_total=m.counter("stale_drops_total", "Groups dropped for exceeding max_staleness."),
            batch_assembly_seconds=m.histogram("batch_assembly_seconds", "Time to assemble one learner batch.",
                                               LATENCY_BUCKETS),
            sample_age_versions=m.histogram("sample_age_versions",
                                            "Learner version minus behaviour version of each sample in a batch.",
                                            SAMPLE_AGE_BUCKETS),
            batches_total=m.counter("batches_total", "Batches handed to the learner."),
        )


@dataclass(frozen=True)
class LearnerMetrics:
    """PPO/VAPO learner (actor and critic updates, weight broadcast)."""

    step_seconds: Histogram
    loss: Gauge  # labels: kind = policy | value | pos_lm
    reward: Gauge
    accuracy: Gauge
    entropy: Gauge
    clipfrac: Gauge  # labels: side = low | high (ratio 0-1)
    explained_variance: Gauge
    version: Gauge
    broadcast_seconds: Histogram
    weight_fetch_bytes_total: Counter
    value_pretrain_steps_total: Counter

    @classmethod
    def create(cls, m: ServiceMetrics) -> LearnerMetrics:
        loss = m.gauge("loss", "Last update's loss, by term.", labels=("kind",))
        clipfrac = m.gauge("clipfrac", "Fraction of tokens whose ratio was clipped, by side (0-1).",
                           labels=("side",))
        for kind in LOSS_KINDS:  # export every series from the start, so a missing term shows as 0 not absent
            loss.labels(kind=kind)
        for side in CLIP_SIDES:
            clipfrac.labels(side=side)
        return cls(
            step_seconds=m.histogram("step_seconds", "Wall time of one learner update step.", LATENCY_BUCKETS),
            loss=loss,
            reward=m.gauge("reward", "Mean reward of the last batch."),
            accuracy=m.gauge("accuracy", "Fraction of correct responses in the last batch (0-1)."),
            entropy=m.gauge("entropy", "Mean token entropy of the policy on the last batch (nats)."),
            clipfrac=clipfrac,
            explained_variance=m.gauge("explained_variance",
                                       "Critic explained variance of the returns (NaN when they do not vary)."),
            version=m.gauge("version", "Policy version after the last update."),
            broadcast_seconds=m.histogram("broadcast_seconds", "Time to publish one policy version.",
                                          TRANSFER_BUCKETS),
            weight_fetch_bytes_total=m.counter("weight_fetch_bytes_total",
                                               "Weight bytes sent to engines fetching over ZeroMQ (other hosts)."),
            value_pretrain_steps_total=m.counter("value_pretrain_steps_total", "Critic-only pretraining steps."),
        )


SERVICE_SETS: dict[str, type] = {"rollout": RolloutMetrics, "verifier": VerifierMetrics, "replay": ReplayMetrics,
                                 "learner": LearnerMetrics}


class _CpuRatio:
    """Process CPU time over wall time since the previous scrape, divided by the number of cores (0-1)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = (time.monotonic(), self._cpu())
        self._cores = os.cpu_count() or 1
        self._value = 0.0

    @staticmethod
    def _cpu() -> float:
        t = os.times()
        return t.user + t.system

    def __call__(self) -> float:
        with self._lock:
            now, cpu = time.monotonic(), self._cpu()
            wall, used = now - self._last[0], cpu - self._last[1]
            if wall >= 0.05:  # two scrapes at once have no meaningful interval: repeat the last value
                self._last = (now, cpu)
                self._value = min(max(used / (wall * self._cores), 0.0), 1.0)
            return self._value


class _GpuCollector:
    """Per-device utilisation and memory from NVML, read at scrape time.

    ``nvml`` is the ``pynvml`` module (or anything with the same functions)."""

    def __init__(self, nvml: Any, prefix: str, handles: Sequence[Any]):
        self._nvml, self._prefix, self._handles = nvml, prefix, list(handles)

    def describe(self):  # lets the registry check for name clashes without calling NVML
        return self._families()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        p = self._prefix
        return (GaugeMetricFamily(f"{p}_gpu_utilization_ratio", "GPU busy fraction over the last sample period.",
                                  labels=["gpu"]),
                GaugeMetricFamily(f"{p}_gpu_memory_used_bytes", "GPU memory in use.", labels=["gpu"]),
                GaugeMetricFamily(f"{p}_gpu_memory_total_bytes", "GPU memory installed.", labels=["gpu"]))

    def collect(self):
        util, used, total = self._families()
        for i, h in enumerate(self._handles):
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(h)
                mem = self._nvml.nvmlDeviceGetMemoryInfo(h)
            except Exception as e:  # a device that stops answering must not break the whole scrape
                log.debug("NVML query for GPU %d failed: %s", i, e)
                continue
            util.add_metric([str(i)], rates.gpu / 100.0)
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
        return [util, used, total]


def _nvml_handles(nvml: Any) -> list[Any]:
    """NVML device handles, or [] (with one debug log) where there is no driver or no device."""
    try:
        nvml.nvmlInit()
        return [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded on a CPU machine
        log.debug("no GPU metrics: NVML unavailable (%s)", e)
        return []


class _WithoutCreated:
    """The registry minus prometheus_client's ``*_created`` samples: in the 0.0.4 text format they become
    one extra gauge per counter/histogram that nothing here reads. (``disable_created_metrics()`` would do
    the same, but for every registry in the process.)"""

    def __init__(self, registry: CollectorRegistry):
        self._registry = registry

    def collect(self):
        for m in self._registry.collect():
            out = Metric(m.name, m.documentation, m.type, m.unit)
            out.samples = [s for s in m.samples if s.name != m.name + "_created"]
            yield out


class ServiceMetrics:
    """All metrics of one service process, in a private registry.

    ``service``: lower-case name (``rollout``, ``verifier``, ``replay``, ``learner``, or any other for a
    service with only the common metrics). ``instance``: replica id, reported in ``/health`` (Prometheus
    gets it as the ``replica`` target label from ``targets.json``, so no metric carries it).
    ``gpu``: ``None`` (or ``True``) probes NVML, ``False`` never registers GPU metrics, or a ``pynvml``-like module
    to read from."""

    def __init__(self, service: str, instance: str = "0", *, gpu: bool | Any | None = None):
        if not re.match(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$", service):
            raise ValueError(f"service name {service!r}: use lower-case [a-z0-9_]")
        from async_vapo import __version__

        self.service, self.instance, self.package_version = service, str(instance), __version__
        self.prefix = f"{PREFIX}_{service}"
        self.registry = CollectorRegistry(auto_describe=True)
        self._metrics: dict[str, tuple[MetricKind, tuple[str, ...], Any]] = {}
        self._sets: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._health: dict[str, Any] = {"status": "starting"}

        ProcessCollector(namespace=self.prefix, registry=self.registry)
        self.process_cpu_ratio = self.gauge("process_cpu_ratio",
                                            "Process CPU time over wall time since the last scrape, per core (0-1).")
        self.process_cpu_ratio.set_function(_CpuRatio())
        self.up = self.gauge("up", "1 while the service reports itself healthy (status ok), else 0.")
        self.info = self.gauge("info", "Always 1; labels identify the build.",
                               labels=("package_version", "python_version"))
        self.info.labels(package_version=__version__, python_version=platform.python_version()).set(1)
        self.wire_rejects_total = self.counter("wire_rejects_total",
                                               "Messages refused by a decoder (size, version, schema).",
                                               labels=("reason",))
        self.gpu_devices = 0
        if gpu is not False:
            nvml = gpu
            if gpu is None or gpu is True:
                try:
                    import pynvml as nvml
                except ImportError as e:
                    log.debug("no GPU metrics: nvidia-ml-py not installed (%s)", e)
                    nvml = None
            handles = _nvml_handles(nvml) if nvml is not None else []
            if handles:
                self.registry.register(_GpuCollector(nvml, self.prefix, handles))
                self.gpu_devices = len(handles)

    # -- factories -----------------------------------------------------------------------------------

    def full_name(self, name: str) -> str:
        return f"{self.prefix}_{name}"

    def _get_or_create(self, kind: MetricKind, name: str, doc: str, labels: Iterable[str],
                       make: Callable[[str, tuple[str, ...]], Any]) -> Any:
        full = validate_metric_name(self.full_name(name), kind)
        labels = validate_label_names(labels)
        if not doc:
            raise ValueError(f"{full}: give a help text")
        with self._lock:
            if full in self._metrics:
                old_kind, old_labels, metric = self._metrics[full]
                if (old_kind, old_labels) != (kind, labels):
                    raise ValueError(f"{full} already exists as a {old_kind} with labels {old_labels}")
                return metric
            metric = make(full, labels)
            self._metrics[full] = (kind, labels, metric)
            return metric

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        """The counter ``async_vapo_<service>_<name>`` (created on first call; ``name`` ends in ``_total``)."""
        return self._get_or_create("counter", name, doc, labels,
                                   lambda full, ls: Counter(full, doc, ls, registry=self.registry))

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        """The gauge ``async_vapo_<service>_<name>`` (created on first call)."""
        return self._get_or_create("gauge", name, doc, labels,
                                   lambda full, ls: Gauge(full, doc, ls, registry=self.registry))

    def histogram(self, name: str, doc: str, buckets: Sequence[float], labels: Sequence[str] = ()) -> Histogram:
        """The histogram ``async_vapo_<service>_<name>`` with the given upper bounds (``+Inf`` is added)."""
        b = [float(x) for x in buckets]
        if not b or any(y <= x for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"{self.full_name(name)}: buckets must be non-empty and strictly increasing, got {b}")
        return self._get_or_create("histogram", name, doc, labels,
                                   lambda full, ls: Histogram(full, doc, ls, registry=self.registry, buckets=b))

    def names(self) -> list[str]:
        """Full names of the metrics created through the factories so far (not the process/GPU collectors)."""
        with self._lock:
            return sorted(self._metrics)

    # -- per-service sets ------------------------------------------------------------------------------

    def _set(self, service: str) -> Any:
        if service != self.service:
            raise ValueError(f"the {service} metric set belongs to ServiceMetrics({service!r}), "
                             f"this one is ServiceMetrics({self.service!r})")
        with self._lock:
            if service not in self._sets:
                self._sets[service] = SERVICE_SETS[service].create(self)
            return self._sets[service]

    @property
    def rollout(self) -> RolloutMetrics:
        return self._set("rollout")

    @property
    def verifier(self) -> VerifierMetrics:
        return self._set("verifier")

    @property
    def replay(self) -> ReplayMetrics:
        return self._set("replay")

    @property
    def learner(self) -> LearnerMetrics:
        return self._set("learner")

    # -- health --------------------------------------------------------------------------------------

    def set_health(self, **fields: Any) -> None:
        """Merge ``fields`` into the ``/health`` document. ``status`` must be ``ok``, ``starting`` or
        ``degraded``; the rest must be JSON-serialisable (e.g. ``policy_version=3``, ``reason="..."``)."""
        if "status" in fields and fields["status"] not in HEALTH_STATUSES:
            raise ValueError(f"health status must be one of {HEALTH_STATUSES}, got {fields['status']!r}")
        reserved = {"service", "instance", "version"} & fields.keys()
        if reserved:
            raise ValueError(f"health fields {sorted(reserved)} are fixed by ServiceMetrics")
        json.dumps(fields)  # fail here, in the service, rather than inside the HTTP handler
        with self._lock:
            self._health.update(fields)
            self.up.set(1.0 if self._health["status"] == "ok" else 0.0)

    def health(self) -> dict[str, Any]:
        """The ``/health`` document: status, service, instance, version (the package's), and set fields."""
        with self._lock:
            return {"status": self._health["status"], "service": self.service, "instance": self.instance,
                    "version": self.package_version, **{k: v for k, v in self._health.items() if k != "status"}}

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what ``/metrics`` returns)."""
        return generate_latest(_WithoutCreated(self.registry))


class MetricsServer:
    """``/metrics`` and ``/health`` of one :class:`ServiceMetrics` on a background daemon thread.

    ``port=0`` binds a free port; :meth:`start` returns the bound one."""

    def __init__(self, metrics: ServiceMetrics, host: str = "127.0.0.1", port: int = 0):
        self.metrics, self.host, self.port = metrics, host, port
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def set_health(self, **fields: Any) -> None:
        self.metrics.set_health(**fields)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> int:
        if self._httpd is not None:
            raise RuntimeError("MetricsServer already started")
        metrics = self.metrics

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: bytes, content_type: str, head: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    try:
                        self.wfile.write(body)
                    except (BrokenPipeError, ConnectionResetError):  # the scraper gave up (its timeout): not ours
                        pass

            def _route(self, head: bool) -> None:
                path = urlsplit(self.path).path
                if path == "/metrics":
                    self._send(200, metrics.exposition(), CONTENT_TYPE_LATEST, head)
                elif path == "/health":
                    doc = metrics.health()
                    self._send(200 if doc["status"] == "ok" else 503, json.dumps(doc).encode(),
                               "application/json", head)
                else:
                    self._send(404, b"not found: try /metrics or /health\n", "text/plain; charset=utf-8", head)

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                self._route(head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                self._route(head=True)

            def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: keep stderr quiet
                log.debug("%s %s", self.address_string(), format % args)

        self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        self._httpd.daemon_threads = True
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"metrics-{metrics.service}-{metrics.instance}", daemon=True)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd, self._thread = None, None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- Prometheus scrape configuration (deploy/prometheus/prometheus.yml.tmpl) ---------------------------

def write_file_sd_targets(path: str | Path, targets: Mapping[str, Sequence[str]]) -> Path:
    """Write a Prometheus ``file_sd`` target file: ``targets`` maps service name to ``host:port`` of each
    replica (index = replica). Prometheus re-reads the file when it changes, so a start script can rewrite
    it as services come and go. Written atomically (temp file + rename)."""
    groups = []
    for service, addrs in targets.items():
        if not re.match(r"^[a-z][a-z0-9_]*$", service):
            raise ValueError(f"service name {service!r}: use lower-case [a-z0-9_]")
        for replica, addr in enumerate(addrs):
            if not re.match(r"^[^\s/:]+:\d+$", addr):
                raise ValueError(f"target {addr!r} of {service}: expected host:port")
            groups.append({"targets": [addr], "labels": {"service": service, "replica": str(replica)}})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(groups, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def render_prometheus_config(template: str | Path, out: str | Path, *, targets_file: str = "targets.json",
                             scrape_interval: str = "5s", scrape_timeout: str = "4s", run_name: str = "async-vapo"
                             ) -> Path:
    """Fill the ``string.Template`` placeholders of ``prometheus.yml.tmpl`` and write ``out``.
    A relative ``targets_file`` is resolved by Prometheus against the directory of ``out``."""
    text = string.Template(Path(template).read_text()).substitute(
        targets_file=targets_file, scrape_interval=scrape_interval, scrape_timeout=scrape_timeout, run_name=run_name)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
