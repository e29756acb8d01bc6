"""Learner service: value pretraining, VAPO updates, weight broadcast (async_vapo.services.learner).

    services/learner.py --config FILE [--run-dir DIR] [--resume CKPT|auto] [key.sub=value ...]
    torchrun --nproc-per-node N services/learner.py ...     (ranks > 0 serve /metrics on port + rank)
    torchrun --nnodes H --rdzv-backend c10d ... services/learner.py --node-rank I --host-addr ADDR ...
                                                              (one agent per learner host: deploy/start_cluster.sh)
"""

import os
import sys

from async_vapo.services.context import run_service, service_arg_parser


def _body(ctx, args):
    from async_vapo.services.learner import run_learner

    run_learner(ctx, resume=args.resume, resume_since=args.resume_since)


if __name__ == "__main__":
    agent = os.getppid()  # torchrun's agent, when there is one
    parser = service_arg_parser("learner", __doc__)
    parser.add_argument("--resume", help="checkpoint directory, or 'auto' for the run's latest")
    parser.add_argument("--resume-since", metavar="FILE",
                        help="resume from the run's newest checkpoint written after FILE when there is one (else "
                             "--resume): ranks that torchrun or a supervisor restarts continue where the group was")
    parser.add_argument("--node-rank", type=int,
                        help="under torchrun: this agent's place among the learner hosts; global rank = NODE_RANK x "
                             "ranks per agent + local rank, so that rank 0 is on the first learner host")
    parser.add_argument("--host-addr", metavar="ADDR",
                        help="under torchrun: the address the other learner hosts reach this one at; gloo connects "
                             "over the interface that holds it (GLOO_SOCKET_IFNAME, unless set)")
    argv = sys.argv[1:]
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from async_vapo.learner.process_group import die_with_agent, gloo_interface_for, rank_by_node

        die_with_agent(agent)
        known = parser.parse_args(argv)
        if known.node_rank is not None:
            rank_by_node(known.node_rank)
        if known.host_addr:
            gloo_interface_for(known.host_addr)
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        argv = ["--instance", str(rank), *argv]
    sys.exit(run_service("learner", argv, _body, parser))
