"""The python tool called in the chat template's own format (``rollout.env_tool_format``): Hermes-style
``<tool_call>`` JSON parsed into the code to run, a call that cannot run answered by an observation, and the tool
described to templates that have a tool-call format (``tools=``). The template below is written for this test in the
shape of Qwen2.5's (tools listed in the system turn, calls in ``<tool_call>``, results in ``<tool_response>``)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.models.base_model import ensure_base_model
from async_vapo.rollout.env import PYTHON_TOOL, PythonToolEnv, ToolCallError, template_calls_tools, tool_call
from async_vapo.rollout.generate import PromptEncoder
from async_vapo.tasks.task import Problem
from async_vapo.verify.tool_sandbox import DEFAULT_BACKEND, unavailable_reason

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}\n\n# Tools\n\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags.<|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}{%- if message.role in ('user', 'assistant') %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PLAIN_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12"]


def call(code: str, name: str = "python", *, string_args: bool = False, close: bool = True) -> str:
    args = json.dumps({"code": code}) if string_args else {"code": code}
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n" + ("</tool_call>" if close else "")


def test_tool_call_parsing():
    assert tool_call("I will compute it.\n" + call("print(123 * 45)")) == "print(123 * 45)"
    assert tool_call(call("print(1)", string_args=True)) == "print(1)"  # arguments as a JSON string
    assert tool_call(call("print(2)", close=False)) == "print(2)"  # generation stopped before the closing tag
    assert tool_call(call("print(1)") + " then " + call("print(3)")) == "print(3)"  # the last call
    assert tool_call("no call here\n```python\nprint(1)\n```") is None
    for text, why in [("<tool_call>{print(1)}</tool_call>", "not JSON"), (call("x", name="bash"), "unknown tool"),
                      ('<tool_call>{"name": "python", "arguments": {"src": "x"}}</tool_call>', "takes"),
                      ("<tool_call>[1, 2]</tool_call>", "JSON object")]:
        with pytest.raises(ToolCallError, match=why):
            tool_call(text)


@pytest.mark.skipif(unavailable_reason(DEFAULT_BACKEND) is not None, reason="the tool sandbox cannot run here")
def test_each_format_runs_its_own_calls_and_a_bad_call_is_an_observation():
    fenced = "```python\nprint(6 * 7)\n```"
    hermes = call("print(6 * 7)")
    assert PythonToolEnv(tool_format="fenced").code_of(hermes) is None
    assert PythonToolEnv(tool_format="hermes").code_of(fenced) is None
    auto = PythonToolEnv(tool_format="auto")
    assert auto.code_of(fenced) == auto.code_of(hermes).rstrip() + "\n"
    env = PythonToolEnv(tool_format="hermes")
    assert env.step(hermes) == ("42", None, False)
    obs, reward, done = env.step("<tool_call>{\"name\": \"python\", \"arguments\": {\"code\": 1}}</tool_call>")
    assert obs.startswith("[tool call error:") and reward is None and not done  # the model may try again
    assert (env.tool_calls, env.tool_errors) == (2, 1)
    assert env.step("The answer is 42.") == (None, None, True)


def test_the_tool_is_described_to_a_template_that_calls_tools(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python"])
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(cfg, progress=False)))
    problem = Problem(uid="p", prompt="What is 123 * 45?", answer="5535")
    tok.chat_template = HERMES_TEMPLATE
    assert template_calls_tools(tok)
    enc = PromptEncoder.from_config(cfg, tok)
    assert enc.tools == [PYTHON_TOOL]
    text = enc.render(problem)
    assert json.dumps(PYTHON_TOOL) in text and text.endswith("<|im_start|>assistant\n")
    # the tool's result comes back in the template's tool turn (this character tokenizer has no newline)
    assert "<tool_response>42</tool_response>" in tok.decode(enc.observation_ids("42", None)).replace("\n", "")
    fenced = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python",
                                     "rollout.env_tool_format=fenced"])
    assert PromptEncoder.from_config(fenced, tok).tools is None
    # a template without a tool-call format: nothing to describe in "auto", refused in "hermes"
    tok.chat_template = PLAIN_TEMPLATE
    assert not template_calls_tools(tok) and PromptEncoder.from_config(cfg, tok).tools is None
    hermes = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python",
                                     "rollout.env_tool_format=hermes"])
    with pytest.raises(ValueError, match="no tool-call format"):
        PromptEncoder.from_config(hermes, tok)
