"""Reward functions that take the prompt and the record's extra fields (issue 48, item 5): the loader reads the
fields, the wire carries them (``Group.extra``), the sandboxed worker calls ours, the keyword, verl's and TRL's forms.
"""

from __future__ import annotations

import json

import pytest

from async_vapo.tasks import ProblemFileError, load_problems
from async_vapo.tasks.files import MAX_EXTRA_BYTES, check_problems
from async_vapo.verify.reward_fn import RewardFnError, reward_call, score

VERL_RECORD = {"data_source": "gauge", "prompt": [{"role": "user", "content": "Read the gauge."}],
               "reward_model": {"ground_truth": "3.0", "style": "rule"}, "extra_info": {"index": 7, "tolerance": 0.5}}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------- the loader


def test_extra_fields_are_every_field_but_the_prompt_when_asked(tmp_path):
    path = _jsonl(tmp_path / "verl.jsonl", [VERL_RECORD])
    (p,) = load_problems(path, extra_keys=None)
    # the prompt (a message list) stays out; the answer's field and extra_info arrive whole, as verl keeps them
    assert dict(p.extra) == {"data_source": "gauge", "reward_model": {"ground_truth": "3.0", "style": "rule"},
                             "extra_info": {"index": 7, "tolerance": 0.5}}
    (p,) = load_problems(path, extra_keys=["data_source", "extra_info.tolerance"])
    assert dict(p.extra) == {"data_source": "gauge", "extra_info.tolerance": 0.5}
    (p,) = load_problems(path)  # the default: none (the maths check takes none)
    assert dict(p.extra) == {}


def test_extra_fields_missing_or_too_large_are_named_errors(tmp_path):
    path = _jsonl(tmp_path / "verl.jsonl", [VERL_RECORD, VERL_RECORD,
                                             {**VERL_RECORD, "notes": "x" * MAX_EXTRA_BYTES}])
    with pytest.raises(ProblemFileError, match=r"verl.jsonl:1: missing field 'extra_info.tolerence' "
                                               r"\(task.extra_keys\).*did you mean 'extra_info.tolerance'"):
        load_problems(path, extra_keys=["extra_info.tolerence"])
    problems, errors = check_problems(path, extra_keys=None)  # `async-vapo check` lists the third record
    assert len(problems) == 2 and len(errors) == 1
    assert errors[0].startswith(f"{path}:3: the record's extra fields take ")
    assert f"above the {MAX_EXTRA_BYTES} a problem carries to the verifier (largest: 'notes' " in errors[0]
    assert errors[0].endswith("name the fields the reward function takes in task.extra_keys")
    assert len(load_problems(path, extra_keys=["data_source"])) == 3  # selecting fields keeps the wire small


# ---------------------------------------------------------------------- the call forms, in this process


def ours(response, answer):
    return response == answer


def keywords(response, answer, *, prompt, tolerance=0.0):
    return 1.0 if "gauge" in prompt and abs(float(response) - float(answer)) <= tolerance else -1.0


def needs_field(response, answer, tolerance):
    return abs(float(response) - float(answer)) <= tolerance


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, as verl's custom reward functions have it."""
    if data_source == "gauge":
        return 1.0 if abs(float(solution_str) - float(ground_truth)) <= extra_info["tolerance"] else 0.0
    return 1.0 if solution_str == ground_truth else 0.0


def trl_reward(completions, prompts, **kwargs):
    """TRL's batched form: one float per completion, dataset columns as lists."""
    return [float(len(c) + len(kwargs["data_source"][0])) for c in completions]


def spread(response, answer, **fields):
    return float(len(fields))


def test_each_form_is_recognised_from_its_signature():
    assert [reward_call(f).form for f in (ours, keywords, needs_field, compute_score, trl_reward, spread)] == [
        "pair", "keywords", "keywords", "verl", "batched", "keywords"]
    with pytest.raises(RewardFnError, match=r"signature \(x\) fits no accepted form"):
        reward_call(lambda x: x)


def test_each_form_gets_the_prompt_and_the_record_fields():
    ctx = {"prompt": "Read the gauge.", "extra": json.dumps({"data_source": "gauge", "tolerance": 0.5,
                                                             "extra_info": {"tolerance": 0.25}})}
    assert score(ours, "3", "3", ctx) == ("scored", True, "")
    assert score(keywords, "3.4", "3", ctx) == ("scored", 1.0, "")  # the record's tolerance 0.5
    assert score(keywords, "3.4", "3", {"prompt": "Read the gauge."}) == ("scored", -1.0, "")  # its default 0
    assert score(compute_score, "3.2", "3", ctx) == ("scored", 1.0, "")  # extra_info's own tolerance 0.25
    assert score(compute_score, "3.4", "3", ctx) == ("scored", 0.0, "")
    assert score(trl_reward, "abc", "3", ctx) == ("scored", 8.0, "")  # 3 characters + len("gauge")
    assert score(spread, "a", "b", ctx) == ("scored", 4.0, "")  # the prompt and the three fields
    # a record without extra_info: verl's extra_info is the dict of its extra fields
    assert score(compute_score, "3.4", "3", {"extra": json.dumps({"data_source": "gauge", "tolerance": 0.5})}) == (
        "scored", 1.0, "")
    reason, _, detail = score(needs_field, "3", "3", {"extra": json.dumps({"data_source": "gauge"})})
    assert (reason, detail) == ("reward_error", "reward_fn needs 'tolerance', which this record does not hold "
                                                "(its extra fields: ['data_source']; task.extra_keys selects them)")
    reason, _, detail = score(lambda completions, **kw: 1.0, "a", "b")
    assert (reason, detail) == ("reward_error", "reward_fn (TRL form) returned float, not a one-float list")
