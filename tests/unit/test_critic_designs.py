"""Critic designs (``model.critic_head_layers``, ``model.critic_logprobs``): each builds over a plain critic, trains on
a trivial target, reads log-probs causally, and survives a learner checkpoint, its export and a reload."""

from __future__ import annotations

import pytest
import torch
from conftest import _groups
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.rl import (
    CriticDesign,
    ValueHead,
    load_critic,
    logprob_features,
    make_token_batch,
    response_values,
)

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=2", "algo.group_size=4",
        "algo.mini_batch_size=8", "algo.micro_batch_size=4", "algo.value_pretrain_steps=0", "train.threads=1"]
DESIGNS = [CriticDesign(), CriticDesign(head_layers=2), CriticDesign(logprobs=True),
           CriticDesign(head_layers=1, logprobs=True)]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    cache = tmp_path_factory.mktemp("model-cache")
    return ensure_base_model(load_config([], FAST + [f"model.cache_dir={cache}"]), progress=False)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    prompts = [[5, 6, 7], [8], [9, 10]]
    responses = [[11, 12, 13, 14, 15], [16, 17], [18, 19, 20, 21]]
    tb = make_token_batch(prompts, responses, pad_id=0)
    lp = -torch.rand(tb.response_mask.shape, generator=g) * 3
    return tb, lp


def _randomise(critic) -> None:
    """Non-zero extra layers, so that every path of the head shows in the values."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in critic.score.parameters():
            p.add_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("design", DESIGNS, ids=lambda d: d.name)
def test_each_design_starts_as_its_critic_and_learns_a_trivial_target(base, design):
    plain = load_critic(base)
    with torch.no_grad():
        plain.score.weight.normal_(0, 0.1)
    plain.save_pretrained(base.parent / "plain-critic")
    critic = load_critic(base.parent / "plain-critic", design=design)
    assert isinstance(critic.score, ValueHead) != design.plain
    assert CriticDesign.of(critic) == design
    tb, lp = _batch()
    with torch.no_grad():  # every extra output layer starts at zero: the loaded critic's values
        torch.testing.assert_close(response_values(critic, tb, logprobs=lp), response_values(plain, tb), rtol=0,
                                   atol=1e-6)
    mask = tb.response_mask.bool()
    target = torch.where(lp < -1.5, -1.0, 1.0)  # any design can at least fit the mean
    opt = torch.optim.Adam(critic.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = ((response_values(critic, tb, logprobs=lp) - target) ** 2)[mask].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], losses
    if design.logprobs:
        assert critic.score.lp_out.weight.abs().sum() > 0  # the log-prob path trained
    if design.head_layers:
        assert all(layer.down.weight.abs().sum() > 0 for layer in critic.score.layers)


def test_logprob_critic_reads_only_the_logprobs_before_each_token(base):
    critic = load_critic(base, design=CriticDesign(head_layers=1, logprobs=True)).eval()
    _randomise(critic)
    tb, lp = _batch()
    t_len = tb.response_mask.shape[1]
    with torch.no_grad():
        ref = response_values(critic, tb, logprobs=lp)
        packed = response_values(critic, tb, packed=True, logprobs=lp)
        mask = tb.response_mask.bool()
        torch.testing.assert_close(packed[mask], ref[mask], rtol=0, atol=1e-5)
        for t in range(t_len - 1):
            changed = lp.clone()
            changed[:, t] = -9.0
            for packing in (False, True):
                v = response_values(critic, tb, packed=packing, logprobs=changed)
                # values up to and including token t are of states before it: unchanged
                torch.testing.assert_close(v[:, : t + 1], (packed if packing else ref)[:, : t + 1], rtol=0, atol=0)
                # the next token's state has read it (every row whose token t + 1 exists)
                rows = mask[:, t + 1]
                assert ((v[rows, t + 1] - ref[rows, t + 1]).abs() > 1e-6).all()
    feats = logprob_features(lp, tb.response_mask)
    assert torch.equal(feats[:, 0], logprob_features(torch.zeros_like(lp), tb.response_mask)[:, 0])
    nan = lp.clone()
    nan[0, 2] = float("nan")  # not reported by the engine: counts as a certain token
    zero = lp.clone()
    zero[0, 2] = 0.0
    assert torch.equal(logprob_features(nan, tb.response_mask), logprob_features(zero, tb.response_mask))
    with pytest.raises(ValueError, match="log-probs"):
        response_values(critic, tb)


def test_learner_trains_a_designed_critic_and_its_checkpoint_and_export_load_again(base, tmp_path):
    from async_vapo.learner.export import export

    over = FAST + [f"model.cache_dir={base.parent}", "model.critic_head_layers=1", "model.critic_logprobs=true",
                   "optim.critic_lr=3e-3"]
    cfg = load_config([], over)
    tok = AutoTokenizer.from_pretrained(str(base))
    batch = make_rollout_batch(_groups(tok, behavior=lambda rng: -rng.random() * 2), tok.pad_token_id)
    torch.manual_seed(0)
    learner = Learner(cfg, base)
    assert CriticDesign.of(learner.critic) == CriticDesign(head_layers=1, logprobs=True)
    first = learner.pretrain_critic(batch)
    for _ in range(4):
        last = learner.pretrain_critic(batch)
    assert last["critic/value_loss"] < first["critic/value_loss"]
    learner.update(batch)  # the PPO path reads the log-probs too
    values = learner.critic_values(batch)
    ckpt = learner.save(tmp_path / "ckpt")

    mask = batch.tokens.response_mask.bool()
    for path in (ckpt / "critic", export(ckpt, tmp_path / "exported", model="critic")):
        again = load_critic(path).eval()  # the design comes from the checkpoint's config
        assert CriticDesign.of(again) == CriticDesign(head_layers=1, logprobs=True)
        with torch.no_grad():
            v = response_values(again, batch.tokens, logprobs=batch.behavior_logprobs)
        torch.testing.assert_close(v[mask], values[mask], rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="design"):  # a designed critic is not silently loaded as another design
        load_critic(ckpt / "critic", design=CriticDesign(head_layers=2))

    torch.manual_seed(0)
    resumed = Learner(cfg, base)
    resumed.load_state(ckpt)
    torch.testing.assert_close(resumed.critic_values(batch)[mask], values[mask], rtol=0, atol=1e-6)
