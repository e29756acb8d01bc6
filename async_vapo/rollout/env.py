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


def tool_call(text: str) -> str | None:
    """The code of the last Hermes-style tool call in ``text`` (``<tool_call>{"name": "python", "arguments":
    {"code": ...}}</tool_call>``; the closing tag may be missing where generation stopped), or None without one.
    ``arguments`` may also be a JSON string of the object, as some models write it. Raises :class:`ToolCallError`
    for a call that is not a python call with its code."""
    calls = _TOOL_CALL.findall(text)
    if not calls:
        return None
    try:
        call = json.loads(calls[-1])
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(call, dict):
        raise ToolCallError('a tool call is a JSON object {"name": ..., "arguments": {...}}')
    name, args = call.get("name"), call.get("arguments", call.get("parameters"))
    if name != "python":
        raise ToolCallError(f"unknown tool {name!r}: the one tool is 'python'")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = None
    if not isinstance(args, dict) or not isinstance(args.get("code"), str):
        raise ToolCallError('the python tool takes {"code": "<program>"}')
    return args["code"]


def template_calls_tools(tokenizer) -> bool:
    """The tokenizer's chat template has a Hermes-style tool-call format (it writes ``<tool_call>``)."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "<tool_call>" in template


def prompt_tools(cfg, tokenizer) -> list[dict] | None:
    """The ``tools=`` a run's chat prompts are rendered with: the python tool's description where ``rollout.env =
    "python"`` calls it in the template's own format (``env_tool_format`` "hermes", or "auto" on a template that
    has one); else None. Raises for "hermes" on a template without a tool-call format."""
    r = cfg.rollout
    if r.env != "python" or r.env_tool_format == "fenced" or cfg.task.prompt_format != "chat":
        return None
    if template_calls_tools(tokenizer):
        return [PYTHON_TOOL]
    if r.env_tool_format == "hermes":
        raise ValueError('rollout.env_tool_format = "hermes": the tokenizer\'s chat template has no tool-call format '
                         '(it never writes <tool_call>); use "fenced" or "auto"')
    return None


class PythonToolEnv:
    """The built-in ``python`` environment: a tool call in the model's turn (a fenced Python block, or the chat
    template's own ``<tool_call>`` format: ``rollout.env_tool_format``) runs in a fresh tool sandbox (never the
    grading pool), its stdout, then its stderr, come back as the next turn; a turn without a call ends the sample and
    the verifier grades it. A call that fails (an exception, a timeout, a limit, a kill) is an observation too: its
    output and ``[status: ...]``; so is a tool call that cannot be run (``[tool call error: ...]``)."""

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
        if self.tool_format not in ("auto", "fenced", "hermes"):
            raise ValueError(f"tool_format must be 'auto', 'fenced' or 'hermes', got {self.tool_format!r}")
        self.tool_calls = self.tool_errors = 0
        self.tool_seconds = 0.0

    def reset(self, problem: Problem) -> None:
        return None

    def code_of(self, text: str) -> str | None:
        """The code a turn asks to run (None: no tool call): its last tool call in the template's format (``hermes``,
        ``auto``) or its last fenced Python block (``fenced``, ``auto`` without a tool call). Raises
        :class:`ToolCallError` for a tool call that cannot be run."""
        if self.tool_format != "fenced":
            code = tool_call(text)
            if code is not None or self.tool_format == "hermes":
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
