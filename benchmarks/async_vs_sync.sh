#!/usr/bin/env bash
# Async vs sync on the services: a config (the embedded default unless CONFIG says) with the same fixed split of
# the machine (rollout engine pinned to one core, learner to the other: async.rollout_devices =
# async.learner_devices = 1), run once per staleness bound; with ONE_PROCESS=1 (the default) first the one-process
# trainer on every core (train.threads = 0), the best synchronous configuration. Each run keeps metrics.jsonl
# (learner rows, held-out evals) and the services' stats/ (busy intervals per stage, peak memory per service);
# `async-vapo report` turns them into figures. The BOUNDS runs generate lock-step (rollout.generation=lockstep,
# whatever the config says); CONTINUOUS_BOUNDS (none by default) runs those bounds again with continuous generation
# (rollout.generation=continuous, its weight_update as configured), as staleness_<s>_continuous, side by side.
#   bash benchmarks/async_vs_sync.sh [key.sub=value ...]
#   (CONFIG=configs/tiny_cpu.toml BOUNDS="0 1 2 4" CONTINUOUS_BOUNDS="" STEPS=30 EVAL_EVERY=10 ONE_PROCESS=1
#    OUT=benchmarks/results/async_vs_sync by default)
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
CONFIG=${CONFIG:-configs/tiny_cpu.toml}
out=${OUT:-benchmarks/results/async_vs_sync}
BOUNDS=${BOUNDS:-"0 1 2 4"}
CONTINUOUS_BOUNDS=${CONTINUOUS_BOUNDS:-}
STEPS=${STEPS:-30}
EVAL_EVERY=${EVAL_EVERY:-10}
ONE_PROCESS=${ONE_PROCESS:-1}
mkdir -p "$out"
echo "CONFIG=$CONFIG BOUNDS=\"$BOUNDS\" CONTINUOUS_BOUNDS=\"$CONTINUOUS_BOUNDS\" STEPS=$STEPS EVAL_EVERY=$EVAL_EVERY ONE_PROCESS=$ONE_PROCESS OUT=$out" \
  "bash benchmarks/async_vs_sync.sh $*" > "$out/command.txt"
.venv/bin/async-vapo make-base --config "$CONFIG" "$@" > /dev/null
if [ "$ONE_PROCESS" = 1 ]; then
  rm -rf "$out/one_process"
  echo "[async_vs_sync] one process, every core -> $out/one_process" >&2
  .venv/bin/async-vapo train --config "$CONFIG" train.name=one_process "train.output_dir=$out/{name}" \
    train.total_steps="$STEPS" train.eval_every="$EVAL_EVERY" train.checkpoint_every=0 train.max_minutes=null \
    train.threads=0 "$@"
  rm -rf "$out/one_process/checkpoints"
fi
cluster_run() {  # run-dir max_staleness [key.sub=value ...]
  local run=$1 s=$2
  shift 2
  rm -rf "$run"
  echo "[async_vs_sync] max_staleness=$s $* -> $run" >&2
  bash deploy/start_cluster.sh --config "$CONFIG" --run-dir "$run" --wait -- \
    async.max_staleness="$s" async.rollout_devices=1 async.learner_devices=1 train.total_steps="$STEPS" \
    train.eval_every="$EVAL_EVERY" train.checkpoint_every=0 train.max_minutes=null "$@"
  rm -rf "$run/checkpoints" "$run/replay" "$run/pids" "$run/weights" "$run/keys" "$run/supervisor"
}
for s in $BOUNDS; do
  cluster_run "$out/staleness_$s" "$s" "$@" rollout.generation=lockstep
done
for s in $CONTINUOUS_BOUNDS; do
  cluster_run "$out/staleness_${s}_continuous" "$s" "$@" rollout.generation=continuous
done
.venv/bin/async-vapo report "$out"
