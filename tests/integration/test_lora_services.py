"""A LoRA version through the services: the learner service publishes each version as its adapter
(``weights.adapter``), and the rollout service's weight client loads it into a LoRA engine, read where it lies
("shm") or fetched over the transport's blob link and written into the engine's own directory ("zmq").

Real parts only: the learner service (``LearnerService``, its ``publish`` and ``WeightBroadcast``), the rollout
service (``RolloutService``, its ``EngineWeightClient``) and the session's LoRA engine (tests/conftest.py), over the
in-process transport. The engine joins after the learner announced its first version (a late engine takes the
current adapter); it then serves exactly the learner's policy; an adapter whose bytes do not match the announce is
refused, acked as failed, and the engine keeps its version until the next good one."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import TINY_TEST_OVERRIDES, assert_engine_serves
from test_lora_engine import set_adapter

from async_vapo.config import load_config
from async_vapo.services.context import make_context

pytestmark = pytest.mark.engines


def serve(learner, rollout, version: int, timeout_s: float = 30.0) -> None:
    """Run both sides until the engine serves ``version`` and the learner has it in rotation."""
    sync = learner.sync
    deadline = time.monotonic() + timeout_s
    while rollout.engine.version != version or rollout.engine_id not in sync.rotation.members \
            or version in sync.rotation.pending:
        assert time.monotonic() < deadline, f"the engine did not take version {version}"
        rollout.weights.poll(0.05)
        rollout.weights.heartbeat()
        sync.heartbeat(sync.rotation.latest)
        sync.poll(0.05)


def counter(metric, **labels) -> float:
    return (metric.labels(**labels) if labels else metric)._value.get()


@pytest.mark.parametrize("transfer", ["shm", "zmq", "auto"])
def test_the_learner_service_publishes_adapters_that_the_engine_serves(transfer, tiny_cfg, tiny_base, lora_engine,
                                                                      tmp_path):
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           "model.lora.rank=4", "model.lora.alpha=8", f"cluster.weights.transfer={transfer}",
                           f"cluster.weights.dir={tmp_path / 'w'}", "cluster.weights.chunk_bytes=16384",
                           "cluster.wire.heartbeat_s=0.1"])
    ctxs = {s: make_context(s, cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
            for s in ("learner", "rollout")}
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    base = load_policy(tiny_base)
    # the base weights under the adapters (another test may have loaded whole weights into the session's engine)
    lora_engine.apply_weights(0, lambda: lora_engine.load_weights(base.state_dict(), 0))
    transport = InprocTransport()
    learner = LearnerService(ctxs["learner"], transport)
    rollout = None
    try:
        sync = learner.sync
        v1 = set_adapter(learner.learner, seed=1)
        # as the step loop of a sharded learner calls it, with what every rank gathered (publish_state: the adapter)
        learner.publish(1, learner.learner.publish_state())
        with pytest.raises(ValueError, match="its adapter"):  # whole weights are refused, never written as a version
            learner.publish(2, learner.learner.policy_state())
        a = sync.latest
        full = sum(t.numel() * t.element_size() for t in learner.learner.policy_state().values())
        assert a.transfer == "adapter", a.transfer
        assert a.nbytes < full / 5, (a.nbytes, full)  # the adapter's bytes, not the weights'
        # an engine that joins after the announce takes the current adapter
        train_set, eval_set = load_task(cfg)
        rollout = RolloutService(ctxs["rollout"], transport, lora_engine, tok, train_set, eval_set,
                                 pretrain_batches=1)
        rollout.weights.start()
        serve(learner, rollout, 1)
        way = {"shm": "adapter", "zmq": "adapter_zmq", "auto": "adapter"}[transfer]  # "auto": this host
        rm, lm = rollout.ctx.metrics.rollout, sync.ctx.metrics.learner
        assert counter(rm.weight_transfers_total, via=way) == 1
        served = counter(lm.weight_fetch_bytes_total)
        assert served == (a.nbytes if transfer == "zmq" else 0), served  # fetched over the transport, or not at all
        # the engine's load is in the push's seconds: its ack's, and the learner's announce-to-last-ack figure
        assert rm.weight_load_seconds._sum.get() > 0 and lm.broadcast_seconds._sum.get() > 0
        assert_engine_serves(lora_engine, learner.learner.policy, tok)
        with pytest.raises(AssertionError):  # not trivially: the adapter moved the policy off the base
            assert_engine_serves(lora_engine, base, tok)

        # version 2's adapter is corrupted after its announce: refused, acked as failed, version 1 still served
        set_adapter(learner.learner, seed=2)
        learner.publish(2)
        if transfer != "zmq":
            from async_vapo.models.lora import ADAPTER_WEIGHTS

            path = sync.publisher.dirs[-1] / ADAPTER_WEIGHTS
            data = bytearray(path.read_bytes())
            data[-1] ^= 1
            path.write_bytes(bytes(data))
        else:  # what the fetch server serves (each chunk's crc32 is computed on it: only the whole blob's check fails)
            blob = bytearray(sync.publisher.blobs[2])
            blob[-1] ^= 1
            sync.publisher.blobs[2] = bytes(blob)
        failed = sync.failed_loads
        deadline = time.monotonic() + 30
        while counter(failed) == 0:
            assert time.monotonic() < deadline, "no failed ack of the corrupted version"
            rollout.weights.poll(0.05)
            sync.poll(0.05)
        assert lora_engine.version == 1
        learner.learner.policy.load_state_dict(v1)
        assert_engine_serves(lora_engine, learner.learner.policy, tok)

        # the next good version is taken
        set_adapter(learner.learner, seed=3)
        learner.publish(3)
        serve(learner, rollout, 3)
        assert_engine_serves(lora_engine, learner.learner.policy, tok)
        assert counter(rm.weight_transfers_total, via=way) == 2
        print(f"{transfer}: adapter {a.nbytes} bytes against {full} whole; engine load "
              f"{rm.weight_load_seconds._sum.get() / 2:.3f} s per version")
    finally:
        if rollout is not None:
            rollout.close()
        learner.close()
        transport.close()


def test_a_fetched_adapter_is_checked_before_anything_is_written(tmp_path):
    """The engine's end of the fetch, without an engine: a version the learner no longer holds is unavailable; an
    announce whose layout names another file than a PEFT directory's is refused before any fetch; a good one is written
    whole, byte for byte the learner's directory."""
    from async_vapo.models import lora
    from async_vapo.transport import InprocTransport
    from async_vapo.weights.adapter import AdapterInbox, AdapterPublisher
    from async_vapo.weights.slots import WeightsUnavailable

    def tensors(seed):
        g = torch.Generator().manual_seed(seed)
        return {f"{lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 64, generator=g),
                f"{lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(64, 4, generator=g)}

    transport = InprocTransport()
    pub = AdapterPublisher(tmp_path / "out", lora.peft_config(4, 8, ["q_proj"]), keep=2, transport=transport,
                           fetch_endpoint="tcp://learner:1", chunk_bytes=1000, max_bytes=1 << 20)
    box = AdapterInbox(tmp_path / "in")
    args = dict(chunk_bytes=1000, timeout_s=10.0, engine_id="e0", max_bytes=1 << 20)
    try:
        announces = [pub.publish(v, tensors(v)) for v in (1, 2, 3)]
        with pytest.raises(WeightsUnavailable):  # two kept: version 1 is gone
            box.fetch(transport, "tcp://learner:1", announces[0], **args)
        bad = announces[2].__class__(**{**{f: getattr(announces[2], f) for f in announces[2].__struct_fields__},
                                        "layout": [("../escape", "uint8", [announces[2].nbytes], 0)]})
        with pytest.raises(ValueError, match="malformed layout"):
            box.fetch(transport, "tcp://learner:1", bad, **args)
        assert not (tmp_path / "in").exists() and not (tmp_path / "escape").exists()
        got = box.fetch(transport, "tcp://learner:1", announces[2], **args)
        for name in (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG):
            assert (got / name).read_bytes() == (pub.dirs[-1] / name).read_bytes()
        assert announces[2].nbytes > 3 * 1000  # several chunks, in flight together
    finally:
        box.close()
        pub.close()
        transport.close()


def test_served_merged_the_learner_service_publishes_whole_weights_to_an_engine_without_lora(tiny_cfg, tiny_base,
                                                                                             vllm_engine, tmp_path):
    """``model.lora.serve = "merged"``: the learner service trains the adapter but publishes each version as the
    merged weights, whole, by the ordinary way ("shm" here); the session's plain engine (no LoRA) loads them and
    serves exactly the learner's adapted policy."""
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           "model.lora.rank=4", "model.lora.alpha=8", "model.lora.serve=merged",
                           "cluster.weights.transfer=shm", f"cluster.weights.dir={tmp_path / 'w'}",
                           "cluster.wire.heartbeat_s=0.1"])
    ctxs = {s: make_context(s, cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
            for s in ("learner", "rollout")}
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    transport = InprocTransport()
    learner = LearnerService(ctxs["learner"], transport)
    rollout = None
    try:
        set_adapter(learner.learner, seed=4)
        learner.publish(1)
        a = learner.sync.latest
        full = sum(t.numel() * t.element_size() for t in learner.learner.policy_state().values())
        assert a.transfer == "shm" and a.nbytes >= full, (a.transfer, a.nbytes, full)  # whole weights, not an adapter
        train_set, eval_set = load_task(cfg)
        rollout = RolloutService(ctxs["rollout"], transport, vllm_engine, tok, train_set, eval_set,
                                 pretrain_batches=1)
        rollout.weights.start()
        serve(learner, rollout, 1)
        assert counter(rollout.ctx.metrics.rollout.weight_transfers_total, via="shm") == 1
        assert_engine_serves(vllm_engine, learner.learner.policy, tok)
        with pytest.raises(AssertionError):  # the adapter moved the policy off the base
            assert_engine_serves(vllm_engine, load_policy(tiny_base), tok)
    finally:
        if rollout is not None:
            rollout.close()
        learner.close()
        transport.close()
        base = load_policy(tiny_base).state_dict()
        vllm_engine.apply_weights(0, lambda: vllm_engine.load_weights(base, version=0))  # other tests share it


def test_adapters_over_weight_groups_are_refused_naming_the_ways_that_work(tmp_path):
    from async_vapo.models import lora
    from async_vapo.weights.publish import make_publisher

    with pytest.raises(ValueError, match='"auto", "shm", "zmq" or "file"'):
        load_config([], ["model.lora.rank=4", "cluster.weights.transfer=dist"])
    with pytest.raises(ValueError, match='"auto", "shm", "zmq" or "file"'):
        make_publisher("dist", tmp_path, keep_versions=2, transport=None, fetch_endpoint=None,
                       lora=lora.peft_config(4, 8, ["q_proj"]))


def test_the_whole_pipeline_trains_with_lora_over_the_fetch(tiny_cfg, tiny_base, lora_engine, tmp_path):
    """Rollout, verifier, replay and learner services over the in-process transport with ``model.lora`` and
    ``cluster.weights.transfer = "zmq"``: three updates, each version fetched as its adapter, and the engine serves
    the final checkpoint's adapter as peft loads it over the base model."""
    import json
    import threading

    from peft import PeftModel
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.context import SERVICES
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    total = 3
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "model.lora.rank=4",
                           "model.lora.alpha=8", f"train.total_steps={total}", f"train.eval_every={total}",
                           "train.checkpoint_every=0", "async.max_staleness=1", "cluster.weights.transfer=zmq",
                           "cluster.weights.chunk_bytes=16384", "cluster.replay.fsync=never",
                           "cluster.wire.batch_poll_s=0.05", "cluster.wire.heartbeat_s=0.2"])
    run_dir = tmp_path / "run"
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    base = load_policy(tiny_base)
    lora_engine.apply_weights(0, lambda: lora_engine.load_weights(base.state_dict(), 0))
    ctxs = {s: make_context(s, cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
            for s in SERVICES}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    replay = ReplayService(ctxs["replay"], transport)
    verifier = VerifierService(ctxs["verifier"], transport)
    learner = LearnerService(ctxs["learner"], transport)
    rollout = RolloutService(ctxs["rollout"], transport, lora_engine, tok, train_set, eval_set,
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
        served = lora_engine.version
        fetched = counter(ctxs["rollout"].metrics.rollout.weight_transfers_total, via="adapter_zmq")
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(60)
        for svc in (rollout, learner, verifier, replay):
            svc.close()
        transport.close()
    train = [r for r in rows() if r["kind"] == "train"]
    assert [(r["step"], r["version"]) for r in train] == [(i, i) for i in range(1, total + 1)]
    assert served == total and fetched == total  # every version came as its adapter, over the fetch
    adapter = run_dir / "checkpoints" / f"step_{total}" / "policy_adapter"
    assert_engine_serves(lora_engine, PeftModel.from_pretrained(load_policy(tiny_base), str(adapter)).eval(), tok)
    with pytest.raises(AssertionError):  # the updates moved the policy off the base
        assert_engine_serves(lora_engine, base, tok)
