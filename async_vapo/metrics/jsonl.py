"""The run's JSON-lines logs (``metrics.jsonl``, ``samples.jsonl``).

One JSON object per line, each appended with a single ``write(2)`` on an ``O_APPEND`` descriptor, so
several processes (the cluster's learner writes pretrain/train rows, rollout 0 eval rows) can share one
file without interleaving inside a line (rows are far below the size where that could happen).

Every line is strict JSON (RFC 8259): a float that is not finite is written as ``null``. A metric is NaN when it
is undefined for that step (the critic's explained variance of returns that do not vary); Python's ``json``
would write the token ``NaN``, which jq, JavaScript, Go and most JSON readers other than Python's reject. Readers
take ``null`` as "no value at this step" (the plots draw a gap).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

PathLike = str | Path


def strict_json(value: Any) -> Any:
    """``value`` with every non-finite float (in nested dicts and lists too) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


class JsonlWriter:
    """Appends rows to ``path`` (created with its parents); ``truncate`` empties an existing file first."""

    def __init__(self, path: Path, *, truncate: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(path, flags, 0o644)

    def write(self, row: dict) -> None:
        os.write(self._fd, (json.dumps(strict_json(row), allow_nan=False) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_metrics(run: PathLike) -> list[dict[str, Any]]:
    """Rows of ``<run>/metrics.jsonl`` (``run`` may also be the file itself); a last line still being written (no
    newline, not JSON yet) is left out.

    Raises FileNotFoundError / ValueError naming the file when it is missing, empty or not JSON lines."""
    path = Path(run)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    rows = []
    lines = path.read_text().splitlines(keepends=True)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if lineno == len(lines) and not line.endswith("\n"):
                break  # a run still being written: its last line may be half flushed
            raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from e
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} is empty: the run has not logged anything yet")
    return rows
