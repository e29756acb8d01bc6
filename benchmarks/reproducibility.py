"""Run-to-run spread of training on the test-size model, and a comparison between two checkouts.

Runs the one-process trainer (``async-vapo train``) ``--runs`` times with one fixed seed for ``--steps``
updates, and the cluster (``deploy/start_cluster.sh --wait``, ``async.max_staleness`` 1) ``--cluster-runs``
times for ``--cluster-steps`` updates, all on the tests' small model (``tests/conftest.py``'s overrides,
built once into a shared cache, with more SFT steps: see ``SFT_STEPS``). Prints every train row's main
metrics per run, the largest difference between runs, and the cluster's final held-out accuracy per run.

    .venv/bin/python benchmarks/reproducibility.py --label after [--repo DIR] [--runs 2] [--steps 10]
        [--cluster-runs 2] [--cluster-steps 30] [--set KEY=VALUE ...]

``--repo`` runs another checkout (e.g. a ``git worktree`` of an older commit, with a ``.venv`` link) with
this one's settings, so two commits are compared on the same model and seeds. Writes
``benchmarks/results/reproducibility/<label>.json``; ``--compare A B`` prints the table of two labels.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "reproducibility"
METRICS = ("rollout/accuracy", "rollout/reward", "rollout/response_length", "actor/pg_loss", "critic/value_loss",
           "actor/entropy", "groups_kept")


SFT_STEPS = 800
"""The tests' model trains for 60 SFT steps and starts at 0 % accuracy, where rewards are constant; this
many steps give it a base accuracy where rewards vary and training moves it."""


def test_overrides() -> list[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import TINY_TEST_OVERRIDES

    return list(TINY_TEST_OVERRIDES) + [f"base_model.sft_steps={SFT_STEPS}"] + EXTRA_OVERRIDES


EXTRA_OVERRIDES: list[str] = []
"""``--set key=value`` overrides, applied to every run of both checkouts after the tests' ones."""


def run_trainer(repo: Path, run_dir: Path, cache: Path, steps: int) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of an earlier measurement: else the new run goes to RUN_DIR-2
    overrides = test_overrides() + [f"model.cache_dir={cache}", f"train.output_dir={run_dir}",
                                    f"train.total_steps={steps}", f"train.eval_every={steps}",
                                    "train.checkpoint_every=0"]
    env = dict(os.environ, PYTHONPATH=str(repo))
    subprocess.run([str(repo / ".venv/bin/python"), "-m", "async_vapo.cli", "train", *overrides], cwd=repo,
                   env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows


def run_cluster(repo: Path, run_dir: Path, cache: Path, steps: int) -> list[dict]:
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = test_overrides() + [f"model.cache_dir={cache}", f"train.total_steps={steps}",
                                    f"train.eval_every={steps}", "train.checkpoint_every=0", "async.max_staleness=1",
                                    "train.threads=0"]
    env = dict(os.environ, PYTHONPATH=str(repo))
    cfg = repo / "configs" / "tiny_cpu.toml"
    subprocess.run(["bash", str(repo / "deploy/start_cluster.sh"), "--config", str(cfg), "--run-dir", str(run_dir),
                    "--wait", "--", *overrides], cwd=repo, env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def spread(runs: list[list[dict]], kind: str = "train") -> list[dict]:
    """Per step: each metric's values over the runs and their range."""
    by_run = [[r for r in rows if r["kind"] == kind] for rows in runs]
    out: list[dict] = []
    if not by_run:  # cluster runs only (--runs 0)
        return out
    for i in range(min(len(r) for r in by_run)):
        row = {"step": by_run[0][i]["step"]}
        for k in METRICS:
            vals = [r[i].get(k) for r in by_run]
            if all(isinstance(v, (int, float)) for v in vals):
                row[k] = vals
        out.append(row)
    return out


def measure(args: argparse.Namespace) -> dict:
    repo = Path(args.repo).resolve()
    work = Path(args.work).resolve()
    cache = work / "model-cache"
    result = {"label": args.label, "repo": str(repo), "commit": subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip(),
              "steps": args.steps, "trainer": [], "cluster": [], "cluster_steps": args.cluster_steps,
              "overrides": list(EXTRA_OVERRIDES)}
    for i in range(args.runs):
        t0 = time.perf_counter()
        rows = run_trainer(repo, work / f"{args.label}-train-{i}", cache, args.steps)
        result["trainer"].append(rows)
        print(f"[reproducibility] {args.label} trainer run {i}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    for i in range(args.cluster_runs):
        t0 = time.perf_counter()
        rows = run_cluster(repo, work / f"{args.label}-cluster-{i}", cache, args.cluster_steps)
        result["cluster"].append(rows)
        print(f"[reproducibility] {args.label} cluster run {i}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return result


def final_eval(rows: list[dict]) -> float | None:
    evals = [r for r in rows if r["kind"] == "eval"]
    return evals[-1]["eval/accuracy"] if evals else None


def table(results: list[dict]) -> str:
    runs = [(res["label"], i, rows) for res in results for i, rows in enumerate(res["trainer"])]
    lines = ["| step | metric | " + " | ".join(f"{lab} #{i}" for lab, i, _ in runs) + " | max diff |",
             "|---|---|" + "---|" * (len(runs) + 1)]
    per_step = spread([rows for _, _, rows in runs])
    for row in per_step:
        for k in METRICS:
            if k in row:
                vals = row[k]
                lines.append(f"| {row['step']} | {k} | " + " | ".join(f"{v:.4g}" for v in vals)
                             + f" | {max(vals) - min(vals):.3g} |")
    lines.append("")
    lines.append("| cluster run | final held-out accuracy | updates |")
    lines.append("|---|---|---|")
    for res in results:
        for i, rows in enumerate(res["cluster"]):
            steps = max((r["step"] for r in rows if r["kind"] == "train"), default=0)
            lines.append(f"| {res['label']} #{i} | {final_eval(rows)} | {steps} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="current")
    p.add_argument("--repo", default=str(ROOT))
    p.add_argument("--work", default="/tmp/async-vapo-reproducibility")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cluster-runs", type=int, default=2)
    p.add_argument("--cluster-steps", type=int, default=30)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run (repeat), e.g. model.critic_init=base to compare two "
                        "checkouts whose reward-like critics are built differently")
    p.add_argument("--compare", nargs="+", metavar="LABEL", help="print the table of saved labels and exit")
    args = p.parse_args(argv)
    EXTRA_OVERRIDES[:] = args.set
    if args.compare:
        results = [json.loads((OUT / f"{lab}.json").read_text()) for lab in args.compare]
        print(table(results))
        return 0
    result = measure(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{args.label}.json").write_text(json.dumps(result) + "\n")
    print(table([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
