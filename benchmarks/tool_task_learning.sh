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
# Each run is alone on the machine (one run needs about 8 GiB with the config's shared prompts) and adds
# OUT/ALGO_TOOL_seedN/ (metrics.jsonl, config.resolved.json, run.json); a run of the same name is replaced. Then
# benchmarks/tool_task.py --summary writes OUT/summary.{md,json} and OUT/curves.png over every run in OUT.
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
grpo=(algo.name=grpo algo.value_pretrain_steps=0)
vapo=(algo.name=vapo)
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
        rollout.seed="$seed" "train.max_minutes=$MINUTES" "train.output_dir=$dir" train.checkpoint_every=0 "$@"
      mkdir -p "$out/$name"
      cp "$dir"/{metrics.jsonl,config.resolved.json,run.json} "$out/$name"/
      rm -rf "$dir/checkpoints"
    done
  done
done
.venv/bin/python benchmarks/tool_task.py --summary "$out"
