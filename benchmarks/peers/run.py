"""TRL's GRPOTrainer beside our GRPO and VAPO, one process and on the services, on the embedded task.

    benchmarks/peers/setup_trl.sh                     # TRL in .venv-trl (once), never in .venv
    PYTHONPATH=. .venv/bin/python benchmarks/peers/run.py --seeds 0,1,2 --updates 30

Per seed, the sides run one after another (never two at once, so each has the machine's two cores), in an order
rotated from seed to seed so that a drift in the machine's load does not favour one side:

* ``trl``: TRL 1.16 ``GRPOTrainer`` (``benchmarks/peers/trl_grpo.py``, in TRL's own venv, HF ``generate``, torch
  threads = the cores), our prompts in our order, our reward rule, ``configs/baselines/grpo.toml``'s settings;
* ``grpo``: ``async-vapo train --config configs/baselines/grpo.toml`` (one process);
* ``vapo``: ``async-vapo train --config configs/tiny_cpu.toml`` (one process; its 10 value-pretraining steps count
  in its wall-clock but not as updates);
* ``cluster``: ``deploy/start_cluster.sh --config configs/baselines/grpo.toml`` (the four services,
  ``async.max_staleness`` 1, engine and learner pinned to a core each).

Each run records, per update k, its training clock t_k: seconds from the start of its first update (the first
value-pretraining step for VAPO; on the services, the learner's first batch, after the engine's start) to the end of
update k, held-out evaluations and process start-up excluded. Held-out accuracy is our
evaluator's (``rollout.generate.evaluate``: 240 problems x 2 samples, temperature 1, the seeded engine): the
one-process runs evaluate themselves every ``--every`` updates; TRL's and the cluster's checkpoints (same cadence)
are evaluated after all runs by one engine loading each checkpoint's weights. Results go to ``--out``:
``runs.json`` (everything measured), ``peers.json`` (the summary, ``benchmarks/peers/report.py``), ``peers.md``
and ``peers.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.peers.report import SIDES, summarize, write_report  # noqa: E402

CONFIGS = {"grpo": "configs/baselines/grpo.toml", "vapo": "configs/tiny_cpu.toml",
           "cluster": "configs/baselines/grpo.toml", "trl": "configs/baselines/grpo.toml"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def run_ours(side: str, seed: int, updates: int, every: int, work: Path, threads: int) -> dict:
    """One-process trainer; its clock is the sum of its steps' ``time/step_s`` (evaluations are outside them)."""
    run_dir = work / f"{side}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [str(REPO / ".venv/bin/async-vapo"), "train", "--config", CONFIGS[side], f"train.seed={seed}",
           f"train.total_steps={updates}", f"train.eval_every={every}", "train.checkpoint_every=0",
           "train.max_minutes=120", f"train.name={run_dir.name}", f"train.output_dir={work}/{{name}}",
           f"train.threads={threads}"]
    t0 = time.perf_counter()
    with open(work / f"{run_dir.name}.log", "w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    clock, times = 0.0, {}
    for r in rows:
        if r["kind"] in ("pretrain", "train"):
            clock += r["time/step_s"]
            if r["kind"] == "train":
                times[r["step"]] = clock
    pretrain_s = sum(r["time/step_s"] for r in rows if r["kind"] == "pretrain")
    acc = {r["step"]: r["eval/accuracy"] for r in rows if r["kind"] == "eval"}
    gen = [r["time/generate_s"] for r in rows if r["kind"] == "train"]
    learn = [r["time/learn_s"] for r in rows if r["kind"] == "train"]
    return {"side": side, "seed": seed, "threads": threads or len(os.sched_getaffinity(0)), "t": times,
            "accuracy": acc, "pretrain_s": pretrain_s,
            "generate_s_mean": sum(gen) / len(gen), "learn_s_mean": sum(learn) / len(learn),
            "process_s": time.perf_counter() - t0}


def run_cluster(seed: int, updates: int, every: int, work: Path) -> dict:
    """The services; its clock runs from the learner's first batch (:func:`cluster_clock`). Rollout 0's own
    evaluation is off (it would hold the engine): checkpoints every ``every`` updates are evaluated afterwards."""
    run_dir = work / f"cluster_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    names = ["verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
             "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port", "rollout_metrics_port"]
    ports = [f"cluster.ports.{n}={p}" for n, p in zip(names, free_ports(len(names)), strict=True)]
    cmd = ["bash", "deploy/start_cluster.sh", "--config", CONFIGS["cluster"], "--run-dir", str(run_dir), "--wait",
           "--", f"train.seed={seed}", f"train.total_steps={updates}", f"train.checkpoint_every={every}",
           "train.max_minutes=120", "cluster.rollout.eval=false", *ports]
    t0 = time.perf_counter()
    with open(work / f"{run_dir.name}.log", "w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True)
    train = cluster_train_rows(run_dir)
    ckpts = {int(p.name.split("_")[1]): str(p / "policy") for p in (run_dir / "checkpoints").glob("step_*")}
    return {"side": "cluster", "seed": seed, "t": cluster_clock(train), "checkpoints": ckpts, "run_dir": str(run_dir),
            "learn_s_mean": sum(r["time/learn_s"] for r in train) / len(train), "process_s": time.perf_counter() - t0}


def cluster_train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def cluster_clock(train: list[dict]) -> dict[int, float]:
    """Seconds from the moment the learner had its first batch (the end of update 1's wait for it, which holds the
    engine's start) to the end of each update."""
    first = train[0]
    start = first["wall_s"] - first["time/step_s"] + first["time/wait_batch_s"]
    return {r["step"]: r["wall_s"] - start for r in train}


def trl_spec(seed: int, updates: int, every: int, threads: int) -> dict:
    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.tasks import PromptSampler, load_task

    cfg = load_config([str(REPO / CONFIGS["trl"])], [f"train.seed={seed}"])
    a, o, v = cfg.algo, cfg.optim, cfg.verifier
    train_set, _ = load_task(cfg)
    problems = PromptSampler(train_set, cfg.train.seed).take(updates * a.prompts_per_step)
    return {"model": str(ensure_base_model(cfg, progress=False)), "threads": threads, "seed": seed,
            "updates": updates, "save_every": every,
            "prompts": [cfg.task.prompt_template.format(prompt=p.prompt) for p in problems],
            "answers": [p.answer for p in problems],
            "hparams": {"reward_correct": v.reward_correct, "reward_incorrect": v.reward_incorrect,
                        "mini_batch_size": a.mini_batch_size, "prompts_per_step": a.prompts_per_step,
                        "group_size": a.group_size, "actor_lr": o.actor_lr, "beta1": o.beta1, "beta2": o.beta2,
                        "weight_decay": o.weight_decay, "grad_clip": a.grad_clip, "eps_low": a.eps_low,
                        "temperature": cfg.rollout.temperature, "max_response_tokens": cfg.rollout.max_response_tokens}}


def run_trl(seed: int, updates: int, every: int, work: Path, python: str, threads: int) -> dict:
    out = work / f"trl_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = trl_spec(seed, updates, every, threads)
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    with open(work / f"trl_s{seed}.log", "w") as f:
        subprocess.run([python, str(REPO / "benchmarks/peers/trl_grpo.py"), "--spec", str(out / "spec.json"),
                        "--out", str(out)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    timing = json.loads((out / "timing.json").read_text())
    ckpts = {int(p.name.split("_")[1]): str(p) for p in out.glob("step_*")}
    return {"side": "trl", "seed": seed, "threads": threads,
            "t": {r["update"]: r["train_s"] for r in timing["updates"]},
            "checkpoints": ckpts, "trl_settings": timing["settings"], "process_s": time.perf_counter() - t0}


def evaluate_checkpoints(runs: list[dict]) -> None:
    """Our evaluator on every checkpoint of the runs that do not evaluate themselves (TRL, the services), and on
    the base model (update 0), with one engine."""
    from safetensors.torch import load_file

    from async_vapo.rollout.generate import Rollout, evaluate
    from async_vapo.verify.sandbox import VerifierPool
    from benchmarks.peers.common import embedded

    e = embedded(str(REPO / CONFIGS["grpo"]))
    cfg, eval_set, enc = e.cfg, e.eval_set, e.encoder
    engine = e.engine()
    verifier = VerifierPool.from_config(cfg.verifier)
    try:
        rollout = Rollout(cfg, engine, verifier, enc)
        base_acc = evaluate(rollout, eval_set, cfg)[0]["eval/accuracy"]
        version = 0
        for run in runs:
            if "checkpoints" not in run or run.get("accuracy"):
                continue
            run["accuracy"] = {0: base_acc}
            for step, path in sorted(run["checkpoints"].items(), key=lambda kv: int(kv[0])):
                version += 1
                state = load_file(str(Path(path) / "model.safetensors"))
                state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])  # tied embeddings
                engine.load_weights(state, version)
                run["accuracy"][int(step)] = evaluate(rollout, eval_set, cfg)[0]["eval/accuracy"]
                log(f"evaluated {run['side']} seed {run['seed']} update {step}: {run['accuracy'][int(step)]:.3f}")
    finally:
        verifier.close()
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--updates", type=int, default=30)
    ap.add_argument("--every", type=int, default=5, help="evaluate / checkpoint every this many updates")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--trl-python", default=str(REPO / ".venv-trl/bin/python"))
    ap.add_argument("--ours-threads", type=int, default=0,
                    help="train.threads of our one-process sides (0: every core for the learner and the engine)")
    ap.add_argument("--trl-threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="TRL's torch threads (default: every core; on a loaded machine 1 can be faster)")
    ap.add_argument("--work", default=str(REPO / "runs/peers"))
    ap.add_argument("--out", default=str(REPO / "benchmarks/results/peers"))
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --out/runs.json")
    args = ap.parse_args()
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    runs_path = out / "runs.json"
    if not args.report_only:
        sides = args.sides.split(",")
        runs: list[dict] = json.loads(runs_path.read_text()) if runs_path.exists() else []
        done = {(r["side"], r["seed"]) for r in runs}
        for i, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for side in sides[i % len(sides):] + sides[: i % len(sides)]:
                if (side, seed) in done:
                    continue
                log(f"{side} seed {seed}")
                if side == "trl":
                    run = run_trl(seed, args.updates, args.every, work, args.trl_python, args.trl_threads)
                elif side == "cluster":
                    run = run_cluster(seed, args.updates, args.every, work)
                else:
                    run = run_ours(side, seed, args.updates, args.every, work, args.ours_threads)
                run["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                n = max(run["t"], key=int)
                log(f"{side} seed {seed}: {run['t'][n]:.1f} s for {n} updates")
                runs.append(run)
                runs_path.write_text(json.dumps(runs, indent=1) + "\n")
        evaluate_checkpoints(runs)
        runs_path.write_text(json.dumps(runs, indent=1) + "\n")
    runs = json.loads(runs_path.read_text())
    for run in runs:  # cluster clocks from their metrics (runs recorded before the clock started at the first batch)
        run_dir = Path(run.get("run_dir", work / f"cluster_s{run['seed']}"))
        if run["side"] == "cluster" and (run_dir / "metrics.jsonl").exists():
            run["t"] = cluster_clock(cluster_train_rows(run_dir))
    runs_path.write_text(json.dumps(runs, indent=1) + "\n")
    summary = summarize(runs, updates=args.updates)
    write_report(summary, out)
    print((out / "peers.md").read_text())


if __name__ == "__main__":
    main()
