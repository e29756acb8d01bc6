"""The tool task's RL summary (benchmarks/tool_task.py --summary, over benchmarks/tool_task_learning.sh's runs): its
figures on hand-made runs, with the tool and without it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _tool_task():
    spec = importlib.util.spec_from_file_location("tool_task", REPO / "benchmarks/tool_task.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_run(d: Path, before: float, after: float, calls: list[float], tool: bool) -> None:
    """Evaluations before and after 6 updates of 10 s each; training batches at accuracy 0.1 * step."""
    rows = [{"kind": "eval", "step": 0, "wall_s": 60.0, "eval/accuracy": before, "eval/truncated_frac": 0.0}]
    for k in range(1, 7):
        rows.append({"kind": "train", "step": k, "wall_s": 60.0 + 10 * k, "time/step_s": 10.0,
                     "rollout/accuracy": 0.1 * k} | ({"rollout/tool_calls": calls[k - 1]} if tool else {}))
    rows.append({"kind": "eval", "step": 6, "wall_s": 180.0, "eval/accuracy": after, "eval/truncated_frac": 0.0})
    if tool:
        rows[0] |= {"eval/tool_calls": 1.0, "eval/tool_errors": 0.25, "eval/turns": 2.0}
        rows[-1] |= {"eval/tool_calls": 0.5, "eval/tool_errors": 0.0, "eval/turns": 1.5}
    d.mkdir(parents=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_of_runs_with_and_without_the_tool(tmp_path):
    t = _tool_task()
    _write_run(tmp_path / "grpo_tool_seed0", 0.3, 0.6, [1.0, 1.0, 0.8, 0.6, 0.6, 0.4], tool=True)
    _write_run(tmp_path / "grpo_no_tool_seed0", 0.05, 0.1, [], tool=False)
    _write_run(tmp_path / "vapo_frozen_tool_seed1", 0.3, 0.2, [1.0] * 6, tool=True)  # no partner: no difference row
    table = t.summary(tmp_path)
    runs = {r["run"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
    g = runs["grpo_tool_seed0"]
    assert (g["algo"], g["tool"], g["seed"], g["updates"], g["s_per_update"]) == ("grpo", "tool", 0, 6, 10.0)
    assert g["minutes"] == 3.0
    assert g["before"] == {"accuracy": 0.3, "tool_calls": 1.0, "turns": 2.0, "calls_that_ran": 0.75}
    assert g["after"] == {"accuracy": 0.6, "tool_calls": 0.5, "turns": 1.5, "calls_that_ran": 1.0}
    assert g["train_tool_calls_first5"] == pytest.approx(0.8)  # (1 + 1 + 0.8 + 0.6 + 0.6) / 5
    assert g["train_tool_calls_last5"] == pytest.approx(0.68)
    assert g["train_accuracy_first5"] == pytest.approx(0.3)
    assert [a for _, a in g["held_out"]] == [0.3, 0.6]
    n = runs["grpo_no_tool_seed0"]
    assert (n["algo"], n["tool"]) == ("grpo", "no_tool")
    assert n["before"]["calls_that_ran"] is None and n["before"]["turns"] == 1.0
    assert (runs["vapo_frozen_tool_seed1"]["algo"], runs["vapo_frozen_tool_seed1"]["seed"]) == ("vapo_frozen", 1)
    assert "| grpo, seed 0 | +0.500 | 3.0 / 3.0 |" in table  # 0.6 with the tool against 0.1 without
    assert "vapo_frozen, seed 1 |" not in table
    assert "| grpo_no_tool_seed0 | 6 | 3.0 | 10.0 | 0.050 → 0.100 | 0.00 → 0.00 | – → – | 1.00 → 1.00 |" in table
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_summary_refuses_a_run_without_its_evaluations(tmp_path):
    t = _tool_task()
    d = tmp_path / "grpo_tool_seed0"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "wall_s": 1.0,
                                                 "rollout/accuracy": 0.5}) + "\n")
    with pytest.raises(SystemExit, match="needs an evaluation before and after"):
        t.summary(tmp_path)


def test_summary_reports_a_critics_explained_variance(tmp_path):
    t = _tool_task()
    d = tmp_path / "vapo_tool_seed0"
    _write_run(d, 0.3, 0.6, [1.0] * 6, tool=True)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    rows[0] |= {"critic/heldout_ev": 0.0, "time/critic_score_s": 44.0}
    rows[-1] |= {"critic/heldout_ev": 0.4, "time/critic_score_s": 40.0}
    for k, r in enumerate(rows[1:-1]):
        r["critic/explained_variance"] = 0.1 * k  # 0.0 ... 0.5
    pretrain = [{"kind": "pretrain", "step": k, "wall_s": 60.0 + k, "time/step_s": 30.0, "critic/heldout_ev": ev}
                for k, ev in enumerate([0.05, 0.2])]
    rows = rows[:1] + pretrain + rows[1:]
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _write_run(tmp_path / "grpo_tool_seed0", 0.3, 0.6, [1.0] * 6, tool=True)  # no critic: no row
    d = tmp_path / "vapo_no_tool_seed0"  # every return equal: the explained variance is null, not a number
    _write_run(d, 0.0, 0.0, [], tool=False)
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    for r in rows[1:-1]:
        r["critic/explained_variance"] = None
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = t.summary(tmp_path)
    c = {r["run"]: r for r in json.loads((tmp_path / "summary.json").read_text())}["vapo_tool_seed0"]["critic"]
    assert c["heldout_ev_before"] == 0.0 and c["heldout_ev_pretrained"] == 0.2 and c["heldout_ev_after"] == 0.4
    assert c["train_ev_first5"] == pytest.approx(0.2) and c["train_ev_last5"] == pytest.approx(0.3)
    assert (c["pretrain_steps"], c["pretrain_minutes"], c["score_s"]) == (2, 1.0, [44.0, 40.0])
    assert "| vapo_tool_seed0 | 0.000 → 0.200 → 0.400 | 0.200 → 0.300 | 2, 1.0 | 44.0, 40.0 |" in table
    assert "| vapo_no_tool_seed0 | – → – → – | – → – | 0, 0.0 | – |" in table
    assert "| grpo_tool_seed0 | –" not in table and table.count("| grpo_tool_seed0 |") == 1
