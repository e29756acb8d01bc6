"""Tokenizer, tiny base model build, policy/critic in HF format, the token layout the learner uses."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_vapo.config import load_config
from async_vapo.models.base_model import base_model_path, ensure_base_model, make_base
from async_vapo.models.rl import load_critic, load_policy, make_token_batch, response_logits, response_values
from async_vapo.models.tiny import build_char_tokenizer
from async_vapo.tasks import arith

ROOT = Path(__file__).resolve().parents[2]

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=4", "algo.group_size=4",
        "algo.mini_batch_size=8", "algo.micro_batch_size=4", "train.threads=1"]


def test_char_tokenizer_round_trips_the_task_alphabet(tmp_path):
    tok = build_char_tokenizer()
    text = "7+3=10;10-5=5;\\boxed{5}"
    ids = tok(text).input_ids
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert all(c in tok.get_vocab() for c in arith.ALPHABET)
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again(text).input_ids == ids
    assert again.decode(ids + [again.eos_token_id], skip_special_tokens=True) == text


def test_base_model_is_deterministic_and_cached(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    a = make_base(cfg, tmp_path / "a", progress=False)
    b = make_base(cfg, tmp_path / "b", progress=False)
    sa = AutoModelForCausalLM.from_pretrained(str(a)).state_dict()
    sb = AutoModelForCausalLM.from_pretrained(str(b)).state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0)
    path = ensure_base_model(cfg, progress=False)
    assert path == base_model_path(cfg) and (path / "model.safetensors").exists()
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_base_model(cfg, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = load_config([], FAST + [f"model.cache_dir={tmp_path}", "base_model.seed=1"])
    assert base_model_path(other) != path


def test_base_keys_of_earlier_recipes_stay_and_new_settings_change_them(tmp_path):
    """The shipped base is found by its key: settings added later (labels, sft_min_ops) leave the key of a config
    that does not set them as it was, and change it when set."""
    from async_vapo.models.base_model import base_model_key
    from async_vapo.models.ship import shipped_entry

    assert shipped_entry("base", base_model_key(load_config([ROOT / "configs" / "tiny_cpu.toml"]))) is not None
    long_cfg = [ROOT / "configs" / "tiny_long_cpu.toml"]
    keys = {base_model_key(load_config(long_cfg, o)) for o in ([], ["base_model.sft_min_ops=1"],
                                                                ["task.labels=false"])}
    assert len(keys) == 3


def test_shorter_chains_join_the_demonstrations(tmp_path):
    """base_model.sft_min_ops: a build on labelled chains of 3 operations with sft_min_ops=1 also demonstrates
    chains of 1-2, none of them held out; the build runs on both."""
    from async_vapo.models.base_model import sft_pools
    from async_vapo.tasks import load_task

    over = FAST + ["task.min_ops=3", "task.max_ops=3", "task.labels=true", "base_model.sft_min_ops=1",
                   "rollout.max_response_tokens=40", "base_model.sft_steps=2"]
    cfg = load_config([], over)
    train, short = sft_pools(cfg)
    held_out = {p.prompt for p in load_task(cfg)[1]}
    assert {p.meta["n_ops"] for p in train} == {3} and {p.meta["n_ops"] for p in short} == {1, 2}
    assert all(p.prompt.startswith(p.prompt[0] + "a") for p in short) and not held_out & {p.prompt for p in short}
    assert sft_pools(load_config([], [o for o in over if "sft_min_ops" not in o]))[1] == []
    assert (make_base(cfg, tmp_path / "m", progress=False) / "model.safetensors").exists()


def test_critic_from_policy_checkpoint_has_zero_head_and_round_trips(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    base = ensure_base_model(cfg, progress=False)
    critic = load_critic(base)
    assert torch.count_nonzero(critic.score.weight) == 0
    backbone = load_policy(base).model.state_dict()
    for k, v in critic.model.state_dict().items():
        torch.testing.assert_close(v, backbone[k], rtol=0, atol=0)
    with torch.no_grad():
        critic.score.weight.fill_(0.01)
    critic.save_pretrained(tmp_path / "critic")
    again = load_critic(tmp_path / "critic")  # a critic checkpoint keeps its head
    torch.testing.assert_close(again.score.weight, critic.score.weight, rtol=0, atol=0)


def test_token_layout_aligns_logits_and_values_with_response_tokens(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    base = ensure_base_model(cfg, progress=False)
    policy, critic = load_policy(base).eval(), load_critic(base).eval()
    with torch.no_grad():
        critic.score.weight.normal_()
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    batch = make_token_batch(prompts, responses, pad_id=0)
    assert batch.prompt_len == 3 and batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    with torch.no_grad():
        logits = response_logits(policy, batch)
        values = response_values(critic, batch)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            alone = torch.tensor([p + r])
            ref_logits = policy(input_ids=alone).logits[0, len(p) - 1: len(p) - 1 + len(r)]
            ref_values = critic(input_ids=alone).logits[0, len(p) - 1: len(p) - 1 + len(r), 0]
            torch.testing.assert_close(logits[i, : len(r)], ref_logits, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(values[i, : len(r)], ref_values, atol=1e-4, rtol=1e-4)
    sub = batch.select([0])
    assert sub.input_ids.shape == (1, 5) and sub.prompt_len == 3 and sub.response_ids.tolist() == [[9, 10]]


def test_reward_like_critic_learns_the_last_token_and_is_cached(tmp_path):
    from async_vapo.models.reward import resolve_critic_path

    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "model.critic_init=reward",
                                  "reward_model.steps=40", "reward_model.batch_size=16", "reward_model.lr=3e-3",
                                  "base_model.demo_step_error_rate=0.5"])
    base = ensure_base_model(cfg, progress=False)
    assert resolve_critic_path(load_config([], FAST + [f"model.cache_dir={tmp_path}"]), base) is None
    path = resolve_critic_path(cfg, base, progress=False)
    meta = json.loads((path / "async_vapo_reward_critic.json").read_text())
    # a zero head scores every response 0, i.e. MSE = E[r^2] = 1 for rewards of +-1: the head learned more
    assert meta["heldout_mse_last_token"] < 0.95
    critic = load_critic(path)
    assert torch.count_nonzero(critic.score.weight) > 0  # the head is kept, not re-zeroed
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert resolve_critic_path(cfg, base, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    explicit = load_config([], FAST + [f"model.cache_dir={tmp_path}", "model.critic_init=reward",
                                       f"model.critic_path={tmp_path}/elsewhere"])
    assert resolve_critic_path(explicit, base) == tmp_path / "elsewhere"
