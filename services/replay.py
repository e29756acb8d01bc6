"""Replay service: durable, staleness-bounded buffer of verified groups (async_vapo.services.replay).

    services/replay.py --config FILE [--run-dir DIR] [key.sub=value ...]
"""

import sys

from async_vapo.services.context import run_service


def _body(ctx, args):
    from async_vapo.services.replay import run_replay

    run_replay(ctx)


if __name__ == "__main__":
    sys.exit(run_service("replay", None, _body))
