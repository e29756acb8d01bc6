"""`async-vapo report DIR...`: turn benchmark results into PNG plots and a markdown table, in DIR.

Recognised folders (by what they hold):

* ``staleness_<s>/`` run directories of ``benchmarks/async_vs_sync.sh`` (cluster runs, one per staleness
  bound): learner-consumed samples/s, wall-clock per update, each stage's busy fraction and how much
  generation and learning overlap, pipeline efficiency, held-out accuracy vs wall-clock, the replay's
  age histogram, the critic's error by sample age, peak memory per service; with ``one_process/`` (the
  one-process trainer on every core, the best synchronous configuration) also each run against it and the
  ideal bound against it;
  -> ``async_vs_sync.md``, ``async_vs_sync.json``, ``async_vs_sync.png``, ``timeline.png``;
* the runs of ``async-vapo experiment`` (``<method>_s<seed>/``) -> see :mod:`async_vapo.experiments.comparison`;
* ``result.json`` of ``benchmarks/weight_sync.py`` / ``benchmarks/transport.py`` -> ``<name>.md`` + PNG.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

STAGES = ("generate", "verify", "learn")
"""The pipeline's stages (rollout, verifier, learner); ``evaluate`` / ``load_weights`` / ``publish`` are
reported beside them."""


def _rows(run: Path) -> list[dict]:
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


def busy_intervals(run: Path, pattern: str = "*") -> dict[str, list[tuple[float, float]]]:
    """Stage -> [(start, end)] seconds since the cluster started, from the busy logs of every service (or of those
    whose name matches ``pattern``, e.g. ``rollout-0``)."""
    out: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for f in sorted((run / "stats").glob(f"{pattern}.busy.jsonl")):
        for line in f.read_text().splitlines():
            try:
                stage, a, b = json.loads(line)
            except ValueError:  # a line cut by a kill: skip it
                continue
            out[stage].append((float(a), float(b)))
    return out


ENGINE_WORK = ("generate", "evaluate", "load_weights")
"""What a rollout engine's own time per update is made of: its training groups, rollout 0's held-out evaluations,
its loads of new versions."""


def _covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of [lo, hi] covered by the union of ``intervals``."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def _intersection(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for a, b in x:
        for c, d in y:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                out.append((lo, hi))
    return out


EVAL_SECONDS = ("time/eval_s", "time/critic_eval_s", "time/critic_score_s")
"""An eval row's seconds: the evaluation's generation and grading, the critic's fresh held-out responses
(``rollout.critic_eval_problems``), and scoring the critic on its held-out responses."""


def eval_seconds(row: dict) -> float:
    """What one eval row's evaluation cost, in seconds (the parts of :data:`EVAL_SECONDS` the row has)."""
    return sum(row.get(k, 0.0) for k in EVAL_SECONDS)


def eval_spans(rows: list[dict]) -> list[tuple[float, float]]:
    """Each held-out evaluation's span in a run's metrics rows: its row's ``wall_s`` less its
    :func:`eval_seconds`, to ``wall_s``."""
    return [(r["wall_s"] - eval_seconds(r), r["wall_s"]) for r in rows if r.get("kind") == "eval"]


def analyse_cluster_run(run: Path) -> dict:
    """Figures of one cluster run over its training window (first to last policy update)."""
    rows = _rows(run)
    train = sorted((r for r in rows if r.get("kind") == "train"), key=lambda r: r["step"])
    if len(train) < 2:
        raise ValueError(f"{run}: fewer than two policy updates in metrics.jsonl")
    lo, hi = train[0]["wall_s"], train[-1]["wall_s"]
    window = hi - lo
    updates = len(train) - 1
    samples = train[-1]["samples_seen"] - train[0]["samples_seen"]
    busy = busy_intervals(run)
    fractions = {stage: _covered(iv, lo, hi) / window for stage, iv in busy.items()}
    gen_and_learn = _covered(_intersection(busy.get("generate", []), busy.get("learn", [])), lo, hi) / window
    # critic error by sample age, pooled over updates (weighted by samples); an update where a figure is undefined
    # (null / NaN: the explained variance of targets that do not vary) does not count towards that figure
    by_age: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(("samples", "ev_w", "ev_n", "err_w",
                                                                             "err_n"), 0.0))
    for r in train:
        for k, n in r.items():
            if k.startswith("critic_age/") and k.endswith("/samples"):
                age = int(k.split("/")[1])
                d = by_age[age]
                d["samples"] += n
                for what, key in (("ev", "explained_variance"), ("err", "value_error_abs")):
                    v = r.get(f"critic_age/{age}/{key}")
                    if v is not None and math.isfinite(v):
                        d[f"{what}_w"] += n * v
                        d[f"{what}_n"] += n
    critic = {a: {"samples": int(d["samples"]),
                  "value_error_abs": d["err_w"] / d["err_n"] if d["err_n"] else None,
                  "explained_variance": d["ev_w"] / d["ev_n"] if d["ev_n"] else None}
              for a, d in sorted(by_age.items())}
    evals = [(r["wall_s"], r["eval/accuracy"], r["version"]) for r in rows if r.get("kind") == "eval"]
    # the learner's own seconds per update: learn and push, its waits for a batch excluded, the median over the
    # updates after the first (which carries start-up); the bound on seconds per update while the learner is the
    # slower side
    own = statistics.median(r["time/learn_s"] + r.get("time/weight_push_s", 0.0) for r in train[1:])
    # the engine's own seconds per update: the seconds of the window in which it generated, evaluated or loaded
    # weights, per update (the mean over engines); the pipeline's bound is the slower side's own time
    engines = [busy_intervals(run, f.name.removesuffix(".busy.jsonl"))
               for f in sorted((run / "stats").glob("rollout-*.busy.jsonl"))]
    engine_own = (statistics.fmean(_covered([iv for st in ENGINE_WORK for iv in e.get(st, [])], lo, hi)
                                   for e in engines) / updates) if engines else None
    bound = max(own, engine_own or 0.0)
    # seconds per update between evaluations: the intervals between consecutive updates that no held-out
    # evaluation's span (eval_spans) overlaps; with the rest, what the evaluations cost
    spans = eval_spans(rows)
    gaps = [(a["wall_s"], b["wall_s"]) for a, b in zip(train, train[1:], strict=False)]
    between = [b - a for a, b in gaps if not any(s <= b and e >= a for s, e in spans)]
    between_s = statistics.fmean(between) if between else None
    replay_log = run / "logs" / "replay.log"
    stale = sum(int(m.group(1)) for m in re.finditer(r"dropped (\d+) groups: stale",
                                                     replay_log.read_text(errors="replace")
                                                     if replay_log.is_file() else ""))
    memory = {}
    for f in sorted((run / "stats").glob("*.json")):
        s = json.loads(f.read_text())
        memory[s["service"]] = round(s["peak_rss_with_children_mib"], 1)
    return {
        "updates": updates, "window_s": window, "samples": samples,
        "samples_per_s": samples / window, "seconds_per_update": window / updates,
        "busy_fraction": fractions, "generate_and_learn_overlap": gen_and_learn,
        "max_age": max(r.get("replay/max_age", 0) for r in train),
        "learn_s_per_update": statistics.fmean(r["time/learn_s"] for r in train),
        "wait_s_per_update": statistics.fmean(r["time/wait_batch_s"] for r in train),
        "critic_by_age": critic, "evals": evals, "peak_rss_mib": memory,
        # how old the trained tokens were (rows of runs before per-token versions lack these: None)
        "token_lag_mean": _mean_of(train, "replay/token_lag_mean"),
        "token_lag_max": max((r["replay/token_lag_max"] for r in train if "replay/token_lag_max" in r), default=None),
        "multi_version_samples": _mean_of(train, "replay/multi_version_samples"),
        "final_accuracy": evals[-1][1] if evals else None,
        "learner_own_s": own, "over_learner_own": window / updates / own - 1,
        "engine_own_s": engine_own, "slower_side_s": bound, "over_slower_side": window / updates / bound - 1,
        "slower_side": "engine" if engine_own is not None and engine_own > own else "learner",
        "between_evals_s_per_update": between_s, "between_evals_updates": len(between),
        "over_learner_own_between_evals": between_s / own - 1 if between_s is not None else None,
        # groups the replay dropped as too old for the staleness bound (its log; the whole run, not the window)
        "stale_groups": stale,
    }


def _mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(vals) if vals else None


def analyse_one_process_run(run: Path) -> dict:
    """Samples/s and seconds per update of a one-process trainer run over its training window (first to last
    update), the window :func:`analyse_cluster_run` uses."""
    train = sorted((r for r in _rows(run) if r.get("kind") == "train"), key=lambda r: r["step"])
    if len(train) < 2:
        raise ValueError(f"{run}: fewer than two policy updates in metrics.jsonl")
    window = train[-1]["wall_s"] - train[0]["wall_s"]
    samples = train[-1]["samples_seen"] - train[0]["samples_seen"]
    return {"updates": len(train) - 1, "window_s": window, "samples": samples, "samples_per_s": samples / window,
            "seconds_per_update": window / (len(train) - 1),
            "generate_s_per_update": statistics.fmean(r["time/generate_s"] for r in train[1:]),
            "learn_s_per_update": statistics.fmean(r["time/learn_s"] for r in train[1:])}


def _stage_alone(sync_run: Path, samples: int) -> dict[str, float]:
    """Samples/s of each stage alone on its share of the machine: in the synchronous run the stages take turns, so
    its busy time per update is the stage's time with nothing else running."""
    alone = {}
    iv = busy_intervals(sync_run)
    tr = [r["wall_s"] for r in _rows(sync_run) if r.get("kind") == "train"]
    for stage in STAGES:
        sec = _covered(iv.get(stage, []), min(tr), max(tr))
        alone[stage] = samples / sec if sec > 0 else float("inf")
    return alone


def _secondary_tables(res: dict) -> tuple[list[str], list[str], list[str]]:
    """The report's markdown rows of the critic's error by sample age, the token-version lag and peak memory."""
    ages = sorted({a for r in res.values() for a in r["critic_by_age"]})
    critic_rows = ["| max_staleness | " + " | ".join(f"age {a}: mean abs(V − R) / EV / samples" for a in ages) + " |",
                   "|---|" + "---|" * len(ages)]
    for s, r in res.items():
        cells = []
        for a in ages:
            c = r["critic_by_age"].get(a)
            ev = "–" if not c or c["explained_variance"] is None else f"{c['explained_variance']:.3f}"
            err = "–" if not c or c["value_error_abs"] is None else f"{c['value_error_abs']:.3f}"
            cells.append("–" if not c else f"{err} / {ev} / {c['samples']}")
        critic_rows.append(f"| {s} | " + " | ".join(cells) + " |")
    lag_rows = ["| max_staleness | mean token lag | max token lag | samples under more than one version |",
                "|---|---|---|---|"]
    for s, r in res.items():
        if r["token_lag_mean"] is not None:
            lag_rows.append(f"| {s} | {r['token_lag_mean']:.3f} | {r['token_lag_max']} | "
                            f"{r['multi_version_samples']:.1%} |")
    services = sorted({k for r in res.values() for k in r["peak_rss_mib"]})
    mem_rows = ["| max_staleness | " + " | ".join(services) + " |", "|---|" + "---|" * len(services)]
    for s, r in res.items():
        mem_rows.append(f"| {s} | " + " | ".join(str(r["peak_rss_mib"].get(k, "–")) for k in services) + " |")
    return critic_rows, lag_rows, mem_rows


def report_async(out: Path) -> dict:
    runs = sorted((d for d in out.iterdir() if d.is_dir() and d.name.startswith("staleness_")), key=_run_order)
    res = {_run_key(d): analyse_cluster_run(d) for d in runs if (d / "metrics.jsonl").exists()}
    if 0 not in res:
        raise ValueError(f"{out}: no staleness_0 run (the synchronous reference)")
    sync = res[0]
    alone = _stage_alone(out / "staleness_0", sync["samples"])
    slowest = min(alone, key=alone.get)
    # a perfect pipeline runs at the slowest stage's pace: its speed-up over sync is bounded by the synchronous
    # update time (every stage plus hand-offs) over the slowest stage's busy time per update
    bound = alone[slowest] / sync["samples_per_s"]
    one = analyse_one_process_run(out / "one_process") if (out / "one_process" / "metrics.jsonl").exists() else None
    table = ["| max_staleness | samples/s | × sync | s / update | busy: generate | verify | learn | "
             "gen ∥ learn | pipeline efficiency | max age | learner wait s/update | last held-out eval |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s, r in res.items():
        r["speedup_vs_sync"] = r["samples_per_s"] / sync["samples_per_s"]
        r["pipeline_efficiency"] = r["samples_per_s"] / alone[slowest]
        if one is not None:
            r["speedup_vs_one_process"] = r["samples_per_s"] / one["samples_per_s"]
        f = r["busy_fraction"]
        last_eval = f"{r['evals'][-1][1]:.3f} (version {r['evals'][-1][2]})" if r["evals"] else "–"
        table.append(f"| {s} | {r['samples_per_s']:.2f} | {r['speedup_vs_sync']:.2f} | {r['seconds_per_update']:.2f} | "
                     f"{f.get('generate', 0):.2f} | {f.get('verify', 0):.3f} | {f.get('learn', 0):.2f} | "
                     f"{r['generate_and_learn_overlap']:.2f} | {r['pipeline_efficiency']:.2f} | {r['max_age']} | "
                     f"{r['wait_s_per_update']:.2f} | "
                     f"{last_eval} |")
    best = max(res, key=lambda s: res[s]["samples_per_s"])
    critic_rows, lag_rows, mem_rows = _secondary_tables(res)
    summary = {
        "stage_alone_samples_per_s": alone, "slowest_stage": slowest,
        "ideal_pipeline_speedup_bound": bound, "best_bound": best,
        "best_speedup_vs_sync": res[best]["speedup_vs_sync"],
        "best_pipeline_efficiency": res[best]["pipeline_efficiency"], "runs": {str(k): v for k, v in res.items()},
    }
    one_text: list[str] = []
    if one is not None:
        # against the best synchronous configuration a perfect pipeline (the slowest stage's pace on its core)
        # is bounded by the one-process trainer's samples/s: the bound can be below 1 when that trainer uses
        # every core in each phase and one stage dominates
        one_bound = alone[slowest] / one["samples_per_s"]
        summary |= {"one_process": one, "ideal_bound_vs_one_process": one_bound,
                    "best_speedup_vs_one_process": res[best]["speedup_vs_one_process"],
                    "fraction_of_bound_vs_one_process": res[best]["speedup_vs_one_process"] / one_bound}
        one_text = [
            "## Against the one-process trainer (every core in each phase: the best synchronous configuration)", "",
            f"One process: {one['samples_per_s']:.2f} samples/s, {one['seconds_per_update']:.2f} s per update "
            f"(generation {one['generate_s_per_update']:.2f} s, learner {one['learn_s_per_update']:.2f} s). "
            f"A perfect pipeline of the services (the slowest stage, {slowest}, alone on its core) reaches at most "
            f"**{one_bound:.2f}×** that; the best run, max_staleness = {best}, reaches "
            f"**{res[best]['speedup_vs_one_process']:.2f}×**, {summary['fraction_of_bound_vs_one_process']:.2f} of "
            f"the bound.", "",
            "| max_staleness | × one process |", "|---|---|",
            *(f"| {s} | {r['speedup_vs_one_process']:.2f} |" for s, r in res.items()), "",
        ]
    text = [
        f"# Async vs sync on the services ({_config_name(out)}, rollout on core 0, learner on core 1)", "",
        "\n".join(table), "",
        f"Each stage alone on its core (busy time in the synchronous run): generate {alone['generate']:.1f}, "
        f"verify {alone['verify']:.0f}, learn {alone['learn']:.1f} samples/s. The slowest is **{slowest}**; "
        f"pipeline efficiency = samples/s ÷ {alone[slowest]:.1f}. A perfect pipeline runs at the slowest stage's "
        f"pace, so it can be at most **{bound:.2f}×** the synchronous run (the synchronous update time, every "
        f"stage plus hand-offs, over the slowest stage's busy time per update).", "",
        f"Best bound: max_staleness = {best}: **{res[best]['speedup_vs_sync']:.2f}× sync** samples/s, pipeline "
        f"efficiency **{res[best]['pipeline_efficiency']:.2f}**.", "",
        *one_text,
        *(["## Token-version lag at training time (the learner's version minus the version that sampled each "
           "trained token; mean over updates)", "", "\n".join(lag_rows), ""] if len(lag_rows) > 2 else []),
        "## Critic error by sample age (before each update, pooled over updates)", "", "\n".join(critic_rows), "",
        "## Peak resident memory per service (MiB, with child processes: vLLM engine core, sandbox workers)", "",
        "\n".join(mem_rows), "",
    ]
    (out / "async_vs_sync.md").write_text("\n".join(text))
    (out / "async_vs_sync.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot_async(out, res, alone, slowest)
    _plot_timeline(out, [0] if best == 0 else [0, best])
    return summary


def _run_order(d: Path) -> tuple[int, str]:
    bound, _, label = d.name.removeprefix("staleness_").partition("_")
    return int(bound), label


def _run_key(d: Path) -> int | str:
    """``staleness_<s>`` -> s; ``staleness_<s>_<label>`` (the same bound in another mode, e.g. ``continuous``) ->
    "<s>_<label>", its run directory's suffix."""
    bound, label = _run_order(d)
    return f"{bound}_{label}" if label else bound


def _config_name(out: Path) -> str:
    """The config the runs were made with (from ``command.txt``), or "embedded default"."""
    cmd = (out / "command.txt").read_text() if (out / "command.txt").exists() else ""
    words = cmd.split()
    for w in words:
        if w.startswith("CONFIG="):
            return w.split("=", 1)[1].strip('"')
    return "embedded default"


def _plot_async(out: Path, res: dict[int, dict], alone: dict[str, float], slowest: str) -> None:
    from async_vapo.experiments.plots import new_figure

    fig, ax = new_figure(2, 2, (12, 8.5))
    bounds = list(res)
    labels = [str(s) for s in bounds]
    a = ax[0][0]
    sps = [res[s]["samples_per_s"] for s in bounds]
    bars = a.bar(labels, sps, color="C0")
    a.bar_label(bars, labels=[f"{v:.1f}\n({res[s]['speedup_vs_sync']:.2f}×)" for v, s in zip(sps, bounds,
                                                                                               strict=True)],
                fontsize="small")
    a.axhline(alone[slowest], color="C3", ls="--", label=f"{slowest} alone ({alone[slowest]:.1f}/s)")
    a.set(xlabel="max_staleness", ylabel="learner-consumed samples / s", title="throughput (× sync)")
    a.legend(fontsize="small")
    a.margins(y=0.2)
    a = ax[0][1]
    width = 0.8 / 4
    for i, stage in enumerate((*STAGES, "overlap")):
        vals = [res[s]["generate_and_learn_overlap"] if stage == "overlap" else res[s]["busy_fraction"].get(stage, 0)
                for s in bounds]
        a.bar([j + (i - 1.5) * width for j in range(len(bounds))], vals, width,
              label="generate ∥ learn" if stage == "overlap" else stage)
    a.set_xticks(range(len(bounds)), labels)
    a.set(xlabel="max_staleness", ylabel="fraction of the training window", title="busy fraction per stage",
          ylim=(0, 1.05))
    a.legend(fontsize="small")
    a = ax[1][0]
    for i, s in enumerate(bounds):
        ev = res[s]["evals"]
        if ev:
            a.plot([w / 60 for w, _, _ in ev], [acc for _, acc, _ in ev], "-o", color=f"C{i}",
                   label=f"max_staleness {s}", ms=3)
    a.set(xlabel="wall-clock (min since cluster start)", ylabel="held-out accuracy", title="accuracy vs wall-clock",
          ylim=(0, 1))
    a.grid(alpha=0.3)
    a.legend(fontsize="small")
    a = ax[1][1]
    for i, s in enumerate(bounds):
        c = res[s]["critic_by_age"]
        if c:
            a.plot(list(c), [math.nan if v["value_error_abs"] is None else v["value_error_abs"] for v in c.values()],
                   "-o", color=f"C{i}", label=f"max_staleness {s}")
    a.set(xlabel="sample age (versions)", ylabel="mean |V − target| per token", title="critic error by sample age")
    a.grid(alpha=0.3)
    a.legend(fontsize="small")
    fig.savefig(out / "async_vs_sync.png", dpi=100)


def _plot_timeline(out: Path, bounds: list[int], span: float = 60.0) -> None:
    """Which stage is busy when, over ``span`` seconds from the middle of each run's training window."""
    from async_vapo.experiments.plots import new_figure

    fig, ax = new_figure(len(bounds), 1, (12, 1.8 * len(bounds) + 0.8))
    for row, s in enumerate(bounds):
        run = out / f"staleness_{s}"
        tr = [r["wall_s"] for r in _rows(run) if r.get("kind") == "train"]
        lo = (min(tr) + max(tr)) / 2 - span / 2
        a = ax[row][0]
        busy = busy_intervals(run)
        lanes = [st for st in ("generate", "evaluate", "load_weights", "verify", "learn", "publish") if st in busy]
        for i, stage in enumerate(lanes):
            segs = [(max(x, lo) - lo, min(y, lo + span) - max(x, lo)) for x, y in busy[stage]
                    if y > lo and x < lo + span]
            a.broken_barh(segs, (i - 0.4, 0.8), color=f"C{i}")
        a.set_yticks(range(len(lanes)), lanes)
        a.set(xlim=(0, span), title=f"max_staleness {s}: busy stages over {span:.0f} s of training")
    ax[-1][0].set_xlabel("seconds")
    fig.savefig(out / "timeline.png", dpi=100)


def report_weight_sync(out: Path) -> Path:
    """``weight_sync.md`` / ``weight_sync.png`` from benchmarks/weight_sync.py's result.json."""
    from async_vapo.experiments.plots import new_figure

    d = json.loads((out / "result.json").read_text())
    sizes = list(d["sizes"])
    paths = list(dict.fromkeys(p for s in d["sizes"].values() for p in s["paths"]))
    rows = ["| size | params | MB | memcpy s | " + " | ".join(f"{p} s (× memcpy)" for p in paths) + " |",
            "|---|---|---|---|" + "---|" * len(paths)]
    fig, ax = new_figure(1, 1, (9, 4.5))
    a = ax[0][0]
    width = 0.8 / len(paths)
    for i, p in enumerate(paths):
        ratios = []
        for s in sizes:
            r = d["sizes"][s]
            ratios.append(r["paths"][p]["median"]["total_s"] / r["memcpy"]["median_s"] if p in r["paths"] else 0)
        bars = a.bar([j + (i - (len(paths) - 1) / 2) * width for j in range(len(sizes))], ratios, width, label=p)
        a.bar_label(bars, labels=[f"{v:.1f}×" for v in ratios], fontsize="small")
    for s in sizes:
        r = d["sizes"][s]
        t = {p: r["paths"][p]["median"]["total_s"] for p in paths if p in r["paths"]}
        cells = [f"{t[p]:.3f} ({t[p] / r['memcpy']['median_s']:.1f}×)" if p in t else "–" for p in paths]
        rows.append(f"| {s} | {r['params']:,} | {r['bytes_per_push'] / 1e6:.0f} | {r['memcpy']['median_s']:.3f} | "
                    + " | ".join(cells) + " |")
    a.axhline(2, color="C3", ls="--", label="goal: 2× memcpy")
    a.set_xticks(range(len(sizes)), sizes)
    a.set(yscale="log", xlabel="model size (parameters)", ylabel="push time ÷ memcpy of the same bytes",
          title="weight push into the running vLLM engine (median)")
    a.legend(fontsize="small")
    fig.savefig(out / "weight_sync.png", dpi=100)
    dist_rows = []
    for s in sizes:
        r = d["sizes"][s]
        if "bare_gloo" not in r or "cluster_dist" not in r["paths"]:
            continue
        m, g = r["paths"]["cluster_dist"]["median"], r["dist_goals"]
        dist_rows.append(f"| {s} | {m['total_s']:.3f} | {m['transfer_s']:.3f} | {r['bare_gloo']['median_s']:.3f} | "
                         f"{m['reload_s']:.3f} | {r['paths']['shared']['median']['reload_s']:.3f} | "
                         f"{g['transfer_over_bare_gloo_le_1.2']:.2f} | {g['push_over_shm_push_le_1']:.2f} | "
                         f"{g['push_over_vllm_reload_weights_le_1.2']:.2f} |")
    if dist_rows:
        rows += ["", "torch.distributed path (cluster_dist) against its references, medians in seconds:", "",
                 "| size | push | transfer | bare gloo | reload (layerwise) | vLLM reload_weights | transfer ÷ bare "
                 "gloo (≤ 1.2) | push ÷ shm push (≤ 1) | push ÷ reload_weights (≤ 1.2) |",
                 "|---|---|---|---|---|---|---|---|---|", *dist_rows]
    md = out / "weight_sync.md"
    md.write_text(f"Command: `{d['command']}`\n\n" + "\n".join(rows) + "\n")
    return md


def report_transport(out: Path) -> Path:
    """``transport.md`` / ``transport.png`` from benchmarks/transport.py's result.json (before / after)."""
    from async_vapo.experiments.plots import bar_chart

    d = json.loads((out / "result.json").read_text())
    runs = [k for k in ("before", "after") if k in d]
    rows = ["| | frame bytes | ours msg/s | raw ZeroMQ msg/s | ratio | transport alone ratio | encode µs | decode µs |",
            "|---|---|---|---|---|---|---|---|"]
    for k in runs:
        r = d[k]
        rows.append(f"| {k} | {r['message']['frame_bytes']:,} | {r['ours_msgs_per_s']:.0f} | "
                    f"{r['raw_msgs_per_s']:.0f} | {r['ratio']:.3f} | {r['transport_only_ratio']:.3f} | "
                    f"{r['encode_us']:.0f} | {r['decode_us']:.0f} |")
    bar_chart(runs, [d[k]["ratio"] for k in runs], out / "transport.png", reference=[0.9] * len(runs),
              title="GroupsMsg through ZeroMQ+msgpack ÷ raw ZeroMQ bytes (messages/s)", ylabel="ratio",
              reference_label="goal")
    md = out / "transport.md"
    md.write_text(f"Command: `{d[runs[-1]]['command']}`\n\n" + "\n".join(rows) + "\n")
    return md


def add_arguments(p) -> None:
    """The arguments of ``async-vapo report`` on the parser ``p`` (here and in ``async_vapo.cli``)."""
    p.add_argument("dirs", nargs="+", help="result folders (benchmarks/results/...)")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="async-vapo report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    for d in map(Path, args.dirs):
        if not d.is_dir():
            print(f"async-vapo report: {d} is not a folder", file=sys.stderr)
            return 2
        if any(d.glob("staleness_*")):
            s = report_async(d)
            print(f"{d}: best max_staleness {s['best_bound']}: {s['best_speedup_vs_sync']:.2f}x sync, "
                  f"pipeline efficiency {s['best_pipeline_efficiency']:.2f} -> {d / 'async_vs_sync.md'}")
        elif (d / "result.json").exists() and "sizes" in json.loads((d / "result.json").read_text()):
            print(report_weight_sync(d))
        elif (d / "result.json").exists() and "after" in json.loads((d / "result.json").read_text()):
            print(report_transport(d))
        elif any(d.glob("*_s[0-9]*/summary.json")):
            from async_vapo.experiments.comparison import report

            report(d)
            print(f"{d}: comparison.md, ablation.md and plots written")
        else:
            print(f"async-vapo report: nothing I recognise in {d}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
