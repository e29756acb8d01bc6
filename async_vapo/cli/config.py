"""``async-vapo config``: print the resolved config as JSON."""

from __future__ import annotations

import argparse
import json

from async_vapo.cli._common import add_config_args, load


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("config", help="print the resolved config as JSON")
    add_config_args(p)
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    print(json.dumps(load(args).model_dump(mode="json", by_alias=True), indent=2))
    return 0
