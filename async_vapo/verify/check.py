"""Decide whether a model response states the reference answer.

``check_answer`` is the pure grading rule; it has no sandbox of its own. Untrusted responses must go
through :class:`async_vapo.verify.sandbox.VerifierPool`, which runs this function inside resource-
limited worker processes with a hard wall-clock deadline.

Which part of the response is the answer (``answer_format``):
- ``boxed``: the last ``\\boxed{...}`` (:func:`async_vapo.verify.extract.extract_boxed`);
- ``answer_line``: the last ``Answer:`` line in the last 300 characters, as DAPO's reward reads it
  (:func:`async_vapo.verify.extract.extract_answer_line`; DAPO-Math-17k's prompt asks for it);
- ``auto``: the last box, else an ``Answer:`` line, else math-verify's own extraction of the final answer
  from the whole response ("... so the answer is 27.").
- ``solution``: the whole response, against a reference that is a whole written solution (the arith task's
  ``task.answer = "solution"``): correct only when the two are equal after whitespace is removed, so every
  step is graded; a response without a box is "no_answer". No math-verify.

Order of tests, cheapest first:
1. Extract the answer as the format says; none or empty -> "no_answer".
2. Normalized string equality (whitespace, TeX spacing commands, ``$`` and a trailing period removed,
   ``\\dfrac``/``\\tfrac`` read as ``\\frac``) -> "correct".
3. Both sides plain decimals of at most 40+40 digits: equal as exact fractions -> "correct";
   unequal integers -> "incorrect"; unequal non-integers go on to math-verify, which compares with
   rounding (``float_rounding=6``) and may still accept them.
4. math-verify ``parse`` of both sides (each wrapped in ``$...$`` so its LaTeX extractor reads the
   whole expression) and ``verify(gold, pred)``.

Departures from plain math-verify usage:
- With ``boxed`` and ``answer_line`` the prediction is only that span, never free text, so "the answer
  is 3, no wait 4" cannot match by accident; ``auto`` accepts that risk for models that write no marker.
- math-verify's own timeouts use ``signal.alarm`` (whole seconds, main thread only). They are off by
  default here (``timeout_s=None``) so the function is safe in any thread; the sandbox enforces the
  deadline instead.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from async_vapo.verify.extract import extract_answer_line, extract_boxed

__all__ = ["ANSWER_FORMATS", "CheckReason", "check_answer", "extract_prediction", "normalize_answer"]

CheckReason = Literal["correct", "incorrect", "no_answer", "parse_error"]
AnswerFormat = Literal["boxed", "answer_line", "auto", "solution"]
ANSWER_FORMATS = ("boxed", "answer_line", "auto", "solution")

_SPACING = re.compile(r"\s+|\\[,;:! ]")
_SPACE = re.compile(r"\s+")
_DECIMAL = re.compile(r"-?[0-9]{1,40}(?:\.[0-9]{1,40})?")


def normalize_answer(text: str) -> str:
    """Canonical string form used for the exact-match fast path."""
    text = _SPACING.sub("", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.strip("$")
    if text.endswith("."):
        text = text[:-1]
    return text


def extract_prediction(response: str, answer_format: AnswerFormat = "boxed") -> str | None:
    """The span of ``response`` that states its answer, by ``answer_format`` (None: none found). For
    ``auto`` without a box or an Answer line this is None too: math-verify then reads the whole response."""
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if answer_format == "solution":
        return response if extract_boxed(response) is not None else None
    if answer_format in ("boxed", "auto"):
        pred = extract_boxed(response)
        if pred is not None or answer_format == "boxed":
            return pred
    return extract_answer_line(response)


def check_answer(response: str, answer: str, *, answer_format: AnswerFormat = "boxed",
                 timeout_s: int | None = None) -> tuple[bool, CheckReason]:
    """Grade ``response`` against the reference ``answer``; returns ``(correct, reason)``.

    ``answer`` may be bare LaTeX (``\\frac{1}{2}``), ``$``-wrapped, or itself contain a box.
    ``timeout_s`` is passed to math-verify's signal-based timeouts (whole seconds; main thread
    only); ``None`` disables them.
    """
    pred = extract_prediction(response, answer_format)
    if answer_format == "solution":
        if pred is None:
            return False, "no_answer"
        return (True, "correct") if _SPACE.sub("", pred) == _SPACE.sub("", answer) else (False, "incorrect")
    if answer_format == "auto" and pred is None:
        return _free_text(response, answer, timeout_s)
    if pred is None or not normalize_answer(pred):
        return False, "no_answer"
    gold_box = extract_boxed(answer) if "box" in answer else None
    gold = gold_box if gold_box is not None else answer

    pred_norm = normalize_answer(pred)
    gold_norm = normalize_answer(gold)
    if pred_norm == gold_norm:
        return True, "correct"
    if _DECIMAL.fullmatch(pred_norm) and _DECIMAL.fullmatch(gold_norm):
        if Fraction(pred_norm) == Fraction(gold_norm):
            return True, "correct"
        if "." not in pred_norm and "." not in gold_norm:
            return False, "incorrect"

    # Heavy import deferred: extract/normalize stay usable without sympy loaded.
    from math_verify import parse, verify

    # Parse the un-normalized text: dropping spaces would turn \sin x into the unknown \sinx.
    gold_tex = gold.strip().strip("$")
    gold_parsed = parse(f"${gold_tex}$", parsing_timeout=timeout_s)
    if not gold_parsed:
        gold_parsed = parse(gold, parsing_timeout=timeout_s)
    pred_parsed = parse(f"${pred.strip().strip('$')}$", parsing_timeout=timeout_s)
    if not gold_parsed or not pred_parsed:
        return False, "parse_error"
    correct = bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    return correct, "correct" if correct else "incorrect"


def _free_text(response: str, answer: str, timeout_s: int | None) -> tuple[bool, CheckReason]:
    """``auto`` without a box or an Answer line: math-verify extracts the final answer from the response."""
    from math_verify import parse, verify

    gold_box = extract_boxed(answer) if "box" in answer else None
    gold = (gold_box if gold_box is not None else answer).strip().strip("$")
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout_s) or parse(gold, parsing_timeout=timeout_s)
    pred_parsed = parse(response, parsing_timeout=timeout_s)
    if not pred_parsed:
        return False, "no_answer"
    if not gold_parsed:
        return False, "parse_error"
    correct = bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    return correct, "correct" if correct else "incorrect"
