"""Policy, value and positive-example LM losses; micro-batch weighting; log-prob helpers."""

import math

import pytest
import torch
from torch.testing import assert_close

from async_vapo.algo.losses import (
    entropy_loss,
    explained_variance,
    loss_normalizer,
    microbatch_weight,
    policy_loss,
    positive_lm_loss,
    value_loss,
)
from async_vapo.algo.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
)

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 0.0}
EPS_LOW, EPS_HIGH = 0.2, 0.28


def scalar(x):
    return torch.tensor(x, dtype=F64)


# ---------------------------------------------------------------- policy loss: clip behaviour


def one_row_policy(log_ratio, adv, eps_low=EPS_LOW, eps_high=EPS_HIGH, **kw):
    logprobs = torch.tensor([log_ratio], dtype=F64, requires_grad=True)
    old = torch.zeros_like(logprobs)
    advantages = torch.tensor([adv], dtype=F64)
    mask = torch.ones_like(logprobs, dtype=torch.bool)
    loss, metrics = policy_loss(logprobs, old, advantages, mask, eps_low, eps_high, **kw)
    loss.backward()
    return loss, metrics, logprobs.grad[0]


def test_clip_per_token_table():
    # Per token: log ratio, A, clipped on the low side, clipped on the high side.
    cases = [
        (math.log(1.5), 2.0, False, True),  # A > 0, ratio above 1 + ε_high: clipped
        (math.log(1.25), 2.0, False, False),  # inside [0.8, 1.28]
        (math.log(0.5), 2.0, False, False),  # A > 0, ratio low: min picks ratio·A, not clipped
        (math.log(0.5), -1.0, True, False),  # A < 0, ratio below 1 − ε_low: clipped
        (math.log(0.9), -1.0, False, False),  # inside
        (math.log(1.5), -1.0, False, False),  # A < 0, ratio high: min picks ratio·A, not clipped
        (0.3, 0.0, False, False),  # A = 0: nothing
    ]
    log_ratio = [c[0] for c in cases]
    adv = [c[1] for c in cases]
    loss, metrics, grad = one_row_policy(log_ratio, adv)
    expect_terms, expect_grad = [], []
    for lr, a, low, high in cases:
        r = math.exp(lr)
        clipped_r = min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
        expect_terms.append(min(r * a, clipped_r * a))
        expect_grad.append(0.0 if (low or high) else -r * a / len(cases))
    assert_close(loss, scalar(-sum(expect_terms) / len(cases)), **TOL)
    assert_close(grad, torch.tensor(expect_grad, dtype=F64), **TOL)
    assert_close(metrics["clipfrac_low"], scalar(1 / 7), **TOL)
    assert_close(metrics["clipfrac_high"], scalar(1 / 7), **TOL)
    assert_close(metrics["clipfrac"], scalar(2 / 7), **TOL)


def test_clip_high_boundary_exact_and_either_side():
    r = torch.exp(torch.tensor(math.log(1.28), dtype=F64))
    eps_high = (r - 1).tolist()  # so that ratio == 1 + ε_high exactly in float64
    a = 2.0
    # Exactly at the boundary: value r·A, gradient of the unclipped branch (−r·A), not counted.
    loss, metrics, grad = one_row_policy([math.log(1.28)], [a], eps_high=eps_high)
    assert_close(loss, -r * a, **TOL)
    assert_close(grad, (-r * a).reshape(1), **TOL)
    assert metrics["clipfrac_high"] == 0
    # Just above: value (1 + ε_high)·A, zero gradient, counted.
    loss, metrics, grad = one_row_policy([math.log(1.28) + 1e-9], [a], eps_high=eps_high)
    assert_close(loss, scalar(-(1 + eps_high) * a), **TOL)
    assert grad == 0
    assert metrics["clipfrac_high"] == 1 and metrics["clipfrac_low"] == 0
    # Just below: unclipped.
    loss, metrics, grad = one_row_policy([math.log(1.28) - 1e-9], [a], eps_high=eps_high)
    assert grad != 0 and metrics["clipfrac"] == 0


def test_clip_low_boundary_negative_advantage():
    r = torch.exp(torch.tensor(math.log(0.8), dtype=F64))
    eps_low = (1 - r).tolist()
    a = -3.0
    loss, metrics, grad = one_row_policy([math.log(0.8)], [a], eps_low=eps_low)
    assert_close(loss, -r * a, **TOL)
    assert_close(grad, (-r * a).reshape(1), **TOL)
    assert metrics["clipfrac_low"] == 0
    loss, metrics, grad = one_row_policy([math.log(0.8) - 1e-9], [a], eps_low=eps_low)
    assert_close(loss, scalar(-(1 - eps_low) * a), **TOL)
    assert grad == 0
    assert metrics["clipfrac_low"] == 1 and metrics["clipfrac_high"] == 0
    _, metrics, grad = one_row_policy([math.log(0.8) + 1e-9], [a], eps_low=eps_low)
    assert grad != 0 and metrics["clipfrac"] == 0


def test_clip_higher_is_asymmetric():
    # ratio 1.25, A > 0: inside the clip-higher range [0.8, 1.28], clipped by symmetric ε = 0.2.
    _, metrics, grad = one_row_policy([math.log(1.25)], [1.0], eps_low=0.2, eps_high=0.28)
    assert metrics["clipfrac_high"] == 0 and grad != 0
    _, metrics, grad = one_row_policy([math.log(1.25)], [1.0], eps_low=0.2, eps_high=0.2)
    assert metrics["clipfrac_high"] == 1 and grad == 0
    # ratio 0.75, A < 0: clipped on the low side by both.
    _, metrics, grad = one_row_policy([math.log(0.75)], [-1.0], eps_low=0.2, eps_high=0.28)
    assert metrics["clipfrac_low"] == 1 and grad == 0


def test_token_level_vs_sequence_level():
    # ratio = 1, so each token's surrogate is its advantage.
    # Row 0: one token, A = 3. Row 1: three tokens, A = 1. Row 2: no valid tokens (ignored).
    adv = torch.tensor([[3.0, 9.0, 9.0], [1.0, 1.0, 1.0], [5.0, 5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    logprobs = torch.full_like(adv, -1.0)
    tok, _ = policy_loss(logprobs, logprobs, adv, mask, EPS_LOW, EPS_HIGH, token_level=True)
    seq, _ = policy_loss(logprobs, logprobs, adv, mask, EPS_LOW, EPS_HIGH, token_level=False)
    # token level: −(3 + 1 + 1 + 1)/4 = −1.5; sequence level: −(3/1 + 3/3)/2 = −2.0; differ by 0.5
    assert_close(tok, scalar(-1.5), **TOL)
    assert_close(seq, scalar(-2.0), **TOL)


def test_policy_metrics_hand_values():
    # Two valid tokens with log ratios 0.1 and −0.2, a padded one with garbage.
    logprobs = torch.tensor([[0.1, -0.2, 50.0]], dtype=F64)
    old = torch.zeros_like(logprobs)
    mask = torch.tensor([[1, 1, 0]])
    entropy = torch.tensor([[1.0, 2.0, 100.0]], dtype=F64)
    _, m = policy_loss(logprobs, old, torch.ones_like(logprobs), mask, EPS_LOW, EPS_HIGH, entropy=entropy)
    r1, r2 = math.exp(0.1), math.exp(-0.2)
    # k3 = (r − 1) − log r per token
    assert_close(m["approx_kl"], scalar(((r1 - 1 - 0.1) + (r2 - 1 + 0.2)) / 2), **TOL)
    assert_close(m["ratio_mean"], scalar((r1 + r2) / 2), **TOL)
    assert_close(m["ratio_max"], scalar(r1), **TOL)
    assert_close(m["entropy"], scalar(1.5), **TOL)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_policy_loss_ignores_masked_garbage():
    gen = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(3, 5, generator=gen, dtype=F64)
    old = logprobs + 0.1 * torch.randn(3, 5, generator=gen, dtype=F64)
    adv = torch.randn(3, 5, generator=gen, dtype=F64)
    mask = torch.arange(5) < torch.tensor([[5], [2], [3]])
    base, _ = policy_loss(logprobs, old, adv, mask, EPS_LOW, EPS_HIGH)
    lp = logprobs.masked_fill(~mask, math.nan).requires_grad_()
    loss, _ = policy_loss(lp, old.masked_fill(~mask, 1e6), adv.masked_fill(~mask, math.inf), mask, 0.2, 0.28)
    loss.backward()
    assert_close(loss, base, atol=0.0, rtol=0.0)
    assert torch.isfinite(lp.grad).all() and (lp.grad[~mask] == 0).all()


# ---------------------------------------------------------------- value loss


def test_value_loss_hand_value_and_clipping():
    values = torch.tensor([[1.0, 2.0, 99.0]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[0.0, 4.0, -99.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    loss, m = value_loss(values, returns, mask)
    # errors 1, −2 → ½·(1 + 4)/2 = 1.25; |err| mean 1.5
    assert_close(loss, scalar(1.25), **TOL)
    assert_close(m["value_error_abs"], scalar(1.5), **TOL)
    assert_close(m["value_mean"], scalar(1.5), **TOL)
    assert_close(m["return_mean"], scalar(2.0), **TOL)
    assert "vf_clipfrac" not in m

    # Token 0: V_old = 3, clip 0.5 → V_clip = 2.5, (2.5 − 0)² = 6.25 > 1 → clipped, zero gradient.
    # Token 1: V_old = 2.1 → V within range, V_clip = V: tie, not clipped, gradient (V − G)/2 = −1.
    old = torch.tensor([[3.0, 2.1, 0.0]], dtype=F64)
    loss, m = value_loss(values, returns, mask, old_values=old, clip=0.5)
    loss.backward()
    assert_close(loss, scalar(0.5 * (6.25 + 4.0) / 2), **TOL)
    assert_close(m["vf_clipfrac"], scalar(0.5), **TOL)
    assert_close(values.grad, torch.tensor([[0.0, -1.0, 0.0]], dtype=F64), **TOL)


def test_explained_variance():
    returns = torch.tensor([[1.0, -1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    _, m = value_loss(returns + 0.0, returns, mask)
    assert_close(m["explained_variance"], scalar(1.0), **TOL)
    mean = (1 - 1 + 1 + 1 + 1) / 5
    _, m = value_loss(torch.full_like(returns, mean), returns, mask)
    assert_close(m["explained_variance"], scalar(0.0), **TOL)
    # Var(G) = 0: undefined, NaN (not 0, which would read as "the critic predicts the mean").
    _, m = value_loss(torch.zeros_like(returns), torch.ones_like(returns), mask)
    assert torch.isnan(m["explained_variance"])
    # Hand value: G = [1, −1, 1, 1, 1], V = 0.5·G → residual 0.5·G, EV = 1 − 0.25 = 0.75.
    _, m = value_loss(0.5 * returns, returns, mask)
    assert_close(m["explained_variance"], scalar(0.75), **TOL)
    # Hand value, padding ignored: G = [1, −1, 1, 1, 1] (mean 0.6, Var 0.64), V = [1, 0, 1, 1, 1] →
    # G − V = [0, −1, 0, 0, 0] (mean −0.2, Var 0.16) → EV = 1 − 0.16 / 0.64 = 0.75.
    values = torch.tensor([[1.0, 0.0, 1.0, 9.0], [1.0, 1.0, -9.0, 9.0]], dtype=F64)
    assert_close(explained_variance(values, returns, mask), scalar(0.75), **TOL)


def test_explained_variance_of_constant_returns_is_nan_not_rounding_noise():
    """Every return 0.1 (float32): the computed Var(G) is ~6e-17 of rounding, not 0. Dividing by it gave an
    explained variance of about −2e16; it is undefined (NaN)."""
    returns = torch.full((3, 7), 0.1)
    mask = torch.ones(3, 7)
    values = torch.linspace(-1.0, 1.0, 21).reshape(3, 7)
    assert 0 < float(masked_var(returns, mask)) < 1e-15
    assert torch.isnan(explained_variance(values, returns, mask))
    _, m = value_loss(values, returns, mask)
    assert torch.isnan(m["explained_variance"])
    assert torch.isnan(explained_variance(values, returns, torch.zeros(3, 7)))  # nothing valid: undefined too
    # a large constant (1000) is just as constant; a small but real spread (1e-3 around 0) is defined
    assert torch.isnan(explained_variance(values, torch.full((3, 7), 1000.0), mask))
    small = 1e-3 * torch.linspace(-1.0, 1.0, 21).reshape(3, 7)
    assert_close(explained_variance(small, small, mask), torch.tensor(1.0), atol=1e-6, rtol=0)


def test_explained_variance_against_a_naive_loop():
    torch.manual_seed(0)
    for _ in range(20):
        returns, values = torch.randn(4, 6, dtype=F64), torch.randn(4, 6, dtype=F64)
        mask = torch.rand(4, 6) > 0.3
        g = [float(returns[i, j]) for i in range(4) for j in range(6) if mask[i, j]]
        r = [g_ - float(values[i, j]) for (i, j), g_ in zip(
            [(i, j) for i in range(4) for j in range(6) if mask[i, j]], g, strict=True)]

        def var(xs):
            mu = sum(xs) / len(xs)
            return sum((x - mu) ** 2 for x in xs) / len(xs)

        assert_close(explained_variance(values, returns, mask), scalar(1 - var(r) / var(g)), **TOL)


# ---------------------------------------------------------------- positive-example LM loss


def test_positive_lm_loss_hand_value():
    logprobs = torch.tensor([[-1.0, -2.0, 9.0], [-3.0, -4.0, -5.0], [-0.5, 9.0, 9.0]], dtype=F64)
    logprobs.requires_grad_()
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    correct = torch.tensor([True, False, True])
    loss, m = positive_lm_loss(logprobs, mask, correct)
    # correct rows 0 and 2: tokens −1, −2, −0.5 → NLL mean 3.5/3
    assert_close(loss, scalar(3.5 / 3), **TOL)
    assert_close(m["pos_lm_nll"], scalar(3.5 / 3), **TOL)
    assert_close(m["pos_lm_frac"], scalar(2 / 3), **TOL)
    loss.backward()
    expect = torch.tensor([[-1, -1, 0], [0, 0, 0], [-1, 0, 0]], dtype=F64) / 3
    assert_close(logprobs.grad, expect, **TOL)
    # ±1 rewards work as "correct".
    loss_pm, _ = positive_lm_loss(logprobs, mask, torch.tensor([1.0, -1.0, 1.0]))
    assert_close(loss_pm, loss, **TOL)


def test_positive_lm_loss_no_correct_keeps_graph():
    logprobs = torch.full((2, 3), -1.0, dtype=F64, requires_grad=True)
    loss, m = positive_lm_loss(logprobs, torch.ones(2, 3), torch.tensor([False, False]))
    assert loss == 0 and loss.requires_grad
    loss.backward()
    assert (logprobs.grad == 0).all()
    assert m["pos_lm_frac"] == 0


# ---------------------------------------------------------------- micro-batching


def test_microbatch_weight_hand_values():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    assert loss_normalizer(mask, token_level=True) == 3
    assert loss_normalizer(mask, token_level=False) == 2
    assert_close(microbatch_weight(mask, 10, token_level=True, dtype=F64), scalar(0.3), **TOL)
    assert_close(microbatch_weight(mask, torch.tensor(8), token_level=False, dtype=F64), scalar(0.25), **TOL)


def make_setup(seed=0, batch=6, length=7, hidden=4, vocab=5):
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, length, hidden, generator=gen, dtype=F64)
    labels = torch.randint(0, vocab, (batch, length), generator=gen)
    lengths = torch.tensor([7, 2, 0, 5, 1, 4])
    mask = torch.arange(length) < lengths[:, None]
    old = -torch.rand(batch, length, generator=gen, dtype=F64) - 1.0
    adv = torch.randn(batch, length, generator=gen, dtype=F64)
    returns = torch.randn(batch, length, generator=gen, dtype=F64)
    old_values = torch.randn(batch, length, generator=gen, dtype=F64)
    correct = torch.tensor([True, False, True, True, False, True])
    w_pi = torch.randn(hidden, vocab, generator=gen, dtype=F64, requires_grad=True)
    w_v = torch.randn(hidden, generator=gen, dtype=F64, requires_grad=True)
    data = dict(feats=feats, labels=labels, mask=mask, old=old, adv=adv, returns=returns,
                old_values=old_values, correct=correct)  # fmt: skip
    return data, (w_pi, w_v)


def losses_on(d, params, token_level):
    w_pi, w_v = params
    logprobs = logprobs_from_logits(d["feats"] @ w_pi, d["labels"])
    values = d["feats"] @ w_v
    pg, _ = policy_loss(logprobs, d["old"], d["adv"], d["mask"], EPS_LOW, EPS_HIGH, token_level=token_level)
    vf, _ = value_loss(values, d["returns"], d["mask"], old_values=d["old_values"], clip=0.2)
    nll, _ = positive_lm_loss(logprobs, d["mask"], d["correct"])
    return pg, vf, nll


def grads(loss, params):
    return torch.autograd.grad(loss, params, retain_graph=True)


@pytest.mark.parametrize("token_level", [True, False])
def test_microbatch_gradient_equivalence(token_level):
    data, params = make_setup()
    pg, vf, nll = losses_on(data, params, token_level)
    full = grads(pg + vf + 0.1 * nll, params)

    mask, correct = data["mask"], data["correct"]
    pos_mask = mask & correct[:, None]
    n_pg = loss_normalizer(mask, token_level)
    n_vf = loss_normalizer(mask, True)
    n_nll = loss_normalizer(pos_mask, True)
    acc = [torch.zeros_like(p) for p in params]
    naive = [torch.zeros_like(p) for p in params]
    splits = [slice(0, 2), slice(2, 3), slice(3, 6)]  # 9, 0 and 10 valid tokens
    for s in splits:
        micro = {k: v[s] for k, v in data.items()}
        pg, vf, nll = losses_on(micro, params, token_level)
        weighted = (
            microbatch_weight(micro["mask"], n_pg, token_level, dtype=F64) * pg
            + microbatch_weight(micro["mask"], n_vf, True, dtype=F64) * vf
            + 0.1 * microbatch_weight(pos_mask[s], n_nll, True, dtype=F64) * nll
        )
        for a, g in zip(acc, grads(weighted, params), strict=True):
            a += g
        for a, g in zip(naive, grads((pg + vf + 0.1 * nll) / len(splits), params), strict=True):
            a += g
    for a, f in zip(acc, full, strict=True):
        assert_close(a, f, atol=1e-10, rtol=0.0)
    # Without the weighting the gradients differ: the test can fail.
    assert not torch.allclose(naive[0], full[0], atol=1e-6)


# ---------------------------------------------------------------- utils


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_logprobs_and_entropy_from_logits(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(2, 4, 11, generator=gen, dtype=F64)).to(dtype)
    labels = torch.randint(0, 11, (2, 4), generator=gen)
    ref_logp = torch.log_softmax(logits.double(), -1).gather(-1, labels[..., None]).squeeze(-1)
    ref_ent = torch.distributions.Categorical(logits=logits.double()).entropy()
    tol = 1e-12 if dtype == F64 else 1e-5
    logp = logprobs_from_logits(logits, labels)
    assert logp.dtype == (torch.float32 if dtype == torch.bfloat16 else dtype)
    assert_close(logp.double(), ref_logp, atol=tol, rtol=tol)
    assert_close(entropy_from_logits(logits).double(), ref_ent, atol=tol, rtol=tol)


def test_masked_stats():
    x = torch.tensor([[1.0, 2.0, math.nan], [3.0, 6.0, 1e9]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # valid values 1, 2, 3, 6: mean 3, population var (4 + 1 + 0 + 9)/4 = 3.5, unbiased 14/3
    assert_close(masked_mean(x, mask), scalar(3.0), **TOL)
    assert_close(masked_mean(x, mask, dim=-1), torch.tensor([1.5, 4.5], dtype=F64), **TOL)
    assert_close(masked_var(x, mask), scalar(3.5), **TOL)
    assert_close(masked_var(x, mask, unbiased=True), scalar(14 / 3), **TOL)
    assert_close(masked_mean(x, torch.zeros_like(mask)), scalar(0.0), **TOL)
    w = masked_whiten(x, mask)
    assert_close(masked_mean(w, mask), scalar(0.0), **TOL)
    assert_close(masked_var(w, mask), scalar(1.0), atol=1e-6, rtol=0.0)
    assert (w[~mask.bool()] == 0).all()
    assert_close(masked_mean(masked_whiten(x, mask, shift_mean=False), mask), scalar(3.0), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_losses_run_in_both_dtypes(dtype):
    data, (w_pi, w_v) = make_setup()
    d = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in data.items()}
    params = (w_pi.detach().to(dtype).requires_grad_(), w_v.detach().to(dtype).requires_grad_())
    pg, vf, nll = losses_on(d, params, token_level=True)
    assert pg.dtype == vf.dtype == nll.dtype == dtype
    ref = losses_on(data, (w_pi, w_v), token_level=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for got, want in zip((pg, vf, nll), ref, strict=True):
        assert_close(got.double(), want.detach(), atol=tol, rtol=tol)


def test_critic_error_by_age_separates_ages_and_ignores_padding():
    from async_vapo.learner.vapo import critic_error_by_age

    returns = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [1.0, 1.0, 9.0], [-1.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    values = returns.clone()  # age 0: exact
    values[2:] = 0.0  # age 2: a constant value, no better than the mean
    values[mask == 0] = 123.0  # padding must not count
    out = critic_error_by_age(values, returns, mask, torch.tensor([0, 0, 2, 2]))
    assert out["critic_age/0/explained_variance"] == pytest.approx(1.0)
    assert out["critic_age/0/value_error_abs"] == pytest.approx(0.0)
    assert out["critic_age/0/samples"] == 2
    # age 2 targets over valid tokens: 1, 1, -1 (mean 1/3); V = 0: the error's variance is the targets' -> EV 0
    assert out["critic_age/2/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert out["critic_age/2/value_error_abs"] == pytest.approx(1.0)
    assert set(out) == {f"critic_age/{a}/{k}" for a in (0, 2) for k in ("explained_variance", "value_error_abs",
                                                                            "samples")}
    # ages 0 and 1 split differently: age 1 (row 1) has targets −1, −1, −1 only: EV undefined, the error is not
    out = critic_error_by_age(values, returns, mask, torch.tensor([0, 1, 2, 2]))
    assert math.isnan(out["critic_age/1/explained_variance"])
    assert out["critic_age/1/value_error_abs"] == pytest.approx(0.0)
    assert math.isnan(out["critic_age/0/explained_variance"])  # row 0 alone: targets 1, 1


def test_learner_metric_means_skip_undefined_explained_variances_only():
    from async_vapo.learner.vapo import _mean_metrics

    rows = [{"critic/explained_variance": 0.5, "critic/value_loss": 1.0},
            {"critic/explained_variance": math.nan, "critic/value_loss": 3.0},
            {"critic/explained_variance": 0.25, "critic/value_loss": math.nan}]
    out = _mean_metrics(rows[:2])
    assert out == {"critic/explained_variance": 0.5, "critic/value_loss": 2.0}
    out = _mean_metrics(rows)
    assert out["critic/explained_variance"] == pytest.approx(0.375) and math.isnan(out["critic/value_loss"])
    assert math.isnan(_mean_metrics(rows[1:2])["critic/explained_variance"])


# -- decoupled PPO: samples of older weights ------------------------------------------------------------------


def test_policy_loss_weights_each_tokens_surrogate_and_nothing_else():
    from async_vapo.algo.losses import policy_loss

    torch.manual_seed(0)
    lp = (torch.randn(3, 5) * 0.1 - 1).requires_grad_()
    old = lp.detach() + torch.randn(3, 5) * 0.05
    adv, mask = torch.randn(3, 5), torch.ones(3, 5)
    mask[2, 3:] = 0
    base, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28)
    ones, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, behavior_weights=torch.ones(3, 5))
    assert torch.equal(base, ones)
    w = torch.rand(3, 5) + 0.5
    weighted, _ = policy_loss(lp, old, adv, mask, 0.2, 0.28, behavior_weights=w)
    (g_w,) = torch.autograd.grad(weighted, lp)
    (g_1,) = torch.autograd.grad(base, lp)
    valid = mask.bool()
    torch.testing.assert_close(g_w[valid], (g_1 * w)[valid])  # token-level mean: each token's gradient times w


def test_decoupled_correction_leaves_on_policy_updates_alone_and_moves_stale_ones(tmp_path):
    """Behaviour log-probs equal to the learner's own (on-policy): the switch changes nothing. Behaviour
    log-probs of other weights (stale samples): it changes the update."""
    from conftest import FAST, _groups
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.base_model import ensure_base_model

    def run(correction: bool, shift: float) -> tuple[dict, dict]:
        cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", f"algo.behavior_correction={correction}"])
        base = ensure_base_model(cfg, progress=False)
        tok = AutoTokenizer.from_pretrained(str(base))
        torch.manual_seed(0)
        learner = Learner(cfg, base)
        batch = make_rollout_batch(_groups(tok), tok.pad_token_id)
        with torch.no_grad():
            own, _ = learner._forward_old(batch)
        batch.behavior_logprobs = torch.where(batch.tokens.response_mask.bool(), own + shift, batch.behavior_logprobs)
        metrics = learner.update(batch)
        return {k: v.clone() for k, v in learner.policy.state_dict().items()}, metrics

    on_a, m_on = run(True, 0.0)
    on_b, _ = run(False, 0.0)
    assert abs(m_on["actor/behavior_weight_mean"] - 1.0) < 1e-6 and m_on["behavior_logprob_gap"] < 1e-6
    for k in on_a:
        torch.testing.assert_close(on_a[k], on_b[k], rtol=0, atol=1e-6)
    stale_a, m_stale = run(True, -0.3)  # the behaviour policy gave these tokens less mass: weight e^0.3
    stale_b, _ = run(False, -0.3)
    assert abs(m_stale["actor/behavior_weight_mean"] - math.exp(0.3)) < 1e-4
    assert any(not torch.allclose(stale_a[k], stale_b[k], atol=1e-6) for k in stale_a)


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("rows", [0, 2])
def test_every_loss_takes_a_batch_without_a_valid_token(token_level, rows):
    # rows = 0: a batch of no responses at all ([0, T]); rows = 2: responses whose every token is masked.
    # Each loss is 0 with a zero gradient, every metric finite (0 by the empty-reduction convention) except the
    # explained variance, which is undefined (NaN) without a token.
    lp = torch.zeros(rows, 5, dtype=F64).requires_grad_()
    none = torch.zeros(rows, 5, dtype=torch.bool)
    other = torch.full((rows, 5), -0.5, dtype=F64)
    pl, pm = policy_loss(lp, other, other, none, EPS_LOW, EPS_HIGH, token_level=token_level, entropy=other,
                         behavior_weights=other)
    vl, vm = value_loss(lp, other, none, old_values=other, clip=0.2)
    nl, nm = positive_lm_loss(lp, none, torch.ones(rows))
    for loss in (pl, vl, nl):
        (grad,) = torch.autograd.grad(loss, lp)
        assert float(loss.detach()) == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    metrics = {**pm, **vm, **nm}
    assert math.isnan(float(metrics.pop("explained_variance")))
    assert {k: float(v) for k, v in metrics.items()} == dict.fromkeys(metrics, 0.0)


@pytest.mark.parametrize("token_level", [True, False])
def test_entropy_loss_hand_values_gradient_and_micro_batches(token_level):
    # H row 0 = [1, 2, 3 | pad 9], row 1 = [4, 0.5 | pad 9, 9]
    #   token level: −(1 + 2 + 3 + 4 + 0.5) / 5 = −2.1; dL/dH = −1/5 on each valid token
    #   sequence level: −(6/3 + 4.5/2) / 2 = −2.125; dL/dH = −1/(2·3) on row 0, −1/(2·2) on row 1
    h = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 0.5, 9.0, 9.0]], dtype=F64, requires_grad=True)
    m = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    loss, metrics = entropy_loss(h, m, token_level)
    (grad,) = torch.autograd.grad(loss, h)
    want, g0, g1 = (-2.1, -1 / 5, -1 / 5) if token_level else (-2.125, -1 / 6, -1 / 4)
    assert_close(loss.detach(), scalar(want), **TOL)
    assert float(metrics["entropy"]) == pytest.approx(-want, abs=1e-12)
    assert_close(grad, torch.tensor([[g0, g0, g0, 0.0], [g1, g1, 0.0, 0.0]], dtype=F64), **TOL)
    # one row per micro-batch, each weighted by its share of the whole batch's normaliser: the same loss
    total = loss_normalizer(m, token_level)
    parts = sum(microbatch_weight(m[r:r + 1], total, token_level, F64) * entropy_loss(h[r:r + 1], m[r:r + 1],
                                                                                       token_level)[0]
                for r in range(2))
    assert_close(parts, loss, **TOL)
