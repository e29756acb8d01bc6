"""The one-process trainer and the rollout engine, on the real vLLM engine with a tiny model."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_TEST_OVERRIDES, assert_engine_serves
from transformers import AutoTokenizer

from async_vapo.learner.vapo import Learner
from async_vapo.models.rl import load_critic, load_policy

pytestmark = pytest.mark.slow


def _greedy(engine, tok, prompts):
    outs = engine.generate([tok(p).input_ids for p in prompts], n=1, temperature=0.0, top_p=1.0, max_tokens=24,
                           stop_token_ids=[tok.eos_token_id])
    return [g[0].token_ids for g in outs]


def test_engine_samples_groups_with_logprobs(vllm_engine, tiny_base):
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    outs = vllm_engine.generate([tok("3+4=").input_ids, tok("9-2+1=").input_ids], n=5, temperature=1.0,
                                top_p=1.0, max_tokens=40, stop_token_ids=[tok.eos_token_id], seed=1)
    assert [len(g) for g in outs] == [5, 5]
    for group in outs:
        for s in group:
            assert len(s.logprobs) == len(s.token_ids) > 0
            assert all(lp <= 0.0 for lp in s.logprobs)
            assert s.finish_reason in ("stop", "length")


@pytest.mark.parametrize("perturb", [False, True], ids=["base", "every-weight-perturbed"])
def test_engine_logprobs_match_the_learner(vllm_engine, tiny_base, perturb):
    """After a push, the engine serves exactly the learner's policy: their log-probs of a sample agree.
    Perturbing every weight (tied embeddings included) catches a push that misses a parameter."""
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    if perturb:
        torch.manual_seed(1)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
    vllm_engine.load_weights(policy.state_dict(), version=1)
    assert_engine_serves(vllm_engine, policy, tok)


def test_weight_push_changes_outputs_in_place(vllm_engine, tiny_base):
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    prompts = ["1+2=", "7-3+5=", "9+9-9="]
    policy = load_policy(tiny_base)
    base_state = {k: v.clone() for k, v in policy.state_dict().items()}
    vllm_engine.load_weights(base_state, version=0)
    before = _greedy(vllm_engine, tok, prompts)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():  # tied embeddings stay tied
            if p.dim() == 2:
                p.add_(0.5 * torch.randn_like(p))
    seconds = vllm_engine.load_weights(policy.state_dict(), version=7)
    assert vllm_engine.version == 7 and seconds > 0
    assert_engine_serves(vllm_engine, policy, tok)
    after = _greedy(vllm_engine, tok, prompts)
    assert after != before
    vllm_engine.load_weights(base_state, version=8)
    assert _greedy(vllm_engine, tok, prompts) == before


def _reject(token: str):
    raise ValueError(f"metrics.jsonl holds {token}, which is not JSON")


def test_few_step_training_run(tiny_cfg, vllm_engine, tiny_base):
    from async_vapo.trainer import train

    summary = train(tiny_cfg, progress=False, engine=vllm_engine)
    run = tiny_cfg.run_dir()
    rows = [json.loads(x, parse_constant=_reject) for x in (run / "metrics.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in rows]
    assert kinds.count("pretrain") == tiny_cfg.algo.value_pretrain_steps
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train_rows] == [1, 2, 3]
    assert vllm_engine.version == 3 == summary["steps"]
    # CPU time of this process and the engine's since the run started: some, and no more than its cores allow
    assert 0 < summary["cpu_s"] <= summary["wall_s"] * (len(os.sched_getaffinity(0)) + 0.5)
    for key in ("rollout/reward", "rollout/accuracy", "rollout/response_length", "actor/entropy",
                "actor/clipfrac_low", "actor/clipfrac_high", "critic/value_loss", "critic/explained_variance",
                "lam_policy/mean", "time/step_s", "time/weight_push_s"):
        assert key in train_rows[-1], key
    assert all(-1.0 <= r["rollout/reward"] <= 1.0 for r in train_rows)
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert json.loads((run / "config.resolved.json").read_text())["algo"]["name"] == "vapo"

    # the checkpoint reloads to the very weights the engine is now serving
    ckpt = run / "checkpoints" / "step_3"
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    assert_engine_serves(vllm_engine, load_policy(ckpt / "policy"), tok)
    # ... and the learner resumes from it with its version and optimiser state
    learner = Learner(tiny_cfg, ckpt / "policy", ckpt / "critic")
    extra = learner.load_state(ckpt)
    assert learner.version == 3 and extra["step"] == 3 and extra["prompt_cursor"] > 0
    assert learner.actor_opt.state_dict()["state"], "optimiser moments restored"
    critic = load_critic(ckpt / "critic")
    for k, v in critic.state_dict().items():
        torch.testing.assert_close(v, learner.critic.state_dict()[k], rtol=0, atol=0)


def test_the_critic_is_scored_on_its_own_heldout_responses(tiny_cfg, vllm_engine, tmp_path):
    """``rollout.critic_eval_problems``: at each evaluation the critic is scored on that many held-out problems x
    ``critic_eval_samples`` fresh responses, not on the evaluation's one per problem (about 10 s)."""
    from async_vapo.config import load_config
    from async_vapo.trainer import train

    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           f"train.output_dir={tmp_path}/{{name}}", "train.total_steps=1", "train.eval_every=1",
                           "train.checkpoint_every=0", "rollout.critic_eval_problems=5",
                           "rollout.critic_eval_samples=3"])
    train(cfg, progress=False, engine=vllm_engine)
    evals = [r for r in map(json.loads, (cfg.run_dir() / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "eval"]
    assert len(evals) == 2 and all(r["eval/accuracy"] >= 0 for r in evals)
    for r in evals:
        assert r["critic/heldout_responses"] == 15  # 5 x 3, where the evaluation sampled 24 x 1
        assert r["time/critic_eval_s"] > 0
        assert r["time/critic_score_s"] > 0  # the critic's pass over the 15, apart from their generation
        assert "critic/heldout_ev" in r  # null where the 15 returns are all equal (an untrained tiny policy)


def test_dynamic_sampling_keeps_informative_groups_and_refills():
    from async_vapo.learner.loop import dynamic_sampling
    from async_vapo.types import Group, Trajectory

    def group(uid, rewards):
        return Group(uid=uid, prompt="1+1=", answer="2", prompt_ids=[1], version=0,
                     samples=[Trajectory(response_ids=[2], behavior_logprobs=[0.0], finish_reason="stop", reward=r)
                              for r in rewards])

    first = [group("a", [1, 1]), group("b", [1, -1]), group("c", [-1, -1])]
    refills = iter([[group("d", [-1, 1]), group("e", [1, 1])], [group("f", [1, -1]), group("g", [-1, 1])]])
    kept, seen = dynamic_sampling(first, lambda: next(refills), want=3, max_rounds=4)
    assert [g.uid for g in kept] == ["b", "d", "f"]
    assert [g.uid for g in seen] == ["a", "b", "c", "d", "e", "f", "g"]
    kept, seen = dynamic_sampling(first, lambda: None, want=3, max_rounds=4)  # the source ran dry
    assert [g.uid for g in kept] == ["b"] and len(seen) == 3
    kept, _ = dynamic_sampling(first, lambda: [group("z", [1, -1])], want=5, max_rounds=2)
    assert [g.uid for g in kept] == ["b", "z", "z"]  # bounded by max_rounds
