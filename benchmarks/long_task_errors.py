"""Where the long task's base model goes wrong, and how often a right box comes from a wrong solution.

    .venv/bin/python benchmarks/long_task_errors.py --config configs/tiny_long_cpu.toml --temperatures 1.0,0.8,0.6

For each temperature: ``--samples`` samples of each of ``--problems`` training problems from the real vLLM engine
(top-p 1, as training samples), each compared with the problem's correct solution (``arith.solution``). Counts
responses by (box right, whole solution right), classifies each wrong response by its first wrong character
(``operand``: the number after a label; ``result``: after ``=``; ``total``: the running total that opens a step),
and reports the engine's probability of that first wrong token. Writes ``--out`` (JSON) and prints a table.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from collections import Counter

from bench_io import write_result


def first_error(text: str, truth: str) -> tuple[int, str]:
    """(character index, kind) of the first difference between a response and the correct solution."""
    k = next((j for j in range(min(len(text), len(truth))) if text[j] != truth[j]), min(len(text), len(truth)))
    step = truth[:k].split(";")[-1]
    return k, "result" if "=" in step else ("operand" if any(c.isalpha() for c in step) else "total")


def sample_base_model(config: str, n_problems: int, samples: int, seed: int, temperatures: list[float] | None = None):
    """``samples`` responses of the config's base model, on the real vLLM engine, to each of ``n_problems`` training
    problems (drawn with ``seed``) at each temperature (default: the training one), top-p 1 as training samples.
    Returns (config, base model
    path, tokenizer, problems, one list of groups per temperature)."""
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.tasks import load_task

    cfg = load_config([config])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    problems = random.Random(seed).sample(load_task(cfg)[0], n_problems)
    prompts = [tok(cfg.task.prompt_template.format(prompt=q.prompt)).input_ids for q in problems]
    engine = VLLMEngine(EngineSpec.from_config(cfg, str(base), longest_prompt=max(map(len, prompts))))
    try:
        return cfg, base, tok, problems, [
            engine.generate(prompts, n=samples, temperature=t, top_p=1.0, max_tokens=cfg.rollout.max_response_tokens,
                            stop_token_ids=[tok.eos_token_id], seed=seed)
            for t in temperatures or [cfg.rollout.temperature]]
    finally:
        engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny_long_cpu.toml")
    p.add_argument("--temperatures", default="1.0,0.8,0.6")
    p.add_argument("--problems", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results/long_task/errors.json")
    args = p.parse_args()

    from async_vapo.tasks import arith
    from async_vapo.verify.check import check_answer

    temperatures = [float(x) for x in args.temperatures.split(",")]
    cfg, base, tok, problems, per_t = sample_base_model(args.config, args.problems, args.samples, args.seed,
                                                        temperatures)
    doc = {"config": args.config, "base_model": str(base), "problems": args.problems, "samples": args.samples,
           "seed": args.seed, "temperatures": {}}
    for t, groups in zip(temperatures, per_t, strict=True):
        outcome, kinds, p_wrong = Counter(), Counter(), []
        for q, group in zip(problems, groups, strict=True):
            truth = arith.solution(q)
            for s in group:
                text = tok.decode(s.token_ids, skip_special_tokens=True)
                box = check_answer(text, truth)[0]  # the box inside the solution
                whole = text.strip() == truth
                outcome["box right, solution right" if whole else
                        "box right, solution wrong" if box else "box wrong"] += 1
                if not whole:
                    k, kind = first_error(text, truth)
                    kinds[f"{kind} ({'box right' if box else 'box wrong'})"] += 1
                    if k < len(s.logprobs):
                        p_wrong.append(math.exp(s.logprobs[k]))
        n = args.problems * args.samples
        right_box = outcome["box right, solution right"] + outcome["box right, solution wrong"]
        doc["temperatures"][str(t)] = {
            "responses": n, "outcomes": dict(outcome), "first_error": dict(kinds),
            "whole_solution_accuracy": outcome["box right, solution right"] / n, "box_accuracy": right_box / n,
            "wrong_solutions_among_right_boxes": outcome["box right, solution wrong"] / max(1, right_box),
            "median_p_first_wrong_token": statistics.median(p_wrong) if p_wrong else None}
        r = doc["temperatures"][str(t)]
        print(f"temperature {t}: box right {r['box_accuracy']:.3f}, whole solution right "
              f"{r['whole_solution_accuracy']:.3f}; {r['wrong_solutions_among_right_boxes']:.0%} of the right "
              f"boxes come from wrong solutions; first errors {dict(kinds)}; median p of the first wrong token "
              f"{r['median_p_first_wrong_token']:.3f}", flush=True)
    write_result(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
