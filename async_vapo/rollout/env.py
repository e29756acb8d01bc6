"""Environments of multi-turn rollouts: the model's turn goes in, an observation (or none), a reward and done come
out; the built-in ``python`` tool environment runs the model's code in the tool sandbox.

``rollout.env = "module:Class"`` (or ``"python"``) makes every sample of a lock-step generation a loop
(:func:`async_vapo.rollout.generate.generate_groups`): one environment per sample, ``reset(problem)`` once, then
after each model turn ``step(turn_text)``. An observation is rendered as the next turn of the conversation (the
tool turn of the chat template, or a fenced ``output`` block for a raw prompt), its tokens appended to the sample's
tokens, and the engine continues the same sequence; ``done`` (or a limit) ends the sample. Unset: today's single
turn, bit for bit.

Invariants
  * Token in, token out: a sample's tokens are exactly the ones the engine saw and produced, in order. A turn is
    appended as its own tokens (the chat template's delta for that turn alone); nothing earlier is tokenised again.
  * The environment's tokens are recorded in ``Trajectory.env_spans``: the learner trains on the model's tokens
    only, the environment's being part of the state (``async_vapo.types``).
  * Every limit (``rollout.env_max_turns``, ``env_tool_output_tokens``, ``max_response_tokens`` over the whole
    trajectory, ``env_tool_seconds``) ends in an observation (a tool that hangs or crashes, output cut short) or in
    the sample ending (finish reason ``length`` when the token budget runs out); never in an exception of the loop.
  * A tool call never reaches the verifier's grading pool: :class:`PythonToolEnv` starts a fresh sandbox per call
    (:func:`async_vapo.verify.tool_sandbox.run_python`).
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from async_vapo.tasks.task import Problem
from async_vapo.verify.tool_sandbox import (
    DEFAULT_BACKEND,
    ToolLimits,
    ToolSandboxUnavailable,
    run_python,
    unavailable_reason,
)

StepResult = tuple[str | None, float | None, bool]
"""``(observation, reward, done)``: the text of the next environment turn (None: none), the sample's reward (None:
the verifier grades the final model turn, as for a single-turn response) and whether the sample ends."""


@runtime_checkable
class Environment(Protocol):
    """What ``rollout.env`` names: one instance per sample, used by one thread.

    Optional attributes read after the sample ends (rows ``rollout/tool_*``): ``tool_calls``, ``tool_errors``,
    ``tool_seconds``."""

    def reset(self, problem: Problem) -> list[dict[str, str]] | None:
        """The first messages of the conversation (``task.prompt_format = "chat"``), or None for the task's own prompt.
        Every sample of a problem must start alike (a group shares its prompt)."""

    def step(self, text: str) -> StepResult:
        """The model's latest turn (its text, special tokens left out) -> :data:`StepResult`."""


@dataclass(frozen=True)
class EnvLimits:
    """The loop's limits (``rollout.env_*``); the whole trajectory's tokens are bounded by ``max_response_tokens``."""

    max_turns: int = 4
    """Model turns per sample; the last one is graded as it is."""
    tool_output_tokens: int = 256
    """Tokens of one observation's text; beyond them it is cut and says so."""


TRUNCATED_NOTE = "\n[output truncated]"

_CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)


def code_block(text: str) -> str | None:
    """The last fenced Python block of ``text`` (```` ```python ```` ... ```` ``` ````), or None."""
    blocks = _CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


PYTHON_TOOL = {"type": "function", "function": {
    "name": "python",
    "description": "Run a Python program in a sandbox and return what it prints (stdout, then stderr).",
    "parameters": {"type": "object", "required": ["code"],
                   "properties": {"code": {"type": "string", "description": "the Python program to run"}}}}}
"""The built-in tool as a chat template's ``tools=`` entry (the OpenAI function schema that Hermes-style templates
render into the system prompt)."""

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


class ToolCallError(ValueError):
    """A tool call that cannot be run (not JSON, another tool, no code): an observation, never a crash."""


def _json(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not JSON ({e.msg} at character {e.pos})") from None


def _python_code(call, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> str:
    """The code of one parsed call ``{"name": "python", "arguments": {"code": ...}}`` (``parameters`` in Llama's
    format; the arguments may be a JSON string of the object)."""
    if not isinstance(call, dict):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name = call.get("name")
    args = next((call[k] for k in args_keys if k in call), None)
    if name != "python":
        raise ToolCallError(f"unknown tool {name!r}: the one tool is 'python'")
    return _code_argument(args)


def _code_argument(args) -> str:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ToolCallError('the python tool takes {"code": "<program>"}')
    return args["code"]


def tool_call(text: str) -> str | None:
    """The code of the last Hermes-style tool call in ``text`` (``<tool_call>{"name": "python", "arguments":
    {"code": ...}}</tool_call>``, the format of Qwen2.5's template; the closing tag may be missing where generation
    stopped), or None without one. ``arguments`` may also be a JSON string of the object, as some models write it.
    Raises :class:`ToolCallError` for a call that is not a python call with its code."""
    calls = _TOOL_CALL.findall(text)
    return _python_code(_json(calls[-1])) if calls else None


LLAMA_PYTHON_TAG = "<|python_tag|>"


def llama_tool_call(text: str) -> str | None:
    """The code of a Llama 3.1-style tool call in ``text``, or None without one. After the last ``<|python_tag|>``
    (the turn then ends with ``<|eom_id|>``): a JSON call ``{"name": "python", "parameters": {"code": ...}}``, or
    else the program itself (the form of Llama's built-in code interpreter). Without the tag: a turn that is
    nothing but a JSON object naming the python tool, ``{"name": "python", "parameters": {...}}`` (Llama 3.1's
    custom-tool form; a JSON object naming anything else is an answer, not a call). Meta's prompt format:
    https://www.llama.com/docs/model-cards-and-prompt-formats/llama3_1/. Raises :class:`ToolCallError` for a tagged
    call that is not a python call with its code, or a bare one without its code."""
    if LLAMA_PYTHON_TAG in text:
        body = text.rsplit(LLAMA_PYTHON_TAG, 1)[1].strip()
        if body.startswith("{"):
            return _python_code(_json(body))
        if not body:
            raise ToolCallError("the tool call holds no code")
        return body + "\n"
    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            return None  # an answer written as text in braces, not a call
        if isinstance(call, dict) and call.get("name") == "python":
            return _python_code(call)
    return None


MISTRAL_TOOL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"


def mistral_tool_call(text: str) -> str | None:
    """The code of the last call after the last ``[TOOL_CALLS]`` in ``text`` (Mistral's tokenizers), or None
    without one: a JSON list of calls ``[{"name": "python", "arguments": {"code": ...}}]`` (or one object; tokenizer
    v3, Mistral-7B-Instruct-v0.3's template) or ``python[ARGS]{"code": ...}`` (tokenizer v11 and later, where a
    ``[CALL_ID]...`` may precede ``[ARGS]``). Raises :class:`ToolCallError` for a call that is not a python call
    with its code."""
    if MISTRAL_TOOL_CALLS not in text:
        return None
    body = text.rsplit(MISTRAL_TOOL_CALLS, 1)[1].strip()
    if MISTRAL_ARGS in body:
        name, args = body.split(MISTRAL_ARGS, 1)
        name = name.split("[CALL_ID]", 1)[0].strip()
        if name != "python":
            raise ToolCallError(f"unknown tool {name!r}: the one tool is 'python'")
        return _code_argument(_json(args.strip()))
    calls = _json(body)
    if isinstance(calls, list):
        if not calls:
            raise ToolCallError("the tool-call list is empty")
        calls = calls[-1]
    return _python_code(calls)


TOOL_CALL_FORMATS: dict[str, tuple[str, Callable[[str], str | None]]] = {
    "hermes": ("<tool_call>", tool_call),
    "llama": (LLAMA_PYTHON_TAG, llama_tool_call),
    "mistral": (MISTRAL_TOOL_CALLS, mistral_tool_call)}
"""The chat templates' own tool-call formats: name -> (the marker a template that uses it writes, the parser of a
model turn). Their markers are kept in the text of a model turn where they are special tokens
(:meth:`~async_vapo.rollout.generate.PromptEncoder.decode_turn`)."""
TOOL_MARKERS = ("<tool_call>", "</tool_call>", LLAMA_PYTHON_TAG, MISTRAL_TOOL_CALLS, MISTRAL_ARGS, "[CALL_ID]")


def template_tool_format(tokenizer) -> str | None:
    """The tool-call format of the tokenizer's chat template (a key of :data:`TOOL_CALL_FORMATS`: the one whose
    marker the template writes), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    return next((name for name, (marker, _) in TOOL_CALL_FORMATS.items() if marker in template), None)


def template_calls_tools(tokenizer) -> bool:
    """The tokenizer's chat template has a tool-call format of its own (:func:`template_tool_format`)."""
    return template_tool_format(tokenizer) is not None


def prompt_tools(cfg, tokenizer) -> list[dict] | None:
    """The ``tools=`` a run's chat prompts are rendered with: the python tool's description where ``rollout.env =
    "python"`` calls it in the template's own format (``env_tool_format`` naming the template's format, or "auto" on
    a template that has one); else None. Raises for a format the template does not write."""
    r = cfg.rollout
    if r.env != "python" or r.env_tool_format == "fenced" or cfg.task.prompt_format != "chat":
        return None
    own = template_tool_format(tokenizer)
    if r.env_tool_format != "auto" and r.env_tool_format != own:
        marker = TOOL_CALL_FORMATS[r.env_tool_format][0]
        has = "it has no tool-call format" if own is None else f"its tool-call format is {own!r}"
        raise ValueError(f'rollout.env_tool_format = "{r.env_tool_format}": the tokenizer\'s chat template never '
                         f'writes {marker} ({has}); use "fenced" or "auto"')
    return [PYTHON_TOOL] if own else None


class PythonToolEnv:
    """The built-in ``python`` environment: a tool call in the model's turn (a fenced Python block, or a chat
    template's own format, :data:`TOOL_CALL_FORMATS`: ``rollout.env_tool_format``) runs in a fresh tool sandbox
    (never the grading pool), its stdout, then its stderr, come back as the next turn; a turn without a call ends the
    sample and the verifier grades it. A call that fails (an exception, a timeout, a limit, a kill) is an observation
    too: its output and ``[status: ...]``; so is a tool call that cannot be run (``[tool call error: ...]``)."""

    def __init__(self, cfg=None, *, tool_seconds: float | None = None, backend: str = DEFAULT_BACKEND,
                 output_bytes: int = 4096, tool_format: str | None = None):
        seconds = tool_seconds if tool_seconds is not None else (cfg.rollout.env_tool_seconds if cfg else 5.0)
        reason = unavailable_reason(backend)
        if reason is not None:
            raise ToolSandboxUnavailable(f"rollout.env = 'python' runs model-written code in the tool sandbox, "
                                         f"which cannot run here: {reason}")
        self.backend = backend
        self.limits = ToolLimits(wall_s=seconds, cpu_s=max(1, math.ceil(seconds)), output_bytes=output_bytes)
        self.tool_format = tool_format or (cfg.rollout.env_tool_format if cfg else "auto")
        if self.tool_format not in ("auto", "fenced", *TOOL_CALL_FORMATS):
            raise ValueError(f"tool_format must be 'auto', 'fenced' or one of {sorted(TOOL_CALL_FORMATS)}, "
                             f"got {self.tool_format!r}")
        self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0

    def reset(self, problem: Problem) -> None:
        return None

    def code_of(self, text: str) -> str | None:
        """The code a turn asks to run (None: no tool call): its tool call in the named template format
        (:data:`TOOL_CALL_FORMATS`), or in ``auto`` the first of those formats that finds a call in the turn, else
        its last fenced Python block (``fenced``, ``auto``). Raises :class:`ToolCallError` for a tool call that
        cannot be run."""
        if self.tool_format in TOOL_CALL_FORMATS:
            return TOOL_CALL_FORMATS[self.tool_format][1](text)
        if self.tool_format == "auto":
            for _, parse in TOOL_CALL_FORMATS.values():
                code = parse(text)
                if code is not None:
                    return code
        return code_block(text)

    def step(self, text: str) -> StepResult:
        try:
            code = self.code_of(text)
        except ToolCallError as e:
            self.tool_calls += 1
            self.tool_errors += 1
            return f"[tool call error: {e}]", None, False
        if code is None:
            return None, None, True
        r = run_python(code, backend=self.backend, limits=self.limits)
        self.tool_calls += 1
        self.tool_errors += r.status != "ok"
        self.tool_seconds += r.seconds
        out = r.stdout + (("\n" if r.stdout and not r.stdout.endswith("\n") else "") + r.stderr if r.stderr else "")
        if r.truncated:
            out += TRUNCATED_NOTE
        if r.status != "ok":
            why = {"timeout": f"timeout after {self.limits.wall_s:g} s", "killed": f"killed by {r.signal}",
                   "error": f"exit code {r.exit_code}"}.get(r.status, r.status)
            out = f"{out.rstrip()}\n[status: {why}]".lstrip("\n")
        return out.rstrip("\n") or "[no output]", None, False


BUILTIN = {"python": PythonToolEnv}


def env_factory(spec: str, cfg=None) -> Callable[[], Environment]:
    """A function making one fresh environment per sample from ``rollout.env``: ``"python"`` or ``"module:Class"``
    (a class, or any callable, taking no argument or the config). The first instance is made here, so that a
    misnamed class or an environment that cannot run fails before any generation."""
    target = BUILTIN.get(spec)
    if target is None:
        module, sep, name = spec.partition(":")
        if not sep or not module or not name:
            raise ValueError(f"rollout.env must be 'python' or 'module:Class', got {spec!r}")
        target = getattr(importlib.import_module(module), name, None)
        if target is None:
            raise ValueError(f"rollout.env = {spec!r}: module {module!r} has no {name!r}")
    try:
        takes_cfg = bool(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        takes_cfg = False

    def make() -> Environment:
        env = target(cfg) if takes_cfg else target()
        if not isinstance(env, Environment):
            raise TypeError(f"rollout.env = {spec!r} made a {type(env).__name__}, which has no reset and step")
        return env

    make()
    return make


@dataclass(frozen=True)
class EnvRunner:
    """What a generation needs to run environments: the factory and the limits."""

    make: Callable[[], Environment]
    limits: EnvLimits
    first_turn_prefix: str = ""
    """``rollout.env_first_turn_prefix``: text that ends every prompt, opening the model's first turn; the
    environment's first step gets it before the turn's text."""

    @classmethod
    def from_config(cls, cfg) -> EnvRunner | None:
        """The runner of ``cfg.rollout.env``; None when it is unset (single-turn generation)."""
        r = cfg.rollout
        if not r.env:
            return None
        return cls(env_factory(r.env, cfg), EnvLimits(max_turns=r.env_max_turns,
                                                      tool_output_tokens=r.env_tool_output_tokens),
                   r.env_first_turn_prefix)
