"""Long-sequence machinery of the learner on a tiny real model: log-probs from hidden states in chunks equal the
full logits' (values and gradients); padding-free packing with our block-diagonal mask equals the padded forward,
while packing by position ids alone attends across sequences (SDPA and eager); token-budget micro-batches make the
same update as one micro-batch of the whole mini-batch."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, _groups
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_vapo.algo.utils import entropy_from_logits, logprobs_from_logits
from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base import ensure_base_model
from async_vapo.models.rl import chunked_response_logprobs, load_critic, model_inputs, response_logits, response_values

OVERRIDES = FAST + ["base_model.num_layers=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_config([], OVERRIDES + [f"model.cache_dir={tmp_path_factory.mktemp('cache')}"])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    return cfg, base, make_rollout_batch(_groups(tok), tok.pad_token_id)


def _policy(base, impl="sdpa"):
    return AutoModelForCausalLM.from_pretrained(str(base), attn_implementation=impl).eval()


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_logprobs_and_entropy_equal_the_full_logits(setup, chunk):
    _, base, batch = setup
    tb, mask = batch.tokens, batch.tokens.response_mask.bool()
    model = _policy(base)
    logits = response_logits(model, tb, 0.7)
    lp, ent = logprobs_from_logits(logits, tb.response_ids), entropy_from_logits(logits)
    (lp[mask].sum() + ent[mask].sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    clp, cent = chunked_response_logprobs(model, tb, 0.7, chunk)
    (clp[mask].sum() + cent[mask].sum()).backward()
    torch.testing.assert_close(clp[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(cent[mask], ent[mask], rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packing_by_position_ids_alone_leaks_and_the_block_mask_does_not(setup, impl):
    _, base, batch = setup
    tb, mask = batch.tokens, batch.tokens.response_mask.bool()
    model = _policy(base, impl)
    with torch.no_grad():
        padded = response_logits(model, tb)
        packed = response_logits(model, tb, packed=True)
        # the same packed row and restarting positions, with no mask but the causal one (the pitfall)
        inputs = model_inputs(tb, packed=True)
        naive = inputs.select(model(input_ids=inputs.kwargs["input_ids"],
                                    position_ids=inputs.kwargs["position_ids"]).logits)
    assert inputs.kwargs["input_ids"].shape[1] == int(tb.attention_mask.sum())  # no padding token left
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)
    leak = float((naive[mask] - padded[mask]).abs().max())
    assert leak > 1e-2, leak  # the second sequence onwards attended to the ones before it
    critic = load_critic(base).eval()
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight)  # a zero head would hide any difference
        torch.testing.assert_close(response_values(critic, tb, packed=True)[mask], response_values(critic, tb)[mask],
                                   rtol=0, atol=1e-5)


def _update(cfg, base, batch, *overrides):
    torch.manual_seed(0)
    learner = Learner(load_config([], OVERRIDES + [f"model.cache_dir={cfg.model.cache_dir}", *overrides]), base)
    metrics = learner.update(batch)
    return learner, metrics


def test_token_budget_micro_batches_make_the_one_big_batch_update(setup):
    """The mini-batch (8 responses) as one micro-batch, against micro-batches of at most 48 padded tokens (packed,
    with chunked log-probs): the token-level loss divides by the whole mini-batch's tokens either way."""
    cfg, base, batch = setup
    big, m_big = _update(cfg, base, batch, "algo.micro_batch_size=8")
    budget = 48
    small, m_small = _update(cfg, base, batch, f"algo.max_tokens_per_micro_batch={budget}", "learner.packing=true",
                             "learner.logprob_chunk_tokens=7")
    seq_tokens = batch.tokens.attention_mask.sum(-1).tolist()
    plan = small._plan(list(range(8)), seq_tokens)[0]
    assert len(plan) > 2  # the budget really split the mini-batch
    for micro in plan:
        assert len(micro) == 1 or len(micro) * max(seq_tokens[i] for i in micro) <= budget
    assert sorted(i for micro in plan for i in micro) == list(range(8))
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert abs(m_small[key] - m_big[key]) <= 1e-5 * m_big[key], (key, m_small[key], m_big[key])
    for k, v in big.policy.state_dict().items():
        torch.testing.assert_close(small.policy.state_dict()[k], v, rtol=0, atol=1e-5)


def test_token_budget_balances_the_ranks(setup):
    """Across 2 ranks each rank's tokens differ by at most the longest sequence (longest first, to the lighter)."""
    cfg, base, batch = setup
    learner, _ = _update(cfg, base, batch, "algo.max_tokens_per_micro_batch=48")
    learner.world = 2
    seq_tokens = [5, 40, 12, 33, 8, 21, 17, 29, 3, 11]
    plans = learner._plan(list(range(10)), seq_tokens)
    loads = [sum(seq_tokens[i] for micro in p for i in micro) for p in plans]
    assert abs(loads[0] - loads[1]) <= max(seq_tokens)
    assert sorted(i for p in plans for micro in p for i in micro) == list(range(10))
