"""The ranks of tests/integration/test_sharded_publish.py, launched by torchrun (gloo, 2 CPU ranks): the learner
service of a sharded policy (``LearnerService``, ``cluster.weights.transfer = "dist"``) publishing its versions
with its own hooks (``publish_all``, also as the step loop's ``publish_collective``, and ``publish_again`` through
its ``BroadcastSource``) through its ``WeightBroadcast``. Rank 0 also plays two engines on its in-process
transport:

* ``rollout-0``, a weight group's engine end (a thread: it asks for a group, joins the gloo group offered, and for
  each announce that names it receives the buckets that the announce's layout plans, as the rollout service's
  receive does, then acks);
* ``rollout-1``, an engine with no group, which loads the slot or fetches (its acks sent from the main thread).

Versions: 0 (no engine known yet: whole, to the slot); 1 and 2 (every engine streamed: no slot); 3 and 4, made by two
updates of the step loop, which publishes each on every rank (streamed); 4 again (rollout-1 could not load it: rank 0's
idle work answers REPUBLISH while its replay source waits and every rank publishes it whole); 5 (rollout-1 known and not
streamed: whole, and rollout-0 streamed from it). Every rank takes ``Learner.policy_state`` (the whole-model path) for
comparison before each publish and after the loop. Rank 0 saves what the engines got, the references and the loop's rows
to ``OUT/published.pt``; every rank its publish figures to ``OUT/figures.<rank>``.

    torchrun --nproc_per_node 2 tests/integration/publish_worker.py CACHE_DIR OUT_DIR FETCH_PORT
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import ListSource, cfg_for  # noqa: E402

BUCKET_BYTES = 4096
EXTRA = ["model.dtype=bfloat16", "algo.name=grpo", "cluster.weights.transfer=dist",
         f"cluster.weights.dist_bucket_bytes={BUCKET_BYTES}", "cluster.weights.dist_timeout_s=30",
         "cluster.weights.dist_join_timeout_s=30", "cluster.wire.batch_request_timeout_s=1",
         "cluster.hosts.bind_host=127.0.0.1", "cluster.hosts.learner_host=127.0.0.1"]
LOOP = ["algo.dynamic_sampling=true", "train.total_steps=2", "train.checkpoint_every=0"]


def bump(learner, k: int) -> None:
    """Version ``k``, as an update makes it: every rank moves its own shards (the same on every rank)."""
    with torch.no_grad():
        for p in learner.policy.parameters():
            p.add_(0.01 * k)
    learner.version = k


def group_engine(transport, ctx, engine_id: str, got: queue.Queue, versions: int) -> None:
    """``engine_id``'s end of its weight group (see the module docstring); puts ``(announce, state)`` per version
    received, or the exception that stopped it."""
    import torch.distributed as dist

    from async_vapo.transport import (
        Heartbeat,
        WeightsAck,
        WeightsAnnounce,
        WeightsGroupJoin,
        WeightsGroupOffer,
        make_envelope,
    )
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights.collective import _views, plan_buckets

    c = ctx.cfg.cluster
    sub = transport.subscriber(ctx.endpoint(c.hosts.learner_host, c.ports.weights_port),
                               decoder=Decoder((WeightsAnnounce, WeightsGroupOffer, Heartbeat)))
    acks = transport.sender(ctx.endpoint(c.hosts.learner_host, c.ports.acks_port))
    try:
        acks.send(make_envelope(WeightsGroupJoin(engine_id=engine_id), sender=engine_id), 5)
        offer = None
        while offer is None:
            env = sub.recv(30)
            assert env is not None, "no group offer"
            if isinstance(env.body, WeightsGroupOffer) and env.body.engine_id == engine_id:
                offer = env.body
        t = datetime.timedelta(seconds=30)
        store = dist.TCPStore(offer.master_addr, offer.master_port, offer.world_size, is_master=False, timeout=t)
        group = dist.ProcessGroupGloo(dist.PrefixStore(offer.prefix, store), 1, offer.world_size, t)
        for _ in range(versions):
            a = None
            while a is None:
                env = sub.recv(60)
                assert env is not None, "no announce"
                if isinstance(env.body, WeightsAnnounce) and engine_id in env.body.dist_engines:
                    a = env.body
            buckets = plan_buckets([(n, getattr(torch, d), tuple(sh)) for n, d, sh, _ in a.layout],
                                   a.dist_bucket_bytes)
            state = {}
            t0 = time.perf_counter()
            for b in buckets:
                flat = torch.empty(b.nbytes, dtype=torch.uint8)
                group.broadcast(flat, 0).wait()
                state.update(_views(flat, b))
            acks.send(make_envelope(WeightsAck(engine_id=engine_id, version=a.version, ok=True, via="dist",
                                               load_seconds=time.perf_counter() - t0), sender=engine_id), 5)
            got.put((a, state))
    except BaseException as e:  # noqa: BLE001 - reported to the main thread
        got.put(e)


def from_slot(a) -> dict[str, torch.Tensor] | None:
    """The version an engine on this host maps from the announce's slot (None when no slot holds it)."""
    from async_vapo.weights.slots import slot_holds

    if not a.location or not slot_holds(a.location, a.version, a.token):
        return None
    data = bytearray(Path(a.location).read_bytes())[a.base: a.base + a.nbytes]
    return views(data, a.layout)


def fetched(a, transport, port: int, cfg) -> dict[str, torch.Tensor]:
    """The version an engine on another host fetches from the learner's fetch server (on ``transport``)."""
    from async_vapo.weights.fetch import fetch_weights

    dst = bytearray(a.nbytes)
    fetch_weights(transport, f"tcp://127.0.0.1:{port}", a.version, a.nbytes, dst,
                  chunk_bytes=cfg.cluster.weights.chunk_bytes, timeout_s=10, engine_id="rollout-1",
                  max_bytes=cfg.cluster.wire.max_message_bytes)
    return views(dst, a.layout)


def views(data: bytearray, layout) -> dict[str, torch.Tensor]:
    out = {}
    for name, d, shape, off in layout:
        dt = getattr(torch, d)
        n = int(torch.Size(shape).numel()) * dt.itemsize
        out[name] = torch.frombuffer(data, dtype=torch.uint8, count=n, offset=off).view(dt).view(shape).clone()
    return out


def main() -> None:
    from torch.distributed.tensor import DTensor

    from async_vapo.learner.loop import BroadcastSource, StepLoop
    from async_vapo.metrics.jsonl import JsonlWriter
    from async_vapo.services.context import make_context
    from async_vapo.services.learner import LearnerService
    from async_vapo.transport import InprocTransport, WeightsAck, make_envelope
    from async_vapo.weights.receive import load_announced
    from async_vapo.weights.slots import WeightsUnavailable

    cache, out, port = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    cfg = cfg_for(cache, [*EXTRA, f"cluster.weights.dir={out / 'w'}", f"cluster.ports.weights_fetch_port={port}"])
    ctx = make_context("learner", cfg=cfg, run_dir=out / "run", instance=rank, serve_metrics=False,
                       install_signals=False)
    transport = InprocTransport() if rank == 0 else None
    svc = LearnerService(ctx, transport)  # joins the process group (torchrun's environment)
    learner, sync = svc.learner, svc.sync
    figures: dict = {"dtensors": sum(isinstance(v, DTensor) for v in learner.policy.state_dict().values())}
    res: dict = {"refs": {}, "engine": {}, "announces": {}, "slot": {}, "fetched": {}, "rows": {}, "held": {}}
    engine_got: queue.Queue = queue.Queue()
    th = None

    def publish(v: int) -> None:
        res["refs"][v] = learner.policy_state()  # every rank: the whole-model path, for comparison
        row = svc.publish_all(v)
        figures[v] = dict(svc.last_publish)
        if rank == 0:
            res["rows"][v] = row
            record(v, v)

    def record(key, v: int) -> None:
        a = sync.latest
        res["announces"][key] = {"version": a.version, "location": a.location, "dist_engines": list(a.dist_engines)}
        if "rollout-0" in a.dist_engines:
            item = engine_got.get(timeout=60)
            if isinstance(item, BaseException):
                raise item
            res["engine"][key] = item[1]
        res["slot"][key] = from_slot(a)
        res["fetched"][key] = fetched(a, transport, port, cfg) if a.location else None
        try:
            sync.publisher.slots.nbytes(v)
            res["held"][key] = True
        except WeightsUnavailable:
            res["held"][key] = False
        sync.poll(0.5)

    try:
        publish(0)  # no engine heard from yet
        if rank == 0:
            th = threading.Thread(target=group_engine, args=(transport, ctx, "rollout-0", engine_got, 5), daemon=True)
            th.start()
            deadline = time.monotonic() + 30
            while sync.groups.get("rollout-0") is None or sync.groups["rollout-0"].group is None:
                assert time.monotonic() < deadline, "rollout-0's group did not form"
                sync.poll(0.1)
        for v in (1, 2):
            bump(learner, v)
            publish(v)

        # the step loop with the service's hook: two VAPO (GRPO) updates, versions 3 and 4, each published by
        # every rank as it is made
        loop_cfg = cfg_for(cache, [*EXTRA, *LOOP])
        source = BroadcastSource(ListSource(svc.tokenizer) if rank == 0 else None, 2)
        writer = JsonlWriter(out / "loop.jsonl") if rank == 0 else None
        loop = StepLoop(loop_cfg, learner, source, pad_id=svc.tokenizer.pad_token_id, run_dir=out / "loop",
                        log_writer=writer, leader=rank == 0, publish_collective=svc.publish_all)
        loop.run()
        figures["loop"] = dict(svc.last_publish)
        res["refs"][4] = learner.policy_state()
        if rank == 0:
            writer.close()
            res["loop_rows"] = [json.loads(x) for x in (out / "loop.jsonl").read_text().splitlines()]
            for v in (3, 4):
                item = engine_got.get(timeout=60)
                if isinstance(item, BaseException):
                    raise item
                res["engine"][v] = item[1]
                res["announces"][v] = {"version": item[0].version, "location": item[0].location,
                                       "dist_engines": list(item[0].dist_engines)}
            sync.poll(0.5)

        # rollout-1 starts: the latest version (4) has no slot, so its load fails and it says so
        acks = None
        if rank == 0:
            c = cfg.cluster
            acks = transport.sender(ctx.endpoint(c.hosts.learner_host, c.ports.acks_port))
            try:
                load_announced(None, sync.latest, transport=transport, mode="dist",
                               fetch_endpoint=f"tcp://127.0.0.1:{port}",
                               chunk_bytes=c.weights.chunk_bytes, timeout_s=5, engine_id="rollout-1",
                               max_bytes=c.wire.max_message_bytes)
                raise AssertionError("version 4 loaded although no slot holds it")
            except WeightsUnavailable as e:
                res["unavailable"] = str(e)
            acks.send(make_envelope(WeightsAck(engine_id="rollout-1", version=4, ok=False, load_seconds=0.0,
                                               error=res["unavailable"]), sender="rollout-1"), 5)
            sync.poll(1.0)
            res["needs_whole"] = sync.needs_whole()

            def stop_once_republished():  # the source stops after REPUBLISH has been served
                deadline = time.monotonic() + 60
                while not sync.latest.location and time.monotonic() < deadline:
                    time.sleep(0.05)
                ctx.stop.set()

            threading.Thread(target=stop_once_republished, daemon=True).start()
        # every rank: the service's source; rank 0's idle work answers REPUBLISH while it waits, then it stops
        figures["source"] = svc.loop.source.next_groups(cfg.algo.prompts_per_step)
        figures["again"] = dict(svc.last_publish)
        if rank == 0:
            record("4 again", 4)
            acks.send(make_envelope(WeightsAck(engine_id="rollout-1", version=4, ok=True, via="shm",
                                               load_seconds=0.01), sender="rollout-1"), 5)
            sync.poll(1.0)
        bump(learner, 5)
        publish(5)  # rollout-1 is known and has no group
        if rank == 0:
            res["full_bytes"] = sum(t.numel() * t.element_size() for t in res["refs"][5].values())
            torch.save(res, out / "published.pt")
        torch.save(figures, out / f"figures.{rank}")
    finally:
        if th is not None:
            th.join(10)
        svc.close()
        if transport is not None:
            transport.close()
        ctx.close()


if __name__ == "__main__":
    main()
