"""Do the policy gradients of independent rollout batches agree? Signal against noise in one update's gradient.

    .venv/bin/python benchmarks/grad_agreement.py --config configs/baselines/grpo.toml --batches 4 --prompts 8
    .venv/bin/python benchmarks/grad_agreement.py --config configs/long/baselines/grpo.toml --batches 4 --prompts 8

Samples ``--batches`` x ``--prompts`` distinct training problems x ``group_size`` responses from the base model on the
real vLLM engine at the config's training temperature, grades them with the config's verifier rule, and computes the
first optimiser step's policy gradient of each batch with the project's ``Learner`` (the config's loss; one
mini-batch per batch, so every ratio is 1). Prints the cosine of every pair of batch gradients: near 0 when one
batch's gradient is mostly noise (then an update moves the policy without a consistent direction), clearly
positive when batches agree. Also prints each batch gradient's norm and the parameters with the largest shares of
its squared norm. Writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--batches", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.tasks import load_task
    from async_vapo.types import Group, Trajectory
    from async_vapo.verify.check import check_answer

    cfg = load_config([args.config])
    k = cfg.algo.group_size
    sizes = [f"algo.prompts_per_step={args.prompts}", f"algo.mini_batch_size={args.prompts * k}"]
    cfg = load_config([args.config], [*sizes, *args.overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    problems = random.Random(args.seed).sample(load_task(cfg)[0], args.batches * args.prompts)
    prompts = [tok(cfg.task.prompt_template.format(prompt=q.prompt)).input_ids for q in problems]
    engine = VLLMEngine(EngineSpec.from_config(cfg, str(base), longest_prompt=max(map(len, prompts))))
    try:
        outs = engine.generate(prompts, n=k, temperature=cfg.rollout.temperature, top_p=1.0,
                               max_tokens=cfg.rollout.max_response_tokens, stop_token_ids=[tok.eos_token_id],
                               seed=args.seed)
    finally:
        engine.close()
    v = cfg.verifier
    groups = []
    for q, ids, group in zip(problems, prompts, outs, strict=True):
        samples = []
        for s in group:
            ok = check_answer(tok.decode(s.token_ids, skip_special_tokens=True), q.answer,
                              answer_format=v.answer_format)[0]
            samples.append(Trajectory(response_ids=s.token_ids, behavior_logprobs=s.logprobs,
                                      finish_reason=s.finish_reason, correct=ok, verdict="x",
                                      reward=v.reward_correct if ok else v.reward_incorrect))
        groups.append(Group(uid=q.uid, prompt=q.prompt, answer=q.answer, prompt_ids=ids, version=0, samples=samples))
    accuracy = sum(s.correct for g in groups for s in g.samples) / (len(groups) * k)

    grads, tops = [], []
    for b in range(args.batches):
        learner = Learner(cfg, base)
        got = {}

        def capture(model, opt, scaler, lr, steps_done, got=got):  # the optimiser step, replaced: keep the gradient
            named = [(n, q.grad) for n, q in model.named_parameters() if q.grad is not None]
            got["g"] = torch.cat([g.flatten() for _, g in named]).clone()
            total = float(got["g"].pow(2).sum())
            got["top"] = sorted(((float(g.pow(2).sum()) / total, n) for n, g in named), reverse=True)[:3]
            opt.zero_grad(set_to_none=True)
            return float(got["g"].norm())

        learner._step = capture
        learner.update(make_rollout_batch(groups[b * args.prompts:(b + 1) * args.prompts], tok.pad_token_id))
        grads.append(got["g"])
        tops.append([[n, round(share, 3)] for share, n in got["top"]])
    cos = [float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in itertools.combinations(grads, 2)]
    doc = {"config": args.config, "overrides": args.overrides, "batches": args.batches,
           "prompts_per_batch": args.prompts, "responses_per_batch": args.prompts * k,
           "temperature": cfg.rollout.temperature,
           "answer_format": v.answer_format, "accuracy": accuracy, "pairwise_cosine": cos,
           "mean_cosine": sum(cos) / len(cos), "norms": [float(g.norm()) for g in grads],
           "largest_shares": tops}
    print(f"{args.config}: {args.batches} batches of {args.prompts * k} responses, accuracy {accuracy:.3f}; gradient "
          f"cosine between batches: mean {doc['mean_cosine']:.3f} (min {min(cos):.3f}, max {max(cos):.3f})")
    for b, (g, top) in enumerate(zip(grads, tops, strict=True)):
        print(f"  batch {b}: norm {float(g.norm()):.3f}; largest shares of its squared norm: "
              + ", ".join(f"{n} {share:.2f}" for n, share in top))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
