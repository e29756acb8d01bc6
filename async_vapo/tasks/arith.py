"""Chain arithmetic: the embedded default task.

A prompt is a left-to-right chain of ``n_ops`` additions/subtractions of single digits, e.g.
``"7+3-5+2="``; a correct response writes one step per operation and boxes the result::

    7+3=10;10-5=5;5+2=7;\\boxed{7}

Responses therefore grow with ``n_ops`` (7 characters for ``0+0=``, up to ``8 * n_ops + 10``), which
gives the heterogeneous lengths VAPO's length-adaptive GAE is about. Every character a prompt or a
response can contain is in :data:`ALPHABET`.

*Labelled* chains (``labels=True``, the long-response task) name each operation with a letter, in the
prompt and in the step that uses it::

    7a+3b-5c+2=   ->   7a+3=10;10b-5=5;5c+2=7;\\boxed{7}

The chains are the same; only the writing differs. Without labels, the k-th step has to find the k-th
operation by its position in the prompt, which a small model does not learn for chains of tens of
operations; with labels it copies the two characters that follow the step's label in the prompt (the
next label is the letter after the previous step's), so a chain of any length is local work, and the
answer still depends on every step. :data:`LABELS` holds the 52 labels, so labelled chains have at
most 52 operations.

Invariants:

* The running total stays in ``[0, 99]`` after every operation (first operand included), so every
  number printed in a correct response has at most two digits and no sign.
* :func:`make_splits` never puts one prompt in both splits, never repeats a prompt within a split,
  and gives every ``n_ops`` value the same number of held-out problems (within one, when
  ``num_eval`` is not a multiple of the number of values). The held-out split depends only on
  ``(seed, num_eval, min_ops, max_ops)``, not on ``num_train``.
* :func:`demonstration` with at least one wrong step always boxes a wrong answer.

Departures from the brief this module was written to:

* Problems are drawn *uniformly among the valid chains* of the drawn length (by unranking an index
  counted with a small dynamic program), not by drawing each operation uniformly and redrawing the
  ones that leave ``[0, 99]``. Both satisfy the range constraint; the uniform draw lets
  :func:`make_splits` sample without replacement exactly (no rejection loop that stalls when a
  length's few distinct problems are nearly used up) and makes :func:`count_problems` the exact
  capacity behind its errors. :func:`generate_problem` uses the same distribution.
* When a length has fewer distinct problems than its share of ``num_train`` (``n_ops=1`` has only
  155), the train split takes all that remain there and gives the rest to the other lengths, so the
  train split is uniform over ``n_ops`` only while no length runs out.
"""

from __future__ import annotations

import dataclasses
import random
import re
import sys
from collections.abc import Sequence
from functools import cache

from async_vapo.tasks.task import Problem, prompt_uid

LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
"""The operation labels of labelled chains, in order: the k-th operation is ``LABELS[k - 1]``."""
ALPHABET = "0123456789+-=;\\boxed{}" + "".join(c for c in LABELS if c not in "\\boxed{}")
"""Every character that a prompt, a solution or a demonstration can contain (no duplicates)."""

MIN_TOTAL = 0
MAX_TOTAL = 99

_DIGITS = range(10)
_MOVES: tuple[tuple[str, int], ...] = tuple(("+", d) for d in _DIGITS) + tuple(("-", d) for d in _DIGITS)
_PROMPT_RE = re.compile(r"(\d)((?:[+-]\d)+)=")
_LABELLED_RE = re.compile(r"(\d)((?:[a-zA-Z][+-]\d)+)=")
_ERROR_OFFSETS = (-2, -1, 1, 2)

Step = tuple[int, str, int, int]
"""``(acc, op, operand, result)`` of one written step, e.g. ``(7, "+", 3, 10)`` for ``7+3=10;``."""


def _apply(acc: int, op: str, d: int) -> int:
    return acc + d if op == "+" else acc - d


def _in_range(x: int) -> bool:
    return MIN_TOTAL <= x <= MAX_TOTAL


@cache
def _completions(n_left: int) -> tuple[int, ...]:
    """``c[acc]``: number of valid ``n_left``-operation continuations from running total ``acc``."""
    if n_left == 0:
        return (1,) * (MAX_TOTAL + 1)
    below = _completions(n_left - 1)
    return tuple(
        sum(below[_apply(acc, op, d)] for op, d in _MOVES if _in_range(_apply(acc, op, d)))
        for acc in range(MAX_TOTAL + 1)
    )


def count_problems(n_ops: int) -> int:
    """Number of distinct prompts with exactly ``n_ops`` operations (155 for one operation)."""
    if n_ops < 1:
        raise ValueError(f"n_ops must be >= 1, got {n_ops}")
    counts = _completions(n_ops)
    return sum(counts[a] for a in _DIGITS)


def _unrank(n_ops: int, index: int) -> tuple[int, list[tuple[str, int]]]:
    """The ``index``-th valid chain of ``n_ops`` operations, as ``(first operand, [(op, d), ...])``."""
    counts = _completions(n_ops)
    for start in _DIGITS:
        if index < counts[start]:
            break
        index -= counts[start]
    else:
        raise IndexError(f"index out of range for n_ops={n_ops}")
    acc, ops = start, []
    for n_left in range(n_ops, 0, -1):
        below = _completions(n_left - 1)
        for op, d in _MOVES:
            new = _apply(acc, op, d)
            if not _in_range(new):
                continue
            if index < below[new]:
                ops.append((op, d))
                acc = new
                break
            index -= below[new]
    return start, ops


def _steps(start: int, ops: Sequence[tuple[str, int]]) -> tuple[Step, ...]:
    steps, acc = [], start
    for op, d in ops:
        new = _apply(acc, op, d)
        steps.append((acc, op, d, new))
        acc = new
    return tuple(steps)


def _problem(start: int, ops: Sequence[tuple[str, int]], labels: bool = False) -> Problem:
    prompt = f"{start}" + "".join(f"{LABELS[i] if labels else ''}{op}{d}" for i, (op, d) in enumerate(ops)) + "="
    steps = _steps(start, ops)
    return Problem(
        uid=prompt_uid(prompt),
        prompt=prompt,
        answer=str(steps[-1][3]),
        meta={"n_ops": len(ops), "steps": steps},
    )


def _parse(prompt: str) -> tuple[int, list[tuple[str, int]], bool]:
    """``(first operand, [(op, d), ...], labelled)`` of a prompt in either writing."""
    if match := _PROMPT_RE.fullmatch(prompt):
        tail = match.group(2)
        return int(match.group(1)), [(tail[i], int(tail[i + 1])) for i in range(0, len(tail), 2)], False
    if match := _LABELLED_RE.fullmatch(prompt):
        tail = match.group(2)
        if tail[::3] != LABELS[: len(tail) // 3]:
            raise ValueError(f"labelled chain-arithmetic prompt with labels out of order: {prompt!r}")
        return int(match.group(1)), [(tail[i + 1], int(tail[i + 2])) for i in range(0, len(tail), 3)], True
    raise ValueError(f"not a chain-arithmetic prompt: {prompt!r}")


def _check_ops(min_ops: int, max_ops: int, labels: bool = False) -> None:
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
    if labels and max_ops > len(LABELS):
        raise ValueError(f"labelled chains have at most {len(LABELS)} operations (one letter each), "
                         f"got max_ops={max_ops}")


def generate_problem(rng: random.Random, min_ops: int = 1, max_ops: int = 6, labels: bool = False) -> Problem:
    """One problem: ``n_ops`` uniform in ``[min_ops, max_ops]``, then a chain uniform among the valid
    chains of that length. ``meta``: ``n_ops`` and ``steps`` (tuple of ``(acc, op, operand, result)``)."""
    _check_ops(min_ops, max_ops, labels)
    n_ops = rng.randint(min_ops, max_ops)
    return _problem(*_unrank(n_ops, rng.randrange(count_problems(n_ops))), labels=labels)


def _sample_indices(rng: random.Random, population: int, k: int, exclude: frozenset[int]) -> list[int]:
    """``k`` distinct indices in ``range(population)`` outside ``exclude``, uniformly, in random order.

    The first ``k`` non-excluded entries of a uniform ``(k + |exclude|)``-sample are a uniform
    ``k``-subset of the complement in uniform random order.
    """
    if population > sys.maxsize:
        # random.sample cannot take a range this long (long chains: ~10^50 problems of 48 operations);
        # draw with rejection of repeats and excluded ones, which are vanishingly rare at such sizes.
        seen, out = set(exclude), []
        while len(out) < k:
            i = rng.randrange(population)
            if i not in seen:
                seen.add(i)
                out.append(i)
        return out
    drawn = rng.sample(range(population), k + len(exclude))
    return [i for i in drawn if i not in exclude][:k]


def _even_split(total: int, keys: Sequence[int]) -> dict[int, int]:
    """``total`` spread over ``keys`` as evenly as possible; the larger shares go to the later keys."""
    share, extra = divmod(total, len(keys))
    return {k: share + (i >= len(keys) - extra) for i, k in enumerate(keys)}


def _fill(total: int, capacity: dict[int, int]) -> dict[int, int]:
    """Water-filling: shares differ by at most one among keys below capacity; the larger shares go to
    the later keys. The caller checks ``total <= sum(capacity.values())``."""
    quota = dict.fromkeys(capacity, 0)
    remaining = total
    while remaining:
        open_keys = [k for k in capacity if quota[k] < capacity[k]]
        if remaining < len(open_keys):
            for k in open_keys[len(open_keys) - remaining :]:
                quota[k] += 1
            break
        # Open keys hold equal quotas, so an equal raise keeps them even; stop at the first to fill.
        share = min(remaining // len(open_keys), min(capacity[k] - quota[k] for k in open_keys))
        for k in open_keys:
            quota[k] += share
        remaining -= share * len(open_keys)
    return quota


def _stream(split: str, seed: int, *parts: int) -> random.Random:
    # String seeds are hashed with SHA-512 by random.Random: stable across processes and
    # PYTHONHASHSEED, and each (split, seed, level) gets an independent stream.
    return random.Random("/".join(["async-vapo", "arith", split, str(seed), *map(str, parts)]))


def make_splits(
    num_train: int, num_eval: int, seed: int, min_ops: int = 1, max_ops: int = 6, labels: bool = False
) -> tuple[list[Problem], list[Problem]]:
    """Deterministic ``(train, held_out)`` splits of distinct problems that share no prompt.

    The held-out split is drawn first, per ``n_ops`` value from its own RNG stream, with an equal
    count per value (the larger counts go to the longer chains when ``num_eval`` does not divide).
    The train split is drawn from what remains, as evenly over ``n_ops`` as capacity allows. Both
    come back shuffled. Raises ValueError when the sizes exceed the distinct problems available
    (see :func:`count_problems`). ``labels`` writes the same chains labelled (the splits hold the
    same chains either way).
    """
    _check_ops(min_ops, max_ops, labels)
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"split sizes must be >= 0, got num_train={num_train}, num_eval={num_eval}")
    levels = list(range(min_ops, max_ops + 1))
    available = {n: count_problems(n) for n in levels}

    eval_quota = _even_split(num_eval, levels)
    for n in levels:
        if eval_quota[n] > available[n]:
            raise ValueError(
                f"num_eval={num_eval} stratified over n_ops {min_ops}..{max_ops} needs {eval_quota[n]} "
                f"held-out problems with n_ops={n}, but only {available[n]} distinct ones exist; "
                f"lower num_eval or raise min_ops"
            )
    eval_index = {
        n: _sample_indices(_stream("eval", seed, n), available[n], eval_quota[n], frozenset()) for n in levels
    }

    train_capacity = {n: available[n] - eval_quota[n] for n in levels}
    if num_train > sum(train_capacity.values()):
        raise ValueError(
            f"num_train={num_train} exceeds the {sum(train_capacity.values())} distinct problems with "
            f"n_ops {min_ops}..{max_ops} left after the {num_eval} held-out ones; lower num_train or "
            f"raise max_ops"
        )
    train_quota = _fill(num_train, train_capacity)
    train_index = {
        n: _sample_indices(_stream("train", seed, n), available[n], train_quota[n], frozenset(eval_index[n]))
        for n in levels
    }

    held_out = [_problem(*_unrank(n, i), labels=labels) for n in levels for i in eval_index[n]]
    train = [_problem(*_unrank(n, i), labels=labels) for n in levels for i in train_index[n]]
    _stream("eval-order", seed).shuffle(held_out)
    _stream("train-order", seed).shuffle(train)
    return train, held_out


def _render(steps: Sequence[Step], labels: bool = False) -> str:
    return "".join(f"{acc}{LABELS[i] if labels else ''}{op}{d}={new};" for i, (acc, op, d, new) in enumerate(steps)) \
        + f"\\boxed{{{steps[-1][3]}}}"


def solution(problem: Problem) -> str:
    """The correct response for an arith problem (computed from the prompt, not from ``meta``), labelled
    when the prompt is."""
    start, ops, labels = _parse(problem.prompt)
    return _render(_steps(start, ops), labels)


def with_solution_answer(problem: Problem) -> Problem:
    """``problem`` whose reference answer is its whole correct solution (``task.answer = "solution"``); the
    final total stays in ``meta["total"]``."""
    return dataclasses.replace(problem, answer=solution(problem), meta={**problem.meta, "total": problem.answer})


def demonstration(problem: Problem, rng: random.Random, step_error_rate: float) -> str:
    """A solution in which each step is wrong with probability ``step_error_rate``.

    A wrong step prints a result off by ±1 or ±2 and the chain continues from that printed value,
    so later steps are computed correctly from a wrong total. The offset is drawn uniformly among
    those that (a) keep every later printed total in ``[0, 99]`` and (b) leave the accumulated
    deviation from the true chain nonzero, so a demonstration with any wrong step boxes a wrong
    answer. When no offset qualifies (only chains that sweep nearly the whole ``[0, 99]`` range,
    impossible below 10 operations) the step stays correct. Deterministic given ``rng``.
    """
    if not 0.0 <= step_error_rate <= 1.0:
        raise ValueError(f"step_error_rate must be in [0, 1], got {step_error_rate}")
    start, ops, labels = _parse(problem.prompt)
    true_steps = _steps(start, ops)
    true_totals = [new for _, _, _, new in true_steps]
    written: list[Step] = []
    deviation = 0
    for i, (acc, op, d, new) in enumerate(true_steps):
        if rng.random() < step_error_rate:
            rest = true_totals[i:]
            # Later printed totals are the true ones shifted by the accumulated deviation.
            lo, hi = MIN_TOTAL - min(rest), MAX_TOTAL - max(rest)
            offsets = [o for o in _ERROR_OFFSETS if lo <= deviation + o <= hi and deviation + o != 0]
            if offsets:
                written.append((acc + deviation, op, d, new + deviation + rng.choice(offsets)))
                deviation = written[-1][3] - new
                continue
        written.append((acc + deviation, op, d, new + deviation))
    return _render(written, labels)
