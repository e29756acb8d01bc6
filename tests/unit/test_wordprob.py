"""Tests of async_vapo.tasks.wordprob: generated grade-school word problems and the committed CI prompt set."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from async_vapo.config import load_config
from async_vapo.tasks import load_problems, load_task, wordprob

ROOT = Path(__file__).resolve().parents[2]
CI_SET = ROOT / "tests" / "data" / "wordprob_ci.jsonl"

# An independent reading of a story, sentence by sentence (not the generator's templates).
_ADD = re.compile(r"(?:buys|finds|picks|gives (?:him|her)) (\d+) more\.")
_SUB = re.compile(r"(?:gives (\d+) to|(?:loses|uses|sells) (\d+) of them)")


def solve(story: str) -> tuple[int, list[int]]:
    sentences = re.findall(r"[^.?]+[.?]", story)
    count = int(re.fullmatch(r"\s*\w+ has (\d+) \w+\.", sentences[0]).group(1))
    seen = [count]
    for s in sentences[1:-1]:
        if m := _ADD.search(s):
            count += int(m.group(1))
        elif m := _SUB.search(s):
            count -= int(m.group(1) or m.group(2))
        elif "doubles" in s or "as many again" in s:
            count *= 2
        elif "triples" in s:
            count *= 3
        else:
            raise AssertionError(f"unread sentence {s!r}")
        seen.append(count)
    assert sentences[-1].strip().startswith("How many")
    return count, seen


def test_answers_match_an_independent_reading_of_the_story():
    rng = random.Random(0)
    for _ in range(2000):
        level = rng.randint(1, wordprob.MAX_LEVEL)
        p = wordprob.generate_problem(rng, level)
        answer, counts = solve(p.prompt)
        assert p.answer == str(answer), p.prompt
        assert len(counts) == level + 1 == len(p.meta["steps"]) + 1
        assert all(0 <= c <= wordprob.MAX_COUNT for c in counts), p.prompt
        assert p.meta["level"] == p.meta["n_ops"] == level
        if level == 1:
            assert counts[0] < 10 and abs(counts[1] - counts[0]) <= 5


def test_splits_are_disjoint_distinct_and_even_over_levels():
    train, held = wordprob.make_splits(600, 50, seed=3, min_level=1, max_level=3)
    assert len(train) == 600 and len(held) == 50
    assert len({p.prompt for p in train}) == 600 and len({p.prompt for p in held}) == 50
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert Counter(p.meta["level"] for p in held) == {1: 16, 2: 17, 3: 17}
    # the held-out split does not depend on num_train
    assert [p.prompt for p in wordprob.make_splits(10, 50, seed=3, min_level=1, max_level=3)[1]] == \
        [p.prompt for p in held]
    assert [p.prompt for p in wordprob.make_splits(10, 50, seed=4, min_level=1, max_level=3)[1]] != \
        [p.prompt for p in held]


def test_few_shot_examples_come_first_in_the_chat():
    (p,) = wordprob.make_splits(0, 1, seed=1, few_shot=1)[1]
    assert p.messages == wordprob.SHOTS[:2] + (("user", p.prompt),)
    assert wordprob.make_splits(0, 1, seed=1, few_shot=0)[1][0].messages == (("user", p.prompt),)
    for _, answer in wordprob.SHOTS[1::2]:
        assert answer.splitlines()[-1].startswith("Answer: ")


def test_same_problems_in_another_process_and_hash_seed():
    code = ("from async_vapo.tasks import wordprob; "
            "print([p.prompt for p in wordprob.make_splits(20, 10, seed=11)[1]])")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    assert out.strip() == str([p.prompt for p in wordprob.make_splits(20, 10, seed=11)[1]])


def test_committed_ci_prompt_set_is_the_generators_seed_2026_level_1():
    """tests/data/wordprob_ci.jsonl (verl layout: the chat as a message list) is what the generator makes."""
    _, held = wordprob.make_splits(0, 4, seed=2026, min_level=1, max_level=1, few_shot=1)
    loaded = load_problems(CI_SET)
    assert [(p.messages, p.answer) for p in loaded] == [(p.messages, p.answer) for p in held]
    assert [json.loads(x)["id"] for x in CI_SET.read_text().splitlines()] == [p.uid for p in held]


@pytest.mark.parametrize("bad", [(0, 1), (2, 1), (1, 5)])
def test_bad_levels_are_refused(bad):
    with pytest.raises(ValueError, match="min_level"):
        wordprob.make_splits(1, 1, seed=0, min_level=bad[0], max_level=bad[1])


def test_config_kind_wordprob():
    cfg = load_config([str(ROOT / "configs" / "smollm2_cpu.toml")], ["task.num_train=30", "task.num_eval=6"])
    train, held = load_task(cfg)
    assert len(train) == 30 and {p.meta["level"] for p in held} == {1, 2}
    with pytest.raises(Exception, match="levels 1-4"):
        load_config([], ["task.kind=wordprob", "task.max_ops=5"])
