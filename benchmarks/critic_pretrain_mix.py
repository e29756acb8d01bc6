"""Value pretraining through the learner's own path (``Learner.pretrain_critic``) on a committed pool of base-model
responses, two ways of dealing the pool into pretraining batches, side by side on the same held-out responses:

* ``groups``: each batch is whole groups (every response to a few problems), as ``algo.value_pretrain_pool`` deals
  the batches the rollout generated; each pretraining step makes its critic steps within those few problems;
* ``responses``: each batch is responses drawn across the whole pool (``algo.value_pretrain_mix = "responses"``), so
  every critic step sees many problems, as the offline fits of ``critic_ceiling.py`` do.

The critic is the config's (``configs/smollm2_vapo_cpu.toml``: a frozen trunk whose states each response gets once,
a two-layer head); both ways start from the same head and share the trunk's states. Held-out: the responses to a
quarter of the pool's problems (``critic_ceiling.split_problems``), token-level EV of the Monte-Carlo return.

    OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/critic_pretrain_mix.py \\
        --pool benchmarks/results/critic_quality/pool600_smollm2_vapo_cpu.json --head-steps 2000
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from bench_io import write_result
from critic_ceiling import split_problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2_vapo_cpu.toml")
    p.add_argument("--pool", default="benchmarks/results/critic_quality/pool600_smollm2_vapo_cpu.json")
    p.add_argument("--batch", type=int, default=64, help="responses per pretraining step")
    p.add_argument("--head-steps", type=int, default=2000, help="critic steps of each way")
    p.add_argument("--eval-every", type=int, default=250, help="held-out EV every this many critic steps")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--mixes", default="groups,responses")
    p.add_argument("--train-problems", default="0",
                   help="comma-separated numbers of training problems to fit on (the first N of them, shuffled by "
                        "--seed); 0: all. Each with each mix, from the same initial head")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for the critic (repeatable), e.g. model.critic_trunk=train "
                        "model.critic_lora.rank=16: another critic through the same path")
    p.add_argument("--out", default="benchmarks/results/critic_quality/pretrain_mix_smollm2.json")
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from async_vapo.algo import explained_variance
    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.types import Group, Trajectory

    cfg = load_config([args.config], args.overrides)
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    pool = json.loads(Path(args.pool).read_text())["pool"]
    by_problem: dict[str, Group] = {}
    def listed(x):  # the pool's id and log-prob lists, stored as JSON text or as lists
        return json.loads(x) if isinstance(x, str) else x

    for r in pool:
        g = by_problem.get(r["problem"])
        if g is None:
            g = by_problem[r["problem"]] = Group(uid=r["uid"], prompt=r["prompt"], answer=r["answer"],
                                                 prompt_ids=listed(r["prompt_ids"]), version=0, samples=[])
        reward = float(r["reward"])
        g.samples.append(Trajectory(response_ids=listed(r["response_ids"]),
                                    behavior_logprobs=listed(r["logprobs"]), finish_reason="stop",
                                    reward=reward, correct=reward > 0))
    samples = [(q, i) for q, g in by_problem.items() for i in range(len(g.samples))]
    train, test = split_problems(samples, args.seed)
    train_problems = sorted({q for q, _ in train})
    held = sorted({q for q, _ in test})
    per_group = len(next(iter(by_problem.values())).samples)
    held_batch = make_rollout_batch([by_problem[q] for q in held], tok.pad_token_id)
    print(f"{len(train)} training responses ({len(train_problems)} problems), {len(test)} held out", flush=True)

    torch.manual_seed(0)
    learner = Learner(cfg, cfg.model.path)
    head0 = {k: v.clone() for k, v in learner.critic.score.state_dict().items()}

    def heldout_ev() -> float:
        v = learner.critic_values(held_batch)
        g = held_batch.rewards[:, None].expand_as(v) * held_batch.tokens.response_mask
        return float(explained_variance(v, g, held_batch.tokens.response_mask))

    def single(q: str, i: int) -> Group:
        g = by_problem[q]
        return Group(uid=f"{g.uid}-{i}", prompt=g.prompt, answer=g.answer, prompt_ids=g.prompt_ids, version=0,
                     samples=[g.samples[i]])

    results = {}
    shuffled = random.Random(args.seed).sample(train_problems, len(train_problems))
    all_train = train
    for n_problems, mix in [(int(n), m) for n in args.train_problems.split(",") for m in args.mixes.split(",")]:
        chosen = set(shuffled[: n_problems or None])
        train_problems = sorted(chosen)
        train = [x for x in all_train if x[0] in chosen]
        learner.critic.score.load_state_dict(head0)
        learner.critic_opt = torch.optim.AdamW(learner._critic_param_groups(), lr=cfg.optim.critic_lr,
                                               betas=(cfg.optim.beta1, cfg.optim.beta2),
                                               weight_decay=cfg.optim.weight_decay)
        learner.critic_steps = 0
        rng = random.Random(args.seed)
        curve = [{"critic_steps": 0, "held_out_ev": heldout_ev()}]
        t0, order = time.perf_counter(), []
        while learner.critic_steps < args.head_steps:
            if mix == "groups":  # whole problems: batch / per_group of them
                if len(order) < args.batch // per_group:
                    order += rng.sample(train_problems, len(train_problems))
                k = args.batch // per_group
                batch, order = [by_problem[q] for q in order[:k]], order[k:]
            else:  # responses across the whole pool
                if len(order) < args.batch:
                    order += rng.sample(train, len(train))
                batch, order = [single(q, i) for q, i in order[: args.batch]], order[args.batch:]
            before = learner.critic_steps
            learner.pretrain_critic(make_rollout_batch(batch, tok.pad_token_id), fresh=False)
            if learner.critic_steps // args.eval_every > before // args.eval_every:
                curve.append({"critic_steps": learner.critic_steps, "held_out_ev": heldout_ev(),
                              "seconds": time.perf_counter() - t0})
                print(f"[{mix}, {len(train_problems)} problems] {curve[-1]}", flush=True)
        results[f"{mix}/{len(train_problems)}"] = {
            "mix": mix, "train_problems": len(train_problems), "train_responses": len(train), "curve": curve,
            "last": curve[-1]["held_out_ev"], "best": max(c["held_out_ev"] for c in curve)}
    command = "OMP_NUM_THREADS=2 PYTHONPATH=. .venv/bin/python benchmarks/critic_pretrain_mix.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "overrides") + "".join(
        f" --set {o}" for o in args.overrides)
    write_result(args.out, {"command": command,
                            "config": args.config, "overrides": args.overrides, "pool": args.pool,
                            "critic_trunk": cfg.model.critic_trunk, "critic_lora_rank": cfg.model.critic_lora.rank,
                            "held_out_responses": len(test), "batch": args.batch,
                            "critic_mini_batch_size": cfg.algo.effective_critic_mini_batch_size,
                            "value_pretrain_epochs": cfg.algo.value_pretrain_epochs, "mixes": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
