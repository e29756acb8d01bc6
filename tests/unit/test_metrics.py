"""Prometheus metrics: naming convention, per-service sets, a real /metrics + /health server on loopback
(hostile clients included: stalled, over the cap, malformed, unauthenticated; TLS with a certificate made
here), GPU metrics, and the deploy files (Grafana dashboard, Prometheus template) against the real names."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from async_vapo.metrics.prom import (
    MetricsServer,
    ServiceMetrics,
    render_prometheus_config,
    validate_label_names,
    validate_metric_name,
    write_file_sd_targets,
)

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    "rollout": ["generated_tokens_total", "generated_samples_total", "inflight_groups", "served_version",
                "weight_load_seconds", "weight_transfers_total", "admission_rejects_total"],
    "verifier": ["checks_total", "timeouts_total", "rejects_total", "queue_depth", "check_seconds"],
    "replay": ["stored_groups", "stale_drops_total", "batch_assembly_seconds", "sample_age_versions", "batches_total"],
    "learner": ["step_seconds", "loss", "reward", "accuracy", "entropy", "clipfrac", "explained_variance", "version",
                "broadcast_seconds", "weight_fetch_bytes_total", "value_pretrain_steps_total"],
}
COMMON = ["process_cpu_ratio", "up", "info", "wire_rejects_total"]


def scrape(url: str, *, context: ssl.SSLContext | None = None, auth: tuple[str, str] | None = None,
           timeout: float = 5) -> tuple[int, str, str]:
    headers = {"Authorization": "Basic " + base64.b64encode(":".join(auth).encode()).decode()} if auth else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout,
                                    context=context) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("Content-Type", ""), e.read().decode()


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def nvml_has_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        return False


# -- naming convention ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,kind", [
    ("async_vapo_replay_stale_drops", "counter"),          # counter without _total
    ("async_vapo_replay_stored_groups_total", "gauge"),    # _total on a gauge
    ("async_vapo_replay:stale_drops_total", "counter"),    # colon
    ("async_vapo_Replay_stale_drops_total", "counter"),    # upper case
    ("async_vapo_replay__stale_drops_total", "counter"),   # empty word
    ("async_vapo_replay_stale_drops_total_", "counter"),   # trailing underscore
    ("async_vapo_learner_step_ms", "histogram"),           # non-base unit
    ("async_vapo_learner_step_minutes", "gauge"),
    ("async_vapo_rollout_memory_mib", "gauge"),
    ("async_vapo_rollout_gpu_util_percent", "gauge"),
    ("async_vapo_learner_step_seconds_bucket", "histogram"),  # exposition suffix
    ("async_vapo_learner_loss_count", "gauge"),
    ("vapo_learner_loss", "gauge"),                        # missing prefix
    ("async_vapo_learner-loss", "gauge"),
    ("async_vapo_learner_loss", "summary"),                # unknown kind
])
def test_validator_rejects_bad_names(name, kind):
    with pytest.raises(ValueError):
        validate_metric_name(name, kind)


@pytest.mark.parametrize("name,kind", [
    ("async_vapo_replay_stale_drops_total", "counter"),
    ("async_vapo_learner_step_seconds", "histogram"),
    ("async_vapo_rollout_gpu_memory_used_bytes", "gauge"),
    ("async_vapo_learner_explained_variance", "gauge"),
    ("async_vapo_learner_info", "gauge"),
])
def test_validator_accepts_good_names(name, kind):
    assert validate_metric_name(name, kind) == name


@pytest.mark.parametrize("labels", [("Reason",), ("le",), ("instance",), ("request_id",), ("version",),
                                    ("__x",), ("reason", "reason"), "reason"])
def test_label_validator_rejects(labels):
    with pytest.raises(ValueError):
        validate_label_names(labels)


def test_factories_prefix_validate_and_reuse():
    m = ServiceMetrics("replay", gpu=False)
    c = m.counter("evictions_total", "Groups evicted.", labels=("reason",))
    assert m.counter("evictions_total", "Groups evicted.", labels=("reason",)) is c
    assert "async_vapo_replay_evictions_total" in m.names()
    with pytest.raises(ValueError, match="_total"):
        m.counter("evictions", "no _total")
    with pytest.raises(ValueError, match="colon"):
        m.gauge("a:b", "colon")
    with pytest.raises(ValueError):
        m.gauge("Depth", "upper case")
    m.gauge("depth", "Groups waiting.")
    with pytest.raises(ValueError, match="already exists"):
        m.histogram("depth", "same name, other kind", buckets=(1, 2))
    with pytest.raises(ValueError, match="already exists"):
        m.counter("evictions_total", "same name, other labels")
    with pytest.raises(ValueError, match="increasing"):
        m.histogram("wait_seconds", "bad buckets", buckets=(1, 1, 2))
    with pytest.raises(ValueError):
        m.gauge("depth", "bad label", labels=("request_id",))
    with pytest.raises(ValueError):
        ServiceMetrics("Bad-Service", gpu=False)


# -- per-service sets ----------------------------------------------------------------------------------

@pytest.mark.parametrize("service", sorted(EXPECTED))
def test_service_sets_keep_their_names(service):
    """The typed set's names are unchanged (dashboards and alerts use them); the catalogue declares more
    (tests/unit/test_catalogue.py checks that a service creates exactly the catalogue's)."""
    m = ServiceMetrics(service, gpu=False)
    getattr(m, service)
    assert set(f"async_vapo_{service}_{n}" for n in EXPECTED[service] + COMMON) <= set(m.names())


def test_full_names_and_types():
    replay, learner, rollout = (ServiceMetrics(s, gpu=False) for s in ("replay", "learner", "rollout"))
    replay.replay.stale_drops_total.inc(3)
    learner.learner.explained_variance.set(0.25)
    learner.learner.clipfrac.labels(side="high").set(0.125)
    rollout.rollout.served_version.set(7)
    f = families(replay.exposition().decode()) | families(learner.exposition().decode()) \
        | families(rollout.exposition().decode())
    # the parser strips _total from a counter's family name; the sample keeps it
    assert f["async_vapo_replay_stale_drops"].type == "counter"
    assert [(s.name, s.value) for s in f["async_vapo_replay_stale_drops"].samples] == [
        ("async_vapo_replay_stale_drops_total", 3.0)]
    assert f["async_vapo_learner_explained_variance"].type == "gauge"
    assert f["async_vapo_learner_explained_variance"].samples[0].value == 0.25
    assert f["async_vapo_rollout_served_version"].samples[0].value == 7.0
    assert {s.labels["kind"] for s in f["async_vapo_learner_loss"].samples} == {"policy", "value", "pos_lm"}
    assert {s.labels["side"]: s.value for s in f["async_vapo_learner_clipfrac"].samples} == {"low": 0.0, "high": 0.125}
    assert f["async_vapo_learner_step_seconds"].type == "histogram"
    assert not [n for n in f if n.endswith("_created")]


def test_learner_rows_with_undefined_values_export_nan_gauges():
    """An explained variance undefined at the last update (NaN in the row, null once read back from
    metrics.jsonl) sets its gauges to NaN, which the exposition carries and Prometheus parses; defined values
    still go through."""
    import math

    from async_vapo.services.learner import export_row

    m = ServiceMetrics("learner", gpu=False)
    export_row(m, {"kind": "train", "step": 3, "critic/explained_variance": 0.5, "critic_age/0/explained_variance": 0.5,
                   "critic_age/0/value_error_abs": 0.25, "critic_age/0/samples": 8.0}, version=3)
    export_row(m, {"kind": "train", "step": 4, "critic/explained_variance": math.nan, "rollout/reward": 0.75,
                   "critic_age/0/explained_variance": None, "critic_age/0/value_error_abs": 0.125,
                   "critic_age/0/samples": 8.0}, version=4)
    f = families(m.exposition().decode())
    assert math.isnan(f["async_vapo_learner_explained_variance"].samples[0].value)
    assert math.isnan(f["async_vapo_learner_critic_explained_variance_by_age"].samples[0].value)
    assert f["async_vapo_learner_critic_value_error_abs_by_age"].samples[0].value == 0.125
    assert f["async_vapo_learner_reward"].samples[0].value == 0.75
    assert f["async_vapo_learner_version"].samples[0].value == 4.0
    assert m.health()["policy_version"] == 4 and m.health()["step"] == 4


def test_sample_age_buckets():
    m = ServiceMetrics("replay", gpu=False)
    for age in (0, 1, 1, 5, 40):
        m.replay.sample_age_versions.observe(age)
    fam = families(m.exposition().decode())["async_vapo_replay_sample_age_versions"]
    buckets = {s.labels["le"]: s.value for s in fam.samples if s.name.endswith("_bucket")}
    # cumulative counts of (0, 1, 1, 5, 40): <=0: 1, <=1: 3, <=2..4: 3, <=6: 4, <=8, <=16: 4, +Inf: 5
    assert buckets == {"0.0": 1, "1.0": 3, "2.0": 3, "3.0": 3, "4.0": 3, "6.0": 4, "8.0": 4, "16.0": 4, "+Inf": 5}


def test_set_belongs_to_its_service():
    m = ServiceMetrics("rollout", gpu=False)
    with pytest.raises(ValueError, match="learner"):
        m.learner  # noqa: B018
    assert m.rollout is m.rollout


def test_two_services_in_one_process_do_not_collide():
    a, b = ServiceMetrics("replay", "0", gpu=False), ServiceMetrics("replay", "1", gpu=False)
    a.replay.stored_groups.set(5)
    b.replay.stored_groups.set(9)
    assert a.registry.get_sample_value("async_vapo_replay_stored_groups") == 5
    assert b.registry.get_sample_value("async_vapo_replay_stored_groups") == 9
    assert not [f.name for f in REGISTRY.collect() if f.name.startswith("async_vapo")]


def test_health_fields_and_up_gauge():
    m = ServiceMetrics("verifier", "2", gpu=False)
    assert m.health()["status"] == "starting"
    assert m.registry.get_sample_value("async_vapo_verifier_up") == 0
    m.set_health(status="ok", workers=4)
    assert m.registry.get_sample_value("async_vapo_verifier_up") == 1
    doc = m.health()
    assert doc["service"] == "verifier" and doc["instance"] == "2" and doc["workers"] == 4 and doc["version"]
    with pytest.raises(ValueError):
        m.set_health(status="fine")
    with pytest.raises(TypeError):
        m.set_health(blob=object())
    with pytest.raises(ValueError):
        m.set_health(service="other")


def test_process_cpu_ratio_tracks_cpu_use():
    m = ServiceMetrics("learner", gpu=False)
    assert m.registry.get_sample_value("async_vapo_learner_process_cpu_ratio") is not None
    t = os.times()
    start = t.user + t.system
    while (lambda t: t.user + t.system)(os.times()) - start < 0.1:  # burn 0.1 s of CPU, however busy the box is
        sum(i * i for i in range(1000))
    ratio = m.registry.get_sample_value("async_vapo_learner_process_cpu_ratio")
    assert 0 < ratio <= 1


# -- the server on loopback ----------------------------------------------------------------------------

def test_metrics_server_scrape_and_health():
    m = ServiceMetrics("replay", "0")
    m.replay.stale_drops_total.inc(2)
    m.replay.stored_groups.set(11)
    m.replay.sample_age_versions.observe(3)
    m.wire_rejects_total.labels(reason="oversize").inc()
    server = MetricsServer(m, port=0)
    port = server.start()
    try:
        assert port > 0 and server.url == f"http://127.0.0.1:{port}"
        code, ctype, text = scrape(f"{server.url}/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert "async_vapo_replay_stale_drops_total 2.0" in text
        assert "async_vapo_replay_stored_groups 11.0" in text
        f = families(text)
        assert f["async_vapo_replay_stale_drops"].type == "counter"
        assert f["async_vapo_replay_stored_groups"].type == "gauge"
        assert f["async_vapo_replay_sample_age_versions"].type == "histogram"
        assert f["async_vapo_replay_wire_rejects"].samples[0].labels == {"reason": "oversize"}
        # process metrics, under the service prefix
        assert f["async_vapo_replay_process_cpu_seconds"].type == "counter"
        assert f["async_vapo_replay_process_resident_memory_bytes"].samples[0].value > 1e6
        assert f["async_vapo_replay_info"].samples[0].labels["package_version"]
        # a query string does not change the route
        assert scrape(f"{server.url}/metrics?name[]=x")[0] == 200

        code, ctype, body = scrape(f"{server.url}/health")
        assert code == 503 and ctype == "application/json"
        assert json.loads(body)["status"] == "starting"
        server.set_health(status="ok", stored_groups=11)
        code, _, body = scrape(f"{server.url}/health")
        doc = json.loads(body)
        assert code == 200
        assert doc["status"] == "ok" and doc["service"] == "replay" and doc["instance"] == "0"
        assert doc["stored_groups"] == 11
        m.set_health(status="degraded", reason="learner unreachable")
        code, _, body = scrape(f"{server.url}/health")
        assert code == 503 and json.loads(body)["reason"] == "learner unreachable"
        assert "async_vapo_replay_up 0.0" in scrape(f"{server.url}/metrics")[2]

        assert scrape(f"{server.url}/")[0] == 404
        assert scrape(f"{server.url}/metricsx")[0] == 404
    finally:
        server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_two_servers_side_by_side():
    a, b = ServiceMetrics("rollout", gpu=False), ServiceMetrics("learner", gpu=False)
    a.rollout.generated_tokens_total.inc(100)
    b.learner.version.set(4)
    with MetricsServer(a) as sa, MetricsServer(b) as sb:
        assert sa.port != sb.port
        ta, tb = scrape(f"{sa.url}/metrics")[2], scrape(f"{sb.url}/metrics")[2]
    assert "async_vapo_rollout_generated_tokens_total 100.0" in ta and "async_vapo_learner" not in ta
    assert "async_vapo_learner_version 4.0" in tb and "async_vapo_rollout" not in tb


# -- GPU -------------------------------------------------------------------------------------------------

def test_gpu_metrics_present_only_with_a_gpu(caplog):
    with caplog.at_level(logging.DEBUG, logger="async_vapo.metrics.prom"):
        m = ServiceMetrics("rollout")
    gpu_families = [n for n in families(m.exposition().decode()) if "_gpu_" in n]
    if nvml_has_gpu():
        assert m.gpu_devices > 0
        assert {"async_vapo_rollout_gpu_utilization_ratio", "async_vapo_rollout_gpu_memory_used_bytes",
                "async_vapo_rollout_gpu_memory_total_bytes"} <= set(gpu_families)
    else:
        assert m.gpu_devices == 0 and gpu_families == []
        assert len([r for r in caplog.records if "no GPU metrics" in r.getMessage()]) == 1
        assert not [r for r in caplog.records if r.levelno > logging.DEBUG]


class FakeNvml:
    """The four NVML calls the collector makes, for two devices; device 1 fails its memory query."""

    def nvmlInit(self):  # noqa: N802
        pass

    def nvmlDeviceGetCount(self):  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):  # noqa: N802
        return i

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return SimpleNamespace(gpu=[37, 90][h], memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        if h == 1:
            raise RuntimeError("GPU is lost")
        return SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)


def test_gpu_collector_reads_nvml_per_device():
    m = ServiceMetrics("learner", gpu=FakeNvml())
    assert m.gpu_devices == 2
    f = families(m.exposition().decode())
    # device 1's failing query drops that device from this scrape instead of failing the scrape
    assert [(s.labels, s.value) for s in f["async_vapo_learner_gpu_utilization_ratio"].samples] == [({"gpu": "0"},
                                                                                                     0.37)]
    assert f["async_vapo_learner_gpu_memory_used_bytes"].samples[0].value == 3 * 2**30
    assert f["async_vapo_learner_gpu_memory_total_bytes"].samples[0].value == 80 * 2**30


# -- deploy files ---------------------------------------------------------------------------------------

def all_exported_names() -> set[str]:
    """Every sample name the four services can export (histogram series included)."""
    out = set()
    for service in EXPECTED:
        m = ServiceMetrics(service, gpu=FakeNvml())
        getattr(m, service)
        for fam in m.registry.collect():  # labelled metrics without children have no samples yet
            suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(fam.type, ("",))
            out.update(fam.name + sfx for sfx in suffixes)
    return out


def test_grafana_dashboard_uses_real_names_and_covers_every_set():
    dash = json.loads((ROOT / "deploy/grafana/async-vapo-dashboard.json").read_text())
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    exported = all_exported_names()
    referenced = set(re.findall(r"\basync_vapo_[a-z0-9_]*[a-z0-9]\b", " ".join(exprs)))
    assert referenced and referenced <= exported, sorted(referenced - exported)
    for pattern in re.findall(r'__name__=~"([^"]+)"', " ".join(exprs)):
        assert any(re.fullmatch(pattern, n) for n in exported), pattern
    # every predefined metric is on some panel
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in referenced}
    for service, names in EXPECTED.items():
        for n in names:
            assert f"async_vapo_{service}_{n}" in base, f"async_vapo_{service}_{n} is on no panel"
    assert any(p["type"] == "heatmap" and "sample_age_versions_bucket" in p["targets"][0]["expr"] for p in panels)


def test_prometheus_template_renders_with_file_sd(tmp_path):
    yaml = pytest.importorskip("yaml")
    out = render_prometheus_config(ROOT / "deploy/prometheus/prometheus.yml.tmpl", tmp_path / "prometheus.yml",
                                   scrape_interval="2s", scrape_timeout="1s", run_name="t")
    text = out.read_text()
    assert "${" not in text
    cfg = yaml.safe_load(text)
    assert cfg["global"]["scrape_interval"] == "2s"
    job = cfg["scrape_configs"][0]
    assert job["file_sd_configs"][0]["files"] == ["targets.json"]
    assert job["metrics_path"] == "/metrics"
    targets = write_file_sd_targets(tmp_path / "targets.json",
                                    {"rollout": ["127.0.0.1:9101", "127.0.0.1:9102"], "learner": ["127.0.0.1:9200"]})
    assert json.loads(targets.read_text()) == [
        {"targets": ["127.0.0.1:9101"], "labels": {"service": "rollout", "replica": "0"}},
        {"targets": ["127.0.0.1:9102"], "labels": {"service": "rollout", "replica": "1"}},
        {"targets": ["127.0.0.1:9200"], "labels": {"service": "learner", "replica": "0"}},
    ]
    with pytest.raises(ValueError):
        write_file_sd_targets(tmp_path / "t.json", {"rollout": ["http://127.0.0.1:9101/metrics"]})


def test_server_stop_is_prompt():
    server = MetricsServer(ServiceMetrics("replay", gpu=False))
    server.start()
    t0 = time.perf_counter()
    server.stop()
    server.stop()  # idempotent
    assert time.perf_counter() - t0 < 2


# -- hostile clients -----------------------------------------------------------------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
STALLED_SERVER = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))  # a server near its descriptor limit
from async_vapo.metrics.prom import MetricsServer, ServiceMetrics
server = MetricsServer(ServiceMetrics("replay", gpu=False), request_timeout_s=1.0, max_connections=64)
print(server.start(), flush=True)
time.sleep(60)
"""


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _rejects(m: ServiceMetrics, reason: str) -> float:
    return m.registry.get_sample_value(f"{m.prefix}_http_rejects_total", {"reason": reason})


def _eventually(condition, timeout_s: float = 1.0) -> bool:
    """The server counts on its own thread, possibly just after the client saw the connection close."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_stalled_clients_cost_no_thread_and_are_cut_at_the_timeout():
    """300 clients connect and send nothing to a server whose descriptor limit is 128: it holds at most
    max_connections of them, no thread each, drops them at request_timeout_s, and /health answers again
    within a second of that."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", STALLED_SERVER], stdout=subprocess.PIPE, text=True, env=env)
    clients: list[socket.socket] = []
    try:
        port = int(proc.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        assert scrape(f"{url}/health")[0] == 503  # up ("starting")
        fds0, threads0 = _fds(proc.pid), _threads(proc.pid)
        refused, stuck = 0, 0
        t0 = time.monotonic()
        for _ in range(300):
            try:  # a SYN dropped while the listen queue is full is resent after 1 s: 3 s covers a busy machine
                clients.append(socket.create_connection(("127.0.0.1", port), timeout=3))
            except TimeoutError:  # the server no longer accepts at all
                stuck += 1
                if time.monotonic() - t0 > 10:
                    break
            except OSError:  # reset at accept: the server is full
                refused += 1
        last_connect = time.monotonic()
        assert stuck == 0, f"{stuck} connects found the server's listen queue full ({len(clients)} connected)"
        time.sleep(0.2)
        held_fds, held_threads = _fds(proc.pid) - fds0, _threads(proc.pid)
        answered = None
        while time.monotonic() < last_connect + 1.0 + 1.0:  # the timeout, then at most a second
            try:
                if scrape(f"{url}/health", timeout=0.5)[0] == 503:
                    answered = time.monotonic() - last_connect
                    break
            except OSError:
                pass
            time.sleep(0.02)
        print(f"300 stalled clients ({refused} reset at connect): server holds {held_fds} more descriptors, "
              f"{held_threads} threads (was {threads0}); /health answered {answered} s after the last connect")
        assert held_fds <= 64 and held_threads == threads0
        assert answered is not None
        time.sleep(max(0.0, last_connect + 1.3 - time.monotonic()))  # every stalled client has timed out
        text = scrape(f"{url}/metrics")[2]
        counts = {s.labels["reason"]: s.value for s in families(text)["async_vapo_replay_http_rejects"].samples}
        print("rejects", counts, "descriptors now", _fds(proc.pid) - fds0)
        assert counts["timeout"] >= 1 and counts["capacity"] + counts["timeout"] >= 300
        assert _fds(proc.pid) - fds0 <= 1  # the /metrics connection itself, at most
    finally:
        for c in clients:
            c.close()
        proc.kill()
        proc.wait()


def test_connections_over_the_cap_are_reset_and_counted():
    m = ServiceMetrics("replay", gpu=False)
    with MetricsServer(m, max_connections=4, request_timeout_s=5.0) as server:
        idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
        deadline = time.monotonic() + 2
        while m.registry.get_sample_value("async_vapo_replay_http_connections") != 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(OSError):  # reset at once: at connect, or at the first read
            with socket.create_connection(("127.0.0.1", server.port), timeout=1) as extra:
                extra.sendall(b"GET /health HTTP/1.1\r\n\r\n")
                if not extra.recv(100):
                    raise ConnectionResetError("closed without an answer")
        assert time.monotonic() - t0 < 0.5
        assert _rejects(m, "capacity") == 1
        idle.pop().close()  # a client that goes frees its slot at once, not at the timeout
        deadline = time.monotonic() + 1
        while m.registry.get_sample_value("async_vapo_replay_http_connections") != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert scrape(f"{server.url}/health")[0] == 503
        for c in idle:
            c.close()


def test_a_trickling_request_is_cut_at_the_timeout():
    """A client sending a byte every 0.2 s never lets a per-read timeout fire; the deadline is per request."""
    m = ServiceMetrics("replay", gpu=False)
    with MetricsServer(m, request_timeout_s=1.0) as server, \
            socket.create_connection(("127.0.0.1", server.port)) as c:
        t0 = time.monotonic()
        closed_at = None
        for byte in b"GET /health HTTP/1.1\r\nX-Slow: " + b"a" * 20:
            try:
                c.sendall(bytes([byte]))
            except OSError:
                closed_at = time.monotonic() - t0
                break
            time.sleep(0.2)
            c.setblocking(False)
            try:
                if c.recv(1) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_at = time.monotonic() - t0
                break
            finally:
                c.setblocking(True)
        print("trickling client closed after", closed_at)
        assert closed_at is not None and 0.9 < closed_at < 1.6
        assert _rejects(m, "timeout") == 1


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(request)
        out = b""
        while chunk := c.recv(65536):
            out += chunk
    return out


def test_malformed_requests_are_answered_and_counted():
    m = ServiceMetrics("replay", gpu=False)
    with MetricsServer(m) as server:
        cases = [
            (b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", b"405"),
            (b"GARBAGE\r\n\r\n", b"400"),
            (b"GET /health HTTP/2.0\r\n\r\n", b"400"),
            (b"GET /health HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", b"400"),
            (b"GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", b"400"),
            (b"GET /health HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
            (b"GET /health HTTP/1.1\r\nX: \xff\r\n\r\n", b"400"),
        ]
        for request, status in cases:
            assert _raw(server.port, request).split(b" ")[1] == status, request[:40]
        assert _rejects(m, "malformed") == len(cases)
        ok = _raw(server.port, b"HEAD /health HTTP/1.0\r\n\r\n")
        assert ok.startswith(b"HTTP/1.1 503") and ok.endswith(b"\r\n\r\n")  # HEAD: headers only


class StuckCollector:
    """A collector that blocks until released (NVML on a GPU that fell off the bus)."""

    def __init__(self):
        self.release = threading.Event()

    def describe(self):
        return []

    def collect(self):
        self.release.wait(10)
        return []


def test_a_stuck_collector_delays_only_metrics():
    m = ServiceMetrics("replay", gpu=False)
    stuck = StuckCollector()
    m.registry.register(stuck)
    with MetricsServer(m, request_timeout_s=0.5) as server:
        try:
            t0 = time.monotonic()
            assert scrape(f"{server.url}/metrics")[0] == 503
            assert 0.4 < time.monotonic() - t0 < 2.0  # cut at the 0.5 s timeout, not stuck
            t0 = time.monotonic()
            assert scrape(f"{server.url}/health")[0] == 503 and time.monotonic() - t0 < 0.3  # "starting", at once
            assert scrape(f"{server.url}/metrics")[0] == 503  # still the one stuck render, not a second
        finally:
            stuck.release.set()
        time.sleep(0.1)
        assert scrape(f"{server.url}/metrics")[0] == 200


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 and its key (openssl CLI)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=async-vapo-test",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"], check=True, capture_output=True)
    return cert, key


PASSWORD = "correct horse battery staple"
PASSWORD_SHA256 = hashlib.sha256(PASSWORD.encode()).hexdigest()


def test_tls_scrape_with_a_self_signed_certificate(self_signed):
    cert, key = self_signed
    m = ServiceMetrics("replay", gpu=False)
    m.replay.stored_groups.set(5)
    trusted = ssl.create_default_context(cafile=str(cert))
    with MetricsServer(m, tls_cert=cert, tls_key=key, request_timeout_s=1.0) as server:
        assert server.url == f"https://127.0.0.1:{server.port}"
        code, ctype, text = scrape(f"{server.url}/metrics", context=trusted)
        assert code == 200 and "async_vapo_replay_stored_groups 5.0" in text
        assert scrape(f"{server.url}/health", context=trusted)[0] == 503
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            scrape(f"{server.url}/health", context=ssl.create_default_context())  # not a CA anyone trusts
        # plain HTTP to the TLS port gets no HTTP answer
        assert not _raw(server.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP")
        # a client that never starts the handshake is cut at the timeout
        with socket.create_connection(("127.0.0.1", server.port)) as stalled:
            t0 = time.monotonic()
            stalled.settimeout(3)
            assert stalled.recv(1) == b""
            assert 0.9 < time.monotonic() - t0 < 2.5  # cut at the 1 s timeout, before the client's 3 s
        assert _eventually(lambda: _rejects(m, "tls") == 2 and _rejects(m, "timeout") == 1)  # 2: unknown CA, plain


def test_basic_auth_rejects_wrong_credentials_and_accepts_right_ones(self_signed):
    cert, key = self_signed
    m = ServiceMetrics("replay", gpu=False)
    trusted = ssl.create_default_context(cafile=str(cert))
    with MetricsServer(m, tls_cert=cert, tls_key=key, basic_auth_user="prometheus",
                       basic_auth_password_sha256=PASSWORD_SHA256) as server:
        for path in ("/metrics", "/health", "/nope"):
            code, _, _ = scrape(f"{server.url}{path}", context=trusted)
            assert code == 401, path
        for auth in [("prometheus", "wrong"), ("root", PASSWORD), ("prometheus", PASSWORD + " "), ("", "")]:
            assert scrape(f"{server.url}/metrics", context=trusted, auth=auth)[0] == 401, auth
        request = urllib.request.Request(f"{server.url}/metrics", headers={"Authorization": "Bearer x"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(request, context=trusted, timeout=5)
        assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Basic realm=")
        code, _, text = scrape(f"{server.url}/metrics", context=trusted, auth=("prometheus", PASSWORD))
        assert code == 200 and "async_vapo_replay_up" in text
        assert scrape(f"{server.url}/health", context=trusted, auth=("prometheus", PASSWORD))[0] == 503
        assert scrape(f"{server.url}/nope", context=trusted, auth=("prometheus", PASSWORD))[0] == 404
        assert _rejects(m, "unauthorized") == 3 + 4 + 1
    with pytest.raises(ValueError, match="64 hex"):
        MetricsServer(m, basic_auth_user="p", basic_auth_password_sha256="abc")


def test_prometheus_template_renders_tls_and_basic_auth(tmp_path, self_signed):
    yaml = pytest.importorskip("yaml")
    tmpl = ROOT / "deploy/prometheus/prometheus.yml.tmpl"
    cert, _key = self_signed
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    out = render_prometheus_config(tmpl, tmp_path / "secure.yml", tls=True, tls_ca_file=str(cert),
                                   basic_auth_user="prometheus", basic_auth_password_file=str(password_file))
    job = yaml.safe_load(out.read_text())["scrape_configs"][0]
    assert job["scheme"] == "https" and job["tls_config"] == {"ca_file": str(cert)}
    assert job["basic_auth"] == {"username": "prometheus", "password_file": str(password_file)}
    assert job["file_sd_configs"][0]["files"] == ["targets.json"] and job["honor_labels"] is False
    unverified = yaml.safe_load(render_prometheus_config(tmpl, tmp_path / "u.yml", tls=True).read_text())
    assert unverified["scrape_configs"][0]["tls_config"] == {"insecure_skip_verify": True}
    plain = yaml.safe_load(render_prometheus_config(tmpl, tmp_path / "plain.yml").read_text())["scrape_configs"][0]
    assert plain["scheme"] == "http" and "tls_config" not in plain and "basic_auth" not in plain
    promtool = shutil.which("promtool")
    if promtool is not None:  # Prometheus' own parser (it also checks that ca_file and password_file exist)
        (tmp_path / "targets.json").write_text("[]")
        for name in ("secure.yml", "u.yml", "plain.yml"):
            check = subprocess.run([promtool, "check", "config", str(tmp_path / name)], capture_output=True,
                                   text=True)
            assert check.returncode == 0, check.stdout + check.stderr


def test_cluster_plan_and_services_follow_the_metrics_http_section(tmp_path, self_signed):
    """One config section drives the servers make_context starts, the rendered scrape config, the health URLs
    and the options start_cluster.sh hands to wait-health."""
    from async_vapo.config import load_config
    from async_vapo.deploy.launch import main as cluster_main
    from async_vapo.services.context import make_context

    cert, key = self_signed
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    section = [f"cluster.metrics_http.tls_cert={cert}", f"cluster.metrics_http.tls_key={key}",
               f"cluster.metrics_http.tls_ca_file={cert}", "cluster.metrics_http.basic_auth_user=prometheus",
               f"cluster.metrics_http.basic_auth_password_sha256={PASSWORD_SHA256}",
               f"cluster.metrics_http.basic_auth_password_file={password_file}",
               "cluster.metrics_http.request_timeout_s=2", f"cluster.ports.replay_metrics_port={port}"]
    cfg = load_config([], section)
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path / "run", install_signals=False)
    try:
        assert ctx.server is not None and ctx.server.url == f"https://127.0.0.1:{port}"
        assert ctx.server.request_timeout_s == 2
        trusted = ssl.create_default_context(cafile=str(cert))
        assert scrape(f"{ctx.server.url}/health", context=trusted)[0] == 401
        ctx.ready()
        assert scrape(f"{ctx.server.url}/health", context=trusted, auth=("prometheus", PASSWORD))[0] == 200

        plan = subprocess.run([sys.executable, "-m", "async_vapo.deploy.launch", "plan", "--run-dir",
                               str(tmp_path / "run"), "--", *section], capture_output=True, text=True, check=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        assert f"HEALTH_REPLAY_0='https://127.0.0.1:{port}/health'" in plan.stdout
        opts_line = next(line for line in plan.stdout.splitlines() if line.startswith("HEALTH_OPTS="))
        shell = subprocess.run(["bash", "-c", opts_line + '\nprintf "%s\\n" "${HEALTH_OPTS[@]}"'],
                               capture_output=True, text=True, check=True)
        opts = shell.stdout.splitlines()
        assert opts == ["--ca-file", str(cert), "--user", "prometheus", "--password-file", str(password_file)]
        rendered = (tmp_path / "run" / "prometheus" / "prometheus.yml").read_text()
        assert "scheme: https" in rendered and "password_file:" in rendered
        assert cluster_main(["wait-health", *opts, f"https://127.0.0.1:{port}/health", "5"]) == 0
        assert cluster_main(["wait-health", "--ca-file", str(cert), f"https://127.0.0.1:{port}/health", "1"]) == 1
    finally:
        ctx.close()
