"""Every service killed once during a cluster run, on the test model, and the engine silenced once: the supervisors
restart each killed service, the learner takes the silent engine out of rotation and back, and the run loses nothing
(async_vapo.deploy.faults). One fixed schedule, in order, each once the previous service is healthy (or back in
rotation): the rollout engine's process group SIGSTOPped at version 1 for longer than the liveness deadline (then
SIGCONT), the replay (SIGKILL) at version 2, the verifier at 3, the rollout engine at 4 and the learner in the middle
of an update at version >= 6, two updates after its checkpoint at 4 (checkpoint_every 4). 9 updates. Budget: about
4 minutes here, at most 8. The random schedules and the comparison with an undisturbed run are benchmarks/faults.py."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES, free_ports, group_alive

from async_vapo.config.schema import PortsConfig
from async_vapo.deploy.faults import Fault, run_cluster

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = 8 * 60


@pytest.mark.slow
def test_each_service_killed_once_loses_nothing(tiny_cfg, tiny_base, tmp_path):
    total = 9
    ports = dict(zip(PortsConfig.model_fields, free_ports(len(PortsConfig.model_fields)), strict=True))
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster.ports]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items()))
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", f"train.total_steps={total}",
                 "train.checkpoint_every=4", "async.max_staleness=1", "cluster.rollout.eval=false",
                 "cluster.wire.heartbeat_s=0.5", "cluster.wire.peer_dead_s=5",
                 # groups lost in flight to a killed verifier or replay are made up once the learner has reported
                 # waiting this long since the engine last shipped; the timer refill is kept out of the way
                 "cluster.rollout.admission_starved_s=3", "cluster.rollout.admission_refill_s=120",
                 "cluster.deploy.health_timeout_s=240", "cluster.deploy.stop_grace_s=15"]
    # a silent engine: stopped for longer than peer_dead_s, then continued
    plan = [Fault("stop", "rollout-0", 1, duration_s=8), Fault("kill", "replay", 2), Fault("kill", "verifier", 3),
            Fault("kill", "rollout-0", 4), Fault("kill", "learner", 6, when="mid_update")]
    run_dir = tmp_path / "run"
    py = REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHON": str(py) if py.exists() else "python"}
    t0 = time.monotonic()
    report = run_cluster([str(config)], overrides, run_dir, plan, timeout_s=BUDGET_S - 90, wait_eval=False, env=env)
    took = time.monotonic() - t0
    print(f"\nfault run: {took:.0f} s; faults: "
          + "; ".join(f"{f['fault']['service']} healthy after {f['healthy_s']} s, training on after "
                      f"{f['progress_s']} s" for f in report["faults"]))

    def logs() -> str:
        return "\n".join(f"--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted((run_dir / "logs").glob("*.log")))

    a = report["audit"]
    assert report["done_s"] is not None and a["reached_total_steps"], logs()
    stop, kills = report["faults"][0], report["faults"][1:]
    assert stop["fired_at"] is not None and stop["version_at_fire"] >= 1, stop
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
    # the learner resumed from its checkpoint; the groups it had been served since were stored again
    resumed = "learner: resumed from " + str(run_dir / "checkpoints" / "step_4")
    assert resumed in (run_dir / "logs" / "learner.log").read_text()
    assert a["updates_redone"] >= 2  # updates 5 and 6 were lost with it and made again
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
    learner = next(f for f in kills if f["fault"]["service"] == "learner")
    assert not list(Path("/dev/shm").glob(f"async-vapo-*-{learner['pid']}"))
    assert report["stop_returncode"] == 0, report["stop_stderr"]
    pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
    assert not [n for n, pgid in pids.items() if group_alive(pgid)]
    children = [int(x) for f in (run_dir / "pids").glob("*.children") for x in f.read_text().split()]
    assert not [c for c in children if Path(f"/proc/{c}/cmdline").exists()
                and b"async_vapo.verify.sandbox" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert took < BUDGET_S
