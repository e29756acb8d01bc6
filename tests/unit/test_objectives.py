"""The objectives beside PPO / GRPO / VAPO (issue 49): Dr. GRPO, RLOO, REINFORCE++ (and -baseline), GSPO (and
GSPO-token), CISPO, and the KL penalty to a reference policy. Hand-computed float64 cases for every advantage and
loss (masked tokens, a group whose rewards are all equal, one-sample groups, extreme ratios), naive references, and
one learner update per objective on the 1-layer test model."""

from __future__ import annotations

import math

import pytest
import torch

from async_vapo.algo.advantages import (
    group_normalized_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from async_vapo.algo.kl import kl_metrics, kl_penalty
from async_vapo.algo.losses import cispo_loss, gspo_loss, loss_normalizer, microbatch_weight, policy_loss
from async_vapo.config import load_config

F64 = torch.float64
TOL = {"rtol": 1e-12, "atol": 1e-12}

# group 0: rewards 1, 0, 0, 1; group 1: all equal; group 2: one sample; group 3: 0.5, 0 (ids need not be sorted)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 0.5, 0.0], dtype=F64)
GROUPS = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3, 9, 1, 1])


# ---------------------------------------------------------------- advantages
def test_dr_grpo_advantage_is_reward_minus_group_mean_without_std():
    # group 0 mean 0.5; group 1 equal -> 0; group 2 alone -> 0; group 3 mean 0.25
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 0, 0.25, -0.25], dtype=F64)
    torch.testing.assert_close(group_normalized_advantages(REWARDS, GROUPS, scale=False), expected, **TOL)
    # GRPO divides the same numbers by the group's unbiased std (group 0: sqrt(1/3); group 3: sqrt(0.125))
    grpo = group_normalized_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(grpo[:4], expected[:4] / (math.sqrt(1 / 3) + 1e-6), **TOL)
    torch.testing.assert_close(grpo[9:], expected[9:] / (math.sqrt(0.125) + 1e-6), **TOL)


def test_rloo_advantage_leaves_one_out():
    # group 0, R = 1: the others 0, 0, 1 -> mean 1/3 -> 2/3; R = 0: the others 1, 0, 1 -> 2/3 -> -2/3
    # group 3: 0.5 - 0 = 0.5, 0 - 0.5 = -0.5; equal rewards and a lone sample: 0
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0, 0, 0.5, -0.5], dtype=F64)
    got = rloo_advantages(REWARDS, GROUPS)
    torch.testing.assert_close(got, expected, **TOL)
    # a naive loop over the samples
    naive = []
    for i in range(len(REWARDS)):
        others = [float(REWARDS[j]) for j in range(len(REWARDS)) if GROUPS[j] == GROUPS[i] and j != i]
        naive.append(float(REWARDS[i]) - sum(others) / len(others) if others else 0.0)
    torch.testing.assert_close(got, torch.tensor(naive, dtype=F64), **TOL)


def test_reinforce_pp_returns_with_kl_normalised_over_the_batch():
    # token rewards r_t = -KL_t (beta = 1 here) + R on the last token; padding holds NaN, never read
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.1, float("nan")]], dtype=F64)
    outcome = torch.tensor([1.0, 0.0], dtype=F64)
    r = -kl
    r[0, 2] += outcome[0]
    r[1, 1] += outcome[1]
    # returns: [0.4, 0.5, 0.7] and [-0.4, 0.1]; batch mean 1.3 / 5 = 0.26; population variance 0.732 / 5 = 0.1464
    returns = [0.4, 0.5, 0.7, -0.4, 0.1]
    std = math.sqrt(0.1464 + 1e-8)
    expected = torch.tensor([[(x - 0.26) / std for x in returns[:3]], [(x - 0.26) / std for x in returns[3:]] + [0]],
                            dtype=F64)
    got = reinforce_pp_advantages(r, mask)
    torch.testing.assert_close(got, expected, **TOL)
    assert got[1, 2] == 0 and torch.isfinite(got).all()
    # every return equal (no KL, one outcome for all): advantage 0, not NaN
    flat = torch.zeros(2, 3, dtype=F64)
    flat[:, -1] = 1.0
    assert torch.equal(reinforce_pp_advantages(flat, torch.ones(2, 3, dtype=torch.bool)), torch.zeros(2, 3, dtype=F64))


def test_kl_estimators_by_hand():
    lp = torch.tensor([[math.log(0.5), math.log(0.2), 0.0]], dtype=F64)
    ref = torch.tensor([[math.log(0.25), -math.inf, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    # token 0: log r = log(0.25 / 0.5) = -log 2; token 1: a reference that cannot emit it, log r clamped to -20
    lr = [-math.log(2), -20.0]
    k1 = kl_penalty(lp, ref, mask, "k1")
    torch.testing.assert_close(k1, torch.tensor([[math.log(2), 20.0, 0]], dtype=F64), **TOL)
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k2"),
                               torch.tensor([[0.5 * lr[0] ** 2, 200.0, 0]], dtype=F64), **TOL)
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k3"),
                               torch.tensor([[(0.5 - 1) + math.log(2), math.expm1(-20) + 20, 0]], dtype=F64), **TOL)
    m = kl_metrics(lp, ref, mask)
    torch.testing.assert_close(m["k1"], torch.tensor((math.log(2) + 20) / 2, dtype=F64), **TOL)
    torch.testing.assert_close(m["seq_k1"], torch.tensor(math.log(2) + 20, dtype=F64), **TOL)


# ---------------------------------------------------------------- Dr. GRPO's constant normaliser
def test_dr_grpo_loss_divides_by_rows_times_max_tokens():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, 99.0]], dtype=F64)
    lp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(2, 3, dtype=F64), adv, mask, 0.2, 0.2, max_tokens=4)
    # ratio 1: -(3 * 1 - 2 * 2) / (2 rows * L = 4) = 1/8, where the token mean would be 1/5
    torch.testing.assert_close(loss, torch.tensor(0.125, dtype=F64), **TOL)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-1, -1, -1], [2, 2, 0]], dtype=F64) / 8, **TOL)
    # split into two micro-batches of one row, weighted by microbatch_weight: the same loss
    total = loss_normalizer(mask, max_tokens=4)
    parts = [microbatch_weight(mask[i: i + 1], total, dtype=F64, max_tokens=4)
             * policy_loss(torch.zeros(1, 3, dtype=F64), torch.zeros(1, 3, dtype=F64), adv[i: i + 1], mask[i: i + 1],
                           0.2, 0.2, max_tokens=4)[0] for i in range(2)]
    torch.testing.assert_close(sum(parts), loss.detach(), **TOL)


# ---------------------------------------------------------------- GSPO
def _gspo_case():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    delta = torch.tensor([[0.3, -0.1, 0.1], [0.0003, 0.0001, 0.0]], dtype=F64)  # log pi - log pi_old
    old = torch.full((2, 3), -1.0, dtype=F64)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=F64)
    return mask, (old + delta).requires_grad_(True), old, adv


def test_gspo_clips_the_sequence_ratio_by_hand():
    mask, lp, old, adv = _gspo_case()
    loss, m = gspo_loss(lp, old, adv, mask, 3e-4, 4e-4)
    # s_0 = exp(mean(0.3, -0.1, 0.1)) = e^0.1 > 1 + 4e-4 with A > 0: clipped, the constant 1.0004
    # s_1 = exp(mean(3e-4, 1e-4)) = e^2e-4, inside [1 - 3e-4, 1 + 4e-4]: s_1 * A = -e^2e-4
    s1 = math.exp(2e-4)
    torch.testing.assert_close(loss, torch.tensor(-(1.0004 - s1) / 2, dtype=F64), **TOL)
    loss.backward()
    # only sequence 1 has a gradient: d/d lp_t of -(1/2)(-s_1) = s_1 * (1/2) * (1/|y_1| = 1/2)
    torch.testing.assert_close(lp.grad, torch.tensor([[0, 0, 0], [s1 / 4, s1 / 4, 0]], dtype=F64), **TOL)
    torch.testing.assert_close(m["clipfrac"], torch.tensor(3 / 5, dtype=F64), **TOL)  # sequence 0's three tokens
    torch.testing.assert_close(m["ratio_max"], torch.tensor(math.exp(0.1), dtype=F64), **TOL)
    # token-level aggregation weighs each sequence by its length: (3 * 1.0004 - 2 * s_1) / 5
    tl, _ = gspo_loss(lp, old, adv, mask, 3e-4, 4e-4, token_level=True)
    torch.testing.assert_close(tl, torch.tensor(-(3 * 1.0004 - 2 * s1) / 5, dtype=F64), **TOL)


def test_gspo_token_has_gspo_value_and_gradient_with_sequence_advantages():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(4, 6, generator=g) > 0.3
    mask[:, 0] = True
    old = -torch.rand(4, 6, generator=g, dtype=F64) - 0.5
    lp = (old + 0.01 * torch.randn(4, 6, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0], dtype=F64)[:, None].expand(4, 6)
    grads = []
    for variant in (False, True):
        lp.grad = None
        loss, _ = gspo_loss(lp, old, adv, mask, 0.2, 0.2, token_variant=variant)  # wide clip: none binds
        loss.backward()
        grads.append((loss.detach(), lp.grad.clone()))
    torch.testing.assert_close(grads[0][0], grads[1][0], **TOL)
    torch.testing.assert_close(grads[0][1], grads[1][1], **TOL)
    # and the token variant lets an advantage differ per token: A_i,t weighs each token's own gradient
    lp.grad = None
    adv_t = adv.clone()
    adv_t[0, 0] = 3.0
    gspo_loss(lp, old, adv_t, mask, 0.2, 0.2, token_variant=True)[0].backward()
    assert not torch.allclose(lp.grad[0], grads[1][1][0])


def test_gspo_extreme_ratio_masked_tokens_and_behaviour_weights():
    mask, lp, old, adv = _gspo_case()
    with torch.no_grad():
        lp[0, 0] = old[0, 0] + 500.0  # log ratio clamped to 20 before the mean
        lp[1, 2] = float("nan")  # padding: never read
    loss, m = gspo_loss(lp, old, adv, mask, 3e-4, 4e-4)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    torch.testing.assert_close(m["ratio_max"], torch.tensor(math.exp((20 - 0.1 + 0.1) / 3), dtype=F64), **TOL)
    # A < 0 with a huge ratio takes the unclipped s·A (PPO's pessimism): a finite gradient
    neg, _ = gspo_loss(lp.detach().requires_grad_(True), old, -adv, mask, 3e-4, 4e-4)
    assert torch.isfinite(neg)
    # a geometric behaviour weight, constant over a sequence, multiplies that sequence's term
    w = torch.tensor([[2.0] * 3, [0.5] * 3], dtype=F64)
    mask2, lp2, old2, adv2 = _gspo_case()
    weighted, _ = gspo_loss(lp2, old2, adv2, mask2, 3e-4, 4e-4, behavior_weights=w)
    torch.testing.assert_close(weighted, torch.tensor(-(2 * 1.0004 - 0.5 * math.exp(2e-4)) / 2, dtype=F64), **TOL)


# ---------------------------------------------------------------- CISPO
def test_cispo_keeps_every_token_with_clipped_stop_gradient_weights():
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    old = torch.full((2, 3), -2.0, dtype=F64)
    ratios = torch.tensor([[1.5, 0.5, 1.0], [1.1, 1.0, 1.0]], dtype=F64)
    lp = (old + ratios.log()).requires_grad_(True)
    adv = torch.tensor([[1.0] * 3, [-2.0] * 3], dtype=F64)
    loss, m = cispo_loss(lp, old, adv, mask, eps_high=0.28)
    # weights min(r, 1.28) with no lower clip: 1.28, 0.5, 1 | 1.1; value -(1.28 + 0.5 + 1 - 2 * 1.1) / 4 tokens
    torch.testing.assert_close(loss, torch.tensor(-0.58 / 4, dtype=F64), **TOL)
    loss.backward()
    # gradient -w * A / 4 on every valid token: the clipped one (r = 1.5, A > 0) keeps its gradient, unlike PPO's
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28, -0.5, -1.0], [2.2, 0, 0]], dtype=F64) / 4, **TOL)
    torch.testing.assert_close(m["clipfrac_high"], torch.tensor(0.25, dtype=F64), **TOL)
    assert m["clipfrac_low"] == 0
    ppo_lp = lp.detach().clone().requires_grad_(True)
    policy_loss(ppo_lp, old, adv, mask, 0.2, 0.28)[0].backward()
    assert ppo_lp.grad[0, 0] == 0  # PPO drops that token
    # with a lower clip (the paper's "large" eps_low: none) 0.5 would rise to 0.8
    lp.grad = None
    low, _ = cispo_loss(lp, old, adv, mask, eps_high=0.28, eps_low=0.2)
    torch.testing.assert_close(low, torch.tensor(-(1.28 + 0.8 + 1 - 2.2) / 4, dtype=F64), **TOL)
    # sequence-level aggregation: mean of the sequences' means
    seq, _ = cispo_loss(lp, old, adv, mask, eps_high=0.28, token_level=False)
    torch.testing.assert_close(seq, torch.tensor(-((1.28 + 0.5 + 1) / 3 - 2.2) / 2, dtype=F64), **TOL)


def test_cispo_extreme_ratios_and_padding_stay_finite():
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    old = torch.tensor([[-30.0, 0.0, 0.0]], dtype=F64)
    lp = torch.tensor([[0.0, -40.0, float("nan")]], dtype=F64, requires_grad=True)  # ratios e^30 and e^-40
    adv = torch.tensor([[1.0, 1.0, 1.0]], dtype=F64)
    loss, m = cispo_loss(lp, old, adv, mask, eps_high=0.28)
    loss.backward()
    # weights 1.28 (capped) and e^-20 (the log ratio clamped to -20, no lower clip)
    torch.testing.assert_close(loss, torch.tensor(-(1.28 + math.exp(-20)) / 2, dtype=F64), **TOL)
    torch.testing.assert_close(lp.grad, torch.tensor([[-1.28 / 2, -math.exp(-20) / 2, 0]], dtype=F64), **TOL)
    torch.testing.assert_close(m["ratio_max"], torch.tensor(math.exp(20), dtype=F64), **TOL)


# ---------------------------------------------------------------- the config switches
def test_names_select_estimator_objective_and_kl():
    def algo(*o):
        return load_config([], [f"algo.{x}" for x in o]).algo

    table = {"vapo": ("gae", "ppo", 0.0), "grpo": ("grpo", "ppo", 0.0), "dr_grpo": ("dr_grpo", "ppo", 0.0),
             "rloo": ("rloo", "ppo", 0.0), "reinforce_pp": ("reinforce_pp", "ppo", 0.01),
             "reinforce_pp_baseline": ("reinforce_pp_baseline", "ppo", 0.01), "gspo": ("grpo", "gspo", 0.0),
             "gspo_token": ("grpo", "gspo_token", 0.0), "cispo": ("grpo", "cispo", 0.0)}
    for name, (est, obj, beta) in table.items():
        a = algo(f"name={name}")
        assert (a.advantage_estimator, a.policy_objective, a.effective_kl_coef) == (est, obj, beta), name
        assert a.constant_loss_normalizer == (name == "dr_grpo")
    assert algo("name=reinforce_pp", "kl_coef=0").effective_kl_coef == 0
    assert algo("name=vapo", "kl_coef=0.05").effective_kl_coef == 0.05
    with pytest.raises(ValueError, match="KL"):
        algo("name=grpo", "kl_coef=0.01")
    for name in ("rloo", "dr_grpo", "gspo", "cispo", "reinforce_pp_baseline"):
        with pytest.raises(ValueError, match="group_size"):
            algo(f"name={name}", "group_size=1", "prompts_per_step=128", "mini_batch_size=64",
                 "micro_batch_size=64")
    assert algo("name=reinforce_pp", "group_size=1", "prompts_per_step=128").group_size == 1


def test_plan_counts_the_reference_policy():
    from async_vapo.deploy.scale import LearnerSetup, ModelShape, learner_memory

    shape = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                       num_kv_heads=2, head_dim=2)  # 420 parameters (test_scale)
    cfg = load_config([], ["algo.name=reinforce_pp"])
    s = LearnerSetup.from_config(cfg, ranks=2, prompt_tokens=4)
    assert s.reference and s.models == 1
    assert learner_memory(shape, s)["state"] == (16 + 4) * 420 // 2
    assert not LearnerSetup.from_config(load_config([], ["algo.name=grpo"]), ranks=2, prompt_tokens=4).reference


# ---------------------------------------------------------------- one learner update per objective
OBJECTIVES = ["dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "gspo_token", "cispo"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


@pytest.mark.parametrize("name", OBJECTIVES)
def test_one_learner_update_per_objective(cache, name):
    """Two updates on the 1-layer test model (2 groups of 4), with the behaviour correction on engine log-probs:
    a finite loss, every step moves the policy, and the reference (REINFORCE++) stays the initial policy while the
    KL to it becomes non-zero."""
    from test_learner import make

    learner, batch = make(cache, f"algo.name={name}", "optim.actor_lr=1e-3", behavior=-2.0)
    assert (learner.reference is not None) == name.startswith("reinforce_pp")
    initial = [p.detach().clone() for p in learner.policy.parameters()]
    for step in range(2):
        before = [p.detach().clone() for p in learner.policy.parameters()]
        m = learner.update(batch)
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]), m
        if step == 0 and learner.reference is not None:  # the policy is still the reference: every row's KL is 0
            assert abs(m["kl_ref/k1"]) < 1e-6 and m["kl_ref/k3"] < 1e-6, m
        now = learner.policy.parameters()
        moved = sum(float((p.detach() - b).abs().sum()) for p, b in zip(now, before, strict=True))
        assert moved > 0, step
    if learner.reference is not None:
        for p, q in zip(learner.reference.parameters(), initial, strict=True):
            assert torch.equal(p, q)
        assert m["kl_ref/k3"] > 0 and math.isfinite(m["kl_ref/k1"])


@pytest.mark.parametrize("name", ["gspo", "cispo", "dr_grpo"])
def test_objectives_compose_with_a_rejection_mask(cache, name):
    """A sequence rejection mask that drops the responses whose engine log-probs are far from the learner's: the
    loss is over the kept responses only (its value changes when the dropped ones do not count), still finite."""
    from test_learner import make

    def update(*extra):
        learner, batch = make(cache, f"algo.name={name}", *extra)
        proximal, _ = learner._forward_old(batch)
        batch.behavior_logprobs = proximal.clone()  # ρ = 1: kept
        batch.behavior_logprobs[:3] -= 5.0  # three responses the engine found far less likely: log ρ_b ≥ 10 > log 1e4
        return learner.update(batch)

    kept = update("algo.behavior_weight=geometric", "algo.behavior_mask=sequence", "algo.behavior_mask_high=1e4")
    assert kept["correction/masked_seq_frac"] == 3 / 8 and math.isfinite(kept["actor/pg_loss"])
    everything = update("algo.behavior_weight=geometric")
    assert kept["actor/pg_loss"] != everything["actor/pg_loss"]


def test_learner_advantages_follow_the_estimator(cache):
    """The learner's advantages are the algo functions' on its batch: the group mean (Dr. GRPO), the leave-one-out
    mean (RLOO), and REINFORCE++-baseline's returns with −β·KL in the token rewards."""
    from test_learner import make

    from async_vapo.algo.advantages import broadcast_to_tokens

    learner, batch = make(cache, "algo.name=reinforce_pp_baseline")
    batch.rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])  # group means 0.25 and 0.75
    mask = batch.tokens.response_mask
    kl = torch.rand(mask.shape) * mask
    adv, returns, _ = learner.advantages(batch, None, kl)
    outcome = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75])
    token_r = torch.zeros(mask.shape)
    token_r[torch.arange(8), batch.lengths - 1] = outcome
    torch.testing.assert_close(adv, reinforce_pp_advantages((token_r - 0.01 * kl) * mask, mask))
    assert returns is None
    for name, seq in [("dr_grpo", outcome), ("rloo", outcome * 4 / 3)]:
        learner.algo = load_config([], [f"algo.name={name}", "algo.group_size=4", "algo.prompts_per_step=2",
                                         "algo.mini_batch_size=8", "algo.micro_batch_size=4"]).algo
        adv, _, _ = learner.advantages(batch, None)
        torch.testing.assert_close(adv, broadcast_to_tokens(seq, mask), msg=name)


def test_vapo_with_zero_values_builds_no_critic_and_gae_runs_on_v_equal_zero(cache):
    """``algo.zero_values`` (issue 45's V ≡ 0 row): no critic, no value pretraining batches, and the advantage of
    response token t is (γλ)^(T−1−t)·R with VAPO's length-adaptive λ = 1 − 1/(αT); an update moves the policy."""
    from test_learner import make

    learner, batch = make(cache, "algo.name=vapo", "algo.zero_values=true", "algo.alpha=0.5", "optim.actor_lr=1e-3")
    assert learner.critic is None and learner.algo.value_pretrain_batches == 0
    batch.rewards = torch.tensor([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0])
    mask = batch.tokens.response_mask
    adv, returns, _ = learner.advantages(batch, None)
    for i, (n, r) in enumerate(zip(batch.lengths.tolist(), batch.rewards.tolist(), strict=True)):
        lam = 1 - 1 / (0.5 * n)
        want = torch.tensor([lam ** (n - 1 - t) * r for t in range(n)])
        torch.testing.assert_close(adv[i, :n].float(), want, rtol=1e-5, atol=1e-6)
        assert not adv[i, n:].any()
    torch.testing.assert_close(returns * mask, batch.rewards[:, None] * mask)  # λ_critic 1: the outcome everywhere
    before = [p.detach().clone() for p in learner.policy.parameters()]
    m = learner.update(batch)
    assert "critic/value_loss" not in m and math.isfinite(m["actor/pg_loss"])
    assert any(not torch.equal(p, b) for p, b in zip(learner.policy.parameters(), before, strict=True))
    with pytest.raises(ValueError, match="zero_values"):
        load_config([], ["algo.name=grpo", "algo.zero_values=true"])


def test_report_pairs_each_objective_with_grpo(tmp_path):
    """``async-vapo experiment report``: a further objective's final minus GRPO's by seed, against the two-sided
    95 % t interval, and the bar chart of every method's final accuracy."""
    from test_experiments import _fake_run

    from async_vapo.experiments.comparison import report

    for seed, (grpo, rloo, cispo) in enumerate([(0.40, 0.50, 0.40), (0.50, 0.62, 0.70), (0.60, 0.68, 0.40)]):
        for name, acc in (("grpo", grpo), ("rloo", rloo), ("cispo", cispo)):
            _fake_run(tmp_path, f"{name}_s{seed}", [0.2, acc, acc], wall_s=60, cpu_s=None)
    result = report(tmp_path)["comparison"]
    # rloo - grpo: +0.10, +0.12, +0.08 -> mean 0.10, sd 0.02, half-width 4.303 * 0.02 / sqrt 3 = 0.0497: beyond
    r = result["rloo"]["minus_grpo_paired"]
    assert r["mean"] == pytest.approx(0.10) and r["sd"] == pytest.approx(0.02)
    assert r["half_width_95"] == pytest.approx(4.303 * 0.02 / 3 ** 0.5)
    # cispo - grpo: 0, +0.20, -0.20 -> mean 0, not beyond
    c = result["cispo"]["minus_grpo_paired"]
    assert c["mean"] == pytest.approx(0.0, abs=1e-12) and c["half_width_95"] > 0.2
    table = (tmp_path / "comparison.md").read_text()
    assert "| rloo − grpo | 0, 1, 2 | +0.100, +0.120, +0.080 | +0.100 ± 0.020 | [+0.050, +0.150] | yes |" in table
    cispo_line = next(x for x in table.splitlines() if x.startswith("| cispo − grpo | 0, 1, 2 |"))
    assert cispo_line.endswith("| no |")
    assert (tmp_path / "final_accuracy.png").stat().st_size > 0
