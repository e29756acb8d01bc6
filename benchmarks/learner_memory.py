"""Peak resident memory of the learner as the model grows: policy + critic (float32) with their AdamW
states, through one VAPO update on a batch of 16 responses (micro-batches of 4), at about 1 M, 30 M and
300 M parameters (the random Qwen2-architecture models of benchmarks/weight_sync.py). Each size runs in
its own process so the peaks do not mix.

    .venv/bin/python benchmarks/learner_memory.py [--sizes 1m,30m,300m]

Prints a table and writes benchmarks/results/learner_memory/result.json.
"""

from __future__ import annotations

import argparse
import json
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


def one_size(size: str) -> dict:
    import torch
    from weight_sync import build_model

    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.rollout.types import Group, Trajectory

    torch.set_num_threads(1)
    out: dict = {"size": size, "rss_start_mib": _rss_mib()}
    with tempfile.TemporaryDirectory() as d:
        model, tok = build_model(size, Path(d))
        out["params"] = sum(p.numel() for p in model.parameters())
        del model
        cfg = load_config([ROOT / "configs" / "tiny_cpu.toml"],
                          [f"model.path={d}", "model.critic_init=base", "algo.mini_batch_size=16",
                           "algo.micro_batch_size=4", "algo.prompts_per_step=2"])
        t0 = time.perf_counter()
        learner = Learner(cfg, d)
        out["rss_after_load_mib"] = _rss_mib()
        rng = random.Random(0)
        groups = []
        for g in range(2):
            samples = []
            for k in range(8):
                ids = tok(f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" + "7;" * rng.randint(10, 28)).input_ids
                samples.append(Trajectory(response_ids=ids + [tok.eos_token_id],
                                          behavior_logprobs=[-1.0] * (len(ids) + 1), finish_reason="stop",
                                          reward=1.0 if k % 2 else -1.0, correct=bool(k % 2)))
            groups.append(Group(uid=f"g{g}", prompt="p", answer="7", prompt_ids=tok("3+4-1*2+5-2+1").input_ids,
                                version=0, samples=samples))
        batch = make_rollout_batch(groups, tok.pad_token_id)
        t1 = time.perf_counter()
        learner.update(batch)
        out["update_s"] = time.perf_counter() - t1
        out["tokens"] = int(batch.tokens.response_mask.sum())
        out["rss_peak_mib"] = _rss_mib()
        out["load_s"] = t1 - t0
    # what the states alone take: params + grads + 2 AdamW moments, policy and critic, float32
    out["state_estimate_mib"] = 2 * 4 * 4 * out["params"] / 2**20
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1m,30m,300m")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_size(args.one)))
        return
    rows = []
    for size in args.sizes.split(","):
        print(f"[learner_memory] {size} ...", file=sys.stderr, flush=True)
        res = subprocess.run([sys.executable, __file__, "--one", size], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
    print(f"{'size':>6} {'params':>12} {'after load MiB':>15} {'peak MiB':>10} {'states est. MiB':>16} {'update s':>9}")
    for r in rows:
        print(f"{r['size']:>6} {r['params']:>12,} {r['rss_after_load_mib']:>15.0f} {r['rss_peak_mib']:>10.0f} "
              f"{r['state_estimate_mib']:>16.0f} {r['update_s']:>9.1f}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"command": "python benchmarks/learner_memory.py --sizes " + args.sizes,
                               "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
