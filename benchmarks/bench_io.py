"""What the benchmark scripts share: writing their result file."""

from __future__ import annotations

import json
from pathlib import Path


def write_result(path: str | Path, doc: dict) -> None:
    """Write ``doc`` as indented JSON to ``path`` (its folder created) and say where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")
