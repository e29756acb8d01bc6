"""Worked examples (few-shot turns) in front of file prompts: ``task.few_shot_path`` or the training split.

A shot is a user turn and the assistant's worked answer. :func:`with_shots` puts the shots before each problem's
question, after a system message that opens the problem's own chat (``task.system_prompt`` is put first by the
prompt encoder, so a system prompt stays first in every case). A problem without a message list becomes one: its user
turn is ``task.prompt_template`` filled with its prompt, as the encoder would make it.

Where shots come from (:func:`load_shots`):

* ``task.few_shot_path``: a file read as problem files are (``async_vapo.tasks.files``), one shot per record: a chat
  message list (the field ``task.messages_key`` names, else ``messages``) of user and assistant turns that ends with
  the assistant's answer, kept as it is; or a question (``task.prompt_key``, else detected as for problems), written
  into ``prompt_template``, and its worked answer (``task.few_shot_solution_key``, else the first of
  :data:`SOLUTION_KEYS`). The first ``task.few_shot`` records are taken; a bad one is an error naming its file and line.
* without a file, the first ``task.few_shot`` records of the training file that have ``task.few_shot_solution_key``:
  those records leave the training set. The held-out file is never read for shots.

Invariant: no shot's question is a held-out problem's prompt (a shot file that holds one is refused): a worked
example of a held-out problem would give its answer away.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from async_vapo.tasks.files import (
    _MISSING,
    PROMPT_KEYS,
    ProblemFileError,
    _detect,
    _field,
    _get,
    _messages,
    _prompt_text,
    _records,
)
from async_vapo.tasks.task import Problem

SOLUTION_KEYS = ("solution", "completion", "response")
"""Worked-answer fields tried in order when ``task.few_shot_solution_key`` is not given (TRL's prompt-completion
layout names it ``completion``)."""
MESSAGES_KEY = "messages"
"""The chat field of a shot record when ``task.messages_key`` is not given (TRL's conversational layout)."""

Turns = tuple[tuple[str, str], ...]


def _chat_shot(value: Any, key: str, where: str) -> Turns:
    turns = _messages(value, key, where)
    if turns is None:
        raise ProblemFileError(f"{where}: field {key!r} must be a list of chat messages, got {type(value).__name__}")
    if any(role == "system" for role, _ in turns):
        raise ProblemFileError(f"{where}: field {key!r}: a worked example holds user and assistant turns only; a "
                               "system message goes first in every chat: set task.system_prompt")
    if not turns or turns[0][0] != "user" or turns[-1][0] != "assistant":
        raise ProblemFileError(f"{where}: field {key!r}: a worked example starts with a user turn and ends with the "
                               f"assistant's answer, got roles {[r for r, _ in turns]}")
    if any(not content.strip() for _, content in turns):
        raise ProblemFileError(f"{where}: field {key!r}: a turn is empty")
    return turns


def _solution(record: Mapping[str, Any], key: str, setting: str, where: str) -> str:
    value = _field(record, key, setting, where)
    if not isinstance(value, str) or not value.strip():
        raise ProblemFileError(f"{where}: field {key!r} ({setting}) must be a non-empty str, got {value!r}"[:300])
    return value


def _question_shot(record: Mapping[str, Any], prompt_key: str | None, solution_key: str | None, template: str,
                   where: str) -> Turns:
    key = prompt_key or _detect(record, PROMPT_KEYS, "prompt", where)
    question = _prompt_text(_field(record, key, "task.prompt_key" if prompt_key else "detected", where), key, where)
    if solution_key is not None:
        answer = _solution(record, solution_key, "task.few_shot_solution_key", where)
    else:
        found = next((k for k in SOLUTION_KEYS if _get(record, k) is not _MISSING), None)
        if found is None:
            raise ProblemFileError(f"{where}: no worked answer found (looked for {', '.join(map(repr, SOLUTION_KEYS))} "
                                   f"and a {MESSAGES_KEY!r} chat; the record's fields: {sorted(record)}); set "
                                   "task.few_shot_solution_key to name it")
        answer = _solution(record, found, "detected", where)
    return (("user", template.format(prompt=question)), ("assistant", answer))


def load_shots(path: str | Path, count: int, *, template: str = "{prompt}", prompt_key: str | None = None,
               messages_key: str | None = None, solution_key: str | None = None) -> Turns:
    """The turns of the first ``count`` worked examples of ``path`` (module docstring), in file order."""
    path = Path(path)
    turns: list[tuple[str, str]] = []
    taken = 0
    chat_key = messages_key or MESSAGES_KEY
    for _, where, record in _records(path):
        if taken == count:
            break
        if not isinstance(record, Mapping):
            raise ProblemFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if isinstance(_get(record, chat_key), list):
            turns += _chat_shot(_get(record, chat_key), chat_key, where)
        else:
            turns += _question_shot(record, prompt_key, solution_key, template, where)
        taken += 1
    if taken < count:
        raise ProblemFileError(f"{path}: {taken} worked example{'s' * (taken != 1)}, but task.few_shot = {count}")
    return tuple(turns)


def shots_from_train(problems: Sequence[Problem], path: str | Path, count: int, solution_key: str, *,
                     template: str = "{prompt}") -> tuple[Turns, list[Problem]]:
    """The first ``count`` training records of ``path`` that have ``solution_key``, as shot turns (each record's
    problem and its worked answer), and ``problems`` without them (matched by the record's row)."""
    path = Path(path)
    rows: dict[int, str] = {}
    for row, where, record in _records(path):
        if len(rows) == count:
            break
        if isinstance(record, Mapping) and _get(record, solution_key) is not _MISSING:
            rows[row] = _solution(record, solution_key, "task.few_shot_solution_key", where)
    if len(rows) < count:
        raise ProblemFileError(f"{path}: {len(rows)} training record{'s' * (len(rows) != 1)} with the field "
                               f"{solution_key!r} (task.few_shot_solution_key), but task.few_shot = {count}")
    chosen = {p.meta["row"]: p for p in problems if p.meta.get("row") in rows}
    turns: list[tuple[str, str]] = []
    for row, answer in rows.items():
        p = chosen[row]
        question = [c for r, c in p.messages if r == "user"] if p.messages else [template.format(prompt=p.prompt)]
        turns += [("user", question[-1]), ("assistant", answer)]
    rest = [p for p in problems if p.meta.get("row") not in rows]
    if not rest:
        raise ProblemFileError(f"{path}: every training record became a worked example (task.few_shot = {count})")
    return tuple(turns), rest


def with_shots(problems: Iterable[Problem], shots: Turns, template: str = "{prompt}") -> list[Problem]:
    """``problems`` with ``shots`` before each one's question (module docstring); the uid and prompt unchanged."""
    if not shots:
        return list(problems)
    out = []
    for p in problems:
        own = p.messages or (("user", template.format(prompt=p.prompt)),)
        head = own[:1] if own[0][0] == "system" else ()
        out.append(dataclasses.replace(p, messages=head + shots + own[len(head):]))
    return out


def check_held_out(shots: Turns, held_out: Sequence[Problem], where: str, template: str = "{prompt}") -> None:
    """Refuse shots whose question is a held-out problem's (its prompt, templated or not, or its last user turn)."""
    questions = {c for r, c in shots if r == "user"}
    for p in held_out:
        user = [c for r, c in p.messages if r == "user"][-1:] if p.messages else []
        if {p.prompt, template.format(prompt=p.prompt), *user} & questions:
            raise ProblemFileError(f"{where}: a worked example is the held-out problem {p.uid!r} "
                                   f"({p.meta.get('path', '')}, row {p.meta.get('row', '?')}): it would give its "
                                   "answer away")
