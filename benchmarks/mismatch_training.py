"""Training under a controlled rollout–learner mismatch, with and without each behaviour correction.

    .venv/bin/python benchmarks/mismatch_training.py --config configs/tiny_cpu.toml --scale 3e-2 \
        --updates 20 --eval-every 5 --seeds 0,1 --out-dir benchmarks/results/mismatch/training

**The mismatch is made, not found.** The one-process trainer (``async_vapo.trainer.train``) runs with its
``engine_weights`` hook: every version the engine serves for generating training samples, the base model's first one
included, is the learner's weights with every parameter moved by ±SCALE, the signs a fixed random pattern drawn once
per run from the run's seed (``perturb_accuracy.perturb_`` over the base model's parameters in order: the same pattern
``perturb_accuracy.py --mismatch`` measured for seed 0) and the same for every version. The learner keeps and trains
its own unperturbed float32 weights; held-out evaluation runs on the learner's weights (the trainer loads them into
the engine for the evaluation and puts the perturbed copy back after), so accuracy measures the trained policy, not
the perturbed copy that generated its samples. The engine's log-probs are the perturbed copy's: every correction sees
the mismatch as it would see a real one.

Arms (``--arms``; each run with the config's settings and these overrides):

- ``unperturbed``: the engine gets the learner's weights, today's default correction (token TIS, cap 5);
- ``none``: perturbed, ``algo.behavior_correction = false`` (the mismatch is only measured);
- ``token_tis`` (today's default), ``seq_tis``, ``geo_tis``: perturbed, truncated IS per token / sequence / geometric
  mean, cap 5;
- ``token_mis``: perturbed, token TIS with tokens whose ρ leaves [0.5, 2] masked (masked IS);
- ``icepop``: perturbed, token TIS with a token mask [0.5, 5] (IcePop's α, β);
- ``seq_mask``: perturbed, token TIS with whole responses masked when Π ρ leaves [0.5, 2] (sequence masked IS).

One float32 engine is started once and reused by every run (its weights replaced at each run's start); the runs
follow each other in one process. Per run: the train rows' ``mismatch/k3`` and ``correction/*`` and the held-out
accuracy at every evaluation. Writes ``OUT_DIR/results.json``, ``OUT_DIR/README.md`` (tables, the command) and
``OUT_DIR/curves.png``; each run's directory (metrics.jsonl) under ``OUT_DIR/runs/``. ``--report`` redraws the
table and plot from ``results.json`` only.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from pathlib import Path

from bench_io import write_result

ROOT = Path(__file__).resolve().parents[1]

MASK_TOKEN = ["algo.behavior_weight=token"]
ARMS: dict[str, tuple[bool, list[str]]] = {  # name: (engine weights perturbed, overrides)
    "unperturbed": (False, []),
    "none": (True, ["algo.behavior_correction=false"]),
    "token_tis": (True, ["algo.behavior_weight=token"]),
    "seq_tis": (True, ["algo.behavior_weight=sequence"]),
    "geo_tis": (True, ["algo.behavior_weight=geometric"]),
    "token_mis": (True, [*MASK_TOKEN, "algo.behavior_mask=token", "algo.behavior_mask_low=0.5",
                         "algo.behavior_mask_high=2.0"]),
    "icepop": (True, [*MASK_TOKEN, "algo.behavior_mask=token", "algo.behavior_mask_low=0.5",
                      "algo.behavior_mask_high=5.0"]),
    "seq_mask": (True, [*MASK_TOKEN, "algo.behavior_mask=sequence", "algo.behavior_mask_low=0.5",
                        "algo.behavior_mask_high=2.0"]),
}
LABELS = {"unperturbed": "unperturbed (token TIS)", "none": "perturbed, no correction",
          "token_tis": "perturbed, token TIS (default)", "seq_tis": "perturbed, sequence TIS",
          "geo_tis": "perturbed, geometric TIS", "token_mis": "perturbed, token masked IS [0.5, 2]",
          "icepop": "perturbed, IcePop token mask [0.5, 5]", "seq_mask": "perturbed, sequence mask [0.5, 2]"}
ROW_KEYS = ("mismatch/k3", "mismatch/abs_log_ratio_mean", "mismatch/abs_log_ratio_max", "mismatch/seq_k3",
            "correction/truncated_frac", "correction/masked_frac", "correction/weight_mean", "rollout/accuracy")


def sign_pattern(base: Path, seed: int) -> dict:
    """name -> ±1 tensor of every parameter of the base model, drawn as ``perturb_accuracy.perturb_`` draws them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.sign(torch.randn(q.shape, generator=gen)) for name, q in model.named_parameters()}


def perturbed_copy(signs: dict, scale: float, seen: list):
    """The ``engine_weights`` hook: a new state with each parameter in ``signs`` moved by ±scale (out of place)."""

    def engine_weights(state: dict, version: int) -> dict:
        out = {k: (v + scale * signs[k].to(v.dtype)) if k in signs else v for k, v in state.items()}
        seen.append((version, sum(k in signs for k in state), len(state)))
        return out

    return engine_weights


def run_arm(args, arm: str, seed: int, engine, base: Path) -> dict:
    from async_vapo.config import load_config
    from async_vapo.trainer import train

    perturbed, overrides = ARMS[arm]
    name = f"{arm}_s{seed}"
    run_dir = Path(args.out_dir) / "runs" / name
    cfg = load_config([args.config], [*args.set, *overrides, f"train.seed={seed}", f"rollout.seed={seed}",
                                      f"train.total_steps={args.updates}", f"train.eval_every={args.eval_every}",
                                      "train.checkpoint_every=0", "train.max_minutes=null", "train.threads=1",
                                      f"train.name={name}", f"train.output_dir={run_dir}"])
    seen: list = []
    hook = perturbed_copy(sign_pattern(base, seed), args.scale, seen) if perturbed else None
    t0 = time.perf_counter()
    summary = train(cfg, progress=False, engine=engine, engine_weights=hook)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    trains = [r for r in rows if r["kind"] == "train"]
    res = {"arm": arm, "seed": seed, "perturbed": perturbed, "scale": args.scale if perturbed else 0.0,
           "overrides": overrides, "wall_s": round(time.perf_counter() - t0, 1),
           "eval": [{"step": r["step"], "accuracy": r["eval/accuracy"]} for r in evals],
           "train": [{"step": r.get("step"), **{k: r[k] for k in ROW_KEYS if k in r}} for r in trains],
           "engine_loads": [list(x) for x in seen], "summary": summary}
    res["acc_start"], res["acc_end"] = evals[0]["eval/accuracy"], evals[-1]["eval/accuracy"]
    res["gain"] = res["acc_end"] - res["acc_start"]
    for k in ROW_KEYS:
        vals = [r[k] for r in trains if k in r and r[k] is not None and not math.isnan(r[k])]
        res[f"mean/{k}"] = sum(vals) / len(vals) if vals else None
    print(f"{name}: accuracy {res['acc_start']:.3f} -> {res['acc_end']:.3f} (gain {res['gain']:+.3f}), "
          f"k3 {res['mean/mismatch/k3']:.3g}, truncated {res['mean/correction/truncated_frac']}, "
          f"masked {res['mean/correction/masked_frac']}, {res['wall_s']:.0f} s", flush=True)
    return res


def mean_se(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, float("nan")
    return m, math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def fmt(x, pct=False, digits=None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if pct:
        return f"{100 * x:.1f} %"
    if digits is not None:
        return f"{x:.{digits}f}"
    return f"{x:.2g}" if abs(x) < 0.01 else f"{x:.3g}"


def report(doc: dict, out_dir: Path) -> str:
    """Markdown table per arm (mean ± standard error over seeds) and the curves' plot."""
    runs = doc["runs"]
    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    base_gain = mean_se([r["gain"] for r in runs if r["arm"] == "unperturbed"])[0] if "unperturbed" in arms else None
    lines = ["| arm | seeds | held-out start | held-out end | gain (± s.e.) | share of unperturbed gain | "
             "training samples correct (engine) | mismatch/k3 | \\|log ρ\\| max | truncated (TIS cap 5) | masked |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        rs = [r for r in runs if r["arm"] == a]
        s, _ = mean_se([r["acc_start"] for r in rs])
        e, _ = mean_se([r["acc_end"] for r in rs])
        g, gse = mean_se([r["gain"] for r in rs])
        share = f"{100 * g / base_gain:.0f} %" if base_gain and a != "unperturbed" else "–"

        def avg(k, rs=rs):
            v = [r[f"mean/{k}"] for r in rs if r.get(f"mean/{k}") is not None]
            return sum(v) / len(v) if v else None

        lines.append(f"| {LABELS[a]} | {len(rs)} | {100 * s:.1f} % | {100 * e:.1f} % | "
                     f"{100 * g:+.1f} ± {fmt(100 * gse, digits=1)} pts | {share} | "
                     f"{fmt(avg('rollout/accuracy'), True)} | {fmt(avg('mismatch/k3'))} | "
                     f"{fmt(avg('mismatch/abs_log_ratio_max'))} | {fmt(avg('correction/truncated_frac'), True)} | "
                     f"{fmt(avg('correction/masked_frac'), True)} |")
    table = "\n".join(lines)
    plot(doc, out_dir / "curves.png")
    return table


def plot(doc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, a in enumerate([a for a in ARMS if any(r["arm"] == a for r in doc["runs"])]):
        rs = [r for r in doc["runs"] if r["arm"] == a]
        steps = [p["step"] for p in rs[0]["eval"]]
        for r in rs:
            ax.plot([p["step"] for p in r["eval"]], [p["accuracy"] for p in r["eval"]], color=colors[i % len(colors)],
                    alpha=0.25, lw=1)
        mean = [sum(r["eval"][j]["accuracy"] for r in rs if j < len(r["eval"])) /
                sum(j < len(r["eval"]) for r in rs) for j in range(len(steps))]
        ax.plot(steps, mean, color=colors[i % len(colors)], lw=2, ls="--" if a == "none" else "-",
                label=f"{LABELS[a]} ({len(rs)} seeds)")
    ax.set_xlabel("update")
    ax.set_ylabel("held-out accuracy (learner's weights)")
    ax.set_title(f"{doc['config']}: engine's copy of the weights ±{doc['scale']:g} (artificial mismatch)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_readme(doc: dict, out_dir: Path) -> None:
    table = report(doc, out_dir)
    text = (f"# Training under an artificial rollout–learner mismatch\n\n    {doc['command']}\n\n"
            f"Engine's copy of the weights moved by ±{doc['scale']:g} on every parameter (fixed random signs per "
            f"seed, the same at every version, the first included); the learner trains its own float32 weights and "
            f"is evaluated on them. {doc['updates']} updates, held-out evaluation every {doc['eval_every']} "
            f"(the config's held-out split: {doc['num_eval']} problems × {doc['eval_samples']} samples). Mean over "
            f"seeds {', '.join(map(str, doc['seeds']))}; ± the standard error over seeds. The k3, |log ρ| max, "
            f"truncated and masked columns are means over the run's updates of the train rows' "
            f"`mismatch/*` and `correction/*`.\n\n{table}\n\n![curves](curves.png)\n")
    (out_dir / "README.md").write_text(text)
    print(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_cpu.toml")
    p.add_argument("--scale", type=float, default=3e-2)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out-dir", default="benchmarks/results/mismatch/training")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE config override for every run")
    p.add_argument("--report", action="store_true", help="redraw README.md and curves.png from results.json")
    p.add_argument("--append", action="store_true",
                   help="add this invocation's runs to OUT_DIR/results.json (same scale, updates and evaluation)")
    args = p.parse_args()
    out_dir = Path(args.out_dir)
    if args.report:
        write_readme(json.loads((out_dir / "results.json").read_text()), out_dir)
        return 0

    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task

    cfg = load_config([args.config], [*args.set, "train.threads=1"])
    base = ensure_base_model(cfg, progress=False)
    encoder = PromptEncoder.from_config(cfg, AutoTokenizer.from_pretrained(str(base)))
    train_set, eval_set = load_task(cfg)
    engine = VLLMEngine(EngineSpec.from_config(cfg, base, longest_prompt=encoder.longest(train_set + eval_set)))
    argv = " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = {"command": f".venv/bin/python benchmarks/mismatch_training.py {argv}", "config": args.config,
           "scale": args.scale, "updates": args.updates, "eval_every": args.eval_every,
           "seeds": [int(s) for s in args.seeds.split(",")], "num_eval": cfg.task.num_eval,
           "eval_samples": cfg.rollout.eval_samples, "engine_dtype": cfg.model.dtype, "set": args.set,
           "perturbation": "engine's copy only: every parameter ±scale, fixed random signs from the run's seed "
                           "(perturb_accuracy.perturb_'s draw), the same at every version, the first included; "
                           "held-out evaluation on the learner's own weights",
           "engine_start_s": engine.start_seconds, "runs": []}
    if args.append and (out_dir / "results.json").exists():
        prev = json.loads((out_dir / "results.json").read_text())
        if (prev["scale"], prev["updates"], prev["eval_every"]) != (args.scale, args.updates, args.eval_every):
            raise SystemExit("--append: scale, updates or eval-every differ from results.json's")
        doc["command"] = f"{prev['command']}; then {doc['command']}"
        doc["seeds"] = sorted(set(prev["seeds"]) | set(doc["seeds"]))
        doc["runs"] = prev["runs"]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                doc["runs"].append(run_arm(args, arm, seed, engine, base))
                write_result(out_dir / "results.json", doc)
    finally:
        engine.close()
    write_readme(doc, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
