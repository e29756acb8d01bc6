"""Issue 51's tool task (item 4), prepared: word problems whose product a 135 M model cannot compute mentally
(three-digit x two-digit), each after one worked example, as problem files for ``task.kind = "files"``.

    .venv/bin/python benchmarks/tool_task.py --out data/tool_task            # with the tool's worked example
    .venv/bin/python benchmarks/tool_task.py --out data/tool_task --no-tool  # the same problems, a mental example
    async-vapo train --config configs/smollm2_tool_cpu.toml

``--no-tool`` writes the same problems (same seed) with a worked example that answers without the tool, for the run
with the tool disabled (``rollout.env`` unset) that item 4 compares against. A record is verl's form: ``prompt`` the
chat messages (the worked example, then the question), ``answer`` the product. With the tool, the example's
assistant turn is a fenced Python block, then a ``tool`` turn with its output, then ``Answer: N``: what the
``python`` environment (``async_vapo.rollout.env``) runs and renders.

Not measured yet (item 4's figures need an hour of runs): the untrained model's accuracy with and without the
tool, and the RL runs.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYSTEM = ("You solve word problems. To compute, write a Python block (```python ... ```) that prints the result; "
          "its output comes back to you. End with a last line 'Answer: N'.")
SYSTEM_NO_TOOL = "You solve word problems. End with a last line 'Answer: N'."
STORIES = (
    "A shop packs {b} {t} into each box. It fills {a} boxes. How many {t} does it pack in all?",
    "A school orders {a} boxes of {t}, with {b} {t} in each box. How many {t} does the school order?",
    "A farm ships {b} crates a day for {a} days, each crate holding one of its {t}. How many {t} does it ship?",
    "Each of {a} students brings {b} {t}. How many {t} do they bring together?",
)
THINGS = ("pencils", "apples", "stickers", "marbles", "cards", "books", "shells", "coins")


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(100, 999), rng.randint(10, 99)
    return rng.choice(STORIES).format(a=a, b=b, t=rng.choice(THINGS)), a * b


def example(tool: bool) -> list[dict[str, str]]:
    """The worked example before each question (a fixed problem outside the sampled ones: 418 x 37)."""
    q = "A shop packs 37 cups into each box. It fills 418 boxes. How many cups does it pack in all?"
    if tool:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q},
                {"role": "assistant", "content": "```python\nprint(418 * 37)\n```"},
                {"role": "tool", "content": "15466"},
                {"role": "assistant", "content": "418 boxes of 37 cups are 15466 cups.\nAnswer: 15466"}]
    return [{"role": "system", "content": SYSTEM_NO_TOOL}, {"role": "user", "content": q},
            {"role": "assistant", "content": "418 boxes of 37 cups are 418 * 37 = 15466 cups.\nAnswer: 15466"}]


def records(n: int, seed: str, tool: bool) -> list[dict]:
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        text, answer = problem(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": example(tool) + [{"role": "user", "content": text}], "answer": str(answer)})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/tool_task")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--no-tool", action="store_true", help="a worked example without the tool")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_no_tool" if a.no_tool else ""
    rows = records(a.train + a.eval, f"tool-task-{a.seed}", not a.no_tool)  # one stream: the splits share nothing
    for split, part in (("train", rows[: a.train]), ("eval", rows[a.train:])):
        path = out / f"{split}{suffix}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path}: {len(part)} problems")


if __name__ == "__main__":
    main()
