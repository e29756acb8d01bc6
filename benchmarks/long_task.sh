#!/usr/bin/env bash
# The long-response task (configs/tiny_long_cpu.toml): builds (or reuses) its base model, measures the base's
# held-out accuracy, and, when that lies in 10-40 %, times one VAPO run of the one-process trainer.
#   bash benchmarks/long_task.sh [key.sub=value ...]
# Writes benchmarks/results/long_task/{make_base.json,base_model.json,reward_critic.json,base_accuracy.json,
# metrics.jsonl,summary.json,samples.jsonl,curves.png}; exits 3 without training when the base is out of range.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# On a loaded machine one engine step can wait minutes for a core; vLLM kills an engine after 300 s by default.
export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=${VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS:-3600}
name=${BENCH_NAME:-long_task}
out="benchmarks/results/$name"
mkdir -p "$out"
# The base model and the critic's reward-like head are built once and cached; the build is timed here (zero when
# cached) and is not part of the training run's wall-clock.
t0=$(date +%s)
paths=$(.venv/bin/async-vapo make-base --config configs/tiny_long_cpu.toml "$@")
printf '{"make_base_wall_s": %s}\n' "$(( $(date +%s) - t0 ))" > "$out/make_base.json"
base=$(sed -n 1p <<< "$paths")
critic=$(sed -n 2p <<< "$paths")
cp "$base/async_vapo_base.json" "$out/base_model.json"
[ -z "$critic" ] || cp "$critic/async_vapo_reward_critic.json" "$out/reward_critic.json"
.venv/bin/python benchmarks/base_accuracy.py --config configs/tiny_long_cpu.toml --out "$out/base_accuracy.json" \
  --range 0.10,0.40 "$@" > /dev/null
.venv/bin/async-vapo train --config configs/tiny_long_cpu.toml train.name="$name" \
  train.output_dir='benchmarks/results/{name}' train.checkpoint_every=0 train.max_minutes=null "$@"
.venv/bin/async-vapo plot "$out" --out "$out/curves.png"
rm -rf "$out/checkpoints"
cat "$out/summary.json"
