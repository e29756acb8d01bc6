"""How often the untrained model's responses hit the response cap, and how often its answer is read, per cap.

Runs ``async-vapo eval`` once on the config's held-out split at a generous cap (``--cap``, one sample per problem at
the evaluation temperature) and derives every smaller cap from the same responses: the engine seeds each request,
so the first c tokens of a response are the same whatever the cap, and a response of n tokens under cap C is cut at
c < n. For each cap c it prints

* truncated: the share of responses of at least c tokens (cut, or ending exactly at the cap);
* parsed (lower bound): the share that end within c tokens and have an answer the verifier reads (any verdict but
  ``no_answer`` / ``parse_error``); a cut response is counted as unparsed;
* accuracy (lower bound): the share that end within c tokens and are correct.

    .venv/bin/python benchmarks/response_cap.py --config configs/smollm2_cpu.toml [--problems 200] [--cap 96]
        [--caps 48,56,64,72,80,96] [--samples FILE] [key.sub=value ...]

``--samples`` reads an earlier run's ``samples.jsonl`` instead of generating. Writes
``benchmarks/results/response_cap/<config stem>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNPARSED = ("no_answer", "parse_error")


def rates(samples: list[dict], cap: int) -> dict:
    n = len(samples)
    within = [s for s in samples if s["response_tokens"] < cap]
    parsed = sum(s["verdict"] not in UNPARSED for s in within)
    correct = sum(bool(s["correct"]) for s in within)
    acc = correct / n
    return {"cap": cap, "truncated": 1 - len(within) / n, "parsed_at_least": parsed / n,
            "accuracy_at_least": acc, "accuracy_se": math.sqrt(acc * (1 - acc) / n)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--problems", type=int, default=200)
    p.add_argument("--cap", type=int, default=96)
    p.add_argument("--caps", default="48,56,64,72,80,96")
    p.add_argument("--samples", help="an earlier eval's samples.jsonl (one sample per problem)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    caps = sorted(int(c) for c in args.caps.split(","))
    if caps[-1] > args.cap:
        p.error(f"--caps go up to --cap ({args.cap}), got {caps[-1]}")
    if args.samples:
        path = Path(args.samples)
    else:
        out = Path(tempfile.mkdtemp(prefix="response-cap-"))
        cmd = [str(ROOT / ".venv" / "bin" / "async-vapo"), "eval", "--config", args.config, "--samples", "1",
               "--out", str(out), f"task.num_eval={args.problems}", f"rollout.max_response_tokens={args.cap}",
               *args.overrides]
        print("[response-cap] " + " ".join(cmd), file=sys.stderr)
        subprocess.run(cmd, check=True, cwd=ROOT)
        path = out / "samples.jsonl"
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    table = [rates(samples, c) for c in caps]
    result = {"config": args.config, "problems": len(samples), "generated_cap": args.cap,
              "overrides": args.overrides, "rates": table}
    dest = ROOT / "benchmarks" / "results" / "response_cap" / f"{Path(args.config).stem}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(samples)} held-out problems, one sample each, generated at cap {args.cap}")
    print("| cap | truncated | parsed (at least) | accuracy (at least) |\n|---|---|---|---|")
    for r in table:
        print(f"| {r['cap']} | {r['truncated']:.3f} | {r['parsed_at_least']:.3f} | "
              f"{r['accuracy_at_least']:.3f} ± {r['accuracy_se']:.3f} |")
    print(f"written: {dest.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
