"""Verifier service: sandboxed answer checking between rollout and replay (async_vapo.services.verifier).

    services/verifier.py --config FILE [--run-dir DIR] [key.sub=value ...]
"""

import sys

from async_vapo.services.context import run_service


def _body(ctx, args):
    from async_vapo.services.verifier import run_verifier

    run_verifier(ctx)


if __name__ == "__main__":
    sys.exit(run_service("verifier", None, _body))
