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
