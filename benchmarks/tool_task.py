"""Issue 51's tool task (item 4): word problems whose product a 135 M model cannot compute mentally (three-digit x
two-digit), each after worked examples, as problem files for ``task.kind = "files"``.

    .venv/bin/python benchmarks/tool_task.py --out data/tool_task            # worked examples of a tool call
    .venv/bin/python benchmarks/tool_task.py --out data/tool_task --no-tool  # the same problems, mental examples
    async-vapo train --config configs/smollm2_tool_cpu.toml
    .venv/bin/python benchmarks/tool_task.py --figures runs/x/eval           # a pilot's figures (async-vapo eval --out)
    .venv/bin/python benchmarks/tool_task.py --summary OUT                   # benchmarks/tool_task_learning.sh's runs

``--no-tool`` writes the same problems (same seed) with worked examples that answer without the tool, for the run
with the tool disabled (``rollout.env`` unset) that item 4 compares against. A record is verl's form: ``prompt`` the
chat messages (the system message, the worked examples, then the question), ``answer`` the product. With the tool,
an example's assistant turn is a fenced Python block, then a ``tool`` turn with its output, then ``Answer: N``: what
the ``python`` environment (``async_vapo.rollout.env``) runs and renders.

Measured (benchmarks/results/tool_task/README.md: the untrained SmolLM2-135M-Instruct, 48 held-out problems, one
sample each): with one worked example (``--shots 1``, the first design) it never calls the tool and scores 0/48;
with two it calls it in 27 % of responses (6/48); with four (the default) in 96 % (18/48 and 15/48 on two sampling
seeds), against 4/48 without the tool (``--no-tool``, four mental examples). ``--system short`` scored the same;
a first turn opened with the code fence (``rollout.env_first_turn_prefix``) did not help. The RL runs
(``benchmarks/tool_task_learning.sh``) are not measured yet.
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
SHOTS = 4
"""Worked examples before each question by default: with fewer the untrained model seldom calls the tool (README)."""


def example_text(i: int) -> str:
    a, b, story, thing = EXAMPLES[i]
    if i == 0:  # the first pilot's wording (pilot_base.json), kept so that --shots 1 writes the same records
        return "A shop packs 37 cups into each box. It fills 418 boxes. How many cups does it pack in all?"
    return STORIES[story].format(a=a, b=b, t=thing)


def example(tool: bool, shots: int = SHOTS, system: str = "long") -> list[dict[str, str]]:
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


def records(n: int, seed: str, tool: bool, shots: int = SHOTS, system: str = "long") -> list[dict]:
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
    ``max_response_tokens`` and the command's wall seconds (engine start included). From ``samples.jsonl`` (the
    responses decoded without special tokens, where a ``tool`` turn of SmolLM2's template reads ``\\ntool\\n...``):
    the responses holding a tool turn, and those whose tool turn printed the right product."""
    out_dir = Path(out_dir)
    m = json.loads((out_dir / "metrics.json").read_text())
    e = m["metrics"]
    rows = [json.loads(line) for line in (out_dir / "samples.jsonl").read_text().splitlines()]
    calls = e.get("eval/tool_calls", 0.0)  # absent: no sample made a tool call
    return {"accuracy": e["eval/accuracy"], "problems": m["problems"],
            "correct": round(e["eval/accuracy"] * m["problems"] * m["samples_per_problem"]),
            "tool_calls_per_response": calls,
            "tool_calls_that_ran": None if not calls else 1 - e["eval/tool_errors"] / calls,
            "responses_with_a_tool_turn": sum("\ntool\n" in r["response"] for r in rows) / len(rows),
            "tool_printed_the_answer": sum(f"\ntool\n{r['answer']}\n" in r["response"] for r in rows) / len(rows),
            "turns_per_response": e.get("eval/turns", 1.0), "truncated_frac": e["eval/truncated_frac"],
            "response_tokens_mean": e["eval/response_length"], "wall_s": m["wall_s"]}


def run_summary(run_dir: str | Path) -> dict:
    """One RL run of ``benchmarks/tool_task_learning.sh`` (``OUT/ALGO_TOOL_seedN/metrics.jsonl``): its held-out
    evaluation before the first update and after the last (accuracy, tool calls per response, the share that ran,
    model turns per response), its updates and seconds per update, and the training batches' tool calls per
    conversation over the first and the last five updates."""
    run_dir = Path(run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if r.get("kind") == "eval"]
    train = [r for r in rows if r.get("kind") == "train"]
    if len(evals) < 2 or not train:
        raise SystemExit(f"{run_dir}: needs an evaluation before and after its updates, and an update")
    stem, seed = run_dir.name.rsplit("_seed", 1)
    tool = "no_tool" if stem.endswith("_no_tool") else "tool"
    algo = stem.removesuffix("_" + tool)

    def ev(r: dict) -> dict:
        calls = r.get("eval/tool_calls", 0.0)
        return {"accuracy": r["eval/accuracy"], "tool_calls": calls, "turns": r.get("eval/turns", 1.0),
                "calls_that_ran": None if not calls else 1 - r.get("eval/tool_errors", 0.0) / calls}

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    pretrain = [r for r in rows if r.get("kind") == "pretrain"]
    critic = None
    if "critic/heldout_ev" in evals[0] or any("critic/explained_variance" in r for r in train):
        # the critic's explained variance on the held-out responses (at the first evaluation, after value
        # pretraining, at the last evaluation), on each update's batch before it trains (first and last five
        # updates), and the seconds of scoring it at each evaluation
        scored = [r for r in pretrain if "critic/heldout_ev" in r]

        def ev_mean(rs: list[dict]) -> float | None:  # null where every return of a batch was equal
            xs = [r["critic/explained_variance"] for r in rs if r.get("critic/explained_variance") is not None]
            return mean(xs) if xs else None

        critic = {"heldout_ev_before": evals[0].get("critic/heldout_ev"),
                  "heldout_ev_pretrained": scored[-1]["critic/heldout_ev"] if scored else None,
                  "heldout_ev_after": evals[-1].get("critic/heldout_ev"),
                  "train_ev_first5": ev_mean(train[:5]), "train_ev_last5": ev_mean(train[-5:]),
                  "pretrain_steps": len(pretrain), "pretrain_minutes": round(sum(
                      r.get("time/step_s", 0.0) for r in pretrain) / 60, 1),
                  "score_s": [round(r["time/critic_score_s"], 1) for r in evals if "time/critic_score_s" in r]}
    return {"run": run_dir.name, "algo": algo, "tool": tool, "seed": int(seed), "updates": train[-1]["step"],
            "minutes": round(evals[-1]["wall_s"] / 60, 1),
            "s_per_update": round(mean([r["time/step_s"] for r in train if "time/step_s" in r]), 1),
            "before": ev(evals[0]), "after": ev(evals[-1]),
            "train_tool_calls_first5": mean([r.get("rollout/tool_calls", 0.0) for r in train[:5]]),
            "train_tool_calls_last5": mean([r.get("rollout/tool_calls", 0.0) for r in train[-5:]]),
            "train_accuracy_first5": mean([r["rollout/accuracy"] for r in train[:5]]),
            "train_accuracy_last5": mean([r["rollout/accuracy"] for r in train[-5:]]),
            "curve": [(round(r["wall_s"] / 60, 2), r["rollout/accuracy"], r.get("rollout/tool_calls", 0.0))
                      for r in train],
            "held_out": [(round(r["wall_s"] / 60, 2), r["eval/accuracy"]) for r in evals], "critic": critic}


def summary(out: str | Path) -> str:
    """``OUT/summary.{md,json}`` and ``OUT/curves.png`` over every run in ``OUT``; the table as markdown."""
    out = Path(out)
    runs = [run_summary(d) for d in sorted(out.glob("*_seed*")) if (d / "metrics.jsonl").exists()]
    if not runs:
        raise SystemExit(f"{out}: no runs (ALGO_TOOL_seedN/metrics.jsonl)")

    def f(x: float | None, d: int = 3) -> str:
        return "–" if x is None else f"{x:.{d}f}"

    lines = ["| run | updates | minutes | s / update | held-out before → after | tool calls / response | calls that "
             "ran | turns / response | training batches' tool calls, first → last 5 updates |",
             "|---|---:|---:|---:|---|---|---|---|---|"]
    for r in runs:
        b, a = r["before"], r["after"]
        cells = [r["run"], r["updates"], r["minutes"], r["s_per_update"],
                 f"{f(b['accuracy'])} → {f(a['accuracy'])}", f"{f(b['tool_calls'], 2)} → {f(a['tool_calls'], 2)}",
                 f"{f(b['calls_that_ran'], 2)} → {f(a['calls_that_ran'], 2)}",
                 f"{f(b['turns'], 2)} → {f(a['turns'], 2)}",
                 f"{f(r['train_tool_calls_first5'], 2)} → {f(r['train_tool_calls_last5'], 2)}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    by = {(r["algo"], r["seed"], r["tool"]): r for r in runs}
    pairs = [(k[0], k[1], by[k], by[(k[0], k[1], "no_tool")])
             for k in sorted(by) if k[2] == "tool" and (k[0], k[1], "no_tool") in by]
    if pairs:
        # the minutes of each side, so that a pair whose runs did not train equally long shows it
        lines += ["", "| algorithm, seed | held-out after RL: with the tool − without | minutes with / without |",
                  "|---|---:|---|"]
        lines += [f"| {algo}, seed {seed} | {w['after']['accuracy'] - wo['after']['accuracy']:+.3f} | "
                  f"{w['minutes']} / {wo['minutes']} |" for algo, seed, w, wo in pairs]
    critics = [r for r in runs if r["critic"]]
    if critics:
        lines += ["", "| run | critic's held-out EV: first evaluation → after value pretraining → last evaluation | "
                  "training batches' EV, first → last 5 updates | value pretraining: steps, minutes | "
                  "scoring the critic at each evaluation (s) |", "|---|---|---|---|---|"]
        for r in critics:
            c = r["critic"]
            lines.append(f"| {r['run']} | {f(c['heldout_ev_before'])} → {f(c['heldout_ev_pretrained'])} → "
                         f"{f(c['heldout_ev_after'])} | {f(c['train_ev_first5'])} → {f(c['train_ev_last5'])} | "
                         f"{c['pretrain_steps']}, {c['pretrain_minutes']} | "
                         f"{', '.join(str(x) for x in c['score_s']) or '–'} |")
    table = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(table)
    (out / "summary.json").write_text(json.dumps(runs, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, r in enumerate(runs):
        t, acc, calls = zip(*r["curve"], strict=True)
        style = dict(color=f"C{i}", label=r["run"], lw=1.2)
        ax1.plot(t, acc, **style)
        et, eacc = zip(*r["held_out"], strict=True)  # the held-out evaluations, larger markers on a dashed line
        ax1.plot(et, eacc, color=f"C{i}", ls="--", marker="o", ms=7, lw=1, label=f"{r['run']}: held-out")
        ax2.plot(t, calls, **style)
    ax1.set(xlabel="trainer wall-clock (minutes)", ylabel="accuracy: training batches, held-out (o)", ylim=(0, 1))
    ax2.set(xlabel="trainer wall-clock (minutes)", ylabel="tool calls per conversation (training batches)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle("tool task: RL with the tool and without it")
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    return table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/tool_task")
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=51)
    ap.add_argument("--no-tool", action="store_true", help="worked examples without the tool")
    ap.add_argument("--shots", type=int, default=SHOTS, choices=range(1, len(EXAMPLES) + 1),
                    help="worked examples before each question")
    ap.add_argument("--system", default="long", choices=("long", "short", "none"),
                    help="the system message: the long instructions, a one-line one, or none (the template's own)")
    ap.add_argument("--figures", metavar="EVAL_OUT", help="print a pilot's figures from an eval --out folder, and stop")
    ap.add_argument("--summary", metavar="RUNS_OUT", help="the table and curves of benchmarks/tool_task_learning.sh's "
                                                          "runs in this folder, and stop")
    a = ap.parse_args(argv)
    if a.summary:
        print(summary(a.summary), end="")
        return
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
