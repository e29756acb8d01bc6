"""Prompts: the chat template over a record's whole message list (DAPO-Math-17k / verl layout), an optional
system prompt, and the raw format with prompt_template; a chat format without a template is refused."""

from __future__ import annotations

import json

import pytest
from test_answer_formats import DAPO_PROMPT

from async_vapo.models.tiny import build_char_tokenizer
from async_vapo.rollout.generate import PromptEncoder
from async_vapo.tasks import Problem, load_problems

# A ChatML-like template, written here (a real instruct model's tokenizer_config.json carries its own).
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture
def tok():
    t = build_char_tokenizer()
    t.chat_template = TEMPLATE
    return t


def test_a_verl_record_keeps_its_whole_chat(tmp_path, tok):
    problem = "What is 9 * 3?"
    record = {"prompt": [{"role": "system", "content": "Think step by step."},
                         {"role": "user", "content": DAPO_PROMPT.format(problem=problem)}],
              "reward_model": {"ground_truth": "27"}, "extra_info": {"index": "a1"}}
    path = tmp_path / "dapo.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (p,) = load_problems(path)
    assert p.prompt == DAPO_PROMPT.format(problem=problem) and p.answer == "27" and p.uid == "a1"
    assert p.messages == (("system", "Think step by step."), ("user", DAPO_PROMPT.format(problem=problem)))
    enc = PromptEncoder(tok, prompt_format="chat", system_prompt="ignored: the record has its own")
    text = enc.render(p)
    assert text == (f"<|system|>Think step by step.<|end|>\n<|user|>{DAPO_PROMPT.format(problem=problem)}<|end|>\n"
                    "<|assistant|>")
    assert enc(p) == tok(text, add_special_tokens=False).input_ids


def test_a_plain_problem_in_chat_format_gets_the_system_prompt_and_the_template(tok):
    p = Problem(uid="u", prompt="1+2=", answer="3")
    enc = PromptEncoder(tok, "Q: {prompt}", prompt_format="chat", system_prompt="Be brief.")
    assert enc.render(p) == "<|system|>Be brief.<|end|>\n<|user|>Q: 1+2=<|end|>\n<|assistant|>"
    raw = PromptEncoder(tok, "Q: {prompt}")
    assert raw.render(p) == "Q: 1+2=" and raw(p) == tok("Q: 1+2=").input_ids


def test_chat_without_a_template_is_refused():
    with pytest.raises(ValueError, match="no chat template"):
        PromptEncoder(build_char_tokenizer(), prompt_format="chat")


def test_malformed_messages_name_the_record(tmp_path):
    from async_vapo.tasks import ProblemFileError

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": "x"}, {"role": "wizard", "content": "y"}],
                                "answer": "1"}) + "\n")
    with pytest.raises(ProblemFileError, match="bad.jsonl:1.*message 1"):
        load_problems(path)


def test_stop_tokens_come_from_the_tokenizer_and_the_generation_config(tmp_path, tok):
    from async_vapo.rollout.generate import stop_token_ids

    assert PromptEncoder(tok).stop_ids == [tok.eos_token_id]  # no generation config: the tokenizer's EOS
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, tok.eos_token_id, 9]}))
    assert stop_token_ids(tok, str(tmp_path)) == [tok.eos_token_id, 7, 9]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert stop_token_ids(tok, str(tmp_path)) == [tok.eos_token_id, 5]
