"""The documentation: references generated from the code are complete and current, the guide's example config
works, every benchmark plot is on a page, and the README stays short.

``mkdocs build --strict`` (run by ``make test`` after pytest) checks the links and the navigation; these tests check
what it cannot see.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
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
    assert set(pages) == {"reference/config.md", "reference/metrics.md", "reference/cli.md", "results/index.md"}
    stale = gen.stale_pages(pages)
    assert not stale, f"stale generated pages {stale}: run make docs-gen and commit them"
    assert not gen.readme_is_stale(), "README.md's results table is stale: run make docs-gen and commit it"


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


def test_every_headline_figure_is_on_both_pages_as_its_file_gives_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    index = (DOCS / "results" / "index.md").read_text(encoding="utf-8")
    rows = gen.figure_rows()
    assert len(rows) >= 12
    for row in rows:
        assert row["text"] in readme and row["text"] in index, f"{row['result']}: {row['text']}"


def _tiny_results(tmp_path, accuracy):
    run = tmp_path / "benchmarks" / "results" / "run"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"final": accuracy, "seeds": [{"seed": 0}, {"seed": 1}]}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"kind": "eval", "step": 0, "acc": 0.25}, {"kind": "train", "step": 1, "acc": 0.9},
        {"kind": "eval", "step": 10, "acc": 0.5})))
    table = tmp_path / "figures.toml"
    table.write_text('''[[row]]
result = "a run"
page = "run.md"
title = "Run"
commands = ["bash run.sh"]
figure = "{first} % → {final} % (peak {peak} %, {seeds} seeds, {delta})"
[row.values]
final = {file = "benchmarks/results/run/summary.json", key = ["final"], scale = 100, format = ".1f"}
seeds = {file = "benchmarks/results/run/summary.json", key = ["seeds", "*"], reduce = "count", format = "d"}
delta = {file = "benchmarks/results/run/summary.json", key = ["final"], scale = -1, format = "+.2f"}
[row.values.first]
file = "benchmarks/results/run/metrics.jsonl"
key = [{kind = "eval", step = 0}, "acc"]
reduce = "one"
scale = 100
format = ".1f"
[row.values.peak]
file = "benchmarks/results/run/metrics.jsonl"
key = [{kind = "eval"}, "acc"]
reduce = "max"
scale = 100
format = ".0f"
''')
    return table


def test_a_figure_is_read_from_its_file_and_the_pages_follow_it(tmp_path):
    table = _tiny_results(tmp_path, 0.8125)
    rows = gen.figure_rows(table, tmp_path)
    # 0.25 → 25.0; 0.8125 → 81.2 (round half to even at .25); the train row's 0.9 is not an eval; minus written as −
    assert rows[0]["text"] == "25.0 % → 81.2 % (peak 50 %, 2 seeds, −0.81)"
    readme = "intro\n" + gen.README_BEGIN + "\n| an old row |\n" + gen.README_END + "\nafter\n"
    written = gen.readme_text(readme, rows)
    assert written.startswith("intro\n") and written.endswith(gen.README_END + "\nafter\n")
    row = "| a run | 25.0 % → 81.2 % (peak 50 %, 2 seeds, −0.81) | `bash run.sh` | [Run](docs/results/run.md) |"
    assert row in written
    assert "an old row" not in written and gen.readme_text(written, rows) == written
    assert "`benchmarks/results/run/summary.json`<br>`benchmarks/results/run/metrics.jsonl`" in gen.results_page(rows)
    (tmp_path / "benchmarks/results/run/summary.json").write_text(json.dumps({"final": 0.9, "seeds": []}))
    assert gen.readme_text(written, gen.figure_rows(table, tmp_path)) != written  # a changed file: a stale page


def test_a_figure_its_file_does_not_give_is_an_error(tmp_path):
    _tiny_results(tmp_path, 0.5)
    base = {"file": "benchmarks/results/run/metrics.jsonl", "format": ".2f"}
    assert gen.figure_value({**base, "key": [{"kind": "eval"}, "acc"], "reduce": "last"}, tmp_path) == "0.50"
    for spec, message in [
        ({**base, "key": [{"kind": "eval"}, "acc"], "reduce": "one"}, "2 items where exactly one"),
        ({**base, "key": [{"kind": "eval"}, "acc"]}, "a list needs a reduce"),
        ({**base, "key": [0, "loss"]}, "no 'loss'"),
        ({**base, "key": [{"kind": "pretrain"}, "acc"], "reduce": "max"}, "no items to max"),
        ({**base, "file": "benchmarks/results/run/missing.json", "key": ["x"]}, "no such file"),
        ({**base, "key": [0, "kind"]}, "not a number"),
    ]:
        with pytest.raises(gen.FigureError, match=message):
            gen.figure_value(spec, tmp_path)
