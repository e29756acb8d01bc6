"""The whole pipeline, rollout -> verifier -> replay -> learner, in one pytest process over the in-process
transport (real vLLM engine, real sandbox, real learner), and the liveness policy on a real cluster: a
rollout stopped with SIGSTOP leaves rotation and rejoins when resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES, assert_engine_serves, free_ports

from async_vapo.config import load_config
from async_vapo.services.context import SERVICES, make_context

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["shm", "dist", "auto"])
def test_pipeline_in_one_process_over_the_inproc_transport(tiny_cfg, tiny_base, vllm_engine, tmp_path, transfer):
    """Budget: about a minute each (3 updates of 4 prompts x 4 samples, one held-out evaluation). Frames are limited
    to 8 KiB, about a step's groups in one message: they travel in chunks of at most 4 KiB, and the learner asks the
    replay for fewer groups than a step per request. With "dist" every version reaches the engine over its
    torch.distributed group (async_vapo.weights.collective); with "auto" the engine, on the learner's host, maps its
    slot and never asks for a group."""
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    total = 3
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           f"train.total_steps={total}", f"train.eval_every={total}", "train.checkpoint_every=0",
                           "async.max_staleness=1", f"cluster.weights.transfer={transfer}",
                           "cluster.replay.fsync=never", "cluster.wire.batch_poll_s=0.05",
                           "cluster.wire.heartbeat_s=0.2", "cluster.wire.max_message_bytes=8192"])
    run_dir = tmp_path / "run"
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    base_state = load_policy(tiny_base).state_dict()
    vllm_engine.load_weights(base_state, 0)
    ctxs = {s: make_context(s, cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
            for s in SERVICES}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    replay = ReplayService(ctxs["replay"], transport)
    verifier = VerifierService(ctxs["verifier"], transport)
    learner = LearnerService(ctxs["learner"], transport)
    rollout = RolloutService(ctxs["rollout"], transport, vllm_engine, tok, train_set, eval_set,
                             pretrain_batches=cfg.algo.value_pretrain_steps)
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    threads = [threading.Thread(target=replay.run, daemon=True),
               threading.Thread(target=verifier.run, args=(decode,), daemon=True),
               threading.Thread(target=learner.run, daemon=True), threading.Thread(target=rollout.run, daemon=True)]

    def rows() -> list[dict]:
        path = run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "DONE").exists() or not any(r["kind"] == "eval" and r["version"] == total
                                                         for r in rows()):
            assert time.monotonic() < deadline, "the pipeline did not train and evaluate in time"
            assert all(t.is_alive() for t in threads), "a service loop died"
            time.sleep(0.2)
        served = vllm_engine.version
        per_request = learner.replay.per_request
        via = {k: v for k, v in _samples(ctxs["rollout"], "weight_transfers_total").items() if v}
        asked_group = rollout.weights.in_group or learner.sync.groups
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(60)
        for svc in (rollout, learner, verifier, replay):
            svc.close()
        transport.close()
    got = rows()
    train = [r for r in got if r["kind"] == "train"]
    assert [r["kind"] for r in got if r["kind"] != "eval"] == ["pretrain"] + ["train"] * total
    assert [(r["step"], r["version"]) for r in train] == [(i, i) for i in range(1, total + 1)]
    assert all(0 <= r["replay/max_age"] <= 1 for r in train)  # the staleness bound held
    assert all("rollout/verdict_unverified" not in r for r in got)  # every sample went through the sandbox
    assert {r["version"] for r in got if r["kind"] == "eval"} >= {0, total}
    assert served == total
    assert per_request < cfg.algo.prompts_per_step  # the step's groups came in several replies
    way = "shm" if transfer == "auto" else transfer
    assert via == {(("via", way),): total}, via  # every version came the configured way
    assert bool(asked_group) == (transfer == "dist")
    ckpt = run_dir / "checkpoints" / f"step_{total}"
    assert_engine_serves(vllm_engine, load_policy(ckpt / "policy"), tok)  # the engine serves the last version
    vllm_engine.load_weights(base_state, 0)


def _samples(ctx, name: str) -> dict:
    """Samples of the service's metric ``name`` by their labels (the process's own registry)."""
    full = ctx.metrics.full_name(name)
    out = {}
    for metric in ctx.metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == full:
                out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(async_vapo_learner_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and not m.group(2):
            out[m.group(1)] = float(m.group(3))
    return out


def _wait(port: int, what: str, cond, timeout_s: float) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    m: dict[str, float] = {}
    while time.monotonic() < deadline:
        try:
            m = _scrape(port)
        except OSError:
            m = {}
        if m and cond(m):
            return m
        time.sleep(0.3)
    pytest.fail(f"{what} within {timeout_s} s; last scrape: {m}")


@pytest.mark.slow
def test_stopped_rollout_leaves_rotation_and_rejoins(tiny_cfg, tiny_base, tmp_path):
    """Budget: about 1.5 minutes (a cluster start, a few updates, a 3 s liveness deadline twice)."""
    names = ["verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
             "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port", "rollout_metrics_port"]
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items())
                      + "heartbeat_s = 0.3\npeer_dead_s = 3.0\nhealth_timeout_s = 240\nstop_grace_s = 10\n"
                      + 'fsync = "never"\nrollout_eval = false\n')
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.total_steps=1000",
                 "train.checkpoint_every=0"]
    run_dir = tmp_path / "run"
    py = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else "python"
    env = {**os.environ, "PYTHON": py}
    learner_port = ports["learner_metrics_port"]
    try:
        start = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config),
                                "--run-dir", str(run_dir), "--", *overrides], cwd=REPO, env=env, capture_output=True,
                               text=True, timeout=300)
        assert start.returncode == 0, start.stderr[-4000:]
        before = _wait(learner_port, "an update with the engine in rotation",
                       lambda m: m.get("async_vapo_learner_version", 0) >= 2
                       and m.get("async_vapo_learner_engines_in_rotation") == 1, 120)
        rollout = int((run_dir / "pids" / "rollout-0.pid").read_text())
        os.killpg(rollout, signal.SIGSTOP)
        try:
            stopped = _wait(learner_port, "the silent engine out of rotation",
                            lambda m: m.get("async_vapo_learner_engines_in_rotation") == 0
                            and m.get("async_vapo_learner_engines_dead_total", 0) >= 1, 30)
        finally:
            os.killpg(rollout, signal.SIGCONT)
        back = _wait(learner_port, "the resumed engine back in rotation and training going on",
                     lambda m: m.get("async_vapo_learner_engines_in_rotation") == 1
                     and m.get("async_vapo_learner_engines_rejoined_total", 0) >= 1
                     and m["async_vapo_learner_version"] > stopped["async_vapo_learner_version"], 90)
        assert back["async_vapo_learner_version"] > before["async_vapo_learner_version"]
        log = (run_dir / "logs" / "learner.log").read_text()
        assert "rollout-0 silent for more than 3 s: out of rotation" in log
    finally:
        subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], capture_output=True,
                       text=True, timeout=120)
