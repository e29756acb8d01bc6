"""Held-out accuracy by transformers' ``generate``, as a check of our evaluator on the peer benchmark's checkpoints.

    PYTHONPATH=. .venv/bin/python benchmarks/peers/hf_check.py --setting smollm2 \
        models/smollm2-135m-instruct runs/peers_smollm2/trl_s0/step_2 \
        --out benchmarks/results/peers/smollm2/pilot/hf_check.json

Each model directory is evaluated on the setting's held-out problems (one sample each, the config's evaluation
temperature and top-p, its response cap, stopping at the model's EOS ids), prompts by our ``PromptEncoder``, graded by
our answer check: the same problems and grading as ``run.py``'s evaluator, another sampler (no vLLM, no shared seed),
so the two agree within sampling noise (one standard error is about 0.03 on 200 problems).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def accuracy(model_dir: str, cfg, problems: list, batch: int, seed: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_vapo.rollout.generate import PromptEncoder, stop_token_ids
    from async_vapo.verify.check import check_answer

    tok = AutoTokenizer.from_pretrained(model_dir)
    enc = PromptEncoder.from_config(cfg, tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    right = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i:i + batch]
        ids = [enc(p) for p in chunk]
        width = max(map(len, ids))
        x = torch.tensor([[tok.pad_token_id] * (width - len(a)) + a for a in ids])
        mask = torch.tensor([[0] * (width - len(a)) + [1] * len(a) for a in ids])
        with torch.no_grad():
            y = model.generate(input_ids=x, attention_mask=mask, do_sample=True,
                               temperature=cfg.rollout.eval_temperature, top_p=cfg.rollout.eval_top_p, top_k=0,
                               max_new_tokens=cfg.rollout.max_response_tokens,
                               eos_token_id=stop_token_ids(tok, model_dir), pad_token_id=tok.pad_token_id)
        for p, row in zip(chunk, y[:, width:], strict=True):
            text = tok.decode(row, skip_special_tokens=True)
            right += check_answer(text, p.answer, answer_format=cfg.verifier.answer_format)[0]
    return right / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="model directories (a base model, a run's step_N)")
    ap.add_argument("--setting", default="smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import torch

    from async_vapo.tasks import load_task
    from benchmarks.peers.run import setting_config

    torch.set_num_threads(args.threads)
    cfg = setting_config(args.setting, "grpo", args.seed)
    _, eval_set = load_task(cfg)
    rows = []
    for m in args.models:
        t0 = time.perf_counter()
        acc = accuracy(m, cfg, eval_set, args.batch, args.seed)
        rows.append({"model": m, "accuracy": acc, "problems": len(eval_set), "seconds": time.perf_counter() - t0})
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).write_text(json.dumps({"setting": args.setting, "seed": args.seed, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
