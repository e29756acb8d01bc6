"""``async-vapo export``: a learner checkpoint's policy or critic (any number of ranks) as an HF directory; a LoRA
policy as a PEFT adapter directory, or with ``--merge`` as the merged HF model.

An existing OUT is replaced only with ``--force``, and never when it is a file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from async_vapo.cli._common import CommandError, existing_dir


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("export", help="a learner checkpoint (any number of ranks) -> an HF directory")
    p.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N")
    p.add_argument("out", help="directory to write (an existing one only with --force)")
    p.add_argument("--model", choices=["policy", "critic"], default="policy")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA policy (model.lora) as the merged HF model; without it, as a PEFT adapter directory "
                        "(a LoRA critic is always merged)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    ckpt = existing_dir(args.checkpoint, "checkpoint")
    meta = ckpt / "hf_meta" / args.model / "config.json"
    if not (ckpt / "dcp").is_dir() or not meta.is_file():  # before torch is imported: a quick, clear refusal
        raise CommandError(f"checkpoint {args.checkpoint}: not a learner checkpoint with a {args.model} (needs dcp/ "
                           f"and {meta.relative_to(ckpt)})")
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise CommandError(f"OUT {args.out}: a file; export writes a directory")
    if out.exists() and not args.force:
        raise CommandError(f"OUT {args.out} exists; --force replaces it")
    from async_vapo.learner.export import export

    print(export(ckpt, out, args.model, args.dtype, merge=args.merge))
    return 0
