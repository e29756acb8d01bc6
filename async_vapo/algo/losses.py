"""VAPO losses: clip-higher PPO policy loss, critic loss, positive-example LM loss, entropy bonus.

All inputs are [B, T] with a validity ``mask`` (bool or 0/1). Each loss returns ``(loss, metrics)``;
``metrics`` maps names to detached 0-dim tensors.

    ratio    = exp(logp − logp_old)
    L_PPO    = −mean( min(ratio·A, clip(ratio, 1 − ε_low, 1 + ε_high)·A) )   PPO eq. 7, VAPO Clip-Higher
    L_NLL    = −token_mean over correct responses( logp )                    VAPO Positive Example LM Loss
    L_critic = ½·token_mean( (V − G)² ), optionally clipped around V_old
    L_ent    = −mean( H )                                                    entropy bonus (off in VAPO / DAPO)

"mean" is one mean over every valid token (VAPO token-level loss), or with ``token_level=False``
the mean of per-sequence token means (sample-level loss of vanilla PPO / GRPO).

Micro-batching and data parallelism. Each loss is a mean over *its* batch, so summing micro-batch
losses does not reproduce the mini-batch loss. A trainer that splits one optimiser step's mini-batch
into micro-batches scales each micro-batch loss by :func:`microbatch_weight`, i.e. by
(micro valid tokens / mini-batch valid tokens) for token-level means, or (micro sequences with a
valid token / mini-batch sequences with a valid token) for sequence-level means, where the
denominator is :func:`loss_normalizer` summed over the mini-batch (and all-reduced across ranks;
if the data-parallel backend *averages* gradients, multiply the weight by the world size). The
accumulated gradient then equals that of one pass over the mini-batch. For the positive-example LM
loss the "valid tokens" are those of correct responses: pass ``mask & correct[:, None]``.

Departures and choices:
- Clip boundary: a token counts as clipped (zero gradient) only when the ratio is strictly
  outside the clip range on the side that binds (A > 0 and ratio > 1 + ε_high, or A < 0 and
  ratio < 1 − ε_low). At the boundary itself the unclipped branch's gradient is used. The value
  equals min(ratio·A, clip(ratio)·A) everywhere.
- log(ratio) is clamped to [−20, 20] (as verl does) so exp() cannot overflow; a token beyond that
  gets no gradient. Irrelevant for any ratio a PPO step can produce (e^20 ≈ 5e8).
- ``approx_kl`` is the k3 estimator of KL(π_old ‖ π): mean of (ratio − 1) − log ratio (Schulman,
  "Approximating KL divergence", 2020); non-negative, unbiased under samples from π_old.
- Value clipping (PPO2 implementation detail; not in the VAPO paper) applies only when both
  ``old_values`` and ``clip`` are given.
- ``explained_variance`` = 1 − Var(G − V) / Var(G) with population variances over valid tokens, and NaN
  (undefined, as in stable-baselines3) when the targets do not vary: Var(G) ≤ 1e-8 · mean(G²), which also catches
  constant targets whose computed variance is rounding noise (that would divide into a huge negative number).
  Reducers of metrics must skip NaN explained variances rather than average them in as 0.
- ``correct`` in :func:`positive_lm_loss` is read as ``correct > 0``, so bool, 0/1 and ±1 rewards work.
- A batch without a valid token (no rows, or every token masked) gives each loss 0 with a zero gradient and every
  metric 0 (the ``algo.utils`` empty-reduction convention, maxima too), except the explained variance: NaN.
- A rejection mask (masked IS, IcePop: ``algo.mismatch.rejection_mask``) narrows the policy surrogate's tokens
  only. The entropy bonus and the positive-example LM loss are no importance-sampled estimates of the behaviour
  policy's samples: they keep every valid response token, in their sums and in their normalisers.
"""

from __future__ import annotations

import torch

from async_vapo.algo.utils import masked_mean, masked_sum, masked_var

__all__ = ["entropy_loss", "explained_variance", "loss_normalizer", "microbatch_weight", "policy_loss",
           "positive_lm_loss", "value_loss"]

_MAX_LOG_RATIO = 20.0
_EV_REL_EPS = 1e-8


def _seq_valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().any(-1)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, token_level: bool) -> torch.Tensor:
    """Token-level: one mean over all valid tokens. Otherwise: mean over sequences that have a valid
    token of each sequence's token mean."""
    if token_level:
        return masked_mean(per_token, mask)
    return masked_mean(masked_mean(per_token, mask, dim=-1), _seq_valid(mask))


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of non-negative ``x`` over valid positions; 0 when none is valid (a batch of no rows included)."""
    flat = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).flatten()
    return torch.cat((flat, flat.new_zeros(1))).max()


def loss_normalizer(mask: torch.Tensor, token_level: bool = True) -> torch.Tensor:
    """The count a loss over ``mask`` divides by: valid tokens, or sequences with a valid token."""
    valid = mask.bool()
    return valid.sum() if token_level else valid.any(-1).sum()


def microbatch_weight(
    mask_micro: torch.Tensor,
    mini_total: torch.Tensor | float,
    token_level: bool = True,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scale for one micro-batch's loss so that the weighted sum over micro-batches equals the
    mini-batch loss. ``mini_total``: :func:`loss_normalizer` summed over the whole mini-batch.
    0-dim tensor of ``dtype`` (default: the default float dtype)."""
    dtype = dtype or torch.get_default_dtype()
    total = torch.as_tensor(mini_total, dtype=dtype, device=mask_micro.device)
    return loss_normalizer(mask_micro, token_level).to(dtype) / total.clamp(min=1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    token_level: bool = True,
    entropy: torch.Tensor | None = None,
    behavior_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-higher PPO surrogate (VAPO "Clip-Higher", "Token-Level Policy Gradient Loss").

    Args:
        logprobs: [B, T] log π_θ(y_t), with grad.
        old_logprobs: [B, T] log π_old(y_t) of the policy that generated the data.
        advantages: [B, T].
        mask: [B, T] valid response tokens.
        eps_low, eps_high: ratio clip range [1 − ε_low, 1 + ε_high] (VAPO: 0.2, 0.28).
        token_level: one mean over all valid tokens (VAPO) vs mean of per-sequence means.
        entropy: optional [B, T] per-token entropy, reported as a metric only.
        behavior_weights: optional [B, T] constant weight of each token's surrogate: the truncated
            π_old / π_behaviour of the decoupled PPO objective (``old_logprobs`` then being the proximal policy's,
            see :func:`async_vapo.algo.mismatch.is_weights`); None = 1. A token that a correction rejects
            (masked IS, IcePop) is not given weight 0 but left out of ``mask``, so that it leaves the mean's
            denominator too.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero)
    # Clamped so exp() stays finite (its backward would turn 0·inf into NaN); see module docstring.
    log_ratio = torch.where(valid, (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), zero)
    ratio = torch.exp(log_ratio)

    clipped_low = valid & (adv < 0) & (ratio < 1.0 - eps_low)
    clipped_high = valid & (adv > 0) & (ratio > 1.0 + eps_high)
    clipped = clipped_low | clipped_high
    # Where the clip binds, clip(ratio)·A is a constant: no gradient (PPO eq. 7).
    surrogate = torch.where(clipped, ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach() * adv, ratio * adv)
    if behavior_weights is not None:
        surrogate = surrogate * torch.where(valid, behavior_weights.detach().to(surrogate.dtype), zero)
    loss = -_aggregate(surrogate, valid, token_level)

    with torch.no_grad():
        metrics = {
            "clipfrac_low": masked_mean(clipped_low.to(ratio.dtype), valid),
            "clipfrac_high": masked_mean(clipped_high.to(ratio.dtype), valid),
            "clipfrac": masked_mean(clipped.to(ratio.dtype), valid),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, valid),  # k3
            "ratio_mean": masked_mean(ratio, valid),
            "ratio_max": _masked_max(ratio, valid),
        }
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.to(ratio.dtype), valid)
    return loss, {k: v.detach() for k, v in metrics.items()}


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(G − V) / Var(G) over valid tokens: [B, T] x3 -> 0-dim, in ``values``' dtype.

    NaN when the targets do not vary (Var(G) ≤ 1e-8 · mean(G²): every G equal, up to rounding), and when no
    token is valid. 1 for a perfect critic, 0 for one that predicts the mean, negative for a worse one."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    target = torch.where(valid, returns.to(values.dtype), zero)
    v = torch.where(valid, values.detach(), zero)
    var_returns = masked_var(target, valid)
    var_resid = masked_var(target - v, valid)
    undefined = var_returns <= _EV_REL_EPS * masked_mean(target.square(), valid)
    safe_var = torch.where(undefined, torch.ones_like(var_returns), var_returns)
    return torch.where(undefined, torch.full_like(var_returns, float("nan")), 1.0 - var_resid / safe_var)


def value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    old_values: torch.Tensor | None = None,
    clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Critic loss ½·token_mean((V − G)²), optionally PPO2-clipped; G: GAE returns with λ_critic.

    Args:
        values: [B, T] current critic values, with grad.
        returns: [B, T] targets G (GAE with λ_critic).
        mask: [B, T] valid response tokens.
        old_values, clip: when both given, the loss per token is
            max((V − G)², (clip(V, V_old − clip, V_old + clip) − G)²).
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    target = torch.where(valid, returns.to(values.dtype), zero)
    v = torch.where(valid, values, zero)
    sq_err = (v - target).square()
    metrics: dict[str, torch.Tensor] = {}
    if old_values is not None and clip is not None:
        v_old = torch.where(valid, old_values.to(values.dtype), zero)
        # Tensor-bound clamp returns V itself (bit for bit) inside the range, so ties are exact.
        v_clipped = torch.clamp(v, v_old - clip, v_old + clip)
        sq_err_clipped = (v_clipped - target).square()
        metrics["vf_clipfrac"] = masked_mean((sq_err_clipped > sq_err).to(values.dtype), valid)
        sq_err = torch.maximum(sq_err, sq_err_clipped)
    loss = 0.5 * masked_mean(sq_err, valid)

    with torch.no_grad():
        metrics["explained_variance"] = explained_variance(v, target, valid)
        metrics["value_mean"] = masked_mean(v, valid)
        metrics["return_mean"] = masked_mean(target, valid)
        metrics["value_error_abs"] = masked_mean((v - target).abs(), valid)
    return loss, {k: val.detach() for k, val in metrics.items()}


def positive_lm_loss(
    logprobs: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VAPO positive-example LM loss: token-mean NLL over the responses the verifier marked correct.

    The actor loss is L_PPO + μ·L_NLL with μ = ``pos_lm_coef`` (VAPO: 0.1), applied by the caller.

    Args:
        logprobs: [B, T] log π_θ(y_t), with grad.
        mask: [B, T] valid response tokens.
        correct: [B] bool / 0-1; a response counts when ``correct > 0``.
    Returns 0 (still attached to the graph) when no response is correct.
    """
    used = mask.bool() & (correct > 0).unsqueeze(-1)
    n_tokens = used.sum().to(logprobs.dtype)
    loss = -masked_sum(logprobs, used) / n_tokens.clamp(min=1)
    metrics = {
        "pos_lm_nll": loss.detach(),
        "pos_lm_frac": masked_mean(used.any(-1).to(logprobs.dtype), torch.ones_like(used[:, 0])),
    }
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor, mask: torch.Tensor, token_level: bool = True
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss: −mean(H) over ``mask``, the mean taken as :func:`policy_loss` takes it (one mean
    over every valid token, or with ``token_level=False`` the mean of per-sequence token means).

    The actor loss adds ``entropy_coef`` times it. ``mask`` is every valid response token, not the tokens that a
    rejection mask keeps for the surrogate (module docstring); micro-batches weight it with
    :func:`microbatch_weight` of the same mask over the mini-batch's :func:`loss_normalizer` of it.

    Args:
        entropy: [B, T] per-token entropy of the policy, with grad.
        mask: [B, T] valid response tokens.
    """
    valid = mask.bool()
    mean = _aggregate(entropy, valid, token_level)
    return -mean, {"entropy": mean.detach()}
