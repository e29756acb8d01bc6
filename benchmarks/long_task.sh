#!/usr/bin/env bash
# The long-response task (configs/tiny_long_cpu.toml): one VAPO run of the one-process trainer, timed, with its
# base model's build time and held-out accuracy before and after.
#   bash benchmarks/long_task.sh [key.sub=value ...]
# Writes benchmarks/results/long_task/{make_base.json,metrics.jsonl,summary.json,samples.jsonl,curves.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
name=${BENCH_NAME:-long_task}
out="benchmarks/results/$name"
mkdir -p "$out"
# The base model (and the critic's reward-like head) are built once and cached; their build is timed here and
# is not part of the training run's wall-clock.
t0=$(date +%s)
paths=$(.venv/bin/async-vapo make-base --config configs/tiny_long_cpu.toml "$@")
base=${paths%%$'\n'*}
printf '{"make_base_wall_s": %s, "base_model": "%s"}\n' "$(( $(date +%s) - t0 ))" "$base" > "$out/make_base.json"
cp "$base/async_vapo_base.json" "$out/base_model.json"
.venv/bin/async-vapo train --config configs/tiny_long_cpu.toml train.name="$name" \
  train.output_dir='benchmarks/results/{name}' train.checkpoint_every=0 train.max_minutes=null "$@"
.venv/bin/async-vapo plot "$out" --out "$out/curves.png"
rm -rf "$out/checkpoints"
cat "$out/summary.json"
