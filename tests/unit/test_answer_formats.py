"""Answer formats: the last box, DAPO's last ``Answer:`` line, and ``auto`` (box, else an Answer line, else
math-verify's own extraction), on DAPO-Math-17k's prompt text and responses in each style."""

from __future__ import annotations

import pytest

from async_vapo.verify.check import check_answer, extract_prediction
from async_vapo.verify.extract import extract_answer_line

# DAPO-Math-17k's user message, verbatim around its problem text
DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
               'Remember to put your answer on its own line after "Answer:".')

STYLES = {
    "answer_line": "Each box holds 9 apples and there are 3 boxes.\n9 * 3 = 27\nAnswer: 27",
    "boxed": "Each box holds 9 apples and there are 3 boxes, so $9 \\cdot 3 = \\boxed{27}$.",
    "prose": "Each box holds 9 apples and there are 3 boxes, so the answer is 27.",
}
# (format, style) -> correct; a style the format cannot read is "no_answer"
EXPECTED = {
    ("boxed", "answer_line"): False, ("boxed", "boxed"): True, ("boxed", "prose"): False,
    ("answer_line", "answer_line"): True, ("answer_line", "boxed"): False, ("answer_line", "prose"): False,
    ("auto", "answer_line"): True, ("auto", "boxed"): True, ("auto", "prose"): True,
}


@pytest.mark.parametrize(("fmt", "style"), list(EXPECTED))
def test_each_format_reads_its_style(fmt, style):
    correct, reason = check_answer(STYLES[style], "27", answer_format=fmt)
    assert correct == EXPECTED[fmt, style]
    assert reason == ("correct" if correct else "no_answer")


def test_the_prompt_itself_is_not_an_answer():
    # The instruction "of the form Answer: $Answer" must not grade as an answer when echoed back.
    echoed = DAPO_PROMPT.format(problem="What is 9 * 3?")
    assert extract_answer_line(echoed) == '".'
    assert check_answer(echoed, "27", answer_format="answer_line") == (False, "incorrect")


@pytest.mark.parametrize("fmt", ["answer_line", "auto"])
def test_wrong_answers_are_wrong(fmt):
    assert check_answer("9 * 3 = 28\nAnswer: 28", "27", answer_format=fmt) == (False, "incorrect")


def test_answer_line_details():
    assert extract_answer_line("answer:   \\frac{1}{2}  \nmore text") == "\\frac{1}{2}  "
    assert extract_answer_line("Answer: 3\nwait, no.\nANSWER : 4") == "4"  # the last one counts
    assert extract_answer_line("Answer: 3" + "x" * 400) is None  # only the last 300 characters, as DAPO
    assert check_answer("Answer: $\\frac{1}{2}$.", "\\frac12", answer_format="answer_line") == (True, "correct")
    assert extract_prediction("\\boxed{1}\nAnswer: 2", "auto") == "1"  # a box wins in auto
    with pytest.raises(ValueError):
        extract_prediction("x", "whatever")  # type: ignore[arg-type]


def test_the_sandboxed_pool_grades_by_its_answer_format():
    from async_vapo.verify.sandbox import VerifierPool

    responses = [(STYLES[s], "27") for s in ("answer_line", "boxed", "prose")]
    with VerifierPool(num_workers=1, answer_format="answer_line") as pool:
        assert [r.reason for r in pool.verify(responses)] == ["correct", "no_answer", "no_answer"]
    with VerifierPool(num_workers=1, answer_format="auto") as pool:
        assert [r.reason for r in pool.verify(responses)] == ["correct", "correct", "correct"]
    chain = "3a+4=7;7b-2=5;\\boxed{5}"
    with VerifierPool(num_workers=1, answer_format="solution") as pool:
        assert [r.reason for r in pool.verify([(chain, chain), ("3a-2=1;1b+4=5;\\boxed{5}", chain),
                                                ("3a+4=7;7b-2=5", chain)])] == ["correct", "incorrect", "no_answer"]
    with pytest.raises(ValueError, match="answer_format"):
        VerifierPool(num_workers=1, answer_format="last_number")


def test_the_paper_config_reads_dapos_answer_line():
    from pathlib import Path

    from async_vapo.config import load_config

    root = Path(__file__).resolve().parents[2]
    assert load_config([root / "configs" / "qwen2.5-32b_vapo.toml"]).verifier.answer_format == "answer_line"
    assert load_config([root / "configs" / "tiny_cpu.toml"]).verifier.answer_format == "boxed"


def test_solution_format_grades_every_step_of_a_chain():
    """``solution``: the whole response against the whole reference solution. A chain that takes two operations
    in the other order reaches the same box (the boxed check accepts it) and is graded incorrect."""
    import random

    from async_vapo.tasks import arith

    p = arith.with_solution_answer(arith.generate_problem(random.Random(3), 18, 20, labels=True))
    start, ops, _ = arith._parse(p.prompt)
    assert p.answer == arith.solution(p) and p.meta["total"] == str(arith._steps(start, ops)[-1][3])
    swapped = [ops[1], ops[0], *ops[2:]]
    steps = arith._steps(start, swapped)
    # the same labels in the same places, the first two operands exchanged: every later total is the true one
    reordered = arith._render(steps, labels=True)
    assert reordered != p.answer and steps[-1][3] == int(p.meta["total"])
    assert check_answer(reordered, p.answer) == (True, "correct")  # the box alone cannot tell
    assert check_answer(reordered, p.answer, answer_format="solution") == (False, "incorrect")
    assert check_answer(p.answer + " \n", p.answer, answer_format="solution") == (True, "correct")
    assert check_answer(p.answer.replace("\\boxed", "boxed"), p.answer, answer_format="solution") == \
        (False, "no_answer")
    assert extract_prediction("x=1;\\boxed{1}", "solution") == "x=1;\\boxed{1}"
