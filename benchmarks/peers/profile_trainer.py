"""Where the one-process trainer's time goes on this machine, each variant measured beside the others in one run.

* ``learner``: one GRPO update (``configs/baselines/grpo.toml``: 16 x 8 real responses from the base model, two
  mini-batches of 64) timed in rounds, the variants alternating inside each round so that the machine's load hits
  them alike: torch threads 1 and every core, with and without the separate old-log-prob pass for the first
  mini-batch. Also how many of the computed positions are real tokens (padding).
* ``engine``: generating those 16 x 8 responses with the vLLM CPU engine's OpenMP threads bound as vLLM binds them by
  itself (one core for the worker, one reserved) or to every core (``rollout.engine.engine_cpu_env``). The binding
  is fixed when an engine starts, so the variants alternate ``--repeats`` times, one engine at a time.

    PYTHONPATH=. .venv/bin/python benchmarks/peers/profile_trainer.py --rounds 5 --out benchmarks/results/peers
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.peers.common import Embedded, embedded  # noqa: E402


def _spread(times: dict[str, list[float]]) -> dict[str, dict]:
    return {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v} for k, v in times.items()}


def profile_learner(e: Embedded, rounds: int, budgets: list[int]) -> dict:
    import torch

    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.rollout.generate import Rollout
    from async_vapo.tasks import PromptSampler
    from async_vapo.verify.sandbox import VerifierPool

    cfg = e.cfg
    engine = e.engine()
    verifier = VerifierPool.from_config(cfg.verifier)
    try:
        groups, _ = Rollout(cfg, engine, verifier, e.encoder).groups(
            PromptSampler(e.train_set, 0).take(cfg.algo.prompts_per_step), n=cfg.algo.group_size, temperature=1.0,
            top_p=1.0)
    finally:
        verifier.close()
        engine.close()
    batch = make_rollout_batch(groups, e.tokenizer.pad_token_id)
    tb, mb = batch.tokens, cfg.algo.micro_batch_size
    computed = sum(int(tb.select(list(range(i, min(i + mb, len(tb))))).input_ids.numel())
                   for i in range(0, len(tb), mb))
    learner0 = Learner(cfg, e.base)
    every = len(os.sched_getaffinity(0))
    variants = {f"threads{t}_{'reuse' if r else 'separate'}": (t, r, 0) for t in (1, every) for r in (False, True)}
    # token-budget micro-batches (algo.max_tokens_per_micro_batch): rows sorted by length, less padding
    variants |= {f"threads{t}_reuse_budget{b}": (t, True, b) for t in (1, every) for b in budgets}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, (threads, reuse, budget) in variants.items():
            torch.set_num_threads(threads)
            learner = copy.deepcopy(learner0)
            learner.reuse_first_logprobs = reuse
            learner.algo = learner.algo.model_copy(update={"max_tokens_per_micro_batch": budget})
            t0 = time.perf_counter()
            learner.update(batch)
            times[name].append(time.perf_counter() - t0)
    out = _spread(times)
    for v in out.values():
        v["speedup_vs_threads1_separate"] = out["threads1_separate"]["median"] / v["median"]
    return {"update_s": out, "samples": len(tb), "real_positions": int(tb.attention_mask.sum()),
            "computed_positions_old_pass": computed, "real_fraction": int(tb.attention_mask.sum()) / computed}


def profile_engine(e: Embedded, rounds: int, repeats: int) -> dict:
    from async_vapo.rollout.engine import engine_cpu_env
    from async_vapo.tasks import PromptSampler

    cfg, enc = e.cfg, e.encoder
    prompts = [enc(p) for p in PromptSampler(e.train_set, 0).take(cfg.algo.prompts_per_step)]
    variants = {"one_core_vllm_auto": {}, "every_core": engine_cpu_env(sorted(os.sched_getaffinity(0)))}
    times: dict[str, list[float]] = {k: [] for k in variants}
    keys = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
    for _ in range(repeats):
        for name, env in variants.items():
            saved = {k: os.environ.pop(k, None) for k in keys}
            os.environ.update(env)
            try:
                engine = e.engine()
            finally:
                for k in keys:
                    os.environ.pop(k, None)
                os.environ.update({k: v for k, v in saved.items() if v is not None})
            try:
                for r in range(rounds + 1):  # the first is a warm-up
                    t0 = time.perf_counter()
                    engine.generate(prompts, n=cfg.algo.group_size, temperature=1.0, top_p=1.0,
                                    max_tokens=cfg.rollout.max_response_tokens, stop_token_ids=enc.stop_ids)
                    if r:
                        times[name].append(time.perf_counter() - t0)
            finally:
                engine.close()
    return {"generate_s": _spread(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/baselines/grpo.toml")
    ap.add_argument("--parts", default="learner,engine")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="engine starts per variant")
    ap.add_argument("--budgets", default="", help="algo.max_tokens_per_micro_batch values to add, e.g. 1024,2048")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    e = embedded(args.config)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    parts: dict[str, Callable[[], dict]] = {"learner": lambda: profile_learner(e, args.rounds, budgets),
                                            "engine": lambda: profile_engine(e, args.rounds, args.repeats)}
    result: dict = {"config": args.config, "load_avg_before": os.getloadavg()}
    for part in args.parts.split(","):
        result[part] = parts[part]()
    result["load_avg_after"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
