# The one-process GRPO trainer (configs/baselines/grpo.toml, every core) with vLLM's default 1 s busy-poll of its
# queue readers ("off": rollout.idle_spin_s=null) and with 0.002 s ("on", the default), alternating, 12 updates each;
# medians of updates 3-12. ab.txt was measured on an idle machine (the first pair before the setting existed, with the
# plugin's environment variable set by hand, which is what the setting does) before the plugin also shortened vLLM's
# 5 s re-check of a sleeping reader: its "on" runs had a 5-10 s generate stall now and then (a lost notification).
# ab_recheck.txt: on / off / on with the re-check at 5 ms, 20 updates each (train.total_steps=20): no stall.
cd "$(dirname "$0")/../../../.."
for mode in off on off on; do
  if [ $mode = on ]; then spin=0.002; else spin=null; fi
  rm -rf /tmp/spin/run_$mode
  timeout 300 .venv/bin/async-vapo train --config configs/baselines/grpo.toml train.total_steps=12 train.eval_every=100 \
    train.checkpoint_every=0 train.threads=0 rollout.idle_spin_s=$spin train.name=run_$mode \
    'train.output_dir=/tmp/spin/{name}' > /tmp/spin/$mode.log 2>&1
  python3 -c "
import json, statistics as s
rows=[json.loads(l) for l in open('/tmp/spin/run_$mode/metrics.jsonl')]
tr=[r for r in rows if r['kind']=='train'][2:]
print('$mode', {k: round(s.median(r[k] for r in tr),3) for k in ['time/generate_s','time/learn_s','time/step_s']}, flush=True)"
done
