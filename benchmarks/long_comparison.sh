#!/usr/bin/env bash
# The comparison on the long-response task, second round, its settings and criterion fixed here before its first run:
#   * arms: VAPO (configs/tiny_long_cpu.toml as it is: the linear critic head, value pretraining that stops on its
#     held-out plateau), GRPO and DAPO (configs/long/baselines), and VAPO without value pretraining, decoupled GAE,
#     length-adaptive GAE or the positive-example LM loss (configs/long/ablations), every arm at seeds 0, 1 and 2:
#     21 runs. PPO is not rerun (the first round has it).
#   * budget: 30 updates x 256 responses per run (VAPO also generates its value-pretraining responses, DAPO up to 4
#     more rounds per update for its dynamic sampling), held-out accuracy every 5 updates, two runs at a time, each
#     on one thread. VAPO, GRPO and DAPO run first (seed by seed), then the ablation rows.
#   * criterion: a run's final accuracy is the mean of its last two held-out evaluations. VAPO's gain over GRPO
#     (and over DAPO) is paired by seed, d_s = final(VAPO, s) - final(GRPO, s); it is beyond the pairs' spread
#     when the one-sided 95 % t lower bound of the mean, mean(d) - 2.920 sd(d) / sqrt(3), is above 0
#     (comparison.md, "beyond the spread"). Each ablation row is read the same way against VAPO (ablation.md, last
#     column).
# Everything reruns: the long task's base model has changed since the first round (base_model.sft_min_ops = 4),
# so no earlier run starts where these do. The first round (old base model, PPO included, three ablation rows at
# seeds 0 and 1) is in benchmarks/results/long_comparison/.
# Resumable: finished runs (summary.json) are skipped and an unfinished one starts over, so after an interruption run
# the same command again; each session can add runs.
#   bash benchmarks/long_comparison.sh            # then: .venv/bin/async-vapo experiment report --out ...
# Writes benchmarks/results/long_comparison_2/{RUN_sSEED/, comparison.md, ablation.md, *.png, result.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
# On a loaded machine one engine step can wait minutes for a core; vLLM kills an engine after 300 s by default.
export VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS=${VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS:-3600}
OUT=${OUT:-benchmarks/results/long_comparison_2}
mkdir -p "$OUT"
echo "$(date -u +%FT%TZ) bash benchmarks/long_comparison.sh $*" >> "$OUT/command.txt"
.venv/bin/async-vapo make-base --config configs/tiny_long_cpu.toml
exec .venv/bin/async-vapo experiment run --vapo-config configs/tiny_long_cpu.toml --arms-dir configs/long \
  --baselines grpo,dapo --ablations no_value_pretrain,no_decoupled_gae,no_length_adaptive_gae,no_pos_lm_loss \
  --seeds 0,1,2 --ablation-seeds 0,1,2 --steps 30 --eval-every 5 --parallel 2 \
  --out "$OUT" "$@"
