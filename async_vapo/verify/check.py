"""Decide whether a model response states the reference answer.

``check_answer`` is the pure grading rule; it has no sandbox of its own. Untrusted responses must go
through :class:`async_vapo.verify.sandbox.VerifierPool`, which runs this function inside resource-
limited worker processes with a hard wall-clock deadline.

Order of tests, cheapest first:
1. Extract the last box (:func:`async_vapo.verify.extract.extract_boxed`); none or empty -> "no_answer".
2. Normalized string equality (whitespace, TeX spacing commands, ``$`` and a trailing period removed,
   ``\\dfrac``/``\\tfrac`` read as ``\\frac``) -> "correct".
3. Both sides plain decimals of at most 40+40 digits: equal as exact fractions -> "correct";
   unequal integers -> "incorrect"; unequal non-integers go on to math-verify, which compares with
   rounding (``float_rounding=6``) and may still accept them.
4. math-verify ``parse`` of both sides (each wrapped in ``$...$`` so its LaTeX extractor reads the
   whole expression) and ``verify(gold, pred)``.

Departures from plain math-verify usage:
- The prediction is only the last box, never free text, so "the answer is 3, no wait 4" cannot
  match by accident.
- math-verify's own timeouts use ``signal.alarm`` (whole seconds, main thread only). They are off by
  default here (``timeout_s=None``) so the function is safe in any thread; the sandbox enforces the
  deadline instead.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from async_vapo.verify.extract import extract_boxed

__all__ = ["CheckReason", "check_answer", "normalize_answer"]

CheckReason = Literal["correct", "incorrect", "no_answer", "parse_error"]

_SPACING = re.compile(r"\s+|\\[,;:! ]")
_DECIMAL = re.compile(r"-?[0-9]{1,40}(?:\.[0-9]{1,40})?")


def normalize_answer(text: str) -> str:
    """Canonical string form used for the exact-match fast path."""
    text = _SPACING.sub("", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.strip("$")
    if text.endswith("."):
        text = text[:-1]
    return text


def check_answer(response: str, answer: str, *, timeout_s: int | None = None) -> tuple[bool, CheckReason]:
    """Grade ``response`` against the reference ``answer``; returns ``(correct, reason)``.

    ``answer`` may be bare LaTeX (``\\frac{1}{2}``), ``$``-wrapped, or itself contain a box.
    ``timeout_s`` is passed to math-verify's signal-based timeouts (whole seconds; main thread
    only); ``None`` disables them.
    """
    pred = extract_boxed(response)
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
