"""Time to push a new weight version into a running vLLM engine, per path, against memcpy of the bytes.

    .venv/bin/python benchmarks/weight_sync.py                      # sizes 1m,30m,300m, 5 pushes each
    .venv/bin/python benchmarks/weight_sync.py --sizes 1m --pushes 3 --profile
    .venv/bin/python benchmarks/weight_sync.py --sizes 300m --paths shared,cluster_shm,cluster_dist   # the goals of
        # the torch.distributed path alone (fewer copies of the model in memory at once)

For each size a random-weight Qwen2-architecture model (float32, the embedded default's character
tokenizer, tied embeddings) is saved with ``save_pretrained`` and served by one ``VLLMEngine``. Then,
for each path, one warm-up push and ``--pushes`` timed pushes of fresh random state dicts (two
pre-generated ones, alternated, so every push changes every weight):

* ``safetensors``: ``load_weights(state, v, via="safetensors")`` -- the state dict written as a
  safetensors file in /dev/shm, loaded by the workers with ``load_file`` (the cluster's format).
* ``shared``: ``load_weights(state, v)`` -- one ``copy_`` per tensor into a flat shared-memory buffer
  that the workers mapped once; the RPC carries names, dtypes, shapes and offsets.
* ``shared_fresh``: the same with the buffer released before each push (a new file every time: what
  keeping the buffer saves, and the cost for a caller that frees it between pushes).

and the cluster's learner -> engine paths (``async_vapo.weights``), the learner's write and the
engine's load through the same functions the services call (``load_announced``):

* ``cluster_file``: a safetensors file per version (``cluster.weights.transfer = "file"``); the engine
  reads it to verify its crc32, then its workers load it.
* ``cluster_shm``: the learner's shared-memory slot (2 slots, written round robin), mapped by the workers.
* ``cluster_zmq``: the same slot fetched over ZeroMQ on loopback TCP in 16 MiB crc32-checked chunks into
  the engine's own buffer (what an engine on another host does), then loaded from it.

and the torch.distributed path (``async_vapo.weights.collective``), beside what it is made of:

* ``cluster_dist``: the learner's EngineGroup streams the state dict in ``--bucket-mb`` buckets over the engine's
  gloo group while the engine receives it through vLLM's weight-transfer API (``update_weights``, layerwise reload);
  split into ``transfer_s`` (the slowest worker's wait in broadcasts), ``reload_s`` (vLLM's layerwise
  ``load_weights`` and its finalisation) and ``rpc_s`` (the rest of the three control-plane calls).
* ``bare_gloo``: the same bytes in the same buckets broadcast between this process and a second one that only
  receives (no vLLM), ended by a one-byte broadcast back: what the transfer costs with nothing around it.

and ``memcpy``: the same bytes copied, one ``copy_`` per tensor, into a preallocated buffer (median of
as many copies). A push is broken into ``write_s`` (this process), ``rpc_s`` (dispatch and return),
``read_s`` (tensors out of the file, in the worker) and ``reload_s`` (vLLM's ``reload_weights``).
After the last push of each path the engine's log-probs of a greedy continuation are compared with a
torch forward of the same weights (``max |diff|`` must be below 1e-3), so the timings are of real loads.
``--profile`` adds, inside the worker, how much of ``reload_weights`` is oneDNN weight repacking
(``dispatch_cpu_unquantized_gemm``) over ``--pushes`` loads, and a cProfile of one more load.

Writes ``benchmarks/results/weight_sync/result.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_io import write_result

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "weight_sync" / "result.json"
SIZES = {  # hidden, layers, intermediate, heads, kv heads
    "1m": (128, 4, 512, 4, 2),
    "30m": (512, 8, 2048, 8, 4),
    "300m": (1024, 24, 3072, 16, 8),
}
PATHS = ("safetensors", "shared", "shared_fresh")
CLUSTER_PATHS = ("cluster_file", "cluster_shm", "cluster_zmq")
SELECTED: set[str] = set(PATHS + CLUSTER_PATHS + ("cluster_dist",))
"""The paths this run times (``--paths``); memcpy and the bare gloo broadcast are always timed."""
CHUNK = 16 * 2**20
TOLERANCE = 1e-3
BARE_RECEIVER = """
import os, sys, datetime, torch, torch.distributed as dist
port, sizes, reps = int(sys.argv[1]), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=120))
g = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(seconds=120))
bufs = [torch.empty(n, dtype=torch.uint8) for n in sorted(set(sizes))]
by_size = {b.numel(): b for b in bufs}
for _ in range(reps):
    for n in sizes:
        g.broadcast(by_size[n], 0).wait()
    g.broadcast(torch.ones(1, dtype=torch.uint8), 1).wait()
os._exit(0)  # not through the group's destructor, which can abort at interpreter exit
"""


def build_model(size: str, directory: Path):
    from async_vapo.models.tiny import build_char_tokenizer, build_tiny_qwen2, save_hf

    hidden, layers, inter, heads, kv = SIZES[size]
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv,
                             intermediate_size=inter, max_position_embeddings=256, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, seed=0).eval()
    save_hf(model, tok, directory)
    return model, tok


def random_state(model, seed: int) -> dict:
    """Fresh weights with the model's names and shapes; tied tensors stay one tensor."""
    import torch

    g = torch.Generator().manual_seed(seed)
    by_storage: dict[int, torch.Tensor] = {}
    out = {}
    for name, t in model.state_dict().items():
        key = t.untyped_storage().data_ptr()
        if key not in by_storage:
            if name.endswith("norm.weight"):
                by_storage[key] = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
            else:
                by_storage[key] = 0.05 * torch.randn(t.shape, generator=g)
        out[name] = by_storage[key]
    return out


def logprob_gap(engine, model, state, prompt: list[int]) -> float:
    """max |engine log-prob - torch log-prob| over a greedy continuation of ``prompt`` under ``state``."""
    import torch

    model.load_state_dict(state)
    sample = engine.generate([prompt], n=1, temperature=0.0, top_p=1.0, max_tokens=12, stop_token_ids=[])[0][0]
    ids = torch.tensor([prompt + sample.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    p = len(prompt)
    ref = logp[p - 1: p - 1 + len(sample.token_ids)].gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
    return float((ref - torch.tensor(sample.logprobs)).abs().max())


def memcpy_seconds(state: dict, dst) -> float:
    import torch

    t0 = time.perf_counter()
    off = 0
    for t in state.values():
        n = t.numel() * t.element_size()
        dst[off: off + n].view(t.dtype).view(t.shape).copy_(t)
        off += -(-n // 64) * 64
    torch.cpu.synchronize()
    return time.perf_counter() - t0


def reload_breakdown(worker, path: str, nbytes: int, layout: list, loads: int) -> dict:
    """Runs inside the worker (collective_rpc callable): ``loads`` shared-buffer loads, timing the part of
    ``reload_weights`` spent in ``dispatch_cpu_unquantized_gemm`` (oneDNN repacking of each linear
    weight, lm_head included), plus a cProfile of one more load (top functions by own time)."""
    import cProfile
    import io
    import pstats
    import statistics
    import time

    import vllm.model_executor.layers.utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    spent = [0.0]

    def timed(*args, **kwargs):  # linear.py and vocab_parallel_embedding.py import it at each call
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    layer_utils.dispatch_cpu_unquantized_gemm = timed
    runs = []
    try:
        for _ in range(loads):
            spent[0] = 0.0
            r = worker.async_vapo_load_shared(path, nbytes, layout)
            runs.append({"reload_s": r["reload_s"], "repack_s": spent[0]})
    finally:
        layer_utils.dispatch_cpu_unquantized_gemm = original
    prof = cProfile.Profile()
    prof.enable()
    worker.async_vapo_load_shared(path, nbytes, layout)
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    return {"median_reload_s": statistics.median(r["reload_s"] for r in runs),
            "median_repack_s": statistics.median(r["repack_s"] for r in runs), "runs": runs,
            "cprofile": out.getvalue()}


def bench_cluster(engine, model, states, prompt, pushes: int, version: int, workdir: Path, result: dict) -> int:
    """The cluster's paths: the learner's write, then the engine's ``load_announced``; returns the last version."""
    from async_vapo.transport import ZmqTransport
    from async_vapo.weights import WeightServer, WeightSlots, load_announced, slot_announce, write_file_version

    workdir.mkdir(parents=True, exist_ok=True)
    slots = WeightSlots(workdir / "slots", 2)
    transport = ZmqTransport()
    server = WeightServer(transport, slots, "tcp://127.0.0.1:*", chunk_bytes=CHUNK, max_bytes=2**20,
                          send_timeout_s=30)
    try:
        for path in (p for p in CLUSTER_PATHS if p in SELECTED):
            runs = []
            for i in range(pushes + 1):  # the first is the warm-up
                state = states[i % 2]
                version += 1
                t0 = time.perf_counter()
                if path == "cluster_file":
                    announce = write_file_version(workdir, version, state)
                else:
                    announce = slot_announce(slots.write(version, state))
                t1 = time.perf_counter()
                how = load_announced(engine, announce, transport=transport, mode=path.removeprefix("cluster_"),
                                     fetch_endpoint=server.endpoint, chunk_bytes=CHUNK, timeout_s=60,
                                     engine_id="bench", max_bytes=2**20)
                t2 = time.perf_counter()
                assert how == path.removeprefix("cluster_"), how
                if path == "cluster_file":
                    Path(announce.location).unlink()
                stages = engine.last_load_stages
                runs.append({"total_s": t2 - t0, "write_s": t1 - t0,
                             "transfer_s": (t2 - t1) - stages["rpc_s"] - stages["read_s"] - stages["reload_s"],
                             "rpc_s": stages["rpc_s"], "read_s": stages["read_s"], "reload_s": stages["reload_s"]})
            gap = logprob_gap(engine, model, state, prompt)
            timed = runs[1:]
            med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
            result["paths"][path] = {"median": med, "warmup": runs[0], "pushes": timed, "logprob_max_abs_diff": gap}
            print(f"{path:<13} median {med['total_s']:.4f} s  (learner write {med['write_s']:.4f}, transfer "
                  f"{med['transfer_s']:.4f}, rpc {med['rpc_s']:.4f}, read {med['read_s']:.4f}, reload "
                  f"{med['reload_s']:.4f})  logprob gap {gap:.2e}", flush=True)
            if not gap < TOLERANCE:
                raise AssertionError(f"{path}: engine log-probs differ from torch by {gap:.3g} after a push")
    finally:
        server.close()
        slots.close()
        transport.close()
    return version


def bench_dist(engine, model, states, prompt, pushes: int, version: int, bucket_bytes: int, result: dict) -> int:
    """``cluster_dist``: the learner's EngineGroup -> the engine's gloo weight-transfer engine."""
    import threading

    from async_vapo.weights.collective import EngineGroup, plan_buckets, update_info, version_meta

    group = EngineGroup("bench", timeout_s=300)
    joiner = threading.Thread(target=group.connect)
    joiner.start()
    engine.join_weight_group(group.init_info)
    joiner.join()
    runs = []
    try:
        for i in range(pushes + 1):  # the first is the warm-up
            state = states[i % 2]
            version += 1
            named = list(state.items())
            buckets = plan_buckets(version_meta(named), bucket_bytes)
            sent: dict = {}
            t0 = time.perf_counter()
            sender = threading.Thread(target=lambda: sent.update(send_s=group.send(buckets, named)))  # noqa: B023
            sender.start()
            engine.receive_weights_dist(update_info(buckets, version), version)
            sender.join()
            total = time.perf_counter() - t0
            st = engine.last_load_stages
            runs.append({"total_s": total, "send_s": sent["send_s"], "transfer_s": st["recv_s"],
                         "reload_s": st["reload_s"], "rpc_s": total - st["recv_s"] - st["reload_s"]})
    finally:
        group.close()
    gap = logprob_gap(engine, model, state, prompt)
    timed = runs[1:]
    med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
    result["paths"]["cluster_dist"] = {"median": med, "warmup": runs[0], "pushes": timed, "logprob_max_abs_diff": gap,
                                       "bucket_bytes": bucket_bytes, "buckets": len(buckets)}
    print(f"{'cluster_dist':<13} median {med['total_s']:.4f} s  (transfer {med['transfer_s']:.4f}, reload "
          f"{med['reload_s']:.4f}, rpc {med['rpc_s']:.4f}; {len(buckets)} buckets)  logprob gap {gap:.2e}", flush=True)
    if not gap < TOLERANCE:
        raise AssertionError(f"cluster_dist: engine log-probs differ from torch by {gap:.3g} after a push")
    return version


def bare_gloo_seconds(state: dict, bucket_bytes: int, pushes: int) -> list[float]:
    """The same bytes in the same buckets, broadcast to a receiving process and acknowledged (warm-up dropped)."""
    import datetime
    import subprocess

    import torch
    import torch.distributed as dist

    from async_vapo.weights.collective import plan_buckets, version_meta

    sizes = [b.nbytes for b in plan_buckets(version_meta(list(state.items())), bucket_bytes)]
    timeout = datetime.timedelta(seconds=300)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timeout)
    proc = subprocess.Popen([sys.executable, "-c", BARE_RECEIVER, str(store.port), ",".join(map(str, sizes)),
                             str(pushes + 1)])
    try:
        g = dist.ProcessGroupGloo(store, 0, 2, timeout)
        bufs = {n: torch.randint(0, 255, (n,), dtype=torch.uint8) for n in set(sizes)}
        ack = torch.zeros(1, dtype=torch.uint8)
        times = []
        for _ in range(pushes + 1):
            t0 = time.perf_counter()
            for n in sizes:
                g.broadcast(bufs[n], 0).wait()
            g.broadcast(ack, 1).wait()
            times.append(time.perf_counter() - t0)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    return times[1:]


def bench_size(size: str, pushes: int, profile: bool, workdir: Path, bucket_bytes: int = 64 << 20) -> dict:
    import torch

    from async_vapo.rollout.engine import EngineSpec, VLLMEngine

    model_dir = workdir / f"qwen2-{size}"
    t0 = time.perf_counter()
    model, tok = build_model(size, model_dir)
    n_params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    states = [random_state(model, 1), random_state(model, 2)]
    nbytes = sum(t.numel() * t.element_size() for t in states[0].values())
    print(f"\n== {size}: {n_params / 1e6:.1f} M parameters, {nbytes / 1e6:.0f} MB per push "
          f"(model built in {time.perf_counter() - t0:.0f} s)", flush=True)
    prompt = tok("12+3*4-5=").input_ids

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(EngineSpec(model_path=str(model_dir), max_model_len=128, kv_cache_gib=1, max_num_seqs=8))
    print(f"engine started in {engine.start_seconds:.0f} s", flush=True)
    result: dict = {"params": n_params, "bytes_per_push": nbytes, "tensors_per_push": len(states[0]),
                    "engine_start_s": engine.start_seconds, "paths": {}}
    try:
        version = 0
        for path in (p for p in PATHS if p in SELECTED):
            runs = []
            for i in range(pushes + 1):  # the first is the warm-up
                state = states[i % 2]
                version += 1
                t_release = 0.0
                if path == "shared_fresh":
                    t = time.perf_counter()
                    engine.release_weight_buffer()
                    t_release = time.perf_counter() - t
                seconds = engine.load_weights(state, version, via="safetensors" if path == "safetensors" else "shared")
                runs.append({"total_s": seconds + t_release, **engine.last_load_stages})
            gap = logprob_gap(engine, model, state, prompt)
            timed = runs[1:]
            med = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
            result["paths"][path] = {"median": med, "warmup": runs[0], "pushes": timed, "logprob_max_abs_diff": gap}
            print(f"{path:<13} median {med['total_s']:.4f} s  (write {med['write_s']:.4f}, rpc {med['rpc_s']:.4f}, "
                  f"read {med['read_s']:.4f}, reload {med['reload_s']:.4f})  logprob gap {gap:.2e}", flush=True)
            if not gap < TOLERANCE:
                raise AssertionError(f"{size}/{path}: engine log-probs differ from torch by {gap:.3g} after a push")
        version = bench_cluster(engine, model, states, prompt, pushes, version, workdir / f"cluster-{size}", result)
        if "cluster_dist" in SELECTED:
            version = bench_dist(engine, model, states, prompt, pushes, version, bucket_bytes, result)
        if profile:
            engine.load_weights(states[0], version + 1)  # maps a kept buffer, as in the "shared" path
            path_, n_, layout = engine._shared.write(states[1])
            prof = engine.llm.collective_rpc(reload_breakdown, args=(path_, n_, layout, pushes))[0]
            result["reload_breakdown"] = prof
            print(f"reload_weights {prof['median_reload_s']:.4f} s, of which oneDNN repacking "
                  f"(dispatch_cpu_unquantized_gemm) {prof['median_repack_s']:.4f} s\n{prof['cprofile']}", flush=True)
    finally:
        engine.close()

    dst = torch.empty(nbytes + 64 * len(states[0]), dtype=torch.uint8)
    copies = [memcpy_seconds(states[i % 2], dst) for i in range(pushes + 1)][1:]
    mem = statistics.median(copies)
    result["memcpy"] = {"median_s": mem, "copies_s": copies, "gb_per_s": nbytes / mem / 1e9}
    for p in result["paths"].values():
        p["ratio_to_memcpy"] = p["median"]["total_s"] / mem
    print(f"memcpy        median {mem:.4f} s ({nbytes / mem / 1e9:.2f} GB/s)", flush=True)
    bare = bare_gloo_seconds(states[0], bucket_bytes, pushes)
    result["bare_gloo"] = {"median_s": statistics.median(bare), "runs_s": bare, "bucket_bytes": bucket_bytes,
                           "gb_per_s": nbytes / statistics.median(bare) / 1e9}
    paths = result["paths"]
    if {"cluster_dist", "shared", "cluster_shm"} <= paths.keys():
        d, sh = paths["cluster_dist"]["median"], paths["shared"]["median"]
        result["dist_goals"] = {  # issue 15's goals on the CPU, each a ratio (goal in the name)
            "transfer_over_bare_gloo_le_1.2": d["transfer_s"] / result["bare_gloo"]["median_s"],
            "push_over_shm_push_le_1": d["total_s"] / paths["cluster_shm"]["median"]["total_s"],
            "push_over_vllm_reload_weights_le_1.2": d["total_s"] / sh["reload_s"],
        }
    print(f"bare gloo     median {statistics.median(bare):.4f} s ({result['bare_gloo']['gb_per_s']:.2f} GB/s); "
          + ", ".join(f"{k} {v:.2f}" for k, v in result.get("dist_goals", {}).items()), flush=True)
    del dst, states, model
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1m,30m,300m")
    ap.add_argument("--pushes", type=int, default=5, help="timed pushes per path (after one warm-up)")
    ap.add_argument("--profile", action="store_true", help="break reload_weights down inside the worker")
    ap.add_argument("--bucket-mb", type=int, default=16, help="bucket of the torch.distributed path (MiB)")
    ap.add_argument("--paths", default=",".join(sorted(SELECTED)),
                    help="comma-separated paths to time (default: all); the goals of the torch.distributed path need "
                         "cluster_dist, shared and cluster_shm")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    unknown = set(args.paths.split(",")) - SELECTED
    if unknown:
        ap.error(f"unknown paths {sorted(unknown)}; known: {sorted(SELECTED)}")
    SELECTED.intersection_update(args.paths.split(","))
    if args.profile:  # collective_rpc pickles the profiling function
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    import torch

    # One intra-op thread in this process (the trainer runs with train.threads=1 here): with the two
    # cores busy, torch's thread pool makes each copy_ of a small tensor cost ~8 ms, which would turn
    # the memcpy baseline into a measurement of thread wake-ups.
    torch.set_num_threads(1)
    doc = {
        "benchmark": "push a state dict into a running vLLM engine (CPU backend) vs memcpy of the same bytes",
        "goal": "<= 2x memcpy at 300 M parameters",
        "command": f"cd {ROOT} && " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "pushes": args.pushes,
        "sizes": {},
    }
    with tempfile.TemporaryDirectory(prefix="weight-sync-bench-") as tmp:
        for size in args.sizes.split(","):
            doc["sizes"][size] = bench_size(size, args.pushes, args.profile, Path(tmp), args.bucket_mb << 20)
            doc["machine"]["loadavg"] = list(os.getloadavg())
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(doc, indent=2) + "\n")  # each size as it ends: a later one may not

    print(f"\n{'size':<6} {'params':>8} {'MB':>6} {'path':<13} {'push s':>8} {'x memcpy':>9} {'write':>7} "
          f"{'transf':>7} {'rpc':>7} {'read':>7} {'reload':>7}")
    for size, r in doc["sizes"].items():
        mem = r["memcpy"]["median_s"]
        rows = [(p, v["median"]) for p, v in r["paths"].items()]
        rows += [("memcpy", {"total_s": mem}), ("bare_gloo", {"total_s": r["bare_gloo"]["median_s"]})]
        for path, m in rows:
            stages = " ".join(f"{m[k]:>7.3f}" if k in m else f"{'':>7}" for k in ("write_s", "transfer_s", "rpc_s",
                                                                               "read_s", "reload_s"))
            print(f"{size:<6} {r['params'] / 1e6:>7.1f}M {r['bytes_per_push'] / 1e6:>6.0f} {path:<13} "
                  f"{m['total_s']:>8.3f} {m['total_s'] / mem:>9.1f} {stages}")
    for size, r in doc["sizes"].items():
        b = r.get("reload_breakdown")
        if b:
            mem = r["memcpy"]["median_s"]
            print(f"{size}: reload_weights {b['median_reload_s']:.3f} s ({b['median_reload_s'] / mem:.1f}x memcpy), "
                  f"of which oneDNN repacking {b['median_repack_s']:.3f} s ({b['median_repack_s'] / mem:.1f}x memcpy)")
    write_result(args.out, doc)


if __name__ == "__main__":
    main()
