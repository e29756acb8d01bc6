"""What a newcomer reads first holds together: no paragraph cut mid-sentence, no paragraph repeated word for word on
two pages, a glossary of the in-house words in the navigation, and a recipes page whose commands name configs and
placements that exist (the GPU guide's Slurm example used a placement the same page calls superseded)."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs of plain prose: code blocks, tables, lists, headings, admonitions and HTML left out."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    out = []
    blocks = re.split(r"\n\s*\n", text)
    for i, block in enumerate(blocks):
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines or lines[0].lstrip().startswith(("#", "|", "-", "*", "!!!", "???", "<", "1.", ">", "--8<--")):
            continue
        if lines[0].startswith("    "):  # inside an admonition or a list item, or an indented code block
            continue
        paragraph = " ".join(ln.strip() for ln in lines)
        if i + 1 < len(blocks) and blocks[i + 1].startswith("    "):  # goes on after an indented example
            paragraph += "."
        out.append(paragraph)
    return out


def test_no_paragraph_is_cut_mid_sentence():
    cut = [f"{page.relative_to(ROOT)}: ...{p[-60:]}" for page in sorted(DOCS.rglob("*.md"))
           if "reference" not in page.parts for p in _prose_paragraphs(page.read_text())
           if not re.search(r"[.:!?)]\)?$|\.\*\*$|\*$", p)]
    assert not cut, cut


def test_no_paragraph_is_repeated_word_for_word_on_two_pages():
    seen: dict[str, str] = {}
    repeated = []
    for page in sorted(DOCS.rglob("*.md")):
        for p in _prose_paragraphs(page.read_text()):
            if len(p) > 200:
                if p in seen and seen[p] != page.name:
                    repeated.append((seen[p], str(page.relative_to(ROOT)), p[:80]))
                seen.setdefault(p, str(page.relative_to(ROOT)))
    assert not repeated, repeated


def _nav_pages(nav) -> list[str]:
    out = []
    for item in nav:
        for value in item.values() if isinstance(item, dict) else [item]:
            out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def test_the_glossary_and_the_recipes_are_in_the_nav_and_cover_what_they_promise():
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))["nav"])
    assert "glossary.md" in nav and "guides/recipes.md" in nav
    glossary = (DOCS / "glossary.md").read_text()
    for word in ("weight way", "keep", "wait", "k3", "EV", "rooms", "give back", "lock-step", "staleness", "group"):
        assert f"**{word}" in glossary or re.search(rf"\*\*[^*]*\b{re.escape(word)}\b[^*]*\*\*", glossary), word
    recipes = (DOCS / "guides/recipes.md").read_text()
    slurm = "sbatch --nodes 2 --gpus-per-node 8 deploy/slurm/async_vapo.sbatch --config configs/qwen2.5-7b_vapo.toml"
    assert slurm in recipes and "PROMETHEUS=1 make cluster" in recipes
    for table_word in ("ppo_mini_batch_size", "num_generations", "report_to", "compute_score"):
        assert table_word in recipes, table_word


def test_the_slurm_examples_use_the_configs_placement():
    """The configs carry the placement their plan fits; the example's overrides were the superseded 24 : 8, TP 4."""
    for page in (DOCS / "guides/gpu-cluster.md", ROOT / "deploy/slurm/async_vapo.sbatch"):
        text = page.read_text()
        for command in re.findall(r"sbatch --nodes[^\n]*(?:\\\n[^\n]*)*", text):
            assert "async.learner_devices=8" not in command, (page.name, command)
