"""First run: `make cluster`'s command on a cold model cache, timed to its first training step.

    .venv/bin/python benchmarks/first_run.py [--steps 2] [--port-base 17700] [--out benchmarks/results/first_run]

Runs ``deploy/start_cluster.sh --config configs/tiny_cpu.toml --wait`` (what ``make cluster`` runs) with
``model.cache_dir`` an empty temporary directory and a new run directory, ``train.total_steps`` = ``--steps``
and the ports moved to ``--port-base`` + k (so that it does not collide with another cluster on the machine).
Every line the command prints is kept with the seconds since the start (``terminal.log``); ``result.json`` has
the seconds to the base model and critic being ready, to all services healthy, to the first row of
``metrics.jsonl`` of each kind (eval, value pretraining, training update) and to the end, with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PORTS = ("verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
         "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port", "rollout_metrics_port")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--port-base", type=int, default=17700)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_run"))
    p.add_argument("--timeout-s", type=float, default=1800)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="first-run-"))
    cache, run = tmp / "cache", tmp / "run"
    overrides = [f"model.cache_dir={cache}", f"train.total_steps={args.steps}", f"train.eval_every={args.steps}"]
    overrides += [f"cluster.ports.{name}={args.port_base + i}" for i, name in enumerate(PORTS)]
    cmd = ["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(REPO / "configs" / "tiny_cpu.toml"),
           "--run-dir", str(run), "--wait", "--", *overrides]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        buf = ""
        while chunk := proc.stdout.read(1):
            if chunk in "\r\n":
                if buf.strip():
                    lines.append((time.perf_counter() - t0, buf))
                    print(f"[{lines[-1][0]:6.1f}s] {buf}", flush=True)
                buf = ""
            else:
                buf += chunk

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first: dict[str, float] = {}
    metrics = run / "metrics.jsonl"
    while proc.poll() is None and time.perf_counter() - t0 < args.timeout_s:
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                kind = json.loads(line)["kind"]
                first.setdefault(kind, round(time.perf_counter() - t0, 1))
        time.sleep(0.5)
    if proc.poll() is None:
        proc.terminate()
        subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run)], check=False)
    reader.join(timeout=10)

    def at(text: str) -> float | None:
        return next((round(t, 1) for t, line in lines if text in line), None)

    result = {"command": " ".join(["benchmarks/first_run.py", *sys.argv[1:]]), "returncode": proc.wait(),
              "cold_model_cache": True, "steps": args.steps, "nproc": os.cpu_count(),
              "loadavg_at_start": [round(x, 2) for x in load0],
              "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
              "base_model_ready_s": at("[make-base] base model"),
              "critic_ready_s": at("[make-base] reward-like critic"),
              "all_services_healthy_s": at("all services up"),
              "first_row_s": {k: first.get(k) for k in ("eval", "pretrain", "train")},
              "total_s": round(time.perf_counter() - t0, 1)}
    (out / "terminal.log").write_text("".join(f"[{t:6.1f}s] {line}\n" for t, line in lines))
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
