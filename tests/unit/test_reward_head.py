"""The reward-like critic's build (async_vapo.models.reward): it keeps the base model's trunk, grades its
demonstrations as the run's verifier does, and its cache key changes with that grading."""

from __future__ import annotations

import json
import random

import torch

from async_vapo.config import load_config
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.reward import _labelled, resolve_critic_path, reward_critic_key
from async_vapo.models.rl import load_critic
from async_vapo.models.tiny import build_char_tokenizer
from async_vapo.tasks import load_task

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "train.threads=1", "model.critic_init=reward",
        "reward_model.steps=6", "reward_model.batch_size=8", "reward_model.lr=1e-3"]


def test_the_head_build_leaves_the_trunk_as_the_base_model_had_it(tmp_path):
    """Build version 1 trained every parameter at 1e-3: after 6 steps here the trunk's weights had moved. Now
    only the head learns (reward_model.trunk_lr = 0): the trunk is the base's, bit for bit, and so is its NLL."""
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    base = ensure_base_model(cfg, progress=False)
    path = resolve_critic_path(cfg, base, progress=False)
    built, start = load_critic(path), load_critic(base)
    trunk = {k: w for k, w in built.state_dict().items() if not k.startswith("score.")}
    assert trunk and all(torch.equal(w, start.state_dict()[k]) for k, w in trunk.items())
    assert torch.count_nonzero(built.score.weight) > 0  # the head did learn
    meta = json.loads((path / "async_vapo_reward_critic.json").read_text())
    assert meta["trunk_nll"] == meta["trunk_nll_base"] > 0 and meta["trunk_relative_change_median"] == 0.0


def test_a_gentle_trunk_lr_moves_the_trunk_a_little(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "reward_model.trunk_lr=1e-5"])
    base = ensure_base_model(cfg, progress=False)
    meta = json.loads((resolve_critic_path(cfg, base, progress=False) / "async_vapo_reward_critic.json").read_text())
    # 6 Adam steps of at most ~1e-5 each on weights of norm ~1 per row: far below 1 %
    assert 0 < meta["trunk_relative_change_median"] < 1e-2
    assert abs(meta["trunk_nll"] - meta["trunk_nll_base"]) < 0.01 * meta["trunk_nll_base"]


def test_demonstrations_are_graded_with_the_configured_answer_format():
    """A demonstration ends in a box and has no ``Answer:`` line: graded by the box some are right; graded as
    answer_line (what that config's verifier does) none is. Build version 1 graded by the box whatever the config."""
    tok = build_char_tokenizer()
    boxed = load_config([], FAST + ["base_model.demo_step_error_rate=0.3"])
    line = load_config([], FAST + ["base_model.demo_step_error_rate=0.3", "verifier.answer_format=answer_line"])
    problems = load_task(boxed)[0][:40]
    r_boxed = _labelled(problems, tok, boxed, random.Random(0))[2]
    r_line = _labelled(problems, tok, line, random.Random(0))[2]
    assert 0 < r_boxed.count(1.0) < len(problems)
    assert r_line == [-1.0] * len(problems)


def test_the_cache_key_covers_the_grading():
    boxed = load_config([], FAST)
    assert reward_critic_key(boxed) == reward_critic_key(load_config([], FAST))
    for other in (["verifier.answer_format=answer_line"], ["verifier.answer_format=auto"]):
        assert reward_critic_key(load_config([], FAST + other)) != reward_critic_key(boxed), other
