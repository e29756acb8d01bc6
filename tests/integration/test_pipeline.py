"""The whole pipeline, rollout -> verifier -> replay -> learner, in one pytest process over the in-process
transport (real vLLM engine, real sandbox, real learner), and the liveness policy on a real cluster: a
rollout stopped with SIGSTOP leaves rotation and rejoins when resumed."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES, assert_engine_serves

from async_vapo.config import load_config
from async_vapo.services.context import SERVICES, make_context

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["shm", "dist", "auto"])
def test_pipeline_in_one_process_over_the_inproc_transport(tiny_cfg, tiny_base, vllm_engine, tmp_path, transfer):
    """Budget: about a minute each (3 updates of 4 prompts x 4 samples, held-out evaluations of versions 0 and 3, the
    critic scored on each). Frames are limited
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
        # done: the last version evaluated by rollout 0, and the learner's critic scored on that evaluation's responses
        while not (run_dir / "DONE").exists() or not {("eval", total), ("critic_eval", total)} <= {
                (r["kind"], r["step"]) for r in rows()}:
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
    assert [r["kind"] for r in got if r["kind"] not in ("eval", "critic_eval")] == ["pretrain"] + ["train"] * total
    # the critic scored on rollout 0's held-out responses at every evaluation, the untrained policy's included
    critic = [r for r in got if r["kind"] == "critic_eval"]
    assert {r["step"] for r in critic} == {r["step"] for r in got if r["kind"] == "eval"}
    assert all(r["critic/heldout_responses"] == len(eval_set) * cfg.rollout.eval_samples for r in critic)
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
