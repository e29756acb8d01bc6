"""The asynchronous cluster: services that survive bad frames (real ZeroMQ sockets, in process), learner
checkpoints and resume. The whole cluster end to end (start_cluster.sh / stop_cluster.sh, a real Prometheus server
scraping every service, faults) is tests/integration/test_faults.py."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
import zmq
from conftest import free_ports

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import (
    PROTOCOL_VERSION,
    BatchMsg,
    BatchRequest,
    GroupsMsg,
    ZmqTransport,
    connect_with_handshake,
    encode,
    make_envelope,
)
from async_vapo.transport.messages import Decoder
from async_vapo.types import Group, Trajectory

REPO = Path(__file__).resolve().parents[2]


# -- a running service keeps serving through bad frames ------------------------------------------------------------

def _group(uid: str, version: int, g: int) -> Group:
    return Group(uid=uid, prompt="1+1", answer="2", prompt_ids=[1, 2], version=version,
                 samples=[Trajectory(response_ids=[3, 4], behavior_logprobs=[-0.1, -0.2], finish_reason="stop",
                                     reward=1.0, correct=True, verdict="correct") for _ in range(g)])


def _reject_count(ctx, reason: str) -> float:
    v = ctx.metrics.registry.get_sample_value("async_vapo_replay_wire_rejects_total", {"reason": reason})
    return v or 0.0


def test_replay_service_counts_bad_frames_and_keeps_serving(tmp_path):
    from async_vapo.services.replay import ReplayService

    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=2", "algo.mini_batch_size=4",
                           "algo.micro_batch_size=4", "cluster.replay.fsync=never"])
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    own = ZmqTransport()
    svc = ReplayService(ctx, own, in_endpoint="tcp://127.0.0.1:*", batch_endpoint="tcp://127.0.0.1:*")
    loop = threading.Thread(target=svc.run, daemon=True)
    loop.start()
    zctx = zmq.Context()
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(svc.pull.endpoint)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(svc.router.endpoint)
    transport = ZmqTransport(zctx)
    try:
        good = make_envelope(GroupsMsg(groups=[_group("a", 0, 2)]), sender="test")
        this_version = b"\xa8protocol" + bytes([PROTOCOL_VERSION])
        wrong_version = encode(good).replace(this_version, b"\xa8protocol" + bytes([PROTOCOL_VERSION + 1]))
        assert wrong_version != encode(good)
        for frame in (b"\x00garbage", wrong_version, b"\x81" + this_version, b"a", b"b"):
            push.send(frame)
        push.send_multipart([b"two", b"frames"])
        dealer.send(b"not msgpack at all")
        # valid traffic after the garbage: a bad group (wrong size) is refused, the good ones are stored and served
        sender = transport.sender(svc.pull.endpoint)
        sender.send(make_envelope(GroupsMsg(groups=[_group("bad", 0, 3), _group("b", 0, 2)]), sender="test"), 5.0)
        sender.send(good, 5.0)
        req = connect_with_handshake(transport, svc.router.endpoint, decoder=Decoder((BatchMsg,)), name="test",
                                     timeout_s=10.0)
        deadline = time.monotonic() + 20
        while len(svc.buffer) < 2:  # both good groups stored
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a forged request for a far-future version would durably drop every stored group as stale: refused
        forged = make_envelope(BatchRequest(n_groups=2, for_version=10**9, min_version=10**9 - 1), sender="x")
        assert req.request(forged, 5.0).body.groups == []
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_rejected_requests_total",
                                                     {"reason": "future_version"}) == 1
        assert len(svc.buffer) == 2
        batch = None
        while time.monotonic() < deadline:
            env = make_envelope(BatchRequest(n_groups=2, for_version=0, min_version=0), sender="test")
            batch = req.request(env, 5.0).body
            if batch.groups:
                break
            time.sleep(0.05)
        assert batch is not None and sorted(g.uid for g in batch.groups) == ["a", "b"]
        assert _reject_count(ctx, "malformed") == 6  # 4 undecodable frames, a 2-frame message, the router's one
        assert _reject_count(ctx, "wrong_version") == 1
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_rejected_groups_total",
                                                     {"reason": "group_size_mismatch"}) == 1
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_batches_total") == 1
        assert loop.is_alive()
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        own.close()
        transport.close()
        push.close()
        dealer.close()
        zctx.term()
    assert 0 < PROTOCOL_VERSION < 0x7F  # one msgpack byte: the wrong_version frame above patched exactly this value


# -- the cluster, end to end ---------------------------------------------------------------------------------------



# -- learner + replay services in process: checkpoints and --resume ----------------------------------------------

def _learner_cfg(tiny_cfg, total_steps: int):
    from conftest import TINY_TEST_OVERRIDES

    ports = free_ports(6)
    names = ["replay_port", "replay_batch_port", "weights_port", "acks_port", "verifier_port", "weights_fetch_port"]
    return load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                            f"train.total_steps={total_steps}", "train.checkpoint_every=1",
                            "cluster.replay.fsync=never",
                            "cluster.wire.batch_poll_s=0.05",
                            *(f"cluster.{k}={p}" for k, p in zip(names, ports, strict=True))])


def _run_learner_until_done(cfg, run_dir: Path, tok, resume: str | None = None):
    """Replay and learner services on real sockets; the test feeds the replay groups of the learner's version."""
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService

    rctx = make_context("replay", cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    replay = ReplayService(rctx, transport)
    lctx = make_context("learner", cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
    learner = LearnerService(lctx, transport, resume=resume)
    resumed_at = (learner.learner.version, learner.loop.start_step, learner.replay.cursor)
    threads = [threading.Thread(target=replay.run, daemon=True), threading.Thread(target=learner.run, daemon=True)]
    for t in threads:
        t.start()
    prompt = tok("1+2=").input_ids
    response = tok("1+2=3\\boxed{3}").input_ids[len(prompt):]
    n = 0
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "DONE").exists():
            assert time.monotonic() < deadline, "learner did not finish"
            assert all(t.is_alive() for t in threads)
            v = learner.learner.version
            if replay.buffer.num_admissible(v) < cfg.algo.prompts_per_step:
                rewards = [1.0 if i % 2 else -1.0 for i in range(cfg.algo.group_size)]
                samples = [Trajectory(response_ids=response, behavior_logprobs=[-1.0] * len(response),
                                      finish_reason="stop", reward=r, correct=r > 0,
                                      verdict="correct" if r > 0 else "incorrect") for r in rewards]
                replay.buffer.add(Group(uid=f"p{n}", prompt="1+2=", answer="3", prompt_ids=prompt, version=v,
                                        samples=samples))
                n += 1
            time.sleep(0.02)
    finally:
        lctx.stop.set()
        rctx.stop.set()
        for t in threads:
            t.join(30)
        learner.close()
        replay.close()
        transport.close()
    return resumed_at


@pytest.mark.slow
def test_learner_service_checkpoints_and_resumes(tiny_cfg, tiny_base, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    run_dir = tmp_path / "run"
    assert _run_learner_until_done(_learner_cfg(tiny_cfg, 2), run_dir, tok) == (0, 0, 0)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    (run_dir / "DONE").unlink()
    version, step, cursor = _run_learner_until_done(_learner_cfg(tiny_cfg, 3), run_dir, tok, resume="auto")
    pps = tiny_cfg.algo.prompts_per_step
    assert (version, step, cursor) == (2, 2, (2 + tiny_cfg.algo.value_pretrain_steps) * pps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["pretrain", "train", "train", "train"]  # no second value pretraining
    assert [(r["step"], r["version"]) for r in rows[1:]] == [(1, 1), (2, 2), (3, 3)]
    assert rows[-1]["replay/cursor"] == cursor + pps
    assert json.loads((run_dir / "summary.json").read_text())["version"] == 3


def _heldout_groups(tok, version: int, vocab: int | None = None) -> list[Group]:
    """Four graded groups of four responses to one sum, half of them right; ``vocab``: a token id outside the model's
    vocabulary in every response (a malformed set)."""
    prompt = tok("1+2=").input_ids
    right, wrong = tok("1+2=3\\boxed{3}").input_ids[len(prompt):], tok("1+2=4\\boxed{4}").input_ids[len(prompt):]
    groups = []
    for i in range(4):
        samples = []
        for j in range(4):
            ok = (i + j) % 2 == 0
            ids = list(right if ok else wrong) + ([vocab] if vocab is not None else [])
            samples.append(Trajectory(response_ids=ids, behavior_logprobs=[-1.0] * len(ids), finish_reason="stop",
                                      reward=1.0 if ok else -1.0, correct=ok, verdict="correct" if ok else "incorrect"))
        groups.append(Group(uid=f"h{i}", prompt="1+2=", answer="3", prompt_ids=prompt, version=version,
                            samples=samples))
    return groups


@pytest.mark.slow
def test_learner_scores_its_critic_on_the_heldout_responses_rollout_0_sends(tiny_cfg, tiny_base, tmp_path):
    """Budget: about 15 s (the tiny learner built, three sets scored). Over a real socket, as rollout 0 sends them
    after an evaluation: the learner assembles a set sent in parts, scores its critic on it (a ``critic_eval`` row with
    ``critic/heldout_*``), keeps it for value pretraining's stopping rule, counts a set it cannot score without losing
    the one it has, and drops a set whose last part never came."""
    from transformers import AutoTokenizer

    from async_vapo.services.learner import SCORE_CRITIC, LearnerService
    from async_vapo.transport import HeldoutResponses

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    cfg = _learner_cfg(tiny_cfg, 2)
    run_dir = tmp_path / "run"
    lctx = make_context("learner", cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    learner = LearnerService(lctx, transport)
    push = transport.sender(f"tcp://{cfg.cluster.hosts.learner_host}:{cfg.cluster.ports.acks_port}", peer="learner")

    def send(groups: list[Group], version: int, part: int = 0, parts: int = 1) -> None:
        push.send(make_envelope(HeldoutResponses(engine_id="rollout-0", version=version, groups=groups, part=part,
                                                 parts=parts), sender="rollout-0", policy_version=version), 5.0)

    def score() -> None:
        deadline = time.monotonic() + 10
        while (what := learner.idle(0.0, 0.1)) is None:
            assert time.monotonic() < deadline, "the learner did not receive the held-out responses"
        assert what == SCORE_CRITIC
        learner.control(what)

    def rows() -> list[dict]:
        return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def errors() -> float:
        return lctx.metrics.registry.get_sample_value(lctx.metrics.full_name("processing_errors_total"),
                                                      {"stage": "critic_eval"}) or 0.0

    try:
        assert learner._heldout_metrics() == {}  # nothing to judge pretraining on before the first set
        groups = _heldout_groups(tok, 0)
        send(groups[:3], 0, 0, 2)  # in two parts, as a set larger than half a frame travels
        send(groups[3:], 0, 1, 2)
        score()
        (row,) = rows()
        assert row["kind"] == "critic_eval" and row["step"] == 0 and row["version"] == learner.learner.version
        assert row["critic/heldout_responses"] == 16
        assert math.isfinite(row["critic/heldout_ev"]) and math.isfinite(row["critic/heldout_ev_prompt_mean"])
        gauge = lctx.metrics.registry.get_sample_value(lctx.metrics.full_name("critic_heldout_explained_variance"),
                                                       {"value_function": "critic"})
        assert gauge == pytest.approx(row["critic/heldout_ev"])  # on /metrics too
        kept = learner.heldout
        assert learner._heldout_metrics()["critic/heldout_ev"] == pytest.approx(row["critic/heldout_ev"])
        send(_heldout_groups(tok, 2, vocab=10**6), 2)  # no such token: the set cannot be scored
        score()
        assert errors() == 1 and len(rows()) == 1 and learner.heldout is kept
        send(_heldout_groups(tok, 4)[:2], 4, 0, 2)  # its second part never comes: a whole set replaces it
        send(_heldout_groups(tok, 6)[:1], 6)
        score()
        assert [(r["step"], r["critic/heldout_responses"]) for r in rows()[1:]] == [(6, 4)]
        assert learner.idle(0.0, 0.2) is None  # nothing left to score
    finally:
        learner.close()
        transport.close()


def test_verifier_service_counts_bad_frames_and_keeps_verifying(tmp_path):
    from async_vapo.services.verifier import VerifierService

    cfg = load_config([], ["verifier.num_workers=1", "cluster.wire.max_message_bytes=4096"])
    ctx = make_context("verifier", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    out = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), bind=True)
    svc = VerifierService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", out_endpoint=out.endpoint)
    loop = threading.Thread(target=svc.run, args=(lambda ids: "".join(map(chr, ids)),), daemon=True)  # ids = chars
    loop.start()
    try:
        sender = transport.sender(svc.pull.endpoint)
        for frame in (b"\xc1", b"x" * 5000):  # 0xc1 is never valid msgpack; 5000 bytes > max_message_bytes
            sender.send_frame(frame, 5.0)
        ok = [ord(c) for c in "1+1=2\\boxed{2}"]
        bad = [ord(c) for c in "\\boxed{3}"]
        group = Group(uid="u", prompt="1+1", answer="2", prompt_ids=[1], version=0,
                      samples=[Trajectory(response_ids=ids, behavior_logprobs=[0.0] * len(ids), finish_reason="stop")
                               for ids in (ok, bad)])
        sender.send(make_envelope(GroupsMsg(groups=[group]), sender="test"), 5.0)
        env = out.recv(60.0)
        assert env is not None, "no verified groups came out"
        assert [(s.correct, s.reward, s.verdict) for s in env.body.groups[0].samples] == [
            (True, 1.0, "correct"), (False, -1.0, "incorrect")]
        reg = ctx.metrics.registry
        assert reg.get_sample_value("async_vapo_verifier_wire_rejects_total", {"reason": "malformed"}) == 1
        assert reg.get_sample_value("async_vapo_verifier_wire_rejects_total", {"reason": "oversized"}) == 1
        assert reg.get_sample_value("async_vapo_verifier_checks_total", {"reason": "correct"}) == 1
        assert loop.is_alive()
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()


def test_verifier_service_holds_each_message_to_its_budget(tmp_path):
    from async_vapo.services.verifier import VerifierService
    from async_vapo.verify import VerifierPool

    cfg = load_config([], ["verifier.num_workers=1", "verifier.timeout_s=0.5", "verifier.message_budget_s=1.0"])
    ctx = make_context("verifier", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    out = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), bind=True)
    # A per-check deadline far past the budget: only the service's per-message budget can end these hangs.
    pool = VerifierPool(num_workers=1, timeout_s=30.0, _test_hooks=True)
    svc = VerifierService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", out_endpoint=out.endpoint, pool=pool)
    loop = threading.Thread(target=svc.run, args=(lambda ids: "".join(map(chr, ids)),), daemon=True)
    loop.start()
    try:
        texts = ["1+1=2\\boxed{2}"] + ["__hang_hard__"] * 4
        group = Group(uid="u", prompt="1+1", answer="2", prompt_ids=[1], version=0,
                      samples=[Trajectory(response_ids=[ord(c) for c in t], behavior_logprobs=[0.0] * len(t),
                                          finish_reason="stop") for t in texts])
        sender = transport.sender(svc.pull.endpoint)
        t0 = time.monotonic()
        sender.send(make_envelope(GroupsMsg(groups=[group]), sender="test"), 5.0)
        env = out.recv(20.0)
        elapsed = time.monotonic() - t0
        assert env is not None, "no verified groups came out"
        print(f"message with 4 hanging responses verified in {elapsed:.2f}s")
        assert elapsed < 3.0
        assert [s.verdict for s in env.body.groups[0].samples] == ["correct"] + ["over_budget"] * 4
        assert [s.reward for s in env.body.groups[0].samples] == [1.0] + [-1.0] * 4
        reg = ctx.metrics.registry
        assert reg.get_sample_value("async_vapo_verifier_checks_total", {"reason": "over_budget"}) == 4
        assert ctx.metrics.health()["sandbox"] == pool.isolation
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()
