"""How much of the long task's return a critic could explain: the ceiling beside what VAPO's critic reaches.

    .venv/bin/python benchmarks/critic_ceiling.py --config configs/tiny_long_cpu.toml

Samples ``--samples`` responses to each of ``--problems`` training problems from the base model on the real vLLM
engine, at the training temperature, and grades each as the verifier does (+1 for the whole correct solution, −1
otherwise). The critic's targets are Monte-Carlo returns (λ_critic = 1, γ = 1), so every token of a response has
its final reward as target. Two value functions are scored by explained variance over response tokens (one token per
character), 1 − Var(G − V) / Var(G), as ``critic/explained_variance`` is in training:

- **length only**: knows the problem's number of steps n, not what has been written:
  V = 2 (1 − q)^(n + 1) − 1, with q the per-step slip rate fitted on the same samples (n steps and the box);
- **slip-aware**: also knows whether the prefix has already gone wrong (the first character that differs from the
  correct solution, as ``long_task_errors.py`` finds it): V = −1 from that character on, before it
  2 (1 − q)^m − 1 with m the steps (and box) not yet finished.

A critic that predicts only the mean scores 0. Writes ``--out`` (JSON) and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_task_errors import first_error  # noqa: E402


def explained_variance(values: list[float], returns: list[float]) -> float:
    n = len(returns)
    mean_g = sum(returns) / n
    var_g = sum((g - mean_g) ** 2 for g in returns) / n
    resid = [g - v for g, v in zip(returns, values, strict=True)]
    mean_r = sum(resid) / n
    return 1.0 - (sum((r - mean_r) ** 2 for r in resid) / n) / var_g


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--problems", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/long_task/critic_ceiling.json")
    args = p.parse_args()

    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.tasks import arith, load_task

    cfg = load_config([args.config])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    problems = random.Random(args.seed).sample(load_task(cfg)[0], args.problems)
    prompts = [tok(cfg.task.prompt_template.format(prompt=q.prompt)).input_ids for q in problems]
    engine = VLLMEngine(EngineSpec.from_config(cfg, str(base), longest_prompt=max(map(len, prompts))))
    try:
        groups = engine.generate(prompts, n=args.samples, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                 max_tokens=cfg.rollout.max_response_tokens, stop_token_ids=[tok.eos_token_id],
                                 seed=args.seed)
    finally:
        engine.close()

    # (response text, correct solution, index of the first wrong character or None)
    rows = []
    for q, group in zip(problems, groups, strict=True):
        truth = arith.solution(q)
        for s in group:
            text = tok.decode(s.token_ids, skip_special_tokens=True).strip()
            rows.append((text, truth, None if text == truth else first_error(text, truth)[0]))
    # per-step slip rate: slips over the steps (and boxes) at risk, each response at risk up to its first slip
    slips = sum(k is not None for _, _, k in rows)
    at_risk = sum(truth.count(";") + 1 if k is None else truth[:k].count(";") + 1 for _, truth, k in rows)
    q = slips / at_risk

    returns, v_length, v_slip = [], [], []
    for text, truth, k in rows:
        g = 1.0 if k is None else -1.0
        units = truth.count(";") + 1
        for t in range(max(1, len(text))):
            returns.append(g)
            v_length.append(2 * (1 - q) ** units - 1)
            wrong = k is not None and t >= k
            v_slip.append(-1.0 if wrong else 2 * (1 - q) ** (units - truth[: t + 1].count(";")) - 1)
    accuracy = sum(k is None for _, _, k in rows) / len(rows)
    doc = {"config": args.config, "base_model": str(base), "problems": args.problems, "samples": args.samples,
           "seed": args.seed, "temperature": cfg.rollout.temperature, "responses": len(rows),
           "whole_solution_accuracy": accuracy, "per_step_slip_rate": q, "tokens": len(returns),
           "explained_variance": {"mean only": 0.0, "length only": explained_variance(v_length, returns),
                                  "slip-aware": explained_variance(v_slip, returns)}}
    print(f"{len(rows)} responses, whole-solution accuracy {accuracy:.3f}, per-step slip rate {q:.4f}; explained "
          f"variance of the Monte-Carlo return over {len(returns):,} tokens: length only "
          f"{doc['explained_variance']['length only']:.3f}, slip-aware {doc['explained_variance']['slip-aware']:.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
