"""Rollout service: one vLLM engine generating version-stamped groups (async_vapo.services.rollout).

    services/rollout.py --config FILE [--run-dir DIR] [--instance I] [key.sub=value ...]
"""

import sys

from async_vapo.services.context import run_service


def _body(ctx, args):
    from async_vapo.services.rollout import run_rollout

    run_rollout(ctx)


if __name__ == "__main__":  # vLLM spawns its engine process: construct it only under this guard
    sys.exit(run_service("rollout", None, _body))
