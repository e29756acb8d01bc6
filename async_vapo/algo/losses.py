"""VAPO losses: clip-higher PPO policy loss, critic loss, positive-example LM loss, entropy bonus.

All inputs are [B, T] with a validity ``mask`` (bool or 0/1). Each loss returns ``(loss, metrics)``;
``metrics`` maps names to detached 0-dim tensors.

    ratio    = exp(logp − logp_old)
    L_PPO    = −mean( min(ratio·A, clip(ratio, 1 − ε_low, 1 + ε_high)·A) )   PPO eq. 7, VAPO Clip-Higher
    L_NLL    = −token_mean over correct responses( logp )                    VAPO Positive Example LM Loss
    L_critic = ½·token_mean( (V − G)² ), optionally clipped around V_old
    L_ent    = −mean( H )                                                    entropy bonus (off in VAPO / DAPO)
    L_GSPO   = −mean( min(s_i·A, clip(s_i, 1 − ε_low, 1 + ε_high)·A) ),  s_i = exp(mean_t log(π/π_old))
                                                                         GSPO eq. 5-7 (arXiv 2507.18071)
    L_CISPO  = −mean( sg(clip(r_t, ≤ 1 + ε_high)) · A · log π )              CISPO eq. 4 (arXiv 2506.13585)

"mean" is one mean over every valid token (VAPO token-level loss), or with ``token_level=False``
the mean of per-sequence token means (sample-level loss of vanilla PPO / GRPO), or with ``max_tokens`` = L the sum
over every valid token divided by a constant, rows · L (Dr. GRPO, arXiv 2503.20783, §3.1: TRL's
``loss_type="dr_grpo"`` with L = the longest response allowed), so that a response's weight does not depend on its
length or on the lengths beside it.

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
- GSPO (:func:`gspo_loss`): s_i is the geometric mean of the token ratios over the tokens ``mask`` keeps (a
  rejection mask's survivors), each token's log ratio clamped to [−20, 20] first. The sequence's clipped term is put
  on each of its tokens and then aggregated like every loss here: the paper's 1/G Σ_i is ``token_level=False``; with
  ``token_level=True`` each sequence weighs by its length. Behaviour weights multiply each token's copy, so a
  sequence-level (geometric) weight multiplies the sequence's term, as the paper's sequence-level correction does.
- CISPO (:func:`cispo_loss`): the token loss is written −sg(ŵ_t)·A_t·exp(log π − sg(log π)), whose gradient is the
  paper's sg(ŵ_t)·A_t·∇log π and whose value, −ŵ_t·A_t, is comparable with the PPO surrogate's (the paper's
  −ŵ·A·log π has the same gradient and a value that means nothing). No token is dropped and the weight has no lower
  bound unless ``eps_low`` is given (the paper sets ε_low^IS large: no lower clip).
- A batch without a valid token (no rows, or every token masked) gives each loss 0 with a zero gradient and every
  metric 0 (the ``algo.utils`` empty-reduction convention, maxima too), except the explained variance: NaN.
- A rejection mask (masked IS, IcePop: ``algo.mismatch.rejection_mask``) narrows the policy surrogate's tokens
  only. The entropy bonus and the positive-example LM loss are no importance-sampled estimates of the behaviour
  policy's samples: they keep every valid response token, in their sums and in their normalisers.
"""

from __future__ import annotations

import torch

from async_vapo.algo.utils import masked_mean, masked_sum, masked_var

__all__ = ["cispo_loss", "entropy_loss", "explained_variance", "gspo_loss", "loss_normalizer", "microbatch_weight",
           "policy_loss", "positive_lm_loss", "value_loss"]

_MAX_LOG_RATIO = 20.0
_EV_REL_EPS = 1e-8


def _seq_valid(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().any(-1)


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, token_level: bool,
               max_tokens: int | None = None) -> torch.Tensor:
    """Token-level: one mean over all valid tokens. Otherwise: mean over sequences that have a valid
    token of each sequence's token mean. ``max_tokens`` = L: the sum over valid tokens / (rows · L) whatever
    ``token_level`` is (Dr. GRPO's constant normaliser)."""
    if max_tokens is not None:
        return masked_sum(per_token, mask) / max(mask.shape[0] * max_tokens, 1)
    if token_level:
        return masked_mean(per_token, mask)
    return masked_mean(masked_mean(per_token, mask, dim=-1), _seq_valid(mask))


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of non-negative ``x`` over valid positions; 0 when none is valid (a batch of no rows included)."""
    flat = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device)).flatten()
    return torch.cat((flat, flat.new_zeros(1))).max()


def loss_normalizer(mask: torch.Tensor, token_level: bool = True, max_tokens: int | None = None) -> torch.Tensor:
    """The count a loss over ``mask`` divides by: valid tokens, or sequences with a valid token, or with
    ``max_tokens`` = L rows · L (Dr. GRPO; every row counts, a response whose tokens are all masked included)."""
    valid = mask.bool()
    if max_tokens is not None:
        return torch.tensor(mask.shape[0] * max_tokens, device=mask.device)
    return valid.sum() if token_level else valid.any(-1).sum()


def microbatch_weight(
    mask_micro: torch.Tensor,
    mini_total: torch.Tensor | float,
    token_level: bool = True,
    dtype: torch.dtype | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Scale for one micro-batch's loss so that the weighted sum over micro-batches equals the
    mini-batch loss. ``mini_total``: :func:`loss_normalizer` summed over the whole mini-batch (with the same
    ``token_level`` and ``max_tokens``). 0-dim tensor of ``dtype`` (default: the default float dtype)."""
    dtype = dtype or torch.get_default_dtype()
    total = torch.as_tensor(mini_total, dtype=dtype, device=mask_micro.device)
    return loss_normalizer(mask_micro, token_level, max_tokens).to(dtype) / total.clamp(min=1)


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor, eps_low: float, eps_high: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO eq. 7's min(ratio·A, clip(ratio)·A) per position, and where each side of the clip binds (module
    docstring: strictly outside the range, on the side that binds; there clip(ratio)·A is a constant)."""
    clipped_low = valid & (adv < 0) & (ratio < 1.0 - eps_low)
    clipped_high = valid & (adv > 0) & (ratio > 1.0 + eps_high)
    clipped = clipped_low | clipped_high
    surrogate = torch.where(clipped, ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach() * adv, ratio * adv)
    return surrogate, clipped_low, clipped_high


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """log π − log π_old on valid tokens, clamped so that exp() stays finite (its backward would turn 0·inf into
    NaN; module docstring), 0 elsewhere."""
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    return torch.where(valid, (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), zero)


def _weighted(surrogate: torch.Tensor, valid: torch.Tensor, behavior_weights: torch.Tensor | None) -> torch.Tensor:
    if behavior_weights is None:
        return surrogate
    zero = torch.zeros((), dtype=surrogate.dtype, device=surrogate.device)
    return surrogate * torch.where(valid, behavior_weights.detach().to(surrogate.dtype), zero)


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, valid: torch.Tensor, clipped_low: torch.Tensor,
                   clipped_high: torch.Tensor, entropy: torch.Tensor | None) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        metrics = {
            "clipfrac_low": masked_mean(clipped_low.to(ratio.dtype), valid),
            "clipfrac_high": masked_mean(clipped_high.to(ratio.dtype), valid),
            "clipfrac": masked_mean((clipped_low | clipped_high).to(ratio.dtype), valid),
            "approx_kl": masked_mean((ratio - 1.0) - log_ratio, valid),  # k3
            "ratio_mean": masked_mean(ratio, valid),
            "ratio_max": _masked_max(ratio, valid),
        }
        if entropy is not None:
            metrics["entropy"] = masked_mean(entropy.to(ratio.dtype), valid)
    return {k: v.detach() for k, v in metrics.items()}


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
    max_tokens: int | None = None,
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
        max_tokens: L of Dr. GRPO's constant normaliser (module docstring); None = the mean ``token_level`` says.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero)
    log_ratio = _log_ratio(logprobs, old_logprobs, valid)
    ratio = torch.exp(log_ratio)
    surrogate, clipped_low, clipped_high = _clipped(ratio, adv, valid, eps_low, eps_high)
    loss = -_aggregate(_weighted(surrogate, valid, behavior_weights), valid, token_level, max_tokens)
    return loss, _ratio_metrics(ratio, log_ratio, valid, clipped_low, clipped_high, entropy)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    token_level: bool = False,
    entropy: torch.Tensor | None = None,
    behavior_weights: torch.Tensor | None = None,
    token_variant: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv 2507.18071): PPO's clip on the sequence ratio

        s_i = (π_θ(y_i) / π_old(y_i))^(1/|y_i|) = exp( (1/|y_i|) Σ_t log(π_θ(y_i,t) / π_old(y_i,t)) )   (eq. 7)
        J   = 1/G Σ_i min( s_i·A_i, clip(s_i, 1 − ε_low, 1 + ε_high)·A_i )                           (eq. 5)

    with the paper's clip range ε_low = 3e-4, ε_high = 4e-4 (§5.1: a length-normalised ratio stays within a few 1e-4
    of 1, so PPO's 0.2 would seldom bind). ``token_variant`` (GSPO-token, eq. 13-14):
    s_i,t = sg[s_i] · π_θ(y_i,t) / sg[π_θ(y_i,t)], clipped per token: the same value as s_i and, when A_i,t = A_i on
    every token, the same gradient; it lets an advantage differ per token.

    Args are :func:`policy_loss`'s (``advantages`` [B, T], a sequence's A_i on each of its tokens). The paper's
    1/G Σ_i is ``token_level=False`` (default); a sequence is clipped as a whole, so ``clipfrac`` counts the tokens
    of clipped sequences. ``ratio_mean``/``ratio_max`` are of s_i (GSPO-token: s_i,t), ``approx_kl`` the k3 of the
    token ratios.
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero)
    log_ratio = _log_ratio(logprobs, old_logprobs, valid)
    seq_log_ratio = masked_mean(log_ratio, valid, dim=-1)  # [B]: (1/|y_i|) Σ_t log ratio, 0 without a valid token
    if token_variant:
        log_s = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    else:
        log_s = seq_log_ratio.unsqueeze(-1).expand_as(log_ratio)
    s = torch.exp(torch.where(valid, log_s, zero))
    surrogate, clipped_low, clipped_high = _clipped(s, adv, valid, eps_low, eps_high)
    loss = -_aggregate(_weighted(surrogate, valid, behavior_weights), valid, token_level)
    metrics = _ratio_metrics(s, log_ratio, valid, clipped_low, clipped_high, entropy)
    with torch.no_grad():
        metrics["approx_kl"] = masked_mean(torch.expm1(log_ratio) - log_ratio, valid)
    return loss, metrics


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_high: float,
    eps_low: float | None = None,
    token_level: bool = True,
    entropy: torch.Tensor | None = None,
    behavior_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv 2506.13585, eq. 4-5): a REINFORCE token loss whose
    importance weight is clipped and carries no gradient, so that no token is dropped from the gradient

        ŵ_t = clip(r_t, 1 − ε_low, 1 + ε_high),  r_t = π_θ(y_t) / π_old(y_t)
        J   = 1/Σ_i|y_i| Σ_i Σ_t sg(ŵ_t) · A_i,t · log π_θ(y_t)

    (PPO's clip instead zeroes the gradient of a token whose ratio left the range: the rare "fork" tokens that
    reflection hinges on, §3.1). The paper sets ε_low^IS large, i.e. no lower clip: ``eps_low`` None (default).

    The ratio is taken against ``old_logprobs``, which the learner passes as the proximal policy's (its own
    log-probs at the start of the update), not the engine's behaviour log-probs: the rollout–learner gap is
    corrected apart (``behavior_weights``, truncated π_proximal / π_behaviour), as for the PPO surrogate, so a token's
    weight is sg(clip(π_θ/π_proximal))·min(π_proximal/π_behaviour, C). Against the behaviour policy the clip would
    also truncate the engine's numeric and staleness gap, and the correction would count it a second time.

    Args are :func:`policy_loss`'s; the paper's 1/Σ|y_i| is ``token_level=True``. ``clipfrac_high`` /
    ``clipfrac_low``: share of tokens whose weight the clip lowered / raised (each still in the gradient).
    """
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    adv = torch.where(valid, advantages.to(logprobs.dtype), zero)
    log_ratio = _log_ratio(logprobs, old_logprobs, valid)
    ratio = torch.exp(log_ratio)
    low = None if eps_low is None else 1.0 - eps_low
    weight = ratio.detach().clamp(min=low, max=1.0 + eps_high)
    # value −ŵ·A, gradient −ŵ·A·∇log π (module docstring)
    surrogate = weight * adv * torch.exp(torch.where(valid, logprobs - logprobs.detach(), zero))
    loss = -_aggregate(_weighted(surrogate, valid, behavior_weights), valid, token_level)
    clipped_high = valid & (ratio > 1.0 + eps_high)
    clipped_low = valid & (ratio < low) if low is not None else torch.zeros_like(valid)
    return loss, _ratio_metrics(ratio, log_ratio, valid, clipped_low, clipped_high, entropy)


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
