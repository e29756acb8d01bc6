"""A critic whose trunk is frozen (``model.critic_trunk = "frozen"``): the value head alone trains, on the trunk's
states of each response computed once and kept (``models.rl.TrunkStateCache``). A tiny real learner (1 layer, 32
wide) on 2 groups x 4 responses."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import _groups
from test_critic_schedule import FAST, adam_steps
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.rl import TrunkStateCache, response_values, trunk_states


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


def make(cache, *overrides: str) -> tuple[Learner, object]:
    cfg = load_config([], FAST + [f"model.cache_dir={cache}", "model.critic_trunk=frozen", *overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(0)
    return Learner(cfg, base), make_rollout_batch(_groups(tok), tok.pad_token_id)


def full_forward_values(learner: Learner, batch) -> torch.Tensor:
    """The critic's values by its whole HF forward (trunk and head together), as an unfrozen critic computes them."""
    lp = batch.behavior_logprobs if learner._critic_reads_logprobs else None
    with torch.no_grad():
        v = response_values(learner.critic, batch.tokens, logprobs=lp)
    return v.masked_fill(~batch.tokens.response_mask.bool(), 0.0)


SHARED_PACKING = ["model.critic_head_layers=1", "learner.packing=true", "learner.share_prompts=true"]


@pytest.mark.parametrize("design", [[], ["model.critic_head_layers=2"], ["model.critic_logprobs=true"], SHARED_PACKING],
                         ids=["linear", "layers2", "logprobs", "shared-prompt-packing"])
def test_head_on_kept_states_equals_the_whole_forward_and_only_the_head_trains(cache, design):
    learner, batch = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=3",
                          "optim.critic_head_lr=1e-2", "optim.critic_warmup_steps=0", *design)
    trunk = {n: p.detach().clone() for n, p in learner.critic.named_parameters() if not n.startswith("score.")}
    head = {n: p.detach().clone() for n, p in learner.critic.named_parameters() if n.startswith("score.")}
    optimised = {id(p) for g in learner.critic_opt.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in learner.critic.score.parameters()}
    m = learner.update(batch)
    assert [g["lr"] for g in learner.critic_opt.param_groups] == [pytest.approx(1e-2)]  # the head's rate
    assert m["critic/steps"] == 6.0 and adam_steps(learner.critic_opt) == {6}
    after = dict(learner.critic.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in trunk.items())
    assert any(not torch.equal(after[n], p) for n, p in head.items())
    # the trained head on the kept states gives what the whole model's forward gives
    kept = learner.critic_values(batch)
    torch.testing.assert_close(kept, full_forward_values(learner, batch), atol=1e-5, rtol=1e-5)


def test_each_response_runs_through_the_trunk_once(cache):
    learner, batch = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=2")
    n = len(batch.rewards)
    learner.pretrain_critic(batch)
    assert learner._trunk_cache.misses == n and len(learner._trunk_cache) == n
    m = learner.pretrain_critic(batch, fresh=False)
    m2 = learner.update(batch)
    assert learner._trunk_cache.misses == n  # every later forward of these responses read the cache
    assert m2["critic/trunk_cache_misses"] == n and m2["critic/trunk_cache_hits"] > m["critic/trunk_cache_hits"] > 0
    # the same responses in another batch (another order, another padding width) are the same rows of the cache
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(learner.cfg, progress=False)))
    other = make_rollout_batch(list(reversed(_groups(tok)))[:1], tok.pad_token_id)
    assert other.tokens.input_ids.shape != batch.tokens.input_ids.shape
    torch.testing.assert_close(learner.critic_values(other), full_forward_values(learner, other), atol=1e-5,
                               rtol=1e-5)
    assert learner._trunk_cache.misses == n


def test_a_full_cache_drops_the_oldest_and_values_stay_exact(cache):
    learner, batch = make(cache, "model.critic_feature_cache_mb=0")
    learner.update(batch)
    assert len(learner._trunk_cache) == 0 and learner._trunk_cache.bytes == 0
    torch.testing.assert_close(learner.critic_values(batch), full_forward_values(learner, batch), atol=1e-5,
                               rtol=1e-5)
    # a cache of about three responses: bounded, least recently used out first
    small = TrunkStateCache(max_bytes=3 * 30 * 32 * 4)
    tb = batch.tokens

    def states(sub):
        with torch.no_grad():
            return trunk_states(learner.critic, sub)

    out = small.states(tb, states)
    assert small.bytes <= small.max_bytes and 0 < len(small) < len(tb)
    torch.testing.assert_close(out, states(tb) * tb.response_mask[..., None], atol=1e-5, rtol=1e-5)
    again = small.states(tb, states)
    torch.testing.assert_close(again, out)


@pytest.mark.parametrize("extra,match", [
    (["model.critic_lora.rank=4"], "pick one"),
    (["async.learner_devices=2"], "sharded learner"),
])
def test_frozen_trunk_refuses_what_it_cannot_serve(extra, match):
    with pytest.raises(ValueError, match=match):
        load_config([], ["model.critic_trunk=frozen", *extra])


def test_kept_batches_of_the_critic_window_are_read_from_the_cache(cache):
    learner, a = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=1", "algo.critic_replay_batches=2")
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(learner.cfg, progress=False)))
    b = make_rollout_batch(_groups(tok, random.Random(1)), tok.pad_token_id)
    learner.update(a)
    m = learner.update(b)
    assert m["critic/replay_batches"] == 2.0 and m["critic/steps"] == 4.0  # 2 mini-batches of b, 2 of a
    # each response ran through the trunk once: a's second use (kept in the window) read the cache
    assert learner._trunk_cache.misses == len(a.rewards) + len(b.rewards) == 16
