"""One row source, several sinks (``async_vapo.metrics.rows``): the rows written to ``metrics.jsonl`` are read back
from the TensorBoard event files (tensorboard's ``EventAccumulator``), from the offline W&B run (wandb's own
transaction-log reader, ``wandb beta leet inspect --json``) and from the service's Prometheus gauges. The tracker
tests need the ``trackers`` extra, which ``deploy/setup.sh`` installs."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from async_vapo.config.schema import Config
from async_vapo.metrics.jsonl import JsonlWriter
from async_vapo.metrics.rows import PrometheusEvalSink, open_row_writer, scalars, tag

ROWS = [
    {"kind": "pretrain", "step": 0, "version": 0, "critic/value_loss": 0.5, "critic/explained_variance": float("nan")},
    {"kind": "train", "step": 1, "version": 1, "samples_seen": 8, "actor/pg_loss": 0.25, "time/step_s": 1.5,
     "critic/explained_variance": float("nan"), "note": "text"},
    {"kind": "train", "step": 2, "version": 2, "samples_seen": 16, "actor/pg_loss": -0.125, "time/step_s": 1.25,
     "critic/explained_variance": 0.5},
    {"kind": "eval", "step": 2, "version": 2, "wall_s": 3.0, "samples_seen": 16, "eval/accuracy": 0.75,
     "eval/response_length": 12.5, "eval/pass@1": 0.75},
]
# What every tracker must hold: per tag, (step, value) in order (values exact in float32, as TensorBoard keeps them).
# Worked out from ROWS by the rule of rows.tag:
# train keys as they are, pretrain and eval keys under their kind; NaN and strings left out.
EXPECTED = {
    "pretrain/version": [(0, 0.0)],
    "pretrain/critic/value_loss": [(0, 0.5)],
    "version": [(1, 1.0), (2, 2.0)],
    "samples_seen": [(1, 8.0), (2, 16.0)],
    "actor/pg_loss": [(1, 0.25), (2, -0.125)],
    "time/step_s": [(1, 1.5), (2, 1.25)],
    "critic/explained_variance": [(2, 0.5)],
    "eval/version": [(2, 2.0)],
    "eval/wall_s": [(2, 3.0)],
    "eval/samples_seen": [(2, 16.0)],
    "eval/accuracy": [(2, 0.75)],
    "eval/response_length": [(2, 12.5)],
    "eval/pass@1": [(2, 0.75)],
}


def test_tags_and_scalars_of_a_row():
    assert tag("train", "actor/pg_loss") == "actor/pg_loss"
    assert tag("pretrain", "critic/value_loss") == "pretrain/critic/value_loss"
    assert tag("eval", "eval/accuracy") == "eval/accuracy"
    assert tag("eval", "wall_s") == "eval/wall_s"
    kind, step, values = scalars(ROWS[1])
    assert (kind, step) == ("train", 1)
    assert values == {"version": 1.0, "samples_seen": 8.0, "actor/pg_loss": 0.25, "time/step_s": 1.5}
    assert scalars({"kind": "eval", "step": 3, "ok": True, "eval/accuracy": math.inf}) == ("eval", 3, {"eval/ok": 1.0})


def test_trackers_are_off_by_default(tmp_path):
    writer = open_row_writer(Config(), tmp_path / "metrics.jsonl")
    writer.write(ROWS[1])
    writer.close()
    assert [type(s) for s in writer.sinks] == [JsonlWriter]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["critic/explained_variance"] is None and row["actor/pg_loss"] == 0.25


def test_a_missing_tracker_package_is_a_clear_error(tmp_path):
    # A fresh interpreter where the package cannot be imported, as on an install without the trackers extra.
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from pathlib import Path\nfrom async_vapo.config.schema import Config\n"
            "from async_vapo.metrics.rows import open_row_writer\n"
            "cfg = Config(); cfg.metrics.wandb = True\n"
            f"open_row_writer(cfg, Path({str(tmp_path / 'metrics.jsonl')!r}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "RuntimeError: metrics.wandb = true needs the wandb package: pip install -e '.[trackers]'" in out.stderr


def test_eval_rows_set_the_held_out_gauges():
    from async_vapo.metrics.prom import ServiceMetrics

    m = ServiceMetrics("rollout", gpu=False)
    sink = PrometheusEvalSink(m)
    for row in ROWS:
        sink.write(row)
    get = m.registry.get_sample_value
    assert get("async_vapo_rollout_eval_accuracy") == 0.75
    assert get("async_vapo_rollout_eval_response_length_tokens") == 12.5
    assert get("async_vapo_rollout_eval_policy_version") == 2.0
    sink.write({"kind": "train", "step": 3, "eval/accuracy": 0.0})  # only eval rows move them
    sink.write({"kind": "eval", "step": 4, "version": 4, "eval/accuracy": float("nan"), "eval/response_length": 9})
    assert get("async_vapo_rollout_eval_accuracy") == 0.75  # no value at this step: the last one stands
    assert get("async_vapo_rollout_eval_response_length_tokens") == 9.0
    assert get("async_vapo_rollout_eval_policy_version") == 4.0


def _tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _wandb_history(run_dir: Path) -> tuple[dict, list[dict]]:
    """The run record and the history rows of an offline run, read by wandb's own reader of ``.wandb`` files."""
    wandb_cli = shutil.which("wandb", path=str(Path(sys.executable).parent))
    assert wandb_cli is not None
    out = subprocess.run([wandb_cli, "beta", "leet", "inspect", "--json", str(run_dir)], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    run = next(r["run"] for r in records if r.get("type") == "run")
    history = [{k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
               for r in records if r.get("type") == "history"]
    return run, history


def test_rows_reach_tensorboard_wandb_and_prometheus(tmp_path):
    pytest.importorskip("tensorboard", reason="the trackers extra (pip install -e '.[trackers]')")
    pytest.importorskip("wandb", reason="the trackers extra (pip install -e '.[trackers]')")
    from async_vapo.metrics.prom import ServiceMetrics

    cfg = Config()
    cfg.train.name = "tracked"
    cfg.metrics.tensorboard = True
    cfg.metrics.wandb = True
    m = ServiceMetrics("rollout", gpu=False)
    writer = open_row_writer(cfg, tmp_path / "metrics.jsonl", m)
    for row in ROWS:
        writer.write(row)
    writer.close()

    jsonl = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in jsonl] == ["pretrain", "train", "train", "eval"]

    assert _tensorboard_scalars(tmp_path / "tensorboard") == EXPECTED

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("run-*.wandb"))
    run, history = _wandb_history(runs[0])
    assert (run["run_group"], run["job_type"], run["project"]) == ("tracked", "rollout", "async-vapo")
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for item in history:
        for key, value in item.items():
            if key != "step":
                by_tag.setdefault(key, []).append((item["step"], value))
    assert by_tag == EXPECTED

    assert m.registry.get_sample_value("async_vapo_rollout_eval_accuracy") == 0.75
    assert m.registry.get_sample_value("async_vapo_rollout_eval_response_length_tokens") == 12.5


def test_only_a_rollouts_writer_sets_the_held_out_gauges(tmp_path):
    from async_vapo.metrics.prom import ServiceMetrics

    learner = open_row_writer(Config(), tmp_path / "learner.jsonl", ServiceMetrics("learner", gpu=False))
    rollout = open_row_writer(Config(), tmp_path / "rollout.jsonl", ServiceMetrics("rollout", gpu=False))
    # the learner writes no eval rows and has no such gauge
    kinds = {type(s) for s in learner.sinks}
    assert JsonlWriter in kinds and PrometheusEvalSink not in kinds
    assert [type(s) for s in rollout.sinks] == [JsonlWriter, PrometheusEvalSink]
    learner.close()
    rollout.close()
