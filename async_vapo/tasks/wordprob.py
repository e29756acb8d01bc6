"""Grade-school word problems, generated: the task of the real-model path (``task.kind = "wordprob"``).

A problem is a short story about one person's count of one kind of object, changed by ``level`` operations
(1: "Mia has 7 apples. She buys 5 more. How many apples does Mia have now?"), each an addition, a subtraction or,
from level 2 on, a doubling or tripling. Level 1 keeps its numbers below 10; later levels start from up to 20 and
add or take up to 12. The answer is the final count, a non-negative integer. ``level`` is the difficulty, as
``n_ops`` is the arith task's: ``task.min_ops`` .. ``task.max_ops`` (1..4). With the chat format each question
follows ``task.few_shot`` worked examples (:data:`SHOTS`); SmolLM2-135M-Instruct without one rambles past any
short token budget.

Invariants:

* Deterministic in ``(seed, num_train, num_eval, min_level, max_level)``: string-seeded ``random.Random`` streams
  (SHA-512 of the string), stable across processes and ``PYTHONHASHSEED``. The held-out split depends only on
  ``(seed, num_eval, min_level, max_level)``.
* Every count in the story stays in [0, 99]; a subtraction never takes more than there is.
* The splits share no prompt and neither repeats one; the held-out split has the same number of problems per
  level (the later levels get the remainder).
* ``meta``: ``level``, ``n_ops`` (the same number, so evaluation reports accuracy by difficulty as for arith)
  and ``steps``: ``(count, op, operand, result)`` per operation.
"""

from __future__ import annotations

import random

from async_vapo.tasks.task import Problem, prompt_uid

MAX_LEVEL = 4
MAX_COUNT = 99

_PEOPLE = (("Mia", "She"), ("Tom", "He"), ("Ava", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"),
           ("Lily", "She"), ("Max", "He"), ("Emma", "She"), ("Ben", "He"), ("Nora", "She"), ("Jack", "He"))
_FRIENDS = ("a friend", "a neighbour", "the teacher", "a classmate")
_THINGS = ("apples", "marbles", "stickers", "pencils", "cookies", "books", "shells", "cards", "stamps",
           "balloons", "coins", "flowers")
_ADD = ("{P} buys {n} more.", "{P} finds {n} more.", "{F} gives {o} {n} more.", "{P} picks {n} more.")
_SUB = ("{P} gives {n} to {F}.", "{P} loses {n} of them.", "{P} uses {n} of them.", "{P} sells {n} of them.")
_MUL = {2: ("Then the number of {t} {p} has doubles.", "{P} gets as many again."),
        3: ("Then the number of {t} {p} has triples.",)}

Step = tuple[int, str, int, int]

SHOTS: tuple[tuple[str, str], ...] = (
    ("user", "Ann has 4 pens. She buys 3 more. How many pens does Ann have now?"),
    ("assistant", "Ann has 4 + 3 = 7 pens.\nAnswer: 7"),
    ("user", "Bob has 9 cups. He gives 2 to a friend. Then the number of cups he has doubles. How many cups does Bob "
             "have now?"),
    ("assistant", "Bob has 9 - 2 = 7 cups, then 7 * 2 = 14 cups.\nAnswer: 14"),
)
"""Worked examples put before each problem's question in its chat (``task.few_shot`` of them): they show the
format, one line of working and a last line ``Answer: N`` (which ``answer_line`` and ``auto`` read)."""


def _stream(*parts: object) -> random.Random:
    return random.Random("/".join(["async-vapo", "wordprob", *map(str, parts)]))


def _check_levels(min_level: int, max_level: int) -> None:
    if not 1 <= min_level <= max_level <= MAX_LEVEL:
        raise ValueError(f"need 1 <= min_level <= max_level <= {MAX_LEVEL}, got {min_level}..{max_level}")


def generate_problem(rng: random.Random, level: int, few_shot: int = 1) -> Problem:
    """One problem of ``level`` operations (module docstring), drawn from ``rng``; its ``messages`` are
    ``few_shot`` worked examples (:data:`SHOTS`) and then the question."""
    if not 0 <= few_shot <= len(SHOTS) // 2:
        raise ValueError(f"few_shot must be in 0..{len(SHOTS) // 2}, got {few_shot}")
    _check_levels(level, level)
    name, pron = rng.choice(_PEOPLE)
    thing = rng.choice(_THINGS)
    small = level == 1  # one operation on numbers below 10: within reach of a 135 M model
    start = rng.randint(2, 9 if small else 20)
    sentences = [f"{name} has {start} {thing}."]
    steps: list[Step] = []
    count = start
    for i in range(level):
        ops = ["+", "-"] + (["*"] if i > 0 and count <= MAX_COUNT // 3 else [])
        op = rng.choice(ops if count > 1 else ["+"])
        if op == "+":
            n = rng.randint(1, min(5 if small else 12, MAX_COUNT - count))
            text = rng.choice(_ADD)
        elif op == "-":
            n = rng.randint(1, min(5 if small else 12, count - 1))
            text = rng.choice(_SUB)
        else:
            n = rng.choice([2, 3])
            text = rng.choice(_MUL[n])
        friend = rng.choice(_FRIENDS)
        sentences.append(text.format(P=pron, n=n, F=friend if "{F}" not in text[:3] else
                                     friend.capitalize(), o="him" if pron == "He" else "her", t=thing,
                                     p=pron.lower()))
        new = count + n if op == "+" else count - n if op == "-" else count * n
        steps.append((count, op, n, new))
        count = new
    sentences.append(f"How many {thing} does {name} have now?")
    prompt = " ".join(sentences)
    return Problem(uid=prompt_uid(prompt), prompt=prompt, answer=str(count),
                   meta={"level": level, "n_ops": level, "steps": tuple(steps)},
                   messages=SHOTS[: 2 * few_shot] + (("user", prompt),))


def _draw(split: str, seed: int, level: int, k: int, exclude: set[str], few_shot: int) -> list[Problem]:
    rng = _stream(split, seed, level)
    out: list[Problem] = []
    seen = set(exclude)
    tries = 0
    while len(out) < k:
        tries += 1
        if tries > 50 * k + 1000:
            raise ValueError(f"could not draw {k} distinct level-{level} problems for the {split} split; "
                             f"lower num_train / num_eval")
        p = generate_problem(rng, level, few_shot)
        if p.prompt not in seen:
            seen.add(p.prompt)
            out.append(p)
    return out


def make_splits(num_train: int, num_eval: int, seed: int, min_level: int = 1, max_level: int = 3,
                few_shot: int = 1) -> tuple[list[Problem], list[Problem]]:
    """Deterministic ``(train, held_out)`` splits of distinct problems that share no prompt (module docstring);
    both evenly spread over the levels and shuffled."""
    _check_levels(min_level, max_level)
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"split sizes must be >= 0, got num_train={num_train}, num_eval={num_eval}")
    levels = list(range(min_level, max_level + 1))

    def quota(total: int) -> dict[int, int]:
        share, extra = divmod(total, len(levels))
        return {lv: share + (i >= len(levels) - extra) for i, lv in enumerate(levels)}

    held_out = [p for lv, k in quota(num_eval).items() for p in _draw("eval", seed, lv, k, set(), few_shot)]
    taken = {p.prompt for p in held_out}
    train = [p for lv, k in quota(num_train).items() for p in _draw("train", seed, lv, k, taken, few_shot)]
    _stream("eval-order", seed).shuffle(held_out)
    _stream("train-order", seed).shuffle(train)
    return train, held_out
