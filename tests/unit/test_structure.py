"""The package's structure holds by check, not by care: the layer contract (import-linter, pyproject.toml's
``[tool.importlinter]``, docs/concepts/layers.md) passes on the tree and fails on a copy with one import against the
grain; no function of the library is over 100 lines."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "async_vapo"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
MAX_FUNCTION_LINES = 100

pytestmark = pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (make setup)")


def _lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the package under ``root`` with the repository's contracts (no cache: a copy is new)."""
    return subprocess.run([str(LINT_IMPORTS), "--config", str(root / "pyproject.toml"), "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                            "PYTHONPATH": str(root)})


def _copy_tree(dst: Path) -> Path:
    """The package's Python files and pyproject.toml under ``dst`` (models and data left out: imports only)."""
    shutil.copytree(PACKAGE, dst / "async_vapo", ignore=shutil.ignore_patterns("shipped", "__pycache__"))
    shutil.copy(REPO / "pyproject.toml", dst / "pyproject.toml")
    return dst


def test_the_layer_contract_is_kept(tmp_path):
    r = _lint(_copy_tree(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    # a lower layer importing a higher one: the algorithm reaching into a service
    ("algo/gae.py", "import async_vapo.services.context", "layers"),
    # the weight client naming the rollout package (the engine interface lives in weights/)
    ("weights/client.py", "from async_vapo.rollout import engine", "layers"),
    # siblings of one layer import nothing of each other
    ("tasks/task.py", "import async_vapo.verify.extract", "layers"),
    # the launcher importing a service's runtime
    ("deploy/placement.py", "import async_vapo.services.context", "launcher"),
])
def test_an_import_against_the_grain_breaks_the_contract(tmp_path, module, bad_import, contract):
    root = _copy_tree(tmp_path)
    path = root / "async_vapo" / module
    path.write_text(path.read_text() + f"\n{bad_import}  # against the grain\n")
    r = _lint(root)
    assert r.returncode != 0, r.stdout
    assert "BROKEN" in r.stdout and bad_import.split()[1].split(".")[1] in r.stdout, r.stdout
    broken = {"layers": "async_vapo's layers, from the ground up BROKEN",
              "launcher": "never imports their runtime BROKEN"}[contract]
    assert broken in r.stdout, r.stdout


def test_a_new_top_level_module_must_be_placed(tmp_path):
    root = _copy_tree(tmp_path)
    (root / "async_vapo" / "newcomer.py").write_text('"""Not yet in a layer."""\n')
    r = _lint(root)
    assert r.returncode != 0 and "newcomer" in r.stdout + r.stderr, r.stdout + r.stderr


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function or method under ``root`` longer than ``limit`` lines, from its
    ``def`` (decorators left out) to its last line; paths relative to ``root``."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_library_function_is_over_100_lines():
    assert long_functions(PACKAGE) == []


def test_the_length_rule_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long.py").write_text(f"def long():\n{body}\n")
    (tmp_path / "short.py").write_text(f"def short():\n{body[:-len(body.splitlines()[-1]) - 1]}\n")
    assert long_functions(tmp_path) == [f"long.py:1 long ({MAX_FUNCTION_LINES + 1} lines)"]
