"""MkDocs hook: serve benchmarks/results/ (plots, tables, raw JSON) inside the site without copying it into docs/.

The results pages link to ``../benchmarks/results/...``; this hook adds those files to the site under the same
relative path, so ``mkdocs build --strict`` checks every link and every plot renders from the committed file.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "benchmarks/results"
SUFFIXES = {".png", ".md", ".json"}


def on_files(files: Files, config) -> Files:
    for path in sorted((ROOT / RESULTS).rglob("*")):
        if path.is_file() and path.suffix in SUFFIXES:
            rel = path.relative_to(ROOT).as_posix()
            files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
