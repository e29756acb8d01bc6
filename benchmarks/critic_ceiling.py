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
  correct solution, as ``long_task_errors.py`` finds it): V = −1 once that character is in the prefix, before it
  2 (1 − q)^m − 1 with m the steps (and box) not yet finished.

As in training, the value at a response token is that of the state before it (the prefix up to the previous token).
A critic that predicts only the mean scores 0. Both reference value functions are those of
``async_vapo.learner.critic_quality``, which every run reports beside its critic (``critic/heldout_ev_length_only``,
``critic/heldout_ev_slip_aware``).

With ``--fit-steps N`` it then trains the config's critic (the reward-like head VAPO starts from) on the Monte-Carlo
returns of the responses to three quarters of the problems, ``--fit-batch`` responses per Adam step at the config's
critic learning rate, and scores it on the responses to the other quarter every ``--fit-eval-every`` steps: whether
this critic can learn the signal the ceilings say is there, given more optimiser steps than a training run gives it.
Writes ``--out`` (JSON) and prints the figures.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from bench_io import write_result
from long_task_errors import sample_base_model


def explained_variance(values: list[float], returns: list[float]) -> float:
    """``critic/explained_variance`` as training computes it, over a flat list of tokens."""
    import torch

    from async_vapo.algo import explained_variance as ev

    v, g = torch.tensor([values], dtype=torch.float64), torch.tensor([returns], dtype=torch.float64)
    return float(ev(v, g, torch.ones_like(v)))


def fit_critic(cfg, base: Path, pad_id: int, samples: list, args) -> dict:
    """Train the config's initial critic on Monte-Carlo returns of most problems' responses, score it on the rest."""
    import torch

    from async_vapo.models.reward import resolve_critic_path
    from async_vapo.models.rl import load_critic, make_token_batch, response_values

    torch.manual_seed(args.seed)
    problems = sorted({i for i, *_ in samples})
    held = set(random.Random(args.seed).sample(problems, len(problems) // 4))
    train = [x for x in samples if x[0] not in held]
    test = [x for x in samples if x[0] in held]
    path = resolve_critic_path(cfg, base, progress=False)
    critic = load_critic(path)
    opt = torch.optim.Adam(critic.parameters(), lr=cfg.optim.critic_lr)

    def values(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tb = make_token_batch([x[1] for x in batch], [x[2] for x in batch], pad_id)
        returns = torch.tensor([x[3] for x in batch])[:, None].expand_as(tb.response_mask)
        return response_values(critic, tb), returns, tb.response_mask.bool()

    def score(batch: list) -> float:
        critic.eval()
        with torch.no_grad():
            v, g, m = zip(*(values(batch[j: j + 32]) for j in range(0, len(batch), 32)), strict=True)
        critic.train()
        return explained_variance(torch.cat([x[y] for x, y in zip(v, m, strict=True)]).tolist(),
                                  torch.cat([x[y] for x, y in zip(g, m, strict=True)]).tolist())

    curve = [{"step": 0, "held_out_ev": score(test)}]
    print(f"critic {path}: held-out explained variance at step 0 {curve[0]['held_out_ev']:.3f}", flush=True)
    rng = random.Random(args.seed)
    order: list = []
    for step in range(1, args.fit_steps + 1):
        if len(order) < args.fit_batch:
            order += rng.sample(train, len(train))
        batch, order = order[: args.fit_batch], order[args.fit_batch:]
        v, g, m = values(batch)
        loss = ((v - g) ** 2)[m].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.fit_eval_every == 0 or step == args.fit_steps:
            curve.append({"step": step, "train_loss": loss.item(), "held_out_ev": score(test)})
            print(f"step {step}: batch MSE {loss.item():.3f}, held-out explained variance "
                  f"{curve[-1]['held_out_ev']:.3f}", flush=True)
    return {"critic": str(path), "lr": cfg.optim.critic_lr, "batch": args.fit_batch, "train_responses": len(train),
            "held_out_responses": len(test), "curve": curve}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--problems", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--fit-steps", type=int, default=0)
    p.add_argument("--fit-batch", type=int, default=32)
    p.add_argument("--fit-eval-every", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/long_task/critic_ceiling.json")
    args = p.parse_args()

    from async_vapo.learner.critic_quality import arith_reference_values, first_error, slip_rate
    from async_vapo.tasks import arith

    cfg, base, tok, problems, (groups,) = sample_base_model(args.config, args.problems, args.samples, args.seed)
    prompts = [tok(cfg.task.prompt_template.format(prompt=q.prompt)).input_ids for q in problems]

    # (response text, correct solution, index of the first wrong character or None)
    rows, samples = [], []
    for i, (q, group) in enumerate(zip(problems, groups, strict=True)):
        truth = arith.solution(q)
        for s in group:
            text = tok.decode(s.token_ids, skip_special_tokens=True).strip()
            rows.append((text, truth, first_error(text, truth)))
            samples.append((i, prompts[i], list(s.token_ids), 1.0 if text == truth else -1.0))
    texts, truths = [r[0] for r in rows], [r[1] for r in rows]
    q = slip_rate(texts, truths)
    # one value per character (the state before it holds the characters before it), as learner.critic_quality has it
    chars = [list(range(max(1, len(text)))) for text in texts]
    length_only, slip_aware = arith_reference_values(chars, texts, truths, 1.0, -1.0, q)
    returns = [1.0 if k is None else -1.0 for (_, _, k), c in zip(rows, chars, strict=True) for _ in c]
    v_length = [v for r in length_only for v in r]
    v_slip = [v for r in slip_aware for v in r]
    accuracy = sum(k is None for _, _, k in rows) / len(rows)
    doc = {"config": args.config, "base_model": str(base), "problems": args.problems, "samples": args.samples,
           "seed": args.seed, "temperature": cfg.rollout.temperature, "responses": len(rows),
           "whole_solution_accuracy": accuracy, "per_step_slip_rate": q, "tokens": len(returns),
           "explained_variance": {"mean only": 0.0, "length only": explained_variance(v_length, returns),
                                  "slip-aware": explained_variance(v_slip, returns)}}
    print(f"{len(rows)} responses, whole-solution accuracy {accuracy:.3f}, per-step slip rate {q:.4f}; explained "
          f"variance of the Monte-Carlo return over {len(returns):,} tokens: length only "
          f"{doc['explained_variance']['length only']:.3f}, slip-aware {doc['explained_variance']['slip-aware']:.3f}")
    if args.fit_steps:
        doc["fit"] = fit_critic(cfg, base, tok.pad_token_id, samples, args)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
