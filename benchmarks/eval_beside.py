"""The held-out evaluation alone against beside training generation (``cluster.rollout.eval_share``), side by side:
two services runs of ``benchmarks/smollm2_learning.sh`` (``NAME_services``) that differ only in that setting.

    .venv/bin/python benchmarks/eval_beside.py benchmarks/results/eval_beside/alone/grpo_services_seed0 \
        benchmarks/results/eval_beside/beside/grpo_services_seed0 --out benchmarks/results/eval_beside
    .venv/bin/python benchmarks/eval_beside.py alone=DIR beside=DIR idle=DIR --out DIR    # NAME=DIR, any number

For each run, over its training window (first to last update): updates, seconds per update, the learner's own
seconds per update (its median ``time/learn_s`` + ``time/weight_push_s``, waits for a batch excluded: the bound), how
far over the bound the run came, the learner's wait for a batch per update (and the seconds of the waits that overlapped
an evaluation), the evaluations' seconds, and rollout restarts (supervisor starts after the first).
Writes ``summary.json`` and ``updates_vs_time.png`` (updates against wall-clock, evaluations marked) in ``--out``.
The evaluations are rollout 0's: rows an evaluator outside the training engines wrote (``"source": "checkpoint"``,
``cluster.evaluator.mode``, at their checkpoints' wall-clock) are counted apart (``checkpoint_evaluations``), neither
marked nor matched against the learner's waits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from async_vapo.experiments.report import analyse_cluster_run, eval_spans


def figures(run: Path) -> dict:
    """The pair's figures of one run: ``analyse_cluster_run``'s window, updates, seconds and waits per update and
    busy shares, with the bound, the waits that overlapped an evaluation, and the restarts."""
    base = analyse_cluster_run(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = sorted((r for r in rows if r["kind"] == "train"), key=lambda r: r["step"])
    evals = [r for r in rows if r["kind"] == "eval" and r["step"] > 0 and r.get("source") != "checkpoint"]
    outside = [r for r in rows if r["kind"] == "eval" and r.get("source") == "checkpoint"]
    algo = json.loads((run / "config.resolved.json").read_text())["algo"]["name"]
    per_update = base["seconds_per_update"]
    # the waits for a batch that overlapped an evaluation (eval_spans); an update's
    # wait is the start of its step (wall_s - time/step_s) for time/wait_batch_s
    spans = eval_spans(evals)
    during_eval = []
    for r in train[1:]:
        start = r["wall_s"] - r["time/step_s"]
        if any(start < b and start + r["time/wait_batch_s"] > a for a, b in spans):
            during_eval.append(r["time/wait_batch_s"])
    log = (run / "logs" / "rollout-0.log").read_text(errors="replace") if (run / "logs").is_dir() else ""
    return {"run": str(run), "algo": algo, "updates": base["updates"], "window_s": base["window_s"],
            "s_per_update": per_update,
            "learner_own_s": base["learner_own_s"], "over_bound": base["over_learner_own"],
            "busy_fraction": base["busy_fraction"],
            "wait_s_per_update": base["wait_s_per_update"], "wait_s_during_eval": sum(during_eval),
            # the engine on the learner's cores too (cluster.rollout.engine_threads), against the learner's waits
            "engine_lent_s": base["busy_fraction"].get("engine_lent", 0.0) * base["window_s"],
            "wait_s": sum(r["time/wait_batch_s"] for r in train[1:]),  # the window's
            "evaluations": len(evals), "eval_s": [round(e["time/eval_s"], 1) for e in evals],
            "eval_accuracy": [(e["step"], e["eval/accuracy"]) for e in evals],
            "checkpoint_evaluations": len(outside),
            "rollout_restarts": max(0, log.count("[supervise] rollout-0: start") - 1),
            "curve": [(r["wall_s"], r["step"]) for r in train], "eval_at": [e["wall_s"] for e in evals]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="NAME=DIR for each run (the first is the reference); two bare DIRs are "
                                           "alone and beside")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    pairs = [r.split("=", 1) if "=" in r else [None, r] for r in args.runs]
    if all(name is None for name, _ in pairs) and len(pairs) == 2:
        pairs = [["alone", pairs[0][1]], ["beside", pairs[1][1]]]
    if any(name is None for name, _ in pairs):
        ap.error("name every run (NAME=DIR), or give exactly two directories (alone, beside)")
    runs = {name: figures(Path(path)) for name, path in pairs}
    print(f"{'':8} {'updates':>7} {'s/update':>8} {'bound':>6} {'over':>6} {'wait/upd':>8} {'waits in evals':>14} "
          f"{'evals':>5} {'per eval':>8}  restarts")
    for name, f in runs.items():
        per_eval = f["wait_s_during_eval"] / max(1, f["evaluations"])
        print(f"{name:8} {f['updates']:7d} {f['s_per_update']:8.1f} {f['learner_own_s']:6.1f} "
              f"{f['over_bound']:+6.1%} {f['wait_s_per_update']:8.1f} {f['wait_s_during_eval']:13.0f}s "
              f"{f['evaluations']:5d} {per_eval:7.0f}s  {f['rollout_restarts']}")
        print(f"         evaluation seconds {f['eval_s']}")
        if f["checkpoint_evaluations"]:
            print(f"         {f['checkpoint_evaluations']} checkpoint evaluations outside the training engines")
        if f["engine_lent_s"]:
            print(f"         the engine on every core {f['engine_lent_s']:.0f} s, the learner waiting "
                  f"{f['wait_s']:.0f} s")
    (first, a), *rest = runs.items()
    for name, b in rest:
        print(f"{name} / {first}, seconds per update: {b['s_per_update'] / a['s_per_update']:.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(
        {k: {x: y for x, y in f.items() if x not in ("curve", "eval_at")} for k, f in runs.items()}, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, f), color in zip(runs.items(), ("tab:gray", "tab:blue", "tab:green", "tab:red"), strict=False):
        t0 = f["curve"][0][0]
        ax.step([(t - t0) / 60 for t, _ in f["curve"]], [s for _, s in f["curve"]], where="post", color=color,
                label=f"{name}: {f['s_per_update']:.1f} s/update ({f['over_bound']:+.0%} over the learner's own)")
        for t in f["eval_at"]:
            ax.axvline((t - t0) / 60, color=color, alpha=0.25, lw=1)
    ax.set_xlabel("minutes since the first update")
    ax.set_ylabel("updates")
    algos = " / ".join(dict.fromkeys(f["algo"].upper() for f in runs.values()))
    ax.set_title(f"SmolLM2 {algos}, services: " + ", ".join(runs) + "\n(when and how rollout 0 evaluates)",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "updates_vs_time.png", dpi=120)
    print(f"wrote {args.out / 'summary.json'} and {args.out / 'updates_vs_time.png'}")


if __name__ == "__main__":
    main()
