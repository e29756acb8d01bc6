#!/usr/bin/env bash
# Held-out accuracy against wall-clock with paired seeds: the services with continuous generation and in-flight
# weight updates (rollout.weight_update = keep; keep_idle: with cluster.rollout.eval_when = idle), the same with
# updates between requests (wait), the services with lock-step calls, and the one-process trainer on every core; then
# benchmarks/continuous_seeds.py compares them at equal wall-clock and writes the table and the plot.
#   bash benchmarks/continuous_seeds.sh [key.sub=value ...]
#   (CONFIG=configs/tiny_cpu.toml SEEDS="1 2 3" STEPS=40 EVAL_EVERY=10 RUNS="one_process keep wait lockstep"
#    OUT=benchmarks/results/continuous_seeds by default)
# Resumable: a run that finished (its summary.json) is kept and skipped, an unfinished one starts over, so a study too
# long for one sitting is run seed by seed into the same OUT (FRESH=1 reruns finished runs too); command.txt logs
# every invocation.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
CONFIG=${CONFIG:-configs/tiny_cpu.toml}
out=${OUT:-benchmarks/results/continuous_seeds}
SEEDS=${SEEDS:-"1 2 3"}
STEPS=${STEPS:-40}
EVAL_EVERY=${EVAL_EVERY:-10}
RUNS=${RUNS:-"one_process keep wait lockstep"}
mkdir -p "$out"
echo "CONFIG=$CONFIG SEEDS=\"$SEEDS\" STEPS=$STEPS EVAL_EVERY=$EVAL_EVERY RUNS=\"$RUNS\" OUT=$out" \
  "bash benchmarks/continuous_seeds.sh $*    # $(date -u +%FT%TZ)" >> "$out/command.txt"
.venv/bin/async-vapo make-base --config "$CONFIG" "$@" > /dev/null
common=(train.total_steps="$STEPS" train.eval_every="$EVAL_EVERY" train.checkpoint_every=0 train.max_minutes=null)
for seed in $SEEDS; do
  for what in $RUNS; do
    run="$out/${what}_seed$seed"
    if [ -f "$run/summary.json" ] && [ -z "${FRESH:-}" ]; then
      echo "[continuous_seeds] $what, train.seed=$seed: finished before, kept ($run)" >&2
      continue
    fi
    rm -rf "$run"
    echo "[continuous_seeds] $what, train.seed=$seed -> $run" >&2
    if [ "$what" = one_process ]; then
      .venv/bin/async-vapo train --config "$CONFIG" train.name="${what}_seed$seed" "train.output_dir=$out/{name}" \
        train.seed="$seed" train.threads=0 "${common[@]}" "$@"
    else
      case $what in
        keep|wait|abort) gen=(rollout.generation=continuous rollout.weight_update="$what") ;;
        keep_idle) gen=(rollout.generation=continuous rollout.weight_update=keep cluster.rollout.eval_when=idle) ;;
        lockstep) gen=(rollout.generation=lockstep) ;;
        *) echo "unknown run $what (one_process, keep, keep_idle, wait, abort, lockstep)" >&2; exit 2 ;;
      esac
      bash deploy/start_cluster.sh --config "$CONFIG" --run-dir "$run" --wait -- \
        train.seed="$seed" "${common[@]}" "${gen[@]}" "$@"
    fi
    rm -rf "$run/checkpoints" "$run/replay" "$run/pids" "$run/weights" "$run/keys" "$run/supervisor"
  done
done
.venv/bin/python benchmarks/continuous_seeds.py "$out"
