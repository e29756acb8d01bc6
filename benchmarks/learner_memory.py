"""Per-rank memory of the learner as the model grows, in one process and sharded over 2 gloo ranks with FSDP2:
policy + critic (float32 masters) with their AdamW states, through one VAPO update, at about 1 M, 30 M and 300 M
parameters (the random Qwen2-architecture models of benchmarks/weight_sync.py). Each (size, ranks) runs in its own
processes (2 ranks: one torchrun launch) so that the peaks do not mix.

Reported per rank:
* ``state_bytes``: bytes of this rank's parameters + gradients (at the optimiser step) + AdamW state of policy and
  critic, counted from the tensors (a sharded parameter counts its local shard);
* ``rss_peak_mib``: the process's peak resident memory (it also holds activations, the batch, torch's allocator
  caches and, on rank 0, the full weights read once at start-up and broadcast);
* ``grown_mib``: peak resident memory (VmHWM, reset through /proc/self/clear_refs once torch and transformers are
  imported) less the resident memory at that moment: what loading and one update added, the quantity the plan
  predicts;
* ``plan_mib``: ``async_vapo.deploy.scale.learner_memory`` for this model, these ranks, this batch's longest row
  and the learner settings of this run (float32 on the CPU, so no 16-bit copies), on the device plus offloaded;
  ``plan_vs_grown`` = plan_mib / grown_mib.
The goal for sharding: ``state_bytes`` at 2 ranks <= 0.55 x at 1 rank.

    .venv/bin/python benchmarks/learner_memory.py [--sizes 1m,30m,300m] [--ranks 1,2] [--algo grpo]

``--algo grpo`` measures the policy alone (no critic): half the memory, for a machine that cannot hold both.

Prints a table and writes benchmarks/results/learner_memory/result.json. The update runs on a small batch
(4 responses of ~40 tokens): the states do not depend on it, and a 300 M update on 16 responses took 7 minutes on
this 2-core machine.
"""

from __future__ import annotations

import argparse
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


def _plan_mib(cfg, model_dir: str, world: int, seq_tokens: int) -> float:
    from async_vapo.deploy.scale import LearnerSetup, ModelShape, learner_memory, micro_batch_rows

    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    a, lc = cfg.algo, cfg.learner
    sharded = world > 1 or lc.fsdp == "on"
    s = LearnerSetup(ranks=world, models=2 if a.uses_critic else 1, seq_tokens=seq_tokens,
                     rows=micro_batch_rows(a.max_tokens_per_micro_batch, a.micro_batch_size, seq_tokens,
                                           a.mini_batch_size, world),
                     compute_bytes={"float32": 4, "bfloat16": 2, "float16": 2}[cfg.model.dtype], sharded=sharded,
                     activation_checkpointing=lc.activation_checkpointing, logprob_chunk_tokens=lc.logprob_chunk_tokens,
                     cpu_offload=lc.cpu_offload and sharded, budget=a.max_tokens_per_micro_batch)
    m = learner_memory(shape, s)
    return (m["total"] + m["host"]) / 2**20


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _opt_bytes(opt) -> int:
    return sum(_local_bytes(v) for s in opt.state.values() for v in s.values() if hasattr(v, "numel"))


def one_size(size: str, model_dir: str, algo: str = "vapo") -> dict:
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
    out: dict = {"size": size, "algo": algo, "ranks": world, "rank": rank, "rss_start_mib": _rss_mib()}
    _reset_peak()
    base_kib = _status_kib("VmRSS")
    cfg = load_config([ROOT / "configs" / "tiny_cpu.toml"],
                      [f"model.path={model_dir}", "model.critic_init=base", "algo.mini_batch_size=4",
                       "algo.micro_batch_size=2", "algo.prompts_per_step=2", "algo.group_size=2", f"algo.name={algo}"])
    t0 = time.perf_counter()
    learner = Learner(cfg, model_dir)
    out["rss_after_load_mib"] = _rss_mib()
    grads: dict[str, int] = {}
    step = learner._step

    def counting_step(model, opt, *args):  # gradients exist between backward and the optimiser step
        grads[id(model)] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        return step(model, opt, *args)

    learner._step = counting_step
    rng = random.Random(0)
    groups = []
    for g in range(2):
        samples = []
        for k in range(2):
            ids = tok(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" + "7;" * rng.randint(10, 18)).input_ids
            samples.append(Trajectory(response_ids=ids + [tok.eos_token_id],
                                      behavior_logprobs=[-1.0] * (len(ids) + 1), finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2)))
        groups.append(Group(uid=f"g{g}", prompt="p", answer="7", prompt_ids=tok("3+4-1*2+5-2+1").input_ids,
                            version=0, samples=samples))
    batch = make_rollout_batch(groups, tok.pad_token_id)
    t1 = time.perf_counter()
    learner.update(batch)
    out["update_s"] = time.perf_counter() - t1
    out["load_s"] = t1 - t0
    out["rss_peak_mib"] = _rss_mib()
    out["grown_mib"] = (_status_kib("VmHWM") - base_kib) / 1024
    out["plan_mib"] = _plan_mib(cfg, model_dir, world, max(Learner._seq_tokens(batch)))
    out["plan_vs_grown"] = out["plan_mib"] / out["grown_mib"]
    models = [(learner.policy, learner.actor_opt)]
    if learner.critic is not None:
        models.append((learner.critic, learner.critic_opt))
    out["params"] = sum(p.numel() for m, _ in models for p in m.parameters())  # whole-model count
    out["param_bytes"] = sum(_local_bytes(p) for m, _ in models for p in m.parameters())
    out["grad_bytes"] = sum(grads.values())
    out["optim_bytes"] = sum(_opt_bytes(o) for _, o in models)
    out["state_bytes"] = out["param_bytes"] + out["grad_bytes"] + out["optim_bytes"]
    if world > 1:
        from async_vapo.learner.process_group import destroy_process_group

        destroy_process_group()
    return out


def run(size: str, ranks: int, model_dir: str, algo: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        res = Path(d) / "rank"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        args = [__file__, "--one", size, "--model-dir", model_dir, "--result", str(res), "--algo", algo]
        if ranks == 1:
            cmd = [sys.executable, *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   *args]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:  # e.g. a rank killed for memory (SIGKILL): recorded, not hidden
            tail = proc.stderr.strip().splitlines()[-12:]
            return [{"size": size, "algo": algo, "ranks": ranks, "rank": r, "failed": f"exit status {proc.returncode}",
                     "stderr_tail": tail} for r in range(ranks)]
        return [json.loads(Path(f"{res}.{r}").read_text()) for r in range(ranks)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1m,30m,300m")
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--algo", default="vapo", choices=["vapo", "grpo"])
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        r = one_size(args.one, args.model_dir, args.algo)
        Path(f"{args.result}.{r['rank']}").write_text(json.dumps(r))
        return
    from weight_sync import build_model

    # rows of earlier runs for other (size, ranks) are kept: sizes can be measured one at a time
    old = json.loads(OUT.read_text()).get("results", []) if OUT.exists() else []
    wanted = {(z, n, args.algo) for z in args.sizes.split(",") for n in map(int, args.ranks.split(","))}
    rows = [r for r in old if (r["size"], r.get("ranks", 1), r.get("algo", "vapo")) not in wanted
            and "state_bytes" in r]
    for size in args.sizes.split(","):
        with tempfile.TemporaryDirectory() as d:
            model, _ = build_model(size, Path(d))
            del model
            for ranks in map(int, args.ranks.split(",")):
                print(f"[learner_memory] {size} on {ranks} rank(s) ...", file=sys.stderr, flush=True)
                rows += run(size, ranks, d, args.algo)
    order = {"1m": 0, "30m": 1, "300m": 2}
    for r in rows:
        r.setdefault("algo", "vapo")
    rows.sort(key=lambda r: (r["algo"] != "vapo", order.get(r["size"], 9), r["ranks"], r["rank"]))
    one = {(r["size"], r["algo"]): r["state_bytes"] for r in rows if r["ranks"] == 1 and "state_bytes" in r}
    for r in rows:
        if (r["size"], r["algo"]) in one and "state_bytes" in r:
            r["state_vs_1_rank"] = r["state_bytes"] / one[(r["size"], r["algo"])]
    print(f"{'algo':>5} {'size':>5} {'ranks':>5} {'rank':>4} {'params':>12} {'state MiB':>10} {'vs 1 rank':>9} "
          f"{'after load MiB':>14} {'peak RSS MiB':>12} {'update s':>8} {'grown MiB':>9} {'plan MiB':>8} "
          f"{'plan/grown':>10}")
    for r in rows:
        if "failed" in r:
            print(f"{r['algo']:>5} {r['size']:>5} {r['ranks']:>5} {r['rank']:>4} failed: {r['failed']}")
            continue
        print(f"{r['algo']:>5} {r['size']:>5} {r['ranks']:>5} {r['rank']:>4} {r['params']:>12,} "
              f"{r['state_bytes'] / 2**20:>10.0f} {r.get('state_vs_1_rank', float('nan')):>9.3f} "
              f"{r['rss_after_load_mib']:>14.0f} "
              f"{r['rss_peak_mib']:>12.0f} {r['update_s']:>8.1f} {r.get('grown_mib', float('nan')):>9.0f} "
              f"{r.get('plan_mib', float('nan')):>8.0f} {r.get('plan_vs_grown', float('nan')):>10.3f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/learner_memory.py --sizes SIZE --ranks 1,2 [--algo grpo] "
                                          "(one size at a time here; rows of other sizes are kept)", "results": rows},
                              indent=2) + "\n")


if __name__ == "__main__":
    main()
