"""The ranks of tests/integration/test_sharded_stream.py, launched by torchrun (gloo, 2 CPU ranks): a sharded
policy streamed to three engines' weight groups with ``learner.sharding.stream_sharded``, the second engine dying
after its first bucket. Rank 0 runs the engines (``FAKE_ENGINE``, one process each, receiving the buckets'
bytes into ``OUT/<engine>.pt``); every rank saves its counts to ``OUT/stream.<rank>`` and rank 0 the unsharded
engine state (``Learner.policy_state``) to ``OUT/full.pt``.

    torchrun --nproc_per_node 2 tests/integration/stream_worker.py CACHE_DIR OUT_DIR
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import cfg_for  # noqa: E402

BUCKET_BYTES = 4096
ENGINES = {"good-0": -1, "dying": 1, "good-1": -1}
"""Engine id -> buckets it receives before it dies (-1: all)."""

FAKE_ENGINE = textwrap.dedent("""
    import datetime, json, os, sys, torch, torch.distributed as dist
    addr, port, prefix, die_after, sizes, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), \\
        json.loads(sys.argv[5]), sys.argv[6]
    print("ready", flush=True)  # imported: joins at once from here (a loaded machine imports torch slowly)
    t = datetime.timedelta(seconds=120)
    store = dist.TCPStore(addr, port, 2, is_master=False, timeout=t)
    g = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, t)
    got = []
    for i, n in enumerate(sizes):
        if i == die_after:
            os._exit(9)  # dies mid-version, without a word
        buf = torch.empty(n, dtype=torch.uint8)
        g.broadcast(buf, 0).wait()
        got.append(buf)
    torch.save(got, out)
""")


def main() -> None:
    from torch.distributed.tensor import DTensor

    from async_vapo.learner.sharding import engine_meta, stream_sharded
    from async_vapo.learner.vapo import Learner
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.weights.collective import EngineGroup, plan_buckets

    cache, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    procs = []
    try:
        cfg = cfg_for(cache, ["model.dtype=bfloat16"])
        learner = Learner(cfg, ensure_base_model(cfg, progress=False))
        dtype = learner.precision.compute_dtype
        full = learner.policy_state()  # the whole-model path (a collective), for comparison
        if rank == 0:
            torch.save(full, out / "full.pt")
        del full
        groups = []
        if rank == 0:
            sizes = [b.nbytes for b in plan_buckets(engine_meta(learner.policy, dtype), BUCKET_BYTES)]
            for engine, die_after in ENGINES.items():
                # each broadcast within 20 s (the dying engine's failure), the join within 120 s
                g = EngineGroup(engine, timeout_s=20, join_timeout_s=120)
                i = g.init_info
                procs.append(subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, i["master_addr"],
                                               str(i["master_port"]), i["prefix"], str(die_after), json.dumps(sizes),
                                               str(out / f"{engine}.pt")], stdout=subprocess.PIPE, text=True))
                groups.append(g)
            for p in procs:
                assert p.stdout.readline() == "ready\n"
        got = stream_sharded(learner.policy, dtype, groups, bucket_bytes=BUCKET_BYTES, timeout_s=180)
        dtensors = sum(isinstance(v, DTensor) for v in learner.policy.state_dict().values())
        results = {e: (type(r).__name__, str(r)) for e, r in got["results"].items()}
        torch.save({**got, "results": results, "dtensors": dtensors}, out / f"stream.{rank}")
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            p.kill()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
