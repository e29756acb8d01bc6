"""Environment tokens of a multi-turn response (``Trajectory.env_spans``): on the wire (protocol 11, older logs still
open), and in the learner: in the sequence as state, out of every loss, its denominator and GAE's steps."""

from __future__ import annotations

import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from async_vapo.algo.gae import compute_gae
from async_vapo.algo.losses import loss_normalizer
from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model
from async_vapo.replay.buffer import REJECT_SPANS, validate_group
from async_vapo.types import Group, Trajectory, enc_hook, model_token_mask

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=2", "algo.group_size=2",
        "algo.mini_batch_size=4", "algo.micro_batch_size=4", "algo.value_pretrain_steps=0", "train.threads=1"]


def _group(env_spans=()) -> Group:
    # response: 3 model tokens, 3 environment tokens, 2 model tokens (the second sample: 4 model tokens, one turn)
    return Group(uid="u", prompt="1+2=", answer="3", prompt_ids=[5, 6, 7], version=0, samples=[
        Trajectory(response_ids=[8, 9, 10, 11, 12, 13, 14, 1], behavior_logprobs=[-1.0] * 3 + [0.0] * 3 + [-1.0] * 2,
                   finish_reason="stop", reward=1.0, correct=True, env_spans=list(env_spans)),
        Trajectory(response_ids=[8, 9, 14, 1], behavior_logprobs=[-1.0] * 4, finish_reason="stop")])


def test_env_spans_on_the_wire_and_an_older_log_still_opens(tmp_path):
    from async_vapo.replay.store import GroupStore

    plain = _group()
    assert b"env_spans" not in msgspec.msgpack.encode(plain, enc_hook=enc_hook)  # single-turn: bytes as before
    assert b"tool_calls" not in msgspec.msgpack.encode(plain, enc_hook=enc_hook)
    path = tmp_path / "replay.log"  # a log of such groups (what protocol 10 wrote) opens with them whole
    with GroupStore(path, fsync="never") as store:
        store.append(plain)
        turned = _group([(3, 3)])
        turned.samples[0].tool_calls, turned.samples[0].tool_seconds = 1, 0.25
        store.append(turned)
    back = [g for _seq, g in GroupStore(path, fsync="never").live()]
    assert back[0].samples[0].env_spans == [] and back[0].samples[0].tool_calls == 0
    assert [tuple(x) for x in back[1].samples[0].env_spans] == [(3, 3)]
    assert back[1].samples[0].tool_calls == 1 and back[1].samples[0].tool_seconds == 0.25
    assert model_token_mask(back[1].samples[0]) == [True] * 3 + [False] * 3 + [True] * 2
    for bad in ([(3, 0)], [(3, 3), (4, 1)], [(6, 3)]):  # empty, overlapping, past the response
        assert validate_group(_group(bad)) == REJECT_SPANS
    assert validate_group(_group([(3, 3)])) is None


def test_env_tokens_are_state_not_actions_in_the_batch():
    batch = make_rollout_batch([_group([(3, 3)])], pad_id=0)
    tb = batch.tokens
    # the environment's tokens stay in the sequence the model reads ...
    assert tb.input_ids[0, tb.prompt_len:].tolist() == [8, 9, 10, 11, 12, 13, 14, 1]
    assert tb.attention_mask[0].tolist() == [1] * 11
    # ... but are not the policy's tokens
    assert tb.response_mask.tolist() == [[1, 1, 1, 0, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]
    assert float(loss_normalizer(tb.response_mask)) == 9.0  # 5 + 4 model tokens: the denominator
    assert batch.lengths.tolist() == [5, 4]
    # a selected micro-batch keeps the whole sequence (not cut at 5, the count of its model tokens)
    assert tb.select([0]).response_ids[0].tolist() == [8, 9, 10, 11, 12, 13, 14, 1]
    # GAE steps over the environment's tokens: gamma = lam = 1, values 0.5 everywhere, reward 1 on the last token.
    # Every model token's advantage is R - V = 0.5; the environment's tokens get 0 and are skipped.
    values = torch.full(tb.response_mask.shape, 0.5)
    rewards = torch.zeros(tb.response_mask.shape)
    rewards[0, 7] = 1.0
    adv, ret = compute_gae(rewards, values, tb.response_mask, 1.0, 1.0)
    assert adv[0].tolist() == [0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.5, 0.5]
    assert ret[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path_factory.mktemp('model-cache')}"])
    base = ensure_base_model(cfg, progress=False)
    torch.manual_seed(0)
    return Learner(cfg, base), AutoTokenizer.from_pretrained(str(base))


def test_an_env_token_has_zero_gradient_and_is_out_of_the_denominator(learner):
    """On the 1-layer test model, through the learner's own forward and policy loss: advantage 1 on every token and
    old log-probs equal to the new ones (ratio 1, no clipping), so the token-level loss is -(1/N) sum over model
    tokens of ratio, and d loss / d logprob = -1/N on each of the N = 5 model tokens (not -1/8) and exactly 0 on the
    3 environment tokens. The reward sits on the last model token (index 7), not at index lengths - 1 = 4."""
    lrn, tok = learner
    batch = make_rollout_batch([_group([(3, 3)])], tok.pad_token_id)
    tb = batch.tokens.select([0])
    lp, ent = lrn._logprobs(tb, entropy_grad=False)
    lp.retain_grad()
    adv = torch.ones_like(lp)
    loss, _ = lrn._policy_loss(lp, lp.detach(), adv, tb.response_mask, ent, None)
    loss.backward()
    torch.testing.assert_close(lp.grad[0], torch.tensor([-0.2] * 3 + [0.0] * 3 + [-0.2] * 2), rtol=0, atol=1e-6)
    assert lrn._token_rewards(batch)[0].tolist() == [0, 0, 0, 0, 0, 0, 0, 1.0]
    stats = lrn.update(batch)  # a whole update runs on it
    assert all(torch.isfinite(torch.tensor(v)) for v in stats.values() if isinstance(v, float))


@pytest.mark.parametrize("packed", ["mask", "shared"])
def test_packed_and_shared_prompt_forwards_keep_the_env_tokens_as_context(learner, packed):
    """``learner.packing`` and ``learner.share_prompts`` on multi-turn samples: the environment's tokens stay in the
    packed row (each sample's model tokens after them read them), so every model token's log-prob equals the padded
    forward's; with shared prompts the row holds the group's prompt once and every response token, the environment's
    included."""
    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import model_inputs, response_logits

    lrn, tok = learner
    tb = make_rollout_batch([_group([(3, 3)])], tok.pad_token_id).tokens
    mask = tb.response_mask.bool()
    with torch.no_grad():
        want = logprobs_from_logits(response_logits(lrn.policy, tb), tb.response_ids)[mask]
        got = logprobs_from_logits(response_logits(lrn.policy, tb, packed=packed), tb.response_ids)[mask]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    row = model_inputs(tb, packed=packed).kwargs["input_ids"].shape[1]
    assert row == {"mask": 2 * 3 + 8 + 4, "shared": 3 + 8 + 4}[packed]  # the 3 environment tokens are in it


def test_rollout_env_settings_are_checked_before_any_generation():
    from async_vapo.rollout.env import EnvRunner

    load_config([], ["rollout.env=python", "rollout.generation=continuous"])  # the continuous engine runs them too
    assert EnvRunner.from_config(load_config([], [])) is None  # unset: single-turn, as before
    for spec, message in (("nocolon", "'python' or 'module:Class'"),
                          ("async_vapo.rollout.env:Missing", "has no 'Missing'"),
                          ("async_vapo.rollout.env:EnvLimits", "has no reset and step")):
        with pytest.raises((ValueError, TypeError), match=message):
            EnvRunner.from_config(load_config([], [f"rollout.env={spec}"]))
