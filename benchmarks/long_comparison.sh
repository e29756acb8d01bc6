#!/usr/bin/env bash
# The comparison on the long-response task, with its budgets fixed here before the first run:
# VAPO, PPO (lambda 0.95, no value pretraining), GRPO and DAPO at 3 seeds, and VAPO without value pretraining,
# decoupled GAE or length-adaptive GAE at 2 seeds (VAPO's seeds 0 and 1 serve both tables): 18 runs of
# 30 updates x 256 responses (configs/tiny_long_cpu.toml; VAPO also generates 10 x 256 for value pretraining,
# DAPO up to 4 more rounds per update for its dynamic sampling), held-out accuracy every 5 updates, two runs at a
# time, each on one thread: about 5 hours on this 2-core machine (a run alone: GRPO ~10 min, VAPO ~20). Seed 0 of
# every arm runs first. Resumable: finished runs (summary.json) are skipped and an unfinished one starts over, so
# after an interruption run the same command again.
#   bash benchmarks/long_comparison.sh            # then: .venv/bin/async-vapo experiment report --out ...
# Writes benchmarks/results/long_comparison/{RUN_sSEED/, comparison.md, ablation.md, *.png, result.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# On a loaded machine one engine step can wait minutes for a core; vLLM kills an engine after 300 s by default.
export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=${VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS:-3600}
.venv/bin/async-vapo make-base --config configs/tiny_long_cpu.toml
exec .venv/bin/async-vapo experiment run --vapo-config configs/tiny_long_cpu.toml --arms-dir configs/long \
  --ablations no_value_pretrain,no_decoupled_gae,no_length_adaptive_gae \
  --seeds 0,1,2 --ablation-seeds 0,1 --steps 30 --eval-every 5 --parallel 2 \
  --out benchmarks/results/long_comparison "$@"
