"""The problem record shared by every task.

A :class:`Problem` is what the rollout side turns into a prompt and what the verifier checks a
response against. ``uid`` is stable across processes and runs (a content hash, never Python's
salted ``hash``), so it can key replay entries, per-problem statistics and eval reports.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

UID_HEX_CHARS = 16
"""Hex digits kept from the SHA-256 of the prompt (64 bits: collisions negligible below ~10^9 prompts)."""


def prompt_uid(prompt: str) -> str:
    """Stable id of a prompt: the first :data:`UID_HEX_CHARS` hex digits of its UTF-8 SHA-256."""
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()[:UID_HEX_CHARS]


@dataclass(frozen=True)
class Problem:
    """One verifiable problem.

    ``answer`` is the reference final answer as a string (what ``\\boxed{...}`` should contain), or for
    ``task.answer = "solution"`` the whole reference solution (which ends in that box).
    ``meta`` is task-specific and informational (e.g. ``n_ops`` for arith, source row for files);
    it is excluded from ``hash`` so problems stay hashable although ``meta`` is a dict.
    """

    uid: str
    prompt: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict, hash=False)
    messages: tuple[tuple[str, str], ...] | None = None
    """The record's whole chat, as ``(role, content)`` pairs, when it came as a message list (DAPO-Math-17k,
    verl); ``prompt`` is then its last user message. ``task.prompt_format = "chat"`` renders all of it."""
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)
    """The record's fields a reward function may take besides the response and the answer (``data_source``,
    ``extra_info``, a tolerance...; ``async_vapo.verify.reward_fn``): JSON values, carried to the verifier in
    ``Group.extra``. Empty for generated tasks, and for files unless ``verifier.reward_fn`` is set."""

    def __post_init__(self) -> None:
        for name in ("uid", "prompt", "answer"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise TypeError(f"Problem.{name} must be str, got {type(value).__name__}: {value!r}")
