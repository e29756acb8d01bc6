"""Cores follow the work on a CPU host (issue 46, item 1): CPU utilisation during the learner's updates on the
embedded default under deploy/start_cluster.sh, with the engines lending their cores (``cluster.deploy.lend_cpus``,
the default) and without (disjoint ``taskset`` slices, as before).

    .venv/bin/python benchmarks/cpu_lending.py [--minutes 3] [--out benchmarks/results/cpu_lending]
    .venv/bin/python benchmarks/cpu_lending.py --attach RUN_DIR --out DIR    # a cluster started elsewhere
    .venv/bin/python benchmarks/cpu_lending.py --config FILE --set KEY=VALUE ... --modes lend    # another config

Each mode runs ``configs/tiny_cpu.toml`` for ``--minutes`` of training (``train.max_minutes``), one after the other.
Every 0.5 s it samples ``/proc/stat`` (each core's busy share, every process of the machine) and the CPU seconds of
the learner's and the rollout's process trees (the vLLM engine core and its worker included; ``psutil``). The
samples that fall inside the learner's updates (``stats/learner-0.busy.jsonl``, stage ``learn``) give, per mode:
each core's busy share (machine-wide), the share of the machine's cores that the learner and the rollout used
(together and each), and the seconds per update (``metrics.jsonl``). Writes ``<mode>.json`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core."""
    out = []
    for line in Path("/proc/stat").read_text().splitlines():
        if re.match(r"cpu\d+ ", line):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + v[4]
            out.append((sum(v[:8]) - idle, sum(v[:8])))
    return out


def tree_seconds(pid: int | None) -> float:
    """CPU seconds of a process and its children (those alive now)."""
    if pid is None:
        return 0.0
    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def services_origin(pid: int) -> float | None:
    """The services' clock origin (start_cluster.sh's ``ASYNC_VAPO_T0``, in the learner's environment): the busy
    spans of ``stats/*.busy.jsonl`` count from it."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"ASYNC_VAPO_T0="):
            return float(kv.split(b"=", 1)[1])
    return None


def read_pid(run: Path, name: str) -> int | None:
    try:
        return int((run / "pids" / f"{name}.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_mode(lend: bool, minutes: float, out: Path, config: Path = REPO / "configs" / "tiny_cpu.toml",
             overrides: list[str] | None = None) -> dict:
    run = out / f"run-{'lend' if lend else 'disjoint'}"
    shutil.rmtree(run, ignore_errors=True)
    t0 = time.time()
    cmd = ["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config),
           "--run-dir", str(run), "--new-run", "--wait", "--", *(overrides or []), f"train.max_minutes={minutes}",
           f"cluster.deploy.lend_cpus={'true' if lend else 'false'}"]
    env = {**os.environ, "ASYNC_VAPO_T0": f"{t0:.6f}"}
    log = open(out / f"{run.name}.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    result = measure(run, lambda: proc.poll() is None, out, "lend_cpus" if lend else "disjoint",
                     {"minutes": minutes, "command": " ".join(cmd)})
    log.close()
    for d in ("checkpoints", "replay", "pids"):
        shutil.rmtree(run / d, ignore_errors=True)
    return result


def attach(run: Path, out: Path) -> dict:
    """Sample a cluster started by someone else (e.g. ``benchmarks/smollm2_learning.sh``'s NAME_services) from its
    learner's start until its ``DONE``; the mode is read from the run's resolved config."""
    while read_pid(run, "learner") is None or not (run / "config.resolved.json").exists():
        time.sleep(1.0)
    cfg = json.loads((run / "config.resolved.json").read_text())
    lend = cfg["cluster"]["deploy"]["lend_cpus"]
    last_alive = [time.time()]

    def running() -> bool:  # until DONE, or a minute with no learner process (a cluster that failed)
        pid = read_pid(run, "learner")
        if pid is not None and psutil.pid_exists(pid):
            last_alive[0] = time.time()
        return not (run / "DONE").exists() and time.time() - last_alive[0] < 60

    return measure(run, running, out, "lend_cpus" if lend else "disjoint",
                   {"minutes": cfg["train"]["max_minutes"], "command": f"attached to {run}"})


def measure(run: Path, running, out: Path, mode: str, meta: dict) -> dict:
    """Every 0.5 s while ``running()``: each core's busy share and the learner's and rollout's CPU seconds; then the
    figures over the samples inside the learner's ``learn`` spans, written to ``out/<mode>.json``."""
    samples = []
    prev = None
    t_origin = None
    while running():
        time.sleep(0.5)
        now, cores = time.time(), cpu_times()
        learner, rollout = tree_seconds(read_pid(run, "learner")), tree_seconds(read_pid(run, "rollout-0"))
        if t_origin is None and read_pid(run, "learner") is not None:
            t_origin = services_origin(read_pid(run, "learner"))
        if prev is not None and learner and rollout:
            dt = now - prev[0]
            samples.append({"t": now, "dt": dt,
                            "cores": [(b - pb) / max(1, t - pt)
                                      for (b, t), (pb, pt) in zip(cores, prev[1], strict=True)],
                            "learner": max(0.0, learner - prev[2]) / dt,
                            "rollout": max(0.0, rollout - prev[3]) / dt})
        prev = (now, cores, learner, rollout)
    if t_origin is None:
        raise SystemExit(f"the learner of {run} never started")
    spans = []
    busy = run / "stats" / "learner-0.busy.jsonl"
    for line in busy.read_text().splitlines() if busy.exists() else []:
        stage, a, b = json.loads(line)
        if stage == "learn":
            spans.append((t_origin + a, t_origin + b))
    inside = [s for s in samples if any(a <= s["t"] - s["dt"] / 2 <= b for a, b in spans)]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()] \
        if (run / "metrics.jsonl").exists() else []
    train = [r for r in rows if r["kind"] == "train"]
    ncpu = len(samples[0]["cores"]) if samples else os.cpu_count()

    def mean(xs):
        xs = list(xs)
        return sum(xs) / len(xs) if xs else float("nan")

    result = {
        "mode": mode, **meta, "ncpu": ncpu,
        "updates": len(train), "learn_spans": len(spans), "samples_in_updates": len(inside),
        "seconds_in_updates": sum(s["dt"] for s in inside),
        "core_busy_in_updates": [mean(s["cores"][i] for s in inside) for i in range(ncpu)],
        "ours_busy_in_updates": mean((s["learner"] + s["rollout"]) / ncpu for s in inside),
        "learner_cores_in_updates": mean(s["learner"] for s in inside),
        "rollout_cores_in_updates": mean(s["rollout"] for s in inside),
        "step_s_median": sorted(r["time/step_s"] for r in train)[len(train) // 2] if train else None,
        "learn_s_median": sorted(r["time/learn_s"] for r in train)[len(train) // 2] if train else None,
        "lent_forward_frac_mean": mean(r["cluster/lent_forward_frac"] for r in train
                                       if "cluster/lent_forward_frac" in r),
        "eval_versions": [r["version"] for r in rows if r["kind"] == "eval"],
        "last_version": max((r["version"] for r in train), default=None),
        "loadavg_after": os.getloadavg(),
    }
    (out / f"{result['mode']}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{result['mode']}.samples.json").write_text(json.dumps({"t_origin": t_origin, "learn_spans": spans,
                                                                   "samples": samples}) + "\n")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cpu_lending")
    p.add_argument("--modes", default="disjoint,lend")
    p.add_argument("--attach", type=Path, help="sample the cluster of this run directory instead of starting one")
    p.add_argument("--config", type=Path, default=REPO / "configs" / "tiny_cpu.toml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.attach:
        r = attach(a.attach, a.out)
        print(json.dumps(r), flush=True)
        return 0
    results = {}
    for mode in a.modes.split(","):
        r = run_mode(mode == "lend", a.minutes, a.out, a.config, a.set)
        results[r["mode"]] = r
        print(json.dumps({k: r[k] for k in ("mode", "updates", "core_busy_in_updates", "ours_busy_in_updates",
                                             "learner_cores_in_updates", "rollout_cores_in_updates",
                                             "learn_s_median", "lent_forward_frac_mean", "eval_versions")}),
              flush=True)
    (a.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
