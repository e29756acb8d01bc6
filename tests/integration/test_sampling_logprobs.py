"""The engine's log-probs and the learner's are of one distribution, softmax(logits / rollout.temperature), at a
temperature other than 1; greedy evaluation still decodes the policy's argmax."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_engine_serves
from transformers import AutoTokenizer

from async_vapo.algo.utils import logprobs_from_logits
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.rl import make_token_batch, response_logits
from async_vapo.types import Group, Trajectory

pytestmark = pytest.mark.slow

T = 0.7
PROMPTS = ["5+5-3=", "8-2+7="]  # 2 x 4 samples: one mini-batch, so its ratio is on-policy


def test_engine_and_learner_logprobs_agree_at_the_sampling_temperature(tiny_cfg, tiny_base, vllm_engine):
    cfg = tiny_cfg.model_copy(deep=True)
    cfg.rollout.temperature = T
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    learner = Learner(cfg, tiny_base)
    vllm_engine.load_weights(learner.policy_state(), version=0)  # the session's engine may serve other weights
    assert_engine_serves(vllm_engine, learner.policy, tok, temperature=T)

    # the learner's own path: engine samples at T as a rollout batch, the engine's log-probs as the behaviour's
    prompts = [tok(p).input_ids for p in PROMPTS]
    outs = vllm_engine.generate(prompts, n=4, temperature=T, top_p=1.0, max_tokens=30,
                                stop_token_ids=[tok.eos_token_id], seed=11)
    groups = [Group(uid=str(i), prompt=p, answer="0", prompt_ids=ids, version=0,
                    samples=[Trajectory(response_ids=s.token_ids, behavior_logprobs=s.logprobs, finish_reason="stop",
                                        reward=float(k % 2) * 2 - 1, correct=bool(k % 2), verdict="x")
                             for k, s in enumerate(group)])
              for i, (p, ids, group) in enumerate(zip(PROMPTS, prompts, outs, strict=True))]
    batch = make_rollout_batch(groups, tok.pad_token_id)
    mask = batch.tokens.response_mask.bool()
    with torch.no_grad():
        proximal, _ = learner._forward_old(batch)
    torch.testing.assert_close(proximal[mask], batch.behavior_logprobs[mask], atol=1e-3, rtol=0)
    # ... and the temperature matters at this tolerance: the untempered log-probs of the same tokens are far off
    with torch.no_grad():
        untempered = logprobs_from_logits(response_logits(learner.policy, batch.tokens), batch.tokens.response_ids)
    assert float((untempered - batch.behavior_logprobs)[mask].abs().max()) > 0.05

    # on-policy samples: behaviour weights 1 and ratio 1 in the update itself
    metrics = learner.update(batch)
    assert metrics["behavior_logprob_gap"] < 1e-3
    assert metrics["actor/behavior_weight_mean"] == pytest.approx(1.0, abs=2e-3)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0, abs=2e-3)


def test_greedy_evaluation_decodes_the_argmax(tiny_base, vllm_engine):
    """eval_temperature = 0 (with an eval_top_p < 1) still works: each token is the policy's most likely one."""
    from async_vapo.models.rl import load_policy

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    vllm_engine.load_weights(policy.state_dict(), version=0)
    prompts = [tok(p).input_ids for p in PROMPTS]
    outs = vllm_engine.generate(prompts, n=1, temperature=0.0, top_p=0.7, max_tokens=30,
                                stop_token_ids=[tok.eos_token_id])
    for ids, (sample,) in zip(prompts, outs, strict=True):
        assert len(sample.logprobs) == len(sample.token_ids) > 0
        batch = make_token_batch([ids], [sample.token_ids], tok.pad_token_id)
        with torch.no_grad():
            greedy = response_logits(policy, batch).argmax(-1)[0]
        assert greedy.tolist() == sample.token_ids
