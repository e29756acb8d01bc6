"""Run plots from synthetic metrics.jsonl files: PNGs that exist, decode and show the runs' lines;
clear errors naming the file when the metrics are missing or malformed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from async_vapo.experiments.plots import (
    bar_chart,
    mean_and_spread,
    plot_curves_with_spread,
    plot_runs,
    read_metrics,
    series,
)
from async_vapo.metrics.jsonl import JsonlWriter

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run: Path, *, steps: int = 6, acc0: float = 0.1, slope: float = 0.1, sec_per_step: float = 30.0,
              evals: bool = True, trains: bool = True) -> Path:
    """A metrics.jsonl shaped like the trainer's: pretrain rows, train rows every step, eval every 2."""
    run.mkdir(parents=True, exist_ok=True)
    rows = [{"kind": "pretrain", "step": 0, "wall_s": 5.0, "rollout/accuracy": acc0, "critic/explained_variance": -0.5}]
    seen = 0
    if evals:
        rows.append({"kind": "eval", "step": 0, "version": 0, "wall_s": 1.0, "samples_seen": 0,
                     "eval/accuracy": acc0, "eval/response_length": 20.0, "eval/accuracy_ops3": acc0 / 2})
    for s in range(1, steps + 1):
        seen += 16
        acc = min(1.0, acc0 + slope * s)
        if trains:
            rows.append({"kind": "train", "step": s, "version": s, "wall_s": 10 + s * sec_per_step,
                         "samples_seen": seen, "rollout/accuracy": acc, "rollout/response_length": 30.0 - s,
                         "critic/explained_variance": 0.1 * s, "actor/entropy": 1.0 / s})
        if evals and s % 2 == 0:
            rows.append({"kind": "eval", "step": s, "version": s, "wall_s": 12 + s * sec_per_step,
                         "samples_seen": seen, "eval/accuracy": acc, "eval/response_length": 25.0 - s})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def assert_png(path: Path, min_bytes: int = 10_000) -> np.ndarray:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > min_bytes
    return imread(path)[..., :3]


def pixels_of(img: np.ndarray, color: str, tol: float = 0.03) -> int:
    return int((np.abs(img - np.array(to_rgb(color))).max(-1) < tol).sum())


def test_plot_runs_writes_a_png_with_a_line_per_run(tmp_path):
    a = write_run(tmp_path / "runs" / "vapo")
    b = write_run(tmp_path / "runs" / "ppo", acc0=0.05, slope=0.05, sec_per_step=20)
    out = plot_runs([a, str(b)], tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    img = assert_png(out, 30_000)
    assert img.shape[:2] == (800, 1200)  # 12x8 in at 100 dpi
    # both runs' colours are drawn (C0 and C1 of the default cycle)
    assert pixels_of(img, "C0") > 200 and pixels_of(img, "C1") > 200


def test_plot_runs_labels_and_eval_only_runs(tmp_path):
    a = write_run(tmp_path / "a" / "seed0", trains=False)  # stopped before the first update
    b = write_run(tmp_path / "b" / "seed0")
    assert_png(plot_runs([a, b], tmp_path / "y.png", labels=["one", "two"]))
    with pytest.raises(ValueError, match="2 runs"):
        plot_runs([a, b], tmp_path / "z.png", labels=["one"])
    with pytest.raises(ValueError, match="PNG"):
        plot_runs([a], tmp_path / "z.pdf")


def test_cli_plot(tmp_path, capsys):
    from async_vapo.cli import main

    run = write_run(tmp_path / "run")
    assert main(["plot", str(run), "--out", str(tmp_path / "cli.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cli.png")
    assert_png(tmp_path / "cli.png")


def test_missing_file_is_named(tmp_path):
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty_run" / "metrics.jsonl")):
        plot_runs([tmp_path / "empty_run"], tmp_path / "out.png")
    assert not (tmp_path / "out.png").exists()


def test_empty_file_is_named(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"run/metrics\.jsonl is empty"):
        plot_runs([tmp_path / "run"], tmp_path / "out.png")


def test_missing_key_names_file_and_key(tmp_path):
    run = write_run(tmp_path / "noeval", evals=False)
    with pytest.raises(ValueError, match=r"noeval/metrics\.jsonl.*'eval/accuracy'"):
        plot_runs([run], tmp_path / "out.png")


def test_corrupt_line_is_named_but_a_partial_last_line_is_tolerated(tmp_path):
    run = write_run(tmp_path / "run")
    path = run / "metrics.jsonl"
    good = path.read_text()
    path.write_text(good + '{"kind": "train", "st')  # still being written
    assert len(read_metrics(run)) == len(good.splitlines())
    path.write_text('{"kind": "eval"}\nnot json\n' + good)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2"):
        read_metrics(run)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:1: expected a JSON object"):
        read_metrics(path)


def test_mean_and_spread_hand_computed():
    # curve a: (0, 0) -> (10, 1); curve b: (0, .2), (5, .4), (10, .6), (20, .9)
    # shared range [0, 10], grid = union of x there = [0, 5, 10]; a at 5 interpolates to 0.5
    # mean: (0+.2)/2 = .1, (.5+.4)/2 = .45, (1+.6)/2 = .8; min/max per point
    x, mean, lo, hi = mean_and_spread([([0, 10], [0, 1]), ([0, 5, 10, 20], [0.2, 0.4, 0.6, 0.9])])
    assert x == [0, 5, 10]
    assert np.allclose(mean, [0.1, 0.45, 0.8]) and np.allclose(lo, [0, 0.4, 0.6]) and np.allclose(hi, [0.2, 0.5, 1])
    # a repeated x keeps the last value (a resumed run evaluates the same step again)
    assert mean_and_spread([([0, 1, 1], [0.0, 0.3, 0.7])])[1] == [0.0, 0.7]
    with pytest.raises(ValueError, match="overlap"):
        mean_and_spread([([0, 1], [0, 1]), ([2, 3], [0, 1])])


@pytest.mark.parametrize("x", ["samples_seen", "wall_s"])
def test_plot_curves_with_spread(tmp_path, x):
    groups = {
        "vapo": [write_run(tmp_path / f"vapo/s{i}", acc0=0.1 + 0.02 * i, slope=0.1) for i in range(3)],
        "grpo": [write_run(tmp_path / f"grpo/s{i}", acc0=0.05, slope=0.04 + 0.01 * i, sec_per_step=25)
                 for i in range(3)],
    }
    out = plot_curves_with_spread(groups, tmp_path / f"spread_{x}.png", x=x, y="eval/accuracy")
    img = assert_png(out)
    # the shaded bands are C0/C1 at alpha 0.2 over white
    band = 0.8 + 0.2 * np.array(to_rgb("C0"))
    assert int((np.abs(img - band).max(-1) < 0.03).sum()) > 500
    with pytest.raises(ValueError, match="'nope'"):
        plot_curves_with_spread(groups, tmp_path / "bad.png", y="nope")
    with pytest.raises(ValueError, match="no runs"):
        plot_curves_with_spread({"empty": []}, tmp_path / "bad.png")


def test_bar_chart(tmp_path):
    out = bar_chart(["VAPO", "- value pretrain", "- decoupled GAE"], [0.6, 0.35, 0.4], tmp_path / "bars.png",
                    reference=[0.6, 0.11, None], title="ablation")
    img = assert_png(out)
    assert pixels_of(img, "C0") > 1000 and pixels_of(img, "C7") > 500
    assert_png(bar_chart(["a"], [math.nan], tmp_path / "nan.png"), 5_000)
    with pytest.raises(ValueError, match="2 reference"):
        bar_chart(["a", "b", "c"], [1, 2, 3], tmp_path / "x.png", reference=[1, 2])
    with pytest.raises(ValueError, match="no labels"):
        bar_chart([], [], tmp_path / "x.png")


def strict_loads(line: str):
    """json.loads that rejects NaN / Infinity, as RFC 8259 readers (jq, JavaScript, Go) do."""
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=reject)


def test_undefined_metrics_are_null_in_metrics_jsonl_and_a_gap_in_the_plots(tmp_path):
    """A step whose explained variance is undefined (NaN: returns that do not vary) is written as null, every
    line stays strict JSON, and the curve has a gap there: no point at 0, no line joining its neighbours."""
    run = tmp_path / "run"
    writer = JsonlWriter(run / "metrics.jsonl", truncate=True)
    evs = [0.1, 0.2, math.nan, 0.4, 0.5]
    for s, ev in enumerate(evs, 1):
        writer.write({"kind": "train", "step": s, "samples_seen": 16 * s, "critic/explained_variance": ev,
                      "nested": {"inf": math.inf, "list": [1.0, -math.inf]}})
    writer.close()
    lines = (run / "metrics.jsonl").read_text().splitlines()
    rows = [strict_loads(x) for x in lines]
    assert rows[2]["critic/explained_variance"] is None and rows[0]["nested"] == {"inf": None, "list": [1.0, None]}
    assert read_metrics(run) == rows

    xs, ys = series(rows, "step", "critic/explained_variance", kind="train")
    assert xs == [1, 2, 3, 4, 5] and math.isnan(ys[2]) and ys[:2] + ys[3:] == [0.1, 0.2, 0.4, 0.5]
    other = write_run(tmp_path / "other", steps=5)
    gx, mean, lo, hi = mean_and_spread([(xs, ys), series(read_metrics(other), "step", "critic/explained_variance",
                                                         kind="train")])
    assert gx == [1, 2, 3, 4, 5]
    assert [math.isnan(v) for v in mean] == [False, False, True, False, False]
    assert mean[0] == pytest.approx((0.1 + 0.1) / 2) and math.isnan(lo[2]) and math.isnan(hi[2])
    assert_png(plot_curves_with_spread({"vapo": [run, other]}, tmp_path / "ev.png", x="step",
                                       y="critic/explained_variance", kind="train"))

