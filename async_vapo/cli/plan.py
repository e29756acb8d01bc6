"""``async-vapo plan``: placement, memory per learner rank / engine GPU, weight-sync arithmetic and estimated step
time of a config (``async_vapo/deploy/scale.py`` states every assumption); ``--search`` lists the placements that
fit, fastest first, with the config overrides of the best.

The placement is the one ``deploy/start_cluster.sh`` runs (``async_vapo.deploy.launch.cluster_placement``): from
``--hostfile`` (the script's own) or, with ``--hosts N``, from the hostfile ``deploy/slurm/async_vapo.sbatch``
writes (replay and verifier on the first host, the learner on as few hosts as hold its ranks, engines on every
host).

Exit status 1 whenever the plan does not fit, whatever the reason: the placement itself (more engines or ranks than
the hosts' GPUs), a learner rank's or an engine's GPU memory, or a learner host's memory (``--host-memory-gib``, by
default a DGX's 2 TiB, or this machine's when every host of ``--hostfile`` is this one); 2 for a bad input.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from async_vapo.cli._common import CommandError, add_config_args, load, take_override


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="placement, memory per learner rank / engine GPU, weight sync and step time; "
                                    "--search ranks the placements that fit (async_vapo/deploy/scale.py)")
    p.add_argument("config_file", nargs="?", metavar="CONFIG", help="a config file (the same as --config CONFIG)")
    add_config_args(p)
    p.add_argument("--hosts", type=int, help="hosts of the cluster (without --hostfile)")
    p.add_argument("--hostfile", help="start_cluster.sh's hostfile ('host role' lines): plan what the script runs")
    p.add_argument("--gpus-per-host", type=int, required=True)
    p.add_argument("--gpu-memory-gib", type=float, help="memory of one GPU (default: --gpu's, 80 for h100-80g)")
    p.add_argument("--host-memory-gib", type=float,
                   help="memory of a learner host, which holds its ranks' offloaded state (learner.cpu_offload); "
                        "default: a DGX's 2048, or this machine's when --hostfile names this machine alone")
    p.add_argument("--gpu", default="h100-80g", help="published figures for the step time without --profile: "
                                                     "a100-80g, h100-80g, h200 (default h100-80g)")
    p.add_argument("--profile", help="JSON of measured rates: generation_tokens_per_s_per_gpu, "
                                     "learner_tokens_per_s_per_gpu (scale.Profile)")
    p.add_argument("--bandwidth-gb-s", type=float, default=50.0,
                   help="learner -> engine bandwidth in GB/s (default 50: one 400 Gb/s NIC)")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="longest prompt (default 1024)")
    p.add_argument("--mean-response-tokens", type=int,
                   help="mean response length for the step time (default: half of rollout.max_response_tokens)")
    p.add_argument("--model-config", help="the model's config.json when model.path has none")
    p.add_argument("--search", action="store_true", help="list the placements that fit, fastest first")
    p.add_argument("--top", type=int, default=10, help="rows --search prints (default 10)")
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    from async_vapo.config import ConfigError
    from async_vapo.deploy.launch import cluster_placement, hosts_line
    from async_vapo.deploy.placement import PlacementError
    from async_vapo.deploy.scale import GPUS, Cluster, Profile, report, resolve_shape, search_hostfile, search_report

    take_override(args, "config_file")
    if (args.hosts is None) == (args.hostfile is None):
        raise CommandError("give --hosts N or --hostfile FILE (one of them)")
    if args.hosts is not None and args.hosts < 1 or args.gpus_per_host < 1:
        raise CommandError("--hosts and --gpus-per-host must be >= 1")
    if args.gpu not in GPUS:
        raise CommandError(f"--gpu must be one of {', '.join(GPUS)}, got {args.gpu!r}")
    cfg = load(args, [*([args.config_file] if args.config_file else []), *(args.config or [])])
    try:
        shape, source = resolve_shape(cfg.model.path, args.model_config)
        host_gib, host_source = _host_memory(args)
        cl = Cluster(gpu_memory_gib=args.gpu_memory_gib or GPUS[args.gpu].memory_gib,
                     host_memory_gib=host_gib, host_memory_source=host_source,
                     bandwidth_gbytes_s=args.bandwidth_gb_s, prompt_tokens=args.prompt_tokens,
                     mean_response_tokens=args.mean_response_tokens, gpu=args.gpu,
                     profile=Profile.load(args.profile) if args.profile else None)
        if args.search:
            if args.hostfile:
                raise CommandError("--search places on --hosts N (it writes the hostfile of its best placement)")
            text, fits = search_report(cfg, shape, source, cl, hosts=args.hosts, gpus_per_host=args.gpus_per_host,
                                       top=args.top)
        else:
            # --hosts: the learner on as few hosts as hold its ranks (ASYNC_VAPO_LEARNER_NODES of the Slurm script)
            k = min(args.hosts, -(-cfg.async_.learner_devices // args.gpus_per_host)) if args.hosts else 0
            placement, lines = cluster_placement(cfg, search_hostfile(args.hosts, k) if k else args.hostfile,
                                                 args.gpus_per_host)
            where = args.hostfile or (f"--hosts: the learner on the first {k} host(s), replay and verifier on "
                                      "the first; engines on every host")
            text, fits = report(cfg, placement, shape, source, cl,
                                hosts_line=hosts_line(lines, args.gpus_per_host, where))
    except PlacementError as e:  # the shape does not fit the hosts: "does not fit", as a memory that does not
        print(f"DOES NOT FIT: {e}")
        return 1
    except (ValueError, OSError) as e:
        if isinstance(e, ConfigError):
            raise
        raise CommandError(str(e)) from None
    print(text)
    return 0 if fits else 1


def _host_memory(args: argparse.Namespace) -> tuple[float, str]:
    """A learner host's memory in GiB and where the figure comes from."""
    import os
    import socket

    from async_vapo.deploy.scale import DEFAULT_HOST_MEMORY_GIB

    if args.host_memory_gib is not None:
        if args.host_memory_gib <= 0:
            raise CommandError("--host-memory-gib must be > 0")
        return args.host_memory_gib, "--host-memory-gib"
    if args.hostfile:
        from async_vapo.deploy.placement import parse_hostfile

        hosts = {h for h, _ in parse_hostfile(Path(args.hostfile).read_text(), args.hostfile)}
        if hosts <= {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, "this machine's"
    return DEFAULT_HOST_MEMORY_GIB, "a DGX's 2 TiB, the default; --host-memory-gib for yours"
