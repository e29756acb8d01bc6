"""Smoke test of the long-response config (configs/tiny_long_cpu.toml): two updates of the one-process trainer on
the real vLLM engine, through the CLI a user runs, which is then ended by SIGTERM (what a scheduler, `timeout` or
`kill` send): it closes its vLLM engine, and none of the engine's processes outlives it (before, the engine core and
worker kept running, and spinning, after the trainer died). The base model is the long config's with a tiny recipe
(20 supervised steps of a one-layer model of width 64, two heads: vLLM's CPU attention needs a head size of at
least 32) built into a temporary cache, never the full build. Budget: about 1.5 minutes here (one engine start)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

TINY_BASE = [
    "base_model.hidden_size=64", "base_model.num_layers=1", "base_model.num_heads=2", "base_model.num_kv_heads=1",
    "base_model.intermediate_size=128", "base_model.sft_steps=20", "base_model.sft_batch_size=8",
    "base_model.sft_lr=1e-2", "reward_model.steps=2", "reward_model.batch_size=4", "task.num_train=200",
]
SMALL_RUN = [
    "task.num_eval=23", "rollout.eval_samples=1", "algo.prompts_per_step=2", "algo.group_size=4",
    "algo.mini_batch_size=8", "algo.micro_batch_size=8", "algo.value_pretrain_steps=1", "train.total_steps=10000",
    "train.eval_every=2", "train.checkpoint_every=0", "train.max_minutes=null", "verifier.num_workers=1",
]


@pytest.mark.slow
def test_long_config_trains_two_updates_then_sigterm_stops_it_and_its_engine(tmp_path):
    cmd = [sys.executable, "-m", "async_vapo.cli", "train", "--config", str(REPO / "configs" / "tiny_long_cpu.toml"),
           *TINY_BASE, *SMALL_RUN, f"model.cache_dir={tmp_path / 'cache'}", f"train.output_dir={tmp_path}/{{name}}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_CPU_KVCACHE_SPACE="1")
    run = tmp_path / "tiny_long_cpu"
    log = tmp_path / "train.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    children: list[psutil.Process] = []

    def rows() -> list[dict]:
        path = run / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    try:
        deadline = time.monotonic() + 600
        while not any(r["kind"] == "eval" and r["step"] == 2 for r in rows()):  # two updates and their evaluation
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no evaluation after two updates within 600 s"
            time.sleep(0.5)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("VLLM" in c.name() or "vllm" in " ".join(c.cmdline()).lower() for c in children), children
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    finally:  # only the trainer's own processes: the test session's shared engine is a child of this process too
        proc.kill()
        for c in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()

    cfg = json.loads((run / "config.resolved.json").read_text())
    assert (cfg["task"]["labels"], cfg["task"]["min_ops"], cfg["task"]["max_ops"], cfg["algo"]["alpha"]) == (
        True, 18, 40, 0.063)
    written = rows()
    assert [r["kind"] for r in written].count("pretrain") == 1
    train_rows = [r for r in written if r["kind"] == "train"]
    assert [r["version"] for r in train_rows][:2] == [1, 2]
    for r in train_rows:
        assert 0 < r["rollout/response_length"] <= 420
        # length-adaptive GAE with alpha 0.063: lambda_policy = 1 - 1/(0.063 l) <= 1 - 1/(0.063 * 420) ~ 0.962
        assert 0 <= r["lam_policy/mean"] <= 0.962
    evals = [r for r in written if r["kind"] == "eval"]
    assert [e["step"] for e in evals][:2] == [0, 2]
    # the held-out split covers every chain length, the longest prompts included
    assert {f"eval/accuracy_ops{n}" for n in range(18, 41)} <= set(evals[-1])
