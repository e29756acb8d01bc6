"""Per-rank memory of the learner as the model grows, in one process and sharded over 2 gloo ranks with FSDP2:
policy + critic (float32 masters) with their AdamW states, through two VAPO updates (``--updates``: the second
runs with every AdamW state allocated, the steady state the plan counts), at about 1 M, 30 M and 300 M
parameters (the random Qwen2-architecture models of benchmarks/weight_sync.py). Each (size, ranks) runs in its own
processes (2 ranks: one torchrun launch) so that the peaks do not mix.

Reported per rank:
* ``state_bytes``: bytes of this rank's parameters + gradients (at the optimiser step) + AdamW state of policy and
  critic, counted from the tensors (a sharded parameter counts its local shard);
* ``rss_peak_mib``: the process's peak resident memory (it also holds activations, the batch, torch's allocator
  caches and, on rank 0, the full weights read once at start-up and broadcast);
* ``grown_mib``: peak resident memory (VmHWM, reset through /proc/self/clear_refs once torch and transformers are
  imported) less the resident memory at that moment: what loading and the updates added, the quantity the plan
  predicts;
* ``phases``: resident memory, its peak so far (both less that same starting point) and glibc's heap counters
  (``mallinfo2``: ``heap_in_use``, ``heap_free``: freed chunks glibc keeps resident, ``mmapped``) at each step of
  loading (rank 0's read of the full weights, ``fully_shard``, the broadcast from rank 0) and after each forward,
  backward and optimiser step; ``heap_free_end_mib``: glibc's free heap at the end;
* ``plan_mib``: ``async_vapo.deploy.scale.learner_memory`` for this model, these ranks, this batch's longest row
  and the learner settings of this run (float32 on the CPU, so no 16-bit copies), on the device plus offloaded;
  ``plan_vs_grown`` = plan_mib / grown_mib.
The goal for sharding: ``state_bytes`` at 2 ranks <= 0.55 x at 1 rank.

The ranks run with glibc's mmap threshold fixed at its initial 128 KiB (``MALLOC_MMAP_THRESHOLD_``;
``--glibc-default`` leaves it dynamic): every tensor of 128 KiB or more is then its own mapping, returned to the
system when freed, so the peak counts the tensors that were live, which is what the plan counts. With the default,
the first such mapping freed raises the threshold to its size (up to 32 MiB) and later tensors below it come from
glibc's heap, which keeps them resident once freed: on 2 ranks FSDP2's per-layer gathered parameters and unsharded
gradients, allocated and freed layer after layer, left up to 775 and 849 MiB of freed heap resident at 30 M, and the
ranks grew 2.2 and 2.1 times as much as with the fixed threshold (glibc_default.json against result.json); one
process, 225 MiB and 1.14 times.

    .venv/bin/python benchmarks/learner_memory.py [--sizes 1m,30m,300m | --model DIR] [--ranks 1,2] [--algo grpo] \
        [--lora RANK] [--groups G --group-size K] [--updates 2] [--glibc-default] [--trim]

``--algo grpo`` measures the policy alone (no critic): half the memory, for a machine that cannot hold both.

``--lora RANK`` (issue 50) trains adapters of that rank (alpha 2 x rank) on every linear layer of the policy and, with
VAPO, of the critic's trunk (``model.lora``, ``model.critic_lora``): its rows sit beside the full fine-tune's of the
same size, algorithm and ranks (``lora`` 0), for the state, the peak and the seconds per update. ``--model DIR``
measures an HF model directory (e.g. ``models/smollm2-135m-instruct``) in place of the random ones, its row's size
the directory's name. ``--groups G --group-size K`` sets the batch (G prompts x K responses, one mini-batch of
micro-batches of 8; default 2 x 2, micro-batches of 2): the states do not depend on it, the seconds per update do.

Prints a table and writes benchmarks/results/learner_memory/result.json (``--out``; ``--glibc-default`` rows of 30
M: glibc_default.json). The update runs on a small batch (4 responses of ~40 tokens): the states do not depend on
it, and a 300 M update on 16 responses took 7 minutes on this 2-core machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
OUT = ROOT / "benchmarks" / "results" / "learner_memory" / "result.json"
MMAP_THRESHOLD = 128 * 1024
"""glibc's initial M_MMAP_THRESHOLD, fixed (module docstring)."""


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> None:
    """Start VmHWM again from the current resident memory (Linux: writing 5 to clear_refs); ru_maxrss cannot be
    reset and carries the peak of the process that forked this one across exec."""
    Path("/proc/self/clear_refs").write_text("5")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


_LIBC = ctypes.CDLL(None)


def _mallinfo() -> dict[str, float]:
    """glibc's heap counters in MiB: ``heap_in_use`` (allocated chunks in the arenas), ``heap_free`` (freed chunks
    the arenas keep, resident unless trimmed) and ``mmapped`` (chunks mapped on their own, returned when freed)."""
    m = _LIBC.mallinfo2
    m.restype = _Mallinfo2
    r = m()
    return {"heap_in_use": r.uordblks / 2**20, "heap_free": r.fordblks / 2**20, "mmapped": r.hblkhd / 2**20}


class _Phases:
    """VmRSS, VmHWM (both less the resident memory before loading) and glibc's counters at each named point of
    loading and of the update; with ``trim`` glibc's free memory is handed back (``malloc_trim(0)``) at each
    point, so that the peak holds live memory only."""

    def __init__(self, base_kib: int, trim: bool):
        self.base, self.trim, self.points = base_kib, trim, []

    def mark(self, label: str) -> None:
        row = {"at": label, "rss_mib": (_status_kib("VmRSS") - self.base) / 1024,
               "hwm_mib": (_status_kib("VmHWM") - self.base) / 1024, **_mallinfo()}
        if self.trim:
            _LIBC.malloc_trim(0)
            row["rss_trimmed_mib"] = (_status_kib("VmRSS") - self.base) / 1024
        self.points.append(row)


def _instrument(ph: _Phases) -> None:
    """Marks at the learner's loading steps (``learner.sharding``: rank 0's full read, sharding, the broadcast)
    and around each forward, backward and optimiser step of the update."""
    import torch
    import torch.distributed.checkpoint.state_dict as sd

    from async_vapo.learner import sharding, vapo

    def wrap(owner, name, label):
        f = getattr(owner, name)

        def g(*a, **k):
            ph.mark(f"{label} start")
            out = f(*a, **k)
            ph.mark(f"{label} end")
            return out
        setattr(owner, name, g)

    load_sharded = sharding.load_sharded

    def load_sharded_marked(build, load_full, *a, **k):
        def full():
            m = load_full()
            ph.mark("full weights read")
            return m
        ph.mark("load start")
        out = load_sharded(build, full, *a, **k)
        ph.mark("load end")
        return out
    sharding.load_sharded = load_sharded_marked
    wrap(sharding, "shard", "fully_shard")
    wrap(sd, "set_model_state_dict", "broadcast from rank 0")
    wrap(torch.autograd, "backward", "backward")
    learner_load = vapo.Learner._load

    def load_marked(self, *a, **k):
        out = learner_load(self, *a, **k)
        ph.mark("model loaded")
        out.register_forward_pre_hook(lambda *_: ph.mark("forward start"))
        out.register_forward_hook(lambda *_: ph.mark("forward end"))
        return out
    vapo.Learner._load = load_marked


def _plan_mib(cfg, model_dir: str, world: int, seq_tokens: int) -> float:
    """The plan's learner memory (on the device plus offloaded) for this model, ranks, batch and LoRA settings."""
    from async_vapo.deploy.scale import LearnerSetup, ModelShape, learner_memory, micro_batch_rows

    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    a, lc = cfg.algo, cfg.learner
    sharded = world > 1 or lc.fsdp == "on"
    s = LearnerSetup(ranks=world, models=2 if a.uses_critic else 1, seq_tokens=seq_tokens,
                     rows=micro_batch_rows(a.max_tokens_per_micro_batch, a.micro_batch_size, seq_tokens,
                                           a.mini_batch_size, world),
                     compute_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype], sharded=sharded,
                     activation_checkpointing=lc.activation_checkpointing, logprob_chunk_tokens=lc.logprob_chunk_tokens,
                     cpu_offload=lc.cpu_offload and sharded, budget=a.max_tokens_per_micro_batch,
                     lora_rank=cfg.model.lora.rank, lora_targets=tuple(cfg.model.lora.target_modules),
                     critic_lora_rank=cfg.model.critic_lora.rank if a.uses_critic else 0,
                     critic_lora_targets=tuple(cfg.model.critic_lora.target_modules))
    m = learner_memory(shape, s)
    return (m["total"] + m["host"]) / 2**20


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _opt_bytes(opt) -> int:
    return sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if hasattr(v, "numel"))


def lora_overrides(rank: int, algo: str) -> list[str]:
    """``--lora RANK``'s config overrides: adapters on the policy and, where there is a critic, on its trunk."""
    if not rank:
        return []
    out = [f"model.lora.rank={rank}", f"model.lora.alpha={2.0 * rank}"]
    if algo != "grpo":
        out += [f"model.critic_lora.rank={rank}", f"model.critic_lora.alpha={2.0 * rank}"]
    return out


def batch_overrides(groups: int, group_size: int) -> list[str]:
    """One mini-batch of the whole batch, in micro-batches of 2 (the default 2 x 2 batch) or 8."""
    n = groups * group_size
    return [f"algo.prompts_per_step={groups}", f"algo.group_size={group_size}", f"algo.mini_batch_size={n}",
            f"algo.micro_batch_size={2 if n <= 4 else 8}"]


def one_size(size: str, model_dir: str, algo: str = "vapo", trim: bool = False, updates: int = 2, lora: int = 0,
             groups: int = 2, group_size: int = 2) -> dict:
    import torch

    from async_vapo.config import load_config
    from async_vapo.learner.process_group import data_parallel_world, init_process_group
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.types import Group, Trajectory

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        init_process_group()
    rank, world = data_parallel_world()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    out: dict = {"size": size, "algo": algo, "lora": lora, "ranks": world, "rank": rank,
                 "batch": f"{groups}x{group_size}", "rss_start_mib": _rss_mib()}
    ph = _Phases(0, trim)
    _instrument(ph)
    _reset_peak()
    base_kib = ph.base = _status_kib("VmRSS")
    cfg = load_config([ROOT / "configs" / "tiny_cpu.toml"],
                      [f"model.path={model_dir}", "model.critic_init=base", f"algo.name={algo}",
                       *batch_overrides(groups, group_size), *lora_overrides(lora, algo)])
    t0 = time.perf_counter()
    learner = Learner(cfg, model_dir)
    out["rss_after_load_mib"] = _rss_mib()
    grads: dict[str, int] = {}
    step = learner._step

    def counting_step(model, opt, *args):  # gradients exist between backward and the optimiser step
        grads[id(model)] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        ph.mark("optimiser step start")
        out = step(model, opt, *args)
        ph.mark("optimiser step end")
        return out

    learner._step = counting_step
    rng = random.Random(0)
    made = []
    for g in range(groups):
        samples = []
        for k in range(group_size):
            ids = tok(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" + "7;" * rng.randint(10, 18)).input_ids
            samples.append(Trajectory(response_ids=ids + [tok.eos_token_id],
                                      behavior_logprobs=[-1.0] * (len(ids) + 1), finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2)))
        made.append(Group(uid=f"g{g}", prompt="p", answer="7", prompt_ids=tok("3+4-1*2+5-2+1").input_ids,
                            version=0, samples=samples))
    batch = make_rollout_batch(made, tok.pad_token_id)
    t1 = time.perf_counter()
    for k in range(updates):
        ph.mark(f"update {k + 1}")
        learner.update(batch)
    out["updates"] = updates
    out["update_s"] = (time.perf_counter() - t1) / updates
    out["load_s"] = t1 - t0
    out["rss_peak_mib"] = _rss_mib()
    out["grown_mib"] = (_status_kib("VmHWM") - base_kib) / 1024
    out["plan_mib"] = _plan_mib(cfg, model_dir, world, max(Learner._seq_tokens(batch)))
    out["plan_vs_grown"] = out["plan_mib"] / out["grown_mib"]
    ph.mark("update end")
    out["malloc"] = "MALLOC_MMAP_THRESHOLD_=" + os.environ["MALLOC_MMAP_THRESHOLD_"] \
        if "MALLOC_MMAP_THRESHOLD_" in os.environ else "glibc default"
    out["heap_free_end_mib"] = ph.points[-1]["heap_free"]
    out["phases"] = [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in ph.points
                     if not r["at"].endswith(" start") or r["at"] == "load start"]
    models = [(learner.policy, learner.actor_opt)]
    if learner.critic is not None:
        models.append((learner.critic, learner.critic_opt))
    out["params"] = sum(p.numel() for m, _ in models for p in m.parameters())  # whole-model count
    out["trained_params"] = sum(p.numel() for m, _ in models for p in m.parameters() if p.requires_grad)
    out["param_bytes"] = sum(_local_bytes(p) for m, _ in models for p in m.parameters())
    out["grad_bytes"] = sum(grads.values())
    out["optim_bytes"] = sum(_opt_bytes(o) for _, o in models)
    out["state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    if world > 1:
        from async_vapo.learner.process_group import destroy_process_group

        destroy_process_group()
    return out


def run(size: str, ranks: int, model_dir: str, algo: str, trim: bool = False, updates: int = 2,
        glibc_default: bool = False, lora: int = 0, groups: int = 2, group_size: int = 2) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "rank"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        if not glibc_default:  # freed tensors go back to the system (module docstring)
            env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        args = [__file__, "--one", size, "--model-dir", model_dir, "--result", str(res), "--algo", algo,
                "--updates", str(updates), "--lora", str(lora), "--groups", str(groups),
                "--group-size", str(group_size)] + (["--trim"] if trim else [])
        if ranks == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   *args]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:  # e.g. a rank killed for memory (SIGKILL): recorded, not hidden
            tail = proc.stderr.strip().splitlines()[-12:]
            return [{"size": size, "algo": algo, "lora": lora, "ranks": ranks, "rank": r,
                     "batch": f"{groups}x{group_size}", "failed": f"exit status {proc.returncode}",
                     "stderr_tail": tail} for r in range(ranks)]
        return [json.loads(Path(f"{res}.{r}").read_text()) for r in range(ranks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1m,30m,300m")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--algo", default="vapo", choices=["vapo", "grpo"])
    p.add_argument("--lora", type=int, default=0, help="adapter rank (0: the whole models trained)")
    p.add_argument("--model", type=Path, help="an HF model directory measured in place of --sizes")
    p.add_argument("--groups", type=int, default=2, help="prompts in the batch")
    p.add_argument("--group-size", type=int, default=2, help="responses per prompt")
    p.add_argument("--trim", action="store_true",
                   help="hand glibc's freed memory back (malloc_trim) at each phase: the peak of live memory")
    p.add_argument("--updates", type=int, default=2, help="updates measured (the peak of all)")
    p.add_argument("--glibc-default", action="store_true",
                   help="glibc's default (dynamic) mmap threshold: its freed heap memory counts in the peak")
    p.add_argument("--out", type=Path, default=OUT, help="result file (rows of other sizes in it are kept)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        r = one_size(args.one, args.model_dir, args.algo, args.trim, args.updates, args.lora, args.groups,
                     args.group_size)
        Path(f"{args.result}.{r['rank']}").write_text(json.dumps(r))
        return
    from weight_sync import build_model

    # rows of earlier runs for other (size, ranks) are kept: sizes can be measured one at a time
    out = args.out
    old = json.loads(out.read_text()).get("results", []) if out.exists() else []
    sizes = [args.model.name] if args.model else args.sizes.split(",")
    batch = f"{args.groups}x{args.group_size}"

    def key(r: dict) -> tuple:
        return r["size"], r.get("ranks", 1), r.get("algo", "vapo"), r.get("lora", 0), r.get("batch", "2x2")
    wanted = {(z, n, args.algo, args.lora, batch) for z in sizes for n in map(int, args.ranks.split(","))}
    rows = [r for r in old if key(r) not in wanted and "state_bytes" in r]

    def measure(size: str, d: str) -> None:
        for ranks in map(int, args.ranks.split(",")):
            print(f"[learner_memory] {size} {args.algo} lora {args.lora} batch {batch} on {ranks} rank(s) ...",
                  file=sys.stderr, flush=True)
            rows.extend(run(size, ranks, d, args.algo, args.trim, args.updates, args.glibc_default, args.lora,
                            args.groups, args.group_size))
    if args.model:
        measure(args.model.name, str(args.model.resolve()))
    else:
        for size in sizes:
            with tempfile.TemporaryDirectory() as d:
                model, _ = build_model(size, Path(d))
                del model
                measure(size, d)
    order = {"1m": 0, "30m": 1, "300m": 2}
    for r in rows:
        r.setdefault("algo", "vapo")
        r.setdefault("lora", 0)
        r.setdefault("batch", "2x2")
    rows.sort(key=lambda r: (r["algo"] != "vapo", order.get(r["size"], 9), r["batch"], r["lora"], r["ranks"],
                             r["rank"]))
    one = {(r["size"], r["algo"], r["lora"], r["batch"]): r for r in rows if r["ranks"] == 1 and "state_bytes" in r}
    for r in rows:
        if "state_bytes" not in r:
            continue
        if (r["size"], r["algo"], r["lora"], r["batch"]) in one:
            r["state_vs_1_rank"] = r["state_bytes"] / one[(r["size"], r["algo"], r["lora"], r["batch"])]["state_bytes"]
        full = one.get((r["size"], r["algo"], 0, r["batch"]))
        if r["lora"] and full is not None and r["ranks"] == 1:  # the adapters beside the full fine-tune
            r["vs_full"] = {k: r[k] / full[k] for k in ("state_bytes", "grown_mib", "update_s")}
    print(f"{'algo':>5} {'size':>22} {'batch':>5} {'lora':>4} {'ranks':>5} {'rank':>4} {'params':>12} "
          f"{'trained':>12} {'state MiB':>10} {'vs 1 rank':>9} {'after load MiB':>14} {'peak RSS MiB':>12} "
          f"{'update s':>8} {'grown MiB':>9} {'plan MiB':>8} {'plan/grown':>10}")
    for r in rows:
        head = f"{r['algo']:>5} {r['size']:>22} {r['batch']:>5} {r['lora']:>4} {r['ranks']:>5} {r['rank']:>4}"
        if "failed" in r:
            print(f"{head} failed: {r['failed']}")
            continue
        print(f"{head} {r['params']:>12,} {r.get('trained_params', r['params']):>12,} "
              f"{r['state_bytes'] / 2**20:>10.0f} {r.get('state_vs_1_rank', float('nan')):>9.3f} "
              f"{r['rss_after_load_mib']:>14.0f} "
              f"{r['rss_peak_mib']:>12.0f} {r['update_s']:>8.1f} {r.get('grown_mib', float('nan')):>9.0f} "
              f"{r.get('plan_mib', float('nan')):>8.0f} {r.get('plan_vs_grown', float('nan')):>10.3f}")
    for r in rows:
        if "vs_full" in r:
            v = r["vs_full"]
            print(f"[learner_memory] {r['algo']} {r['size']} batch {r['batch']}, LoRA rank {r['lora']} against the "
                  f"full fine-tune: state {v['state_bytes']:.3f}x, grown {v['grown_mib']:.3f}x, seconds per update "
                  f"{v['update_s']:.3f}x")
    out.parent.mkdir(parents=True, exist_ok=True)
    flags = " --glibc-default --out " + str(out.relative_to(ROOT) if out.is_relative_to(ROOT) else out) \
        if args.glibc_default else ""
    out.write_text(json.dumps({"command": f"python benchmarks/learner_memory.py --sizes SIZE --ranks 1,2 [--algo grpo]"
                                          f" [--lora RANK] [--model DIR --groups G --group-size K]{flags} (one "
                                          f"size at a time here; rows of other sizes and settings are kept)",
                               "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
