"""Tests of async_vapo.tasks: the chain-arithmetic generator and the problem-file loaders."""

from __future__ import annotations

import itertools
import json
import random
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_vapo.tasks import Problem, ProblemFileError, arith, load_problems, prompt_uid

STEP_RE = re.compile(r"(-?\d+)([+-])(\d)=(-?\d+);")
RESPONSE_RE = re.compile(r"((?:-?\d+[+-]\d=-?\d+;)+)\\boxed\{(-?\d+)\}")


def parse_response(text: str) -> tuple[list[tuple[int, str, int, int]], int]:
    """Independent parser of a written chain: ([(acc, op, d, result), ...], boxed)."""
    match = RESPONSE_RE.fullmatch(text)
    assert match is not None, text
    steps = [(int(a), op, int(d), int(r)) for a, op, d, r in STEP_RE.findall(match.group(1))]
    return steps, int(match.group(2))


def running_totals(prompt: str) -> list[int]:
    """Naive left-to-right evaluation of a prompt, character by character."""
    assert prompt.endswith("=")
    totals = [int(prompt[0])]
    for op, d in zip(prompt[1:-1:2], prompt[2:-1:2], strict=True):
        totals.append(totals[-1] + int(d) if op == "+" else totals[-1] - int(d))
    return totals


# ---------------------------------------------------------------- counting


def test_count_problems_one_op_by_hand():
    # Start a in 0..9: "+d" is always valid (10 each, 100 in all); "-d" needs d <= a (a + 1 each,
    # 1 + 2 + ... + 10 = 55 in all). 100 + 55 = 155.
    assert arith.count_problems(1) == 155


@pytest.mark.parametrize("n_ops", [1, 2])
def test_count_problems_matches_brute_force(n_ops):
    valid = 0
    for start, *ops in itertools.product(range(10), *[[(o, d) for o in "+-" for d in range(10)]] * n_ops):
        prompt = f"{start}" + "".join(f"{o}{d}" for o, d in ops) + "="
        valid += all(0 <= t <= 99 for t in running_totals(prompt))
    assert arith.count_problems(n_ops) == valid


def test_count_problems_matches_forward_count_up_to_twelve_ops():
    # ways[t]: chains so far whose running total is t; counted forwards, unlike the module's backward
    # count, and long enough (11+ ops) for the upper bound 99 to bind.
    ways = Counter(range(10))
    for n_ops in range(1, 13):
        nxt: Counter[int] = Counter()
        for total, w in ways.items():
            for new in [total + d for d in range(10)] + [total - d for d in range(10)]:
                if 0 <= new <= 99:
                    nxt[new] += w
        ways = nxt
        assert arith.count_problems(n_ops) == sum(ways.values()), n_ops


# ---------------------------------------------------------------- splits


def test_make_splits_deterministic_in_seed():
    a = arith.make_splits(300, 60, seed=3)
    b = arith.make_splits(300, 60, seed=3)
    c = arith.make_splits(300, 60, seed=4)
    assert a == b
    assert [p.prompt for p in a[0]] != [p.prompt for p in c[0]]
    assert {p.prompt for p in a[1]} != {p.prompt for p in c[1]}


@pytest.mark.parametrize("seed", [0, 1, 1234])
@pytest.mark.parametrize(
    ("num_train", "num_eval", "min_ops", "max_ops"),
    [
        (4000, 240, 1, 6),  # the default config: n_ops=1 runs out of train problems
        (2460, 300, 1, 2),  # every one of the 155 + 2605 distinct problems is used
        (500, 50, 3, 4),
        (1, 1, 1, 1),
        (4000, 138, 22, 44),  # the long config: more problems per length than random.sample can index
    ],
)
def test_splits_are_disjoint_and_distinct(seed, num_train, num_eval, min_ops, max_ops):
    train, held_out = arith.make_splits(num_train, num_eval, seed, min_ops, max_ops)
    assert len(train) == num_train and len(held_out) == num_eval
    train_prompts = [p.prompt for p in train]
    eval_prompts = [p.prompt for p in held_out]
    assert len(set(train_prompts)) == num_train
    assert len(set(eval_prompts)) == num_eval
    assert not set(train_prompts) & set(eval_prompts)
    assert all(min_ops <= p.meta["n_ops"] <= max_ops for p in train + held_out)


@pytest.mark.parametrize(("num_eval", "per_level"), [(240, {40}), (60, {10}), (100, {16, 17})])
def test_held_out_is_stratified_by_n_ops(num_eval, per_level):
    _, held_out = arith.make_splits(100, num_eval, seed=5)
    counts = Counter(len(running_totals(p.prompt)) - 1 for p in held_out)
    assert sorted(counts) == [1, 2, 3, 4, 5, 6]
    assert set(counts.values()) == per_level


def test_held_out_does_not_depend_on_num_train():
    _, small = arith.make_splits(10, 120, seed=9)
    _, large = arith.make_splits(5000, 120, seed=9)
    assert small == large


def test_long_chain_splits_are_deterministic_and_stratified():
    assert arith.count_problems(44) > sys.maxsize
    train, held_out = arith.make_splits(300, 46, seed=3, min_ops=22, max_ops=44)
    assert (train, held_out) == arith.make_splits(300, 46, seed=3, min_ops=22, max_ops=44)
    assert arith.make_splits(10, 46, seed=3, min_ops=22, max_ops=44)[1] == held_out
    assert set(Counter(p.meta["n_ops"] for p in held_out).values()) == {2}
    for p in held_out[:5]:
        assert arith.solution(p).endswith(f"\\boxed{{{p.answer}}}")


def test_train_uses_all_lengths_evenly_until_one_runs_out():
    train, _ = arith.make_splits(4000, 240, seed=1)
    counts = Counter(p.meta["n_ops"] for p in train)
    # n_ops=1 has 155 problems, 40 held out: all 115 left go to train, the rest spread evenly.
    assert counts[1] == 115
    assert max(counts[n] for n in range(2, 7)) - min(counts[n] for n in range(2, 7)) <= 1


def test_split_sizes_beyond_capacity_raise():
    with pytest.raises(ValueError, match=r"n_ops=1, but only 155"):
        arith.make_splits(10, 6 * 156, seed=0)
    with pytest.raises(ValueError, match=r"num_train=2461 exceeds the 2460"):
        arith.make_splits(2461, 300, seed=0, min_ops=1, max_ops=2)
    with pytest.raises(ValueError, match="min_ops"):
        arith.make_splits(10, 10, seed=0, min_ops=3, max_ops=2)


# ---------------------------------------------------------------- problems and solutions


def _all_problems() -> list[Problem]:
    train, held_out = arith.make_splits(400, 120, seed=11)
    rng = random.Random(0)
    return train + held_out + [arith.generate_problem(rng, 1, 12) for _ in range(200)]


def test_solution_is_correct_by_independent_evaluation():
    for problem in _all_problems():
        steps, boxed = parse_response(arith.solution(problem))
        expected = eval(problem.prompt[:-1])  # + and - are left-associative: plain eval is the chain
        assert boxed == expected == int(problem.answer)
        totals = running_totals(problem.prompt)
        assert len(steps) == len(totals) - 1 == problem.meta["n_ops"]
        assert tuple(steps) == problem.meta["steps"]
        for (acc, op, d, result), before, after in zip(steps, totals[:-1], totals[1:], strict=True):
            assert acc == before and result == after
            assert result == (acc + d if op == "+" else acc - d)
        assert problem.prompt == f"{steps[0][0]}" + "".join(f"{op}{d}" for _, op, d, _ in steps) + "="
        assert problem.uid == prompt_uid(problem.prompt)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32), min_ops=st.integers(1, 12), extra=st.integers(0, 6))
def test_generated_running_total_stays_in_range(seed, min_ops, extra):
    max_ops = min(min_ops + extra, 12)
    problem = arith.generate_problem(random.Random(seed), min_ops, max_ops)
    totals = running_totals(problem.prompt)
    assert min_ops <= len(totals) - 1 <= max_ops
    assert all(0 <= t <= 99 for t in totals)
    assert re.fullmatch(r"\d([+-]\d)+=", problem.prompt)


def test_generate_problem_covers_every_length():
    rng = random.Random(2)
    lengths = Counter(arith.generate_problem(rng, 2, 5).meta["n_ops"] for _ in range(400))
    assert sorted(lengths) == [2, 3, 4, 5]


def test_response_lengths_are_heterogeneous():
    train, _ = arith.make_splits(1000, 60, seed=0)
    lengths = [len(arith.solution(p)) for p in train]
    assert len({p.meta["n_ops"] for p in train}) == 6
    # shortest: "a+b=c;\boxed{c}" with one digit is 14 chars; six two-digit steps are far longer.
    assert min(lengths) <= 17 and max(lengths) >= 50


def test_solution_rejects_other_prompts():
    with pytest.raises(ValueError, match="not a chain-arithmetic prompt"):
        arith.solution(Problem(uid="x", prompt="What is 2+2?", answer="4"))


# ---------------------------------------------------------------- demonstrations


def _step_errors(text: str) -> tuple[int, int]:
    """(wrong steps, steps) of a written chain; also checks the chain continues from printed values."""
    steps, boxed = parse_response(text)
    wrong = 0
    for i, (acc, op, d, result) in enumerate(steps):
        if i:
            assert acc == steps[i - 1][3], "the chain must continue from the printed value"
        true = acc + d if op == "+" else acc - d
        assert 0 <= result <= 99 and 0 <= acc <= 99
        if result != true:
            assert result - true in (-2, -1, 1, 2)
            wrong += 1
    assert boxed == steps[-1][3]
    return wrong, len(steps)


def test_demonstration_with_rate_zero_is_the_solution():
    rng = random.Random(0)
    for problem in _all_problems():
        assert arith.demonstration(problem, rng, 0.0) == arith.solution(problem)


def test_demonstration_with_rate_one_gets_every_step_and_the_answer_wrong():
    rng = random.Random(0)
    for problem in arith.make_splits(500, 60, seed=1)[0]:
        text = arith.demonstration(problem, rng, 1.0)
        wrong, n = _step_errors(text)
        assert wrong == n == problem.meta["n_ops"]
        assert parse_response(text)[1] != int(problem.answer)


def test_demonstration_step_error_rate_matches_request():
    rng = random.Random(7)
    train, _ = arith.make_splits(2000, 60, seed=2)
    wrong = steps = 0
    for problem in train:
        text = arith.demonstration(problem, rng, 0.3)
        w, n = _step_errors(text)
        wrong, steps = wrong + w, steps + n
        # any wrong step makes the boxed answer wrong; no wrong step keeps it right
        assert (parse_response(text)[1] == int(problem.answer)) == (w == 0)
    assert abs(wrong / steps - 0.3) < 0.03


def test_demonstration_is_deterministic_given_rng():
    problems = arith.make_splits(50, 12, seed=4)[0]
    a = [arith.demonstration(p, random.Random(i), 0.5) for i, p in enumerate(problems)]
    b = [arith.demonstration(p, random.Random(i), 0.5) for i, p in enumerate(problems)]
    assert a == b
    assert any(x != arith.solution(p) for x, p in zip(a, problems, strict=True))


def test_alphabet_covers_every_generated_character():
    assert len(set(arith.ALPHABET)) == len(arith.ALPHABET)
    rng = random.Random(3)
    seen: set[str] = set()
    labelled = [arith.generate_problem(random.Random(i), 40, 52, labels=True) for i in range(20)]
    for problem in _all_problems() + labelled:
        for text in (problem.prompt, arith.solution(problem), arith.demonstration(problem, rng, 0.5)):
            seen |= set(text)
    assert seen <= set(arith.ALPHABET)
    assert seen == set(arith.ALPHABET)  # and nothing in the alphabet is unused


# ---------------------------------------------------------------- labelled chains


def _unlabel(text: str) -> str:
    return re.sub(r"[a-zA-Z](?=[+-]\d)", "", text)


def test_labelled_splits_are_the_same_chains_written_with_labels():
    plain = arith.make_splits(300, 46, seed=5, min_ops=18, max_ops=40)
    labelled = arith.make_splits(300, 46, seed=5, min_ops=18, max_ops=40, labels=True)
    for a_split, b_split in zip(plain, labelled, strict=True):
        assert len(a_split) == len(b_split)
        for a, b in zip(a_split, b_split, strict=True):
            assert _unlabel(b.prompt) == a.prompt and b.answer == a.answer and b.meta == a.meta
            n = a.meta["n_ops"]
            # the k-th operation carries the k-th label, in order
            assert re.fullmatch(r"\d" + "".join(f"{arith.LABELS[k]}[+-]\\d" for k in range(n)) + "=", b.prompt)
            assert b.uid == prompt_uid(b.prompt) != a.uid


def test_labelled_solution_and_demonstration_carry_each_steps_label():
    rng = random.Random(9)
    for problem in arith.make_splits(200, 46, seed=6, min_ops=18, max_ops=40, labels=True)[0]:
        n = problem.meta["n_ops"]
        text = arith.solution(problem)
        steps = re.findall(r"(\d+)([a-zA-Z])([+-]\d)=(\d+);", text)
        assert [s[1] for s in steps] == list(arith.LABELS[:n])
        # each step copies the operation that follows its label in the prompt
        assert all(f"{label}{op}" in problem.prompt for _, label, op, _ in steps)
        unlabelled = _unlabel(text)
        assert parse_response(unlabelled)[1] == int(problem.answer)
        demo = arith.demonstration(problem, rng, 0.3)
        assert [s[1] for s in re.findall(r"(\d+)([a-zA-Z])([+-]\d)=(\d+);", demo)] == list(arith.LABELS[:n])
        wrong, _ = _step_errors(_unlabel(demo))
        assert (parse_response(_unlabel(demo))[1] == int(problem.answer)) == (wrong == 0)


def test_labelled_chains_are_at_most_52_operations_and_parse_strictly():
    with pytest.raises(ValueError, match="at most 52"):
        arith.make_splits(10, 2, seed=0, min_ops=50, max_ops=53, labels=True)
    with pytest.raises(ValueError, match="out of order"):
        arith.solution(Problem(uid="x", prompt="7a+3c-5=", answer="5"))


def test_tasks_import_neither_torch_nor_pyarrow():
    code = "import sys, async_vapo.tasks; assert not {'torch', 'pyarrow'} & set(sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# ---------------------------------------------------------------- file loaders


def write_jsonl(path: Path, lines: list[object | str]) -> Path:
    """Objects are JSON-encoded; strings are written verbatim (blank or broken lines)."""
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


DAPO_RECORD = {
    "data_source": "math_dapo",
    "prompt": [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Find x if 2x = 10."},
    ],
    "ability": "MATH",
    "reward_model": {"ground_truth": "5", "style": "rule-lighteval/MATH_v2"},
    "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
}


def test_load_flat_jsonl_with_blank_lines(tmp_path):
    path = write_jsonl(
        tmp_path / "flat.jsonl", [{"prompt": "1+1=", "answer": "2"}, "", "  ", {"prompt": "p", "answer": 7}]
    )
    problems = load_problems(path)
    assert [(p.prompt, p.answer) for p in problems] == [("1+1=", "2"), ("p", "7")]
    assert problems[0].uid == prompt_uid("1+1=")
    assert [p.meta["row"] for p in problems] == [1, 4]


def test_load_dapo_layout_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "dapo.jsonl", [DAPO_RECORD])
    (problem,) = load_problems(path)
    assert problem.prompt == "Find x if 2x = 10."  # the last user message
    assert problem.answer == "5"
    assert problem.uid == "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"


@pytest.mark.parametrize(("p_key", "a_key"), [("Problem", "Answer"), ("problem", "answer")])
def test_load_aime_layout_jsonl(tmp_path, p_key, a_key):
    records = [
        {"ID": "2024-I-1", p_key: "How many?", a_key: 204, "Solution": "..."},
        {p_key: "q", a_key: "033"},
    ]
    problems = load_problems(write_jsonl(tmp_path / "aime.jsonl", records))
    assert [(p.uid, p.prompt, p.answer) for p in problems] == [
        ("2024-I-1", "How many?", "204"),
        (prompt_uid("q"), "q", "033"),
    ]


def test_load_json_list_explicit_dotted_keys_and_limit(tmp_path):
    path = tmp_path / "x.json"
    records = [{"question": f"q{i}", "label": {"final": i}} for i in range(5)]
    path.write_text(json.dumps(records, indent=1))
    problems = load_problems(path, prompt_key="question", answer_key="label.final", limit=3)
    assert [(p.prompt, p.answer, p.meta["row"]) for p in problems] == [
        ("q0", "0", 1),
        ("q1", "1", 2),
        ("q2", "2", 3),
    ]


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    second = {
        **DAPO_RECORD,
        "reward_model": {"ground_truth": "12", "style": "x"},
        "extra_info": {"index": "b"},
    }
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist([DAPO_RECORD, second]), path)
    problems = load_problems(path)
    assert [(p.prompt, p.answer, p.uid) for p in problems] == [
        ("Find x if 2x = 10.", "5", DAPO_RECORD["extra_info"]["index"]),
        ("Find x if 2x = 10.", "12", "b"),
    ]


def test_load_parquet_error_names_the_row(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]), path
    )
    with pytest.raises(ProblemFileError, match=r"bad\.parquet: row 2: field 'answer' must be str or int"):
        load_problems(path)


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        ([{"prompt": "a", "answer": "1"}, "", {"prompt": "b"}], r"f\.jsonl:3: missing field 'answer'"),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": 5, "answer": "1"}],
            r"f\.jsonl:2: field 'prompt' must be str",
        ),
        ([{"prompt": "a", "answer": [1]}], r"f\.jsonl:1: field 'answer' must be str or int, got list"),
        ([{"prompt": "a", "answer": True}], r"f\.jsonl:1: field 'answer' must be str or int, got bool"),
        ([{"prompt": "a", "answer": "1"}, '{"prompt": "b", '], r"f\.jsonl:2: invalid JSON"),
        ([{"prompt": "a", "answer": "1"}, "[1, 2]"], r"f\.jsonl:2: expected a JSON object, got list"),
        (
            [{"prompt": "a", "answer": "1"}, {"prompt": " ", "answer": "1"}],
            r"f\.jsonl:2: field 'prompt' is empty",
        ),
        (
            ["", {"prompt": [{"role": "system", "content": "s"}], "answer": "1"}],
            r"f\.jsonl:2: .* without a 'user'",
        ),
        ([{"question": "a", "answer": "1"}], r"f\.jsonl:1: no prompt field found"),
        (["", " "], r"f\.jsonl: no problems"),
    ],
)
def test_load_jsonl_errors_name_file_and_line(tmp_path, lines, fragment):
    with pytest.raises(ProblemFileError, match=fragment):
        load_problems(write_jsonl(tmp_path / "f.jsonl", lines))


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("g.json", "[]", r"g\.json: no problems"),
        (
            "g.json",
            '[{"prompt": "a", "answer": "1"},\n {"prompt": "b"}]',
            r"g\.json: record 2: missing field",
        ),
        (
            "g.json",
            '{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n',
            r"g\.json:2: invalid JSON.*jsonl",
        ),
        ("g.json", '{"prompt": "a", "answer": "1"}', r"g\.json: expected a JSON list of objects, got dict"),
        ("g.csv", "prompt,answer\na,1\n", r"g\.csv: unknown extension '\.csv'"),
    ],
)
def test_load_other_errors_name_the_file(tmp_path, name, text, fragment):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ProblemFileError, match=fragment):
        load_problems(path)


# --- datasets with their own field names (task.prompt_key / answer_key / messages_key) ---

OWN_FIELDS = [
    {"question": "What is 2+3?", "solution": {"final": 5, "steps": "2+3=5"},
     "chat": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]},
    {"question": "What is 4*4?", "solution": {"final": "16", "steps": "4*4=16"},
     "chat": [{"role": "user", "content": "4*4?"}]},
]


def files_config(train: Path, *keys: str):
    from async_vapo.config import load_config

    return load_config(overrides=["task.kind=files", f"task.train_path={train}", f"task.eval_path={train}", *keys])


def test_config_field_names_reach_the_loader(tmp_path):
    from async_vapo.tasks import load_task

    path = write_jsonl(tmp_path / "own.jsonl", OWN_FIELDS)
    cfg = files_config(path, "task.prompt_key=question", "task.answer_key=solution.final", "task.messages_key=chat")
    train, held_out = load_task(cfg)
    assert [(p.prompt, p.answer) for p in train] == [("What is 2+3?", "5"), ("What is 4*4?", "16")]
    assert train[0].messages == (("system", "Be brief."), ("user", "2+3?"))  # the list, not the prompt field
    assert train[1].messages == (("user", "4*4?"),)
    assert [p.prompt for p in held_out] == [p.prompt for p in train]
    # messages_key alone: the prompt is the list's last user message
    (p, _) = load_problems(path, answer_key="solution.final", messages_key="chat")
    assert (p.prompt, p.messages) == ("2+3?", (("system", "Be brief."), ("user", "2+3?")))


def test_field_names_are_for_problem_files_only():
    from async_vapo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="task.prompt_key .*kind='files' only"):
        load_config(overrides=["task.prompt_key=question"])


def test_a_wrong_key_names_the_file_the_key_and_the_fields(tmp_path):
    path = write_jsonl(tmp_path / "own.jsonl", OWN_FIELDS)
    with pytest.raises(ProblemFileError) as e:
        load_problems(path, prompt_key="questoin", answer_key="solution.final")
    msg = str(e.value)
    assert msg.startswith(f"{path}:1: missing field 'questoin' (task.prompt_key)")
    assert "['chat', 'question', 'solution']" in msg and "did you mean 'question'?" in msg
    with pytest.raises(ProblemFileError) as e:  # a dotted key: the fields of the object it reached
        load_problems(path, prompt_key="question", answer_key="solution.finl")
    assert "missing field 'solution.finl' (task.answer_key); the fields of 'solution' found: ['final', 'steps']" \
        in str(e.value) and "did you mean 'solution.final'?" in str(e.value)
    with pytest.raises(ProblemFileError, match=r"own\.jsonl:1: missing field 'talk' \(task\.messages_key\)"):
        load_problems(path, answer_key="solution.final", messages_key="talk")
    with pytest.raises(ProblemFileError, match=r"field 'question' \(task\.messages_key\) must be a list of chat"):
        load_problems(path, answer_key="solution.final", messages_key="question")
    with pytest.raises(ProblemFileError, match=r"own\.jsonl:1: no prompt field found .*set task\.prompt_key"):
        load_problems(path)


def test_parquet_with_its_own_field_names(tmp_path):
    import pyarrow as pa  # a core dependency: the configs that read parquet need it
    import pyarrow.parquet as pq

    path = tmp_path / "own.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "1+1?", "gold": "2"}, {"q": "2+2?", "gold": "4"}]), path)
    cfg = files_config(path, "task.prompt_key=q", "task.answer_key=gold")
    from async_vapo.tasks import load_task

    assert [(p.prompt, p.answer, p.meta["row"]) for p in load_task(cfg)[0]] == [("1+1?", "2", 1), ("2+2?", "4", 2)]
    with pytest.raises(ProblemFileError, match=r"own\.parquet: row 1: missing field 'question' .*\['gold', 'q'\]"):
        load_problems(path, prompt_key="question", answer_key="gold")


def test_a_path_that_is_no_problem_file(tmp_path):
    with pytest.raises(ProblemFileError, match=r"nope\.jsonl: no such file or directory"):
        load_problems(tmp_path / "nope.jsonl")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ProblemFileError, match="folder: a directory, but not a dataset written by datasets' "
                                               "save_to_disk"):
        load_problems(tmp_path / "folder")


def test_an_hf_dataset_saved_to_disk(tmp_path):
    datasets = pytest.importorskip("datasets")

    data = datasets.Dataset.from_list([{"question": r["question"], "gold": str(r["solution"]["final"]),
                                        "chat": r["chat"]} for r in OWN_FIELDS])
    data.save_to_disk(str(tmp_path / "ds"))
    problems = load_problems(tmp_path / "ds", prompt_key="question", answer_key="gold", messages_key="chat")
    assert [(p.prompt, p.answer, p.meta["row"]) for p in problems] == [("What is 2+3?", "5", 1),
                                                                       ("What is 4*4?", "16", 2)]
    assert problems[0].messages == (("system", "Be brief."), ("user", "2+3?"))
    with pytest.raises(ProblemFileError, match=r"ds: row 1: missing field 'answer' \(task\.answer_key\); the fields "
                                               r"found: \['chat', 'gold', 'question'\]"):
        load_problems(tmp_path / "ds", prompt_key="question", answer_key="answer")
    datasets.DatasetDict({"train": data, "test": data}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ProblemFileError, match=r"dd: a dataset with splits \['test', 'train'\]"):
        load_problems(tmp_path / "dd", prompt_key="question", answer_key="gold")
    assert len(load_problems(tmp_path / "dd" / "train", prompt_key="question", answer_key="gold")) == 2
