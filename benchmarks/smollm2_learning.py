"""Does RL make a real pretrained model better here? Summary of SmolLM2-135M-Instruct learning runs on this CPU.

    .venv/bin/python benchmarks/smollm2_learning.py RUN_DIR [RUN_DIR ...] [--base DIR [DIR ...]] \
        [--out benchmarks/results/smollm2_learning]

Each RUN_DIR is the ``--out`` of one ``benchmarks/smollm2.py`` run (its ``metrics.jsonl``, ``results.json`` and
``config.resolved.json``), optionally with ``final/``: ``async-vapo eval`` of the run's last checkpoint, compared
with the ``--base`` directory evaluated alike: the same of the untrained model, on the same held-out problems, seeds
and n samples per problem (``benchmarks/smollm2_learning.sh`` makes them; one per n). Last checkpoints evaluated with
different n are not compared with each other.

For every run it reports the held-out accuracy curve against the trainer's wall-clock (evaluations and value
pretraining included; the engine's start is not) with one standard error, and, where the paired evaluations exist,
the gain measured per problem: d_i = (fraction correct of problem i after) - (before), its mean and its standard
error sd(d) / sqrt(problems), so that a problem's difficulty, shared by both measurements, does not count as noise.
Side by side: each algorithm's paired gain over its seeds, and for each seed two algorithms both ran, their last
checkpoints compared per problem the same way (the same problems and sample seeds).
Writes ``summary.md``, ``summary.json`` and ``curves.png`` (accuracy against minutes, one line per run) to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def per_problem(samples: Path) -> dict[str, float]:
    """Fraction correct per problem uid of an ``async-vapo eval`` samples.jsonl."""
    hits: dict[str, list[bool]] = defaultdict(list)
    for line in samples.read_text().splitlines():
        r = json.loads(line)
        hits[r["uid"]].append(bool(r["correct"]))
    return {uid: sum(v) / len(v) for uid, v in hits.items()}


def answer_rates(samples: Path) -> dict[str, float]:
    """Share of an ``async-vapo eval`` samples.jsonl's responses cut by the token cap, and with an answer read."""
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    return {"truncated": sum(r["finish_reason"] == "length" for r in rows) / len(rows),
            "parsed": sum(r["verdict"] in ("correct", "incorrect") for r in rows) / len(rows), "samples": len(rows)}


def paired_gain(before: dict[str, float], after: dict[str, float]) -> dict:
    """Mean and standard error of the per-problem gain, over the problems both evaluations hold."""
    uids = sorted(set(before) & set(after))
    if len(uids) < 2:
        raise ValueError(f"paired evaluations share {len(uids)} problems")
    d = [after[u] - before[u] for u in uids]
    se = statistics.stdev(d) / math.sqrt(len(d))
    mean = statistics.fmean(d)
    return {"problems": len(uids), "before": statistics.fmean(before[u] for u in uids),
            "after": statistics.fmean(after[u] for u in uids), "gain": mean, "se": se,
            "gain_in_se": mean / se if se > 0 else float("inf"),
            "improved": sum(x > 0 for x in d), "worsened": sum(x < 0 for x in d)}


def _row_name(path: Path, cfg: dict) -> str:
    """The run's row: its directory's name before ``_seedN`` (``smollm2_learning.sh``'s ALGOS word, e.g.
    ``vapo_critic``), else the config's algorithm."""
    stem, sep, _ = path.name.rpartition("_seed")
    return stem if sep else cfg["algo"]["name"]


def _evaluated_alike(a: dict, b: dict) -> bool:
    """Two ``async-vapo eval`` metrics.json of the same samples per problem, sample seed and temperature."""
    return all(a[k] == b[k] for k in ("samples_per_problem", "seed", "temperature"))


def load_run(path: Path, bases: Sequence[Path] = ()) -> dict:
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    cfg = json.loads((path / "config.resolved.json").read_text())
    n = cfg["task"]["num_eval"] * cfg["rollout"]["eval_samples"]
    evals = [r for r in rows if r["kind"] == "eval"]
    steps = [r for r in rows if r["kind"] == "train"]
    curve = [{"step": r["step"], "minutes": r["wall_s"] / 60, "accuracy": r["eval/accuracy"],
              "se": math.sqrt(r["eval/accuracy"] * (1 - r["eval/accuracy"]) / n),
              "truncated": r.get("eval/truncated_frac")} for r in evals]
    out = {"dir": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
           "algo": _row_name(path, cfg), "seed": cfg["train"]["seed"], "eval_samples_total": n, "curve": curve,
           "updates": len(steps), "s_per_update": statistics.fmean(r["time/step_s"] for r in steps) if steps else None,
           "learn_s": statistics.fmean(r["time/learn_s"] for r in steps) if steps else None,
           "generate_s": statistics.fmean(r["time/generate_s"] for r in steps if "time/generate_s" in r)
           if any("time/generate_s" in r for r in steps) else None}
    if (path / "stats").is_dir() and len(steps) >= 2:  # through the services (smollm2_learning.sh's NAME_services)
        out["services"] = services_split(path, steps)
    if curve:
        first, last = curve[0], curve[-1]
        peak = max(curve, key=lambda c: c["accuracy"])
        out["peak"] = {"step": peak["step"], "minutes": peak["minutes"], "accuracy": peak["accuracy"]}
        out["gain_unpaired"] = {"before": first["accuracy"], "after": last["accuracy"],
                                "gain": last["accuracy"] - first["accuracy"],
                                "se": math.hypot(first["se"], last["se"]), "minutes": last["minutes"]}
    final = path / "final"
    if (final / "samples.jsonl").is_file():
        m = json.loads((final / "metrics.json").read_text())
        out["final_samples_per_problem"] = m["samples_per_problem"]
        base = next((b for b in bases if _evaluated_alike(m, json.loads((b / "metrics.json").read_text()))), None)
        if base is None:
            if bases:
                print(f"{final}: no --base evaluated alike ({m['samples_per_problem']} samples per problem, seed "
                      f"{m['seed']}, temperature {m['temperature']}): no paired gain", file=sys.stderr)
            return out
        out["gain_paired"] = paired_gain(per_problem(base / "samples.jsonl"), per_problem(final / "samples.jsonl"))
        out["gain_paired"]["samples_per_problem"] = m["samples_per_problem"]
        out["gain_paired"]["rates_before"] = answer_rates(base / "samples.jsonl")
        out["gain_paired"]["rates_after"] = answer_rates(final / "samples.jsonl")
    return out


def services_split(path: Path, steps: list[dict]) -> dict:
    """Where a services run's time went, over its training window (first to last update): each stage's busy share
    (the services' busy logs), the learner's wait for a batch and weight push per update, its own median seconds per
    update (learn and push, waits excluded: the bound while the learner is the slower side) and how far over it the
    run came, the engine's generating seconds per batch it made, the engine's own seconds per update (generation,
    evaluation and loads: ``analyse_cluster_run``'s ``engine_own_s``) and how far over the slower side's own time the
    run came, the groups the replay dropped as stale (its log) as a share of those it dropped or served, and how old
    the trained tokens were (the share of tokens generated K versions behind the learner, averaged over updates)."""
    from async_vapo.experiments.report import analyse_cluster_run

    a = analyse_cluster_run(path)
    stale = a["stale_groups"]
    cfg = json.loads((path / "config.resolved.json").read_text())
    pps = cfg["algo"]["prompts_per_step"]
    served = len(steps) * pps * (1 + cfg["algo"].get("max_resample_rounds", 0)
                                 * bool(cfg["algo"].get("dynamic_sampling")))
    lags: dict[str, list[float]] = defaultdict(list)
    for r in steps:
        for k, v in r.items():
            if k.startswith("mismatch/lag") and k.endswith("/token_frac"):
                lags[k.split("/")[1].removeprefix("lag")].append(v)
    return {"seconds_per_update": a["seconds_per_update"], "busy_fraction": a["busy_fraction"],
            "generate_and_learn_overlap": a["generate_and_learn_overlap"], "learn_s": a["learn_s_per_update"],
            "wait_s": a["wait_s_per_update"],
            "push_s": statistics.fmean(r.get("time/weight_push_s", 0.0) for r in steps),
            "token_lag_mean": a["token_lag_mean"], "token_lag_max": a["token_lag_max"],
            "multi_version_samples": a["multi_version_samples"], "own_s": a["learner_own_s"],
            "over_bound": a["over_learner_own"], "stale_groups": stale,
            "between_evals_s": a["between_evals_s_per_update"], "engine_own_s": a["engine_own_s"],
            "slower_side": a["slower_side"], "over_slower_side": a["over_slower_side"],
            "over_bound_between_evals": a["over_learner_own_between_evals"],
            "stale_share": stale / (stale + served) if stale + served else 0.0,
            # the engine's side: its seconds generating per batch it made (served in the window, or dropped stale)
            "engine_s_per_batch": a["busy_fraction"].get("generate", 0.0) * a["window_s"] * pps
            / max(1, a["updates"] * pps + stale),
            "token_lag_share": {k: sum(v) / len(steps) for k, v in sorted(lags.items(), key=lambda kv: int(kv[0]))}}


def side_by_side(runs: list[dict]) -> list[dict]:
    """Per algorithm: the paired gains' mean over seeds; per seed that both algorithms ran: their last checkpoints
    compared per problem (each run's ``final/`` evaluation, same problems and sample seeds)."""
    rows = []
    by_algo: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if "gain_paired" in r:
            by_algo[r["algo"]].append(r)
    for algo, rs in sorted(by_algo.items()):
        gains = [r["gain_paired"]["gain"] for r in rs]
        rows.append({"kind": "algo", "algo": algo, "seeds": [r["seed"] for r in rs], "gains": gains,
                     "mean_gain": statistics.fmean(gains),
                     "peaks": [r["peak"]["accuracy"] for r in rs if "peak" in r],
                     "last": [r["gain_paired"]["after"] for r in rs]})
    algos = sorted(by_algo)
    for i, a in enumerate(algos):
        for b in algos[i + 1:]:
            for seed in sorted({r["seed"] for r in by_algo[a]} & {r["seed"] for r in by_algo[b]}):
                of_seed = {r["algo"]: r for r in runs if r["seed"] == seed}
                if of_seed[a]["final_samples_per_problem"] != of_seed[b]["final_samples_per_problem"]:
                    continue  # last checkpoints evaluated with other samples per problem: not compared
                final = {k: ROOT / r["dir"] / "final" / "samples.jsonl" for k, r in of_seed.items()}
                g = paired_gain(per_problem(final[a]), per_problem(final[b]))
                rows.append({"kind": "pair", "a": a, "b": b, "seed": seed, **g})
    return rows


def plot(runs: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    algos = sorted({r["algo"] for r in runs})
    seeds = sorted({r["seed"] for r in runs})
    for r in runs:  # a colour per algorithm, a line style per seed
        xs = [c["minutes"] for c in r["curve"]]
        ys = [c["accuracy"] for c in r["curve"]]
        se = [c["se"] for c in r["curve"]]
        line, = ax.plot(xs, ys, ["o-", "s--", "^:", "d-."][seeds.index(r["seed"]) % 4],
                        color=f"C{algos.index(r['algo'])}", label=f"{r['algo']}, seed {r['seed']}")
        ax.fill_between(xs, [y - s for y, s in zip(ys, se, strict=True)], [y + s for y, s in zip(ys, se, strict=True)],
                        color=line.get_color(), alpha=0.15)
    ax.axvline(60, color="grey", ls=":", lw=1)
    ax.set(xlabel="trainer wall-clock (minutes; evaluations included)", ylabel="held-out accuracy (± 1 s.e.)",
           title="SmolLM2-135M-Instruct, word problems, 2-core CPU")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def _between(x: dict) -> str:
    """Seconds per update between evaluations and how far over the learner's own (median) they came."""
    if x.get("between_evals_s") is None:
        return "–"
    return f"{x['between_evals_s']:.1f}, {x['over_bound_between_evals']:+.0%}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--base", nargs="*", default=[],
                    help="async-vapo eval's outputs for the untrained model (samples.jsonl, metrics.json); each run's "
                         "final/ is paired with the one evaluated alike (samples per problem, seed, temperature)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "smollm2_learning"))
    args = ap.parse_args(argv)
    bases = [Path(b) for b in args.base]
    runs = [load_run(Path(p).resolve(), bases) for p in args.runs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| run | updates | s / update (learner) | held-out before → after | minutes | gain ± s.e. (unpaired) "
             "| gain ± s.e. (paired, per problem) | best held-out |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        u = r.get("gain_unpaired", {})
        p = r.get("gain_paired")
        if p:
            rb, ra = p["rates_before"], p["rates_after"]
            paired = (f"{p['before']:.3f} → {p['after']:.3f}: {p['gain']:+.3f} ± {p['se']:.3f} ({p['gain_in_se']:.1f} "
                      f"s.e.; {p['problems']} problems × {p['samples_per_problem']}; cut {rb['truncated']:.3f} → "
                      f"{ra['truncated']:.3f}, answer read {rb['parsed']:.3f} → {ra['parsed']:.3f})")
        else:
            paired = "—"
        pk = r.get("peak")
        best = f"{pk['accuracy']:.3f} at update {pk['step']} ({pk['minutes']:.1f} min)" if pk else "—"
        lines.append(f"| {r['algo']} seed {r['seed']} | {r['updates']} | {r['s_per_update']:.1f} ({r['learn_s']:.1f}) "
                     f"| {u.get('before', float('nan')):.3f} → {u.get('after', float('nan')):.3f} "
                     f"| {u.get('minutes', float('nan')):.1f} | {u.get('gain', float('nan')):+.3f} ± "
                     f"{u.get('se', float('nan')):.3f} | {paired} | {best} |")
    services = [r for r in runs if "services" in r]
    if services:
        lines += ["", "| through the services | s / update | the learner's own (median), over it "
                  "| s / update between evaluations, over the learner's own "
                  "| the engine's generating s per batch made "
                  "| the engine's own s / update (generate, evaluate, load); the slower side's, over it "
                  "| busy share: generate, learn, evaluate, load weights "
                  "| generate and learn at once "
                  "| learner waits for a batch (s / update) "
                  "| groups dropped stale (share) | trained tokens by version lag | samples under two versions |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in services:
            x = r["services"]
            b = x["busy_fraction"]
            lag = ", ".join(f"{k}: {v:.1%}" for k, v in x["token_lag_share"].items())
            lines.append(f"| {r['algo']} seed {r['seed']} | {x['seconds_per_update']:.1f} | {x['own_s']:.1f}, "
                         f"{x['over_bound']:+.0%} | {_between(x)} | {x['engine_s_per_batch']:.1f} | "
                         f"{x['engine_own_s']:.1f}; {x['slower_side']}, {x['over_slower_side']:+.0%} | "
                         + ", ".join(f"{b.get(k, 0.0):.2f}" for k in ("generate", "learn", "evaluate", "load_weights"))
                         + f" | {x['generate_and_learn_overlap']:.2f} | {x['wait_s']:.1f} | "
                         f"{x['stale_groups']} ({x['stale_share']:.0%}) | {lag} "
                         f"| {x['multi_version_samples'] or 0.0:.1%} |")
    side = side_by_side(runs)
    if side:
        lines += ["", "| side by side | per seed | mean |", "|---|---|---|"]
        for x in side:
            if x["kind"] == "algo":
                per = ", ".join(f"seed {s}: {g:+.3f}" for s, g in zip(x["seeds"], x["gains"], strict=True))
                lines.append(f"| {x['algo']}: paired gain of the last checkpoint | {per} | {x['mean_gain']:+.3f} |")
            else:
                lines.append(f"| {x['b']} − {x['a']}, last checkpoints per problem | seed {x['seed']}: "
                             f"{x['gain']:+.3f} ± {x['se']:.3f} ({x['gain_in_se']:.1f} s.e.; "
                             f"{x['improved']} problems better, {x['worsened']} worse) | |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    (out / "summary.json").write_text(json.dumps({"runs": runs, "side_by_side": side}, indent=1) + "\n")
    plot(runs, out / "curves.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
