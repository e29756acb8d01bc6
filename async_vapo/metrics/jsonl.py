"""The run's JSON-lines logs (``metrics.jsonl``, ``samples.jsonl``).

One JSON object per line, each appended with a single ``write(2)`` on an ``O_APPEND`` descriptor, so
several processes (the cluster's learner writes pretrain/train rows, rollout 0 eval rows) can share one
file without interleaving inside a line (rows are far below the size where that could happen).
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class JsonlWriter:
    """Appends rows to ``path`` (created with its parents); ``truncate`` empties an existing file first."""

    def __init__(self, path: Path, *, truncate: bool = False):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if truncate else 0)
        self._fd = os.open(path, flags, 0o644)

    def write(self, row: dict) -> None:
        os.write(self._fd, (json.dumps(row) + "\n").encode())

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
