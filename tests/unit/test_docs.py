"""The documentation: references generated from the code are complete and current, the guide's example config
works, every benchmark plot is on a page, and the README stays short.

``mkdocs build --strict`` (run by ``make test`` after pytest) checks the links and the navigation; these tests check
what it cannot see.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _generator()


def test_every_config_key_has_a_description():
    missing = gen.undocumented_config()
    assert not missing, f"config keys without a docstring in async_vapo/config/schema.py: {missing}"


def test_every_metric_has_help():
    missing = gen.undocumented_metrics()
    assert not missing, f"metrics without help in async_vapo/metrics/catalogue.py: {missing}"


class _Inner(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    documented: int = Field(1, ge=0)
    """A documented field."""
    bare: str = "x"


class _Root(BaseModel):
    """A root with one section that has no description and a field without one."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    inner: _Inner = _Inner()
    top: bool = True


def test_the_description_check_finds_what_is_missing():
    assert gen.undocumented_config(_Root) == ["top", "inner", "inner.bare"]


def test_a_field_row_has_its_key_type_default_bounds_and_description():
    text = gen.config_page(_Root)
    assert "| `inner.documented` | `int` | `1` | ≥ 0 | A documented field. |" in text
    assert "| `top` | `bool` | `true` |  |  |" in text
    real = gen.config_page()
    assert "## `[cluster.weights]`" in real and "| `async.max_staleness` |" in real


def test_generated_pages_are_current():
    pages = gen.generate()
    assert set(pages) == {"reference/config.md", "reference/metrics.md", "reference/cli.md"}
    stale = gen.stale_pages(pages)
    assert not stale, f"stale generated pages {stale}: run make docs-gen and commit them"


def test_the_stale_check_sees_an_edited_or_missing_page(tmp_path):
    pages = gen.generate()
    for path, text in pages.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text, encoding="utf-8")
    assert gen.stale_pages(pages, tmp_path) == []
    (tmp_path / "reference/config.md").write_text(pages["reference/config.md"] + "an edit\n", encoding="utf-8")
    (tmp_path / "reference/cli.md").unlink()
    assert gen.stale_pages(pages, tmp_path) == ["reference/config.md", "reference/cli.md"]


def test_every_metric_and_command_is_on_its_page():
    from async_vapo.cli import build_parser
    from async_vapo.metrics.catalogue import CATALOGUE

    metrics = gen.metrics_page()
    for spec in CATALOGUE:
        name = f"async_vapo_<service>_{spec.name}" if spec.service == "all" else spec.full_name()
        assert f"`{name}`" in metrics
    cli = gen.cli_page()
    for name, _help, _sub in gen._subcommands(build_parser()):
        assert f"`async-vapo {name}`" in cli


def test_the_own_model_guide_example_loads():
    from async_vapo.config.loader import load_config
    from async_vapo.tasks.sampler import load_task

    example = DOCS / "examples" / "own_model.toml"
    assert '--8<-- "docs/examples/own_model.toml"' in (DOCS / "guides" / "own-model.md").read_text()
    cfg = load_config([example])
    assert cfg.task.kind == "files" and cfg.task.prompt_format == "chat"
    train, held_out = load_task(cfg)
    assert train and held_out and all(p.messages for p in train)  # verl layout: the message lists are kept


def test_every_benchmark_plot_is_on_a_page():
    shown = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.rglob("*.md"))
    plots = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "results").rglob("*.png"))
    assert plots
    missing = [p for p in plots if not re.search(rf"!\[[^\]]*\]\((\.\./)*{re.escape(p)}\)", shown)]
    assert not missing, f"plots shown on no docs page (add them to a page under docs/results/): {missing}"


def test_readme_is_short_and_names_the_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    assert "make test" in readme and "make cluster" in readme
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), f"README links to a missing page: {link}"


def test_the_command_reference_does_not_depend_on_the_terminal(monkeypatch):
    wide = gen.cli_page()
    monkeypatch.setenv("COLUMNS", "40")
    assert gen.cli_page() == wide


def test_every_file_the_pages_name_exists():
    named = re.compile(r"`((?:async_vapo|deploy|benchmarks|tests|configs|services|docs)/[^`\s]*)`")
    missing = []
    for page in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        for path in named.findall(page.read_text(encoding="utf-8")):
            path = path.split("::")[0].rstrip(".,:;")
            if not any(c in path for c in "{*<") and not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, f"pages name files that do not exist: {missing}"
