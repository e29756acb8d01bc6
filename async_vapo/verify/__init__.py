"""Answer verification: extract the final boxed answer and grade it in sandboxed workers.

``extract_boxed`` and ``check_answer`` are pure functions for trusted input. Model output goes
through ``VerifierPool``, which runs ``check_answer`` in resource-limited worker processes.

The sandbox names are loaded on first use: workers run ``python -m async_vapo.verify.sandbox``, and
an eager import here would load that module twice in every worker.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from async_vapo.verify.check import check_answer, normalize_answer
from async_vapo.verify.extract import extract_boxed

if TYPE_CHECKING:
    from async_vapo.verify.sandbox import REASONS, VerifierPool, VerifyResult, WorkerStartError

__all__ = [
    "REASONS",
    "VerifierPool",
    "VerifyResult",
    "WorkerStartError",
    "check_answer",
    "extract_boxed",
    "normalize_answer",
]

_SANDBOX_NAMES = frozenset({"REASONS", "VerifierPool", "VerifyResult", "WorkerStartError"})


def __getattr__(name: str) -> Any:
    if name in _SANDBOX_NAMES:
        from async_vapo.verify import sandbox

        return getattr(sandbox, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
