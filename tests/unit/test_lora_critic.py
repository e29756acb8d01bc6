"""A LoRA critic (``model.critic_lora``, ``models.lora.add_critic_lora``): adapters on the critic's trunk, its value
head trained in full. It starts as the model it is loaded from (B zero) with the base model's zero head, so its trunk
gets no gradient until the head has moved (issue 50, item 6: it relies on value pretraining); only adapters and head
ever move; a checkpoint's ``critic/`` is the merged critic, and a resume gives the same values and the same next
step."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, _groups
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.rl import load_critic

CRITIC_LORA = ["model.critic_lora.rank=4", "model.critic_lora.alpha=8", "algo.name=vapo", "optim.critic_lr=1e-2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


def make(cache, *overrides: str):
    cfg = load_config([], FAST + [f"model.cache_dir={cache}", *CRITIC_LORA, *overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(0)
    return Learner(cfg, base), make_rollout_batch(_groups(tok), tok.pad_token_id), base


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def moved(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> set[str]:
    return {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}


def test_only_the_critics_adapters_and_head_train_and_the_trunk_waits_for_the_head(cache):
    learner, batch, _ = make(cache)
    critic = learner.critic
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    head = {n for n in trainable if n.startswith("score.")}
    adapters = trainable - head
    layers = critic.config.num_hidden_layers
    assert head == {"score.weight", "score.bias"} and len(adapters) == 2 * 7 * layers
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters)
    in_opt = {id(p) for g in learner.critic_opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in critic.named_parameters() if n in trainable}
    assert learner.policy_state() and not any(p.requires_grad is False for p in learner.policy.parameters())
    # B zero and the base model's zero head: every value 0
    assert all(not v.any() for k, v in critic.state_dict().items() if ".lora_B." in k or k.startswith("score."))
    assert not learner.critic_values(batch).any()

    before = snapshot(critic)
    learner.pretrain_critic(batch)  # 8 rows / critic_mini_batch_size (8): one critic step
    first = moved(critic, before)
    # a zero head passes no gradient to the trunk: d V / d h = w = 0, so the first step moves the head alone
    assert first == head
    learner.pretrain_critic(batch)
    learner.pretrain_critic(batch)
    later = moved(critic, before)
    assert later <= trainable | {k for k in critic.state_dict() if ".lora_" in k}
    assert any(".lora_B." in k for k in later) and any(".lora_A." in k for k in later)  # B first, then A (dA ∝ B)
    assert not any(".base_layer." in k or "embed_tokens" in k or "norm" in k for k in later)  # the trunk is frozen


def test_a_lora_critic_checkpoint_resumes_to_the_same_values_and_next_step(cache, tmp_path):
    learner, batch, base = make(cache)
    for _ in range(3):
        learner.pretrain_critic(batch)
    learner.update(batch)
    values = learner.critic_values(batch)
    assert values.abs().max() > 1e-3  # the critic has learnt something
    ckpt = learner.save(tmp_path / "ckpt")
    # critic/ is an ordinary critic: the merged trunk and the head, which load_critic reads outside the learner
    plain = load_critic(ckpt / "critic").eval()
    assert not any("lora" in k for k in plain.state_dict())
    again = Learner(learner.cfg, base, ckpt / "critic")  # as the trainer's resume passes the checkpoint's critic
    again.load_state(ckpt)
    for k, v in learner.critic.state_dict().items():
        torch.testing.assert_close(again.critic.state_dict()[k], v, rtol=0, atol=0)
    torch.testing.assert_close(again.critic_values(batch), values, rtol=0, atol=0)
    with torch.no_grad():  # the merged critic's values are the LoRA critic's, to float32 rounding
        from async_vapo.models.rl import response_values

        merged = response_values(plain, batch.tokens)
    m = batch.tokens.response_mask.bool()
    torch.testing.assert_close(merged[m], values[m], rtol=0, atol=1e-5)
    learner.update(batch)
    again.update(batch)
    for k, v in learner.critic.state_dict().items():
        torch.testing.assert_close(again.critic.state_dict()[k], v, rtol=0, atol=0)


def test_policy_and_critic_adapters_together_and_the_critic_exports_merged(cache, tmp_path):
    """model.lora and model.critic_lora on together, a head with extra layers (model.critic_head_layers): each model
    trains its adapters (and the critic its head) alone; ``async-vapo export --model critic`` writes the merged critic,
    which load_critic reads with the same values."""
    from async_vapo.cli import main
    from async_vapo.models.rl import response_values

    learner, batch, _ = make(cache, "model.lora.rank=4", "model.critic_head_layers=1")
    policy_before, critic_before = snapshot(learner.policy), snapshot(learner.critic)
    for _ in range(3):
        learner.pretrain_critic(batch)
    learner.update(batch)
    assert moved(learner.policy, policy_before) and all(".lora_" in k for k in moved(learner.policy, policy_before))
    critic_moved = moved(learner.critic, critic_before)
    assert any(k.startswith("score.layers.") for k in critic_moved) and any(".lora_B." in k for k in critic_moved)
    assert all(".lora_" in k or k.startswith("score.") for k in critic_moved)
    values = learner.critic_values(batch)
    ckpt = learner.save(tmp_path / "ckpt")
    assert main(["export", str(ckpt), str(tmp_path / "critic"), "--model", "critic"]) == 0
    exported = load_critic(tmp_path / "critic").eval()
    assert not any("lora" in k for k in exported.state_dict())
    with torch.no_grad():
        got = response_values(exported, batch.tokens)
    m = batch.tokens.response_mask.bool()
    torch.testing.assert_close(got[m], values[m], rtol=0, atol=1e-5)


def test_critic_lora_is_refused_without_a_critic():
    with pytest.raises(ValueError, match="builds no critic"):
        load_config([], FAST + ["model.critic_lora.rank=4", "algo.name=grpo"])
    # a sharded learner takes it (tests/unit/test_lora.py trains one)
    assert load_config([], FAST + ["model.critic_lora.rank=4", "learner.fsdp=on"]).model.critic_lora.rank == 4
