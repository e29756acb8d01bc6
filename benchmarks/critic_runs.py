"""The value model's criteria (benchmarks/results/value_model/plan.md, issue 45 item 3) read from runs'
``metrics.jsonl``, one row per run, and a plot of how each run's critic carries to responses it has not trained on:
a new batch's explained variance before its update (``critic/fresh_ev``) and the held-out EV at each evaluation
beside its prompt-mean level.

    .venv/bin/python benchmarks/critic_runs.py benchmarks/results/smollm2_learning/vapo_frozen_seed{0,1} \\
        benchmarks/results/smollm2_learning/vapo_frozen_window_seed0 --out benchmarks/results/value_model/critic_runs

Criteria, as the plan states them: (1) after value pretraining, the last pretraining row's held-out EV against half
its answer-aware level and above its prompt-mean level; (2) the median held-out EV over the evaluations after the
first against the median prompt-mean level; (3) the mean |value_mean − return_mean| over updates 5 to the end, at
most 0.1; (4) the run's minutes to its last evaluation, within the hour. The held-out scores are the eval rows' (the
one-process trainer) or the learner's ``kind="critic_eval"`` rows (the services: rollout 0's held-out responses).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def _rows(run: Path) -> list[dict]:
    with open(run / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


CRITIC_ROWS = ("eval", "critic_eval")
"""Rows with the critic's held-out scores: the one-process trainer's evaluations, the services' learner's."""


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    return None if v is None or v != v else float(v)  # None and NaN are both missing


def criteria(run: Path) -> dict:
    """The plan's four criteria and the carry measures of one run."""
    rows = _rows(run)
    pre = [r for r in rows if r.get("kind") == "pretrain" and _num(r, "critic/heldout_ev") is not None]
    train = [r for r in rows if r.get("kind") == "train"]
    evals = [r for r in rows if r.get("kind") in CRITIC_ROWS and r.get("step", 0) > 0
             and _num(r, "critic/heldout_ev") is not None and _num(r, "critic/heldout_ev_prompt_mean") is not None]
    out: dict = {"run": run.name, "updates": len(train)}
    # the reference levels of the last pretraining row, else of the untrained model's evaluation
    levels = [r for r in pre[-1:] + [r for r in rows if r.get("kind") in CRITIC_ROWS and r.get("step") == 0]
              if _num(r, "critic/heldout_ev_answer_aware") is not None]
    if pre and levels:
        last = pre[-1]
        out |= {"pretrain_steps": len([r for r in rows if r.get("kind") == "pretrain"]),
                "after_pretrain_ev": _num(last, "critic/heldout_ev"),
                "best_pretrain_ev": max(_num(r, "critic/heldout_ev") for r in pre),
                "half_answer_aware": 0.5 * _num(levels[0], "critic/heldout_ev_answer_aware"),
                "prompt_mean_level": _num(levels[0], "critic/heldout_ev_prompt_mean")}
        out["c1"] = out["after_pretrain_ev"] >= out["half_answer_aware"] and \
            out["after_pretrain_ev"] > out["prompt_mean_level"]
    if evals:
        out["median_heldout_ev"] = statistics.median(_num(r, "critic/heldout_ev") for r in evals)
        out["median_prompt_mean"] = statistics.median(_num(r, "critic/heldout_ev_prompt_mean") for r in evals)
        out["c2"] = out["median_heldout_ev"] > out["median_prompt_mean"]
    gaps = [abs(_num(r, "critic/value_mean") - _num(r, "critic/return_mean")) for r in train
            if r.get("step", 0) >= 5 and _num(r, "critic/value_mean") is not None
            and _num(r, "critic/return_mean") is not None]
    if gaps:
        out["value_gap"] = statistics.fmean(gaps)
        out["c3"] = out["value_gap"] <= 0.1
    every_eval = [r for r in rows if r.get("kind") == "eval"]
    if every_eval:
        out["minutes"] = every_eval[-1]["wall_s"] / 60
        out["c4"] = out["minutes"] <= 60
    fresh = [_num(r, "critic/fresh_ev") for r in train if _num(r, "critic/fresh_ev") is not None]
    fitted = [_num(r, "critic/explained_variance") for r in train if _num(r, "critic/explained_variance") is not None]
    steps = [_num(r, "critic/steps") for r in train if _num(r, "critic/steps") is not None]
    out |= {"median_fresh_ev": statistics.median(fresh) if fresh else None,
            "median_fitted_ev": statistics.median(fitted) if fitted else None,
            "critic_steps_per_update": statistics.median(steps) if steps else None}
    return out


def _fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "met" if x else "missed"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def table(results: list[dict]) -> str:
    head = ("| run | updates | critic steps / update | 1. EV after pretraining (best) vs ½ answer-aware, prompt mean "
            "| 2. median held-out EV vs prompt mean | 3. \\|value − return\\| | 4. minutes "
            "| new batch's EV before its update (median) | its batch's EV after the steps (median) |")
    lines = [head, "|" + "---|" * 9]
    for r in results:
        c1 = (f"{_fmt(r.get('after_pretrain_ev'))} ({_fmt(r.get('best_pretrain_ev'))}) vs "
              f"{_fmt(r.get('half_answer_aware'))}, {_fmt(r.get('prompt_mean_level'))}: {_fmt(r.get('c1'))}"
              if "c1" in r else "-")
        c2 = (f"{_fmt(r['median_heldout_ev'])} vs {_fmt(r['median_prompt_mean'])}: {_fmt(r['c2'])}"
              if "c2" in r else "-")
        c3 = f"{_fmt(r['value_gap'])}: {_fmt(r['c3'])}" if "c3" in r else "-"
        c4 = f"{_fmt(r['minutes'], 1)}: {_fmt(r['c4'])}" if "c4" in r else "-"
        lines.append(f"| {r['run']} | {r['updates']} | {_fmt(r['critic_steps_per_update'], 0)} | {c1} | {c2} | {c3} "
                     f"| {c4} | {_fmt(r['median_fresh_ev'])} | {_fmt(r['median_fitted_ev'])} |")
    return "\n".join(lines)


def plot(runs: list[Path], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, run in enumerate(runs):
        rows, colour = _rows(run), f"C{i}"
        train = [r for r in rows if r.get("kind") == "train" and _num(r, "critic/fresh_ev") is not None]
        xs, ys = [r["step"] for r in train], [_num(r, "critic/fresh_ev") for r in train]
        smooth = [statistics.median(ys[max(0, j - 4): j + 5]) for j in range(len(ys))]
        a.plot(xs, ys, ".", color=colour, alpha=0.25)
        a.plot(xs, smooth, "-", color=colour, label=run.name)
        evals = [r for r in rows if r.get("kind") in CRITIC_ROWS and _num(r, "critic/heldout_ev") is not None]
        b.plot([r["step"] for r in evals], [_num(r, "critic/heldout_ev") for r in evals], "o-", color=colour,
               label=f"{run.name}: critic")
        b.plot([r["step"] for r in evals], [_num(r, "critic/heldout_ev_prompt_mean") for r in evals], "x:",
               color=colour, label=f"{run.name}: prompt-mean level")
    a.axhline(0, color="k", lw=0.5)
    a.set(xlabel="update", ylabel="explained variance", ylim=(-1, 1),
          title="a new batch, before the critic's steps on it (running median of 9)")
    b.axhline(0, color="k", lw=0.5)
    b.set(xlabel="update", ylabel="explained variance", ylim=(-1, 1), title="held-out responses, at each evaluation")
    a.legend(fontsize=7)
    b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="run directories with a metrics.jsonl")
    p.add_argument("--out", type=Path, required=True, help="writes OUT.md, OUT.json and OUT.png")
    a = p.parse_args()
    results = [criteria(r) for r in a.runs]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    text = table(results)
    print(text)
    a.out.with_suffix(".md").write_text(text + "\n")
    a.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    plot(a.runs, a.out.with_suffix(".png"))
    print(f"wrote {a.out.with_suffix('.md')}, .json, .png")


if __name__ == "__main__":
    main()
