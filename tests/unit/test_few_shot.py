"""Own data as easy as the built-in task: worked examples (few-shot turns) before file prompts, from a file or from
the training split; task settings refused where they do nothing; the first evaluation's warning when responses hit
the cap."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from async_vapo.config import ConfigError, load_config, save_resolved
from async_vapo.rollout.generate import TRUNCATED_WARN_FRAC, PromptEncoder, warn_if_truncated
from async_vapo.tasks import ProblemFileError, load_task

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "models" / "smollm2-135m-instruct"


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture
def files(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [{"question": f"Tim has {i} cups. He buys 1 more. How many?",
                                               "final": i + 1} for i in range(2, 8)])
    held = _jsonl(tmp_path / "test.jsonl", [{"question": "Ann has 3 pens. She loses 1. How many?", "final": 2},
                                            {"question": "Bo has 5 cards. He finds 2 more. How many?", "final": 7}])
    return train, held


def _cfg(train, held, *extra: str):
    return load_config([], ["task.kind=files", f"task.train_path={train}", f"task.eval_path={held}",
                            "task.prompt_key=question", "task.answer_key=final", "task.prompt_format=chat", *extra])


def test_shots_from_a_file_come_before_each_question_after_the_system_prompt(tmp_path, files):
    shots = _jsonl(tmp_path / "shots.jsonl", [
        {"question": "Kim has 4 hats. She buys 3 more. How many?", "worked": "4 + 3 = 7.\nAnswer: 7"},
        {"question": "Lu has 9 mugs. He gives 2 away. How many?", "worked": "9 - 2 = 7.\nAnswer: 7"},
        {"question": "never taken: few_shot = 2", "worked": "Answer: 0"}])
    cfg = _cfg(*files, f"task.few_shot_path={shots}", "task.few_shot_solution_key=worked", "task.few_shot=2",
               "task.prompt_template=Q: {prompt}", "task.system_prompt=Be brief.")
    train, held = load_task(cfg)
    assert len(train) == 6 and len(held) == 2  # a shot file takes nothing from the splits
    turns = (("user", "Q: Kim has 4 hats. She buys 3 more. How many?"), ("assistant", "4 + 3 = 7.\nAnswer: 7"),
             ("user", "Q: Lu has 9 mugs. He gives 2 away. How many?"), ("assistant", "9 - 2 = 7.\nAnswer: 7"))
    for p in (*train, *held):
        assert p.messages == (*turns, ("user", f"Q: {p.prompt}"))
    assert held[0].prompt == "Ann has 3 pens. She loses 1. How many?" and held[0].answer == "2"
    if not SMOLLM2.is_dir():
        pytest.skip(f"{SMOLLM2} not imported (async-vapo import-gguf): the rendering is checked with its template")
    from transformers import AutoTokenizer

    text = PromptEncoder.from_config(cfg, AutoTokenizer.from_pretrained(str(SMOLLM2))).render(held[0])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nQ: Kim has 4 hats. She buys 3 more. How many?<|im_end|>\n"
                    "<|im_start|>assistant\n4 + 3 = 7.\nAnswer: 7<|im_end|>\n"
                    "<|im_start|>user\nQ: Lu has 9 mugs. He gives 2 away. How many?<|im_end|>\n"
                    "<|im_start|>assistant\n9 - 2 = 7.\nAnswer: 7<|im_end|>\n"
                    "<|im_start|>user\nQ: Ann has 3 pens. She loses 1. How many?<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_shots_and_a_records_own_system_message_stay_in_place(tmp_path):
    """Shot records as chat message lists (TRL's conversational layout); problems as verl message lists with their
    own system message: the shots go after it, before the question."""
    system = {"role": "system", "content": "Think."}
    train = _jsonl(tmp_path / "train.jsonl", [{"prompt": [system, {"role": "user", "content": f"{i}+1?"}],
                                               "answer": str(i + 1)} for i in range(3)])
    shots = _jsonl(tmp_path / "shots.jsonl", [{"messages": [{"role": "user", "content": "2+2?"},
                                                            {"role": "assistant", "content": "Answer: 4"}]}])
    cfg = load_config([], ["task.kind=files", f"task.train_path={train}", f"task.eval_path={train}",
                           "task.prompt_format=chat", f"task.few_shot_path={shots}"])
    train_set, _ = load_task(cfg)
    assert train_set[1].messages == (("system", "Think."), ("user", "2+2?"), ("assistant", "Answer: 4"),
                                     ("user", "1+1?"))
    assert cfg.task.shots == 1  # a shot source without few_shot: one worked example


def test_shots_from_the_training_split_leave_it(tmp_path, files):
    train, held = files
    records = [json.loads(x) for x in train.read_text().splitlines()]
    records[2]["worked"] = "4 + 1 = 5.\nAnswer: 5"
    records[4]["worked"] = "6 + 1 = 7.\nAnswer: 7"
    _jsonl(train, records)
    cfg = _cfg(train, held, "task.few_shot_solution_key=worked", "task.few_shot=2")
    train_set, held_set = load_task(cfg)
    shot_qs = [records[2]["question"], records[4]["question"]]
    assert [p.prompt for p in train_set] == [r["question"] for i, r in enumerate(records) if i not in (2, 4)]
    assert len(held_set) == 2
    for p in (*train_set, *held_set):
        assert p.messages == (("user", shot_qs[0]), ("assistant", records[2]["worked"]),
                              ("user", shot_qs[1]), ("assistant", records[4]["worked"]), ("user", p.prompt))
    with pytest.raises(ProblemFileError, match=r"train.jsonl: 2 training records with the field 'worked'"):
        load_task(_cfg(train, held, "task.few_shot_solution_key=worked", "task.few_shot=3"))
    # the held-out file is never a source of shots: when it is the training file, a shot would give an answer away
    with pytest.raises(ProblemFileError, match="is the held-out problem"):
        load_task(_cfg(train, train, "task.few_shot_solution_key=worked"))


@pytest.mark.parametrize(("lines", "fragment"), [
    (['{"question": "a?", "worked": "A"}', '{"question": "b?"}'], r"shots.jsonl:2: missing field 'worked'"),
    (['{"question": "a?", "worked": "A"}', "", "{oops"], r"shots.jsonl:3: invalid JSON"),
    (['{"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "a?"}]}'],
     r"shots.jsonl:1: field 'messages': a worked example holds user and assistant turns only"),
    (['{"messages": [{"role": "user", "content": "a?"}]}'], r"shots.jsonl:1: .* ends with the assistant's answer"),
    (['{"question": "a?", "worked": "A"}'], r"shots.jsonl: 1 worked example, but task.few_shot = 2"),
    (['{"question": "Ann has 3 pens. She loses 1. How many?", "worked": "Answer: 2"}', '{"question": "b?", '
      '"worked": "B"}'], r"shots.jsonl: a worked example is the held-out problem"),
])
def test_bad_shot_files_name_the_file_and_line(tmp_path, files, lines, fragment):
    shots = tmp_path / "shots.jsonl"
    shots.write_text("\n".join(lines) + "\n")
    key = [] if "messages" in lines[0] else ["task.few_shot_solution_key=worked"]
    with pytest.raises(ProblemFileError, match=fragment):
        load_task(_cfg(*files, f"task.few_shot_path={shots}", "task.few_shot=2", *key))


def test_a_question_record_without_a_named_solution_is_detected_or_named(tmp_path, files):
    shots = _jsonl(tmp_path / "shots.jsonl", [{"question": "a?", "completion": "Answer: 1"}])
    train, _ = load_task(_cfg(*files, f"task.few_shot_path={shots}"))
    assert train[0].messages[:2] == (("user", "a?"), ("assistant", "Answer: 1"))
    _jsonl(shots, [{"question": "a?", "reply": "Answer: 1"}])
    with pytest.raises(ProblemFileError, match="no worked answer found .* set task.few_shot_solution_key"):
        load_task(_cfg(*files, f"task.few_shot_path={shots}"))


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["task.few_shot=1"], "task.few_shot with kind='files' needs worked examples: set task.few_shot_path"),
    (["task.min_ops=2", "task.num_train=10"], "task.min_ops, task.num_train: the settings of a generated task do "
                                              "nothing for kind='files'"),
    (["task.seed=7"], "task.seed: the settings of a generated task"),
    (["task.few_shot_path=x.jsonl", "task.prompt_format=raw"], "need task.prompt_format = 'chat'"),
    (["task.system_prompt=Be brief.", "task.prompt_format=raw"], "task.system_prompt is a chat message"),
])
def test_file_task_settings_that_do_nothing_are_refused(files, overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _cfg(*files, *overrides)


@pytest.mark.parametrize(("overrides", "fragment"), [
    (["task.few_shot=1"], "task.few_shot does nothing for kind='arith'"),
    (["task.kind=wordprob", "task.max_ops=2", "task.few_shot=3"], "kind='wordprob' has 2 worked examples"),
    (["task.kind=wordprob", "task.max_ops=2", "task.few_shot_path=x.jsonl"], "task.few_shot_path is for kind='files'"),
    (["task.train_path=x.jsonl"], "task.train_path is for kind='files'"),
])
def test_generated_task_settings_that_do_nothing_are_refused(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config([], overrides)


def test_defaults_keep_loading_and_a_resolved_file_config_loads_again(tmp_path, files):
    cfg = _cfg(*files, "task.few_shot_solution_key=final")  # every default of the generated tasks left alone
    assert cfg.task.shots == 1 and load_config([], ["task.kind=wordprob", "task.max_ops=2"]).task.shots == 1
    assert load_config([], []).task.shots == 0
    resolved = save_resolved(cfg, tmp_path / "run")  # every field written, min_ops ... at their defaults
    assert load_config([resolved]).task == cfg.task


def test_truncation_warning_fires_above_ten_percent_and_names_the_settings(files, caplog):
    cfg = _cfg(*files, "rollout.max_response_tokens=64")
    with caplog.at_level(logging.WARNING, logger="async_vapo.rollout.generate"):
        assert warn_if_truncated({"eval/truncated_frac": TRUNCATED_WARN_FRAC}, cfg) is None  # at: silent
        assert warn_if_truncated({"eval/truncated_frac": 0.0}, cfg) is None
        assert not caplog.records
        text = warn_if_truncated({"eval/truncated_frac": 0.55}, cfg)
    assert caplog.records[-1].getMessage() == text
    assert text.startswith("55% of the held-out responses hit the 64-token cap")
    for setting in ("rollout.max_response_tokens", "task.few_shot with task.few_shot_path or "
                    "task.few_shot_solution_key", "task.system_prompt", "generation_config.json"):
        assert setting in text
    own = logging.getLogger("test.own")
    with caplog.at_level(logging.WARNING, logger="test.own"):
        warn_if_truncated({"eval/truncated_frac": 0.11}, cfg, own)
    assert caplog.records[-1].name == "test.own"
