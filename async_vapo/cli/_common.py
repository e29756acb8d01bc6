"""What the commands share: the config arguments, overrides anywhere on the line, and the one-line error.

A command module registers its subparser with ``add_parser(sub)`` (which sets ``run``, the function that
carries the command out) and raises :class:`CommandError` for anything a user can fix; ``main`` prints it,
like a :class:`~async_vapo.config.ConfigError` or an unreadable file, as one line on stderr and exits 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path


class CommandError(Exception):
    """A bad input the user can fix (a path, a file, a combination of options): one line, exit status 2."""


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", metavar="FILE", help="TOML file (repeat to layer several)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="overrides applied after the files (anywhere on the line)")


def is_override(token: str) -> bool:
    """``algo.eps_high=0.3``: a ``key=value`` token that is not an option."""
    return "=" in token and not token.startswith("-")


def take_override(args: argparse.Namespace, name: str) -> None:
    """A positional slot that argparse filled with an override (``eval a.b=1``): move it to the overrides."""
    value = getattr(args, name)
    if value and is_override(value) and not Path(value).exists():
        args.overrides = [value, *(args.overrides or [])]
        setattr(args, name, None)


def load(args: argparse.Namespace, files: list[str] | None = None):
    from async_vapo.config import load_config

    return load_config(args.config or [] if files is None else files, args.overrides or [])


def existing_dir(path: str, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise CommandError(f"{what} {path}: no such directory")
    if not p.is_dir():
        raise CommandError(f"{what} {path}: not a directory")
    return p
