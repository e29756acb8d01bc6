"""The peer benchmark's arithmetic and report (``benchmarks/peers/run.py`` writes the runs; this reads them).

A run is ``{"side", "seed", "t": {update: seconds}, "accuracy": {update: held-out accuracy}}``, where ``t[k]`` is
the training clock at the end of update k (from the start of the run's first update, or of its first
value-pretraining step) and ``accuracy[0]`` is the base model's.

Per run:
* ``updates_per_s`` = (N - 1) / (t[N] - t[1]): the steady rate, without the first update (warm-up; on the services,
  batches generated while the learner started);
* ``samples_per_s`` = ``updates_per_s`` x samples per update (16 x 8 on every side);
* ``time_to_n_s`` = t[N], and ``accuracy_at_n`` = accuracy[N] (equal updates);
* ``accuracy_at_equal_wall`` = the accuracy of the last evaluation reached by ``equal_wall_s`` (update k with
  t[k] <= equal_wall_s, or the base model), where ``equal_wall_s`` is the smallest of the sides' mean ``time_to_n_s``:
  every side is compared at the moment the fastest one has finished.
Per side: the mean over seeds, with min and max; ``x_trl`` is the side's mean ``updates_per_s`` over TRL's, and
``x_trl_same_seed`` the ratio run by run against TRL's run of the same seed (mean, min, max).

A real-model run (``run.py --setting smollm2``) also has ``process_t``: per update, seconds from the process's
launch, start-up included, held-out evaluations excluded, and ``budget_s``. :func:`summarize_time_to` reads it: per
run the process seconds to the first evaluation at or above each threshold (``time_to``), censored at the budget
when none is (``reached`` false), the seconds per update after the first, the last evaluation. For each of our runs
against TRL's run of the same seed, ``vs_trl``: per threshold the ratio of the two times with what it is when a side
is censored (``"="`` both reached; ``"<"`` only ours, so the ratio is an upper bound, TRL's time being past its
budget; ``">"`` only TRL's, a lower bound; ``None`` neither), and the study's criterion (issue 47): ours reaches the
last threshold in at most ``CRITERION_RATIO`` x TRL's time, at equal or better final accuracy (the last evaluation).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

SIDES = ["trl", "grpo", "vapo", "cluster"]
LABELS = {"trl": "TRL 1.16 GRPOTrainer (HF generate)",
          "grpo": "async-vapo train, configs/baselines/grpo.toml (one process)",
          "vapo": "async-vapo train, configs/tiny_cpu.toml (VAPO, one process)",
          "cluster": "deploy/start_cluster.sh, configs/baselines/grpo.toml (services, max_staleness 1)"}
LABELS_REAL = {"trl": "TRL 1.16 GRPOTrainer (HF generate)",
               "grpo": "async-vapo train, configs/smollm2_grpo_cpu.toml (one process)",
               "vapo": "async-vapo train, configs/smollm2_cpu.toml (VAPO, one process)",
               "cluster": "deploy/start_cluster.sh, configs/smollm2_grpo_cpu.toml (services, max_staleness 1, "
                          "continuous)"}
SAMPLES_PER_UPDATE = 128
METRICS = ["updates_per_s", "samples_per_s", "time_to_n_s", "accuracy_at_n", "accuracy_at_equal_wall"]


def _ints(d: dict) -> dict[int, float]:
    return {int(k): float(v) for k, v in d.items()}


def run_figures(run: dict, n: int, equal_wall_s: float | None = None) -> dict[str, float]:
    t, acc = _ints(run["t"]), _ints(run["accuracy"])
    ups = (n - 1) / (t[n] - t[1])
    out = {"updates_per_s": ups, "samples_per_s": ups * SAMPLES_PER_UPDATE, "time_to_n_s": t[n],
           "accuracy_at_n": acc[n]}
    if equal_wall_s is not None:
        reached = [k for k in acc if k == 0 or (k in t and t[k] <= equal_wall_s)]
        out["accuracy_at_equal_wall"] = acc[max(reached)]
        out["update_at_equal_wall"] = float(max(reached))
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def summarize(runs: list[dict], *, updates: int) -> dict:
    sides = [s for s in SIDES if any(r["side"] == s for r in runs)]
    by_side = {s: [r for r in runs if r["side"] == s] for s in sides}
    mean_time = {s: statistics.fmean(run_figures(r, updates)["time_to_n_s"] for r in rs) for s, rs in by_side.items()}
    equal_wall_s = min(mean_time.values())
    out: dict = {"updates": updates, "samples_per_update": SAMPLES_PER_UPDATE, "equal_wall_s": equal_wall_s,
                 "sides": {}}
    for s, rs in by_side.items():
        per_run = [{"seed": r["seed"], **run_figures(r, updates, equal_wall_s)} for r in rs]
        threads = sorted({r["threads"] for r in rs if "threads" in r})
        label = LABELS[s] + (f", torch threads {'/'.join(map(str, threads))}" if threads else "")
        side = {"label": label, "seeds": [r["seed"] for r in rs], "runs": per_run}
        side.update({m: _spread([p[m] for p in per_run]) for m in METRICS})
        out["sides"][s] = side
    if "trl" in out["sides"]:
        trl = out["sides"]["trl"]["updates_per_s"]["mean"]
        trl_by_seed = {p["seed"]: p["updates_per_s"] for p in out["sides"]["trl"]["runs"]}
        for side in out["sides"].values():
            side["x_trl"] = side["updates_per_s"]["mean"] / trl
            paired = [p["updates_per_s"] / trl_by_seed[p["seed"]] for p in side["runs"] if p["seed"] in trl_by_seed]
            if paired:
                side["x_trl_same_seed"] = _spread(paired)
    return out


THRESHOLDS = (0.8, 0.9)
CRITERION_RATIO = 0.6


def versus_trl(row: dict, trl: dict, thresholds: tuple[float, ...]) -> dict:
    """One of our runs' times against TRL's run of the same seed (rows of :func:`summarize_time_to`)."""
    out: dict = {"ratio": {}}
    for thr in map(str, thresholds):
        ours, theirs = row["time_to"][thr], trl["time_to"][thr]
        kind = {(True, True): "=", (True, False): "<", (False, True): ">", (False, False): None}[
            (ours["reached"], theirs["reached"])]
        out["ratio"][thr] = {"x": None if kind is None else ours["s"] / theirs["s"], "kind": kind}
    last = out["ratio"][str(thresholds[-1])]
    out["criterion"] = {"ratio_le": CRITERION_RATIO,
                        "time": last["kind"] in ("=", "<") and last["x"] <= CRITERION_RATIO,
                        "final_accuracy": row["last_accuracy"] >= trl["last_accuracy"]}
    out["criterion"]["met"] = out["criterion"]["time"] and out["criterion"]["final_accuracy"]
    return out


def time_to(run: dict, threshold: float) -> tuple[float, bool]:
    """(process seconds at the end of the first update evaluated at >= ``threshold``, True), or (the budget, False):
    a run that never reaches it within its budget on the process clock is censored at the budget (our trainer's
    ``train.max_minutes`` starts after its start-up, so its process clock can run past the budget)."""
    t, acc = _ints(run["process_t"]), _ints(run["accuracy"])
    hits = [k for k in sorted(acc) if acc[k] >= threshold and (k == 0 or (k in t and t[k] <= run["budget_s"]))]
    if hits:
        return (0.0 if hits[0] == 0 else t[hits[0]]), True
    return float(run["budget_s"]), False


def summarize_time_to(runs: list[dict], thresholds: tuple[float, ...] = THRESHOLDS) -> dict:
    out: dict = {"thresholds": list(thresholds), "sides": {}}
    for s in [s for s in SIDES if any(r["side"] == s and "process_t" in r for r in runs)]:
        per_run, mine = [], [x for x in runs if x["side"] == s and "process_t" in x]
        for r in mine:
            t, acc = _ints(r["process_t"]), _ints(r["accuracy"])
            n = max(t)
            last = max(acc)
            row = {"seed": r["seed"], "updates": n, "budget_s": r["budget_s"], "first_update_s": t[1],
                   "s_per_update": (t[n] - t[1]) / (n - 1) if n > 1 else None, "base_accuracy": acc[0],
                   "last_eval_update": last, "last_accuracy": acc[last], "time_to": {}}
            for thr in thresholds:
                secs, reached = time_to(r, thr)
                row["time_to"][str(thr)] = {"s": secs, "reached": reached}
            per_run.append(row)
        threads = "/".join(map(str, sorted({x["threads"] for x in mine if "threads" in x})))
        out["sides"][s] = {"label": LABELS_REAL[s] + (f", torch threads {threads}" if threads else ""),
                           "runs": per_run}
    trl = {r["seed"]: r for r in out["sides"].get("trl", {}).get("runs", [])}
    for s, side in out["sides"].items():
        for row in side["runs"]:
            if s != "trl" and row["seed"] in trl:
                row["vs_trl"] = versus_trl(row, trl[row["seed"]], thresholds)
    return out


def markdown_time_to(summary: dict) -> str:
    thr = summary["thresholds"]
    head = " | ".join(f"s to {x}" for x in thr)
    lines = ["# TRL beside async-vapo on SmolLM2-135M-Instruct, level-1 word problems", "",
             "Process wall-clock from launch (start-up included, held-out evaluations excluded). Held-out accuracy: "
             "our evaluator, 200 problems x 1 sample, temperature 0.7. '> B' is a run censored at its budget B.", "",
             f"| side | seed | updates | s, first update | s per update after it | base accuracy | last evaluation "
             f"| {head} |", "|---|---|---|---|---|---|---|" + "---|" * len(thr)]
    for side in summary["sides"].values():
        for r in side["runs"]:
            spu = "—" if r["s_per_update"] is None else f"{r['s_per_update']:.1f}"
            cells = []
            for x in thr:
                tt = r["time_to"][str(x)]
                cells.append(f"{tt['s']:.0f}" if tt["reached"] else f"> {tt['s']:.0f}")
            lines.append(f"| {side['label']} | {r['seed']} | {r['updates']} | {r['first_update_s']:.0f} | {spu} | "
                         f"{r['base_accuracy']:.3f} | {r['last_accuracy']:.3f} at update {r['last_eval_update']} | "
                         + " | ".join(cells) + " |")
    ours = [(side["label"], r) for side in summary["sides"].values() for r in side["runs"] if "vs_trl" in r]
    if ours:
        lines += ["", f"Against TRL's run of the same seed: our time over TRL's ('< x' where TRL is censored at its "
                  f"budget, an upper bound; '> x' where ours is). Criterion: {thr[-1]} in at most "
                  f"{CRITERION_RATIO}x TRL's time, at equal or better final accuracy.", "",
                  "| side | seed | " + " | ".join(f"x TRL's time to {x}" for x in thr) + " | criterion |",
                  "|---|---|" + "---|" * len(thr) + "---|"]
        for label, r in ours:
            cells = []
            for x in thr:
                v = r["vs_trl"]["ratio"][str(x)]
                cells.append("— (both censored)" if v["kind"] is None
                             else ("" if v["kind"] == "=" else f"{v['kind']} ") + f"{v['x']:.2f}")
            c = r["vs_trl"]["criterion"]
            verdict = "met" if c["met"] else "not met (" + ", ".join(
                k for k in ("time", "final_accuracy") if not c[k]).replace("_", " ") + ")"
            lines.append(f"| {label} | {r['seed']} | " + " | ".join(cells) + f" | {verdict} |")
    return "\n".join(lines) + "\n"


def plot_time_to(summary: dict, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = dict(zip(SIDES, ["tab:gray", "tab:blue", "tab:green", "tab:orange"], strict=True))
    for s in summary["sides"]:
        for r in (x for x in runs if x["side"] == s and "process_t" in x):
            t, acc = _ints(r["process_t"]), _ints(r["accuracy"])
            ks = [k for k in sorted(acc) if k == 0 or k in t]
            style = "o-" if r["seed"] % 2 == 0 else "s--"  # a side's seeds told apart by line and marker
            ax.plot([0.0 if k == 0 else t[k] for k in ks], [acc[k] for k in ks], style, color=colors[s], alpha=0.8,
                    label=f"{s} seed {r['seed']}")
    for x in summary["thresholds"]:
        ax.axhline(x, color="k", ls=":", lw=1)
    ax.set(xlabel="seconds since launch (held-out evaluations excluded)", ylabel="held-out accuracy",
           title="SmolLM2-135M-Instruct, level-1 word problems")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(s: dict, digits: int = 2) -> str:
    return f"{s['mean']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def markdown(summary: dict) -> str:
    n, wall = summary["updates"], summary["equal_wall_s"]
    lines = [f"# TRL beside async-vapo: {n} GRPO-sized updates (16 prompts x 8 samples, 2 optimiser steps each)", "",
             "Mean over seeds (min–max). Updates/s are steady-state: (N − 1) / (t_N − t_1). Held-out accuracy is our "
             "evaluator's (240 problems x 2 samples, temperature 1).", "",
             f"| side | seeds | updates/s | × TRL | × TRL, same seed | samples/s | s to {n} updates "
             f"| accuracy at update {n} | accuracy at {wall:.0f} s |", "|---|---|---|---|---|---|---|---|---|"]
    for side in summary["sides"].values():
        x = f"{side['x_trl']:.2f}" if "x_trl" in side else "—"
        xs = _fmt(side["x_trl_same_seed"]) if "x_trl_same_seed" in side else "—"
        lines.append(f"| {side['label']} | {len(side['seeds'])} | {_fmt(side['updates_per_s'], 3)} | {x} | {xs} | "
                     f"{_fmt(side['samples_per_s'], 1)} | {_fmt(side['time_to_n_s'], 0)} | "
                     f"{_fmt(side['accuracy_at_n'], 3)} | {_fmt(side['accuracy_at_equal_wall'], 3)} |")
    lines += ["", f"Equal wall-clock: {wall:.0f} s, the fastest side's mean time to {n} updates; each run is "
              "taken at its last evaluation reached by then."]
    return "\n".join(lines) + "\n"


def plot(summary: dict, runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = dict(zip(SIDES, ["tab:gray", "tab:blue", "tab:green", "tab:orange"], strict=True))
    for s, side in summary["sides"].items():
        for i, r in enumerate(x for x in runs if x["side"] == s):
            t, acc = _ints(r["t"]), _ints(r["accuracy"])
            ks = sorted(acc)
            lab = s if i == 0 else None
            axes[0].plot(ks, [acc[k] for k in ks], "o-", color=colors[s], alpha=0.7, label=lab)
            axes[1].plot([0.0 if k == 0 else t[k] for k in ks], [acc[k] for k in ks], "o-", color=colors[s],
                         alpha=0.7, label=lab)
        u = side["updates_per_s"]
        axes[2].bar(s, u["mean"], color=colors[s], yerr=[[u["mean"] - u["min"]], [u["max"] - u["mean"]]], capsize=4)
    axes[1].axvline(summary["equal_wall_s"], color="k", ls=":", lw=1)
    axes[0].set(xlabel="update", ylabel="held-out accuracy", title="accuracy at equal updates")
    axes[1].set(xlabel="training seconds", ylabel="held-out accuracy", title="accuracy at equal wall-clock")
    axes[2].set(ylabel="updates / s (steady)", title="throughput (mean, min–max over seeds)")
    for ax in axes[:2]:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(summary: dict, out: Path) -> None:
    runs = json.loads((out / "runs.json").read_text())
    (out / "peers.json").write_text(json.dumps(summary, indent=1) + "\n")
    if "thresholds" in summary:
        (out / "peers.md").write_text(markdown_time_to(summary))
        plot_time_to(summary, runs, out / "peers.png")
        return
    (out / "peers.md").write_text(markdown(summary))
    plot(summary, runs, out / "peers.png")
