"""Prometheus metrics: naming convention, per-service sets, a real /metrics + /health server on loopback,
GPU metrics, and the deploy files (Grafana dashboard, Prometheus template) against the real names."""

from __future__ import annotations

import json
import logging
import os
import re
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


def scrape(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
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
def test_service_sets_have_exact_names(service):
    m = ServiceMetrics(service, gpu=False)
    getattr(m, service)
    assert m.names() == sorted(f"async_vapo_{service}_{n}" for n in EXPECTED[service] + COMMON)


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

    from async_vapo.cluster.learner_service import export_row

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
