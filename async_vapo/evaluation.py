"""`async-vapo eval`: accuracy, avg@n and pass@k of a model on a task's problems, on the real engine.

An app over the library, like the trainer: the model is served by the vLLM engine (``rollout.engine``),
responses are graded by the sandboxed verifier pool of ``cfg.verifier``, and the figures are computed by
``rollout.generate.run_evaluation``, the code the in-training evaluation runs. What is evaluated:

* a checkpoint (``runs/NAME/checkpoints/step_N``: ``policy/`` and ``learner_state.pt``), with its run's
  ``config.resolved.json`` unless ``--config`` is given;
* an HF model directory (``config.json``), with ``--config`` (default: the schema's defaults);
* nothing: the config's own starting policy (``model.path`` or the embedded base model).

Outputs in ``--out`` (default ``runs/eval/<label>``): ``samples.jsonl`` (one record per sample: problem,
difficulty, response, verdict), ``metrics.json`` (the figures and how they were made).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from async_vapo.config import Config, ConfigError, load_config


def resolve_target(path: str | None, configs: Sequence[str], overrides: Sequence[str]) -> tuple[Config, Path | None,
                                                                                             str]:
    """(config, policy directory or None for the config's own starting policy, label) of what to evaluate."""
    if path is None:
        cfg = load_config(configs, overrides)
        return cfg, None, f"{cfg.train.name}-base"
    p = Path(path).expanduser()
    if (p / "policy" / "config.json").is_file() and (p / "learner_state.pt").is_file():
        run_config = p.parent.parent / "config.resolved.json"
        if not configs and not run_config.is_file():
            raise ConfigError(f"{p} is a checkpoint, but its run has no {run_config}: pass --config")
        cfg = load_config(configs or [run_config], overrides)
        return cfg, p / "policy", f"{cfg.train.name}-{p.name}"
    if (p / "config.json").is_file():
        cfg = load_config(configs, overrides)
        return cfg, p, p.name
    raise ConfigError(f"{p} is neither an HF model directory (config.json) nor a checkpoint (policy/ and "
                      "learner_state.pt)")


def run_eval(cfg: Config, policy: Path | None, *, out_dir: Path, n: int | None = None,
             ks: Sequence[int] | None = None, split: str = "eval", limit: int | None = None, engine=None,
             progress: bool = True) -> dict:
    """Evaluate ``policy`` (None: the config's starting policy) and write ``out_dir``; returns ``metrics.json``'s
    content. ``engine``: a running engine to use (the policy's weights are loaded into it)."""
    import torch
    from transformers import AutoTokenizer

    from async_vapo.metrics.jsonl import JsonlWriter
    from async_vapo.metrics.passk import default_ks
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder, Rollout, run_evaluation
    from async_vapo.tasks import load_task
    from async_vapo.verify.sandbox import VerifierPool

    t0 = time.perf_counter()
    n = n or cfg.rollout.eval_samples
    if n < 1:
        raise ConfigError(f"--samples must be at least 1, got {n}")
    ks = sorted(set(default_ks(n) if ks is None else ks))
    if ks[0] < 1 or ks[-1] > n:
        raise ConfigError(f"--k takes values from 1 to the samples per problem ({n}), got {ks}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if policy is not None and (policy / "tokenizer_config.json").is_file():
        tok_dir = policy
    else:  # the config's starting policy, or a checkpoint (whose tokenizer is its base model's)
        tok_dir = ensure_base_model(cfg, progress=progress)
        policy = tok_dir if policy is None else policy
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    train_set, eval_set = load_task(cfg)
    problems = (eval_set if split == "eval" else train_set)[:limit]
    encoder = PromptEncoder.from_config(cfg, tokenizer)
    own_engine = engine is None
    if engine is None:
        engine = VLLMEngine(EngineSpec.from_config(cfg, policy, longest_prompt=encoder.longest(problems)))
    else:
        from async_vapo.models.rl import load_policy

        engine.load_weights(load_policy(policy).state_dict(), engine.version + 1)
    verifier = VerifierPool.from_config(cfg.verifier)
    try:
        ev = run_evaluation(Rollout(cfg, engine, verifier, encoder), problems, cfg, n=n, ks=ks)
    finally:
        verifier.close()
        if own_engine:
            engine.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = JsonlWriter(out_dir / "samples.jsonl", truncate=True)
    for rec in ev.records(encoder.decode):
        writer.write(rec)
    writer.close()
    r = cfg.rollout
    result = {"model": str(policy), "split": split, "problems": len(problems), "samples_per_problem": n, "ks": ks,
              "temperature": r.eval_temperature, "top_p": r.eval_top_p, "seed": r.seed,
              "answer_format": cfg.verifier.answer_format, "wall_s": round(time.perf_counter() - t0, 1),
              "metrics": ev.metrics}
    (out_dir / "metrics.json").write_text(json.dumps(result, indent=2, allow_nan=False, default=str) + "\n")
    return result


def format_table(metrics: dict[str, float], ks: Sequence[int]) -> str:
    """Accuracy and pass@k, overall and per difficulty, as aligned text."""
    labels = [""] + sorted({k.rsplit("_", 1)[1] for k in metrics if k.startswith("eval/accuracy_")},
                           key=lambda s: (s.rstrip("0123456789"), int("".join(c for c in s if c.isdigit()) or -1)))
    head = ["", "accuracy"] + [f"pass@{k}" for k in ks]
    rows = [head]
    for label in labels:
        suffix = f"_{label}" if label else ""
        rows.append([label or "all", f"{metrics[f'eval/accuracy{suffix}']:.3f}"]
                    + [f"{metrics[f'eval/pass@{k}{suffix}']:.3f}" for k in ks])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def main(args) -> int:
    if args.model and "=" in args.model and not Path(args.model).exists():  # an override, no model named
        args.overrides, args.model = [args.model, *args.overrides], None
    cfg, policy, label = resolve_target(args.model, args.config or [], args.overrides)
    try:
        ks = [int(k) for k in args.k.split(",")] if args.k else None
    except ValueError:
        raise ConfigError(f"--k takes comma-separated integers, got {args.k!r}") from None
    out = Path(args.out) if args.out else Path("runs") / "eval" / label
    result = run_eval(cfg, policy, out_dir=out, n=args.samples, ks=ks, split=args.split, limit=args.limit)
    m = result["metrics"]
    n = result["samples_per_problem"]
    print(f"{result['model']}: {result['problems']} {args.split} problems x {n} samples "
          f"(temperature {result['temperature']}, top-p {result['top_p']}), avg@{n} {m[f'eval/avg@{n}']:.3f}",
          file=sys.stderr)
    print(format_table(m, result["ks"]), file=sys.stderr)
    print(f"per-sample responses and verdicts: {out / 'samples.jsonl'}; figures: {out / 'metrics.json'}",
          file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "metrics"} | {"out": str(out)}))
    return 0
