"""Fault injection on the embedded default: does a supervised cluster survive every crash, and what does it cost?

    .venv/bin/python benchmarks/faults.py [--steps 40] [--schedules 3] [--seed 20261201] [--out DIR] [key=value ...]

Runs the cluster of configs/tiny_cpu.toml (deploy/start_cluster.sh, supervised) once undisturbed and once per
schedule. Each schedule is drawn from ``--seed`` (logged in the results) and, in version order, each fault once the
previous service is back: SIGKILL of the replay, of the verifier and of the rollout engine, each at a random
version; SIGKILL of the learner in the middle of an update, and right after one of its checkpoints; and SIGSTOP of
the rollout engine for a random 5-20 s beyond ``cluster.wire.peer_dead_s`` (it stops acking, leaves rotation, and
rejoins after SIGCONT). The machinery and the audit are async_vapo.deploy.faults.

``train.total_steps`` is reduced to ``--steps`` (40 instead of 100: six runs of 100 updates do not fit this 2-core
machine's budget), ``train.checkpoint_every`` to ``--checkpoint-every`` (5; the default 50 would make a learner crash
cost up to 50 updates) and ``train.max_minutes`` is lifted. Everything else is the embedded default.

Writes ``DIR/<run>.json`` (plan, per-fault recovery, audit), ``DIR/<run>/`` (metrics.jsonl, the supervisors' events,
the services' logs), ``DIR/summary.json``, ``DIR/faults.md`` and ``DIR/faults.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from async_vapo.config import load_config  # noqa: E402
from async_vapo.deploy.faults import Fault, audit_run, run_cluster, stall_after  # noqa: E402


def draw_plan(rng: random.Random, steps: int, checkpoint_every: int, peer_dead_s: float) -> list[Fault]:
    lo, hi = 2, steps - 8
    ckpts = list(range(checkpoint_every, steps - checkpoint_every + 1, checkpoint_every))
    plan = [Fault("kill", "replay", rng.randint(lo, hi)), Fault("kill", "verifier", rng.randint(lo, hi)),
            Fault("kill", "rollout-0", rng.randint(lo, hi)),
            Fault("kill", "learner", rng.randint(lo, hi), when="mid_update"),
            Fault("kill", "learner", rng.choice(ckpts), when="after_checkpoint"),
            Fault("stop", "rollout-0", rng.randint(lo, hi), duration_s=round(peer_dead_s + rng.uniform(5, 20), 1))]
    return sorted(plan, key=lambda f: f.at_version)


def keep(run_dir: Path, dest: Path) -> None:
    """The run's small outputs (metrics, supervisor events, logs, resolved config) next to its report."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for name in ("metrics.jsonl", "config.resolved.json", "summary.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, dest / name)
    (dest / "logs").mkdir()
    for p in (run_dir / "logs").glob("*.log"):
        shutil.copy(p, dest / "logs" / p.name)
    for p in (run_dir / "supervisor").glob("events-*.jsonl"):
        shutil.copy(p, dest / p.name)


def summarise(runs: dict[str, dict]) -> dict:
    base = runs.get("baseline")
    out = {"runs": {}}
    for name, r in runs.items():
        a = r["audit"]
        out["runs"][name] = {
            "done_s": r["done_s"], "reached_total_steps": a["reached_total_steps"],
            "updates_redone": a["updates_redone"], "acknowledged_groups": a["acknowledged_groups"],
            "acknowledged_groups_lost": a["acknowledged_groups_lost"], "groups_served_twice": a["groups_served_twice"],
            "staleness_violations": len(a["staleness_violations_rows"]) + a["staleness_violations_groups"],
            "engine_version_violations": a["engine_version_violations"], "fates": a["fates"],
            "final_eval_accuracy": a["final_eval_accuracy"],
            "admission_refills": a.get("admission_refills"),
            "faults": [{"what": f"{f['fault']['kind']} {f['fault']['service']} {f['fault']['when']}".strip(),
                        "at_version": f["version_at_fire"], "healthy_s": _r(f["healthy_s"]),
                        "rejoined_after_sigcont_s": None if f["rejoined_s"] is None
                        else _r(f["rejoined_s"] - f["fault"]["duration_s"]),
                        "left_rotation": f["left_rotation"], "restart_delay_s": f["restart_delay_s"],
                        "stall_s": f["stall_s"], "progress_s": _r(f["progress_s"])} for f in r["faults"]],
        }
    by_service: dict[str, list[dict]] = {}
    for r in out["runs"].values():
        for f in r["faults"]:
            by_service.setdefault(f["what"], []).append(f)
    out["recovery_by_fault"] = {
        what: {k: _stats([f[k] for f in fs if f[k] is not None])
               for k in ("restart_delay_s", "healthy_s", "rejoined_after_sigcont_s", "stall_s")}
        for what, fs in sorted(by_service.items())}
    if base is not None:
        rows = [r["wall_s"] for r in _rows_of(base)]
        out["baseline_update_s"] = round(statistics.median([b - a for a, b in zip(rows, rows[1:], strict=False)]), 2)
    return out


def _rows_of(report: dict) -> list[dict]:
    return report["train_rows"]


def _na(x) -> str:
    return "—" if x is None else str(x)


def _r(x):
    return None if x is None else round(x, 1)


def _stats(xs: list[float]) -> dict | None:
    if not xs:
        return None
    return {"n": len(xs), "min": round(min(xs), 1), "median": round(statistics.median(xs), 1), "max": round(max(xs), 1)}


def markdown(summary: dict, meta: dict) -> str:
    runs = summary["runs"]
    lines = [
        "# Fault injection on the embedded default",
        "",
        f"`{meta['command']}` on {meta['date']}: {meta['config']} with train.total_steps={meta['steps']}, "
        f"train.checkpoint_every={meta['checkpoint_every']}, seed {meta['seed']}; "
        f"{'one undisturbed run and ' if 'baseline' in runs else ''}{meta['schedules']} schedule(s) of faults "
        "(async_vapo.deploy.faults), each fault once the previous one's service was back.",
        "",
        "| run | updates done | wall-clock to DONE | acknowledged groups | lost | served twice | staleness violations "
        "| engine version violations | updates redone | final held-out accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        acc = "—" if r["final_eval_accuracy"] is None else f"{100 * r['final_eval_accuracy']:.1f} %"
        lines.append(f"| {name} | {'all' if r['reached_total_steps'] else 'NO'} | {r['done_s']} s | "
                     f"{r['acknowledged_groups']} | {r['acknowledged_groups_lost']} | {r['groups_served_twice']} | "
                     f"{r['staleness_violations']} | {r['engine_version_violations']} | {r['updates_redone']} | "
                     f"{acc} |")
    base = runs.get("baseline", {}).get("final_eval_accuracy")
    if base is not None:
        deltas = [f"{name} {100 * (r['final_eval_accuracy'] - base):+.1f}" for name, r in runs.items()
                  if name != "baseline" and r["final_eval_accuracy"] is not None]
        lines += ["", f"Final held-out accuracy against the undisturbed run, in points: {', '.join(deltas)}."]
    lines += ["", "Recovery, seconds from the fault (over all schedules; n, min / median / max):", "",
              "| fault | supervisor: death to restart | service healthy again (new process) "
              "| engine back in rotation after SIGCONT | training stalled |",
              "|---|---|---|---|---|"]

    def cell(s):
        return "—" if s is None else f"{s['n']}: {s['min']} / {s['median']} / {s['max']}"

    for what, s in summary["recovery_by_fault"].items():
        lines.append(f"| {what} | {cell(s['restart_delay_s'])} | {cell(s['healthy_s'])} | "
                     f"{cell(s['rejoined_after_sigcont_s'])} | {cell(s['stall_s'])} |")
    if "baseline_update_s" in summary:
        lines += ["", f"\"Training stalled\" is the longest time without a new learner version from the fault until "
                      f"the learner is 3 versions beyond the highest it had reached (or the next fault); an "
                      f"undisturbed update takes {summary['baseline_update_s']} s (median of the baseline)."]
    lines += ["", "Fates of the acknowledged groups (the replay's log; `requeued`: served to an update lost with the "
              "learner, stored again, its copy's fate counted too), and the engines' admission refills:", ""]
    for name, r in runs.items():
        lines.append(f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["fates"].items()))
                     + f"; refills {r['admission_refills']}")
    lines += ["", "Each fault (version when it fired; seconds):", "",
              "| run | fault | at version | death to restart | healthy | back in rotation after SIGCONT "
              "| left rotation | training stalled |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        for f in r["faults"]:
            lines.append(f"| {name} | {f['what']} | {f['at_version']} | {_na(f['restart_delay_s'])} | "
                         f"{_na(f['healthy_s'])} | {_na(f['rejoined_after_sigcont_s'])} | {_na(f['left_rotation'])} | "
                         f"{_na(f['stall_s'])} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, r in runs.items():
        t0 = r["versions"][0][0] if r["versions"] else 0
        (line,) = ax1.step([t - t0 for t, _ in r["versions"]], [v for _, v in r["versions"]], where="post",
                           label=name)
        for f in r["faults"]:
            if f["fired_at"] is not None:
                ax1.plot([f["fired_at"] - t0], [f["version_at_fire"]], marker="x", color=line.get_color(), ms=7)
        curve = r["audit"]["eval_curve"]
        ax2.plot([s for s, _ in curve], [100 * a for _, a in curve], marker="o", label=name)
    ax1.set(xlabel="seconds since the learner's first version", ylabel="learner version",
            title="learner version (x: a fault)")
    ax2.set(xlabel="update", ylabel="held-out accuracy (%)", title="held-out accuracy")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(REPO / "configs" / "tiny_cpu.toml"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--schedules", type=int, default=3)
    p.add_argument("--seed", type=int, default=20261201)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "faults"))
    p.add_argument("--runs-dir", default=str(REPO / "runs" / "faults"), help="where the clusters run (not kept)")
    p.add_argument("--timeout-s", type=float, default=2400)
    p.add_argument("--plan", help="run this plan (a JSON list of Fault fields) as the one schedule, named --name, "
                   "instead of drawing schedules")
    p.add_argument("--name", default="plan")
    p.add_argument("--reaudit", action="store_true",
                   help="run nothing: audit the runs in --runs-dir again and rewrite the reports and the summary")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out, runs_dir = Path(args.out), Path(args.runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [*args.overrides, f"train.total_steps={args.steps}", f"train.checkpoint_every={args.checkpoint_every}",
                 "train.max_minutes=120"]
    cfg = load_config([args.config], overrides)
    meta = {"command": " ".join(["python benchmarks/faults.py", *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d"),
            "config": str(Path(args.config).resolve().relative_to(REPO)) if Path(args.config).resolve().is_relative_to(
                REPO) else args.config,
            "seed": args.seed, "steps": args.steps, "checkpoint_every": args.checkpoint_every,
            "schedules": args.schedules, "overrides": overrides}
    plans = {} if args.no_baseline else {"baseline": []}
    if args.plan:
        plans[args.name] = [Fault(**f) for f in json.loads(args.plan)]
        meta["schedules"] = 1
    for i in range(0 if args.plan else args.schedules):
        rng = random.Random(f"{args.seed}-{i}")
        plans[f"schedule-{i}"] = draw_plan(rng, args.steps, args.checkpoint_every, cfg.cluster.wire.peer_dead_s)
    print(f"[faults] seed {args.seed}; plans:\n" + json.dumps({k: [asdict(f) for f in v] for k, v in plans.items()},
                                                               indent=1), flush=True)
    reports = {}
    if args.reaudit:
        for path in sorted(out.glob("*.json")):
            if path.name == "summary.json":
                continue
            report = json.loads(path.read_text())
            report["audit"] = audit_run(runs_dir / path.stem, total_steps=cfg.train.total_steps,
                                        max_staleness=cfg.async_.max_staleness)
            fired = [f["fired_at"] for f in report["faults"] if f["fired_at"] is not None]
            for f in report["faults"]:
                if f["fired_at"] is not None:
                    until = min([t for t in fired if t > f["fired_at"]], default=None)
                    f["stall_s"] = stall_after(report["versions"], f["fired_at"], f["highest_version_at_fire"], until)
            path.write_text(json.dumps(report, indent=1) + "\n")
            reports[path.stem] = report
        if not reports:
            p.error(f"--reaudit: no reports in {out}")
        plans = {}
        meta = reports[next(iter(reports))]["meta"]
    for name, plan in plans.items():
        run_dir = runs_dir / name
        if run_dir.exists():
            shutil.rmtree(run_dir)
        print(f"[faults] === {name}", flush=True)
        report = run_cluster([args.config], overrides, run_dir, plan, timeout_s=args.timeout_s,
                             log=lambda m: print(m, flush=True))
        report["train_rows"] = [{"step": r["step"], "wall_s": r["wall_s"]} for r in
                                (json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines())
                                if r["kind"] == "train"]
        report["meta"] = meta
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        keep(run_dir, out / name)
        reports[name] = report
        a = report["audit"]
        print(f"[faults] {name}: done in {report['done_s']} s; lost {a['acknowledged_groups_lost']}, served twice "
              f"{a['groups_served_twice']}, accuracy {a['final_eval_accuracy']}", flush=True)
    summary = summarise(reports)
    summary["meta"] = meta
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "faults.md").write_text(markdown(summary, meta))
    plot(reports, out / "faults.png")
    print((out / "faults.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
