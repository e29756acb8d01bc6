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
  2 (1 − q)^m − 1 with m the steps (and box) not yet finished;
- **slip-aware by step**: the same with a slip rate per step position (q_j fitted on the same samples), for chains
  whose late steps slip more often than their early ones.

As in training, the value at a response token is that of the state before it (the prefix up to the previous token).
A critic that predicts only the mean scores 0. Both reference value functions are those of
``async_vapo.learner.critic_quality``, which every run reports beside its critic (``critic/heldout_ev_length_only``,
``critic/heldout_ev_slip_aware``).

With ``--fit-steps N`` it then trains the config's critic (the reward-like head VAPO starts from) on the Monte-Carlo
returns of the responses to three quarters of the problems, ``--fit-batch`` responses per Adam step at the config's
critic learning rate, and scores it on the responses to the other quarter every ``--fit-eval-every`` steps: whether
this critic can learn the signal the ceilings say is there, given more optimiser steps than a training run gives it.
``--designs`` fits each of several critic designs (``model.critic_head_layers``, ``model.critic_logprobs``; a
``frozen`` variant trains the head alone) from the same initial critic on the same responses, and prints a table:
design, held-out EV (at the last step, and the best with its step), training EV (on the responses it trains on),
steps, CPU minutes of the fit (scoring left out), beside the reference levels on the same held-out responses and a
ridge regression on the log-prob features alone:

    .venv/bin/python benchmarks/critic_ceiling.py --config configs/tiny_cpu.toml --problems 256 --fit-steps 400 \
        --designs linear,layers2,logprobs,layers2+logprobs --out benchmarks/results/critic_quality/designs_tiny_cpu.json

Writes ``--out`` (JSON) and prints the figures.
"""

from __future__ import annotations

import argparse
import json
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


def parse_design(spec: str):
    """A ``--designs`` entry: ``+``-joined parts of ``linear`` (the plain head), ``layersN`` (``model.critic_head_layers
    = N``), ``logprobs`` (``model.critic_logprobs``) and ``frozen`` (the trunk not trained: a benchmark variant, no
    config option). Returns (CriticDesign, frozen)."""
    from async_vapo.models.rl import CriticDesign

    layers, logprobs, frozen = 0, False, False
    for part in spec.split("+"):
        if part.startswith("layers") and part[6:].isdigit():
            layers = int(part[6:])
        elif part == "logprobs":
            logprobs = True
        elif part == "frozen":
            frozen = True
        elif part != "linear":
            raise SystemExit(f"--designs: unknown part {part!r} of {spec!r} (linear, layersN, logprobs, frozen)")
    return CriticDesign(head_layers=layers, logprobs=logprobs), frozen


def split_problems(samples: list, seed: int) -> tuple[list, list]:
    """(train, held-out): the responses to three quarters of the problems and to the other quarter."""
    problems = sorted({x[0] for x in samples})
    held = set(random.Random(seed).sample(problems, len(problems) // 4))
    return [x for x in samples if x[0] not in held], [x for x in samples if x[0] in held]


def fit_critic(cfg, base: Path, pad_id: int, samples: list, args, spec: str = "linear") -> dict:
    """Train the config's initial critic, with the head of design ``spec`` (:func:`parse_design`), on Monte-Carlo
    returns of most problems' responses, score it on the rest (held-out) and on the responses it trains on."""
    import time

    import torch

    from async_vapo.models.reward import resolve_critic_path
    from async_vapo.models.rl import load_critic, make_token_batch, response_values

    design, frozen = parse_design(spec)
    torch.manual_seed(args.seed)
    train, test = split_problems(samples, args.seed)
    path = resolve_critic_path(cfg, base, progress=False) or base
    critic = load_critic(path, design=design)
    if frozen:
        for p in getattr(critic, critic.base_model_prefix).parameters():
            p.requires_grad_(False)
    params = [p for p in critic.parameters() if p.requires_grad]
    lr = args.fit_lr or cfg.optim.critic_lr
    opt = torch.optim.Adam(params, lr=lr)

    def values(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        tb = make_token_batch([x[1] for x in batch], [x[2] for x in batch], pad_id)
        lp = torch.full(tb.response_mask.shape, float("nan"))
        for i, x in enumerate(batch):
            lp[i, : len(x[4])] = torch.tensor(x[4])
        returns = torch.tensor([x[3] for x in batch])[:, None].expand_as(tb.response_mask)
        return response_values(critic, tb, logprobs=lp), returns, tb.response_mask.bool()

    def score(batch: list) -> float:
        critic.eval()
        with torch.no_grad():
            v, g, m = zip(*(values(batch[j: j + 64]) for j in range(0, len(batch), 64)), strict=True)
        critic.train()
        return explained_variance(torch.cat([x[y] for x, y in zip(v, m, strict=True)]).tolist(),
                                  torch.cat([x[y] for x, y in zip(g, m, strict=True)]).tolist())

    cpu0, wall0, scoring = time.process_time(), time.perf_counter(), 0.0

    def evaluate(row: dict) -> dict:
        nonlocal scoring
        c = time.process_time()
        row.update({"held_out_ev": score(test), "train_ev": score(train)})
        scoring += time.process_time() - c
        return row

    curve = [evaluate({"step": 0})]
    print(f"[{spec}] critic {path}: step 0 held-out EV {curve[0]['held_out_ev']:.3f}, "
          f"training EV {curve[0]['train_ev']:.3f}", flush=True)
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
            curve.append(evaluate({"step": step, "train_loss": loss.item()}))
            print(f"[{spec}] step {step}: batch MSE {loss.item():.3f}, held-out EV {curve[-1]['held_out_ev']:.3f}, "
                  f"training EV {curve[-1]['train_ev']:.3f}", flush=True)
    best = max(curve, key=lambda r: r["held_out_ev"])
    return {"design": spec, "critic_design": design.as_dict(), "trunk_frozen": frozen, "critic": str(path),
            "lr": lr, "batch": args.fit_batch, "steps": args.fit_steps, "train_responses": len(train),
            "held_out_responses": len(test), "trainable_parameters": sum(p.numel() for p in params),
            "held_out_ev": curve[-1]["held_out_ev"], "train_ev": curve[-1]["train_ev"],
            "best_held_out_ev": best["held_out_ev"], "best_step": best["step"],
            # the fit's own CPU time: the scoring passes (held-out and training EV at each point) left out
            "cpu_minutes": (time.process_time() - cpu0 - scoring) / 60,
            "wall_minutes": (time.perf_counter() - wall0) / 60, "curve": curve}


def features_ridge(samples: list, seed: int, pad_id: int) -> dict:
    """A causal value function of the log-prob features alone (``models.rl.logprob_features``, what the log-prob
    critic reads, plus the position and the prompt's length): ridge regression fitted on the training responses'
    tokens, EV on the held-out ones. Whether the features carry the signal, whatever a critic makes of them."""
    import torch

    from async_vapo.models.rl import logprob_features, make_token_batch

    def design(batch: list) -> tuple[torch.Tensor, torch.Tensor]:
        tb = make_token_batch([x[1] for x in batch], [x[2] for x in batch], pad_id)
        lp = torch.zeros(tb.response_mask.shape)
        for i, x in enumerate(batch):
            lp[i, : len(x[4])] = torch.tensor(x[4])
        m = tb.response_mask.bool()
        f = logprob_features(lp, tb.response_mask)
        t = torch.arange(m.shape[1], dtype=torch.float)[None].expand(m.shape) / 100
        plen = torch.tensor([len(x[1]) / 100 for x in batch])[:, None].expand(m.shape)
        x = torch.cat([f, t[..., None], plen[..., None], torch.ones(*m.shape, 1)], dim=-1)[m].double()
        g = torch.tensor([x[3] for x in batch])[:, None].expand(m.shape)[m].double()
        return x, g

    train, test = split_problems(samples, seed)
    xa, ga = design(train)
    w = torch.linalg.solve(xa.T @ xa + 1e-3 * torch.eye(xa.shape[1], dtype=xa.dtype), xa.T @ ga)
    xb, gb = design(test)
    return {"held_out_ev": explained_variance((xb @ w).tolist(), gb.tolist()),
            "train_ev": explained_variance((xa @ w).tolist(), ga.tolist())}


def print_table(rows: list[dict]) -> None:
    print("| design | held-out EV (last) | best held-out EV (step) | training EV | steps | CPU minutes |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        best = f"{r['best_held_out_ev']:.3f} ({r['best_step']})" if "best_step" in r else "–"
        cpu = f"{r['cpu_minutes']:.1f}" if "cpu_minutes" in r else "–"
        print(f"| {r['design']} | {r['held_out_ev']:.3f} | {best} | {r['train_ev']:.3f} | {r.get('steps', '–')} "
              f"| {cpu} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--problems", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--fit-steps", type=int, default=0)
    p.add_argument("--fit-batch", type=int, default=32)
    p.add_argument("--fit-eval-every", type=int, default=50)
    p.add_argument("--fit-lr", type=float, default=None, help="critic lr of the fits (default: optim.critic_lr)")
    p.add_argument("--designs", default=None,
                   help="comma-separated critic designs to fit, each a '+'-joined set of linear, layersN, logprobs, "
                        "frozen (e.g. linear,layers2,logprobs,layers2+logprobs); default: the config's design")
    p.add_argument("--samples-cache", default=None,
                   help="JSON file of the sampled responses: read when it holds the same config, problems, samples and "
                        "seed, else written after sampling (reruns of the fits skip the engine)")
    p.add_argument("--out", default="benchmarks/results/long_task/critic_ceiling.json")
    args = p.parse_args()

    from async_vapo.learner.critic_quality import (
        arith_reference_values,
        by_step_reference_values,
        first_error,
        slip_rate,
        slip_rates_by_step,
    )
    from async_vapo.tasks import arith

    cache = Path(args.samples_cache) if args.samples_cache else None
    key = {"config": args.config, "problems": args.problems, "samples": args.samples, "seed": args.seed}
    if cache is not None and cache.is_file() and json.loads(cache.read_text())["key"] == key:
        from transformers import AutoTokenizer

        from async_vapo.config import load_config
        from async_vapo.models.base_model import ensure_base_model

        cfg = load_config([args.config])
        base = ensure_base_model(cfg, progress=False)
        tok = AutoTokenizer.from_pretrained(str(base))
        cached = json.loads(cache.read_text())
        rows = [(t, truth, first_error(t, truth)) for t, truth in cached["texts"]]
        samples = [tuple(x) for x in cached["samples"]]
        print(f"{len(samples)} responses from {cache}", flush=True)
    else:
        cfg, base, tok, problems, (groups,) = sample_base_model(args.config, args.problems, args.samples, args.seed)
        prompts = [tok(cfg.task.prompt_template.format(prompt=q.prompt)).input_ids for q in problems]

        # (response text, correct solution, index of the first wrong character or None)
        rows, samples = [], []
        for i, (q, group) in enumerate(zip(problems, groups, strict=True)):
            truth = arith.solution(q)
            for s in group:
                text = tok.decode(s.token_ids, skip_special_tokens=True).strip()
                rows.append((text, truth, first_error(text, truth)))
                samples.append((i, prompts[i], list(s.token_ids), 1.0 if text == truth else -1.0, list(s.logprobs)))
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps({"key": key, "texts": [r[:2] for r in rows], "samples": samples}))
    texts, truths = [r[0] for r in rows], [r[1] for r in rows]
    q = slip_rate(texts, truths)
    # one value per character (the state before it holds the characters before it), as learner.critic_quality has it
    chars = [list(range(max(1, len(text)))) for text in texts]
    length_only, slip_aware = arith_reference_values(chars, texts, truths, 1.0, -1.0, q)
    rates = slip_rates_by_step(texts, truths)
    by_step = by_step_reference_values(chars, texts, truths, 1.0, -1.0, rates)
    returns = [1.0 if k is None else -1.0 for (_, _, k), c in zip(rows, chars, strict=True) for _ in c]
    v_length = [v for r in length_only for v in r]
    v_slip = [v for r in slip_aware for v in r]
    v_by_step = [v for r in by_step for v in r]
    accuracy = sum(k is None for _, _, k in rows) / len(rows)
    doc = {"config": args.config, "base_model": str(base), "problems": args.problems, "samples": args.samples,
           "seed": args.seed, "temperature": cfg.rollout.temperature, "responses": len(rows),
           "whole_solution_accuracy": accuracy, "per_step_slip_rate": q, "slip_rate_by_step": rates,
           "tokens": len(returns),
           "explained_variance": {"mean only": 0.0, "length only": explained_variance(v_length, returns),
                                  "slip-aware": explained_variance(v_slip, returns),
                                  "slip-aware by step": explained_variance(v_by_step, returns)}}
    ev = doc["explained_variance"]
    print(f"{len(rows)} responses, whole-solution accuracy {accuracy:.3f}, per-step slip rate {q:.4f}; explained "
          f"variance of the Monte-Carlo return over {len(returns):,} tokens: length only {ev['length only']:.3f}, "
          f"slip-aware {ev['slip-aware']:.3f}, slip-aware by step {ev['slip-aware by step']:.3f}")
    if args.fit_steps:
        from async_vapo.models.rl import CriticDesign

        default = CriticDesign.from_config(cfg).name
        designs = (args.designs or default).split(",")
        held = {id(x) for x in split_problems(samples, args.seed)[1]}
        # the reference value functions on the same split (one value per character, as above)
        table = []
        for name, ref in (("length only", length_only), ("slip-aware", slip_aware),
                          ("slip-aware by step", by_step)):
            row = {"design": f"reference: {name}"}
            for key, keep in (("held_out_ev", True), ("train_ev", False)):
                v, g = [], []
                for x, r, (_, _, k) in zip(samples, ref, rows, strict=True):
                    if (id(x) in held) == keep:
                        v += r
                        g += [1.0 if k is None else -1.0] * len(r)
                row[key] = explained_variance(v, g)
            table.append(row)
        table.append({"design": "reference: log-prob features alone (ridge, causal)",
                      **features_ridge(samples, args.seed, tok.pad_token_id)})
        doc["default_design"] = default
        doc["fits"] = [fit_critic(cfg, base, tok.pad_token_id, samples, args, spec) for spec in designs]
        table += [{k: f[k] for k in ("design", "held_out_ev", "best_held_out_ev", "best_step", "train_ev", "steps",
                                     "cpu_minutes")} for f in doc["fits"]]
        doc["table"] = table
        print_table(table)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
