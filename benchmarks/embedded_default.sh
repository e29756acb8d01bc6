#!/usr/bin/env bash
# The embedded default's learning result: held-out accuracy of the tiny model before and after VAPO,
# on this machine, within train.max_minutes of wall-clock (engine start included).
#   bash benchmarks/embedded_default.sh [key.sub=value ...]
# Writes benchmarks/results/embedded_default/{metrics.jsonl,summary.json,samples.jsonl,curves.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
name=${BENCH_NAME:-embedded_default}
# The base model is built once and cached (not part of the timed run).
.venv/bin/async-vapo make-base --config configs/tiny_cpu.toml "$@"
rm -rf "benchmarks/results/$name"  # this measurement replaces the last (a run there would send it to $name-2)
.venv/bin/async-vapo train --config configs/tiny_cpu.toml train.name="$name" \
  train.output_dir='benchmarks/results/{name}' train.checkpoint_every=0 "$@"
.venv/bin/async-vapo plot "benchmarks/results/$name" --out "benchmarks/results/$name/curves.png"
rm -rf "benchmarks/results/$name/checkpoints"
cat "benchmarks/results/$name/summary.json"
