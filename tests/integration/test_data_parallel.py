"""Data-parallel learner ranks (torch.distributed, gloo on CPU): two ranks that each take half of every
mini-batch's micro-batches and all-reduce their gradients make exactly the single-process update."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_vapo.config import load_config
from async_vapo.models.base import ensure_base_model
from async_vapo.models.rl import load_policy
from async_vapo.rollout.types import Group, Trajectory

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=2", "algo.group_size=4",
        "algo.mini_batch_size=8", "algo.micro_batch_size=2", "algo.value_pretrain_steps=0", "train.threads=1",
        "optim.actor_lr=1e-2", "optim.critic_lr=1e-2"]


def _groups(tok) -> list[Group]:
    rng = random.Random(0)
    groups = []
    for g in range(2):
        samples = []
        for k in range(4):
            text = f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" + "7" * rng.randint(1, 12)
            ids = tok(text).input_ids + [tok.eos_token_id]
            samples.append(Trajectory(response_ids=ids, behavior_logprobs=[-1.0] * len(ids), finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2), verdict="x"))
        groups.append(Group(uid=f"g{g}", prompt="p", answer="7", prompt_ids=tok(f"{g}+1")["input_ids"], version=0,
                            samples=samples))
    return groups


def _update(cfg, base) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    from transformers import AutoTokenizer

    from async_vapo.learner.vapo import Learner, make_rollout_batch

    tok = AutoTokenizer.from_pretrained(str(base))
    learner = Learner(cfg, base)
    metrics = [learner.update(make_rollout_batch(_groups(tok), tok.pad_token_id)) for _ in range(2)]
    state = {f"policy.{k}": v.clone() for k, v in learner.policy.state_dict().items()}
    state |= {f"critic.{k}": v.clone() for k, v in learner.critic.state_dict().items()}
    return state, metrics


def _rank(rank: int, world: int, init: str, cfg, base, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_update(cfg, base), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_make_the_single_process_update(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    base = ensure_base_model(cfg, progress=False)
    single, single_metrics = _update(cfg, base)
    mp.spawn(_rank, args=(2, f"file://{tmp_path}/store", cfg, base, str(tmp_path / "state")), nprocs=2, join=True)
    (r0, m0), (r1, m1) = torch.load(tmp_path / "state.0"), torch.load(tmp_path / "state.1")
    # Gradient norms before clipping (one mini-batch per update): the summed gradient is the whole batch's, not
    # half of it or twice it (Adam would hide a scale error in the parameters, the norm does not).
    for a, b, c in zip(single_metrics, m0, m1, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert b[key] == c[key]
            assert abs(b[key] - a[key]) <= 1e-5 * a[key], (key, a[key], b[key])
    moved = 0
    initial = {f"policy.{k}": v for k, v in load_policy(base).state_dict().items()}
    for k, v in single.items():
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)  # the ranks stay identical replicas
        torch.testing.assert_close(r0[k], v, rtol=1e-4, atol=1e-5)  # and equal to one process doing it all
        if k in initial and not torch.equal(initial[k], v):
            moved += 1
    assert moved > 0  # the update changed the policy, so the comparison above is not vacuous
