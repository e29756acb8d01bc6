import json
from pathlib import Path

import pytest

from async_vapo.experiments.comparison import ABLATIONS, COMPARISON, Arms, Run, plan

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


def test_baselines_pick_the_arms_beside_vapo():
    arms = Arms("configs/tiny_long_cpu.toml", "configs/long")
    runs = plan("all", [0, 1, 2], [0, 1, 2], arms, ["no_value_pretrain", "no_pos_lm_loss"], ["grpo", "dapo"])
    assert [r.dirname for r in runs[:3]] == ["vapo_s0", "dapo_s0", "grpo_s0"]  # seed 0 of every arm first
    assert {r.name for r in runs} == {"vapo", "grpo", "dapo", "no_value_pretrain", "no_pos_lm_loss"}
    assert len(runs) == 3 * 3 + 3 * 2
    with pytest.raises(ValueError, match="reinforce"):
        plan("all", [0], [0], arms, [], ["reinforce"])


def _fake_run(out: Path, name: str, accs: list[float], *, wall_s: float, cpu_s: float | None,
              pretrain: int = 0, per_step: int = 4, s_per_update: float = 10.0) -> None:
    """A finished run's files as the trainer writes them: an evaluation every 2 updates."""
    d = out / name
    d.mkdir(parents=True)
    (d / "config.resolved.json").write_text(json.dumps(
        {"algo": {"prompts_per_step": per_step, "group_size": 1}, "train": {"total_steps": 2 * (len(accs) - 1)}}))
    rows = [{"kind": "pretrain", "step": 0} for _ in range(pretrain)]
    for i, acc in enumerate(accs):
        step = 2 * i
        if step:
            rows += [{"kind": "train", "step": s, "samples_seen": s * per_step, "actor/entropy": 1.0,
                      "rollout/response_length": 10.0, "critic/explained_variance": 0.0, "critic/value_loss": 1.0}
                     for s in (step - 1, step)]
        rows.append({"kind": "eval", "step": step, "samples_seen": step * per_step, "wall_s": s_per_update * step,
                     "eval/accuracy": acc})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"wall_s": wall_s, **({} if cpu_s is None else {"cpu_s": cpu_s})}
    (d / "summary.json").write_text(json.dumps(summary))


def test_report_gives_accuracy_at_equal_responses_and_wall_clock_and_cpu_minutes_where_recorded(tmp_path):
    from async_vapo.experiments.comparison import report

    # VAPO spends 2 x 4 responses on value pretraining; its seed 1 ran before CPU time was recorded.
    _fake_run(tmp_path, "vapo_s0", [0.2, 0.4, 0.6], wall_s=600, cpu_s=1200, pretrain=2)
    _fake_run(tmp_path, "vapo_s1", [0.2, 0.2, 0.4], wall_s=600, cpu_s=None, pretrain=2)
    _fake_run(tmp_path, "grpo_s0", [0.2, 0.3, 0.5], wall_s=300, cpu_s=360, s_per_update=4.0)
    _fake_run(tmp_path, "grpo_s1", [0.2, 0.5, 0.5], wall_s=300, cpu_s=480, s_per_update=4.0)
    result = report(tmp_path)["comparison"]
    # GRPO generated 16 responses, VAPO 8 + 16 = 24; at 16, VAPO is at its first evaluation after pretraining
    # (8 + 8 = 16 responses): 0.4 and 0.2
    assert result["vapo"]["common_budget"] == 16
    assert result["vapo"]["accuracy_at_common_budget"] == pytest.approx(0.3)
    assert result["grpo"]["accuracy_at_common_budget"] == pytest.approx(0.5)
    assert result["grpo"]["gain_at_common_budget"] == pytest.approx(0.3)  # both seeds started at 0.2
    # GRPO's runs end at 16 s, 4/5 of the way from VAPO's first evaluation (0.2, 0.2) to its second (0.4, 0.2)
    assert result["vapo"]["common_wall_s"] == 16.0
    assert result["vapo"]["accuracy_at_common_wall_s"] == pytest.approx((0.36 + 0.2) / 2)
    assert result["grpo"]["accuracy_at_common_wall_s"] == pytest.approx(0.5)
    assert result["vapo"]["final_mean"] == pytest.approx((0.5 + 0.3) / 2)
    assert result["grpo"]["cpu_minutes"] == pytest.approx(7.0) and result["vapo"]["cpu_minutes"] == 20.0
    table = (tmp_path / "comparison.md").read_text()
    assert "at 0.3 minutes" in table and "| 10.0 | 20.0 (1 of 2 runs) |" in table and "| 5.0 | 7.0 |" in table
    assert (tmp_path / "accuracy_vs_samples.png").stat().st_size > 0
    # paired by seed: VAPO's finals 0.5 and 0.3, GRPO's 0.4 and 0.5
    g = result["grpo"]["vapo_gain_paired"]
    assert g["by_seed"] == {0: pytest.approx(0.1), 1: pytest.approx(-0.2)} and g["mean"] == pytest.approx(-0.05)
    assert g["lower_95"] == pytest.approx(-0.05 - 6.314 * 0.3 / 2 ** 0.5 / 2 ** 0.5) and not g["beyond_spread"]
    assert "| VAPO − grpo | 0, 1 | +0.100, -0.200 | -0.050 ± 0.212 |" in table


def test_paired_gain_beyond_the_spread_of_three_seeds(tmp_path):
    from async_vapo.experiments.comparison import paired_gain

    for seed, (v, g) in enumerate([(0.50, 0.40), (0.52, 0.40), (0.48, 0.40)]):
        _fake_run(tmp_path, f"vapo_s{seed}", [0.2, v, v], wall_s=60, cpu_s=None)
        _fake_run(tmp_path, f"grpo_s{seed}", [0.2, g, g], wall_s=60, cpu_s=None)
    _fake_run(tmp_path, "grpo_s3", [0.2, 0.9, 0.9], wall_s=60, cpu_s=None)  # no VAPO seed 3: not paired
    vapo, grpo = sorted(tmp_path.glob("vapo_s*")), sorted(tmp_path.glob("grpo_s*"))
    g = paired_gain(vapo, grpo)
    assert g["seeds"] == 3 and g["mean"] == pytest.approx(0.10) and g["sd"] == pytest.approx(0.02)
    assert g["lower_95"] == pytest.approx(0.10 - 2.920 * 0.02 / 3 ** 0.5) and g["beyond_spread"]
    # the same mean with pairs spread wider than it (+0.30, -0.08, +0.08) is not beyond the spread
    wide = tmp_path / "wide"
    for seed, g in enumerate([0.20, 0.60, 0.40]):
        _fake_run(wide, f"grpo_s{seed}", [0.2, g, g], wall_s=60, cpu_s=None)
    g = paired_gain(vapo, sorted(wide.glob("grpo_s*")))
    assert g["mean"] == pytest.approx(0.10) and g["sd"] > g["mean"] and g["lower_95"] < 0 and not g["beyond_spread"]


def test_ablation_table_compares_rows_at_equal_responses_and_pairs_seeds(tmp_path):
    from async_vapo.experiments.comparison import report

    _fake_run(tmp_path, "vapo_s0", [0.2, 0.4, 0.6], wall_s=600, cpu_s=600, pretrain=2)
    _fake_run(tmp_path, "vapo_s1", [0.2, 0.2, 0.4], wall_s=600, cpu_s=600, pretrain=2)
    # without value pretraining: no pretraining responses, so it ends at 16 responses, where VAPO is at update 2
    _fake_run(tmp_path, "no_value_pretrain_s0", [0.2, 0.2, 0.3], wall_s=500, cpu_s=500)
    abl = report(tmp_path)["ablation"]["no_value_pretrain"]
    assert abl["common_budget"] == 16 and abl["accuracy_at_common_budget"] == pytest.approx(0.3)
    assert abl["paired_delta"] == pytest.approx(0.25 - 0.5)  # against VAPO's seed 0 only
    table = (tmp_path / "ablation.md").read_text()
    assert "at 16 responses" in table and "| 0.300 ± 0.141 |" in table  # VAPO's seeds at 16: 0.4 and 0.2
