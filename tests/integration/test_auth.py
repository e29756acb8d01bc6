"""CURVE + ZAP on real sockets: who may talk to whom. The replay and the learner's weight server, each with
its role's keys; clients with the right role's key, the wrong role's key, a stranger's key pair (knowing
the server's public key) and no key at all.

Budget: about 15 s."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
import zmq

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import (
    BatchMsg,
    BatchRequest,
    Decoder,
    GroupsMsg,
    PeerTimeout,
    ZmqTransport,
    make_envelope,
    shared_context,
)
from async_vapo.transport.security import CurveKeys, Security, SecurityError, create_keys
from async_vapo.types import Group, Trajectory
from async_vapo.weights import WeightSlots, WeightsUnavailable, fetch_weights, slot_announce
from async_vapo.weights.fetch import WeightServer


def _group(uid: str) -> Group:
    return Group(uid=uid, prompt="1+1=", answer="2", prompt_ids=[1, 2], version=0,
                 samples=[Trajectory(response_ids=[3, 4], behavior_logprobs=[-0.1, -0.2], finish_reason="stop",
                                     reward=r, correct=r > 0, verdict="x") for r in (1.0, -1.0)])


@pytest.fixture
def keys(tmp_path):
    d = create_keys(tmp_path / "keys")
    # a stranger: its own key pairs, and the cluster's public keys (public keys are no secret)
    stranger = create_keys(tmp_path / "stranger")
    for role in ("replay", "learner"):
        shutil.copyfile(d / f"{role}.key", stranger / f"{role}.key")
    yield d, stranger
    Security.stop_all()


def _transport(keys_dir, role: str, ctx: zmq.Context | None = None) -> ZmqTransport:
    ctx = ctx or shared_context()
    return ZmqTransport(ctx, security=Security(CurveKeys.load(keys_dir, role), ctx))


def test_only_the_verifier_stores_groups_and_only_the_learner_gets_batches(tmp_path, keys):
    from async_vapo.services.replay import ReplayService

    cluster, stranger = keys
    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=1", "algo.mini_batch_size=2",
                           "algo.micro_batch_size=2", "cluster.replay.fsync=never"])
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    server = _transport(cluster, "replay")
    svc = ReplayService(ctx, server, in_endpoint="tcp://127.0.0.1:*", batch_endpoint="tcp://127.0.0.1:*")
    loop = threading.Thread(target=svc.run, daemon=True)
    loop.start()
    stranger_ctx = zmq.Context()  # the stranger is another process: its own context and ZAP handler
    clients = {
        "verifier": _transport(cluster, "verifier"), "rollout": _transport(cluster, "rollout"),
        "learner": _transport(cluster, "learner"), "stranger": _transport(stranger, "verifier", stranger_ctx),
        "plaintext": ZmqTransport(stranger_ctx),
    }
    try:
        for name, t in clients.items():  # everyone tries to push a group (reward +1 for a wrong answer: forged)
            t.sender(svc.pull.endpoint, peer="replay").send(
                make_envelope(GroupsMsg(groups=[_group(f"from-{name}")]), sender=name), 2.0)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.2)
        assert sorted(g.uid for _, g in svc.store.live()) == ["from-verifier"]

        def ask(name: str) -> list | None:
            req = clients[name].requester(svc.router.endpoint, decoder=Decoder((BatchMsg,)), name=name,
                                          peer="replay")
            try:
                # for_version 10**9 would drop every stored group as stale if it were acted on
                forged = make_envelope(BatchRequest(n_groups=1, for_version=10**9, min_version=0), sender=name)
                req.request(forged, 2.0)
                return req.request(make_envelope(BatchRequest(n_groups=1, for_version=0, min_version=0),
                                                 sender=name), 2.0).body.groups
            except PeerTimeout:
                return None

        for name in ("rollout", "verifier", "stranger", "plaintext"):
            assert ask(name) is None, name  # no handshake, no answer
        assert len(svc.buffer) == 1
        got = ask("learner")
        assert got is not None and [g.uid for g in got] == ["from-verifier"]
        refused = server.security.auth.refused
        assert refused >= 4, refused  # rollout's and the stranger's push, rollout/verifier/stranger requests
        assert loop.is_alive()
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        for t in clients.values():
            t.close()
        server.close()
        stranger_ctx.destroy(linger=0)


def test_only_rollouts_fetch_the_weights(tmp_path, keys):
    cluster, stranger = keys
    learner = Security(CurveKeys.load(cluster, "learner"), shared_context())
    slots = WeightSlots(tmp_path / "slots", 2)
    state = {"w": torch.arange(1024, dtype=torch.float32)}
    a = slot_announce(slots.write(3, state))
    server = WeightServer(ZmqTransport(security=learner), slots, "tcp://127.0.0.1:*", chunk_bytes=1024,
                          max_bytes=1 << 20, send_timeout_s=2.0)
    try:
        def fetch(security) -> bytes | None:
            dst = bytearray(a.nbytes)
            try:
                fetch_weights(ZmqTransport(security=security), server.endpoint, 3, a.nbytes, dst, chunk_bytes=1024,
                              timeout_s=2.0, engine_id="x", max_bytes=1 << 20)
            except (PeerTimeout, WeightsUnavailable):
                return None
            return bytes(dst)

        stranger_ctx = zmq.Context()
        try:
            assert fetch(Security(CurveKeys.load(stranger, "rollout"), stranger_ctx)) is None  # a stranger
            assert fetch(Security(CurveKeys.load(cluster, "replay"), shared_context())) is None  # wrong role
            assert fetch(None) is None  # no CURVE at all
            assert fetch(Security(CurveKeys.load(cluster, "rollout"), shared_context())) == \
                state["w"].numpy().tobytes()
        finally:
            stranger_ctx.destroy(linger=0)
    finally:
        server.close()
        slots.close()


def test_keys_are_private_and_plaintext_beyond_loopback_is_refused(tmp_path):
    d = create_keys(tmp_path / "keys")
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    assert all(oct((d / f"{r}.key_secret").stat().st_mode & 0o777) == "0o600"
               for r in ("replay", "verifier", "rollout", "learner"))
    (d / "replay.key_secret").chmod(0o644)
    with pytest.raises(SecurityError, match="readable by others"):
        CurveKeys.load(d, "replay")
    with pytest.raises(SecurityError, match="no CURVE key"):
        CurveKeys.load(tmp_path / "nowhere", "learner")
    with pytest.raises(Exception, match="allow_plaintext"):
        load_config([], ["cluster.security.curve=false", "cluster.hosts.bind_host=0.0.0.0"])
    assert not load_config([], ["cluster.security.curve=false", "cluster.hosts.bind_host=0.0.0.0",
                                "cluster.security.allow_plaintext=true"]).cluster.security.curve


def test_only_rollouts_hear_the_weight_announcements(keys):
    from async_vapo.transport import Heartbeat

    cluster, stranger = keys
    learner = _transport(cluster, "learner")
    pub = learner.publisher("tcp://127.0.0.1:*", peer="rollout")
    stranger_ctx = zmq.Context()
    subs = {name: t.subscriber(pub.endpoint, decoder=Decoder((Heartbeat,)), peer="learner")
            for name, t in (("rollout", _transport(cluster, "rollout")), ("replay", _transport(cluster, "replay")),
                            ("stranger", _transport(stranger, "rollout", stranger_ctx)))}
    heard = dict.fromkeys(subs, 0)
    try:
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # the CURVE handshake (a few hundred bytes) passes the subscription cap
            pub.pump()
            pub.publish(make_envelope(Heartbeat(service="learner", instance="0", served_version=1), sender="l"))
            for name, sub in subs.items():
                heard[name] += sub.recv(0.05) is not None
        assert heard["rollout"] > 0 and heard["replay"] == 0 and heard["stranger"] == 0, heard
    finally:
        learner.close()
        for sub in subs.values():
            sub.close()
        stranger_ctx.destroy(linger=0)
