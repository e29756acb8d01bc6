"""The engine boundary of the weight path (``async_vapo.weights.engine.WeightEngine``) on both real engines: the
lock-step ``VLLMEngine`` and the continuous ``ContinuousEngine`` (the session's shared ones, tiny model).

The cluster's weight client drives each engine through the interface alone: the learner's ``WeightBroadcast`` and
the client share one in-process transport, so a version arrives by the learner's shared-memory slot (rollout-0, on
the learner's host) and by a fetch over the transport's blob link (rollout-1, ``transfer = "zmq"``) with no ZeroMQ
socket; each load is checked by the engine's log-probs against the policy's. The engine's version is its own:
read-only to callers, -1 after a load that raised, whole again after the next load."""

from __future__ import annotations

import inspect
import time

import pytest
import torch
from conftest import TINY_TEST_OVERRIDES, assert_engine_serves

from async_vapo.weights.engine import WeightEngine


@pytest.fixture(params=["vllm_engine", "continuous_engine"])
def engine(request):
    """Each of the session's shared engines in turn (started in setup, once per session)."""
    return request.getfixturevalue(request.param)


def test_both_engine_classes_declare_the_interface():
    """Statically: both classes carry every member of the interface (the instances are checked below)."""
    from async_vapo.rollout.continuous import ContinuousEngine
    from async_vapo.rollout.engine import EngineWeights, VLLMEngine

    members = {"version", "weight_backend", "apply_weights", "invalidate", "load_weights_from_shared",
               "load_weights_from_file", "receive_buffer", "load_received", "join_weight_group",
               "receive_weights_dist"}
    assert members <= set(dir(WeightEngine))
    for cls in (VLLMEngine, ContinuousEngine):
        assert issubclass(cls, EngineWeights)
        # weight_backend is set per instance; the rest are on the class
        assert {m for m in members if not hasattr(cls, m)} == {"weight_backend"}, cls
        version = inspect.getattr_static(cls, "version")
        assert isinstance(version, property) and version.fset is None, cls  # no caller can set it


@pytest.mark.engines  # the session's engines, taken by name in the fixture: the conftest cannot see them
def test_weight_client_drives_each_engine_by_slot_and_by_fetch(engine, tiny_cfg, tiny_base, tmp_path):
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.services.context import make_context
    from async_vapo.transport import InprocTransport
    from async_vapo.weights import WeightBroadcast
    from async_vapo.weights.client import EngineWeightClient

    assert isinstance(engine, WeightEngine)
    with pytest.raises(AttributeError):
        engine.version = 5  # read-only: only the engine changes it

    def cfg(transfer: str):
        # in-process endpoints are names: the ports only need to agree between the learner and its clients
        return load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                                f"cluster.weights.transfer={transfer}", f"cluster.weights.dir={tmp_path / 'w'}"])

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    transport = InprocTransport()
    ctxs = [make_context(s, cfg=cfg(t), run_dir=tmp_path / "run", instance=i, serve_metrics=False,
                         install_signals=False)
            for s, i, t in (("learner", 0, "auto"), ("rollout", 0, "auto"), ("rollout", 1, "zmq"))]
    wb = WeightBroadcast(ctxs[0], transport, device="cpu")
    torch.manual_seed(17)
    # numbered past what the shared engine serves: another test may have left it at version 1 (then loading "1"
    # would load nothing, and the engine would serve that test's weights)
    version = max(engine.version, 0)
    clients = []

    def push(client) -> str:
        """One version: the learner publishes it, the client loads it into the engine; returns its way."""
        nonlocal version
        version += 1
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        wb.publish(version, policy.state_dict())
        deadline = time.monotonic() + 60
        while engine.version != version:
            assert time.monotonic() < deadline, f"version {version} did not reach {client.engine_id}"
            client.poll(0.05)
        assert_engine_serves(engine, policy, tok)
        [sample] = engine.generate([tok("1+2=").input_ids], n=1, temperature=1.0, top_p=1.0, max_tokens=4,
                                   stop_token_ids=[tok.eos_token_id], seed=1)[0]
        assert sample.version_spans == [(version, 0)]  # the engine labels its tokens with the version it loaded
        return max(("shm", "zmq"), key=lambda w: client.m_way.labels(way=w)._value.get())

    try:
        here = EngineWeightClient(ctxs[1], transport, engine)
        clients.append(here)
        assert push(here) == "shm"
        elsewhere = EngineWeightClient(ctxs[2], transport, engine)
        clients.append(elsewhere)
        assert push(elsewhere) == "zmq"  # fetched through the in-process transport's blob link
        assert wb.server.decoder.rejects.total == 0
        served = ctxs[0].metrics.learner.weight_fetch_bytes_total._value.get()
        assert served == wb.latest.nbytes, served

        # a load that raises in the workers leaves the engine at -1 (serve nothing: the weights may be mixed) ...
        with pytest.raises(Exception):  # noqa: B017 - whatever the workers raise on a missing file
            engine.apply_weights(version + 1, lambda: engine.load_weights_from_shared(
                str(tmp_path / "absent"), 64, [("w", "float32", [16], 0)], version + 1))
        assert engine.version == -1
        # ... and the client brings it back to the learner's latest, whole
        deadline = time.monotonic() + 60
        while engine.version != version:
            assert time.monotonic() < deadline, "the engine did not load the latest version again"
            elsewhere.poll(0.05)
        assert_engine_serves(engine, policy, tok)
    finally:
        wb.close()
        for c in clients:
            c.close()
        transport.close()
        for ctx in ctxs:
            ctx.close()
        engine.apply_weights(0, lambda: engine.load_weights(base, version=0))  # other tests share this engine
