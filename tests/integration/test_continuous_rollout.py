"""The rollout service in continuous mode (``rollout.generation = "continuous"``): the whole pipeline in one pytest
process over the in-process transport with vLLM's async engine, a request per group, new weights loaded in flight.

Budget: two short runs of about a minute each, on the session's continuous engine (tests/conftest.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import TINY_TEST_OVERRIDES

from async_vapo.config import load_config
from async_vapo.services.context import SERVICES, make_context


def _run(cfg, engine, tiny_base, run_dir, total: int) -> tuple[list[dict], dict]:
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    engine.load_weights(load_policy(tiny_base).state_dict(), 0)
    ctxs = {s: make_context(s, cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
            for s in SERVICES}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    replay, verifier = ReplayService(ctxs["replay"], transport), VerifierService(ctxs["verifier"], transport)
    learner = LearnerService(ctxs["learner"], transport)
    rollout = RolloutService(ctxs["rollout"], transport, engine, tok, train_set, eval_set,
                             pretrain_batches=cfg.algo.value_pretrain_steps)
    assert rollout.continuous is not None
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    threads = [threading.Thread(target=replay.run, daemon=True),
               threading.Thread(target=verifier.run, args=(decode,), daemon=True),
               threading.Thread(target=learner.run, daemon=True), threading.Thread(target=rollout.run, daemon=True)]
    path = run_dir / "metrics.jsonl"
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "DONE").exists():
            assert time.monotonic() < deadline, "the continuous pipeline did not train in time"
            assert all(t.is_alive() for t in threads), "a service loop died"
            time.sleep(0.2)
        m = ctxs["rollout"].metrics
        figures = {name: m.get(name)._value.get() for name in
                   ("groups_shipped_total", "multi_version_groups_total", "tokens_after_switch_total")}
        figures["aborted"] = {r: m.get("aborted_groups_total").labels(reason=r)._value.get()
                              for r in ("stale", "error", "rolled_back")}
        figures["pauses"] = m.get("weight_pause_seconds")._sum.get()
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(60)
        for svc in (rollout, learner, verifier, replay):
            svc.close()
        transport.close()
    return [json.loads(x) for x in path.read_text().splitlines()], figures


def _cfg(tiny_cfg, tmp_path, *extra):
    return load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.total_steps=3",
                            "train.eval_every=3", "train.checkpoint_every=0", "cluster.weights.transfer=shm",
                            "cluster.replay.fsync=never", "cluster.wire.batch_poll_s=0.05",
                            "cluster.wire.heartbeat_s=0.2", "cluster.rollout.eval=false",
                            "rollout.generation=continuous", "rollout.max_response_tokens=120",
                            f"cluster.weights.dir={tmp_path / 'w'}", *extra])


@pytest.mark.slow
def test_keep_trains_within_the_bound_of_every_token(continuous_engine, tiny_cfg, tiny_base, tmp_path):
    """max_staleness 1, weights updated in flight ("keep"): every step trains, and no token of a trained group is
    more than one version behind the learner (the bound is the oldest token's); groups are shipped one by one."""
    continuous_engine.weight_update = "keep"
    cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=keep")
    rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 3)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(0 <= r["replay/max_age"] <= 1 and 0 <= r["replay/token_lag_max"] <= 1 for r in train), train
    assert figures["groups_shipped_total"] >= 3 * cfg.algo.prompts_per_step
    assert figures["aborted"]["error"] == 0
    assert figures["pauses"] > 0  # each version paused the engine
    # the engine's time with requests in flight is the generate stage's busy time, as a lock-step call's is
    busy = [json.loads(x) for x in (tmp_path / "run" / "stats" / "rollout-0.busy.jsonl").read_text().splitlines()]
    generate = [(a, b) for stage, a, b in busy if stage == "generate"]
    assert generate and all(b >= a for a, b in generate)
    assert sum(b - a for a, b in generate) > 1.0
    print("continuous keep:", figures, [(r["replay/token_lag_mean"], r["replay/multi_version_samples"])
                                        for r in train])


@pytest.mark.slow
def test_wait_gives_every_sample_one_version(continuous_engine, tiny_cfg, tiny_base, tmp_path):
    """"wait" lets the requests in flight finish under the old weights before a new version loads: the lock-step
    semantics, one version per sample, on the continuous engine."""
    continuous_engine.weight_update = "wait"
    try:
        cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=wait")
        rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 3)
    finally:
        continuous_engine.weight_update = "keep"
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert figures["multi_version_groups_total"] == 0 and figures["tokens_after_switch_total"] == 0
    assert all(r["replay/multi_version_samples"] == 0 for r in train)
    assert all(0 <= r["replay/max_age"] <= 1 for r in train)
