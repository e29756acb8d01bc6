"""Generalised advantage estimation with per-sequence λ (VAPO: decoupled and length-adaptive GAE).

Shapes: B responses, T positions. ``mask[b, t]`` is true on the generated tokens of response b
(EOS included), right-padded; the verifier reward sits on the last valid token. ``V[b, t]`` is the
critic's value of the state before token t.

    δ_t = r_t + γ·V_{t+1} − V_t,   V after the last valid token = 0
    A_t = δ_t + γ·λ·A_{t+1}  =  Σ_k (γλ)^k δ_{t+k}          (GAE, Schulman et al. 2016, eq. 16)
    returns G_t = A_t + V_t                                  (critic target)

VAPO "Decoupled-GAE": call :func:`compute_gae` twice, with λ_critic (paper: 1.0, so G_t = R for
every t when γ = 1) for the critic's returns and λ_policy for the actor's advantages.
VAPO "Length-Adaptive GAE": λ_policy per sequence from :func:`length_adaptive_lambda`.

Implementation: the backward recurrence A_t = δ_t + c_t·A_{t+1} is a first-order linear scan,
evaluated by recursive doubling in ⌈log2 T⌉ vectorised steps (no loop over T). It only forms
products of coefficients in [0, 1] and never divides by powers of γλ, so unlike cumsum-based closed
forms it is stable for any λ, including λ = 0.

Departures and choices (the paper is silent on these):
- Masked positions are skipped, not zero-filled: a valid token's V_{t+1} and A_{t+1} are those of
  the next *valid* position. For right-padded masks this is simply t+1; masks with holes (e.g. tool
  output inside a multi-turn response) are handled the same way, with γ applied per valid token.
- Rewards and values at masked positions are never read (selected away with ``torch.where``, so
  even NaN there is harmless); outputs at masked positions are 0.
- Not wrapped in ``no_grad``: callers pass detached values.
- Length-adaptive λ for α·l < 1 (where 1 − 1/(α·l) would be negative): α·l is clamped to ≥ 1 and
  λ to [0, 1], so very short responses get λ = 0 (one-step TD advantages).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["compute_gae", "length_adaptive_lambda"]


def _reverse_linear_scan(delta: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Solve A_t = delta_t + coef_t·A_{t+1} (A_T = 0) along the last dim by recursive doubling.

    Invariant after the step with offset k: A_t sums the next 2k terms and C_t is the product of the
    next 2k coefficients, so ⌈log2 T⌉ steps cover the whole sequence. Only C_t with t + 2k < T is
    ever read again, so C shrinks by 2k per step.
    """
    length = delta.shape[-1]
    adv, carry = delta, coef
    k = 1
    while k < length:
        prev = adv
        adv = prev.clone()  # never update in place what the right-hand side still reads
        adv[..., : length - k].addcmul_(carry[..., : length - k], prev[..., k:])
        keep = max(length - 2 * k, 0)
        carry = carry[..., :keep] * carry[..., k : k + keep]
        k *= 2
    return adv


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    lam: float | torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns: [B, T] each, 0 at masked positions.

    Args:
        rewards: [B, T] per-token rewards (VAPO: the verifier reward on the last valid token).
        values: [B, T] critic values V(s_t).
        mask: [B, T] bool or 0/1, valid response tokens.
        lam: GAE λ, a float or a [B] tensor (one λ per sequence, VAPO length-adaptive GAE).
        gamma: discount γ (VAPO: 1.0).
    """
    valid = mask.bool()
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    zero = torch.zeros((), dtype=dtype, device=values.device)
    r = torch.where(valid, rewards.to(dtype), zero)
    v = torch.where(valid, values.to(dtype), zero)
    batch, length = v.shape

    # Index of the next valid position strictly after t (T = "past the end", whose value is 0):
    # a reverse running minimum over the indices of valid positions.
    pos = torch.arange(length, device=v.device).expand(batch, length)
    valid_pos = torch.where(valid, pos, torch.full_like(pos, length))
    next_valid = torch.cummin(valid_pos.flip(-1), dim=-1).values.flip(-1)
    next_valid = F.pad(next_valid[:, 1:], (0, 1), value=length)
    v_next = F.pad(v, (0, 1)).gather(-1, next_valid)

    delta = torch.where(valid, r + gamma * v_next - v, zero)  # δ_t, GAE eq. 16
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=v.device, dtype=dtype)
        lam = lam.reshape(batch, 1) if lam.dim() else lam
    decay = torch.as_tensor(gamma * lam, dtype=dtype, device=v.device)
    # Masked positions pass A through unchanged (coefficient 1), so padding is skipped.
    coef = torch.where(valid, decay, torch.ones((), dtype=dtype, device=v.device))

    advantages = torch.where(valid, _reverse_linear_scan(delta, coef), zero)
    returns = torch.where(valid, advantages + v, zero)
    return advantages, returns


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO length-adaptive GAE: λ_policy = 1 − 1/(α·l) per sequence, [B] -> [B].

    α·l is clamped to ≥ 1 and λ to [0, 1] (the paper is silent for α·l < 1; see module docstring).
    Float result: the dtype of ``lengths`` if floating, else the default float dtype.
    """
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    scaled = (alpha * lengths.to(dtype)).clamp(min=1.0)
    return (1.0 - 1.0 / scaled).clamp(0.0, 1.0)
