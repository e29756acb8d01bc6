"""A user's reward function in place of the maths check (``verifier.reward_fn = "module:function"``).

For datasets whose answers are not maths (code output, a label, a string to match) the operator names a function

    def my_reward(response: str, answer: str) -> float

importable in the verifier's environment (an installed package, or a module on ``PYTHONPATH``): ``"module:function"``,
the function part may be dotted (``"pkg.rewards:Scorer.exact"``). It runs inside the sandboxed verifier workers
(:mod:`async_vapo.verify.sandbox`) exactly where ``check_answer`` would, under the same limits: the per-check wall
clock (soft timer, then the pool's kill), RLIMIT_CPU and RLIMIT_AS, no network, the sandbox uid.

What a call's outcome becomes (the pool's :class:`~async_vapo.verify.sandbox.VerifyResult`):
- a real number (``int``, ``float``, ``numpy.float64``...), finite: that is the reward; the response counts as
  correct (accuracy, pass@k, dynamic sampling) when it is at least ``verifier.reward_correct``;
- ``True`` / ``False``: ``verifier.reward_correct`` / ``verifier.reward_incorrect``;
- anything else (``None``, a string, a tensor, NaN, an infinity) or an exception: the verdict ``reward_error``, reward
  ``verifier.reward_incorrect``, with the type or the exception in the result's detail. The worker lives on;
- past the time limit: ``timeout``; out of memory or a dead worker: ``crash`` (the worker is replaced), as for maths.

The module is imported once per worker at its start, before the privilege drop (like math-verify: it is the
operator's code, not the model's; only the responses are untrusted, and they reach the function after the drop). A
path that does not resolve to a callable stops the pool from starting with :class:`RewardFnError`, never a check.
"""

from __future__ import annotations

import importlib
import math
import numbers
import re
from collections.abc import Callable

__all__ = ["REWARD_FN_RE", "RewardFnError", "load_reward_fn", "score"]

REWARD_FN_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""``module.path:attr.path``."""


class RewardFnError(Exception):
    """``verifier.reward_fn`` does not name a callable (bad syntax, module not importable, no such attribute)."""


def load_reward_fn(path: str) -> Callable[[str, str], object]:
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


def score(fn: Callable[[str, str], object], response: str, answer: str) -> tuple[str, float | bool | None, str]:
    """``(reason, reward, detail)`` of one call: ("scored", the number or bool, "") or ("reward_error", None, why).

    A function that calls ``sys.exit`` gets "reward_error" too (the worker stays). ``MemoryError`` and the sandbox's
    soft timeout propagate: the sandbox turns them into "crash" and "timeout"."""
    try:
        value = fn(response, answer)
    except MemoryError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        return "reward_error", None, f"reward_fn raised {type(e).__name__}: {e}"[:500]
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
