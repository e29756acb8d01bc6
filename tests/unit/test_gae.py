"""GAE and length-adaptive λ: hand values, a naive loop reference, invariances."""

import math

import pytest
import torch
from torch.testing import assert_close

from async_vapo.algo.gae import compute_gae, length_adaptive_lambda

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 0.0}


def reference_gae(rewards, values, mask, lam, gamma):
    """The paper's recurrence, one token at a time, skipping masked positions."""
    batch, length = rewards.shape
    adv = [[0.0] * length for _ in range(batch)]
    ret = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        lam_b = float(lam[b]) if isinstance(lam, torch.Tensor) else lam
        next_value, next_adv = 0.0, 0.0
        for t in reversed([t for t in range(length) if mask[b, t]]):
            v = float(values[b, t])
            delta = float(rewards[b, t]) + gamma * next_value - v
            next_adv = delta + gamma * lam_b * next_adv
            next_value = v
            adv[b][t], ret[b][t] = next_adv, next_adv + v
    return torch.tensor(adv, dtype=F64), torch.tensor(ret, dtype=F64)


def two_rows():
    # Row 0: length 3, V = [0.5, 0.2, -0.1], R = +1 on token 2.
    # Row 1: length 2, V = [0.4, 0.3], R = -1 on token 1; position 2 is padding (garbage 7.0).
    values = torch.tensor([[0.5, 0.2, -0.1], [0.4, 0.3, 7.0]], dtype=F64)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return rewards, values, mask


def test_hand_computed_scalar_lambda():
    rewards, values, mask = two_rows()
    adv, ret = compute_gae(rewards, values, mask, lam=0.5, gamma=1.0)
    # Row 0: δ = [0.2−0.5, −0.1−0.2, 1−(−0.1)] = [−0.3, −0.3, 1.1]
    #        A2 = 1.1, A1 = −0.3 + 0.5·1.1 = 0.25, A0 = −0.3 + 0.5·0.25 = −0.175
    #        G = A + V = [0.325, 0.45, 1.0]
    # Row 1: δ = [0.3−0.4, −1−0.3] = [−0.1, −1.3]; A1 = −1.3, A0 = −0.1 + 0.5·(−1.3) = −0.75
    #        G = [−0.35, −1.0], padding → 0
    assert_close(adv, torch.tensor([[-0.175, 0.25, 1.1], [-0.75, -1.3, 0.0]], dtype=F64), **TOL)
    assert_close(ret, torch.tensor([[0.325, 0.45, 1.0], [-0.35, -1.0, 0.0]], dtype=F64), **TOL)


def test_hand_computed_per_sequence_lambda():
    rewards, values, mask = two_rows()
    adv, ret = compute_gae(rewards, values, mask, lam=torch.tensor([0.5, 0.9], dtype=F64), gamma=1.0)
    # Row 0 as above (λ = 0.5). Row 1 with λ = 0.9: A0 = −0.1 + 0.9·(−1.3) = −1.27, G0 = −0.87.
    assert_close(adv, torch.tensor([[-0.175, 0.25, 1.1], [-1.27, -1.3, 0.0]], dtype=F64), **TOL)
    assert_close(ret, torch.tensor([[0.325, 0.45, 1.0], [-0.87, -1.0, 0.0]], dtype=F64), **TOL)


def test_hand_computed_discounted():
    rewards, values, mask = two_rows()
    adv, _ = compute_gae(rewards[:1], values[:1], mask[:1], lam=0.5, gamma=0.9)
    # δ = [0.9·0.2 − 0.5, 0.9·(−0.1) − 0.2, 1.1] = [−0.32, −0.29, 1.1], γλ = 0.45
    # A2 = 1.1, A1 = −0.29 + 0.45·1.1 = 0.205, A0 = −0.32 + 0.45·0.205 = −0.22775
    assert_close(adv, torch.tensor([[-0.22775, 0.205, 1.1]], dtype=F64), **TOL)


def random_batch(seed, batch=6, length=37, holes=False):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0] = length  # one full row
    lengths[1] = 0  # one empty row
    mask = torch.arange(length) < lengths[:, None]
    if holes:
        mask &= torch.rand(batch, length, generator=gen) > 0.3
    values = torch.randn(batch, length, generator=gen, dtype=F64)
    rewards = torch.randn(batch, length, generator=gen, dtype=F64)
    lam = torch.rand(batch, generator=gen, dtype=F64)
    lam[-2:] = torch.tensor([0.0, 1.0])
    return rewards, values, mask, lam


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("gamma", [1.0, 0.97])
@pytest.mark.parametrize("holes", [False, True])
def test_matches_loop_reference(seed, gamma, holes):
    rewards, values, mask, lam = random_batch(seed, holes=holes)
    adv, ret = compute_gae(rewards, values, mask, lam=lam, gamma=gamma)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, lam, gamma)
    assert_close(adv, ref_adv, atol=1e-6, rtol=0.0)
    assert_close(ret, ref_ret, atol=1e-6, rtol=0.0)
    adv_s, _ = compute_gae(rewards, values, mask, lam=0.95, gamma=gamma)
    assert_close(adv_s, reference_gae(rewards, values, mask, 0.95, gamma)[0], atol=1e-6, rtol=0.0)


def test_long_sequence_matches_reference():
    # Non-power-of-two length exercises the last, partial doubling step.
    rewards, values, mask, _ = random_batch(11, batch=3, length=1500)
    lam = length_adaptive_lambda(mask.sum(-1), alpha=0.05).to(F64)
    adv, ret = compute_gae(rewards, values, mask, lam=lam)
    ref_adv, ref_ret = reference_gae(rewards, values, mask, lam, 1.0)
    assert_close(adv, ref_adv, atol=1e-6, rtol=0.0)
    assert_close(ret, ref_ret, atol=1e-6, rtol=0.0)


def test_masked_positions_do_not_matter():
    rewards, values, mask, lam = random_batch(3, holes=True)
    adv, ret = compute_gae(rewards, values, mask, lam=lam, gamma=0.99)
    for garbage in (1e6, -1e6, math.nan, math.inf):
        v = values.masked_fill(~mask, garbage).requires_grad_()
        r = rewards.masked_fill(~mask, garbage)
        adv_g, ret_g = compute_gae(r, v, mask, lam=lam, gamma=0.99)
        assert_close(adv_g, adv, atol=0.0, rtol=0.0)
        assert_close(ret_g, ret, atol=0.0, rtol=0.0)
        (adv_g.sum() + ret_g.sum()).backward()
        assert torch.isfinite(v.grad).all()
        assert (v.grad[~mask] == 0).all()
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_lambda_one_gamma_one_returns_final_reward():
    # Monte-Carlo targets (VAPO value pretraining, λ_critic = 1): G_t = R at every valid token.
    rewards, values, mask, _ = random_batch(5)
    lengths = mask.sum(-1)
    final = torch.randn(mask.shape[0], dtype=F64)
    terminal = torch.zeros_like(rewards)
    rows = torch.arange(mask.shape[0])[lengths > 0]
    terminal[rows, lengths[rows] - 1] = final[rows]
    _, ret = compute_gae(terminal, values * 10, mask, lam=1.0, gamma=1.0)
    assert_close(ret, torch.where(mask, final[:, None], 0.0).to(F64), atol=1e-12, rtol=0.0)


def test_lambda_zero_is_one_step_td():
    rewards, values, mask = two_rows()
    adv, _ = compute_gae(rewards, values, mask, lam=0.0)
    # δ from test_hand_computed_scalar_lambda
    assert_close(adv, torch.tensor([[-0.3, -0.3, 1.1], [-0.1, -1.3, 0.0]], dtype=F64), **TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes(dtype):
    rewards, values, mask, lam = random_batch(7)
    adv, ret = compute_gae(rewards.to(dtype), values.to(dtype), mask.float(), lam=lam.float())
    assert adv.dtype == dtype and ret.dtype == dtype
    ref_adv, _ = reference_gae(rewards, values, mask, lam.float(), 1.0)
    tol = 1e-4 if dtype == torch.float32 else 1e-6
    assert_close(adv.to(F64), ref_adv, atol=tol, rtol=tol)


def test_length_adaptive_lambda_hand_values():
    # α = 0.05: l=100 → α·l = 5 → 1 − 1/5 = 0.8; l=40 → 0.5; l=1000 → 0.98;
    # l=20 → α·l = 1 → 0; l=10 → α·l = 0.5, clamped to 1 → 0; l=0 → 0.
    lengths = torch.tensor([100, 40, 1000, 20, 10, 0])
    lam = length_adaptive_lambda(lengths, alpha=0.05)
    assert lam.dtype == torch.get_default_dtype()
    assert_close(lam, torch.tensor([0.8, 0.5, 0.98, 0.0, 0.0, 0.0]), atol=1e-6, rtol=0.0)
    lam64 = length_adaptive_lambda(lengths.to(F64), alpha=0.05)
    assert lam64.dtype == F64
    assert_close(lam64, torch.tensor([0.8, 0.5, 0.98, 0.0, 0.0, 0.0], dtype=F64), atol=1e-12, rtol=0.0)
