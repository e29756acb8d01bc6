#!/usr/bin/env bash
# RL on a real pretrained model on this CPU within an hour: SmolLM2-135M-Instruct (configs/smollm2_cpu.toml) on
# level-1 word problems, GRPO and VAPO, paired seeds. Each run is benchmarks/smollm2.py (held-out accuracy on 200
# problems every EVAL_EVERY updates, the trainer stopped after MINUTES of wall-clock, its last evaluation after
# that); then `async-vapo eval` of the untrained model and of the run's last checkpoint, SAMPLES per problem, for the
# gain measured per problem; then benchmarks/smollm2_learning.py writes the table and the curves.
#   bash benchmarks/smollm2_learning.sh [key.sub=value ...]
#   (ALGOS="grpo vapo" SEEDS="0 1" MINUTES=55 EVAL_EVERY=10 SAMPLES=2 OUT=benchmarks/results/smollm2_learning)
# ALGOS may also name vapo_critic, vapo_critic_nopretrain, vapo_frozen, vapo_frozen_nopretrain, vapo_frozen_window,
# vapo_frozen_window_lam1, vapo_frozen_lam1 and vapo_v0 (issue 45, below), grpo_lora and vapo_frozen_lora (issue 50:
# the policy as a LoRA adapter, below; grpo_lora_merged and vapo_frozen_lora_merged serve its versions merged) and the objectives of configs/baselines/ (issue 49): gspo gspo_token cispo rloo reinforce_pp
# reinforce_pp_baseline dr_grpo, each with its baseline config's settings over the shared ones below, e.g.
#   ALGOS="gspo cispo rloo reinforce_pp dr_grpo" SEEDS=0 bash benchmarks/smollm2_learning.sh
# With one optimiser step per update on fresh samples every ratio is 1 at the step: GSPO's and CISPO's clips
# never bind, and GSPO's gradient is GRPO's (sample-level), CISPO's a token-level GRPO's.
# NAME_services (e.g. grpo_services, vapo_frozen_services; issue 46) runs NAME's settings through the four services
# (deploy/start_cluster.sh with its default placement) at async.max_staleness 1 with continuous generation and
# in-flight weight updates (rollout.weight_update = keep); its held-out evaluations are rollout 0's, its clock the
# learner's, and its run directory's metrics, config, logs and busy spans are copied to OUT with the CPU use sampled
# during its updates (cpu/, benchmarks/cpu_lending.py --attach), e.g.
#   ALGOS="grpo_services vapo_frozen_services" SEEDS=0 bash benchmarks/smollm2_learning.sh
# Runs add to OUT: a run of the same algorithm and seed is replaced, the untrained model's evaluation is made once per
# SAMPLES (base/ for the committed runs' 2, base_sN/ for another N; each run is paired with its own), and the summary
# covers every run in OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
out=${OUT:-benchmarks/results/smollm2_learning}
ALGOS=${ALGOS:-"grpo vapo"}
SEEDS=${SEEDS:-"0 1"}
MINUTES=${MINUTES:-55}
EVAL_EVERY=${EVAL_EVERY:-10}
SAMPLES=${SAMPLES:-2}
model=models/smollm2-135m-instruct
mkdir -p "$out"
base="$out/base"
if [ -f "$base/metrics.json" ] && ! grep -q "\"samples_per_problem\": $SAMPLES," "$base/metrics.json"; then
  base="$out/base_s$SAMPLES"  # the untrained model with these samples per problem, beside the one the others pair with
fi
echo "ALGOS=\"$ALGOS\" SEEDS=\"$SEEDS\" MINUTES=$MINUTES EVAL_EVERY=$EVAL_EVERY SAMPLES=$SAMPLES OUT=$out" \
  "bash benchmarks/smollm2_learning.sh $*" >> "$out/command.txt"
# the settings every run shares: level-1 problems, 8 prompts x 8 samples, one optimiser step per update (its
# old log-probs are its own forward's), packed forwards with shared prompts, log-probs of response positions only
common=(task.max_ops=1 algo.prompts_per_step=8 algo.group_size=8 algo.mini_batch_size=64 algo.micro_batch_size=8
        optim.actor_lr=3e-5 train.threads=0 learner.packing=true learner.share_prompts=true
        learner.logprob_chunk_tokens=4096 "train.max_minutes=$MINUTES")
grpo=(algo.name=grpo algo.value_pretrain_steps=0 algo.clip_higher=false algo.token_level_loss=false
      algo.pos_lm_coef=0.0)
vapo=(algo.name=vapo)
# issue 45: VAPO with configs/smollm2_vapo_cpu.toml's critic settings (its own 8-response steps, value pretraining on
# a pool with a stopping rule, head lr 1e-3 / trunk 1e-5), the critic scored on 50 held-out problems x 4 at every
# evaluation; and its two attribution rows: no value pretraining, and V = 0 (no critic at all)
vapo_critic=(algo.name=vapo algo.critic_mini_batch_size=8 algo.critic_epochs=1 algo.value_pretrain_pool=16
             algo.value_pretrain_steps=24 algo.value_pretrain_min_steps=8 algo.value_pretrain_patience=6
             optim.critic_lr=1e-5 optim.critic_head_lr=1e-3 rollout.critic_eval_problems=50
             rollout.critic_eval_samples=4)
vapo_critic_nopretrain=("${vapo_critic[@]}" algo.value_pretrain_steps=0 algo.value_pretrain_pool=0
                        algo.value_pretrain_min_steps=0 algo.value_pretrain_patience=0)
vapo_v0=(algo.name=vapo algo.zero_values=true)
# the frozen-trunk critic (benchmarks/results/value_model/plan.md, design 2): the head alone trains (two MLP layers
# before the linear head, lr 1e-3) on the trunk's states, computed once per response; value pretraining on a pool of
# 32 batches, up to 320 steps of two passes over a batch (5,120 head steps), at least 128; 32 head steps per update
vapo_frozen=(algo.name=vapo model.critic_trunk=frozen model.critic_head_layers=2 algo.critic_mini_batch_size=8
             algo.critic_epochs=4 algo.value_pretrain_pool=32 algo.value_pretrain_steps=320
             algo.value_pretrain_epochs=2 algo.value_pretrain_min_steps=128 algo.value_pretrain_patience=64
             optim.critic_head_lr=1e-3 rollout.critic_eval_problems=50 rollout.critic_eval_samples=4)
vapo_frozen_nopretrain=("${vapo_frozen[@]}" algo.value_pretrain_steps=0 algo.value_pretrain_pool=0
                        algo.value_pretrain_min_steps=0 algo.value_pretrain_patience=0)
# design 3 (plan.md): the same critic, its 8-response steps spread over the latest 8 batches (one pass over the window
# per update: 64 head steps, each response stepped on at most once an update, in 8 updates)
vapo_frozen_window=("${vapo_frozen[@]}" algo.critic_epochs=1 algo.critic_replay_batches=8)
# its diagnostic row: the same critic as a baseline only, every token's advantage R - V(s_t) (lambda_policy 1, the
# length-adaptive rule off), so that the critic's errors shift each token's advantage without compounding over GAE
vapo_frozen_window_lam1=("${vapo_frozen_window[@]}" algo.length_adaptive_gae=false algo.lam_policy=1.0)
# and the same lambda_policy 1 without the window (plan.md, the next diagnostic row)
vapo_frozen_lam1=("${vapo_frozen[@]}" algo.length_adaptive_gae=false algo.lam_policy=1.0)
# issue 50: the policy as a rank-16 adapter on every linear layer of the decoder (model.lora), at LoRA's usual ten
# times the full fine-tune's learning rate (as configs/qwen2.5-7b_grpo_lora.toml; not tuned); the engine serves each
# version as its adapter
lora=(model.lora.rank=16 model.lora.alpha=32 optim.actor_lr=3e-4)
grpo_lora=("${grpo[@]}" "${lora[@]}")
vapo_frozen_lora=("${vapo_frozen[@]}" "${lora[@]}")
# the same adapters, each version sent to an engine without LoRA as the merged weights (model.lora.serve): vLLM's CPU
# LoRA path took 8.7x as long per batch
grpo_lora_merged=("${grpo_lora[@]}" model.lora.serve=merged)
vapo_frozen_lora_merged=("${vapo_frozen_lora[@]}" model.lora.serve=merged)
# through the services: one step behind at most, continuous generation, a request keeps its version's weights when a
# new one lands mid-response; 1000 updates (the minutes stop it first), an evaluation every EVAL_EVERY, a checkpoint at
# the end
services=(async.max_staleness=1 rollout.generation=continuous rollout.weight_update=keep train.total_steps=1000
          "train.eval_every=$EVAL_EVERY" train.checkpoint_every=0)
# the further objectives: their configs/baselines/*.toml settings (REINFORCE++ without a group: 64 prompts x 1)
critic_free=(algo.value_pretrain_steps=0 algo.pos_lm_coef=0.0)
gspo=(algo.name=gspo "${critic_free[@]}" algo.token_level_loss=false)
gspo_token=(algo.name=gspo_token "${critic_free[@]}" algo.token_level_loss=false)
cispo=(algo.name=cispo "${critic_free[@]}" algo.clip_higher=true algo.eps_high=0.28 algo.token_level_loss=true)
rloo=(algo.name=rloo "${critic_free[@]}" algo.clip_higher=false algo.token_level_loss=false)
reinforce_pp=(algo.name=reinforce_pp "${critic_free[@]}" algo.clip_higher=false algo.group_size=1
              algo.prompts_per_step=64)
reinforce_pp_baseline=(algo.name=reinforce_pp_baseline "${critic_free[@]}" algo.clip_higher=false)
dr_grpo=(algo.name=dr_grpo "${critic_free[@]}" algo.clip_higher=false)
for algo in $ALGOS; do
  for seed in $SEEDS; do
    run="$out/${algo}_seed$seed"
    rm -rf "$run" "runs/smollm2_learning/${algo}_seed$seed"
    echo "[smollm2_learning] $algo, train.seed=$seed -> $run" >&2
    declare -n extra="${algo%_services}"
    if [[ $algo == *_services ]]; then
      mkdir -p "$run"
      # each core's busy share and the services' CPU seconds every 0.5 s, over the learner's updates
      .venv/bin/python benchmarks/cpu_lending.py --attach "runs/smollm2_learning/${algo}_seed$seed" --out "$run/cpu" &
      sampler=$!
      bash deploy/start_cluster.sh --config configs/smollm2_cpu.toml --run-dir "runs/smollm2_learning/${algo}_seed$seed" \
        --wait -- "${common[@]}" "${extra[@]}" "${services[@]}" train.seed="$seed" "$@"
      wait "$sampler"
      rm -f "$run"/cpu/*.samples.json  # every 0.5 s sample of the hour (about 1 MB); the figures are in cpu/<mode>.json
      cp "runs/smollm2_learning/${algo}_seed$seed"/{metrics.jsonl,config.resolved.json,run.json} "$run"/
      cp -r "runs/smollm2_learning/${algo}_seed$seed"/{logs,stats} "$run"/
    else
      .venv/bin/python benchmarks/smollm2.py --steps 1000 --eval-every "$EVAL_EVERY" --out "$run" --skip-base \
        --keep-checkpoint --run-dir "runs/smollm2_learning/${algo}_seed$seed" "${common[@]}" "${extra[@]}" \
        train.seed="$seed" "$@"
    fi
    ckpt=$(ls -d "runs/smollm2_learning/${algo}_seed$seed"/checkpoints/step_* | sort -t_ -k2 -n | tail -1)
    if [ ! -f "$base/samples.jsonl" ]; then  # the untrained model, once: every run evaluates the same problems
      .venv/bin/async-vapo eval "$model" --config "$run/config.resolved.json" --samples "$SAMPLES" --out "$base"
    fi
    .venv/bin/async-vapo eval "$ckpt" --samples "$SAMPLES" --out "$run/final"
    rm -rf "runs/smollm2_learning/${algo}_seed$seed/checkpoints"
  done
done
# the summary covers every run in OUT, those of earlier invocations too
mapfile -t runs < <(ls -d "$out"/*_seed*/ 2>/dev/null | sed 's:/$::' | sort)
# each run pairs with the untrained model's evaluation of its samples per problem (base/, base_sN/)
.venv/bin/python benchmarks/smollm2_learning.py "${runs[@]}" --base "$out"/base* --out "$out"
