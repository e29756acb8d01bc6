"""``async-vapo train``: the one-process trainer (rollout -> verify -> learn), synchronously."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from async_vapo.cli._common import CommandError, add_config_args, existing_dir, load


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="one-process trainer (rollout -> verify -> learn)")
    add_config_args(p)
    run_rule = p.add_mutually_exclusive_group()
    run_rule.add_argument("--resume", metavar="CKPT|auto",
                          help="continue from this checkpoint (runs/NAME/checkpoints/step_N), or 'auto': from the "
                               "run directory's newest one (an error if it cannot be continued)")
    run_rule.add_argument("--new-run", action="store_true",
                          help="start a new run in a directory that holds none (runs/NAME-2, ...)")
    p.add_argument("--no-check", action="store_true",
                   help="skip async-vapo check's checks before the start (data files, answer format, model, disk)")
    p.set_defaults(run=run)
    return p


def _exit_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so that ``finally`` blocks run: the trainer then closes its vLLM
    engine, whose processes would otherwise outlive it (vLLM's engine core does not watch its parent)."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _check(cfg) -> None:
    """``async-vapo check --for train``: every problem it finds, before a run directory is claimed or a model built."""
    from async_vapo.cli.check import check

    problems = check(cfg, app="train").problems
    if len(problems) == 1:
        raise CommandError(f"{problems[0]} (found by the check before the start; --no-check skips it)")
    if problems:
        raise CommandError(f"{len(problems)} problem(s) found before the start (async-vapo check; --no-check skips "
                           "it); nothing was started:\n  " + "\n  ".join(problems))


def run(args: argparse.Namespace) -> int:
    from async_vapo.learner.rundir import RunDirError, RunPlan, claim, plan_run

    cfg = load(args)
    if not args.no_check:
        _check(cfg)
    try:
        if args.resume and args.resume != "auto":
            existing_dir(args.resume, "--resume")
            plan = RunPlan(cfg.run_dir(), Path(args.resume), f"resuming {cfg.run_dir()} from {args.resume}")
        else:
            plan = plan_run(cfg, "train", "resume" if args.resume else "new" if args.new_run else "auto")
    except RunDirError as e:
        raise CommandError(str(e)) from None
    print(f"[run] {plan.message}", file=sys.stderr)
    cfg = claim(plan, cfg, "train")
    from async_vapo.trainer import train

    _exit_on_sigterm()
    summary = train(cfg, resume=None if plan.resume is None else str(plan.resume))
    print(json.dumps(summary, indent=2))
    return 0
