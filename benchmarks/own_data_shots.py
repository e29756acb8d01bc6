"""Truncation and accuracy of SmolLM2-135M-Instruct on a file task of its own, without and with worked examples.

A user's own data, as the own-model guide sets it up: generated word problems (``async_vapo.tasks.wordprob``, levels
1-2, seed 7) written as flat JSONL with field names of their own (``question`` / ``final``), read by
``task.kind = "files"`` with ``task.prompt_key`` / ``task.answer_key`` in the chat format. ``async-vapo eval`` of the
base model on the held-out file, three ways:

* ``none``: no worked example (what a file task got before ``task.few_shot_path``);
* ``file``: ``task.few_shot = 1`` from ``shots.jsonl`` (the worked example the wordprob task uses);
* ``train``: ``task.few_shot = 2`` taken from the training records that carry a ``worked`` answer.

Writes the data, the config and ``summary.json`` / ``summary.md`` to ``benchmarks/results/own_data_shots/`` (the eval
outputs to a temporary directory) and prints the table. One thread for everything (``--threads``)::

    .venv/bin/python benchmarks/own_data_shots.py [--problems 40] [--samples 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "own_data_shots"
SEED, LEVELS, NUM_TRAIN = 7, (1, 2), 60

CONFIG = """# benchmarks/own_data_shots.py: a file task of the user's own, SmolLM2-135M-Instruct in the chat format.
[task]
kind = "files"
train_path = "benchmarks/results/own_data_shots/train.jsonl"
eval_path = "benchmarks/results/own_data_shots/test.jsonl"
prompt_key = "question"
answer_key = "final"
prompt_format = "chat"

[model]
path = "models/smollm2-135m-instruct"
dtype = "float32"

[verifier]
answer_format = "auto"
num_workers = 1

[rollout]
eval_temperature = 0.7
eval_top_p = 1.0
max_response_tokens = 64
kv_cache_gib = 1.0

[train]
threads = 1
"""

VARIANTS = {
    "none": [],
    "file": ["task.few_shot_path=benchmarks/results/own_data_shots/shots.jsonl", "task.few_shot_solution_key=worked",
             "task.few_shot=1"],
    "train": ["task.few_shot_solution_key=worked", "task.few_shot=2"],
}


def worked(p) -> str:
    """A worked answer in the wordprob shots' style, from the problem's steps: ``4 + 3 = 7, then 7 * 2 = 14.``"""
    steps = ", then ".join(f"{a} {op} {n} = {b}" for a, op, n, b in p.meta["steps"])
    return f"{steps}.\nAnswer: {p.answer}"


def write_data(problems: int) -> None:
    sys.path.insert(0, str(ROOT))
    from async_vapo.tasks import wordprob

    train, held = wordprob.make_splits(NUM_TRAIN, problems, SEED, *LEVELS, few_shot=0)
    OUT.mkdir(parents=True, exist_ok=True)
    rows = [{"question": p.prompt, "final": int(p.answer)} | ({"worked": worked(p)} if i % 10 == 3 else {})
            for i, p in enumerate(train)]  # a few training records carry a worked answer
    (OUT / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (OUT / "test.jsonl").write_text("".join(json.dumps({"question": p.prompt, "final": int(p.answer)}) + "\n"
                                            for p in held))
    shots = wordprob.SHOTS
    (OUT / "shots.jsonl").write_text("".join(json.dumps({"question": shots[i][1], "worked": shots[i + 1][1]}) + "\n"
                                             for i in range(0, len(shots), 2)))
    (OUT / "own_data.toml").write_text(CONFIG)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--problems", type=int, default=40)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    write_data(args.problems)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, sorted(os.sched_getaffinity(0))[:args.threads]))}
    rows = {}
    for name, overrides in VARIANTS.items():
        out = Path(tempfile.mkdtemp(prefix=f"own-data-{name}-"))
        cmd = [str(ROOT / ".venv" / "bin" / "async-vapo"), "eval", "--config", str(OUT / "own_data.toml"),
               "--samples", str(args.samples), "--out", str(out), f"train.threads={args.threads}", *overrides]
        print("[own-data] " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
        result = json.loads((out / "metrics.json").read_text())
        samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
        m = result["metrics"]
        rows[name] = {"overrides": overrides, "responses": len(samples), "truncated_frac": m["eval/truncated_frac"],
                      "accuracy": m["eval/accuracy"], "mean_response_tokens":
                      sum(s["response_tokens"] for s in samples) / len(samples), "answer_line_frac":
                      sum("Answer:" in s["response"] for s in samples) / len(samples), "wall_s": result["wall_s"],
                      "example": samples[0]["response"]}
    summary = {"problems": args.problems, "samples": args.samples, "threads": args.threads, "cap": 64,
               "variants": rows}
    (OUT / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [f"SmolLM2-135M-Instruct, {args.problems} held-out problems x {args.samples} samples at temperature 0.7, "
             "cap 64 tokens (benchmarks/own_data_shots.py)", "",
             "| worked examples | truncated | with an 'Answer:' line | accuracy | mean response tokens | eval wall s |",
             "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['truncated_frac']:.3f} | {r['answer_line_frac']:.3f} | {r['accuracy']:.3f} | "
                     f"{r['mean_response_tokens']:.1f} | {r['wall_s']:.0f} |")
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
