"""``async-vapo eval``: accuracy, avg@n and pass@k of a checkpoint or an HF model directory."""

from __future__ import annotations

import argparse

from async_vapo.cli._common import add_config_args


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="accuracy, avg@n and pass@k of a checkpoint or HF model directory, by "
                                    "difficulty, with every response and verdict (samples.jsonl)")
    p.add_argument("model", nargs="?", help="a checkpoint (runs/NAME/checkpoints/step_N: its run's config is used "
                                            "unless --config is given), an HF model directory, or a run directory "
                                            "(runs/NAME: each checkpoint not yet evaluated, as eval rows of its "
                                            "metrics.jsonl); default: the config's starting policy")
    add_config_args(p)
    p.add_argument("--samples", type=int, help="samples per problem, n (default rollout.eval_samples)")
    p.add_argument("--k", help="comma-separated k of pass@k, each <= n (default 1,2,4,...,n)")
    p.add_argument("--split", choices=("eval", "train"), default="eval", help="the task's split (default eval)")
    p.add_argument("--limit", type=int, help="only the first LIMIT problems of the split")
    p.add_argument("--out", help="output directory (default runs/eval/<label>; a run directory: RUN_DIR/eval)")
    p.add_argument("--watch", action="store_true",
                   help="a run directory: evaluate each checkpoint as it is written, until the run is done (an "
                        "evaluator beside a cluster run with cluster.rollout.eval = false)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from async_vapo.evaluation import main as eval_main

    # a model slot filled with an override (`eval a.b=1`) is moved to the overrides there
    return eval_main(args)
