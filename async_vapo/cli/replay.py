"""``async-vapo replay fsck``: check a replay log; ``--apply`` quarantines its damage and rewrites it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from async_vapo.cli._common import CommandError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("replay", help="the replay's log: fsck")
    replay_sub = p.add_subparsers(dest="replay_cmd", required=True)
    p_fsck = replay_sub.add_parser("fsck", help="report damaged records; --apply quarantines them and rewrites the "
                                                "log from the whole ones (stop the replay first)")
    p_fsck.add_argument("path", help="the log, e.g. runs/NAME/replay/groups.log")
    p_fsck.add_argument("--apply", action="store_true")
    p_fsck.set_defaults(run=run, parser=p_fsck)
    return p


def _log_path(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_dir():
        inside = [c for c in (p / "groups.log", p / "replay" / "groups.log") if c.is_file()]
        hint = f" (did you mean {inside[0]}?)" if inside else ""
        raise CommandError(f"{path}: a directory; give the log file{hint}")
    if not p.exists():
        raise CommandError(f"{path}: no such file")
    return p


def run(args: argparse.Namespace) -> int:
    import msgspec

    from async_vapo.replay.store import CorruptLogError, StoreLockedError, fsck

    try:
        report = fsck(_log_path(args.path), apply=args.apply)
    except (CorruptLogError, StoreLockedError) as e:
        raise CommandError(str(e)) from None
    print(json.dumps(msgspec.to_builtins(report), indent=2))
    if not report.clean:
        what = "quarantined in " + str(report.quarantine) if report.quarantine else "--apply quarantines it"
        print(f"async-vapo: {len(report.damaged)} damaged region(s), {report.groups_lost} group(s) lost; {what}",
              file=sys.stderr)
        return 0 if report.quarantine else 1
    return 0
