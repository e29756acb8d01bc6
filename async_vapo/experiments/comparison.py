"""`async-vapo experiment`: the learning comparison (VAPO vs PPO / GRPO / DAPO, and on request the other objectives
of :data:`OBJECTIVES`: GSPO, CISPO, RLOO, REINFORCE++, Dr. GRPO) and the ablation table.

``run`` trains every (config, seed) of the plan with the one-process trainer, ``--parallel`` runs at a
time (each pinned to its own thread budget), all with the same samples per step and the same number of
steps, so every method sees the same sample budget (DAPO's dynamic sampling counts what it generated).
Finished runs (``summary.json`` present) are skipped, so an interrupted plan resumes. A progress line
shows every running run's step and last held-out accuracy.

``report`` reads the runs and writes, in the output folder: curves with mean and min–max over seeds
(held-out accuracy vs samples and vs wall-clock, response length, entropy, critic explained variance),
``comparison.md`` (final accuracy, steps to reach DAPO's final accuracy), ``ablation.md`` and
``ablation.png`` (each VAPO-without-X beside the paper's AIME24 figure).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from async_vapo.metrics.jsonl import strict_json

COMPARISON = {"vapo": "configs/tiny_cpu.toml", "dapo": "configs/baselines/dapo.toml",
              "grpo": "configs/baselines/grpo.toml", "ppo": "configs/baselines/ppo.toml"}
OBJECTIVES = {n: f"configs/baselines/{n}.toml" for n in (
    "gspo", "gspo_token", "cispo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "dr_grpo")}
"""Further objectives (``algo.name``), each a baseline config beside VAPO's; run only when ``--baselines`` names
them (the default comparison stays VAPO, PPO, GRPO, DAPO)."""
ABLATIONS = {
    "no_value_pretrain": ("value pretraining", 11),
    "no_decoupled_gae": ("decoupled GAE", 33),
    "no_length_adaptive_gae": ("length-adaptive GAE", 45),
    "no_clip_higher": ("clip-higher", 46),
    "no_token_level_loss": ("token-level loss", 53),
    "no_pos_lm_loss": ("positive-example LM loss", 54),
    "no_group_sampling": ("group sampling", 55),
}
PAPER = {"vapo": 60.4, "dapo": 50, "ppo": 5, "grpo": 47}
"""AIME24 avg@32 of Qwen2.5-32B (../shared/VAPO_SPEC.md); grpo is DeepSeek-R1-Zero-Qwen-32B."""


@dataclass(frozen=True)
class Arms:
    """Where each arm's config lives: VAPO's file, the baselines in ``ROOT/baselines/`` and the ablation rows in
    ``ROOT/ablations/`` (the defaults are the embedded task's; ``configs/long`` holds the long task's)."""

    vapo: str = COMPARISON["vapo"]
    root: str = "configs"

    def config(self, name: str) -> str:
        if name == "vapo":
            return self.vapo
        baseline = name in COMPARISON or name in OBJECTIVES
        return f"{self.root}/{'baselines' if baseline else 'ablations'}/{name}.toml"


@dataclass(frozen=True)
class Run:
    name: str  # vapo, dapo, ..., no_clip_higher
    seed: int
    config: str = ""

    def __post_init__(self) -> None:
        if not self.config:
            object.__setattr__(self, "config", Arms().config(self.name))

    @property
    def dirname(self) -> str:
        return f"{self.name}_s{self.seed}"


def plan(which: str, seeds: list[int], ablation_seeds: list[int], arms: Arms = Arms(),
         ablations: list[str] | None = None, baselines: list[str] | None = None) -> list[Run]:
    """The runs of ``which`` (all, comparison, ablation); ``ablations`` picks rows of :data:`ABLATIONS` (all),
    ``baselines`` the baselines beside VAPO, of :data:`COMPARISON` and :data:`OBJECTIVES` (default: ppo, grpo,
    dapo), in the order given."""
    rows = list(ABLATIONS) if ablations is None else ablations
    unknown = [a for a in rows if a not in ABLATIONS]
    if unknown:
        raise ValueError(f"unknown ablation rows {unknown}; known: {', '.join(ABLATIONS)}")
    known = [*COMPARISON, *OBJECTIVES]
    arms_compared = list(COMPARISON) if baselines is None else ["vapo", *baselines]
    unknown = [b for b in arms_compared if b not in known]
    if unknown:
        raise ValueError(f"unknown baselines {unknown}; known: {', '.join(n for n in known if n != 'vapo')}")
    order = [n for n in COMPARISON if n in arms_compared] + [n for n in arms_compared if n in OBJECTIVES]
    runs: list[Run] = []
    if which in ("all", "comparison"):
        runs += [Run(n, s, arms.config(n)) for s in seeds for n in order]
    if which in ("all", "ablation"):
        if which == "ablation":
            runs += [Run("vapo", s, arms.config("vapo")) for s in ablation_seeds]
        runs += [Run(n, s, arms.config(n)) for s in ablation_seeds for n in rows]
    return list(dict.fromkeys(runs))


def _last_rows(path: Path) -> tuple[dict | None, dict | None]:
    last = last_eval = None
    try:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "train":
                last = row
            elif row.get("kind") == "eval":
                last_eval = row
    except (OSError, ValueError):
        pass
    return last, last_eval


def run_plan(runs: list[Run], out: Path, *, steps: int, parallel: int, eval_every: int,
             extra: list[str]) -> list[Run]:
    """Train every run not yet finished; returns the runs that failed."""
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    todo = [r for r in runs if not (out / r.dirname / "summary.json").exists()]
    bar = tqdm(total=len(runs), initial=len(runs) - len(todo), desc="runs", dynamic_ncols=True)
    running: dict[Run, tuple[subprocess.Popen, float]] = {}
    failed: list[Run] = []
    while todo or running:
        while todo and len(running) < parallel:
            r = todo.pop(0)
            d = out / r.dirname
            if d.exists():
                shutil.rmtree(d)  # an unfinished earlier attempt: start it over
            d.mkdir(parents=True)
            cmd = [sys.executable, "-m", "async_vapo.cli", "train", "--config", r.config,
                   f"train.name={r.dirname}", f"train.output_dir={out}/{{name}}", f"train.seed={r.seed}",
                   f"rollout.seed={r.seed}", f"train.total_steps={steps}", f"train.eval_every={eval_every}",
                   "train.checkpoint_every=0", "train.max_minutes=null", "train.threads=1", *extra]
            (d / "command.txt").write_text(" ".join(cmd[1:]) + "\n")
            env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_MININTERVAL="30")
            log = (d / "train.log").open("w")
            running[r] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                           start_new_session=True), time.time())
        try:
            time.sleep(10)
        except KeyboardInterrupt:  # stop every running run with its engine process, keep what finished
            for proc, _ in running.values():
                os.killpg(proc.pid, signal.SIGTERM)
            for proc, _ in running.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            raise
        status = []
        for r, (proc, t0) in list(running.items()):
            last, last_eval = _last_rows(out / r.dirname / "metrics.jsonl")
            acc = f" acc {last_eval['eval/accuracy']:.2f}" if last_eval else ""
            status.append(f"{r.dirname}: step {last['step'] if last else 0}/{steps}{acc}")
            if proc.poll() is None:
                continue
            del running[r]
            shutil.rmtree(out / r.dirname / "checkpoints", ignore_errors=True)
            ok = proc.returncode == 0 and (out / r.dirname / "summary.json").exists()
            if not ok:
                failed.append(r)
            bar.update(1)
            tqdm.write(f"{'finished' if ok else 'FAILED'} {r.dirname} in {(time.time() - t0) / 60:.1f} min"
                       + ("" if ok else f" (log: {out / r.dirname / 'train.log'})"))
        bar.set_postfix_str(" | ".join(status))
    bar.close()
    return failed


# ---------------------------------------------------------------- report
def _evals(run_dir: Path) -> list[dict]:
    rows = (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip())
    return [r for r in rows if r.get("kind") == "eval"]


def _final(run_dir: Path, last: int = 2) -> float:
    """Held-out accuracy at the end: the mean of the last ``last`` evaluations (less noise than one)."""
    ev = _evals(run_dir)
    return statistics.fmean(e["eval/accuracy"] for e in ev[-last:])


def _steps_to(run_dir: Path, target: float) -> int | None:
    for e in _evals(run_dir):
        if e["eval/accuracy"] >= target:
            return int(e["step"])
    return None


def budget_metrics(run_dir: Path) -> Path:
    """``<run>/budget_metrics.jsonl``: the run's rows with ``samples_generated`` = every response generated so
    far, value-pretraining batches included (``samples_seen`` counts only what policy updates consumed; DAPO's
    resampled groups are in both). The first evaluation precedes value pretraining."""
    cfg = json.loads((run_dir / "config.resolved.json").read_text())
    per_step = cfg["algo"]["prompts_per_step"] * cfg["algo"]["group_size"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    pretrain = per_step * sum(r.get("kind") == "pretrain" for r in rows)
    out = run_dir / "budget_metrics.jsonl"
    with out.open("w") as f:
        for r in rows:
            if "samples_seen" in r:
                r["samples_generated"] = r["samples_seen"] + (pretrain if r["step"] > 0 else 0)
            f.write(json.dumps(strict_json(r), allow_nan=False) + "\n")
    return out


def _accuracy_at(budget_file: Path, at: float, x: str = "samples_generated") -> float:
    """Held-out accuracy at ``at`` of ``x`` (generated samples, or ``wall_s``), linearly interpolated between
    evaluations."""
    pts = [(r[x], r["eval/accuracy"]) for r in map(json.loads, budget_file.read_text().splitlines())
           if r.get("kind") == "eval"]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x0 <= at <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    raise ValueError(f"{budget_file}: no evaluation brackets {x} = {at}")


def _mean_sd(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _comparison_report(out: Path, comp: dict[str, list[Path]]) -> dict:
    """The comparison's plots, ``comparison.md`` and its figures, from the runs of each method in ``comp``."""
    from async_vapo.experiments.plots import plot_curves_with_spread

    budget = {k: [budget_metrics(d) for d in runs] for k, runs in comp.items()}
    for x, y, kind, fname, title in [
        ("samples_generated", "eval/accuracy", "eval", "accuracy_vs_samples.png",
         "held-out accuracy vs responses generated\n(value pretraining included; mean, min–max over seeds)"),
        ("wall_s", "eval/accuracy", "eval", "accuracy_vs_wallclock.png", None),
        ("samples_generated", "rollout/response_length", "train", "response_length.png", None),
        ("samples_generated", "actor/entropy", "train", "entropy.png", None),
    ]:
        plot_curves_with_spread(budget, out / fname, x=x, y=y, kind=kind, title=title)
    critic_runs = {k: v for k, v in budget.items() if k in ("vapo", "ppo")}
    if critic_runs:
        plot_curves_with_spread(critic_runs, out / "explained_variance.png", x="samples_generated",
                                y="critic/explained_variance", kind="train")
        plot_curves_with_spread(critic_runs, out / "value_loss.png", x="samples_generated",
                                y="critic/value_loss", kind="train")
    last = {f: [json.loads(x) for x in f.read_text().splitlines()][-1] for fs in budget.values() for f in fs}
    common = min(r["samples_generated"] for r in last.values())
    evals = {f: [r for r in map(json.loads, f.read_text().splitlines()) if r.get("kind") == "eval"]
             for fs in budget.values() for f in fs}
    common_wall = min(e[-1]["wall_s"] for e in evals.values())
    dapo_final = statistics.fmean(_final(d) for d in comp["dapo"]) if "dapo" in comp else None
    rows = ["| method | seeds | initial | final (mean ± sd) | best eval | responses generated | "
            f"at {common:,} responses | gain over its start at {common:,} | at {common_wall / 60:.1f} minutes | "
            "steps to DAPO's final | minutes | CPU minutes | paper AIME24 |", "|---" * 13 + "|"]
    table = {}
    for k, runs in comp.items():
        finals = [_final(d) for d in runs]
        init = statistics.fmean(_evals(d)[0]["eval/accuracy"] for d in runs)
        best = statistics.fmean(max(e["eval/accuracy"] for e in _evals(d)) for d in runs)
        summaries = [json.loads((d / "summary.json").read_text()) for d in runs]
        mins = statistics.fmean(x["wall_s"] / 60 for x in summaries)
        cpu = [x["cpu_s"] / 60 for x in summaries if "cpu_s" in x]  # runs from before it was recorded lack it
        cpu_s = "–" if not cpu else f"{statistics.fmean(cpu):.1f}" + (
            "" if len(cpu) == len(runs) else f" ({len(cpu)} of {len(runs)} runs)")
        reach = [_steps_to(d, dapo_final) for d in runs] if dapo_final is not None else []
        reach_s = ", ".join("never" if s is None else str(s) for s in reach) or "–"
        m, sd = _mean_sd(finals)
        generated = statistics.fmean(last[f]["samples_generated"] for f in budget[k])
        at_common, at_sd = _mean_sd([_accuracy_at(f, common) for f in budget[k]])
        # each seed samples its held-out evaluation with its own seed, so its start differs: the gain over it
        gain, gain_sd = _mean_sd([_accuracy_at(f, common) - _evals(d)[0]["eval/accuracy"]
                                  for f, d in zip(budget[k], runs, strict=True)])
        at_wall, at_wall_sd = _mean_sd([_accuracy_at(f, common_wall, "wall_s") for f in budget[k]])
        table[k] = {"final_mean": m, "final_sd": sd, "finals": finals, "initial": init, "best": best,
                    "steps_to_dapo_final": reach, "minutes": mins,
                    "cpu_minutes": statistics.fmean(cpu) if cpu else None, "responses_generated": generated,
                    "accuracy_at_common_budget": at_common, "common_budget": common,
                    "gain_at_common_budget": gain, "gain_at_common_budget_sd": gain_sd,
                    "accuracy_at_common_wall_s": at_wall, "common_wall_s": common_wall}
        rows.append(f"| {k} | {len(runs)} | {init:.3f} | {m:.3f} ± {sd:.3f} | {best:.3f} | {generated:,.0f} | "
                    f"{at_common:.3f} ± {at_sd:.3f} | {gain:+.3f} ± {gain_sd:.3f} | "
                    f"{at_wall:.3f} ± {at_wall_sd:.3f} | {reach_s} | {mins:.1f} | {cpu_s} | {PAPER.get(k, '–')} |")
    paired_rows = []
    for k in comp:
        if k == "vapo" or "vapo" not in comp:
            continue
        table[k]["vapo_gain_paired"] = g = paired_gain(comp["vapo"], comp[k])
        if g["seeds"]:
            verdict = "yes" if g["beyond_spread"] else "no" if g["seeds"] >= 2 else "one seed: cannot tell"
            paired_rows.append(f"| VAPO − {k} | {', '.join(map(str, g['by_seed']))} | "
                               + ", ".join(f"{x:+.3f}" for x in g["by_seed"].values())
                               + f" | {g['mean']:+.3f} ± {_num(g['sd'], '.3f')} | {_num(g['lower_95'], '+.3f')} | "
                               f"{verdict} |")
    paired_md = "" if not paired_rows else (
        "\n\nVAPO's gain over each baseline, paired by seed (final minus final, same seed): beyond the pairs' spread "
        "when the one-sided 95 % t lower bound of the mean, mean − t·sd/√n, is above 0.\n\n"
        "| pair | seeds | per seed | mean ± sd | 95 % lower bound | beyond the spread |\n|---|---|---|---|---|---|\n"
        + "\n".join(paired_rows))
    paired_md += _objectives_report(out, comp, table)
    updates = max(json.loads((d / "config.resolved.json").read_text())["train"]["total_steps"]
                  for runs in comp.values() for d in runs)
    (out / "comparison.md").write_text(
        f"Final = mean held-out accuracy of the last two evaluations ({updates} updates each); DAPO's final "
        f"(mean over seeds) = {dapo_final if dapo_final is None else round(dapo_final, 3)}. Responses generated "
        "include value pretraining (VAPO) and dynamic-sampling resamples (DAPO); 'at N responses' compares every "
        "method at the smallest budget any of them used, 'at M minutes' at the shortest run's wall-clock (its last "
        "evaluation). Minutes: wall-clock of a run; CPU minutes: user + system time of the run's processes (its "
        "engine core and verifier workers included).\n\n" + "\n".join(rows) + paired_md + "\n")
    return table


def _objectives_report(out: Path, comp: dict[str, list[Path]], table: dict) -> str:
    """With any of :data:`OBJECTIVES` beside GRPO: each objective's final minus GRPO's, paired by seed, against the
    two-sided 95 % t interval of the mean (a difference either way), and ``final_accuracy.png`` (every method's
    final accuracy, mean ± sd over its seeds). Returns the markdown to append ('' without such rows)."""
    from async_vapo.experiments.plots import bar_chart

    rows = [k for k in comp if k in OBJECTIVES]
    if not rows or "grpo" not in comp:
        return ""
    lines = []
    for k in rows:
        g = paired_gain(comp[k], comp["grpo"])  # the objective minus GRPO, seed by seed
        half = T_95_TWO_SIDED.get(g["seeds"] - 1, 1.96) * g["sd"] / g["seeds"] ** 0.5 if g["seeds"] > 1 else None
        table[k]["minus_grpo_paired"] = g | {"half_width_95": half}
        if not g["seeds"]:
            continue
        verdict = ("one seed: cannot tell" if half is None else
                   "yes" if abs(g["mean"]) > half else "no")
        lines.append(f"| {k} − grpo | {', '.join(map(str, g['by_seed']))} | "
                     + ", ".join(f"{x:+.3f}" for x in g["by_seed"].values())
                     + f" | {g['mean']:+.3f} ± {_num(g['sd'], '.3f')} | "
                     + ("–" if half is None else f"[{g['mean'] - half:+.3f}, {g['mean'] + half:+.3f}]")
                     + f" | {verdict} |")
    labels = list(comp)
    bar_chart(labels, [100 * table[k]["final_mean"] for k in labels], out / "final_accuracy.png",
              errors=[100 * table[k]["final_sd"] for k in labels],
              title="final held-out accuracy (%), mean ± sd over seeds", ylabel="accuracy (%)")
    return ("\n\nEach further objective against GRPO, paired by seed (its final minus GRPO's, same seed): a difference "
            "beyond the pairs' spread when the two-sided 95 % t interval of the mean, mean ± t·sd/√n, excludes 0.\n\n"
            "| pair | seeds | per seed | mean ± sd | 95 % interval | beyond the spread |\n|---|---|---|---|---|---|\n"
            + "\n".join(lines))


def _num(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


T_95_ONE_SIDED = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
"""Student's t, one-sided 95 %, by degrees of freedom (n − 1 pairs)."""
T_95_TWO_SIDED = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
"""Student's t, two-sided 95 % (0.975 quantile), by degrees of freedom."""


def paired_gain(vapo_runs: list[Path], other_runs: list[Path]) -> dict:
    """VAPO's final minus another arm's, seed by seed over the seeds both ran: the mean, its spread, the one-sided
    95 % t lower bound of the mean, and whether that bound is above 0 (the gain beyond the pairs' spread)."""
    vapo = {d.name.rsplit("_s", 1)[1]: _final(d) for d in vapo_runs}
    other = {d.name.rsplit("_s", 1)[1]: _final(d) for d in other_runs}
    by_seed = {int(s): vapo[s] - other[s] for s in sorted(set(vapo) & set(other), key=int)}
    n = len(by_seed)
    m = statistics.fmean(by_seed.values()) if n else None
    sd = statistics.stdev(by_seed.values()) if n > 1 else None
    lower = m - T_95_ONE_SIDED.get(n - 1, 1.645) * sd / n ** 0.5 if n > 1 else None
    return {"seeds": n, "by_seed": by_seed, "mean": m, "sd": sd, "lower_95": lower,
            "beyond_spread": lower is not None and lower > 0}


def _ablation_report(out: Path, done: dict[str, list[Path]]) -> dict:
    """The ablation table (``ablation.md``, ``ablation.png``) and its figures: each row against VAPO's runs."""
    from async_vapo.experiments.plots import bar_chart

    vapo_m, vapo_sd = _mean_sd([_final(d) for d in done["vapo"]])
    labels, vals, errs, ref = ["VAPO"], [vapo_m], [vapo_sd], [60.4]
    rows_budget = {k: [budget_metrics(d) for d in done[k]] for k in ["vapo", *ABLATIONS] if k in done}
    abl_common = min(json.loads(f.read_text().splitlines()[-1])["samples_generated"]
                     for fs in rows_budget.values() for f in fs)

    def at_common(k: str) -> tuple[float, float]:
        return _mean_sd([_accuracy_at(f, abl_common) for f in rows_budget[k]])

    rows = ["| run | seeds | final held-out accuracy (mean ± sd) | Δ vs VAPO (all its seeds) | "
            f"Δ vs VAPO, same seeds (paired) | at {abl_common:,} responses | paper AIME24 | paper Δ | "
            "VAPO's gain beyond the pairs' spread (95 % lower bound) |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| VAPO | {len(done['vapo'])} | {vapo_m:.3f} ± {vapo_sd:.3f} | 0 | 0 | "
            "{:.3f} ± {:.3f} | 60.4 | 0 | – |".format(*at_common("vapo"))]
    abl = {}
    for k, (what, paper) in ABLATIONS.items():
        if k not in done:
            continue
        m, sd = _mean_sd([_final(d) for d in done[k]])
        g = paired_gain(done["vapo"], done[k])  # VAPO minus the row, seed by seed
        paired_d = -g["mean"] if g["seeds"] else float("nan")
        abl[k] = {"final_mean": m, "final_sd": sd, "seeds": len(done[k]), "paper": paper,
                  "paired_delta": paired_d, "accuracy_at_common_budget": at_common(k)[0],
                  "common_budget": abl_common, "vapo_gain_paired": g}
        beyond = ("yes" if g["beyond_spread"] else "no") + f" ({_num(g['lower_95'], '+.3f')})" if g["seeds"] > 1 \
            else "–"  # one pair: no spread to compare with
        labels.append(f"w/o {what}")
        vals.append(m)
        errs.append(sd)
        ref.append(paper)
        rows.append(f"| w/o {what} | {len(done[k])} | {m:.3f} ± {sd:.3f} | {m - vapo_m:+.3f} | {paired_d:+.3f} | "
                    "{:.3f} ± {:.3f} | ".format(*at_common(k)) + f"{paper} | {paper - 60.4:+.1f} | {beyond} |")
    (out / "ablation.md").write_text("\n".join(rows) + "\n")
    bar_chart(labels, [100 * v for v in vals], out / "ablation.png", reference=ref,
              errors=[100 * e for e in errs], title="VAPO ablations: toy held-out accuracy (%) vs paper AIME24",
              ylabel="accuracy (%)", reference_label="paper (AIME24, Qwen2.5-32B)")
    return abl


def report(out: Path) -> dict:
    done: dict[str, list[Path]] = {}
    for d in sorted(out.iterdir()):
        if (d / "summary.json").exists() and "_s" in d.name:
            done.setdefault(d.name.rsplit("_s", 1)[0], []).append(d)
    result: dict = {"runs": {k: [p.name for p in v] for k, v in done.items()}}
    comp = {k: done[k] for k in [*COMPARISON, *OBJECTIVES] if k in done}
    if comp:
        result["comparison"] = _comparison_report(out, comp)
    if "vapo" in done and any(k in done for k in ABLATIONS):
        result["ablation"] = _ablation_report(out, done)
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def add_arguments(p) -> None:
    """The arguments of ``async-vapo experiment`` on the parser ``p`` (here and in ``async_vapo.cli``)."""
    sub = p.add_subparsers(dest="cmd", required=True)
    pr = sub.add_parser("run", help="train the plan's runs (skips finished ones), then write the report")
    pr.add_argument("--plan", choices=["all", "comparison", "ablation"], default="all")
    pr.add_argument("--seeds", default="0,1", help="seeds of the comparison runs")
    pr.add_argument("--ablation-seeds", default="0", help="seeds of the ablation runs")
    pr.add_argument("--steps", type=int, default=40)
    pr.add_argument("--eval-every", type=int, default=5)
    pr.add_argument("--parallel", type=int, default=2)
    pr.add_argument("--vapo-config", default=Arms.vapo, help="VAPO's config (the comparison's reference arm)")
    pr.add_argument("--arms-dir", default=Arms.root,
                    help="folder with baselines/NAME.toml and ablations/no_*.toml (configs/long: long task)")
    pr.add_argument("--ablations", default=None, help="comma-separated ablation rows (default: all seven)")
    pr.add_argument("--baselines", default=None,
                    help="comma-separated baselines beside VAPO (default: ppo,grpo,dapo; also "
                         + ",".join(OBJECTIVES) + ")")
    pr.add_argument("--out", default="benchmarks/results/algorithms")
    pr.add_argument("overrides", nargs="*", help="key.sub=value overrides for every run")
    rp = sub.add_parser("report", help="tables and plots from finished runs")
    rp.add_argument("--out", default="benchmarks/results/algorithms")


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="async-vapo experiment", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.cmd == "run":
        seeds = [int(s) for s in args.seeds.split(",")]
        runs = plan(args.plan, seeds, [int(s) for s in args.ablation_seeds.split(",")],
                    Arms(args.vapo_config, args.arms_dir), args.ablations.split(",") if args.ablations else None,
                    args.baselines.split(",") if args.baselines else None)
        failed = run_plan(runs, out, steps=args.steps, parallel=args.parallel, eval_every=args.eval_every,
                          extra=args.overrides)
        if failed:
            print("failed runs: " + ", ".join(r.dirname for r in failed), file=sys.stderr)
    report(out)
    print(json.dumps(json.loads((out / "result.json").read_text()), indent=2)[:4000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
