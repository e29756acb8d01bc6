"""``async-vapo experiment``: VAPO against the baselines, and the ablation table: run / report.

Its parser is :mod:`async_vapo.experiments.comparison`'s own; the subparser here carries the same arguments so
that ``build_parser`` lists them.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> argparse.ArgumentParser:
    from async_vapo.experiments import comparison

    p = sub.add_parser("experiment", help="VAPO vs baselines and the ablation table: run / report",
                       description=comparison.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    comparison.add_arguments(p)
    p.set_defaults(run=None)
    return p


def main(argv: list[str]) -> int:
    from async_vapo.experiments.comparison import main as experiment_main

    return experiment_main(argv)
