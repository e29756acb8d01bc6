"""Held-out accuracy against wall-clock, paired by seed: the runs of ``benchmarks/continuous_seeds.sh``.

    .venv/bin/python benchmarks/continuous_seeds.py benchmarks/results/continuous_seeds

Reads ``<kind>_seed<N>/metrics.jsonl`` in the folder (kinds: one_process, keep, keep_idle, wait, abort, lockstep).
Time is counted from each run's first evaluation (of the untrained model), so that start-up (the services' processes and
engines, the trainer's one engine) is left out of the comparison; value pretraining, every update and every later
evaluation are in it. Between two evaluations a run's accuracy is interpolated linearly. For every seed and every pair
of kinds it reports the mean and the largest accuracy difference over the time both runs cover, every 10 s;
``keep`` against ``wait`` is the issue's criterion (within 0.03 at equal wall-clock). Per run also: accuracy and time
at every evaluation, seconds per update, the trained tokens' version lag (mean, share at each lag, largest) and the
share of samples generated under more than one version; and where an update's time goes: the learner's update and its
wait for a batch (train rows), and for the services the engine's seconds generating and loading weights per update and
how much of its generating ran while the learner was updating (the services' ``stats/*.busy.jsonl``: on a machine
whose cores the two share, that overlap slows both). Writes ``summary.json`` and ``accuracy_vs_time.png`` beside the
runs.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from bench_io import write_result

from async_vapo.experiments.report import busy_intervals

KINDS = ("one_process", "keep", "keep_idle", "wait", "abort", "lockstep")
STEP_S = 10.0


def read_run(path: Path) -> dict:
    evals, train = [], []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("kind") == "eval" and "eval/accuracy" in row:
            evals.append((row["step"], row["wall_s"], row["eval/accuracy"]))
        elif row.get("kind") == "train":
            train.append(row)
    evals.sort()
    if not evals:
        raise SystemExit(f"{path}: no evaluation rows in metrics.jsonl")
    t0 = evals[0][1]
    lags = [r["replay/token_lag_mean"] for r in train if "replay/token_lag_mean" in r]
    multi = [r["replay/multi_version_samples"] for r in train if "replay/multi_version_samples" in r]
    walls = sorted(r["wall_s"] for r in train if "wall_s" in r)
    lag_frac: dict[int, float] = {}
    for key in sorted({k for r in train for k in r}):
        m = re.fullmatch(r"mismatch/lag(\d+)/token_frac", key)
        if m:  # an update without tokens at this lag has no key: it counts as 0
            lag_frac[int(m[1])] = round(sum(r.get(key, 0.0) for r in train) / len(train), 4)
    lag_max = max((r["replay/token_lag_max"] for r in train if "replay/token_lag_max" in r), default=0)
    return {
        "evals": [{"step": s, "t_s": round(w - t0, 1), "accuracy": round(a, 4)} for s, w, a in evals],
        "updates": len(train),
        "s_per_update": round((walls[-1] - walls[0]) / (len(walls) - 1), 3) if len(walls) > 1 else None,
        "token_lag_mean": round(statistics.fmean(lags), 3) if lags else 0.0,
        "multi_version_samples": round(statistics.fmean(multi), 4) if multi else 0.0,
        "token_lag_frac": lag_frac,
        "token_lag_max": lag_max,
        "time": time_breakdown(path, train),
    }


def time_breakdown(path: Path, train: list[dict]) -> dict:
    """Mean seconds per update (the first update, which waits for the first batch, left out) of the learner's update
    and its wait for a batch; for the services also the engine's generating and weight loading and the part of its
    generating that ran while the learner was updating."""
    rows = train[1:] or train
    out = {k.removeprefix("time/"): round(statistics.fmean(r[k] for r in rows), 3)
           for k in ("time/learn_s", "time/wait_batch_s", "time/generate_s") if rows and all(k in r for r in rows)}
    busy = busy_intervals(path) if (path / "stats").is_dir() else {}
    learn, gen = busy.get("learn", []), busy.get("generate", [])
    if learn and gen and train:
        n = len(train)
        overlap = sum(max(0.0, min(a1, b1) - max(a0, b0)) for a0, a1 in gen for b0, b1 in learn)
        out["engine_generate_s"] = round(sum(b - a for a, b in gen) / n, 3)
        out["engine_generate_during_learn_s"] = round(overlap / n, 3)
        out["engine_load_weights_s"] = round(sum(b - a for a, b in busy.get("load_weights", [])) / n, 3)
    return out


def accuracy_at(evals: list[dict], t: float) -> float:
    """Linear between the evaluations around ``t`` (``t`` within the run's span)."""
    for a, b in zip(evals, evals[1:], strict=False):
        if a["t_s"] <= t <= b["t_s"]:
            w = (t - a["t_s"]) / max(b["t_s"] - a["t_s"], 1e-9)
            return a["accuracy"] + w * (b["accuracy"] - a["accuracy"])
    return evals[-1]["accuracy"]


def compare(x: list[dict], y: list[dict]) -> dict:
    """x − y over the time both cover, every STEP_S seconds; and at every update both evaluated (the first left out:
    the same untrained model)."""
    end = min(x[-1]["t_s"], y[-1]["t_s"])
    grid = [i * STEP_S for i in range(int(end // STEP_S) + 1)]
    diffs = [accuracy_at(x, t) - accuracy_at(y, t) for t in grid]
    worst = max(diffs, key=abs)
    ya = {e["step"]: e["accuracy"] for e in y}
    by_step = {e["step"]: round(e["accuracy"] - ya[e["step"]], 4) for e in x[1:] if e["step"] in ya}
    return {"over_s": end, "mean_diff": round(statistics.fmean(diffs), 4), "max_abs_diff": round(abs(worst), 4),
            "max_diff_signed": round(worst, 4), "by_update": by_step,
            "mean_diff_by_update": round(statistics.fmean(by_step.values()), 4) if by_step else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    args = ap.parse_args()
    runs: dict[str, dict[int, dict]] = {}
    for d in sorted(args.folder.iterdir()):
        m = re.fullmatch(rf"({'|'.join(KINDS)})_seed(\d+)", d.name)
        if m and (d / "metrics.jsonl").is_file():
            runs.setdefault(m[1], {})[int(m[2])] = read_run(d)
    if not runs:
        print(f"no <kind>_seed<N> runs in {args.folder}", file=sys.stderr)
        return 2
    kinds = [k for k in KINDS if k in runs]
    print("run                 seed  updates  s/update  token lag  multi-version  accuracy (s since first eval)")
    for k in kinds:
        for seed, r in sorted(runs[k].items()):
            curve = "  ".join(f"{e['accuracy']:.3f} ({e['t_s']:.0f})" for e in r["evals"])
            print(f"{k:<18} {seed:>5} {r['updates']:>8} {r['s_per_update'] or 0:>9.2f} {r['token_lag_mean']:>10.2f} "
                  f"{r['multi_version_samples']:>14.3f}  {curve}")
    pairs = {}
    for i, a in enumerate(kinds):
        for b in kinds[i + 1:]:
            seeds = sorted(set(runs[a]) & set(runs[b]))
            per_seed = {s: compare(runs[a][s]["evals"], runs[b][s]["evals"]) for s in seeds}
            if not per_seed:
                continue
            means = [c["mean_diff"] for c in per_seed.values()]
            pairs[f"{a}-{b}"] = {"per_seed": per_seed, "mean_of_means": round(statistics.fmean(means), 4),
                                 "max_abs_diff": max(c["max_abs_diff"] for c in per_seed.values())}
    print("\naccuracy difference at equal wall-clock (every 10 s over the time both runs cover), paired by seed:")
    for name, p in pairs.items():
        seeds = "  ".join(f"seed {s}: mean {c['mean_diff']:+.3f}, largest {c['max_diff_signed']:+.3f} over "
                          f"{c['over_s']:.0f} s" for s, c in p["per_seed"].items())
        print(f"  {name:<22} mean {p['mean_of_means']:+.3f}  |  {seeds}")
    print("\naccuracy difference at equal updates (every evaluation after the first), paired by seed:")
    for name, p in pairs.items():
        seeds = "  ".join(f"seed {s}: " + " ".join(f"{d:+.3f}" for d in c["by_update"].values())
                          for s, c in p["per_seed"].items())
        means = [c["mean_diff_by_update"] for c in p["per_seed"].values() if c["mean_diff_by_update"] is not None]
        p["mean_diff_by_update"] = round(statistics.fmean(means), 4) if means else None
        print(f"  {name:<22} mean {p['mean_diff_by_update'] or 0:+.3f}  |  {seeds}")
    print("\ntrained tokens by version lag (share of an update's tokens, mean over updates; largest lag of any token):")
    for k in kinds:
        for seed, r in sorted(runs[k].items()):
            fr = "  ".join(f"lag {lag}: {f:.1%}" for lag, f in sorted(r["token_lag_frac"].items())) or "on-policy"
            print(f"  {k:<18} seed {seed}  {fr}  (largest {r['token_lag_max']})")
    print("\nwhere an update's time goes, mean seconds per update (learn: the learner's update; wait: its wait for a "
          "batch;\n  engine: generating, of that during the learner's update, loading weights):")
    for k in kinds:
        for seed, r in sorted(runs[k].items()):
            t = r["time"]
            eng = (f"  engine {t['engine_generate_s']:.2f}, {t['engine_generate_during_learn_s']:.2f} during learn, "
                   f"load {t['engine_load_weights_s']:.2f}" if "engine_generate_s" in t else
                   f"  generate {t['generate_s']:.2f}" if "generate_s" in t else "")
            print(f"  {k:<18} seed {seed}  learn {t.get('learn_s', 0):.2f}  wait {t.get('wait_batch_s', 0):.2f}{eng}")
    print("\nseconds per update by kind (each seed):")
    for k in kinds:
        per = [r["s_per_update"] for _, r in sorted(runs[k].items()) if r["s_per_update"]]
        mean = f"   mean {statistics.fmean(per):.2f}" if per else ""
        print(f"  {k:<18} " + "  ".join(f"{x:.2f}" for x in per) + mean)
    if "keep-wait" in pairs:
        kw = pairs["keep-wait"]
        print(f"\nkeep within 0.03 of wait at equal wall-clock (every seed, every 10 s): "
              f"{'yes' if kw['max_abs_diff'] <= 0.03 else 'no'} (largest |difference| {kw['max_abs_diff']:.3f})")
    write_result(args.folder / "summary.json", {"runs": runs, "pairs": pairs, "step_s": STEP_S})
    plot(runs, kinds, args.folder / "accuracy_vs_time.png")
    return 0


def plot(runs: dict, kinds: list[str], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"one_process": "tab:gray", "keep": "tab:blue", "keep_idle": "tab:cyan", "wait": "tab:orange",
               "abort": "tab:red",
               "lockstep": "tab:green"}
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k in kinds:
        for i, (_, r) in enumerate(sorted(runs[k].items())):
            ax.plot([e["t_s"] for e in r["evals"]], [e["accuracy"] for e in r["evals"]], marker="o", ms=3,
                    color=colours[k], alpha=0.8, lw=1.2, label=k if i == 0 else None)
    ax.set_xlabel("seconds since the first evaluation (start-up left out)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("Held-out accuracy against wall-clock, one line per seed")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
