"""``async-vapo plan``: placement, memory per learner / engine GPU and weight-sync arithmetic of a config.

The config is given with ``--config`` like every other command; the positional form (``plan CONFIG``) is kept.
"""

from __future__ import annotations

import argparse

from async_vapo.cli._common import CommandError, add_config_args, load, take_override


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="placement, memory per learner / engine GPU and weight-sync arithmetic "
                                    "(async_vapo/deploy/scale.py states every assumption)")
    p.add_argument("config_file", nargs="?", metavar="CONFIG", help="a config file (the same as --config CONFIG)")
    add_config_args(p)
    p.add_argument("--hosts", type=int, required=True)
    p.add_argument("--gpus-per-host", type=int, required=True)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0, help="memory of one GPU (default 80)")
    p.add_argument("--bandwidth-gb-s", type=float, default=50.0,
                   help="learner -> engine bandwidth in GB/s (default 50: one 400 Gb/s NIC)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="longest prompt (default 1024)")
    p.add_argument("--model-config", help="the model's config.json when model.path has none")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from async_vapo.config import ConfigError
    from async_vapo.deploy.placement import PlacementError
    from async_vapo.deploy.scale import report

    take_override(args, "config_file")
    if args.hosts < 1 or args.gpus_per_host < 1:
        raise CommandError("--hosts and --gpus-per-host must be >= 1")
    cfg = load(args, [*([args.config_file] if args.config_file else []), *(args.config or [])])
    try:
        print(report(cfg, hosts=args.hosts, gpus_per_host=args.gpus_per_host, gpu_memory_gib=args.gpu_memory_gib,
                     bandwidth_gbytes_s=args.bandwidth_gb_s, prompt_tokens=args.prompt_tokens,
                     model_config=args.model_config))
    except (PlacementError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise CommandError(str(e)) from None
    return 0
