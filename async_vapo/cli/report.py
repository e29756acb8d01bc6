"""``async-vapo report``: benchmark result folders -> PNG plots and markdown tables.

Its parser is :mod:`async_vapo.experiments.report`'s own; the subparser here carries the same arguments so
that ``build_parser`` lists them.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from async_vapo.experiments import report

    p = sub.add_parser("report", help="benchmark result folders -> PNG plots and markdown tables",
                       description=report.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    report.add_arguments(p)
    p.set_defaults(run=None)
    return p


def main(argv: list[str]) -> int:
    from async_vapo.experiments.report import main as report_main

    return report_main(argv)
