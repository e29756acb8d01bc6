"""The whole cluster end to end, disturbed: start_cluster.sh on the test model with a real Prometheus server scraping
every service, the engine silenced once and every service killed once. The supervisors restart each killed service,
the learner takes the silent engine out of rotation and back, Prometheus sees every service and the training advance,
the engine evaluates held-out problems, and the run loses nothing (async_vapo.deploy.faults); stop_cluster.sh leaves
nothing. One fixed schedule, in order, each once the previous service is healthy (or back in rotation): the rollout
replay (SIGKILL) at version 1, the verifier at 2, the rollout engine at 3, the learner in the middle of an update at
version >= 5, two updates after its checkpoint at 3 (checkpoint_every 3), and once the learner is back, the rollout
engine's process group SIGSTOPped at version >= 8 for longer than the liveness deadline (then SIGCONT). 16 updates
(an update takes about a second here: the last ones need the engine back, so the run cannot end before it rejoins),
a held-out evaluation every 4.
One cluster start serves what were three tests (end to end with Prometheus, a stopped engine, the kills). Budget:
about 4 minutes here, at most 10. The random schedules and the comparison with an undisturbed run are
benchmarks/faults.py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES, free_ports, group_alive

from async_vapo.config.schema import PortsConfig
from async_vapo.deploy.faults import Fault, run_cluster

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 10 * 60


def _prom_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _prom_value(port: int, query: str) -> float | None:
    try:
        res = _prom_query(port, query)
    except OSError:
        return None
    return float(res[0]["value"][1]) if res else None


class _Watch:
    """What Prometheus says while the run goes on (polled from a thread beside ``run_cluster``)."""

    def __init__(self, port: int):
        self.port, self.stop = port, threading.Event()
        self.up: dict[str, float] = {}
        self.own_up: dict[str, float] = {}
        self.learner_versions: list[float] = []
        self.served: list[float] = []
        self.in_rotation: list[float] = []

    def run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                for r in _prom_query(self.port, 'up{job="async-vapo"}'):
                    svc = r["metric"]["service"]
                    self.up[svc] = max(self.up.get(svc, 0.0), float(r["value"][1]))
                for svc in ("replay", "verifier", "rollout", "learner"):
                    v = _prom_value(self.port, f"async_vapo_{svc}_up")
                    if v is not None:
                        self.own_up[svc] = max(self.own_up.get(svc, 0.0), v)
                for name, seen in (("async_vapo_learner_version", self.learner_versions),
                                   ('async_vapo_rollout_served_version{service="rollout"}', self.served),
                                   ("async_vapo_learner_engines_in_rotation", self.in_rotation)):
                    v = _prom_value(self.port, name)
                    if v is not None and (not seen or seen[-1] != v):
                        seen.append(v)
            except OSError:
                continue


@pytest.mark.slow
def test_cluster_end_to_end_under_faults_scraped_by_prometheus(tiny_cfg, tiny_base, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the prometheus binary is not installed (.ci/install_prometheus.sh installs Debian's package)")
    total = 16
    ckpt_every = 3
    ports = free_ports(len(PortsConfig.model_fields) + 1)
    prom_port = ports.pop()
    ports = dict(zip(PortsConfig.model_fields, ports, strict=True))
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster.ports]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items()))
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", f"train.total_steps={total}",
                 f"train.checkpoint_every={ckpt_every}", "train.eval_every=4", "async.max_staleness=1",
                 "cluster.wire.heartbeat_s=0.5", "cluster.wire.peer_dead_s=5",
                 # groups lost in flight to a killed verifier or replay are made up once the learner has reported
                 # waiting this long since the engine last shipped; the timer refill is kept out of the way
                 "cluster.rollout.admission_starved_s=3", "cluster.rollout.admission_refill_s=120",
                 "cluster.deploy.health_timeout_s=240", "cluster.deploy.stop_grace_s=15"]
    # the last: a silent engine, stopped for longer than peer_dead_s, then continued
    plan = [Fault("kill", "replay", 1), Fault("kill", "verifier", 2), Fault("kill", "rollout-0", 3),
            Fault("kill", "learner", 5, when="mid_update"), Fault("stop", "rollout-0", 8, duration_s=8)]
    run_dir = tmp_path / "run"
    py = REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHON": str(py) if py.exists() else "python"}
    # The scrape config as start_cluster.sh writes it (same plan helper), so Prometheus is up before the services.
    subprocess.run([env["PYTHON"], "-m", "async_vapo.deploy.launch", "plan", "--config", str(config), "--run-dir",
                    str(run_dir), "--scrape-interval", "1s", "--", *overrides], check=True, cwd=REPO, env=env,
                   stdout=subprocess.DEVNULL)
    prom = subprocess.Popen([prometheus, f"--config.file={run_dir / 'prometheus' / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
                            start_new_session=True)
    watch = _Watch(prom_port)
    watcher = threading.Thread(target=watch.run, daemon=True)
    watcher.start()
    # What Prometheus stored over the run (its range query, not the watcher's polls, which can miss the last scrape)
    recorded = {"version": 'max_over_time(async_vapo_learner_version[1h])',
                "served": 'max_over_time(async_vapo_rollout_served_version{service="rollout"}[1h])'}

    def scraped_final() -> bool:  # the cluster stays up after the end until Prometheus has scraped its final state
        return all(_prom_value(prom_port, q) == total for q in recorded.values())

    t0 = time.monotonic()
    try:
        report = run_cluster([str(config)], overrides, run_dir, plan, timeout_s=BUDGET_S - 90, wait_eval=True,
                             env=env, start_args=["--scrape-interval", "1s"], settled=scraped_final)
        took = time.monotonic() - t0
        time.sleep(2)  # the last scrapes of the stopped services
        final = {k: _prom_value(prom_port, q) for k, q in recorded.items()}
    finally:
        watch.stop.set()
        watcher.join(10)
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
    print(f"\nfault run: {took:.0f} s; faults: "
          + "; ".join(f"{f['fault']['service']} healthy after {f['healthy_s']} s, training on after "
                      f"{f['progress_s']} s" for f in report["faults"]))

    def logs() -> str:
        return "\n".join(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted((run_dir / "logs").glob("*.log")))

    a = report["audit"]
    assert report["done_s"] is not None and a["reached_total_steps"], logs()
    kills, stop = report["faults"][:-1], report["faults"][-1]
    assert stop["fired_at"] is not None and stop["version_at_fire"] >= 8, stop
    # the learner took the silent engine out of rotation at its liveness deadline and back once it spoke again
    assert stop["left_rotation"] and stop["rejoined_s"] is not None and stop["progress_s"] is not None, (stop, logs())
    assert "rollout-0 silent for more than 5 s: out of rotation" in (run_dir / "logs" / "learner.log").read_text()
    for f in kills:  # each fired, on time, and its service came back as a new process
        assert f["fired_at"] is not None and f["version_at_fire"] >= f["fault"]["at_version"], f
        assert f["healthy_s"] is not None and f["new_pid"] != f["pid"], (f, logs())
        assert f["restart_delay_s"] is not None and f["restart_delay_s"] < 5, f  # backoff 1 s (+ the group's reaping)
        if f["fault"]["service"] in ("replay", "verifier"):  # groups lost with it never waited for the 120 s timer
            assert f["progress_s"] is not None and f["progress_s"] < 100, (f, logs())
    assert sorted(r["name"] for r in report["supervisor_restarts"]) == ["learner", "replay", "rollout-0", "verifier"]
    assert not list((run_dir / "supervisor").glob("*.gave_up"))
    for name in ("replay", "verifier", "rollout-0", "learner"):  # two starts each, the PID file names the second
        starts = (run_dir / "supervisor" / f"{name}.starts").read_text().split()
        assert len(starts) == 2 and starts[-1] == (run_dir / "pids" / f"{name}.pid").read_text().strip(), name
    # the learner resumed from its newest checkpoint (step 3 when the schedule runs on time: updates 4 and 5 lost with
    # it); the updates since were made again and the groups it had been served since were stored again
    killed = next(f for f in kills if f["fault"]["service"] == "learner")
    ckpt = killed["version_at_fire"] // ckpt_every * ckpt_every
    resumed = "learner: resumed from " + str(run_dir / "checkpoints" / f"step_{ckpt}")
    assert ckpt >= ckpt_every and resumed in (run_dir / "logs" / "learner.log").read_text(), killed
    if killed["version_at_fire"] > ckpt:
        assert a["updates_redone"] >= killed["version_at_fire"] - ckpt, a
        assert a["fates"].get("requeued", 0) > 0, a["fates"]
    # the restarted replay served on from its log: the groups it held and its cursor
    replay_log = (run_dir / "logs" / "replay.log").read_text()
    restored = re.findall(r"replay: (\d+) groups restored from .*, cursor (\d+);", replay_log)
    assert len(restored) == 2 and int(restored[1][1]) > 0, restored
    # nothing acknowledged was lost, nothing served twice, the staleness bound held, the engine never went back
    assert a["acknowledged_groups_lost"] == 0 and a["lineage_batches_unmatched"] == 0, a
    assert a["groups_served_twice"] == 0, a
    assert a["staleness_violations_rows"] == [] and a["staleness_violations_groups"] == 0, a
    assert a["engine_version_violations"] == 0 and a["engines"]["rollout-0"]["incarnations"] == 2, a["engines"]
    # the dead learner's weight slots were removed, and stop_cluster.sh left nothing
    assert not list(Path("/dev/shm").glob(f"async-vapo-*-{killed['pid']}"))
    assert report["stop_returncode"] == 0, report["stop_stderr"]
    pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
    assert not [n for n, pgid in pids.items() if group_alive(pgid)]
    children = [int(x) for f in (run_dir / "pids").glob("*.children") for x in f.read_text().split()]
    assert not [c for c in children if Path(f"/proc/{c}/cmdline").exists()
                and b"async_vapo.verify.sandbox" in Path(f"/proc/{c}/cmdline").read_bytes()]
    # Prometheus scraped all four services and their own health gauges, and saw the learner and the engine advance
    assert watch.up == {"replay": 1.0, "verifier": 1.0, "rollout": 1.0, "learner": 1.0}, watch.up
    assert watch.own_up == {"replay": 1.0, "verifier": 1.0, "rollout": 1.0, "learner": 1.0}, watch.own_up
    assert final == {"version": total, "served": total}, (final, watch.learner_versions, watch.served)
    assert len(set(watch.learner_versions)) >= 3 and len(set(watch.served)) >= 3, (watch.learner_versions, watch.served)
    assert watch.in_rotation and watch.in_rotation[-1] == 1.0, watch.in_rotation
    # held-out evaluations by the engine: before training, at the end, and between
    evals = [r for r in (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert {0, total} <= {r["version"] for r in evals} and len(evals) >= 3, [r["version"] for r in evals]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    assert (run_dir / "checkpoints" / f"step_{total}" / "learner_state.pt").exists()
    # each service's last incarnation left its statistics (busy intervals, peak memory, the engine core counted)
    from async_vapo.experiments.report import analyse_cluster_run

    stats = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stats").glob("*.json")}
    assert set(stats) == {"replay-0", "verifier-0", "rollout-0", "learner-0"}
    assert all(s["peak_rss_mib"] > 10 for s in stats.values())
    assert stats["rollout-0"]["peak_rss_with_children_mib"] > stats["rollout-0"]["peak_rss_mib"]
    fig = analyse_cluster_run(run_dir)
    for stage in ("generate", "verify", "learn"):
        assert 0 < fig["busy_fraction"][stage] <= 1, fig["busy_fraction"]
    assert took < BUDGET_S
