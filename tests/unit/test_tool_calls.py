"""The python tool called in the chat template's own format (``rollout.env_tool_format``): Hermes-style
``<tool_call>`` JSON, Llama 3.1's ``<|python_tag|>`` and Mistral's ``[TOOL_CALLS]`` parsed into the code to run, a
call that cannot run answered by an observation, and the tool described to templates that have a tool-call format
(``tools=``). The templates below are written for this test in the shapes of Qwen2.5's (tools listed in the system
turn, calls in ``<tool_call>``, results in ``<tool_response>``), Llama 3.1's (``<|python_tag|>`` calls that end with
``<|eom_id|>``, results in an ``ipython`` turn) and Mistral-7B-Instruct-v0.3's (``[AVAILABLE_TOOLS]``,
``[TOOL_CALLS]``, results in ``[TOOL_RESULTS]`` with a nine-character call id)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.models.base_model import ensure_base_model
from async_vapo.rollout.env import (
    PYTHON_TOOL,
    PythonToolEnv,
    ToolCallError,
    llama_tool_call,
    mistral_tool_call,
    template_calls_tools,
    template_tool_format,
    tool_call,
)
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
LLAMA_TEMPLATE = (
    "<|begin_of_text|>{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "<|eot_id|>{% endif %}{%- for message in messages %}{%- if message.role in ('user', 'assistant') %}"
    "{% if message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>"
    "{{ message.tool_calls[0].function | tojson }}<|eom_id|>{% else %}<|start_header_id|>{{ message.role }}"
    "<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% elif message.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ message.content }}<|eot_id|>{% endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "<s>{%- for message in messages %}{%- if message.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS] "
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST] {{ message.content }}[/INST]"
    "{%- elif message.role == 'assistant' %}{% if message.tool_calls %}[TOOL_CALLS] {{ message.tool_calls | tojson }}"
    "{% else %}{{ message.content }}{% endif %}</s>{%- elif message.role == 'tool' %}"
    "{% if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '[TOOL_RESULTS] {"content": {{ message.content | tojson }}, "call_id": "{{ message.tool_call_id }}"}'
    "[/TOOL_RESULTS]{%- endif %}{%- endfor %}")
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


def test_llama_and_mistral_tool_call_parsing():
    code = {"code": "print(6 * 7)"}
    # Llama 3.1: the program after <|python_tag|> (its code interpreter), a JSON call after it, or a bare JSON call
    assert llama_tool_call("Let me compute.<|python_tag|>print(6 * 7)") == "print(6 * 7)\n"
    assert llama_tool_call("<|python_tag|>" + json.dumps({"name": "python", "parameters": code})) == "print(6 * 7)"
    assert llama_tool_call(json.dumps({"name": "python", "parameters": json.dumps(code)})) == "print(6 * 7)"
    assert llama_tool_call("<|python_tag|>print(1)<|python_tag|>print(2)") == "print(2)\n"  # the last call
    for text in ["The answer is 42.", '{"name": "calculator", "parameters": {}}', "{42}", "```python\nprint(1)\n```"]:
        assert llama_tool_call(text) is None  # no call: an answer, graded
    for text, why in [("<|python_tag|>", "no code"), ('<|python_tag|>{"name": "bash", "parameters": {}}', "unknown"),
                      ('<|python_tag|>{"name": "python", "parameters": {"src": "x"}}', "takes"),
                      ('<|python_tag|>{"name": "python", ', "not JSON"),
                      ('{"name": "python", "parameters": {"code": 1}}', "takes")]:
        with pytest.raises(ToolCallError, match=why):
            llama_tool_call(text)
    # Mistral: a JSON list after [TOOL_CALLS] (tokenizer v3; the last call of the list runs), or name[ARGS]{...}
    calls = [{"name": "python", "arguments": {"code": "print(1)"}, "id": "a1b2c3d4e"},
             {"name": "python", "arguments": code, "id": "f5g6h7i8j"}]
    assert mistral_tool_call("[TOOL_CALLS] " + json.dumps(calls)) == "print(6 * 7)"
    assert mistral_tool_call("[TOOL_CALLS]" + json.dumps(calls[0])) == "print(1)"  # one object
    assert mistral_tool_call("[TOOL_CALLS]python[ARGS]" + json.dumps(code)) == "print(6 * 7)"
    assert mistral_tool_call("[TOOL_CALLS]python[CALL_ID]a1b2c3d4e[ARGS]" + json.dumps(code)) == "print(6 * 7)"
    assert mistral_tool_call("The answer is 42.") is None
    for text, why in [("[TOOL_CALLS] []", "empty"), ("[TOOL_CALLS]bash[ARGS]{}", "unknown"),
                      ("[TOOL_CALLS] [{print(1)}]", "not JSON"), ("[TOOL_CALLS] [1]", "JSON object"),
                      ('[TOOL_CALLS]python[ARGS]{"src": "x"}', "takes")]:
        with pytest.raises(ToolCallError, match=why):
            mistral_tool_call(text)
    # each format runs its own calls only; "auto" runs any of them
    assert PythonToolEnv.code_of.__doc__ and PythonToolEnv(tool_format="llama").code_of(call("x")) is None
    assert PythonToolEnv(tool_format="hermes").code_of("<|python_tag|>print(1)") is None
    auto = PythonToolEnv(tool_format="auto")
    assert [auto.code_of(t) for t in ("<|python_tag|>print(1)", "[TOOL_CALLS]python[ARGS]" + json.dumps(code))] == [
        "print(1)\n", "print(6 * 7)"]
    with pytest.raises(ValueError, match="tool_format must be"):
        PythonToolEnv(tool_format="llama3")


def _tokenizer(tmp_path, template: str, specials: list[str], stops: list[str]):
    """The embedded character tokenizer with ``specials`` added as special tokens, ``template`` as its chat
    template and ``stops`` as its generation config's EOS ids, saved and loaded again as a model directory is."""
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat"])
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(cfg, progress=False)))
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.chat_template = template
    out = tmp_path / "tok"
    tok.save_pretrained(str(out))
    ids = tok.convert_tokens_to_ids(stops)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    return AutoTokenizer.from_pretrained(str(out))


def test_a_llama_turn_keeps_its_tag_and_its_eom_is_not_closed_again(tmp_path):
    """Llama's <|python_tag|> is a special token, dropped by the verifier's decode; the environment reads the turn
    with it. The call ends with <|eom_id|> where the template closes a turn with <|eot_id|>: the result's turn follows
    the model's <|eom_id|> directly (Meta's format), not after an <|eot_id|> the model never wrote."""
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
    tok = _tokenizer(tmp_path, LLAMA_TEMPLATE, specials, ["<|eot_id|>", "<|eom_id|>"])
    assert template_tool_format(tok) == "llama"
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python",
                                  "rollout.env_tool_format=llama"])
    enc = PromptEncoder.from_config(cfg, tok)
    assert enc.tools == [PYTHON_TOOL] and "Environment: ipython" in enc.render(Problem(uid="p", prompt="q", answer="1"))
    eom = tok.convert_tokens_to_ids("<|eom_id|>")
    assert eom in enc.stop_ids
    turn = tok("Iwillcompute.", add_special_tokens=False).input_ids + tok.convert_tokens_to_ids(["<|python_tag|>"]) + \
        tok("print(6*7)", add_special_tokens=False).input_ids + [eom]
    assert enc.decode(turn) == "Iwillcompute.print(6*7)"  # what the verifier reads: no tag
    assert enc.decode_turn(turn) == "Iwillcompute.<|python_tag|>print(6*7)"
    assert PythonToolEnv(tool_format="llama").code_of(enc.decode_turn(turn)) == "print(6*7)\n"
    assert tok.decode(enc.observation_ids("42", eom)) == (
        "<|start_header_id|>ipython<|end_header_id|>42<|eot_id|><|start_header_id|>assistant<|end_header_id|>")
    # a turn that ended with the template's own <|eot_id|> is not closed again either
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    assert tok.decode(enc.observation_ids("42", eot)).startswith("<|start_header_id|>ipython")
    # a format the template does not write is refused at start
    hermes = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python",
                                     "rollout.env_tool_format=hermes"])
    with pytest.raises(ValueError, match="never writes <tool_call>.*format is 'llama'"):
        PromptEncoder.from_config(hermes, tok)


def test_a_mistral_result_comes_back_in_its_tool_results_turn(tmp_path):
    """Mistral's template refuses a tool turn without a nine-character call id; the observation's turn is rendered
    with one, in [TOOL_RESULTS], rather than falling back to a user turn."""
    tok = _tokenizer(tmp_path, MISTRAL_TEMPLATE, ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                                  "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], ["<eos>"])
    assert template_tool_format(tok) == "mistral"
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "task.prompt_format=chat", "rollout.env=python"])
    enc = PromptEncoder.from_config(cfg, tok)  # "auto": the template's format
    assert enc.tools == [PYTHON_TOOL]
    assert enc.render(Problem(uid="p", prompt="q", answer="1")).startswith("<s>[AVAILABLE_TOOLS]")
    turn = tok.convert_tokens_to_ids(["[TOOL_CALLS]"]) + tok('[{"name":"python","arguments":{"code":"print(6*7)"}}]',
                                                             add_special_tokens=False).input_ids
    assert PythonToolEnv(tool_format="auto").code_of(enc.decode_turn(turn)) == "print(6*7)"
    obs = tok.decode(enc.observation_ids("42", None))
    assert obs.startswith("</s>[TOOL_RESULTS]") and '"42"' in obs and obs.endswith("[/TOOL_RESULTS]"), obs
