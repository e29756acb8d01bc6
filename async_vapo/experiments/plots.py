"""Plots of training runs from their ``metrics.jsonl`` (one JSON object per line, ``kind`` = pretrain /
train / eval, written by :mod:`async_vapo.trainer`).

* :func:`plot_runs`: held-out accuracy and mean response length against step and wall-clock, one line
  per run, and the critic's held-out explained variance beside its reference levels where the rows have it
  (the ``async-vapo plot`` command).
* :func:`plot_curves_with_spread`: mean and min–max band over seeds, one band per group of runs.
* :func:`bar_chart`: final numbers of an ablation, optionally beside the paper's.

Figures are drawn with matplotlib's object API on the Agg canvas: no pyplot, no global backend switch,
safe to call from any thread or a headless server. Every function returns the path of the PNG it wrote.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from async_vapo.metrics.jsonl import read_metrics

PathLike = str | Path

_X_LABELS = {"step": "update step", "samples_seen": "samples seen", "wall_s": "wall-clock (minutes)",
             "version": "policy version"}


def series(rows: Sequence[Mapping[str, Any]], x: str, y: str, *, kind: str | None = None,
           source: PathLike = "metrics") -> tuple[list[float], list[float]]:
    """(x, y) of the rows holding both keys (and of ``kind`` if given), sorted by x; ``wall_s`` in minutes.

    A y that is undefined at a step (``null`` in metrics.jsonl, or NaN) is NaN: matplotlib leaves a gap there
    rather than joining its neighbours over it. Raises ValueError naming ``source`` when no row has both."""
    pts = [(float(r[x]), math.nan if r[y] is None else float(r[y])) for r in rows
           if x in r and y in r and (kind is None or r.get("kind") == kind) and r[x] is not None]
    if not pts:
        where = f" kind={kind!r}" if kind else ""
        raise ValueError(f"{source}: no{where} row has both {x!r} and {y!r}")
    pts.sort(key=lambda p: p[0])
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    if x == "wall_s":
        xs = [v / 60.0 for v in xs]
    return xs, ys


def _out_path(out: PathLike) -> Path:
    path = Path(out)
    if path.suffix.lower() != ".png":
        raise ValueError(f"{path}: plots are written as PNG, give a .png file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def new_figure(nrows: int, ncols: int, size: tuple[float, float]) -> tuple[Figure, Any]:
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _run_labels(runs: Sequence[Path], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(runs):
            raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
        return list(labels)
    names = [r.name for r in runs]
    if len(set(names)) < len(names):  # e.g. runs/a/seed0 and runs/b/seed0
        names = [f"{r.parent.name}/{r.name}" for r in runs]
    return names


def plot_runs(runs: Sequence[PathLike], out: PathLike, labels: Sequence[str] | None = None) -> Path:
    """One PNG, 2×2: held-out accuracy vs step and vs wall-clock minutes (top), mean response length
    (held-out solid, rollout dashed) vs step and vs wall-clock (bottom); one colour per run. When a run's eval rows
    hold the critic's held-out explained variance (``critic/heldout_ev``; the services' learner writes it in its
    ``critic_eval`` rows), a third row plots it, with its reference levels on the same responses (length only dashed,
    slip-aware dotted)."""
    if not runs:
        raise ValueError("plot_runs: give at least one run directory")
    run_paths = [Path(r) for r in runs]
    names = _run_labels(run_paths, labels)
    out = _out_path(out)
    all_rows = [read_metrics(run) for run in run_paths]
    critic = any("critic/heldout_ev" in r for rows in all_rows for r in rows if r.get("kind") in _CRITIC_ROWS)
    fig, ax = new_figure(3 if critic else 2, 2, (12, 12 if critic else 8))
    for i, (run, name, rows) in enumerate(zip(run_paths, names, all_rows, strict=True)):
        src = run / "metrics.jsonl" if run.is_dir() else run
        color = f"C{i % 10}"
        if critic:
            _plot_critic_quality(ax[2], rows, name, color, src)
        for col, x in enumerate(("step", "wall_s")):
            xs, ys = series(rows, x, "eval/accuracy", kind="eval", source=src)
            ax[0][col].plot(xs, ys, "o-", color=color, label=name, markersize=3)
            xs, ys = series(rows, x, "eval/response_length", kind="eval", source=src)
            ax[1][col].plot(xs, ys, "o-", color=color, label=f"{name} (held-out)", markersize=3)
            try:
                xs, ys = series(rows, x, "rollout/response_length", kind="train", source=src)
            except ValueError:  # a run stopped before its first update has evals only
                continue
            ax[1][col].plot(xs, ys, "--", color=color, alpha=0.7, label=f"{name} (rollout)")
    for col, x in enumerate(("step", "wall_s")):
        ax[0][col].set(xlabel=_X_LABELS[x], ylabel="held-out accuracy", ylim=(-0.02, 1.02))
        ax[1][col].set(xlabel=_X_LABELS[x], ylabel="mean response length (tokens)")
        for a in (ax[0][col], ax[1][col]):
            a.grid(alpha=0.3)
            a.legend(fontsize="small")
    ax[0][0].set_title("held-out accuracy vs step")
    ax[0][1].set_title("held-out accuracy vs wall-clock")
    ax[1][0].set_title("response length vs step")
    ax[1][1].set_title("response length vs wall-clock")
    if critic:
        for col, x in enumerate(("step", "wall_s")):
            ax[2][col].set(xlabel=_X_LABELS[x], ylabel="critic explained variance (held-out)",
                           title=f"critic on held-out responses vs {'step' if x == 'step' else 'wall-clock'}")
            ax[2][col].axhline(0.0, color="grey", lw=0.8)
            ax[2][col].grid(alpha=0.3)
            ax[2][col].legend(fontsize="small")
    fig.suptitle("async-vapo: " + ", ".join(names))
    fig.savefig(out, dpi=100)
    return out


_CRITIC_LINES = (("critic/heldout_ev", "o-", "critic"), ("critic/heldout_ev_length_only", "--", "length only"),
                 ("critic/heldout_ev_slip_aware", ":", "slip-aware"),
                 ("critic/heldout_ev_slip_aware_by_step", "-.", "slip-aware by step"))


_CRITIC_ROWS = ("eval", "critic_eval")
"""Rows with the critic's held-out scores: the one-process trainer's evaluations, the services' learner's."""


def _plot_critic_quality(axes, rows, name: str, color: str, src: PathLike) -> None:
    """The critic's held-out EV at each evaluation and its reference levels (``learner.critic_quality``)."""
    kind = "critic_eval" if any(r.get("kind") == "critic_eval" for r in rows) else "eval"
    for col, x in enumerate(("step", "wall_s")):
        for key, style, what in _CRITIC_LINES:
            try:
                xs, ys = series(rows, x, key, kind=kind, source=src)
            except ValueError:  # this run does not have this level (another task, no critic)
                continue
            axes[col].plot(xs, ys, style, color=color, label=f"{name} ({what})", markersize=3)


Curve = tuple[list[float], list[float]]


def mean_and_spread(curves: Sequence[Curve]) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean, min and max of several (x, y) curves on the x range they all cover, linearly interpolated
    onto the union of their x values there. Repeated x keep the last y (a resumed run re-evaluates). A NaN y
    (undefined at that step) makes the curve NaN on both sides of it up to its neighbours, and the mean, min and
    max NaN wherever a curve is: a gap in the plot, not a value made up across it."""
    import numpy as np

    if not curves:
        raise ValueError("no curves")
    cleaned = []
    for xs, ys in curves:
        d = dict(zip(xs, ys, strict=True))  # later rows win
        cx = np.array(sorted(d))
        cleaned.append((cx, np.array([d[v] for v in cx])))
    lo = max(c[0][0] for c in cleaned)
    hi = min(c[0][-1] for c in cleaned)
    if lo > hi:
        raise ValueError(f"the seeds' x ranges do not overlap (latest start {lo}, earliest end {hi})")
    grid = np.unique(np.concatenate([c[0][(c[0] >= lo) & (c[0] <= hi)] for c in cleaned]))
    ys = np.stack([np.interp(grid, cx, cy) for cx, cy in cleaned])
    return grid.tolist(), ys.mean(0).tolist(), ys.min(0).tolist(), ys.max(0).tolist()


def plot_curves_with_spread(groups: Mapping[str, Sequence[PathLike]], out: PathLike, x: str = "samples_seen",
                            y: str = "eval/accuracy", *, title: str | None = None, kind: str | None = None) -> Path:
    """One line per group (e.g. per algorithm): the mean of ``y`` over its runs (seeds) against ``x``,
    with the min–max band shaded. Seeds are interpolated onto a shared x grid over the range all of
    them reached. ``x``: ``samples_seen``, ``wall_s`` (plotted in minutes) or ``step``; ``kind``
    restricts to rows of that kind (default: every row holding both keys)."""
    if not groups:
        raise ValueError("plot_curves_with_spread: give at least one group of runs")
    out = _out_path(out)
    fig, ax = new_figure(1, 1, (8, 5))
    a = ax[0][0]
    for i, (name, runs) in enumerate(groups.items()):
        if not runs:
            raise ValueError(f"group {name!r} has no runs")
        curves = []
        for run in runs:
            src = Path(run) / "metrics.jsonl" if Path(run).is_dir() else Path(run)
            curves.append(series(read_metrics(run), x, y, kind=kind, source=src))
        try:
            gx, mean, lo, hi = mean_and_spread(curves)
        except ValueError as e:
            raise ValueError(f"group {name!r}: {e}") from e
        color = f"C{i % 10}"
        a.plot(gx, mean, "-", color=color, label=f"{name} (n={len(runs)})", marker="o" if len(gx) == 1 else None)
        if len(runs) > 1:
            a.fill_between(gx, lo, hi, color=color, alpha=0.2, linewidth=0)
    a.set(xlabel=_X_LABELS.get(x, x), ylabel=y)
    if y.endswith("accuracy"):
        a.set_ylim(-0.02, 1.02)
    a.grid(alpha=0.3)
    a.legend(fontsize="small")
    a.set_title(title or f"{y} vs {_X_LABELS.get(x, x)} (mean, min–max over seeds)")
    fig.savefig(out, dpi=100)
    return out


def bar_chart(labels: Sequence[str], values: Sequence[float], out: PathLike, reference: Sequence[float] | None = None,
              title: str = "ablation", *, ylabel: str = "held-out accuracy", errors: Sequence[float] | None = None,
              reference_label: str = "paper") -> Path:
    """Bars of ``values`` per label (with optional ± ``errors``), and when ``reference`` is given the
    paper's number for each label as a second, hatched bar beside it (NaN where the paper has none)."""
    n = len(labels)
    if n == 0:
        raise ValueError("bar_chart: no labels")
    for what, seq in (("values", values), ("reference", reference), ("errors", errors)):
        if seq is not None and len(seq) != n:
            raise ValueError(f"bar_chart: {len(seq)} {what} for {n} labels")
    out = _out_path(out)
    fig, ax = new_figure(1, 1, (max(6.0, 1.1 * n + 2), 4.5))
    a = ax[0][0]
    width = 0.4 if reference is not None else 0.7
    pos = list(range(n))
    ours_x = [p - width / 2 for p in pos] if reference is not None else pos
    bars = a.bar(ours_x, values, width, yerr=errors, capsize=3, label="ours", color="C0")
    a.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize="small", padding=2)
    if reference is not None:
        ref = [float("nan") if v is None else float(v) for v in reference]
        rb = a.bar([p + width / 2 for p in pos], ref, width, label=reference_label, color="C7", hatch="//",
                   edgecolor="black", linewidth=0.5)
        a.bar_label(rb, labels=["" if math.isnan(v) else f"{v:.3g}" for v in ref], fontsize="small", padding=2)
        a.legend(fontsize="small")
    # long labels on few bars wrap onto two lines rather than run into each other; many bars turn theirs
    ticks = list(labels) if n > 4 else [textwrap.fill(x, 16) for x in labels]
    a.set_xticks(pos, ticks, rotation=20 if n > 4 else 0, ha="right" if n > 4 else "center")
    a.set(ylabel=ylabel, title=title)
    a.margins(y=0.12)  # room for the value labels above the bars
    a.grid(axis="y", alpha=0.3)
    fig.savefig(out, dpi=100)
    return out
