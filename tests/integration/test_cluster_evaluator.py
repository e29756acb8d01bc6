"""Held-out evaluation outside the training engines, started by start_cluster.sh (``cluster.evaluator.mode``): the
tiny test model through the four services with ``cluster.rollout.eval = false``, its starting policy and every
checkpoint evaluated by ``async-vapo eval RUN_DIR`` into the run's metrics. ``watch``: a fifth supervised process
beside the services, which ``--wait`` waits for; ``after``: once the services are stopped. Budget: about 1.5 minutes
each here (a cluster start, two engines in ``watch``), at most 5."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES, free_ports, group_alive

from async_vapo.config.schema import PortsConfig
from async_vapo.metrics.jsonl import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("mode", ["watch", "after"])
def test_the_cluster_evaluates_each_checkpoint_outside_its_training_engines(mode, tiny_cfg, tiny_base, tmp_path):
    ports = dict(zip(PortsConfig.model_fields, free_ports(len(PortsConfig.model_fields)), strict=True))
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster.ports]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items()))
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.total_steps=4",
                 "train.checkpoint_every=2", "cluster.rollout.eval=false", f"cluster.evaluator.mode={mode}",
                 "cluster.deploy.health_timeout_s=240", "cluster.deploy.stop_grace_s=15"]
    run_dir = tmp_path / "run"
    py = REPO / ".venv" / "bin" / "python"
    env = {**os.environ, "PYTHON": str(py) if py.exists() else "python", "PYTHONPATH": str(REPO)}
    r = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config), "--run-dir",
                        str(run_dir), "--wait", "--", *overrides], capture_output=True, text=True, env=env,
                       timeout=300, cwd=REPO)

    def logs() -> str:
        tails = (f"\n--- {p.name}:\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:])
                 for p in sorted((run_dir / "logs").glob("*.log")))
        return r.stderr[-3000:] + "".join(tails)

    assert r.returncode == 0, logs()
    rows = read_metrics(run_dir / "metrics.jsonl")
    train = {x["step"]: x for x in rows if x["kind"] == "train"}
    evals = {x["step"]: x for x in rows if x["kind"] == "eval"}
    assert sorted(train) == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4], logs()  # none from the training engine
    for step, row in evals.items():
        assert row["source"] == "checkpoint" and 0.0 <= row["eval/accuracy"] <= 1.0
        assert row["wall_s"] == (train[step]["wall_s"] if step else 0.0)  # at its update's wall-clock
        assert len((run_dir / "eval" / f"step_{step}" / "samples.jsonl").read_text().splitlines()) == 24
    log = (run_dir / "logs" / "evaluator.log").read_text()
    assert "update 4: held-out accuracy" in log
    if mode == "watch":  # supervised beside the services; --wait waited for its last checkpoint
        assert "[start_cluster] evaluator runs" in r.stderr
        assert json.loads((run_dir / "eval" / "DONE").read_text())["evaluated"] == [0, 2, 4]
        assert (run_dir / "supervisor" / "evaluator.starts").read_text().count("\n") == 1
    else:
        assert not (run_dir / "pids" / "evaluator.pid").exists()
    assert "held-out accuracy" in r.stderr  # its progress on the terminal
    pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
    assert not [n for n, pgid in pids.items() if group_alive(pgid)]
