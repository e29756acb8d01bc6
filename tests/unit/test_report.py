"""The benchmark report's arithmetic on hand-made run directories (busy intervals, windows, ratios)."""

from __future__ import annotations

import json

import pytest

from async_vapo.experiments.report import _covered, _intersection, analyse_cluster_run, eval_spans, report_async


def test_covered_merges_overlaps_and_clips_to_the_window():
    assert _covered([(0, 2), (1, 3), (5, 6)], 0, 10) == pytest.approx(4)
    assert _covered([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == pytest.approx(2)
    assert _covered([], 0, 1) == 0
    assert _intersection([(0, 4)], [(1, 2), (3, 5)]) == [(1, 2), (3, 4)]


def _write_run(run, *, step_s: float, gen: float, learn: float, ages: list[int], steps: int = 5):
    """A run whose learner updates every ``step_s`` s; generation and learning busy ``gen`` / ``learn`` s of each."""
    (run / "stats").mkdir(parents=True)
    rows, busy_r, busy_l = [], [], []
    for k in range(1, steps + 1):
        end = 100 + k * step_s
        busy_l.append(["learn", end - learn, end])
        busy_r.append(["generate", end - learn - gen, end - learn])
        row = {"kind": "train", "step": k, "version": k, "wall_s": end, "samples_seen": 128 * k,
               "time/learn_s": learn, "time/wait_batch_s": step_s - learn, "replay/max_age": max(ages),
               "replay/token_lag_mean": 0.1 * max(ages) * k, "replay/token_lag_max": max(ages),
               "replay/multi_version_samples": 0.05 * max(ages)}
        for a in ages:
            row |= {f"critic_age/{a}/samples": 64.0, f"critic_age/{a}/value_error_abs": 0.5 + 0.1 * a,
                    f"critic_age/{a}/explained_variance": 0.2 - 0.1 * a}
        rows.append(row)
    rows.append({"kind": "eval", "step": steps, "version": steps, "wall_s": 100 + steps * step_s + 1,
                 "eval/accuracy": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "stats" / "rollout-0.busy.jsonl").write_text("".join(json.dumps(b) + "\n" for b in busy_r) + '["gen')
    (run / "stats" / "learner-0.busy.jsonl").write_text("".join(json.dumps(b) + "\n" for b in busy_l))
    (run / "stats" / "verifier-0.busy.jsonl").write_text(
        "".join(json.dumps(["verify", b[2], b[2] + 0.1]) + "\n" for b in busy_r))
    for svc, mib in (("rollout-0", 900.0), ("learner-0", 600.0)):
        (run / "stats" / f"{svc}.json").write_text(json.dumps({"service": svc, "peak_rss_with_children_mib": mib}))


def test_cluster_run_figures(tmp_path):
    _write_run(tmp_path / "r", step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    fig = analyse_cluster_run(tmp_path / "r")
    assert fig["updates"] == 4 and fig["samples"] == 4 * 128
    assert fig["samples_per_s"] == pytest.approx(128 / 8)
    assert fig["busy_fraction"]["learn"] == pytest.approx(6 / 8)
    assert fig["busy_fraction"]["generate"] == pytest.approx(2 / 8)
    assert fig["generate_and_learn_overlap"] == 0  # synchronous: they take turns
    assert fig["peak_rss_mib"] == {"rollout-0": 900.0, "learner-0": 600.0}
    assert fig["critic_by_age"][0]["value_error_abs"] == pytest.approx(0.5)
    # the learner's own seconds per update: learn (and push), waits excluded, the first update left out
    assert fig["learner_own_s"] == pytest.approx(6.0)
    assert fig["over_learner_own"] == pytest.approx(8 / 6 - 1)
    assert fig["stale_groups"] == 0


def test_cluster_run_learner_own_time_and_stale_groups(tmp_path):
    run = tmp_path / "r"
    _write_run(run, step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    pushes = [9.0, 1.0, 1.0, 2.0, 3.0]  # the first update's (start-up) does not count
    for r, p in zip((r for r in rows if r["kind"] == "train"), pushes, strict=True):
        r["time/weight_push_s"] = p
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "logs").mkdir()
    (run / "logs" / "replay.log").write_text("replay: dropped 3 groups: stale (version 2 < 4)\n"
                                             "replay: dropped 5 groups: stale (version 6 < 8)\nother\n")
    fig = analyse_cluster_run(run)
    assert fig["learner_own_s"] == pytest.approx(6.0 + 1.5)  # the median of 7, 7, 8, 9
    assert fig["stale_groups"] == 8


def test_cluster_run_seconds_per_update_between_evaluations(tmp_path):
    run = tmp_path / "r"
    _write_run(run, step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    walls = [108.0, 116.0, 130.0, 138.0, 146.0]  # the third interval held up 6 s by an evaluation
    for r, w in zip(train, walls, strict=True):
        r["wall_s"] = w
    rows = [r for r in rows if r["kind"] == "train"]
    rows.append({"kind": "eval", "step": 2, "version": 2, "wall_s": 125.0, "time/eval_s": 7.0, "eval/accuracy": 0.5})
    rows.append({"kind": "eval", "step": 0, "version": 0, "wall_s": 90.0, "time/eval_s": 9.0, "eval/accuracy": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = analyse_cluster_run(run)
    assert fig["seconds_per_update"] == pytest.approx(38 / 4)
    # the evaluation's span 118-125 s lies inside the interval 116-130 s; the one before training overlaps none
    assert fig["between_evals_updates"] == 3
    assert fig["between_evals_s_per_update"] == pytest.approx(8.0)
    assert fig["over_learner_own_between_evals"] == pytest.approx(8 / 6 - 1)


def test_an_evaluations_span_includes_the_critics_held_out_scoring():
    rows = [{"kind": "eval", "wall_s": 500.0, "time/eval_s": 100.0, "time/critic_score_s": 390.0},
            {"kind": "eval", "wall_s": 900.0, "time/eval_s": 20.0, "time/critic_eval_s": 30.0,
             "time/critic_score_s": 5.0},
            {"kind": "eval", "wall_s": 1000.0, "time/eval_s": 50.0},  # a run without a critic
            {"kind": "train", "wall_s": 950.0, "time/eval_s": 99.0}]
    assert eval_spans(rows) == [(10.0, 500.0), (845.0, 900.0), (950.0, 1000.0)]


def test_async_report_ratios_against_the_synchronous_run(tmp_path):
    _write_run(tmp_path / "staleness_0", step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    _write_run(tmp_path / "staleness_1", step_s=6.4, gen=2.0, learn=6.0, ages=[0, 1])
    s = report_async(tmp_path)
    assert s["slowest_stage"] == "learn"
    assert s["stage_alone_samples_per_s"]["learn"] == pytest.approx(128 / 6)
    assert s["best_bound"] == 1
    assert s["best_speedup_vs_sync"] == pytest.approx(8 / 6.4)
    assert s["best_pipeline_efficiency"] == pytest.approx((128 / 6.4) / (128 / 6))
    assert s["ideal_pipeline_speedup_bound"] == pytest.approx(8 / 6)  # sync s/update over learn s/update
    assert s["runs"]["1"]["critic_by_age"][1]["explained_variance"] == pytest.approx(0.1)
    for f in ("async_vs_sync.md", "async_vs_sync.json", "async_vs_sync.png", "timeline.png"):
        assert (tmp_path / f).stat().st_size > 0
    with pytest.raises(ValueError, match="staleness_0"):
        report_async(tmp_path / "staleness_1")


def test_async_report_puts_a_bound_run_in_another_mode_beside_its_plain_run(tmp_path):
    # staleness_1_continuous: the same bound with continuous generation (benchmarks/async_vs_sync.sh
    # CONTINUOUS_BOUNDS), 5.6 s per update against the lock-step run's 6.4
    _write_run(tmp_path / "staleness_0", step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    _write_run(tmp_path / "staleness_1", step_s=6.4, gen=2.0, learn=6.0, ages=[0, 1])
    _write_run(tmp_path / "staleness_1_continuous", step_s=5.6, gen=2.0, learn=5.0, ages=[0, 1])
    s = report_async(tmp_path)
    assert list(s["runs"]) == ["0", "1", "1_continuous"]
    assert s["best_bound"] == "1_continuous"
    assert s["best_speedup_vs_sync"] == pytest.approx(8 / 5.6)
    assert s["runs"]["1"]["speedup_vs_sync"] == pytest.approx(8 / 6.4)
    md = (tmp_path / "async_vs_sync.md").read_text()
    assert "| 1_continuous | 22.86 | 1.43 |" in md
    assert s["runs"]["1_continuous"]["token_lag_mean"] == pytest.approx(0.3)  # 0.1 × (1 + ... + 5) / 5
    assert "| 1_continuous | 0.300 | 1 | 5.0% |" in md
    assert (tmp_path / "timeline.png").stat().st_size > 0


def test_async_report_against_the_one_process_trainer(tmp_path):
    # sync services 8 s per update, async 6.4 s, learner alone 6 s; the one-process trainer on both cores 5 s: a
    # perfect pipeline of the services is bounded at 5/6 of it, and the async run reaches (5/6.4) / (5/6)
    _write_run(tmp_path / "staleness_0", step_s=8.0, gen=2.0, learn=6.0, ages=[0])
    _write_run(tmp_path / "staleness_1", step_s=6.4, gen=2.0, learn=6.0, ages=[0, 1])
    one = tmp_path / "one_process"
    one.mkdir()
    rows = [{"kind": "train", "step": k, "wall_s": 50 + 5.0 * k, "samples_seen": 128 * k, "time/generate_s": 2.0,
             "time/learn_s": 3.0} for k in range(1, 6)]
    (one / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "command.txt").write_text("CONFIG=configs/tiny_long_cpu.toml BOUNDS=\"0 1\" bash ...\n")
    s = report_async(tmp_path)
    assert s["one_process"]["samples_per_s"] == pytest.approx(128 / 5)
    assert s["ideal_bound_vs_one_process"] == pytest.approx(5 / 6)
    assert s["best_speedup_vs_one_process"] == pytest.approx(5 / 6.4)
    assert s["fraction_of_bound_vs_one_process"] == pytest.approx(6 / 6.4)
    md = (tmp_path / "async_vs_sync.md").read_text()
    assert "configs/tiny_long_cpu.toml" in md and "**0.83×**" in md and "| 1 | 0.78 |" in md


def test_weight_sync_and_transport_reports_render_the_committed_results(tmp_path):
    import shutil
    from pathlib import Path

    from async_vapo.experiments.report import report_transport, report_weight_sync

    root = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    for name, fn in (("weight_sync", report_weight_sync), ("transport", report_transport)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(root / name / "result.json", d / "result.json")
        md = fn(d).read_text()
        assert (d / f"{name}.png").stat().st_size > 0
        data = json.loads((d / "result.json").read_text())
        if name == "weight_sync":
            for size, r in data["sizes"].items():  # one row per size, with the measured memcpy time
                assert f"| {size} | {r['params']:,} |" in md and f"{r['memcpy']['median_s']:.3f}" in md
        else:
            assert f"{data['after']['ratio']:.3f}" in md and f"{data['before']['ratio']:.3f}" in md


def test_undefined_explained_variance_is_left_out_not_averaged_in(tmp_path):
    """Updates whose explained variance is undefined (null in metrics.jsonl) do not count towards the pooled
    figure; an age where it is never defined shows "–"."""
    for s in (0, 1):
        run = tmp_path / f"staleness_{s}"
        _write_run(run, step_s=8.0 - s, gen=2.0, learn=6.0, ages=[0, 1])
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for i, r in enumerate(rows):
            if r["kind"] == "train":
                r["critic_age/1/explained_variance"] = None
                if i % 2:
                    r["critic_age/0/explained_variance"] = None
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = report_async(tmp_path)
    critic = s["runs"]["1"]["critic_by_age"]
    assert critic[0]["explained_variance"] == pytest.approx(0.2)  # the defined updates' 0.2, not pulled to 0
    assert critic[1]["explained_variance"] is None and critic[1]["value_error_abs"] == pytest.approx(0.6)
    assert "0.600 / – / 320" in (tmp_path / "async_vs_sync.md").read_text()
    assert (tmp_path / "async_vs_sync.png").stat().st_size > 0


def test_cluster_run_bound_is_the_slower_sides_own_time(tmp_path):
    """The engine's own seconds per update (generation, evaluation, loads, per engine) against the learner's: the
    slower one bounds the pipeline."""
    run = tmp_path / "r"
    _write_run(run, step_s=8.0, gen=2.0, learn=6.0, ages=[0])  # window 108-140 s: 4 updates, 8 s each
    fig = analyse_cluster_run(run)
    # generation 2 s per update inside the window (updates 2..5: the first update's generation is before it)
    assert fig["engine_own_s"] == pytest.approx(2.0)
    assert fig["slower_side_s"] == pytest.approx(6.0) and fig["slower_side"] == "learner"
    # an evaluation of 9 s and loads of 1 s per update on the engine; a second engine busy all the window
    with open(run / "stats" / "rollout-0.busy.jsonl", "a") as f:
        f.write("\n" + json.dumps(["evaluate", 120.0, 129.0]) + "\n")
        f.write("".join(json.dumps(["load_weights", 95 + k * 8.0, 96 + k * 8.0]) + "\n" for k in range(1, 6)))
        f.write(json.dumps(["engine_lent", 100.0, 140.0]) + "\n")  # a marker, not work
    (run / "stats" / "rollout-1.busy.jsonl").write_text(json.dumps(["generate", 90.0, 150.0]) + "\n")
    fig = analyse_cluster_run(run)
    # rollout-0 in the window 108-140: generation 8 s (108-110, 116-118, 124-126, 132-134), the evaluation 7 s more
    # (120-129, less 124-126), loads 3 s more (111-112, 119-120, 135-136; 103-104 before the window, 127-128 inside
    # the evaluation): 18 s; rollout-1: 32 s; the mean, 25 s over 4 updates
    assert fig["engine_own_s"] == pytest.approx(25 / 4)
    assert fig["slower_side"] == "engine" and fig["slower_side_s"] == pytest.approx(25 / 4)
    assert fig["over_slower_side"] == pytest.approx(8 / (25 / 4) - 1)
