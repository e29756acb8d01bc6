"""The fault harness's injector (async_vapo/deploy/faults.py) after a run's end: reading the learner's version from
its real /health (a ServiceMetrics server on loopback), it records a fired fault's outcome when the learner's newer
version is read only then, and fires nothing more. A few seconds, no cluster."""

from __future__ import annotations

import subprocess
import time

from async_vapo.config import load_config
from async_vapo.deploy.faults import Fault, Injector
from async_vapo.metrics.prom import MetricsServer, ServiceMetrics


def test_after_the_end_the_injector_reads_the_last_version_and_fires_nothing(tmp_path):
    metrics = ServiceMetrics("learner", "0", gpu=False)
    metrics.set_health(policy_version=8)
    victim = subprocess.Popen(["sleep", "60"])  # what the next fault would kill if it fired
    (tmp_path / "pids").mkdir()
    (tmp_path / "pids" / "verifier.pid").write_text(f"{victim.pid}\n")
    try:
        with MetricsServer(metrics, port=0) as server:
            cfg = load_config([], [f"cluster.ports.learner_metrics_port={server.port}"])
            injector = Injector(cfg, tmp_path, [Fault("kill", "replay", 1), Fault("kill", "verifier", 2)])
            # the replay's kill fired at version 8 and the replay came back; the learner has not moved on yet
            injector.poll(fire=False)
            fired = injector.records[0]
            fired.fired_at, fired.version_at_fire, fired.highest_version_at_fire = time.time(), 8, injector.highest
            fired.healthy_s, injector.next = 1.0, 1
            injector.poll(fire=False)
            assert injector.highest == 8 and fired.progress_s is None and not injector.settled()
            # the run's last versions, published after its polls: read after the end
            metrics.set_health(policy_version=16)
            injector.poll(fire=False)
            assert injector.highest == 16 and fired.progress_s is not None and injector.settled()
            # the verifier's kill is due (version 16 >= 2) but nothing fires after the end
            assert injector.next == 1 and injector.records[1].fired_at is None
            assert victim.poll() is None
            # while the run goes on, it fires
            injector.poll()
            assert injector.next == 2 and injector.records[1].fired_at is not None
            assert victim.wait(10) == -9
    finally:
        if victim.poll() is None:
            victim.kill()
