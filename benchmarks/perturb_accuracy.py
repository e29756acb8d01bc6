"""Held-out accuracy of a config's base model after an undirected step: every parameter moved by ±SCALE (random
signs), as large as Adam's steps or larger, to tell a fragile model from a harmful update direction.

    .venv/bin/python benchmarks/perturb_accuracy.py --config configs/tiny_long_cpu.toml --scales 1e-4,3e-4,1e-3

Each perturbed copy is written to a temporary directory and evaluated by ``benchmarks/base_accuracy.py`` (the
config's held-out split and evaluation settings, the real vLLM engine). Writes ``--out`` (JSON).

With ``--mismatch`` the perturbation is a controlled rollout–learner mismatch instead: only the *engine's* copy of
the weights is perturbed (loaded in place into one running float32 vLLM engine, scale 0 first: the unperturbed
floor), the float32 learner keeps the base weights, and ``benchmarks/mismatch.py``'s :func:`measure` reports what
every update would log (``mismatch/*``: k3 KL, |log ratio| per token and per sequence) and what each behaviour
correction would truncate or mask, on ``--prompts`` training problems:

    .venv/bin/python benchmarks/perturb_accuracy.py --config configs/tiny_cpu.toml --mismatch \
        --scales 1e-3,3e-3,1e-2,3e-2 --out benchmarks/results/mismatch/tiny_cpu_perturbed.json

Training under such a mismatch (every version the engine serves perturbed with the same draw as :func:`perturb_`,
the learner trained and evaluated on its own weights), with and without each behaviour correction, is
``benchmarks/mismatch_training.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_io import write_result

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--scales", default="1e-4,3e-4,1e-3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/long_task/perturbed_accuracy.json")
    p.add_argument("--mismatch", action="store_true",
                   help="perturb the engine's weights only and measure the rollout-learner mismatch (module doc)")
    p.add_argument("--prompts", type=int, default=64, help="--mismatch: training problems sampled per scale")
    args = p.parse_args()
    if args.mismatch:
        write_result(args.out, mismatch_sweep(args.config, args.scales.split(","), args.seed, args.prompts))
        return 0

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model

    base = ensure_base_model(load_config([args.config]), progress=False)
    doc = {"config": args.config, "base_model": str(base), "seed": args.seed, "accuracy": {}}
    with tempfile.TemporaryDirectory(prefix="perturbed-") as tmp:
        for scale in args.scales.split(","):
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            perturb_(model, float(scale), args.seed)
            out = Path(tmp) / f"scale-{scale}"
            model.save_pretrained(out)
            AutoTokenizer.from_pretrained(str(base)).save_pretrained(out)
            for f in base.glob("async_vapo_*.json"):  # the build's record, which the evaluation reads
                shutil.copy(f, out / f.name)
            res = Path(tmp) / f"scale-{scale}.json"
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "base_accuracy.py"), "--config", args.config,
                            "--out", str(res), f"model.path={out}"], check=True, cwd=ROOT,
                           stdout=subprocess.DEVNULL)
            doc["accuracy"][scale] = json.loads(res.read_text())["eval/accuracy"]
            print(f"±{scale} on every parameter: held-out accuracy {doc['accuracy'][scale]:.3f}", flush=True)
    write_result(args.out, doc)
    return 0


def perturb_(model, scale: float, seed: int) -> None:
    """Move every parameter of ``model`` by ±``scale`` (random signs from ``seed``), in place."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in model.parameters():
            q.add_(scale * torch.sign(torch.randn(q.shape, generator=gen)))


def mismatch_sweep(config: str, scales: list[str], seed: int, prompts: int) -> dict:
    """One float32 engine serving the base weights perturbed by each scale in turn (0 first) against the unperturbed
    float32 learner: ``measure``'s result per scale."""
    import time

    from mismatch import engine_for, measure, setup

    cfg, base, learner, encoder, train, held_out = setup(config, [])
    engine = engine_for(cfg, base, encoder, train + held_out, "float32")
    doc = {"config": config, "base_model": str(base), "seed": seed, "prompts": prompts,
           "group_size": cfg.algo.group_size, "perturbed": "the engine's weights only (learner: base, float32)",
           "engine_dtype": "float32", "mismatch": {}}
    try:
        for version, scale in enumerate(["0", *scales], start=1):
            t0 = time.perf_counter()
            policy = copy.deepcopy(learner.policy)
            perturb_(policy, float(scale), seed)
            engine.load_weights(learner.precision.engine_state({k: v.detach().cpu()
                                                                for k, v in policy.state_dict().items()}), version)
            res = measure(engine, learner, cfg, encoder, train[:prompts], seed=seed)
            res["wall_s"] = round(time.perf_counter() - t0, 1)
            doc["mismatch"][scale] = res
            m, c = res["mismatch"], res["corrections"]
            print(f"engine weights ±{scale}: k3 {m['k3']:.3g}, |log ratio| mean {m['abs_log_ratio_mean']:.3g} "
                  f"max {m['abs_log_ratio_max']:.3g}, sequence |log ratio| mean {m['seq_abs_log_ratio_mean']:.3g}; "
                  f"token MIS masks {c['token_mis_0.5_2']['masked_frac']:.3f}, IcePop "
                  f"{c['icepop_0.5_5']['masked_frac']:.3f}, sequence MIS {c['seq_mis_0.5_2']['masked_frac']:.3f}",
                  flush=True)
    finally:
        engine.close()
    return doc


if __name__ == "__main__":
    sys.exit(main())
