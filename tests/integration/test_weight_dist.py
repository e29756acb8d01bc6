"""Versions over torch.distributed (gloo) into the real vLLM engine through vLLM's weight-transfer API
(``async_vapo.weights.dist``): the engine joins its group and serves each version exactly; an engine that never
answers, or dies mid-broadcast, costs the learner its deadline at most, and a rejoining engine gets a new group."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from conftest import assert_engine_serves

from async_vapo.weights.dist import (
    EngineGroup,
    EngineSyncFailed,
    EngineSyncTimeout,
    plan_buckets,
    update_info,
    version_meta,
)


def test_buckets_are_bounded_and_keep_order():
    meta = [("a", torch.float32, (10,)), ("b", torch.bfloat16, (3, 4)), ("big", torch.float32, (100,)),
            ("c", torch.float32, (2,))]
    bs = plan_buckets(meta, 64)
    # a 40 B + b 24 B = 64 B fill one bucket; big (400 B) alone; c 8 B
    assert [b.names for b in bs] == [["a", "b"], ["big"], ["c"]]
    assert [b.nbytes for b in bs] == [64, 400, 8]
    assert bs[0].dtype_names == ["float32", "bfloat16"] and bs[0].shapes == [[10], [3, 4]]


def _push(group, engine, named, version, bucket_bytes):
    buckets = plan_buckets(version_meta(named), bucket_bytes)
    sent: dict = {}

    def send():
        try:
            sent["s"] = group.send(buckets, named)
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            sent["error"] = e

    th = threading.Thread(target=send)
    th.start()
    engine.receive_weights_dist(update_info(buckets, version), version)
    th.join()
    assert "error" not in sent, sent
    return len(buckets)


def _join(engine, group):
    th = threading.Thread(target=group.connect)
    th.start()
    engine.join_weight_group(group.init_info)
    th.join()
    assert group.group is not None


def test_engine_serves_each_version_received_over_its_group(vllm_engine, tiny_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    policy = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    group = EngineGroup("rollout-0", timeout_s=30)
    _join(vllm_engine, group)
    try:
        torch.manual_seed(0)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            n = _push(group, vllm_engine, list(policy.state_dict().items()), version, bucket_bytes=32 << 10)
            assert n > 3  # several bounded buckets, not one
            assert vllm_engine.version == version
            assert_engine_serves(vllm_engine, policy, tok)
        # the engine leaves (its group torn down) and rejoins: a new group, a new store, and the next version
        group.close()
        group = EngineGroup("rollout-0", timeout_s=30)
        _join(vllm_engine, group)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        _push(group, vllm_engine, list(policy.state_dict().items()), 4, bucket_bytes=1 << 20)
        assert_engine_serves(vllm_engine, policy, tok)
    finally:
        # the session's engine goes back to the base weights for the tests after this one
        policy.load_state_dict(base)
        _push(group, vllm_engine, list(policy.state_dict().items()), 0, bucket_bytes=1 << 20)
        group.close()
        assert_engine_serves(vllm_engine, policy, tok)


def test_sync_to_an_engine_that_never_answers_times_out():
    group = EngineGroup("ghost", timeout_s=2)  # the engine never joins
    named = [("w", torch.ones(1000))]
    t0 = time.monotonic()
    with pytest.raises(EngineSyncTimeout, match="ghost did not join its group within 2 s"):
        group.send(plan_buckets(version_meta(named), 1 << 20), named)
    assert time.monotonic() - t0 < 10
    assert group.closed and group.store is None
    with pytest.raises(RuntimeError, match="torn down"):
        group.connect()


FAKE_ENGINE = textwrap.dedent("""
    import os, sys, datetime, torch, torch.distributed as dist
    addr, prefix = sys.argv[1], sys.argv[3]
    port, die_after, nbytes = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
    t = datetime.timedelta(seconds=20)
    print("ready", flush=True)  # imports done: joins at once
    store = dist.TCPStore(addr, port, 2, is_master=False, timeout=t)
    g = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, t)
    got = []
    for i in range(10**6):
        if i == die_after:
            os._exit(9)  # dies mid-broadcast, without a word
        buf = torch.empty(nbytes, dtype=torch.uint8)
        g.broadcast(buf, 0).wait()
        got.append(buf)
        if sum(b.numel() for b in got) >= int(sys.argv[6]):
            break
    print(torch.cat(got).view(torch.float32).sum().item(), flush=True)
""")


def _fake_engine(group: EngineGroup, die_after: int, bucket_bytes: int, total: int) -> subprocess.Popen:
    i = group.init_info
    proc = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, i["master_addr"], str(i["master_port"]), i["prefix"],
                             str(die_after), str(bucket_bytes), str(total)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_engine_dead_mid_broadcast_is_dropped_and_rejoins_with_a_new_group():
    named = [(f"w{i}", torch.full((256,), float(i))) for i in range(8)]  # 8 buckets of 1 KiB
    buckets = plan_buckets(version_meta(named), 1024)
    total = sum(b.nbytes for b in buckets)
    group = EngineGroup("rollout-1", timeout_s=5)
    proc = _fake_engine(group, die_after=3, bucket_bytes=1024, total=total)
    try:
        t0 = time.monotonic()
        with pytest.raises((EngineSyncFailed, EngineSyncTimeout), match="rollout-1"):
            group.send(buckets, named, deadline=time.monotonic() + 5)
        assert time.monotonic() - t0 < 15  # within the group's timeout (plus the join), never a hang
        assert proc.wait(timeout=10) == 9 and group.closed
    finally:
        proc.kill()

    again = EngineGroup("rollout-1", timeout_s=5)
    assert again.init_info["prefix"] != group.init_info["prefix"]
    proc = _fake_engine(again, die_after=-1, bucket_bytes=1024, total=total)
    try:
        again.send(buckets, named, deadline=time.monotonic() + 10)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert float(out) == sum(float(i) * 256 for i in range(8))
    again.close()


SILENT_ENGINE = textwrap.dedent("""
    import sys, time, datetime, torch.distributed as dist
    addr, port, world, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    t = datetime.timedelta(seconds=30)
    store = dist.TCPStore(addr, port, world, is_master=False, timeout=t)
    g = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, world, t)
    print("joined", flush=True)
    time.sleep(120)  # in the group, never receiving: a wedged engine
""")


def test_learner_publish_goes_on_past_an_engine_that_stops_answering(tmp_path):
    """The learner's WeightBroadcast in "dist": an engine asks for a group, joins it, then never receives. The
    publish of the next version returns within cluster.weights.dist_timeout_s, drops that engine's group and counts
    the failure; the version after is announced to no group and costs nothing."""
    from async_vapo.cluster.common import make_context
    from async_vapo.config import load_config
    from async_vapo.transport import (
        Heartbeat,
        InprocTransport,
        WeightsAnnounce,
        WeightsGroupJoin,
        WeightsGroupOffer,
        make_envelope,
    )
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights import WeightBroadcast

    cfg = load_config([], ["cluster.weights.transfer=dist", "cluster.weights.dist_timeout_s=3",
                           "cluster.weights.dist_join_timeout_s=60",
                           f"cluster.weights.dir={tmp_path / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
    transport = InprocTransport()
    wb = WeightBroadcast(ctx, transport, pub_endpoint="weights", acks_endpoint="acks")
    acks = transport.sender("acks")
    sub = transport.subscriber("weights", decoder=Decoder((WeightsAnnounce, WeightsGroupOffer, Heartbeat)))
    proc = None
    try:
        acks.send(make_envelope(WeightsGroupJoin(engine_id="rollout-0"), sender="rollout-0"), 5)
        wb.poll(1.0)
        env = sub.recv(5)
        assert isinstance(env.body, WeightsGroupOffer) and env.body.engine_id == "rollout-0"
        o = env.body
        proc = subprocess.Popen([sys.executable, "-c", SILENT_ENGINE, o.master_addr, str(o.master_port),
                                 str(o.world_size), o.prefix], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "joined\n"
        deadline = time.monotonic() + 10
        while wb.groups["rollout-0"].group is None:
            assert time.monotonic() < deadline, "the learner's side of the group did not form"
            time.sleep(0.05)

        state = {"w": torch.randn(16 << 20 // 4 * 2)}  # 32 MB: more than socket buffers hold
        t0 = time.monotonic()
        wb.publish(1, state)
        took = time.monotonic() - t0
        assert wb.latest.dist_engines == ["rollout-0"]
        assert took < 3 + 5, took  # the deadline, plus the slot write
        assert "rollout-0" not in wb.groups and wb.dist_failures._value.get() == 1

        t0 = time.monotonic()
        wb.publish(2, state)
        assert wb.latest.dist_engines == [] and time.monotonic() - t0 < 3
    finally:
        if proc is not None:
            proc.kill()
        wb.close()
        transport.close()
        ctx.close()


def test_auto_times_an_engine_on_another_host_over_its_group_and_drops_a_slower_group(tmp_path, caplog):
    """The learner's WeightBroadcast in "auto", engines played by acks: one on the learner's host (its slot) is
    offered no group; one on another host fetches, asks for a group, gets it, is streamed versions over it only
    once its fetch is timed, and, its group slower here (the acks say so), keeps the fetch: its group is torn
    down and it is streamed nothing more. The gauge and the log say which way each engine takes."""
    import logging
    import queue

    import torch.distributed as dist

    from async_vapo.cluster.common import make_context
    from async_vapo.config import load_config
    from async_vapo.transport import (
        Heartbeat,
        InprocTransport,
        WeightsAck,
        WeightsAnnounce,
        WeightsGroupJoin,
        WeightsGroupOffer,
        make_envelope,
    )
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights import WeightBroadcast

    cfg = load_config([], ["cluster.weights.transfer=auto", "cluster.weights.auto_trials=1",
                           "cluster.weights.dist_timeout_s=20", f"cluster.weights.dir={tmp_path / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
    transport = InprocTransport()
    wb = WeightBroadcast(ctx, transport, pub_endpoint="weights", acks_endpoint="acks", device="cpu")
    acks = transport.sender("acks")
    sub = transport.subscriber("weights", decoder=Decoder((WeightsAnnounce, WeightsGroupOffer, Heartbeat)))
    state = {"w": torch.arange(1000.0)}
    got: queue.Queue = queue.Queue()

    def send(body, sender):
        acks.send(make_envelope(body, sender=sender), 5)

    def ack(engine, version, via, seconds):
        send(WeightsAck(engine_id=engine, version=version, ok=True, load_seconds=seconds, via=via), engine)
        wb.poll(0.5)

    def offers():
        out = []
        while (env := sub.recv(0.2)) is not None:
            if isinstance(env.body, WeightsGroupOffer):
                out.append(env.body)
        return out

    def engine(o, versions):  # rollout-1's end of its gloo group: joins, then receives `versions` versions
        t = __import__("datetime").timedelta(seconds=20)
        store = dist.TCPStore(o.master_addr, o.master_port, o.world_size, is_master=False, timeout=t)
        g = dist.ProcessGroupGloo(dist.PrefixStore(o.prefix, store), 1, o.world_size, t)
        for _ in range(versions):
            buf = torch.empty(4000, dtype=torch.uint8)
            g.broadcast(buf, 0).wait()
            got.put(buf.view(torch.float32).sum().item())

    caplog.set_level(logging.INFO)
    th = None
    try:
        wb.publish(1, state)
        ack("rollout-0", 1, "shm", 0.01)
        send(WeightsGroupJoin(engine_id="rollout-0"), "rollout-0")  # asks, although on the learner's host
        wb.poll(0.5)
        assert offers() == [] and "rollout-0" not in wb.groups
        ack("rollout-1", 1, "zmq", 0.5)  # another host: fetched (the warm-up), then asks for a group
        send(WeightsGroupJoin(engine_id="rollout-1"), "rollout-1")
        wb.poll(0.5)
        [o] = offers()
        assert (o.engine_id, o.backend) == ("rollout-1", "gloo")
        th = threading.Thread(target=engine, args=(o, 2), daemon=True)
        th.start()
        deadline = time.monotonic() + 10
        while wb.groups["rollout-1"].group is None:
            assert time.monotonic() < deadline, "the learner's side of the group did not form"
            time.sleep(0.05)
        wb.publish(2, state)
        assert wb.latest.dist_engines == []  # its fetch is timed first
        ack("rollout-1", 2, "zmq", 0.05)
        for v, seconds in ((3, 0.01), (4, 0.5)):  # the group's warm-up, then a timed load slower than the fetch
            wb.publish(v, state)
            assert wb.latest.dist_engines == ["rollout-1"] and got.get(timeout=10) == sum(range(1000))
            ack("rollout-1", v, "dist", seconds)
        assert wb.chooser.way("rollout-1") == "zmq" and "rollout-1" not in wb.groups  # torn down
        wb.publish(5, state)
        assert wb.latest.dist_engines == []
        ways = {w: wb.by_way.labels(way=w)._value.get() for w in ("shm", "zmq", "dist", "file")}
        assert ways == {"shm": 1, "zmq": 1, "dist": 0, "file": 0}
        text = caplog.text
        assert "rollout-0 takes its weights by shm (on the learner's host" in text
        assert "rollout-1 takes its weights by zmq (on another host; trying the fetch, then its group" in text
        assert "rollout-1 takes its weights by zmq from now on (median of 1 timed loads each: dist 0.500 s" in text
    finally:
        if th is not None:
            th.join(10)
        wb.close()
        transport.close()
        ctx.close()


def test_auto_on_the_real_engine_maps_the_slot_here_and_times_fetch_against_group_elsewhere(
        vllm_engine, tiny_cfg, tiny_base, tmp_path, monkeypatch, caplog):
    """The rollout service's and the learner's "auto" around the session's real engine: as rollout-0 on the
    learner's host it maps the slot and never asks for a group; as rollout-1 "on another host" (the slot made
    unreadable) it fetches, asks for a gloo group, joins it through vLLM, is timed over it, and then takes every
    version by the way measured faster. It serves each version exactly; the metrics and logs say the ways."""
    import logging

    from conftest import TINY_TEST_OVERRIDES, free_ports
    from transformers import AutoTokenizer

    import async_vapo.cluster.rollout_service as rs
    import async_vapo.weights.receive as receive
    from async_vapo.cluster.common import make_context
    from async_vapo.cluster.rollout_service import RolloutService
    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport
    from async_vapo.weights import WeightBroadcast

    ports = free_ports(3)
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           "cluster.weights.transfer=auto", "cluster.weights.auto_trials=1",
                           "cluster.weights.dist_timeout_s=60", f"cluster.weights.dir={tmp_path / 'w'}",
                           f"cluster.ports.weights_port={ports[0]}", f"cluster.ports.acks_port={ports[1]}",
                           f"cluster.ports.weights_fetch_port={ports[2]}"])
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    ctxs = [make_context(s, cfg=cfg, run_dir=tmp_path / "run", instance=i, serve_metrics=False,
                         install_signals=False) for s, i in (("learner", 0), ("rollout", 0), ("rollout", 1))]
    wb = WeightBroadcast(ctxs[0], transport, device="cpu")
    caplog.set_level(logging.INFO)
    torch.manual_seed(5)
    version = 0

    def push(rollout) -> str:
        """One version: the learner publishes (and streams, in a thread: it waits for the engine), the rollout
        loads it between two "generate calls"; returns the way it came."""
        nonlocal version
        version += 1
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        th = threading.Thread(target=wb.publish, args=(version, policy.state_dict()))
        th.start()
        deadline = time.monotonic() + 60
        while vllm_engine.version != version or th.is_alive():
            assert time.monotonic() < deadline, f"version {version} did not reach {rollout.engine_id}"
            rollout.poll_weights(0.05)
        wb.poll(0.2)
        rollout.poll_weights(0.2)  # a group offer, if one came
        wb.poll(0.2)
        assert_engine_serves(vllm_engine, policy, tok)
        return max(("dist", "shm", "zmq"), key=lambda w: rollout.m_way.labels(way=w)._value.get())

    here = elsewhere = None
    try:
        here = RolloutService(ctxs[1], transport, vllm_engine, tok, train_set, eval_set, pretrain_batches=0)
        assert [push(here), push(here)] == ["shm", "shm"]
        assert not here.remote and not here.in_group and "rollout-0" not in wb.groups
        assert wb.chooser.way("rollout-0") == "shm"

        monkeypatch.setattr(rs, "slot_readable", lambda *a: False)  # rollout-1 is "on another host"
        monkeypatch.setattr(receive, "slot_holds", lambda *a: False)
        elsewhere = RolloutService(ctxs[2], transport, vllm_engine, tok, train_set, eval_set, pretrain_batches=0)
        ways = [push(elsewhere) for _ in range(4)]
        # fetch (warm-up), fetch (timed; its group joined meanwhile), group (warm-up), group (timed)
        assert ways == ["zmq", "zmq", "dist", "dist"], ways
        assert elsewhere.remote and elsewhere.in_group
        chosen = wb.chooser.way("rollout-1")
        e = wb.chooser.engines["rollout-1"]
        assert chosen == ("dist" if e.costs["dist"][0] < e.costs["zmq"][0] else "zmq"), e
        assert [push(elsewhere), push(elsewhere)] == [chosen, chosen]  # kept
        assert ("rollout-1" in wb.groups) == (chosen == "dist")
        assert {w: wb.by_way.labels(way=w)._value.get() for w in ("shm", chosen)} == {"shm": 1, chosen: 1}
        text = caplog.text
        assert "rollout-0: serving version 1 via shm" in text and "rollout-1: serving version 6 via dist" in text
        assert "rollout-1: in its gloo weight group" in text
        assert f"learner: rollout-1 takes its weights by {chosen} from now on (median of 1 timed loads each" in text
    finally:
        wb.close()
        for svc in (here, elsewhere):
            if svc is not None:
                svc.close()
        transport.close()
        for ctx in ctxs:
            ctx.close()
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
