"""Held-out accuracy of a config's base model after an undirected step: every parameter moved by ±SCALE (random
signs), as large as Adam's steps or larger, to tell a fragile model from a harmful update direction.

    .venv/bin/python benchmarks/perturb_accuracy.py --config configs/tiny_long_cpu.toml --scales 1e-4,3e-4,1e-3

Each perturbed copy is written to a temporary directory and evaluated by ``benchmarks/base_accuracy.py`` (the
config's held-out split and evaluation settings, the real vLLM engine). Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model

    base = ensure_base_model(load_config([args.config]), progress=False)
    doc = {"config": args.config, "base_model": str(base), "seed": args.seed, "accuracy": {}}
    with tempfile.TemporaryDirectory(prefix="perturbed-") as tmp:
        for scale in args.scales.split(","):
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
            gen = torch.Generator().manual_seed(args.seed)
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(float(scale) * torch.sign(torch.randn(q.shape, generator=gen)))
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


if __name__ == "__main__":
    sys.exit(main())
