"""Where the torch.distributed push's reload time goes (a profile, not a timing benchmark).

    .venv/bin/python benchmarks/dist_reload_profile.py            # a ~10 M-parameter model (57 MB), one engine

The "dist" path loads each version through vLLM's layerwise reload with one ``model.load_weights`` call per bucket,
while the next bucket is received; ``reload_weights`` loads the whole model in one call. Inside the engine's worker
(``collective_rpc``), with no receive running beside it, this loads the same views of one shared-memory buffer:

* ``whole``: one ``load_weights`` call between ``initialize_layerwise_reload`` and ``finalize_layerwise_reload``
  (what ``reload_weights`` does);
* ``16MiB`` / ``4MiB``: the same views cut into bucket-sized ``load_weights`` calls (what the dist engine does);

and prints the median seconds of each stage over ``--reps`` loads (the first dropped), then a cProfile of one
``16MiB`` load. Then whole pushes over a gloo group (the learner's ``EngineGroup`` in this process, as in
``benchmarks/weight_sync.py``) in 16 and 4 MiB buckets, ``--reps`` each after a warm-up, and the cores each thread of
the worker may run on, gloo's receive threads included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc pickles the functions below


def split_load(worker, path: str, nbytes: int, layout: list, bucket_bytes: int, reps: int, profile: bool) -> dict:
    """Runs in the worker: ``reps`` layerwise loads of the buffer's views in calls of at most ``bucket_bytes``."""
    import cProfile
    import io
    import mmap
    import os
    import pstats
    import time

    import torch
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fd)
    flat = torch.frombuffer(buf, dtype=torch.uint8)
    chunks: list[list] = [[]]
    size = 0
    for name, dtype, shape, off in layout:
        dt = getattr(torch, dtype)
        n = dt.itemsize * int(torch.Size(shape).numel())
        if chunks[-1] and size + n > bucket_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append((name, flat[off: off + n].view(dt).view(shape)))
        size += n
    model = worker.model_runner.get_model()
    model_config = worker.model_runner.vllm_config.model_config
    runs = []
    prof = cProfile.Profile()
    for r in range(reps + 1):
        t0 = time.perf_counter()
        initialize_layerwise_reload(model)
        t1 = time.perf_counter()
        if profile and r == reps:
            prof.enable()
        for c in chunks:
            model.load_weights(c)
        prof.disable()
        t2 = time.perf_counter()
        finalize_layerwise_reload(model, model_config)
        runs.append({"start_s": t1 - t0, "load_s": t2 - t1, "finish_s": time.perf_counter() - t2})
    out = {"calls": len(chunks), "median": {k: statistics.median(x[k] for x in runs[1:]) for k in runs[0]}}
    if profile:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(15)
        out["cprofile"] = text.getvalue()
    del flat, chunks
    return out


def thread_cores(worker) -> dict[str, list[str]]:
    """Runs in the worker: thread names by the cores they may run on."""
    import glob

    out: dict[str, list[str]] = {}
    for status in glob.glob("/proc/self/task/*/status"):
        fields = dict(line.split(":", 1) for line in open(status).read().splitlines() if ":" in line)
        out.setdefault(fields["Cpus_allowed_list"].strip(), []).append(fields["Name"].strip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import torch

    import benchmarks.weight_sync as ws
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.weights.collective import EngineGroup, plan_buckets, update_info, version_meta

    torch.set_num_threads(1)
    ws.SIZES["10m"] = (384, 6, 1536, 6, 2)
    with tempfile.TemporaryDirectory(prefix="dist-reload-profile-") as tmp:
        model, _ = ws.build_model("10m", Path(tmp) / "m")
        state = ws.random_state(model, 1)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = VLLMEngine(EngineSpec(model_path=str(Path(tmp) / "m"), max_model_len=128, kv_cache_gib=1,
                                       max_num_seqs=8))
        try:
            path, nbytes, layout = engine._shared.write(state)
            print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, {nbytes / 1e6:.0f} MB")
            for label, bucket, profile in (("whole", 1 << 40, False), ("16MiB", 16 << 20, True),
                                           ("4MiB", 4 << 20, False)):
                r = engine.llm.collective_rpc(split_load, args=(path, nbytes, layout, bucket, args.reps, profile))[0]
                print(f"{label:<6} {r['calls']:>3} load_weights calls: "
                      + " ".join(f"{k} {v:.4f}" for k, v in r["median"].items()), flush=True)
                if profile:
                    print(r["cprofile"])
            group = EngineGroup("profile", timeout_s=60)
            joiner = threading.Thread(target=group.connect)
            joiner.start()
            engine.join_weight_group(group.init_info)
            joiner.join()
            named = list(state.items())
            version = 0
            for mib in (16, 4):
                buckets = plan_buckets(version_meta(named), mib << 20)
                runs = []
                for _ in range(args.reps + 1):
                    version += 1
                    sender = threading.Thread(target=group.send, args=(buckets, named))
                    sender.start()
                    engine.receive_weights_dist(update_info(buckets, version), version)
                    sender.join()
                    runs.append({"push_s": engine.last_load_seconds, **engine.last_load_stages})
                med = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
                print(f"push over gloo, {mib} MiB buckets ({len(buckets)}): "
                      + " ".join(f"{k} {v:.4f}" for k, v in med.items()), flush=True)
            group.close()
            for cores, names in engine.llm.collective_rpc(thread_cores)[0].items():
                print(f"worker threads on cores {cores}: {len(names)} "
                      f"({sum(n.startswith(('gloo', 'pt_gloo')) for n in names)} of them gloo's)")
        finally:
            engine.close()


if __name__ == "__main__":
    main()
