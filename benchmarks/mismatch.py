"""The rollout–learner mismatch of a config's base model: the vLLM engine in each dtype against the float32 learner.

    .venv/bin/python benchmarks/mismatch.py --config configs/tiny_cpu.toml --dtypes float32,bfloat16 \
        --out benchmarks/results/mismatch/tiny_cpu.json

For each engine dtype, the real vLLM engine samples ``--prompts`` training problems × ``algo.group_size`` responses
at the config's training temperature and top-p, with the log-prob of each sampled token (``rollout.engine``); the
learner (``learner.vapo.Learner``, float32, same weights) recomputes them as at the start of an update, and
``algo.mismatch.mismatch_metrics`` measures the gap exactly as every update does (``mismatch/*``, all lag 0: same
weights). ``corrections`` says what each correction would do to that batch at its documented bounds: the share of
tokens token-level TIS (cap 5) truncates, and the shares masked IS (token or sequence, [0.5, 2]) and IcePop
([0.5, 5]) would reject. float32 against float32 is the floor: the engine's and the learner's kernels differ even
in one dtype.

``benchmarks/perturb_accuracy.py --mismatch`` uses :func:`measure` with perturbed engine weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from bench_io import write_result

CORRECTIONS = {  # name: (kind, level, bounds) at the bounds the config documents
    "token_tis_cap5": ("weight", "token", 5.0),
    "seq_tis_cap5": ("weight", "sequence", 5.0),
    "geo_tis_cap5": ("weight", "geometric", 5.0),
    "token_mis_0.5_2": ("mask", "token", (0.5, 2.0)),
    "seq_mis_0.5_2": ("mask", "sequence", (0.5, 2.0)),
    "icepop_0.5_5": ("mask", "token", (0.5, 5.0)),
}


def measure(engine, learner, cfg, encoder, problems, *, seed: int) -> dict:
    """Sample ``problems`` on ``engine`` and measure its log-probs against ``learner``'s: mismatch metrics,
    what each correction would do, and the batch's size."""
    import torch

    from async_vapo.algo.mismatch import behavior_log_ratio, is_weights, mismatch_metrics, rejection_mask
    from async_vapo.learner.vapo import make_rollout_batch
    from async_vapo.rollout.generate import generate_groups

    r = cfg.rollout
    groups = generate_groups(engine, encoder, problems, version=0, n=cfg.algo.group_size, temperature=r.temperature,
                             top_p=r.top_p, max_tokens=r.max_response_tokens, stop_token_ids=encoder.stop_ids,
                             seed=seed)
    batch = make_rollout_batch(groups, encoder.tokenizer.pad_token_id)
    old_lp, _ = learner._forward_old(batch)
    mask = batch.tokens.response_mask
    out = {k: float(v) for k, v in mismatch_metrics(old_lp, batch.behavior_logprobs, mask,
                                                    torch.zeros(len(mask), dtype=torch.long)).items()
           if not k.startswith(("lag1/", "lag2plus/"))}
    lr = behavior_log_ratio(old_lp, batch.behavior_logprobs, mask)
    corr = {}
    for name, (kind, level, bound) in CORRECTIONS.items():
        if kind == "weight":
            _, m = is_weights(lr, mask, level, bound)
            corr[name] = {"truncated_frac": float(m["truncated_frac"]), "weight_mean": float(m["weight_mean"])}
        else:
            _, m = rejection_mask(lr, mask, level, *bound)
            corr[name] = {k: float(v) for k, v in m.items()}
    return {"mismatch": out, "corrections": corr, "responses": len(mask), "tokens": int(mask.sum())}


def setup(config: str, overrides: list[str]):
    """(cfg, base model path, float32 learner, prompt encoder, training problems)."""
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import load_task

    cfg = load_config([config], overrides + ["model.dtype=float32"])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    train, held_out = load_task(cfg)
    encoder = PromptEncoder.from_config(cfg, tok)
    learner = Learner(cfg, base)
    return cfg, base, learner, encoder, train, held_out


def engine_for(cfg, base, encoder, problems, dtype: str):
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine

    spec = EngineSpec.from_config(cfg, base, longest_prompt=encoder.longest(problems))
    return VLLMEngine(dataclasses.replace(spec, dtype=dtype))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_cpu.toml")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/mismatch/tiny_cpu.json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    cfg, base, learner, encoder, train, held_out = setup(args.config, args.overrides)
    problems = train[: args.prompts]
    doc = {"config": args.config, "overrides": args.overrides, "base_model": str(base), "prompts": len(problems),
           "group_size": cfg.algo.group_size, "temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
           "learner_dtype": "float32", "seed": args.seed, "engine": {}}
    for dtype in args.dtypes.split(","):
        t0 = time.perf_counter()
        engine = engine_for(cfg, base, encoder, train + held_out, dtype)
        try:
            res = measure(engine, learner, cfg, encoder, problems, seed=args.seed)
        finally:
            engine.close()
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        doc["engine"][dtype] = res
        m = res["mismatch"]
        print(f"engine {dtype} vs learner float32: k3 {m['k3']:.3g}, |log ratio| mean {m['abs_log_ratio_mean']:.3g} "
              f"max {m['abs_log_ratio_max']:.3g}, per sequence mean {m['seq_abs_log_ratio_mean']:.3g} "
              f"max {m['seq_abs_log_ratio_max']:.3g} ({res['tokens']} tokens)", flush=True)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
