"""`async-vapo eval`: accuracy, avg@n and pass@k of a model on a task's problems, on the real engine.

An app over the library, like the trainer: the model is served by the vLLM engine (``rollout.engine``),
responses are graded by the sandboxed verifier pool of ``cfg.verifier``, and the figures are computed by
``rollout.generate.run_evaluation``, the code the in-training evaluation runs. What is evaluated:

* a checkpoint (``runs/NAME/checkpoints/step_N``: ``policy/`` and ``learner_state.pt``), with its run's
  ``config.resolved.json`` unless ``--config`` is given; a LoRA policy's (``policy_adapter/``, ``model.lora``) is
  evaluated as its adapter merged into the run's base model, by peft, on an engine without LoRA;
* an HF model directory (``config.json``), or a PEFT adapter directory (``adapter_config.json``, merged over the
  config's model), with ``--config`` (default: the schema's defaults);
* nothing: the config's own starting policy (``model.path`` or the embedded base model; with
  ``model.lora.init_from``, that adapter merged over it);
* a run directory (``runs/NAME``): every checkpoint of the run with HF weights or an adapter (``step_N/policy`` or
  ``step_N/policy_adapter``, whole or pruned by ``train.keep_checkpoints``) not evaluated yet, and the starting policy
  as update 0, with one engine (:func:`eval_run`). Each becomes an ``eval`` row of the run's ``metrics.jsonl``
  (``"source": "checkpoint"``, the wall-clock and samples of that update's training row), so ``async-vapo plot`` and
  ``report`` draw the curve as if the run had evaluated itself; ``--watch`` follows a run still training, an evaluator
  outside the training engines (the services' ``cluster.rollout.eval = false``; on a GPU host, on a device of its own),
  until the run is done.

Outputs in ``--out`` (default ``runs/eval/<label>``; for a run directory ``RUN_DIR/eval/step_N``): ``samples.jsonl``
(one record per sample: problem, difficulty, response, verdict), ``metrics.json`` (the figures and how they were made).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from async_vapo.config import Config, ConfigError, load_config


def resolve_target(path: str | None, configs: Sequence[str], overrides: Sequence[str]) -> tuple[Config, Path | None,
                                                                                             str]:
    """(config, policy directory or None for the config's own starting policy, label) of what to evaluate (a run
    directory is :func:`eval_run`'s)."""
    if path is None:
        cfg = load_config(configs, overrides)
        return cfg, None, f"{cfg.train.name}-base"
    p = Path(path).expanduser()
    checkpoint = (p / "learner_state.pt").is_file() or p.parent.name == "checkpoints"  # whole, or pruned to weights
    if checkpoint and (policy := checkpoint_policy(p)) is not None:
        run_config = p.parent.parent / "config.resolved.json"
        if not configs and not run_config.is_file():
            raise ConfigError(f"{p} is a checkpoint, but its run has no {run_config}: pass --config")
        cfg = load_config(configs or [run_config], overrides)
        return cfg, policy, f"{cfg.train.name}-{p.name}"
    if (p / "config.json").is_file() or _is_adapter(p):
        cfg = load_config(configs, overrides)
        return cfg, p, p.name
    raise ConfigError(f"{p} is neither an HF model directory (config.json), a PEFT adapter directory "
                      "(adapter_config.json, over the config's model) nor a checkpoint (policy/ or policy_adapter/, "
                      "and learner_state.pt)")


def _is_adapter(path: Path) -> bool:
    from async_vapo.models.lora import ADAPTER_CONFIG

    return (path / ADAPTER_CONFIG).is_file()


def checkpoint_policy(ckpt: Path) -> Path | None:
    """The policy a checkpoint holds as a directory: ``policy/`` (HF weights) or, for a LoRA policy, its PEFT adapter
    ``policy_adapter/`` (evaluated merged over the run's base model); None when it has neither (a sharded learner's
    ``dcp/`` alone)."""
    if (ckpt / "policy" / "config.json").is_file():
        return ckpt / "policy"
    return ckpt / "policy_adapter" if _is_adapter(ckpt / "policy_adapter") else None


def is_run_dir(path: str | Path) -> bool:
    """Whether ``path`` is a run directory (its ``config.resolved.json`` and a ``checkpoints/`` or metrics file)."""
    p = Path(path).expanduser()
    return (p / "config.resolved.json").is_file() and ((p / "checkpoints").is_dir() or (p / "metrics.jsonl").is_file())


def run_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, policy directory) of every checkpoint of the run with HF weights or a LoRA adapter
    (:func:`checkpoint_policy`), by step. A checkpoint with neither (a sharded learner's) is an error that says how
    to get them."""
    from async_vapo.learner.rundir import checkpoint_dirs

    out = []
    for step, p in checkpoint_dirs(run_dir, resumable=False):
        if (policy := checkpoint_policy(p)) is not None:
            out.append((step, policy))
        elif (p / "dcp").is_dir():
            raise ConfigError(f"{p} has no HF policy weights (policy/config.json): a sharded learner's checkpoint; "
                              f"write them with `async-vapo export {p}` and evaluate that directory")
    return out


def _evaluated_steps(rows: list[dict]) -> set[int]:
    return {int(r["step"]) for r in rows if r.get("kind") == "eval" and isinstance(r.get("step"), int)}


def eval_run(run_dir: Path, configs: Sequence[str] = (), overrides: Sequence[str] = (), *, n: int | None = None,
             ks: Sequence[int] | None = None, split: str = "eval", limit: int | None = None, watch: bool = False,
             poll_s: float = 10.0, out_dir: Path | None = None, engine=None, progress: bool = True,
             log=print) -> list[dict]:
    """Evaluate the run's starting policy (update 0) and each of its checkpoints that has no ``eval`` row yet in
    ``metrics.jsonl``, oldest first, with one engine (each checkpoint's weights loaded in place); append a row per
    evaluation there. ``watch``: starts once the run has made its first update, then waits for new checkpoints
    every ``poll_s`` seconds until the run has ended (``DONE`` or ``summary.json``) and every checkpoint is
    evaluated, and writes ``out_dir/DONE``. Returns the rows written. The config is the
    run's ``config.resolved.json`` unless ``configs`` are given; ``overrides`` apply over it. Each evaluation's
    samples and figures go to ``out_dir/step_N`` (default ``RUN_DIR/eval``). ``engine``: a running engine to use
    (left running), else one is started for the first evaluation and closed at the end."""
    from async_vapo.metrics.jsonl import JsonlWriter, read_metrics

    run_dir = Path(run_dir).expanduser()
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "eval"
    cfg = load_config(list(configs) or [run_dir / "config.resolved.json"], list(overrides))
    metrics = run_dir / "metrics.jsonl"
    writer = JsonlWriter(metrics)
    own_engine, written = engine is None, []
    try:
        while True:
            # the end marker is read before the checkpoints: the last checkpoint is written before it
            ended = (run_dir / "DONE").exists() or (run_dir / "summary.json").exists()
            rows = read_metrics(metrics) if metrics.is_file() and metrics.stat().st_size else []
            done = _evaluated_steps(rows)
            train = {int(r["step"]): r for r in rows if r.get("kind") == "train" and isinstance(r.get("step"), int)}
            if watch and not ended and not train:
                # nothing to evaluate before the run's first update; an engine started now would only slow the
                # services' own start where they share the host
                time.sleep(poll_s)
                continue
            todo = [(0, None)] if 0 not in done else []
            todo += [(s, p) for s, p in run_checkpoints(run_dir) if s not in done and s > 0]
            for step, policy in todo:
                try:
                    result = run_eval(cfg, policy, out_dir=out_dir / f"step_{step}", n=n, ks=ks, split=split,
                                      limit=limit, engine=engine, keep_engine=True, progress=progress)
                except OSError:
                    if policy is None or policy.exists():
                        raise
                    log(f"update {step}: its checkpoint was deleted before it was evaluated (train.keep_weights)")
                    continue
                engine = result.pop("engine")
                at = train.get(step, {})
                row = {"kind": "eval", "step": step, "version": step, "source": "checkpoint",
                       "wall_s": at.get("wall_s", 0.0), "samples_seen": at.get("samples_seen", 0),
                       "time/eval_s": result["wall_s"], **result["metrics"]}
                writer.write(row)
                written.append(row)
                log(f"update {step}: held-out accuracy {row['eval/accuracy']:.3f} ({result['wall_s']:.1f} s)")
            if not watch:
                return written
            if ended and not todo:
                # the watch's end, for whoever waits on it (start_cluster.sh --wait with cluster.evaluator)
                (out_dir / "DONE").parent.mkdir(parents=True, exist_ok=True)
                (out_dir / "DONE").write_text(json.dumps({"evaluated": sorted(_evaluated_steps(rows) | {
                    r["step"] for r in written})}) + "\n")
                return written
            if not todo:
                time.sleep(poll_s)
    finally:
        writer.close()
        if own_engine and engine is not None:
            engine.close()


def run_eval(cfg: Config, policy: Path | None, *, out_dir: Path, n: int | None = None,
             ks: Sequence[int] | None = None, split: str = "eval", limit: int | None = None, engine=None,
             progress: bool = True, keep_engine: bool = False) -> dict:
    """Evaluate ``policy`` (None: the config's starting policy) and write ``out_dir``; returns ``metrics.json``'s
    content. ``engine``: a running engine to use (the policy's weights are loaded into it). ``keep_engine``: the
    engine (the given one or the one started here) is left running and returned as the result's ``engine``."""
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
    if policy is None and cfg.model.lora.enabled and cfg.model.lora.init_from:  # the starting policy: its adapter
        policy = Path(cfg.model.lora.init_from)
    adapter = policy is not None and _is_adapter(policy)
    if policy is not None and not adapter and (policy / "tokenizer_config.json").is_file():
        tok_dir = policy
    else:  # the config's starting policy, or a checkpoint or adapter (whose tokenizer is its base model's)
        tok_dir = ensure_base_model(cfg, progress=progress)
        policy = tok_dir if policy is None else policy
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    train_set, eval_set = load_task(cfg)
    problems = (eval_set if split == "eval" else train_set)[:limit]
    encoder = PromptEncoder.from_config(cfg, tokenizer)
    own_engine = engine is None and not keep_engine
    # a LoRA policy is evaluated as its merged weights (W + (alpha / r) B A, by peft over the config's base model) on
    # an engine without LoRA: one adapter for every request gains nothing from vLLM's LoRA path, which is slower
    weights = adapter_merged_weights(policy, tok_dir) if adapter else None
    if engine is None:
        spec = EngineSpec.from_config(cfg, tok_dir if adapter else policy, longest_prompt=encoder.longest(problems))
        engine = VLLMEngine(dataclasses.replace(spec, max_lora_rank=0))
        if weights is not None:
            engine.load_weights(weights, engine.version + 1)
    else:
        from async_vapo.models.rl import load_policy

        engine.load_weights(weights if weights is not None else load_policy(policy).state_dict(), engine.version + 1)
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
    return result | ({"engine": engine} if keep_engine else {})


def adapter_merged_weights(adapter: Path, base: Path) -> dict:
    """The weights of the PEFT adapter directory ``adapter`` merged into the model ``base``, under the plain model's
    names (peft's own merge, outside the learner's code)."""
    from peft import PeftModel

    from async_vapo.models.rl import load_policy

    try:
        model = PeftModel.from_pretrained(load_policy(base), str(adapter))
    except (ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(f"{adapter}: the adapter does not load over {base} ({e}); pass the run's --config") from e
    return model.merge_and_unload().state_dict()


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
    if args.watch and args.model and Path(args.model).is_dir() and not is_run_dir(args.model):
        # an evaluator started beside the services (cluster.evaluator.mode = "watch"): the run directory's config
        # and metrics come with the services' start
        print(f"waiting for {args.model} to become a run directory (config.resolved.json and metrics.jsonl)",
              file=sys.stderr)
        while not is_run_dir(args.model):
            time.sleep(2.0)
    if args.model and is_run_dir(args.model):
        ks = [int(k) for k in args.k.split(",")] if args.k else None
        rows = eval_run(Path(args.model), args.config or [], args.overrides, n=args.samples, ks=ks, split=args.split,
                        limit=args.limit, watch=args.watch, out_dir=Path(args.out) if args.out else None,
                        log=lambda m: print(m, file=sys.stderr))
        print(json.dumps({"run_dir": args.model, "evaluated": [r["step"] for r in rows],
                          "accuracy": {r["step"]: r["eval/accuracy"] for r in rows}}))
        return 0
    if args.watch:
        raise ConfigError("--watch follows a run directory (runs/NAME); got a model")
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
