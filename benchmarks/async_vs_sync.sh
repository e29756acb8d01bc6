#!/usr/bin/env bash
# Async vs sync on the services: the embedded default with the same fixed split of the machine (rollout
# engine pinned to one core, learner to the other: async.rollout_devices = async.learner_devices = 1), run
# once per staleness bound. Each run keeps metrics.jsonl (learner rows, held-out evals) and stats/ (busy
# intervals per stage, peak memory per service); `async-vapo report` turns them into figures.
#   bash benchmarks/async_vs_sync.sh [key.sub=value ...]      (BOUNDS="0 1 2 4" STEPS=30 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
out=benchmarks/results/async_vs_sync
BOUNDS=${BOUNDS:-"0 1 2 4"}
STEPS=${STEPS:-30}
mkdir -p "$out"
echo "BOUNDS=\"$BOUNDS\" STEPS=$STEPS bash benchmarks/async_vs_sync.sh $*" > "$out/command.txt"
.venv/bin/async-vapo make-base --config configs/tiny_cpu.toml "$@" > /dev/null
for s in $BOUNDS; do
  run="$out/staleness_$s"
  rm -rf "$run"
  echo "[async_vs_sync] max_staleness=$s -> $run" >&2
  bash deploy/start_cluster.sh --config configs/tiny_cpu.toml --run-dir "$run" --wait -- \
    async.max_staleness="$s" async.rollout_devices=1 async.learner_devices=1 train.total_steps="$STEPS" \
    train.eval_every=10 train.checkpoint_every=0 train.max_minutes=null "$@"
  rm -rf "$run/checkpoints" "$run/replay" "$run/pids" "$run/weights"
done
.venv/bin/async-vapo report "$out"
