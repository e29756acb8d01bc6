"""Learner service: value pretraining, VAPO updates, weight broadcast (async_vapo.cluster.learner_service).

    services/learner.py --config FILE [--run-dir DIR] [--resume CKPT|auto] [key.sub=value ...]
    torchrun --nproc-per-node N services/learner.py ...     (ranks > 0 serve /metrics on port + rank)
"""

import os
import sys

from async_vapo.cluster.common import run_service, service_arg_parser


def _body(ctx, args):
    from async_vapo.cluster.learner_service import run_learner

    run_learner(ctx, resume=args.resume)


if __name__ == "__main__":
    parser = service_arg_parser("learner", __doc__)
    parser.add_argument("--resume", help="checkpoint directory, or 'auto' for the run's latest")
    argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        argv = ["--instance", str(rank), *argv]
    sys.exit(run_service("learner", argv, _body, parser))
