from pathlib import Path

import pytest

from async_vapo.experiments import ABLATIONS, COMPARISON, Arms, Run, plan

REPO = Path(__file__).resolve().parents[2]


def test_default_arms_are_the_embedded_configs():
    runs = plan("all", [0, 1], [0])
    assert {r.config for r in runs if r.name in COMPARISON} == set(COMPARISON.values())
    assert Run("no_clip_higher", 0).config == "configs/ablations/no_clip_higher.toml"
    assert len(runs) == 2 * len(COMPARISON) + len(ABLATIONS)


def test_long_arms_name_existing_long_configs():
    arms = Arms("configs/tiny_long_cpu.toml", "configs/long")
    runs = plan("all", [0, 1, 2], [0, 1], arms,
                ["no_value_pretrain", "no_decoupled_gae", "no_length_adaptive_gae"])
    assert len(runs) == 3 * 4 + 2 * 3  # VAPO's seeds 0 and 1 serve both tables
    for r in runs:
        assert (REPO / r.config).exists(), r.config
        assert r.config == "configs/tiny_long_cpu.toml" or r.config.startswith("configs/long/"), r.config
    assert {r.dirname for r in runs if r.name == "vapo"} == {"vapo_s0", "vapo_s1", "vapo_s2"}


def test_unknown_ablation_row_is_an_error():
    with pytest.raises(ValueError, match="no_such_row"):
        plan("ablation", [0], [0], Arms(), ["no_such_row"])
