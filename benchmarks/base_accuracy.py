"""Held-out accuracy of a config's base model (what a training run's first evaluation measures), by chain length.

    .venv/bin/python benchmarks/base_accuracy.py --config configs/tiny_long_cpu.toml [--out FILE.json] [--range 0.1,0.4]

Builds the base model first if it is not cached. With ``--range LO,HI`` the exit status is 3 when the accuracy
falls outside [LO, HI] (benchmarks/long_task.sh stops there rather than train from an unsuitable base).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--out")
    p.add_argument("--range", help="LO,HI: exit 3 when the accuracy is outside it")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder, Rollout, evaluate
    from async_vapo.tasks import load_task
    from async_vapo.verify.sandbox import VerifierPool

    cfg = load_config([args.config], args.overrides)
    base = ensure_base_model(cfg)
    tok = AutoTokenizer.from_pretrained(str(base))
    train, held_out = load_task(cfg)
    encoder = PromptEncoder.from_config(cfg, tok)
    engine = VLLMEngine(EngineSpec.from_config(cfg, base, longest_prompt=encoder.longest(train + held_out)))
    t0 = time.perf_counter()
    verifier = VerifierPool.from_config(cfg.verifier)
    try:
        metrics, examples = evaluate(Rollout(cfg, engine, verifier, encoder), held_out, cfg)
    finally:
        engine.close()
        verifier.close()
    build = json.loads((base / "async_vapo_base.json").read_text())
    result = {"config": args.config, "overrides": args.overrides, "base_model": str(base),
              "sft_seconds": build["sft_seconds"], "final_sft_loss": build["final_sft_loss"],
              "held_out_problems": len(held_out), "samples_per_problem": cfg.rollout.eval_samples,
              "eval_wall_s": round(time.perf_counter() - t0, 1), **metrics, "examples": examples[:3]}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    status = 0
    if args.range:
        lo, hi = map(float, args.range.split(","))
        if not lo <= metrics["eval/accuracy"] <= hi:
            print(f"base held-out accuracy {metrics['eval/accuracy']:.3f} is outside [{lo}, {hi}]", file=sys.stderr)
            status = 3
    return status


if __name__ == "__main__":
    sys.exit(main())
