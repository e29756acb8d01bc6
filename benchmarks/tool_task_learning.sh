#!/usr/bin/env bash
# Issue 51, item 4: RL on the tool task (configs/smollm2_tool_cpu.toml: SmolLM2-135M-Instruct, three-digit times
# two-digit word problems after four worked examples), each algorithm and seed with the tool and without it at equal
# wall-clock (MINUTES of training; the trainer's held-out evaluation of the 200 problems before the first update and
# after the last). Without the tool: the same problems after four mental examples (benchmarks/tool_task.py
# --no-tool) and rollout.env off. The trainer's rows carry what the issue asks before and after RL: eval/accuracy,
# eval/tool_calls (per response), eval/tool_errors (calls that did not run), eval/turns; and per update
# rollout/tool_calls and the rest.
#   bash benchmarks/tool_task_learning.sh [key.sub=value ...]
#   (ALGOS="grpo vapo" SEEDS="0 1" TOOLS="tool no_tool" MINUTES=55 OUT=benchmarks/results/tool_task/learning
#    DATA=data/tool_task)
# ALGOS may also name vapo_frozen: VAPO with the value-model issue's frozen-trunk critic (below); vapo is the config's
# own critic, a full trunk initialised from the base model.
# The minutes end every run (train.total_steps 1000 is never reached: without the tool an update takes ~14 s against
# ~40 s with it, and the config's 100 would stop that run at 25 minutes). Each run is alone on the machine (one run
# needs about 8 GiB with the config's shared prompts) and adds OUT/ALGO_TOOL_seedN/ (metrics.jsonl,
# config.resolved.json, run.json, samples.jsonl); a run of the same name is replaced. Then benchmarks/tool_task.py
# --summary writes OUT/summary.{md,json} and OUT/curves.png over every run in OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
bash deploy/setup.sh
out=${OUT:-benchmarks/results/tool_task/learning}
data=${DATA:-data/tool_task}
ALGOS=${ALGOS:-"grpo vapo"}
SEEDS=${SEEDS:-"0 1"}
TOOLS=${TOOLS:-"tool no_tool"}
MINUTES=${MINUTES:-55}
mkdir -p "$out"
[ -f "$data/train.jsonl" ] || .venv/bin/python benchmarks/tool_task.py --out "$data"
[ -f "$data/train_no_tool.jsonl" ] || .venv/bin/python benchmarks/tool_task.py --out "$data" --no-tool
echo "ALGOS=\"$ALGOS\" SEEDS=\"$SEEDS\" TOOLS=\"$TOOLS\" MINUTES=$MINUTES OUT=$out DATA=$data" \
  "bash benchmarks/tool_task_learning.sh $*" >> "$out/command.txt"
# grpo is GRPO's group-normalised advantages in the config's loss, the same loss as vapo's (token-level, clip-higher
# 0.2 / 0.28, the positive-example LM loss 0.1, actor lr 1e-6): grpo and vapo differ in the advantage alone
grpo=(algo.name=grpo algo.value_pretrain_steps=0)
vapo=(algo.name=vapo)
# benchmarks/smollm2_learning.sh's vapo_frozen (benchmarks/results/value_model/plan.md, design 2): two MLP layers and
# the head train on the frozen trunk's states at lr 1e-3, four passes of 8-response steps per update, value
# pretraining up to 320 steps with a stopping rule; its pool 16 batches of this config's 16 responses (256 against
# the word problems' 32 x 64), the critic scored on 50 held-out problems x 2 before and after RL
vapo_frozen=(algo.name=vapo model.critic_trunk=frozen model.critic_head_layers=2 algo.critic_mini_batch_size=8
             algo.critic_epochs=4 algo.value_pretrain_pool=16 algo.value_pretrain_steps=320
             algo.value_pretrain_epochs=2 algo.value_pretrain_min_steps=128 algo.value_pretrain_patience=64
             optim.critic_head_lr=1e-3 rollout.critic_eval_problems=50 rollout.critic_eval_samples=2)
tool=("task.train_path=$data/train.jsonl" "task.eval_path=$data/eval.jsonl")
no_tool=(rollout.env=none "task.train_path=$data/train_no_tool.jsonl" "task.eval_path=$data/eval_no_tool.jsonl")
for t in $TOOLS; do
  for algo in $ALGOS; do
    for seed in $SEEDS; do
      name="${algo}_${t}_seed$seed"
      dir="runs/tool_task_learning/$name"
      rm -rf "$out/$name" "$dir"
      echo "[tool_task_learning] $name -> $out/$name" >&2
      declare -n a="$algo" d="$t"
      .venv/bin/async-vapo train --config configs/smollm2_tool_cpu.toml "${a[@]}" "${d[@]}" train.seed="$seed" \
        rollout.seed="$seed" "train.max_minutes=$MINUTES" train.total_steps=1000 "train.output_dir=$dir" \
        train.checkpoint_every=0 "$@"
      mkdir -p "$out/$name"
      cp "$dir"/{metrics.jsonl,config.resolved.json,run.json} "$out/$name"/
      # the trainer's logged conversations (a few held-out problems before the first update and after the last)
      [ ! -f "$dir/samples.jsonl" ] || cp "$dir/samples.jsonl" "$out/$name"/
      rm -rf "$dir/checkpoints"
    done
  done
done
.venv/bin/python benchmarks/tool_task.py --summary "$out"
