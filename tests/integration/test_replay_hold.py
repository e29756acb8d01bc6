"""The replay holds a batch request for groups still to come (``BatchRequest.wait_s``) and answers it as soon as
they are stored, over real ZeroMQ sockets: the learner gets its batch when the verifier delivers it, not at its
next poll. Budget: about 10 s."""

from __future__ import annotations

import threading
import time

import pytest

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import BatchMsg, BatchRequest, Decoder, GroupsMsg, ZmqTransport, make_envelope
from async_vapo.types import Group, Trajectory


def _group(i: int) -> Group:
    return Group(uid=f"u{i}", prompt="1+1=", answer="2", prompt_ids=[1, 2, 3], version=0,
                 samples=[Trajectory(response_ids=[4, 5], behavior_logprobs=[-0.5, -0.5], finish_reason="stop",
                                     reward=1.0, correct=True, verdict="correct") for _ in range(2)])


@pytest.fixture
def replay(tmp_path):
    from async_vapo.services.replay import ReplayService

    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=2", "algo.mini_batch_size=4",
                           "algo.micro_batch_size=4"])
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    svc = ReplayService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", batch_endpoint="tcp://127.0.0.1:*")
    loop = threading.Thread(target=svc.run, daemon=True)
    loop.start()
    peer = ZmqTransport()
    sender = peer.sender(svc.pull.endpoint)
    req = peer.requester(svc.router.endpoint, decoder=Decoder((BatchMsg,)), name="learner-0")
    yield svc, sender, req, peer
    ctx.stop.set()
    loop.join(10)
    svc.close()
    transport.close()
    peer.close()


def _ask(req, wait_s: float, n: int = 2):
    env = make_envelope(BatchRequest(n_groups=n, for_version=0, min_version=0, wait_s=wait_s), sender="learner-0")
    t0 = time.monotonic()
    reply = req.request(env, 10.0)
    return reply.body, time.monotonic() - t0


def test_a_held_request_is_answered_when_its_groups_arrive(replay):
    svc, sender, req, _ = replay

    def deliver() -> None:
        time.sleep(0.5)
        sender.send(make_envelope(GroupsMsg(groups=[_group(0), _group(1)]), sender="verifier-0"), 1.0)

    pusher = threading.Thread(target=deliver)
    pusher.start()
    batch, waited = _ask(req, wait_s=4.0)
    pusher.join()
    # without the hold the reply comes at once and empty; with it, the groups come with it, long before 4 s
    assert sorted(g.uid for g in batch.groups) == ["u0", "u1"]
    assert 0.4 < waited < 3.0, waited
    assert not svc._waiting


def test_a_request_with_nothing_to_come_is_answered_empty_after_its_wait(replay):
    _, sender, req, _ = replay
    batch, waited = _ask(req, wait_s=0.6)
    assert batch.groups == [] and waited >= 0.55, waited
    batch, waited = _ask(req, wait_s=0.0)  # no hold asked for: answered at once
    assert batch.groups == [] and waited < 0.5, waited
    sender.send(make_envelope(GroupsMsg(groups=[_group(2), _group(3)]), sender="verifier-0"), 1.0)
    batch, _ = _ask(req, wait_s=2.0)
    assert sorted(g.uid for g in batch.groups) == ["u2", "u3"]


def test_a_new_request_answers_the_held_one_of_the_same_learner(replay):
    # a learner that asks again (its request timed out, or it restarted) wants the new request answered: the
    # held one is answered at once, empty, rather than with groups its learner no longer waits for
    svc, _, req, peer = replay
    earlier = peer.requester(svc.router.endpoint, decoder=Decoder((BatchMsg,)), name="learner-0")
    got = {}
    t = threading.Thread(target=lambda: got.update(zip(("batch", "waited"), _ask(earlier, wait_s=4.0), strict=True)))
    t.start()
    deadline = time.monotonic() + 3
    while not svc._waiting:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    batch, _ = _ask(req, wait_s=0.3)
    t.join(5)
    assert got["batch"].groups == [] and got["waited"] < 3.0, got
    assert batch.groups == [] and not svc._waiting


def test_groups_that_arrive_stale_are_counted_by_the_engine_that_made_them(replay):
    # the learner asks for version 1 with floor 1; then groups of version 0 from two engines arrive: all four are
    # dropped on arrival. The next answer names each engine's late groups once (the learner sums them into its
    # heartbeats), the one after none.
    svc, sender, req, _ = replay
    ask = make_envelope(BatchRequest(n_groups=2, for_version=1, min_version=1, wait_s=0.0), sender="learner-0")
    assert req.request(ask, 10.0).body.groups == []
    groups = [_group(10), _group(11), _group(12), _group(13)]
    for g, engine in zip(groups, ("rollout-0", "rollout-1", "rollout-1", ""), strict=True):
        g.engine = engine
    sender.send(make_envelope(GroupsMsg(groups=groups), sender="verifier-0"), 1.0)
    deadline = time.monotonic() + 5.0
    while svc.buffer.stats().added_total < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    batch = req.request(ask, 10.0).body
    assert batch.groups == [] and svc.buffer.stats().stale_dropped_total == 4
    assert batch.late_dropped_by_engine == {"rollout-0": 1, "rollout-1": 2}  # a group naming no engine: left out
    assert batch.stale_dropped_by_engine == batch.late_dropped_by_engine
    again = req.request(ask, 10.0).body
    assert again.late_dropped_by_engine == {} and again.stale_dropped_by_engine == {}
