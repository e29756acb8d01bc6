"""A real Prometheus server scrapes /metrics over TLS with basic auth, configured by the rendered
``deploy/prometheus/prometheus.yml.tmpl``: the template and the MetricsServer agree on scheme, certificate
and credentials, and a target that wants other credentials is down. The server also loads
``deploy/prometheus/alerts.yml`` (copied next to the rendered file, as the template expects): every rule loads and the
service-down alert fires for that target, with the run label the template gives every series. Budget: about 10 s."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import free_ports

from async_vapo.metrics.prom import (
    MetricsServer,
    ServiceMetrics,
    render_prometheus_config,
    write_file_sd_targets,
)

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "a long random scrape password"


def _api(port: int, path: str, **params: str):
    """``data`` of a Prometheus HTTP API answer (None while the server does not answer)."""
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())["data"]
    except OSError:
        return None


def _up(port: int, query: str = "up") -> dict[str, float]:
    """``up`` per target instance, from the Prometheus HTTP API."""
    data = _api(port, "query", query=query)
    return {s["metric"]["instance"]: float(s["value"][1]) for s in data["result"]} if data else {}


def _firing(port: int) -> list[dict]:
    data = _api(port, "alerts")
    return [a for a in data["alerts"] if a["state"] == "firing"] if data else []


def _alert_rules_firing_at_once(out: Path) -> None:
    """deploy/prometheus/alerts.yml into ``out`` with the service-down alert's ``for: 1m`` dropped, so that it fires at
    the first evaluation after a failed scrape; the rest of the rule is the shipped one (its ``for`` is tested by
    promtool in tests/unit/test_dashboard.py)."""
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.yml").read_text())
    [down] = [r for r in rules["groups"][0]["rules"] if r["alert"] == "AsyncVapoServiceDown"]
    assert down.pop("for") == "1m"
    out.write_text(yaml.safe_dump(rules))


def test_prometheus_scrapes_over_tls_with_basic_auth(tmp_path):
    prometheus, openssl = shutil.which("prometheus"), shutil.which("openssl")
    if prometheus is None or openssl is None:
        pytest.skip("needs the prometheus binary (.ci/install_prometheus.sh) and the openssl command")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=async-vapo-test",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")  # Prometheus trims it, as the services' hash assumes
    digest = hashlib.sha256(PASSWORD.encode()).hexdigest()
    other = hashlib.sha256(b"not the password in the file").hexdigest()
    prom_port, port_ok, port_other = free_ports(3)
    m = ServiceMetrics("replay", gpu=False)
    m.replay.stored_groups.set(7)
    tls = {"tls_cert": cert, "tls_key": key, "basic_auth_user": "prometheus"}
    with MetricsServer(m, port=port_ok, basic_auth_password_sha256=digest, **tls), \
            MetricsServer(ServiceMetrics("verifier", gpu=False), port=port_other, basic_auth_password_sha256=other,
                          **tls):
        write_file_sd_targets(tmp_path / "targets.json",
                              {"replay": [f"127.0.0.1:{port_ok}"], "verifier": [f"127.0.0.1:{port_other}"]})
        _alert_rules_firing_at_once(tmp_path / "alerts.yml")
        config = render_prometheus_config(REPO / "deploy/prometheus/prometheus.yml.tmpl", tmp_path / "prometheus.yml",
                                          scrape_interval="1s", scrape_timeout="800ms", run_name="scrape-test",
                                          tls=True, tls_ca_file=str(cert), basic_auth_user="prometheus",
                                          basic_auth_password_file=str(password_file))
        proc = subprocess.Popen([prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 30
            up: dict[str, float] = {}
            while time.monotonic() < deadline and len(up) < 2:
                time.sleep(0.5)
                up = _up(prom_port)
            print("up per target:", up)
            assert up == {f"127.0.0.1:{port_ok}": 1.0, f"127.0.0.1:{port_other}": 0.0}, \
                (tmp_path / "prometheus.log").read_text()[-3000:]
            unauthorized = m.registry.get_sample_value("async_vapo_replay_http_rejects_total",
                                                       {"reason": "unauthorized"})
            assert unauthorized == 0  # every scrape of the first target carried the right credentials
            assert _up(prom_port, 'up{run="scrape-test"}').keys() == up.keys()  # the dashboard's run variable

            [group] = _api(prom_port, "rules")["groups"]
            shipped = (REPO / "deploy/prometheus/alerts.yml").read_text().count("- alert: ")
            assert len(group["rules"]) == shipped and all(r["health"] == "ok" for r in group["rules"]), group
            deadline = time.monotonic() + 10
            firing: list[dict] = []
            while time.monotonic() < deadline and not firing:
                time.sleep(0.25)
                firing = _firing(prom_port)
            print("firing:", [(a["labels"]["alertname"], a["labels"]["instance"]) for a in firing])
            assert [a["labels"]["alertname"] for a in firing] == ["AsyncVapoServiceDown"]
            labels = firing[0]["labels"]
            assert (labels["service"], labels["instance"], labels["run"], labels["severity"]) == \
                ("verifier", f"127.0.0.1:{port_other}", "scrape-test", "critical")
            assert firing[0]["annotations"]["summary"] == "verifier 0 of run scrape-test is down"
        finally:
            proc.terminate()
            proc.wait(10)
