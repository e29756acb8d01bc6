#!/usr/bin/env bash
# The embedded default on the services (rollout, verifier, replay, learner as separate processes over
# ZeroMQ), with configs/tiny_cpu.toml's async.max_staleness (1).
#   bash benchmarks/cluster_default.sh [key.sub=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
name=${BENCH_NAME:-cluster_default}
run="benchmarks/results/$name"
rm -rf "$run"
bash deploy/start_cluster.sh --config configs/tiny_cpu.toml --run-dir "$run" --wait -- "$@"
rm -rf "$run/checkpoints" "$run/replay" "$run/pids"
.venv/bin/async-vapo plot "$run" benchmarks/results/embedded_default --out "$run/curves.png"
