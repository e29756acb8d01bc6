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
SYSTEM_SHORT = "Compute with Python, then end with 'Answer: N'."
SYSTEM_SHORT_NO_TOOL = "End with 'Answer: N'."
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


EXAMPLES = ((418, 37, 0, "cups"), (256, 43, 3, "pens"), (731, 18, 1, "eggs"), (164, 92, 2, "cards"))
"""The worked examples' problems ``(a, b, story, thing)``: fixed, outside the sampled ones (``records`` skips them)."""


def example_text(i: int) -> str:
    a, b, story, thing = EXAMPLES[i]
    if i == 0:  # the first pilot's wording (pilot_base.json), kept so that --shots 1 writes the same records
        return "A shop packs 37 cups into each box. It fills 418 boxes. How many cups does it pack in all?"
    return STORIES[story].format(a=a, b=b, t=thing)


def example(tool: bool, shots: int = 1, system: str = "long") -> list[dict[str, str]]:
    """The worked examples before each question (``shots`` of :data:`EXAMPLES`), after a system message
    (``system``: ``long``, ``short`` or ``none``)."""
    text = {"long": SYSTEM if tool else SYSTEM_NO_TOOL, "short": SYSTEM_SHORT if tool else SYSTEM_SHORT_NO_TOOL,
            "none": None}[system]
    out = [] if text is None else [{"role": "system", "content": text}]
    for i in range(shots):
        a, b, _, thing = EXAMPLES[i]
        p = a * b
        said = (f"{a} boxes of {b} {thing} are {p} {thing}." if i == 0 else f"{a} * {b} = {p}.")
        out.append({"role": "user", "content": example_text(i)})
        if tool:
            out += [{"role": "assistant", "content": f"```python\nprint({a} * {b})\n```"},
                    {"role": "tool", "content": str(p)},
                    {"role": "assistant", "content": f"{said}\nAnswer: {p}"}]
        else:
            mental = (f"{a} boxes of {b} {thing} are {a} * {b} = {p} {thing}." if i == 0 else f"{a} * {b} = {p}.")
            out.append({"role": "assistant", "content": f"{mental}\nAnswer: {p}"})
    return out


def records(n: int, seed: str, tool: bool, shots: int = 1, system: str = "long") -> list[dict]:
    rng = random.Random(seed)
    seen, out = {example_text(i) for i in range(len(EXAMPLES))}, []
    while len(out) < n:
        text, answer = problem(rng)
        if text in seen:
            continue
        seen.add(text)
        out.append({"prompt": example(tool, shots, system) + [{"role": "user", "content": text}],
                    "answer": str(answer)})
    return out


def figures(out_dir: str | Path) -> dict:
    """A pilot's figures from an ``async-vapo eval --out`` folder (its ``metrics.json``): accuracy, tool calls per
    response, the share of them that ran (exit 0, no timeout or kill), model turns per response, the share cut at
    ``max_response_tokens`` and the command's wall seconds (engine start included)."""
    m = json.loads((Path(out_dir) / "metrics.json").read_text())
    e = m["metrics"]
    calls = e.get("eval/tool_calls", 0.0)  # absent: no sample made a tool call
    return {"accuracy": e["eval/accuracy"], "problems": m["problems"],
            "correct": round(e["eval/accuracy"] * m["problems"] * m["samples_per_problem"]),
            "tool_calls_per_response": calls,
            "tool_calls_that_ran": None if not calls else 1 - e["eval/tool_errors"] / calls,
            "turns_per_response": e.get("eval/turns", 1.0), "truncated_frac": e["eval/truncated_frac"],
            "response_tokens_mean": e["eval/response_length"], "wall_s": m["wall_s"]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/tool_task")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--no-tool", action="store_true", help="a worked example without the tool")
    ap.add_argument("--shots", type=int, default=1, choices=range(1, len(EXAMPLES) + 1),
                    help="worked examples before each question")
    ap.add_argument("--system", default="long", choices=("long", "short", "none"),
                    help="the system message: the long instructions, a one-line one, or none (the template's own)")
    ap.add_argument("--figures", metavar="EVAL_OUT", help="print a pilot's figures from an eval --out folder, and stop")
    a = ap.parse_args(argv)
    if a.figures:
        print(json.dumps(figures(a.figures), indent=1))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "_no_tool" if a.no_tool else ""
    # one stream: the splits share nothing
    rows = records(a.train + a.eval, f"tool-task-{a.seed}", not a.no_tool, a.shots, a.system)
    for split, part in (("train", rows[: a.train]), ("eval", rows[a.train:])):
        path = out / f"{split}{suffix}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in part))
        print(f"{path}: {len(part)} problems")


if __name__ == "__main__":
    main()
