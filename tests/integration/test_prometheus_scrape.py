"""A real Prometheus server scrapes /metrics over TLS with basic auth, configured by the rendered
``deploy/prometheus/prometheus.yml.tmpl``: the template and the MetricsServer agree on scheme, certificate
and credentials, and a target that wants other credentials is down. Budget: about 10 s."""

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


def _up(port: int) -> dict[str, float]:
    """``up`` per target instance, from the Prometheus HTTP API."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": "up"})
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            result = json.loads(r.read())["data"]["result"]
    except OSError:
        return {}
    return {s["metric"]["instance"]: float(s["value"][1]) for s in result}


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
        config = render_prometheus_config(REPO / "deploy/prometheus/prometheus.yml.tmpl", tmp_path / "prometheus.yml",
                                          scrape_interval="1s", scrape_timeout="800ms", tls=True,
                                          tls_ca_file=str(cert), basic_auth_user="prometheus",
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
        finally:
            proc.terminate()
            proc.wait(10)
