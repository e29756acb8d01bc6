"""`async-vapo eval` on the real vLLM engine (the session's engine) with the tiny test model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest

from async_vapo.metrics.passk import pass_at_k

pytestmark = pytest.mark.slow


def test_eval_of_a_checkpoint_writes_every_sample_and_consistent_figures(tiny_cfg, vllm_engine, tiny_base, tmp_path):
    from async_vapo.config import save_resolved
    from async_vapo.evaluation import format_table, resolve_target, run_eval
    from async_vapo.learner.vapo import Learner

    run = tmp_path / "run"
    save_resolved(tiny_cfg, run)
    Learner(tiny_cfg, tiny_base, None).save(run / "checkpoints" / "step_0")
    cfg, policy, label = resolve_target(str(run / "checkpoints" / "step_0"), [], ["rollout.eval_temperature=1.0"])
    assert policy == run / "checkpoints" / "step_0" / "policy" and label == "tiny_cpu-step_0"
    assert cfg.task.max_ops == tiny_cfg.task.max_ops  # the run's own config

    result = run_eval(cfg, policy, out_dir=tmp_path / "out", n=4, ks=[1, 2, 4], limit=12, engine=vllm_engine,
                      progress=False)
    records = [json.loads(x) for x in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 12 * 4 and result["problems"] == 12
    assert all(isinstance(r["verdict"], str) and r["verdict"] for r in records)
    assert all(r["difficulty"].startswith("ops") and r["response_tokens"] > 0 for r in records)
    m = result["metrics"]
    # the figures are those of the records: recompute pass@k per problem from the verdicts written
    by_uid = defaultdict(list)
    for r in records:
        assert r["correct"] == (r["verdict"] == "correct")
        by_uid[r["uid"]].append(r["correct"])
    for k in (1, 2, 4):
        want = sum(pass_at_k(4, sum(c), k) for c in by_uid.values()) / len(by_uid)
        assert m[f"eval/pass@{k}"] == pytest.approx(want)
    assert m["eval/pass@1"] == pytest.approx(m["eval/accuracy"]) == m["eval/avg@4"]
    assert m["eval/pass@1"] <= m["eval/pass@2"] <= m["eval/pass@4"]
    assert {k for k in m if k.startswith("eval/accuracy_ops")} <= {f"eval/accuracy_ops{i}" for i in (1, 2, 3)}
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"] == pytest.approx(m)
    assert "pass@4" in format_table(m, [1, 2, 4])


def test_in_training_evaluation_reports_pass_at_k(tiny_cfg, vllm_engine, tiny_base):
    """The trainer's held-out evaluation is the same code: its rows carry pass@k and avg@n."""
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.rollout.generate import PromptEncoder, Rollout, evaluate
    from async_vapo.tasks import load_task
    from async_vapo.verify.sandbox import VerifierPool

    vllm_engine.load_weights(load_policy(tiny_base).state_dict(), vllm_engine.version + 1)
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    with VerifierPool.from_config(tiny_cfg.verifier) as pool:
        rollout = Rollout(tiny_cfg, vllm_engine, pool, PromptEncoder.from_config(tiny_cfg, tok))
        m, examples = evaluate(rollout, load_task(tiny_cfg)[1][:6], tiny_cfg)
    n = tiny_cfg.rollout.eval_samples
    assert f"eval/pass@{n}" in m and m[f"eval/avg@{n}"] == pytest.approx(m["eval/accuracy"])
    assert len(examples) == 6 and {"prompt", "response", "verdict"} <= set(examples[0])


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/dir"], "neither an HF model directory"),
    (["--k", "1,x"], "--k takes comma-separated integers"),
])
def test_eval_cli_rejects_bad_input_with_a_clear_error(args, message):
    run = subprocess.run([sys.executable, "-m", "async_vapo.cli", "eval", *args], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]


def responses(run, step: int) -> list[str]:
    lines = (run / "eval" / f"step_{step}" / "samples.jsonl").read_text().splitlines()
    return [json.loads(x)["response"] for x in lines]


def test_eval_of_a_run_directory_adds_a_row_per_checkpoint_and_follows_the_run(tiny_cfg, vllm_engine, tiny_base,
                                                                                 tmp_path):
    """``async-vapo eval RUN_DIR``: the starting policy and every checkpoint with weights (one pruned by
    ``train.keep_checkpoints`` included) become eval rows of the run's metrics.jsonl at their updates' wall-clock,
    each with its own weights (a checkpoint whose LM head is scrambled answers otherwise); a second call evaluates
    nothing; ``watch`` picks up a checkpoint written while it waits and returns once the run is done."""
    import threading
    import time

    import torch

    from async_vapo.config import save_resolved
    from async_vapo.evaluation import eval_run, is_run_dir
    from async_vapo.learner.rundir import prune_checkpoints
    from async_vapo.learner.vapo import Learner
    from async_vapo.metrics.jsonl import JsonlWriter

    run = tmp_path / "run"
    save_resolved(tiny_cfg, run)
    w = JsonlWriter(run / "metrics.jsonl")
    for step in (2, 4, 6):
        w.write({"kind": "train", "step": step, "wall_s": 10.0 * step, "samples_seen": 8 * step})
    w.close()
    learner = Learner(tiny_cfg, tiny_base, None)
    learner.save(run / "checkpoints" / "step_2")
    with torch.no_grad():
        head = learner.policy.get_output_embeddings().weight
        head.copy_(head[torch.randperm(head.shape[0], generator=torch.Generator().manual_seed(0))])
    learner.save(run / "checkpoints" / "step_4")
    assert [p.name for p in prune_checkpoints(run, 1)] == ["step_2"]
    assert is_run_dir(run) and not is_run_dir(run / "checkpoints" / "step_4")
    over = ["rollout.eval_samples=2", "rollout.eval_temperature=1.0"]

    rows = eval_run(run, overrides=over, limit=12, engine=vllm_engine, progress=False, log=lambda m: None)
    assert [r["step"] for r in rows] == [0, 2, 4]
    assert all(r["kind"] == "eval" and r["source"] == "checkpoint" for r in rows)
    assert [r["wall_s"] for r in rows] == [0.0, 20.0, 40.0] and rows[1]["samples_seen"] == 16
    # each with its own weights: sampling is seeded, so the base's weights at update 2 answer as at update 0, word for
    # word, and the scrambled head of update 4 answers otherwise, and never right
    assert responses(run, 2) == responses(run, 0) != responses(run, 4) and rows[2]["eval/accuracy"] == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["kind"] == "eval"] == [0, 2, 4]
    assert eval_run(run, overrides=over, limit=12, engine=vllm_engine, progress=False, log=lambda m: None) == []

    # the run's last checkpoint (written aside, renamed in as the learner's save does), then its end marker, while
    # the evaluator waits
    Learner(tiny_cfg, tiny_base, None).save(tmp_path / "step_6")

    def finish():
        time.sleep(1.0)
        (tmp_path / "step_6").rename(run / "checkpoints" / "step_6")
        (run / "DONE").write_text("6\n")

    t = threading.Thread(target=finish)
    t.start()
    rows = eval_run(run, overrides=over, limit=12, engine=vllm_engine, watch=True, poll_s=0.2, progress=False,
                    log=lambda m: None)
    t.join()
    assert [(r["step"], r["wall_s"]) for r in rows] == [(6, 60.0)] and responses(run, 6) == responses(run, 0)
    assert 6 in json.loads((run / "eval" / "DONE").read_text())["evaluated"]  # the watch's end, for start_cluster.sh
