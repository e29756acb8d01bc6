"""Which problems a run trains and evaluates on, and the seeded order it walks them in."""

from __future__ import annotations

import random
from collections.abc import Sequence

from async_vapo.config import Config
from async_vapo.tasks import arith, shots, wordprob
from async_vapo.tasks.files import load_problems
from async_vapo.tasks.task import Problem


def load_task(cfg: Config) -> tuple[list[Problem], list[Problem]]:
    """(training problems, held-out problems) of ``cfg.task``; a file task's worked examples (``task.few_shot``)
    before each question (``async_vapo.tasks.shots``)."""
    t = cfg.task
    if t.kind == "arith":
        splits = arith.make_splits(t.num_train, t.num_eval, t.seed, t.min_ops, t.max_ops, t.labels)
        if t.answer == "solution":
            splits = tuple([arith.with_solution_answer(p) for p in part] for part in splits)
        return splits
    if t.kind == "wordprob":
        return wordprob.make_splits(t.num_train, t.num_eval, t.seed, t.min_ops, t.max_ops, t.shots)
    keys = {"prompt_key": t.prompt_key, "answer_key": t.answer_key, "messages_key": t.messages_key,
            "extra_keys": t.extra_keys if cfg.verifier.reward_fn else ()}  # the maths check takes no extra field
    train, held_out = load_problems(t.train_path, **keys), load_problems(t.eval_path, **keys)
    if not t.shots:
        return train, held_out
    if t.few_shot_path is not None:
        turns = shots.load_shots(t.few_shot_path, t.shots, template=t.prompt_template, prompt_key=t.prompt_key,
                                 messages_key=t.messages_key, solution_key=t.few_shot_solution_key)
    else:
        turns, train = shots.shots_from_train(train, t.train_path, t.shots, t.few_shot_solution_key,
                                              template=t.prompt_template)
    shots.check_held_out(turns, held_out, t.few_shot_path or t.train_path, t.prompt_template)
    return (shots.with_shots(train, turns, t.prompt_template), shots.with_shots(held_out, turns, t.prompt_template))


class PromptSampler:
    """Walks the training problems in a seeded order, epoch after epoch; its cursor is checkpointed."""

    def __init__(self, problems: Sequence[Problem], seed: int):
        self.problems, self.seed, self.cursor = list(problems), seed, 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Problem]:
        out = []
        while len(out) < n:
            epoch, pos = divmod(self.cursor, len(self.problems))
            out.append(self.problems[self._order(epoch)[pos]])
            self.cursor += 1
        return out
