"""The helpers ``deploy/start_cluster.sh`` calls (no torch import: they take well under a second).

    python -m async_vapo.deploy.launch plan [--config F] [--run-dir D] [--hostfile F] [overrides]
        the cluster plan as shell assignments; writes RUN_DIR/prometheus/{targets.json,prometheus.yml}
    python -m async_vapo.deploy.launch wait-health [--ca-file F | --insecure] [--user U --password-file F] URL T [PID]
    python -m async_vapo.deploy.launch memory-check [--config F] [--hostfile F] --gpus-per-host N [overrides]
        ``async-vapo plan``'s memory per learner rank and engine GPU for the placement ``plan`` computes (torch is not
        imported here either); exit 1 when the learner or an engine does not fit, 0 with a note when the model's
        shape is unknown (the embedded tiny model)

:func:`cluster_placement` is the one place the placement of a config and a hostfile is computed: the script's plan
and ``async-vapo plan --hostfile`` both call it, so they print the same table.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from async_vapo.config import Config, load_config
from async_vapo.config.cluster import SERVICES, keys_dir, metrics_port, service_host
from async_vapo.config.loader import ConfigError
from async_vapo.deploy.placement import Placement, PlacementError, parse_hostfile, place, shell_assignments
from async_vapo.metrics.prom import render_prometheus_config, write_file_sd_targets


def cluster_placement(cfg: Config, hostfile: str | Sequence[tuple[str, str]] | None,
                      gpus_per_host: int) -> tuple[Placement, list[tuple[str, str]]]:
    """The placement start_cluster.sh runs for ``cfg`` on ``hostfile`` (a path, or its parsed lines; None: this
    machine), and the hostfile's lines; raises PlacementError."""
    if isinstance(hostfile, str):
        lines = parse_hostfile(Path(hostfile).read_text(), hostfile)
    else:
        lines = list(hostfile or [])
    return place(cfg.async_.rollout_devices, cfg.async_.learner_devices,
                 tensor_parallel_size=cfg.rollout.tensor_parallel_size, gpus_per_host=gpus_per_host,
                 hostfile=lines, evaluator=cfg.cluster.evaluator.mode == "watch"), lines


def hosts_line(lines: Sequence[tuple[str, str]], gpus_per_host: int, source: str) -> str:
    """How ``plan`` names the cluster it placed on."""
    hosts = list(dict.fromkeys(h for h, _ in lines)) or ["localhost"]
    return f"{len(hosts)} host(s) x {gpus_per_host} GPU(s) ({source})"


def _memory_check(argv: Sequence[str]) -> int:
    """``memory-check``: the plan's memory report for the script's placement; 1 when something does not fit."""
    from async_vapo.deploy.scale import Cluster, report, resolve_shape

    p = argparse.ArgumentParser(prog="memory-check")
    p.add_argument("--config", action="append", default=[])
    p.add_argument("--hostfile")
    p.add_argument("--gpus-per-host", type=int, required=True)
    p.add_argument("--gpu-memory-gib", type=float, default=80.0)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        placement, lines = cluster_placement(cfg, args.hostfile, args.gpus_per_host)
    except (ConfigError, PlacementError) as e:
        print(e, file=sys.stderr)
        return 2
    try:
        shape, source = resolve_shape(cfg.model.path)
    except ValueError as e:
        print(f"# memory check skipped: {e}")
        return 0
    text, fits = report(cfg, placement, shape, source, Cluster(gpu_memory_gib=args.gpu_memory_gib),
                        hosts_line=hosts_line(lines, args.gpus_per_host, args.hostfile or "this machine"))
    print("\n".join(f"# {ln}" if ln else "#" for ln in text.splitlines()))
    if not fits:
        print("memory check: the learner or an engine does not fit its GPU (async-vapo plan --search lists the "
              "placements that do)", file=sys.stderr)
        return 1
    return 0


def _plan(argv: Sequence[str]) -> int:
    """Print the cluster plan as shell assignments and write RUN_DIR/prometheus/{targets.json,prometheus.yml}."""
    p = argparse.ArgumentParser(prog="plan")
    p.add_argument("--config", action="append", default=[])
    p.add_argument("--run-dir")
    p.add_argument("--scrape-interval", default="5s")
    p.add_argument("--resume", help="a checkpoint, or 'auto' (the run directory's newest)")
    p.add_argument("--new-run", action="store_true")
    p.add_argument("--hostfile", help="lines 'host role' (async_vapo.cluster.placement)")
    p.add_argument("--gpus-per-host", type=int, default=0, help="0: no GPU placement (CPU)")
    p.add_argument("--local-name", action="append", default=[], help="a name of this machine in the hostfile")
    p.add_argument("--local-addr", default="127.0.0.1", help="what the other hosts reach this machine at")
    p.add_argument("--dry-run", action="store_true", help="write nothing")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if args.run_dir:
        cfg.train.output_dir = str(Path(args.run_dir).resolve())
    cfg, resume = _choose_run_dir(cfg, args.resume, args.new_run, dry_run=args.dry_run)
    rd = cfg.run_dir().resolve()
    c = cfg.cluster
    n_roll = cfg.rollout_engines()
    try:
        placement, hostfile = cluster_placement(cfg, args.hostfile, args.gpus_per_host)
    except PlacementError as e:
        print(f"placement: {e}", file=sys.stderr)
        return 2
    rollout_hosts_override = ""
    local = {"localhost", "127.0.0.1", *args.local_name}
    if hostfile:
        c.hosts.rollout_hosts = [args.local_addr if e.host in local else e.host for e in placement.engines]
        rollout_hosts_override = "cluster.hosts.rollout_hosts=[" + ",".join(
            f'"{h}"' for h in c.hosts.rollout_hosts) + "]"
    targets = {s: [f"{service_host(cfg, s, i)}:{metrics_port(cfg, s, i)}"
                   for i in range(n_roll if s == "rollout" else 1)] for s in SERVICES}
    prom = rd / "prometheus"
    if not args.dry_run:
        write_file_sd_targets(prom / "targets.json", targets)
    interval = args.scrape_interval
    # Prometheus durations are integers with a unit: 80 % of an interval in seconds, in milliseconds
    timeout = f"{max(500, int(float(interval[:-1]) * 800))}ms" if interval[-1:] == "s" and interval[-2:] != "ms" \
        else interval
    tmpl = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "prometheus.yml.tmpl"
    http = c.metrics_http
    ca_file, password_file = (_absolute(x) for x in (http.tls_ca_file, http.basic_auth_password_file))
    if not args.dry_run:
        render_prometheus_config(tmpl, prom / "prometheus.yml", scrape_interval=interval, scrape_timeout=timeout,
                                 run_name=cfg.train.name, tls=http.tls_cert is not None, tls_ca_file=ca_file,
                                 basic_auth_user=http.basic_auth_user, basic_auth_password_file=password_file)
        for rules in Path(tmpl).parent.glob("alerts*.yml"):  # the template's rule_files: the alert rules beside it
            shutil.copy(rules, prom / rules.name)
    out = {"RUN_DIR": str(rd), "RESUME": resume, "TOTAL_STEPS": cfg.train.total_steps,
           "N_ROLLOUT": n_roll, "N_LEARNER": cfg.async_.learner_devices,
           "ROLLOUT_HOSTS_OVERRIDE": rollout_hosts_override, "PLACEMENT_TABLE": placement.describe(),
           "HEALTH_TIMEOUT": int(math.ceil(c.deploy.health_timeout_s)),
           "STOP_GRACE": int(math.ceil(c.deploy.stop_grace_s)),
           "POLICY_PATH": cfg.model.path or "", "CURVE": int(c.security.curve), "KEYS_DIR": str(keys_dir(cfg, rd)),
           "LEARNER_RDZV_PORT": c.ports.learner_rdzv_port, "LEND_CPUS": int(c.deploy.lend_cpus),
           "CONTINUOUS": int(cfg.rollout.generation == "continuous"), "EVALUATOR": c.evaluator.mode}
    for agent in placement.learners:  # what the other learner hosts reach each learner agent at
        out[f"ADDR_{agent.name.upper().replace('-', '_')}"] = args.local_addr if agent.host in local else agent.host
    scheme = "https" if http.tls_cert is not None else "http"
    for s in SERVICES:
        for i, t in enumerate(targets[s]):
            out[f"HEALTH_{s.upper()}_{i}"] = f"{scheme}://{t}/health"
    for k, v in out.items():
        print(f"{k}={_shell_quote(str(v))}")
    print("\n".join(shell_assignments(placement)))
    # wait-health's options for these services (a bash array: paths may hold spaces)
    opts = (["--ca-file", ca_file] if ca_file else ["--insecure"] if http.tls_cert is not None else []) + (
        ["--user", http.basic_auth_user, "--password-file", password_file] if password_file else [])
    print(f"HEALTH_OPTS=({' '.join(_shell_quote(str(o)) for o in opts)})")
    return 0


def _choose_run_dir(cfg: Config, resume: str | None, new_run: bool, *, dry_run: bool = False) -> tuple[Config, str]:
    """The run directory by ``async_vapo.learner.rundir``'s rule, said on stderr, and the checkpoint the learner
    resumes from ("" for none). A directory whose cluster still runs here is kept, so that start_cluster.sh
    refuses to start a second one in it. ``dry_run``: decide and say, but create and record nothing."""
    from async_vapo.learner.rundir import RunDirError, RunPlan, claim, plan_run, run_dirs

    rd = cfg.run_dir().resolve()
    for d in run_dirs(rd):
        if _cluster_alive(d):
            cfg.train.output_dir = str(d)
            return cfg, ""
    if resume and resume != "auto":
        plan = RunPlan(rd, Path(resume).resolve(), f"resuming {rd} from {resume}")
    else:
        try:
            plan = plan_run(cfg, "cluster", "resume" if resume else "new" if new_run else "auto", rd)
        except RunDirError as e:
            raise SystemExit(f"start_cluster: {e}") from None
    print(f"[start_cluster] {plan.would if dry_run else plan.message}", file=sys.stderr)
    resume_from = "" if plan.resume is None else str(plan.resume)
    if dry_run:
        cfg = cfg.model_copy(deep=True)
        cfg.train.output_dir = str(plan.run_dir)
        return cfg, resume_from
    return claim(plan, cfg, "cluster"), resume_from


def _cluster_alive(run_dir: Path) -> bool:
    """Whether a service started in ``run_dir`` on this machine still runs (its process group exists)."""
    for f in (run_dir / "pids").glob("*.pid"):
        if f.with_suffix(".host").exists():
            return True  # on another host: start_cluster.sh checks it over ssh
        try:
            os.killpg(int(f.read_text().strip()), 0)
            return True
        except PermissionError:
            return True
        except (ValueError, ProcessLookupError):
            continue
    return False


def _absolute(path: str | None) -> str | None:
    return None if path is None else str(Path(path).expanduser().resolve())


def _shell_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


def _wait_health(argv: Sequence[str]) -> int:
    """``wait-health [--ca-file F | --insecure] [--user U --password-file F] URL TIMEOUT_S [PID]``: 0 once URL
    answers 200; 1 on timeout or when PID has exited. The options are the plan's ``HEALTH_OPTS``: how to verify
    an https server, and the basic auth credentials."""
    import base64
    import ssl
    import urllib.error
    import urllib.request

    p = argparse.ArgumentParser(prog="wait-health")
    p.add_argument("url")
    p.add_argument("timeout_s", type=float)
    p.add_argument("pid", type=int, nargs="?")
    p.add_argument("--ca-file", help="verify an https server against this CA (or self-signed certificate)")
    p.add_argument("--insecure", action="store_true", help="https without verifying the server")
    p.add_argument("--user", help="basic auth user (with --password-file)")
    p.add_argument("--password-file", help="file holding the basic auth password (surrounding whitespace ignored)")
    args = p.parse_args(argv)
    context = None
    if args.url.startswith("https:"):
        context = ssl.create_default_context(cafile=args.ca_file)
        if args.insecure:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    headers = {}
    if args.user is not None:
        password = Path(args.password_file).read_text().strip()
        headers["Authorization"] = "Basic " + base64.b64encode(f"{args.user}:{password}".encode()).decode()
    url, timeout_s, pid = args.url, args.timeout_s, args.pid
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2,
                                        context=context) as r:
                if r.status == 200:
                    return 0
        except (urllib.error.URLError, OSError):
            pass
        if pid is not None:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print(f"process {pid} exited before {url} became healthy", file=sys.stderr)
                return 1
            except PermissionError:
                pass
        time.sleep(0.5)
    print(f"{url} not healthy after {timeout_s:g} s", file=sys.stderr)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": _plan, "wait-health": _wait_health, "memory-check": _memory_check}
    if not argv or argv[0] not in commands:
        print("usage: python -m async_vapo.deploy.launch {plan [--config F] [--run-dir D] [overrides]"
              " | wait-health [--ca-file F | --insecure] [--user U --password-file F] URL TIMEOUT_S [PID]"
              " | memory-check [--config F] [--hostfile F] --gpus-per-host N [--gpu-memory-gib G] [overrides]}",
              file=sys.stderr)
        return 2
    return commands[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
