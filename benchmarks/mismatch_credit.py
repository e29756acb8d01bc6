"""Where each behaviour correction puts a batch's loss weight under a large rollout–learner mismatch: why the
per-token corrections collapse in ``benchmarks/mismatch_training.py`` while no correction only stalls.

    .venv/bin/python benchmarks/mismatch_credit.py --config configs/tiny_cpu.toml --scale 2e-2 --prompts 64 \
        --out benchmarks/results/mismatch/credit_2e-2.json

One float32 engine samples ``--prompts`` training problems × ``algo.group_size`` responses twice, at the config's
training temperature: once with the learner's own (base) weights, once with every parameter moved by ±SCALE (the
sign pattern of ``mismatch_training.py``'s seed, ``perturb_accuracy.perturb_``). The responses are graded; the
float32 learner (the base weights) recomputes the perturbed engine's tokens' log-probs, as at the start of an update.

A token is **divergent** when the engine sampled it at least ``1/--low`` times more readily than the learner would
(ρ_t = π_learner / π_engine < ``--low``, 0.5 by default: the bound of masked IS and IcePop): a choice the
perturbation made, that the learner's own policy rarely makes. Per response: right or wrong, has it a divergent token,
where is the first. Then, for the wrong responses (the ones whose tokens a negative advantage pushes down), the
share of their loss weight that lands on divergent tokens, on the tokens before the first, and on the tokens after it,
under each correction (the weight of a token in the token-mean loss: its IS weight, 0 where a mask rejects it, each
response's weights over the batch's kept tokens): none (every token 1), token TIS (min(ρ_t, 5)), geometric TIS
(min(exp(mean log ρ), 5) on every token of the response), token masked IS ([0.5, 2]) and IcePop ([0.5, 5]); and the
same shares of their *pull* on the update, weight × (1 − p_t) (p_t the learner's probability of the token: the norm of
the gradient a token's term sends to its logits is of that order), since a token the learner finds unlikely pulls far
harder than one it is sure of.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time

from bench_io import write_result

CORRECTIONS = {  # name: (weight level or None, mask (low, high) or None)
    "none": (None, None),
    "token_tis": ("token", None),
    "geo_tis": ("geometric", None),
    "token_mis": ("token", (0.5, 2.0)),
    "icepop": ("token", (0.5, 5.0)),
}


def credit(groups, learner, encoder, low: float) -> dict:
    import torch

    from async_vapo.algo.mismatch import behavior_log_ratio, is_weights, rejection_mask
    from async_vapo.learner.vapo import make_rollout_batch

    batch = make_rollout_batch(groups, encoder.tokenizer.pad_token_id)
    prox, _ = learner._forward_old(batch)
    mask = batch.tokens.response_mask.bool()
    lr = behavior_log_ratio(prox, batch.behavior_logprobs, mask)
    divergent = mask & (lr < torch.log(torch.tensor(low)))
    wrong = ~batch.correct.bool()
    has = divergent.any(-1)
    pos = torch.arange(mask.shape[1]).expand_as(mask)
    first = torch.where(has, torch.where(divergent, pos, mask.shape[1]).min(-1).values, mask.shape[1])
    before = mask & (pos < first.unsqueeze(-1))
    after = mask & (pos > first.unsqueeze(-1)) & ~divergent
    out = {
        "responses": int(len(mask)), "tokens": int(mask.sum()),
        "accuracy_engine": float(batch.correct.float().mean()),
        "divergent_token_frac": float(divergent.sum() / mask.sum()),
        "wrong_with_divergent": float(has[wrong].float().mean()) if wrong.any() else None,
        "right_with_divergent": float(has[~wrong].float().mean()) if (~wrong).any() else None,
        "first_divergent_position_wrong_median": float(first[wrong & has].float().median()) if (wrong & has).any()
        else None,
        "length_wrong_median": float(mask[wrong].sum(-1).float().median()) if wrong.any() else None,
        "corrections": {},
    }
    for name, (level, bounds) in CORRECTIONS.items():
        w = torch.ones_like(lr) if level is None else is_weights(lr, mask, level, 5.0)[0]
        keep = mask if bounds is None else rejection_mask(lr, mask, "token", *bounds)[0]
        w = torch.where(keep, w, torch.zeros_like(w)) / keep.sum()  # each token's weight in the token-mean loss
        wrong_w = w[wrong].sum()
        # the gradient a token's loss term sends to its logits has norm of order 1 − p (p: the learner's probability
        # of the token): weight × (1 − p) is the token's pull on the update, not only its weight
        g = w * (1 - prox.exp())
        wrong_g = g[wrong].sum()
        out["corrections"][name] = {
            "weight_on_wrong": float(wrong_w / w.sum()),
            "wrong_share_divergent": float(w[wrong][divergent[wrong]].sum() / wrong_w),
            "wrong_share_before_first": float(w[wrong][before[wrong]].sum() / wrong_w),
            "wrong_share_after_first": float(w[wrong][after[wrong]].sum() / wrong_w),
            "wrong_pull_share_divergent": float(g[wrong][divergent[wrong]].sum() / wrong_g),
            "wrong_pull_share_after_first": float(g[wrong][after[wrong]].sum() / wrong_g),
            "mean_weight_divergent": float((w * keep.sum())[divergent].mean()) if divergent.any() else None,
            "mean_weight_after_first": float((w * keep.sum())[after].mean()) if after.any() else None,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_cpu.toml")
    p.add_argument("--scale", type=float, default=2e-2)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--low", type=float, default=0.5)
    p.add_argument("--out", default="benchmarks/results/mismatch/credit_2e-2.json")
    args = p.parse_args()

    from mismatch import engine_for, setup
    from perturb_accuracy import perturb_

    from async_vapo.rollout.generate import Rollout
    from async_vapo.verify.sandbox import VerifierPool

    t0 = time.perf_counter()
    cfg, base, learner, encoder, train, held_out = setup(args.config, [])
    problems = train[: args.prompts]
    engine = engine_for(cfg, base, encoder, train + held_out, "float32")
    verifier = VerifierPool.from_config(cfg.verifier)
    rollout = Rollout(cfg, engine, verifier, encoder)
    r = cfg.rollout
    doc = {"config": args.config, "base_model": str(base), "scale": args.scale, "seed": args.seed,
           "prompts": len(problems), "group_size": cfg.algo.group_size, "temperature": cfg.rollout.temperature,
           "low": args.low, "engine_dtype": "float32", "learner_dtype": "float32"}
    try:
        own, _ = rollout.groups(problems, n=cfg.algo.group_size, temperature=r.temperature, top_p=r.top_p,
                                seed=args.seed)
        doc["accuracy_learner_weights"] = sum(s.correct for g in own for s in g.samples) / sum(
            len(g.samples) for g in own)
        policy = copy.deepcopy(learner.policy)
        perturb_(policy, args.scale, args.seed)
        engine.load_weights(learner.precision.engine_state({k: v.detach().cpu()
                                                            for k, v in policy.state_dict().items()}), 1)
        groups, _ = rollout.groups(problems, n=cfg.algo.group_size, temperature=r.temperature, top_p=r.top_p,
                                   seed=args.seed)
        doc |= credit(groups, learner, encoder, args.low)
    finally:
        verifier.close()
        engine.close()
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"±{args.scale}: accuracy with the learner's weights {doc['accuracy_learner_weights']:.3f}, with the "
          f"perturbed engine's {doc['accuracy_engine']:.3f}; divergent tokens {doc['divergent_token_frac']:.3%}; "
          f"responses with one: wrong {doc['wrong_with_divergent']:.3f}, right {doc['right_with_divergent']:.3f}")
    for name, c in doc["corrections"].items():
        print(f"  {name:10s} wrong responses' weight: on divergent tokens {c['wrong_share_divergent']:.3f}, before "
              f"the first {c['wrong_share_before_first']:.3f}, after it {c['wrong_share_after_first']:.3f}; mean "
              f"weight divergent {c['mean_weight_divergent']:.3f}, after {c['mean_weight_after_first']:.3f}; pull "
              f"(weight × (1 − p)) on divergent tokens {c['wrong_pull_share_divergent']:.3f}, after the first "
              f"{c['wrong_pull_share_after_first']:.3f}")
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
