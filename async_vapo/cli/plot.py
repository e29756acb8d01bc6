"""``async-vapo plot``: held-out accuracy and response length of runs, as one PNG."""

from __future__ import annotations

import argparse

from async_vapo.cli._common import CommandError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plot", help="plot held-out accuracy / response length of runs")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or their metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE.png")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from async_vapo.experiments.plots import plot_runs

    try:
        print(plot_runs(args.runs, args.out))
    except ValueError as e:  # a metrics file that is empty, not JSON lines, or lacks the plotted series
        raise CommandError(str(e)) from None
    return 0
