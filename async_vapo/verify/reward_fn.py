"""A user's reward function in place of the maths check (``verifier.reward_fn = "module:function"``).

For datasets whose answers are not maths (code output, a label, a string to match) the operator names a function
importable in the verifier's environment (an installed package, or a module on ``PYTHONPATH``): ``"module:function"``,
the function part may be dotted (``"pkg.rewards:Scorer.exact"``). It runs inside the sandboxed verifier workers
(:mod:`async_vapo.verify.sandbox`) exactly where ``check_answer`` would, under the same limits: the per-check wall
clock (soft timer, then the pool's kill), RLIMIT_CPU and RLIMIT_AS, no network, the sandbox uid.

What it is given, decided once from its signature when the worker loads it (:func:`reward_call`; ``CALL_FORMS``):

- ``"pair"``: ``def f(response, answer)``, this project's form: the response text and the reference answer.
- ``"keywords"``: ``def f(response, answer, *, prompt=None, extra_info=None, tolerance=0.0, **fields)``: the pair
  first (positionally, whatever its names), then every other parameter by its name: ``prompt`` is the problem's
  prompt (``Problem.prompt``: the question, or the last user message of a chat record); a name that is a field of the
  record gets that field's value (``data_source``, ``tolerance``, ...); ``extra_info`` is the record's ``extra_info``
  field, or, for a record without one, a dict of all its extra fields; ``**fields`` receives the prompt and every
  extra field. A parameter without a default whose value the record does not hold is a ``reward_error`` naming it.
- ``"verl"``: verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` unchanged
  (recognised by a parameter named ``solution_str``), called with keywords as verl calls it: ``data_source`` the
  record's field (None without one), ``solution_str`` the response, ``ground_truth`` the answer, ``extra_info`` as
  above; other named parameters as in "keywords".
- ``"batched"``: TRL's ``def reward(completions, prompts, **kwargs) -> list[float]`` (recognised by a first
  parameter named ``completions``), called with one response at a time: ``completions=[response]``,
  ``prompts=[prompt]`` and each extra field as a one-element list (the answer's own field among them, e.g.
  ``solution=[...]``); its one-element list is the result. Not a group at a time: the sandbox's unit of deadline,
  blame and requeue is one response (a hanging call is that response's "timeout", the worker's next items go on), and
  the pool splits a message's responses across workers by load, not by group. A function that scores each completion
  on its own (accuracy, format, length: TRL's and open-r1's) gives the same numbers; one that compares the
  completions of a group with each other does not fit the sandbox and is refused nowhere: it sees groups of one.

The record's extra fields are every field of its file except the prompt's and the messages' (or the
``task.extra_keys`` listed), read by :mod:`async_vapo.tasks.files`, carried to the verifier in ``Group.extra`` (JSON
text) and handed to the worker with each response (``(response, answer, context)`` items of
:meth:`~async_vapo.verify.sandbox.VerifierPool.verify`; the maths check ignores them).

What a call's outcome becomes (the pool's :class:`~async_vapo.verify.sandbox.VerifyResult`):
- a real number (``int``, ``float``, ``numpy.float64``...), finite: that is the reward; the response counts as
  correct (accuracy, pass@k, dynamic sampling) when it is at least ``verifier.reward_correct``;
- ``True`` / ``False``: ``verifier.reward_correct`` / ``verifier.reward_incorrect``;
- anything else (``None``, a string, a tensor, NaN, an infinity) or an exception: the verdict ``reward_error``, reward
  ``verifier.reward_incorrect``, with the type or the exception in the result's detail. The worker lives on;
- past the time limit: ``timeout``; out of memory or a dead worker: ``crash`` (the worker is replaced), as for maths.

The module is imported once per worker at its start, before the privilege drop (like math-verify: it is the
operator's code, not the model's; only the responses are untrusted, and they reach the function after the drop). A
path that does not resolve to a callable, or a callable whose signature fits no form above, stops the pool from
starting with :class:`RewardFnError`, never a check.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["CALL_FORMS", "REWARD_FN_RE", "RewardCall", "RewardFnError", "load_reward_fn", "reward_call", "score"]

REWARD_FN_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``module.path:attr.path``."""


class RewardFnError(Exception):
    """``verifier.reward_fn`` does not name a callable (bad syntax, module not importable, no such attribute)."""


def load_reward_fn(path: str) -> Callable[..., object]:
    """The callable that ``"module:function"`` names; :class:`RewardFnError` with the reason otherwise. Importing runs
    the module's top level, so a module that raises while being imported is reported with its exception."""
    if not REWARD_FN_RE.match(path):
        raise RewardFnError(f"verifier.reward_fn = {path!r}: expected 'module:function' (e.g. 'my_rewards:exact')")
    module_name, attrs = path.split(":")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as e:
        raise RewardFnError(f"verifier.reward_fn = {path!r}: cannot import {module_name!r} "
                            f"({type(e).__name__}: {e})") from e
    for attr in attrs.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise RewardFnError(f"verifier.reward_fn = {path!r}: {module_name!r} has no attribute {attrs!r}") from None
    if not callable(obj):
        raise RewardFnError(f"verifier.reward_fn = {path!r}: {type(obj).__name__} is not callable")
    return obj  # type: ignore[return-value]




CALL_FORMS = ("pair", "keywords", "verl", "batched")
"""The signatures a reward function may have (the module docstring says what each receives)."""

_MISSING = object()
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclass(frozen=True)
class RewardCall:
    """A reward function and how to call it (:func:`reward_call`). ``names``: the parameters filled by keyword;
    ``required``: those of them without a default; ``var_kw``: it takes ``**kwargs``; ``pair_names``: the names of
    the response's and the answer's parameters ("keywords"), never filled from the record."""

    fn: Callable[..., object]
    form: str
    names: tuple[str, ...] = ()
    required: frozenset[str] = frozenset()
    var_kw: bool = False
    pair_names: frozenset[str] = frozenset()

    def __call__(self, response: str, answer: str, prompt: str = "", extra: Mapping[str, Any] | None = None) -> object:
        """The function's raw result for one response (one-element list for "batched"); :class:`MissingField` when
        a parameter without a default has no value in this record."""
        extra = extra or {}
        if self.form == "pair":
            return self.fn(response, answer)
        if self.form == "batched":
            given: dict[str, Any] = {k: [v] for k, v in extra.items()}
            given.update(completions=[response], prompts=[prompt])
            return self.fn(**self._kwargs(given, extra))
        given = {**extra, "prompt": prompt, "extra_info": extra.get("extra_info", dict(extra))}
        if self.form == "verl":
            given.update(data_source=extra.get("data_source"), solution_str=response, ground_truth=answer)
            return self.fn(**self._kwargs(given, extra))
        return self.fn(response, answer, **self._kwargs(given, extra))

    def _kwargs(self, given: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
        missing = sorted(n for n in self.required if n not in given)
        if missing:
            raise MissingField(f"reward_fn needs {', '.join(map(repr, missing))}, which this record does not hold "
                               f"(its extra fields: {sorted(extra)}; task.extra_keys selects them)")
        out = {n: given[n] for n in self.names if n in given}
        if self.var_kw:  # the record's fields (and the prompt), as the form passes them, beside the named ones
            spread = {k: v for k, v in given.items() if k != "extra_info" or "extra_info" in extra}
            out.update({k: v for k, v in spread.items() if k not in out and k not in self.pair_names})
        return out


class MissingField(Exception):
    """A reward function's parameter without a default names a field this record does not have."""


def reward_call(fn: Callable[..., object], path: str = "") -> RewardCall:
    """How to call ``fn``, from its signature (``CALL_FORMS``); :class:`RewardFnError` when it fits none: fewer than
    two positional parameters and none of verl's or TRL's names. A callable without a readable signature (some
    builtins) is called as a pair."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return RewardCall(fn, "pair")
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in _NAMED]
    if any(p.name == "solution_str" for p in named) or (named and named[0].name == "completions"):
        form = "verl" if any(p.name == "solution_str" for p in named) else "batched"
        unnamed = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty]
        if unnamed:
            raise RewardFnError(f"verifier.reward_fn = {path!r}: {form} form, but {unnamed} are positional-only: "
                                "every parameter is passed by name")
        rest = named
    else:
        positional = [p for p in params if p.kind in _POSITIONAL]
        if len(positional) < 2 and not any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            raise RewardFnError(
                f"verifier.reward_fn = {path!r}: signature {inspect.signature(fn)} fits no accepted form: "
                "(response, answer, *, prompt=..., <record field>=...), verl's compute_score(data_source, "
                "solution_str, ground_truth, extra_info=None) or TRL's (completions, prompts, **kwargs)")
        first_two = frozenset(p.name for p in positional[:2])
        rest = [p for p in named if p.name not in first_two]
        if not rest and not var_kw:
            return RewardCall(fn, "pair")
        required = frozenset(p.name for p in rest if p.default is p.empty)
        return RewardCall(fn, "keywords", tuple(p.name for p in rest), required, var_kw, first_two)
    required = frozenset(p.name for p in rest if p.default is p.empty)
    return RewardCall(fn, form, tuple(p.name for p in rest), required, var_kw)


def score(fn: Callable[..., object] | RewardCall, response: str, answer: str,
          context: Mapping[str, Any] | None = None) -> tuple[str, float | bool | None, str]:
    """``(reason, reward, detail)`` of one call: ("scored", the number or bool, "") or ("reward_error", None, why).
    ``context``: ``{"prompt": str, "extra": JSON object text}`` (absent: an empty prompt and no extra fields).

    A function that calls ``sys.exit`` gets "reward_error" too (the worker stays). ``MemoryError`` and the sandbox's
    soft timeout propagate: the sandbox turns them into "crash" and "timeout"."""
    call = fn if isinstance(fn, RewardCall) else reward_call(fn)
    context = context or {}
    try:
        extra = json.loads(context["extra"]) if context.get("extra") else {}
        if not isinstance(extra, dict):
            raise TypeError(f"extra fields must be a JSON object, got {type(extra).__name__}")
    except (TypeError, ValueError) as e:
        return "reward_error", None, f"the record's extra fields do not decode: {e}"[:500]
    try:
        value = call(response, answer, str(context.get("prompt", "")), extra)
    except MemoryError:
        raise
    except MissingField as e:
        return "reward_error", None, str(e)[:500]
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        return "reward_error", None, f"reward_fn raised {type(e).__name__}: {e}"[:500]
    if call.form == "batched":
        if not isinstance(value, list | tuple) or len(value) != 1:
            return "reward_error", None, f"reward_fn (TRL form) returned {type(value).__name__}, not a one-float list"
        value = value[0]
    if isinstance(value, bool):
        return "scored", value, ""
    if not isinstance(value, numbers.Real):
        return "reward_error", None, f"reward_fn returned {type(value).__name__}, not a float"
    try:
        reward = float(value)
    except Exception as e:
        return "reward_error", None, f"reward_fn returned {type(value).__name__} that float() refuses: {e}"[:500]
    if not math.isfinite(reward):
        return "reward_error", None, f"reward_fn returned {reward}, not a finite float"
    return "scored", reward, ""
