"""pass@k, avg@n and accuracy by difficulty (async_vapo.metrics.passk)."""

from __future__ import annotations

import itertools
import random
from fractions import Fraction

import pytest

from async_vapo.metrics.passk import default_ks, difficulty, pass_at_k, summarize


def _brute_pass_at_k(verdicts: list[bool], k: int) -> Fraction:
    """The fraction of all k-subsets of the samples holding a correct one: what pass@k estimates."""
    subsets = list(itertools.combinations(range(len(verdicts)), k))
    return Fraction(sum(any(verdicts[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", [1, 2, 5, 8, 10])
def test_pass_at_k_equals_enumerating_every_subset(n):
    for c in range(n + 1):
        verdicts = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_brute_pass_at_k(verdicts, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_hand_values_and_large_n():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    # large n: exact integers, no overflow or cancellation (1 - C(999,8)/C(1000,8) = 8/1000)
    assert pass_at_k(1000, 1, 8) == pytest.approx(0.008, rel=1e-12)


@pytest.mark.parametrize(("n", "c", "k"), [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


def test_summarize_overall_and_by_difficulty():
    correct = [[True, False, False, False], [True, True, False, False], [False] * 4, [True] * 4]
    labels = ["ops1", "ops1", "ops10", "ops2"]
    m = summarize(correct, [1, 2, 4], labels=labels)
    assert m["eval/accuracy"] == 7 / 16 == m["eval/avg@4"] == m["eval/pass@1"]
    assert m["eval/pass@2"] == pytest.approx((0.5 + 5 / 6 + 0 + 1) / 4)
    assert m["eval/pass@4"] == 0.75
    assert m["eval/accuracy_ops1"] == 3 / 8 and m["eval/pass@2_ops1"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert m["eval/accuracy_ops10"] == 0.0 and m["eval/pass@4_ops2"] == 1.0
    assert [k for k in m if k.startswith("eval/accuracy_")] == ["eval/accuracy_ops1", "eval/accuracy_ops2",
                                                                  "eval/accuracy_ops10"]


def test_summarize_is_the_mean_of_per_problem_estimates():
    rng = random.Random(0)
    correct = [[rng.random() < 0.3 for _ in range(6)] for _ in range(50)]
    m = summarize(correct, [3])
    brute = sum(_brute_pass_at_k(c, 3) for c in correct) / len(correct)
    assert m["eval/pass@3"] == pytest.approx(float(brute), abs=1e-12)


def test_summarize_refuses_k_above_the_samples():
    with pytest.raises(ValueError, match="pass@4 needs at least 4 samples"):
        summarize([[True, False], [True, True, False, False]], [4])


def test_default_ks_and_difficulty_labels():
    assert default_ks(1) == [1] and default_ks(2) == [1, 2] and default_ks(32) == [1, 2, 4, 8, 16, 32]
    assert default_ks(6) == [1, 2, 4, 6]
    assert difficulty({"n_ops": 3}) == "ops3" and difficulty({"difficulty": "hard"}) == "hard"
    assert difficulty({"path": "x", "row": 1}) is None


def test_problem_files_keep_their_difficulty(tmp_path):
    from async_vapo.tasks import load_problems

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1", "level": 3}\n{"prompt": "b", "answer": "2"}\n'
                    '{"prompt": "c", "answer": "3", "difficulty": "hard", "level": 5}\n')
    assert [difficulty(p.meta) for p in load_problems(path)] == ["3", None, "hard"]
