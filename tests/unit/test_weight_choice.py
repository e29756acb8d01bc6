"""``cluster.weights.transfer = "auto"`` chooses each engine's way (``async_vapo.weights.choose``), and the
torch.distributed path picks gloo or NCCL by device (``async_vapo.weights.collective``): the bookkeeping, the backend
rules and the config errors, on the CPU. The real engine and real groups are in
tests/integration/test_weight_dist.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from async_vapo.metrics.catalogue import WEIGHT_WAYS
from async_vapo.weights.choose import MAX_DIST_FAILURES, RECORDED, WAYS, WayChooser
from async_vapo.weights.collective import (
    EngineGroup,
    check_learner_backend,
    engine_backend,
    engine_init_info,
    group_backend,
    plan_buckets,
    update_info,
)


def test_an_engine_on_the_learners_host_keeps_the_slot_and_is_offered_no_group():
    c = WayChooser(auto=True, trials=2)
    assert c.loaded("r0", "shm", 1, 0.05) == "takes its weights by shm (on the learner's host: it maps the slot)"
    assert c.way("r0") == "shm" and not c.stream("r0") and not c.group_asked("r0")
    assert c.loaded("r0", "shm", 2, 0.05) is None
    assert c.counts() == {"shm": 1, "dist": 0, "zmq": 0, "file": 0, "adapter": 0, "adapter_zmq": 0}


@pytest.mark.parametrize(("zmq_s", "dist_s", "chosen"), [(0.17, 0.12, "dist"), (0.10, 0.30, "zmq")])
def test_an_engine_on_another_host_times_the_fetch_then_its_group_and_keeps_the_faster(zmq_s, dist_s, chosen):
    c = WayChooser(auto=True, trials=2)
    assert c.loaded("r1", "zmq", 1, 5.0).startswith("takes its weights by zmq (on another host; trying")
    assert c.group_asked("r1")
    assert not c.stream("r1")  # the fetch is timed first: 1 warm-up + 2 timed loads
    c.loaded("r1", "zmq", 2, zmq_s)
    assert not c.stream("r1")
    c.loaded("r1", "zmq", 3, zmq_s)
    assert c.stream("r1")  # now the group
    for v in (4, 5):
        c.sent("r1", v, 0.01)
        assert c.loaded("r1", "dist", v, 9.0 if v == 4 else dist_s) is None  # 4 is the group's warm-up
    c.sent("r1", 6, 0.01)
    line = c.loaded("r1", "dist", 6, dist_s)
    assert line.startswith(f"takes its weights by {chosen} from now on (median of 2 timed loads each: "
                           f"dist {dist_s:.3f} s (the learner's wait included), zmq {zmq_s:.3f} s")
    assert c.way("r1") == chosen and c.stream("r1") == (chosen == "dist")
    assert c.group_asked("r1") == (chosen == "dist")  # no new group once the fetch is final
    assert c.counts()[chosen] == 1


def test_the_learners_wait_counts_against_the_group():
    """The engine loads fast, but the learner waited a long generate call for it to receive: the fetch wins."""
    c = WayChooser(auto=True, trials=1)
    for v, s in ((1, 1.0), (2, 0.2)):
        c.loaded("r1", "zmq", v, s)
    c.group_asked("r1")
    for v in (3, 4):
        c.sent("r1", v, 2.5)  # the learner's send, its wait for the engine included
        c.loaded("r1", "dist", v, 0.05)
    assert c.way("r1") == "zmq" and "dist 2.500 s" in c.engines["r1"].reason


def test_no_timing_follows_the_recorded_order():
    assert RECORDED["30m"]["shm"] < RECORDED["30m"]["dist"] < RECORDED["30m"]["zmq"]
    c = WayChooser(auto=True, trials=0)
    assert "its group once it has one" in c.loaded("r1", "zmq", 1, 0.2)
    assert c.stream("r1")
    assert c.loaded("r1", "dist", 2, 0.1).startswith("takes its weights by dist from now on")


def test_a_group_that_keeps_failing_leaves_the_fetch():
    c = WayChooser(auto=True, trials=0)
    c.loaded("r1", "zmq", 1, 0.2)
    for _ in range(MAX_DIST_FAILURES - 1):
        assert c.failed("r1") is None and c.stream("r1")
    assert c.failed("r1") == f"takes its weights by zmq from now on: its group failed {MAX_DIST_FAILURES} times"
    assert not c.stream("r1") and not c.group_asked("r1")


def test_a_learner_that_cannot_match_the_engines_backend_leaves_it_the_fetch():
    c = WayChooser(auto=True, trials=2)
    c.loaded("r1", "zmq", 1, 0.2)
    assert c.no_group("r1", "NCCL on a CPU learner") == "takes its weights by zmq (no group: NCCL on a CPU learner)"
    assert not c.stream("r1")


def test_other_transfers_are_only_reported():
    c = WayChooser(auto=False)
    assert c.group_asked("r1") and c.stream("r1")  # "dist": every engine that asks gets a group and its stream
    assert c.loaded("r1", "shm", 1, 0.1) == "takes its weights by shm (cluster.weights.transfer)"  # not joined yet
    assert c.loaded("r1", "dist", 2, 0.1) == "takes its weights by dist (cluster.weights.transfer)"
    assert c.loaded("r1", "dist", 3, 0.1) is None and c.way("r1") == "dist"
    assert c.loaded("r1", "", 4, 0.1) is None  # an ack without its way (a failed load)


@pytest.mark.parametrize("auto", [True, False])
def test_a_lora_engines_adapter_ways_are_reported_and_counted(auto):
    """model.lora: a version is its adapter, read where it lies or fetched, whatever transfer is; the gauges
    (engines_by_weight_way, weight_way) have a series for each way from the first scrape."""
    c = WayChooser(auto=auto)
    assert c.loaded("r1", "adapter", 1, 0.01) == "takes its weights by adapter (model.lora: each version its adapter)"
    assert c.loaded("r2", "adapter_zmq", 1, 0.1) == ("takes its weights by adapter_zmq (model.lora: each version its "
                                                     "adapter)")
    assert c.loaded("r1", "adapter", 2, 0.01) is None and c.way("r2") == "adapter_zmq"
    assert c.counts() == {"shm": 0, "dist": 0, "zmq": 0, "file": 0, "adapter": 1, "adapter_zmq": 1}
    assert not c.stream("r2") or not auto  # nothing to choose: never a group under "auto"
    assert set(WEIGHT_WAYS) == set(WAYS)


# -- gloo or NCCL ----------------------------------------------------------------------------------------------------

def test_the_backend_follows_the_devices():
    assert engine_backend("auto", cuda=False) == "gloo" and engine_backend("auto", cuda=True) == "nccl"
    assert engine_backend("gloo", cuda=True) == "gloo" and engine_backend("nccl", cuda=True) == "nccl"
    with pytest.raises(ValueError, match='"nccl" needs the engine on a CUDA device'):
        engine_backend("nccl", cuda=False)
    with pytest.raises(ValueError, match="unknown"):
        engine_backend("mpi", cuda=True)
    assert group_backend("gloo", "cpu") == "gloo" and group_backend("gloo", "cuda") == "gloo"  # gloo stays gloo
    assert group_backend("nccl", "cuda") == "nccl"
    with pytest.raises(ValueError, match="over NCCL and the learner is on cpu"):
        group_backend("nccl", "cpu")
    check_learner_backend("auto", "cpu")
    check_learner_backend("nccl", "cuda")
    with pytest.raises(ValueError, match='"nccl" needs the learner on a CUDA device; it is on cpu'):
        check_learner_backend("nccl", "cpu")


def test_config_names_the_backend_and_the_trials():
    from async_vapo.config import load_config
    from async_vapo.config.loader import ConfigError

    w = load_config([], []).cluster.weights
    assert (w.transfer, w.dist_backend, w.auto_trials) == ("auto", "auto", 2)
    with pytest.raises(ConfigError, match="dist_backend: Input should be 'auto', 'gloo' or 'nccl'"):
        load_config([], ["cluster.weights.dist_backend=mpi"])
    with pytest.raises(ConfigError, match="auto_trials"):
        load_config([], ["cluster.weights.auto_trials=-1"])


def test_a_cpu_learner_refuses_nccl_at_start(tmp_path):
    from async_vapo.config import load_config
    from async_vapo.services.context import make_context
    from async_vapo.transport import InprocTransport
    from async_vapo.weights import WeightBroadcast

    cfg = load_config([], ["cluster.weights.dist_backend=nccl", f"cluster.weights.dir={tmp_path / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
    try:
        with pytest.raises(ValueError, match='"nccl" needs the learner on a CUDA device'):
            WeightBroadcast(ctx, InprocTransport(), pub_endpoint="w", acks_endpoint="a", device="cpu")
    finally:
        ctx.close()


def test_each_backend_gets_its_own_init_and_update_info():
    meta = [("a", torch.float32, (10,)), ("b", torch.bfloat16, (3, 4)), ("c", torch.float32, (100,))]
    buckets = plan_buckets(meta, 64)
    assert update_info(buckets, 7) == {"buckets": [b.__dict__ for b in buckets], "version": 7}
    assert update_info(buckets, 7, "nccl") == {"names": ["a", "b", "c"], "dtype_names": ["float32", "bfloat16",
                                                                                        "float32"],
                                               "shapes": [[10], [3, 4], [100]]}
    offer = {"master_addr": "10.0.0.1", "master_port": 4100, "world_size": 3, "prefix": "r1/ab", "timeout_s": 30.0}
    assert engine_init_info(offer, "gloo", 1 << 20) == offer
    nccl = engine_init_info(offer, "nccl", 1 << 20)
    assert nccl == {"master_address": "10.0.0.1", "master_port": 4100, "world_size": 3, "rank_offset": 1,
                    "packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2, "timeout_s": 30.0}
    with pytest.raises(ValueError):
        engine_init_info(offer, "mpi", 1)


def _nccl_engine():
    """vLLM's NCCL engine with our watchdog, built on the CPU around a stand-in config (no communicator)."""
    from async_vapo.weights.collective import NcclWeightTransferEngine

    cfg = SimpleNamespace(parallel_config=SimpleNamespace(rank=0, data_parallel_index=0, world_size=1),
                          model_config=None)
    return NcclWeightTransferEngine(None, cfg, torch.device("cpu"), torch.nn.Linear(2, 2))


def test_the_nccl_engine_takes_our_init_info_and_aborts_a_receive_past_its_limit(monkeypatch):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from async_vapo.weights.collective import NCCL_BACKEND, register

    register()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    assert NCCL_BACKEND in WeightTransferEngineFactory._registry
    eng = _nccl_engine()
    offer = {"master_addr": "10.0.0.1", "master_port": 4100, "world_size": 2, "prefix": "", "timeout_s": 0.3}
    info = eng.parse_init_info(engine_init_info(offer, "nccl", 4096))
    assert (info.master_address, info.rank_offset, info.packed, info.timeout_s) == ("10.0.0.1", 1, True, 0.3)
    upd = eng.parse_update_info(update_info(plan_buckets([("w", torch.float32, (4,))], 4096), 1, "nccl"))
    with pytest.raises(RuntimeError, match="not initialized"):
        eng.receive_weights(upd)  # no group joined

    aborted = []

    class Group:
        def destroy(self):
            aborted.append(time.monotonic())

    def hang(self, update_info):  # a learner that died mid-broadcast: the receive never returns by itself
        while not aborted:
            time.sleep(0.01)

    monkeypatch.setattr(NCCLWeightTransferEngine, "receive_weights", hang)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda: None)
    eng.model_update_group, eng.timeout_s = Group(), 0.3
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="NCCL receive ran past 0.3 s"):
        eng.receive_weights(upd)
    assert 0.25 < aborted[0] - t0 < 5 and eng.model_update_group is None  # the group is gone: it rejoins


def test_an_nccl_group_holds_its_port_from_the_offer_and_frees_it_on_close():
    import socket

    g = EngineGroup("r1", backend="nccl", device="cpu", bucket_bytes=1 << 20)
    port = g.init_info["master_port"]
    s = socket.socket()
    with pytest.raises(OSError):
        s.bind(("127.0.0.1", port))  # held: nobody else takes it before the engine joins
    s.close()
    g.close()
    assert g.closed and g._listen is None
    with pytest.raises(ValueError, match="unknown weight-transfer backend"):
        EngineGroup("r1", backend="mpi")
