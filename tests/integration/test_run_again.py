"""A second training run in the same place (async_vapo.learner.rundir on the one-process trainer): it resumes the
run from its newest checkpoint when it can, and otherwise starts a new directory, never touching the first run.
The real engine is the session's; about a minute of tiny-model training on this CPU."""

from __future__ import annotations

import json

import pytest

from async_vapo.learner.rundir import claim, plan_run

pytestmark = pytest.mark.slow


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_again_resumes_then_starts_a_new_directory(tiny_cfg, vllm_engine, tmp_path):
    from async_vapo.trainer import train

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.train.output_dir = str(tmp_path / "{name}")
    cfg.train.total_steps, cfg.train.checkpoint_every, cfg.train.eval_every = 2, 2, 2

    plan = plan_run(cfg, "train")
    assert plan.resume is None
    train(claim(plan, cfg, "train"), progress=False, engine=vllm_engine)
    first = cfg.run_dir()
    ckpt2 = (first / "checkpoints" / "step_2" / "learner_state.pt").read_bytes()

    # a longer run of the same config continues the first from its checkpoint, in its directory
    cfg.train.total_steps = 3
    plan = plan_run(cfg, "train")
    assert plan.run_dir == first and plan.resume == first / "checkpoints" / "step_2"
    summary = train(claim(plan, cfg, "train"), resume=str(plan.resume), progress=False, engine=vllm_engine)
    rows = _rows(first)
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3] and summary["steps"] == 3
    assert [r["version"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    assert sum(r["kind"] == "pretrain" for r in rows) == cfg.algo.value_pretrain_steps  # not redone
    assert (first / "checkpoints" / "step_2" / "learner_state.pt").read_bytes() == ckpt2
    assert (first / "checkpoints" / "step_3" / "learner_state.pt").exists()
    starts = json.loads((first / "run.json").read_text())["starts"]
    assert [s["resume"] for s in starts] == [None, str(first / "checkpoints" / "step_2")]

    # finished: the same command again starts tiny_cpu-2 and leaves the first run as it was
    before = (first / "metrics.jsonl").read_bytes()
    plan = plan_run(cfg, "train")
    assert plan.run_dir == first.with_name(first.name + "-2") and plan.resume is None
    assert "finished" in plan.message
    again = claim(plan, cfg, "train")
    again.train.total_steps = 1  # (shorter, to save time: still a run of its own)
    train(again, progress=False, engine=vllm_engine)
    assert (first / "metrics.jsonl").read_bytes() == before
    assert [r["step"] for r in _rows(plan.run_dir) if r["kind"] == "train"] == [1]
