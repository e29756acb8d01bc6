"""Prometheus metrics for the async-vapo services: one registry per process, `/metrics` and `/health`.

Every name is ``async_vapo_<service>_<quantity>_<unit>`` (see STYLE.md, "Prometheus habits"):

* base units only (``_seconds``, ``_bytes``; ratios are plain 0–1 values, never percent);
* counters end in ``_total``, nothing else does;
* lower-case ``[a-z0-9_]``, no colons (colons are reserved for recording rules);
* labels are low-cardinality enums (``reason``, ``kind``, ``side``, ``gpu``): never ids, prompts or versions.

:class:`ServiceMetrics` owns a private :class:`CollectorRegistry` (the global default registry is never
touched, so two services in one pytest process do not collide). Every metric of a service is declared in
``async_vapo.metrics.catalogue`` and created when its ``ServiceMetrics`` is made; code takes one by name
(:meth:`ServiceMetrics.get`) or through the typed per-service sets (:class:`RolloutMetrics`,
:class:`VerifierMetrics`, :class:`ReplayMetrics`, :class:`LearnerMetrics`). The factories
:meth:`ServiceMetrics.counter` / :meth:`~ServiceMetrics.gauge` / :meth:`~ServiceMetrics.histogram` prefix the
service name and validate the convention (asking twice for the same name returns the same metric); the library
creates metrics only through the catalogue.

Always present on every service: process CPU seconds / resident memory (prometheus_client's
``ProcessCollector`` under the service prefix), ``process_cpu_ratio``, ``up``, ``info`` and
``wire_rejects_total{reason}``; with a :class:`MetricsServer`, also ``http_connections`` and
``http_rejects_total{reason}``. GPU utilisation and memory per device come from NVML (``nvidia-ml-py``)
and are only registered when a GPU is visible; on a CPU machine they are absent, not zero.

:class:`MetricsServer` serves the registry: ``/metrics`` in the Prometheus text format, ``/health`` as JSON
(HTTP 200 when the status is ``ok``, 503 otherwise), from an asyncio loop on one daemon thread. What a client
can cost it is bounded (see the class): no thread per connection, at most ``max_connections`` descriptors, each
for at most twice ``request_timeout_s``; optional TLS and HTTP basic auth.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import json
import logging
import os
import platform
import queue
import re
import socket
import ssl
import string
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from async_vapo.metrics.catalogue import (  # noqa: F401  (re-exported: the buckets are used beside the metrics)
    CLIP_SIDES,
    HTTP_REJECT_REASONS,
    LATENCY_BUCKETS,
    LOSS_KINDS,
    SAMPLE_AGE_BUCKETS,
    TRANSFER_BUCKETS,
    MetricKind,
    MetricSpec,
    specs_for,
)

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
    weight_transfers_total: Counter  # labels: via = dist | shm | zmq | file
    admission_rejects_total: Counter  # labels: reason

    @classmethod
    def create(cls, m: ServiceMetrics) -> RolloutMetrics:
        return cls(**{f.name: m.get(f.name) for f in fields(cls)})


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
        return cls(**{f.name: m.get(f.name) for f in fields(cls)})


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
        return cls(**{f.name: m.get(f.name) for f in fields(cls)})


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
        return cls(**{f.name: m.get(f.name) for f in fields(cls)})


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
        for spec in specs_for(service):
            self._create(spec)
        self.process_cpu_ratio = self.get("process_cpu_ratio")
        self.process_cpu_ratio.set_function(_CpuRatio())
        self.up = self.get("up")
        self.info = self.get("info")
        self.info.labels(package_version=__version__, python_version=platform.python_version()).set(1)
        self.wire_rejects_total = self.get("wire_rejects_total")
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

    def _create(self, spec: MetricSpec) -> Any:
        if spec.kind == "counter":
            metric = self.counter(spec.name, spec.help, spec.labels)
        elif spec.kind == "gauge":
            metric = self.gauge(spec.name, spec.help, spec.labels)
        else:
            metric = self.histogram(spec.name, spec.help, spec.buckets or (), spec.labels)
        for values in spec.series:
            metric.labels(*values)
        return metric

    def get(self, name: str) -> Any:
        """The catalogue's metric ``name`` of this service (``async_vapo.metrics.catalogue``), created with the
        service; a name the catalogue does not declare for it is an error."""
        with self._lock:
            got = self._metrics.get(self.full_name(name))
        if got is None:
            raise KeyError(f"{self.full_name(name)} is not declared in async_vapo.metrics.catalogue for the "
                           f"{self.service} service")
        return got[2]

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


"""``http_rejects_total{reason}``: connection over ``max_connections`` (closed at accept), no complete request
(or response taken) within ``request_timeout_s``, not a well-formed GET/HEAD, wrong or missing credentials,
failed TLS handshake."""

_MAX_HEAD_BYTES = 8192  # request line and headers
_MAX_HEADERS = 64
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus):
        self.status = status


def _parse_head(head: bytes) -> _Request:
    """The request line and headers of an HTTP/1.x request (``head`` ends with the blank line)."""
    try:
        lines = head[:-4].decode("ascii").split("\r\n")
    except UnicodeDecodeError:
        raise _BadRequest(HTTPStatus.BAD_REQUEST) from None
    parts = lines[0].split(" ")
    if len(parts) != 3 or not re.fullmatch(r"HTTP/1\.[01]", parts[2]) or not parts[0].isalpha():
        raise _BadRequest(HTTPStatus.BAD_REQUEST)
    if len(lines) - 1 > _MAX_HEADERS:
        raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", name) or name.lower() in headers:
            raise _BadRequest(HTTPStatus.BAD_REQUEST)  # repeated headers too: no guessing which one counts
        headers[name.lower()] = value.strip(" \t")
    if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
        raise _BadRequest(HTTPStatus.BAD_REQUEST)  # GET and HEAD carry no body
    return _Request(parts[0], urlsplit(parts[1]).path, headers)


class MetricsServer:
    """``/metrics`` and ``/health`` of one :class:`ServiceMetrics`, served by an asyncio loop on one daemon thread.

    ``port=0`` binds a free port; :meth:`start` returns the bound one. It binds ``host`` only. Per connection,
    whatever the client does:

    * one request (answered with ``Connection: close``): GET or HEAD, no body, request line and headers at
      most 8 KiB, arriving complete (TLS handshake included) within ``request_timeout_s`` of the connection;
      the response must be taken within ``request_timeout_s`` as well. Past either, the connection is closed
      and counted (``http_rejects_total{reason="timeout"}``), so a client that connects and sends nothing
      holds one descriptor for ``request_timeout_s`` and no thread;
    * at most ``max_connections`` are open at once: one more is closed as soon as it is accepted, before any
      TLS or HTTP (``reason="capacity"``). Stalled clients therefore hold at most ``max_connections``
      descriptors, far below the process's limit, and once they time out ``/health`` answers again;
    * TLS (``tls_cert`` + ``tls_key``, TLS 1.2 or newer) and HTTP basic auth (``basic_auth_user`` +
      ``basic_auth_password_sha256``, the hex SHA-256 of the password; user and digest compared in constant
      time) are optional. With auth, every path, ``/health`` included, answers 401 without the right
      credentials (``reason="unauthorized"``). Without TLS the password crosses the network in clear.

    ``/metrics`` is rendered on a separate thread, so a collector that blocks (NVML on a lost GPU) delays
    only ``/metrics`` (503 after ``request_timeout_s``), never ``/health``.
    """

    def __init__(self, metrics: ServiceMetrics, host: str = "127.0.0.1", port: int = 0, *,
                 request_timeout_s: float = 5.0, max_connections: int = 64, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, basic_auth_user: str | None = None,
                 basic_auth_password_sha256: str | None = None):
        if not request_timeout_s > 0 or max_connections < 1:
            raise ValueError("request_timeout_s must be > 0 and max_connections >= 1")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if (basic_auth_user is None) != (basic_auth_password_sha256 is None):
            raise ValueError("basic auth needs both basic_auth_user and basic_auth_password_sha256")
        self.metrics, self.host, self.port = metrics, host, port
        self.request_timeout_s, self.max_connections = float(request_timeout_s), max_connections
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self._auth: tuple[bytes, bytes] | None = None
        if basic_auth_user is not None and basic_auth_password_sha256 is not None:
            digest = basic_auth_password_sha256.lower()
            if not basic_auth_user or ":" in basic_auth_user or not _SHA256_HEX.match(digest):
                raise ValueError("basic_auth_user must be non-empty without ':' and basic_auth_password_sha256 "
                                 "64 hex digits")
            self._auth = (basic_auth_user.encode(), digest.encode())
        self.rejects = metrics.get("http_rejects_total")
        self.connections = metrics.get("http_connections")
        self._open = 0  # touched on the loop's thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._tls: ssl.SSLContext | None = None
        self._tasks: set[asyncio.Task] = set()
        self._render_queue: queue.SimpleQueue[asyncio.Future | None] = queue.SimpleQueue()
        self._rendering: asyncio.Future | None = None

    @classmethod
    def from_config(cls, metrics: ServiceMetrics, http, host: str, port: int) -> MetricsServer:
        """The server of a ``cluster.metrics_http`` section (``MetricsHttpConfig``) on ``host:port``."""
        return cls(metrics, host, port, request_timeout_s=http.request_timeout_s,
                   max_connections=http.max_connections, tls_cert=http.tls_cert, tls_key=http.tls_key,
                   basic_auth_user=http.basic_auth_user, basic_auth_password_sha256=http.basic_auth_password_sha256)

    def set_health(self, **fields: Any) -> None:
        self.metrics.set_health(**fields)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls_cert else 'http'}://{host}:{self.port}"

    def start(self) -> int:
        """Bind and serve; raises here (not on the thread) for an address in use or unusable TLS files."""
        if self._thread is not None:
            raise RuntimeError("MetricsServer already started")
        tls = None
        if self.tls_cert is not None:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            tls.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        sock = socket.create_server((self.host, self.port), family=socket.AF_INET6 if ":" in self.host
                                    else socket.AF_INET, backlog=128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        self._sock, self._tls = sock, tls
        self._loop = loop = asyncio.new_event_loop()
        loop.add_reader(sock.fileno(), self._accept)
        name = f"metrics-{self.metrics.service}-{self.metrics.instance}"
        self._render_queue = queue.SimpleQueue()
        # Daemon threads: neither a stuck collector nor the loop may keep the process from exiting.
        threading.Thread(target=self._render_forever, args=(loop, self._render_queue), daemon=True,
                         name=f"{name}-render").start()
        self._thread = threading.Thread(target=self._run, args=(loop,), daemon=True, name=name)
        self._thread.start()
        return self.port

    def stop(self) -> None:
        if self._thread is None or self._loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        self._thread.join(timeout=5)
        self._render_queue.put(None)
        self._thread, self._loop = None, None

    def __enter__(self) -> MetricsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _render_forever(self, loop: asyncio.AbstractEventLoop, jobs: queue.SimpleQueue) -> None:
        """Render the exposition for each future queued by the loop, and settle it on the loop."""
        while (future := jobs.get()) is not None:
            try:
                body, error = self.metrics.exposition(), None
            except Exception as e:
                body, error = b"", e
            try:
                loop.call_soon_threadsafe(_settle, future, body, error)
            except RuntimeError:  # the loop is closed: the server stopped
                return

    # -- on the loop's thread ------------------------------------------------------------------------------

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            loop.run_until_complete(asyncio.sleep(0))  # the aborted transports' close callbacks
        finally:
            loop.close()

    async def _exposition(self) -> bytes:
        """The registry's exposition from the render thread; requests arriving while one is rendered share it, so
        a collector that hangs holds one render, not one per scrape."""
        if self._rendering is None or self._rendering.done():
            self._rendering = asyncio.get_running_loop().create_future()
            self._render_queue.put(self._rendering)
        return await asyncio.shield(self._rendering)

    def _accept(self) -> None:
        """Accept what is pending. Over the cap a connection is reset right here: its descriptor never outlives
        this call, however many arrive at once."""
        assert self._loop is not None and self._sock is not None
        for _ in range(128):
            try:
                conn, _addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors or memory: the socket stays readable; pause, do not spin
                log.warning("metrics server: accept failed (%s); pausing 0.1 s", e)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(0.1, self._loop.add_reader, self._sock.fileno(), self._accept)
                return
            if self._open >= self.max_connections:
                self.rejects.labels(reason="capacity").inc()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, no TIME_WAIT
                conn.close()
                continue
            self._open += 1
            self.connections.set(self._open)
            task = self._loop.create_task(self._connection(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _shutdown(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is not None:
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        loop.stop()

    async def _connection(self, conn: socket.socket) -> None:
        streams: list[asyncio.StreamWriter] = []  # the writer, once the connection (and TLS) is up
        try:
            try:  # TLS handshake and request head, under one deadline
                head = await asyncio.wait_for(self._read_request(conn, streams), self.request_timeout_s)
            except (ssl.SSLError, ConnectionError) as e:
                if not streams:
                    self.rejects.labels(reason="tls").inc()
                    log.debug("metrics client: TLS handshake failed: %s", e)
                return
            except asyncio.TimeoutError:
                self.rejects.labels(reason="timeout").inc()
                return
            except asyncio.IncompleteReadError:
                return  # closed before a whole request: nobody to answer
            except asyncio.LimitOverrunError:
                self.rejects.labels(reason="malformed").inc()
                await self._respond(streams[0], HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
                return
            await self._answer(head, streams[0])
        except (ConnectionError, OSError) as e:  # the client went away mid-answer: its business
            log.debug("metrics client: %s", e)
        finally:
            self._open -= 1
            self.connections.set(self._open)
            if streams:
                await self._close(streams[0])
            else:
                conn.close()

    async def _read_request(self, conn: socket.socket, streams: list[asyncio.StreamWriter]) -> bytes:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=_MAX_HEAD_BYTES, loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        # The handshake's own timeout is a backstop: the caller's deadline comes first.
        transport, _ = await loop.connect_accepted_socket(
            lambda: protocol, conn, ssl=self._tls,
            ssl_handshake_timeout=self.request_timeout_s + 1 if self._tls is not None else None)
        streams.append(asyncio.StreamWriter(transport, protocol, reader, loop))
        return await reader.readuntil(b"\r\n\r\n")

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            request = _parse_head(head)
        except _BadRequest as e:
            self.rejects.labels(reason="malformed").inc()
            await self._respond(writer, e.status)
            return
        if request.method not in ("GET", "HEAD"):
            self.rejects.labels(reason="malformed").inc()
            await self._respond(writer, HTTPStatus.METHOD_NOT_ALLOWED, extra={"Allow": "GET, HEAD"})
            return
        head_only = request.method == "HEAD"
        if not self._authorized(request.headers.get("authorization")):
            self.rejects.labels(reason="unauthorized").inc()
            await self._respond(writer, HTTPStatus.UNAUTHORIZED, head_only=head_only,
                                extra={"WWW-Authenticate": 'Basic realm="async-vapo", charset="UTF-8"'})
            return
        if request.path == "/metrics":
            try:
                body = await asyncio.wait_for(self._exposition(), self.request_timeout_s)
            except asyncio.TimeoutError:
                await self._respond(writer, HTTPStatus.SERVICE_UNAVAILABLE, b"metrics collection timed out\n",
                                    head_only=head_only)
                return
            await self._respond(writer, HTTPStatus.OK, body, CONTENT_TYPE_LATEST, head_only)
        elif request.path == "/health":
            doc = self.metrics.health()
            status = HTTPStatus.OK if doc["status"] == "ok" else HTTPStatus.SERVICE_UNAVAILABLE
            await self._respond(writer, status, json.dumps(doc).encode(), "application/json", head_only)
        else:
            await self._respond(writer, HTTPStatus.NOT_FOUND, b"not found: try /metrics or /health\n",
                                head_only=head_only)

    def _authorized(self, header: str | None) -> bool:
        if self._auth is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        try:
            decoded = base64.b64decode(token.strip(), validate=True)
        except (binascii.Error, ValueError):
            decoded = b""
        user, sep, password = decoded.partition(b":")
        # Both comparisons always run, each in constant time for its length (the digest's is fixed).
        user_ok = hmac.compare_digest(user, self._auth[0])
        password_ok = hmac.compare_digest(hashlib.sha256(password).hexdigest().encode(), self._auth[1])
        return bool(user_ok & password_ok) and sep == b":" and scheme.lower() == "basic"

    async def _respond(self, writer: asyncio.StreamWriter, status: HTTPStatus, body: bytes | None = None,
                       content_type: str = "text/plain; charset=utf-8", head_only: bool = False,
                       extra: Mapping[str, str] | None = None) -> None:
        if body is None:
            body = f"{status.value} {status.phrase}\n".encode()
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", "Connection: close", *(f"{k}: {v}" for k, v in (extra or {}).items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body))
        try:
            await asyncio.wait_for(writer.drain(), self.request_timeout_s)
        except asyncio.TimeoutError:
            self.rejects.labels(reason="timeout").inc()

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        """Close gracefully (what was written is sent, a TLS close_notify too) within a second, else reset."""
        try:
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (asyncio.TimeoutError, ConnectionError, OSError, ssl.SSLError):
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()
            raise


def _settle(future: asyncio.Future, body: bytes, error: Exception | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(body)
    else:
        future.set_exception(error)


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
                             scrape_interval: str = "5s", scrape_timeout: str = "4s", run_name: str = "async-vapo",
                             tls: bool = False, tls_ca_file: str | None = None, basic_auth_user: str | None = None,
                             basic_auth_password_file: str | None = None) -> Path:
    """Fill the ``string.Template`` placeholders of ``prometheus.yml.tmpl`` and write ``out``.
    A relative ``targets_file`` (or CA / password file) is resolved by Prometheus against the directory of ``out``.

    ``tls``: the services serve HTTPS (scheme https; verified against ``tls_ca_file``, or not verified at all
    without one); ``basic_auth_user`` with ``basic_auth_password_file`` (the password itself, which Prometheus
    reads at each scrape): the credentials the services require."""
    if (basic_auth_user is None) != (basic_auth_password_file is None):
        raise ValueError("basic auth needs both basic_auth_user and basic_auth_password_file")
    if tls_ca_file is not None and not tls:
        raise ValueError("tls_ca_file without tls")
    client: list[str] = []
    if tls:
        client.append("tls_config:")
        client.append(f"  ca_file: {json.dumps(tls_ca_file)}" if tls_ca_file is not None
                      else "  insecure_skip_verify: true  # no CA configured: encrypted, the server unverified")
    if basic_auth_user is not None:
        client += ["basic_auth:", f"  username: {json.dumps(basic_auth_user)}",
                   f"  password_file: {json.dumps(basic_auth_password_file)}"]  # JSON strings are YAML scalars
    text = string.Template(Path(template).read_text()).substitute(
        targets_file=targets_file, scrape_interval=scrape_interval, scrape_timeout=scrape_timeout, run_name=run_name,
        scheme="https" if tls else "http", http_client="".join(f"    {line}\n" for line in client))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out
