"""Hostile frames over real ZeroMQ sockets at every port the services bind: the replay's ``in`` and
``batches``, the verifier's ``in``, the learner's ``acks``, ``weights`` (XPUB: subscriptions) and
``weights_fetch``. After 240 frames per port (10,000-level nesting, declared lengths of 2**32 - 1, random
and mutated frames, wrong frame counts, frames over the limit by a little and by a lot) every service
still does its job on the next valid message, and its loop is alive.

Budget: about 20 s. Authentication is not on these sockets yet: this is the unauthenticated case."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import (
    BatchMsg,
    BatchRequest,
    Decoder,
    GroupsMsg,
    WeightsAck,
    ZmqTransport,
    make_envelope,
    shared_context,
)
from async_vapo.types import Group, Trajectory
from async_vapo.weights import WeightBroadcast, fetch_weights

HOSTILE = Path(__file__).resolve().parents[1] / "hostile.py"
FRAMES_PER_PORT = 240
MAX_BYTES = 1 << 20


def _group(uid: str, version: int) -> Group:
    return Group(uid=uid, prompt="1+1=", answer="2", prompt_ids=[1, 2], version=version,
                 samples=[Trajectory(response_ids=[ord(c) for c in text], behavior_logprobs=[-0.1] * len(text),
                                     finish_reason="stop") for text in ("1+1=2\\boxed{2}", "\\boxed{3}")])


@pytest.mark.parametrize("auth", [False, True], ids=["plaintext", "curve"])
def test_every_bound_port_survives_hostile_frames(tmp_path, auth):
    """Plaintext: the frames reach every decoder and are counted. CURVE: the strangers' connections never
    complete a handshake, so no frame reaches a decoder; either way every service still does its job."""
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.transport.security import CurveKeys, Security, create_keys

    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=1", "algo.mini_batch_size=2",
                           "algo.micro_batch_size=2", "verifier.num_workers=1", "cluster.replay.fsync=never",
                           f"cluster.wire.max_message_bytes={MAX_BYTES}", "cluster.weights.transfer=auto"])
    ctxs = {s: make_context(s, cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
            for s in ("replay", "verifier", "learner")}
    if auth:  # each service and each valid client with its own role's keys
        keys = create_keys(tmp_path / "keys")
        tp = {role: ZmqTransport(security=Security(CurveKeys.load(keys, role), shared_context()))
             for role in ("replay", "verifier", "rollout", "learner")}
    else:
        tp = dict.fromkeys(("replay", "verifier", "rollout", "learner"), ZmqTransport())
    any_port = "tcp://127.0.0.1:*"
    replay = ReplayService(ctxs["replay"], tp["replay"], in_endpoint=any_port, batch_endpoint=any_port)
    verifier = VerifierService(ctxs["verifier"], tp["verifier"], in_endpoint=any_port,
                               out_endpoint=replay.pull.endpoint)
    sync = WeightBroadcast(ctxs["learner"], tp["learner"], pub_endpoint=any_port, acks_endpoint=any_port,
                           fetch_endpoint=any_port, weights_dir=tmp_path / "weights")
    threads = [threading.Thread(target=replay.run, daemon=True),
               threading.Thread(target=verifier.run, args=(lambda ids: "".join(map(chr, ids)),), daemon=True)]
    for t in threads:
        t.start()
    try:
        state = {"w": torch.arange(64, dtype=torch.float32)}
        sync.publish(1, state, min_version=1)
        targets = [("PUSH", replay.pull.endpoint), ("DEALER", replay.router.endpoint),
                   ("PUSH", verifier.pull.endpoint), ("PUSH", sync.acks.endpoint),
                   ("XSUB", sync.pub.endpoint), ("DEALER", sync.server.endpoint)]
        # The senders run in their own processes, as a stranger on the network would: libzmq's XSUB keeps
        # the subscriptions it sent in a trie that it frees recursively, so the sender of a multi-MiB
        # "subscription" crashes itself when it closes (the publisher's side is unaffected).
        blasters = [subprocess.Popen([sys.executable, str(HOSTILE), str(kind), ep, f"port-{i}",
                                      str(FRAMES_PER_PORT), str(MAX_BYTES)], stdout=subprocess.PIPE, text=True)
                    for i, (kind, ep) in enumerate(targets)]
        deadline = time.monotonic() + 120
        while any(b.poll() is None for b in blasters):
            sync.heartbeat(1)
            sync.poll(0.05)
            assert time.monotonic() < deadline, "sending the hostile frames took too long"
        sent = [b.stdout.read().strip() for b in blasters]
        if not auth:  # every frame left the stranger (under CURVE most never do: no handshake, no connection)
            assert all(x == f"sent {FRAMES_PER_PORT}" for x in sent[:4] + sent[5:]), sent
        assert all(t.is_alive() for t in threads), "a service loop died"

        # Every port still works. The verifier grades a group and the replay stores and serves it ...
        sender = tp["rollout"].sender(verifier.pull.endpoint, peer="verifier")
        sender.send(make_envelope(GroupsMsg(groups=[_group("after", 1)]), sender="test"), 5.0)
        req = tp["learner"].requester(replay.router.endpoint, decoder=Decoder((BatchMsg,)), name="test", peer="replay")
        req.handshake(10.0)
        batch = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not batch:
            reply = req.request(make_envelope(BatchRequest(n_groups=1, for_version=1, min_version=1),
                                              sender="test"), 5.0)
            batch = reply.body.groups
            time.sleep(0.1)
        assert batch and batch[0].uid == "after"
        assert [s.verdict for s in batch[0].samples] == ["correct", "incorrect"]
        # ... the learner takes an engine's ack, and serves a weight fetch
        acks = tp["rollout"].sender(sync.acks.endpoint, peer="learner")
        acks.send(make_envelope(WeightsAck(engine_id="rollout-0", version=1, ok=True, load_seconds=0.1),
                                sender="rollout-0"), 5.0)
        deadline = time.monotonic() + 10
        while "rollout-0" not in sync.rotation.members:
            assert time.monotonic() < deadline, "the ack was not taken"
            sync.poll(0.05)
        dst = bytearray(sync.latest.nbytes)
        fetch_weights(tp["rollout"], sync.server.endpoint, 1, sync.latest.nbytes, dst, chunk_bytes=4096,
                      timeout_s=10.0, engine_id="rollout-0", max_bytes=MAX_BYTES)
        assert bytes(dst[:256]) == state["w"].numpy().tobytes()
        assert all(t.is_alive() for t in threads)
        for name in ("replay", "verifier", "learner"):
            counts = {k: v for k, v in _rejects(ctxs[name]).items() if v}
            if auth:  # no stranger got through a CURVE handshake: not one frame reached a decoder
                assert counts == {}, (name, counts)
            else:  # the frames were seen and counted, not ignored
                assert sum(counts.values()) > 0, (name, counts)
            print(name, "auth" if auth else "plaintext", counts)
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(10)
        replay.close()
        verifier.close()
        sync.close()
        for transport in set(tp.values()):
            transport.close()
        Security.stop_all()


def _rejects(ctx) -> dict[str, float]:
    reg = ctx.metrics.registry
    out = {}
    for metric in reg.collect():
        if metric.name.endswith("wire_rejects"):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    out[sample.labels["reason"]] = sample.value
    return out
