"""Rollout–learner mismatch: how far the engine's behaviour policy is from the learner's proximal policy, and the
corrections of the PPO surrogate for it.

Notation, per response b and token t (all [B, T], ``mask`` the valid response tokens):

    log ρ_t  = log π_proximal(y_t) − log π_behaviour(y_t)       the learner's log-prob at the start of the update
                                                                over the engine's (decoupled PPO, AReaL)
    k3_t     = (ρ_t − 1) − log ρ_t                              Schulman's k3 estimator of KL(π_behaviour ‖ π_proximal)
                                                                (tokens are sampled from π_behaviour, so it is
                                                                unbiased and each term is ≥ 0)
    log ρ_b  = Σ_t log ρ_t                                      the sequence's ratio (product of token ratios)
    log ρ̄_b = Σ_t log ρ_t / L_b                                its geometric mean (L_b valid tokens)

Measures (:func:`mismatch_metrics`): the token mean of k3, the token mean and max of |log ρ_t|, the sequence mean
of Σ_t k3_t (a sequence-level KL estimate) and the sequence mean and max of |log ρ_b|; the token measures again
for each version lag (learner version − the version that generated the token: 0, 1, 2 or more). A lag is given
per sequence ([B]) or per token ([B, T]); today every token of a group carries the group's version.

Corrections, composable with the PPO clip (verl ``rollout_corr``: IS weights and rejection sampling as separate
mechanisms; NeMo-RL ``tis``, ``icepop``, ``seq-mask-tis``; "When Speed Kills Stability", Liu, Li et al. 2025):

- :func:`is_weights` — a constant weight on each token's clipped surrogate, truncated at ``cap``:
  ``token``    w_t = min(ρ_t, C)                   token-level TIS (AReaL's decoupled PPO; verl ``rollout_is=token``)
  ``sequence`` w_t = min(ρ_b, C) on every token    sequence-level TIS (verl ``rollout_is=sequence``)
  ``geometric`` w_t = min(ρ̄_b, C) on every token  sequence-level TIS on the geometric mean
- :func:`rejection_mask` — tokens (or whole sequences) whose statistic leaves [low, high] are *removed* from the
  loss: ``token`` on ρ_t (masked IS at token level; IcePop with [α, β]), ``sequence`` on ρ_b (masked IS at sequence
  level, NeMo-RL ``seq-mask-tis``, verl ``rollout_rs=sequence``), ``geometric`` on ρ̄_b (verl ``rollout_rs=geometric``).
  The caller passes the returned mask as the loss's validity mask, so a rejected token leaves the denominator of the
  token mean as well as its numerator. A zero *weight* would keep it in the denominator and shrink every other
  token's gradient by the rejected fraction: the normalisation bug slime and verl both shipped and then fixed.

The named corrections of the literature as compositions (weights × mask):
  token TIS      = is_weights(token, C)
  sequence TIS   = is_weights(sequence | geometric, C)
  masked IS      = is_weights(token | sequence, C) × rejection_mask(token | sequence, 1/C, C)
  IcePop         = is_weights(token, ≥ β) × rejection_mask(token, α, β)   (Ring-1T / IcePop: α = 0.5, β = 5)

Departures and choices:
- log ρ_t is clamped to [−20, 20] (verl's safety bound) before anything else, so no exp() overflows: a ratio of
  e^±20 is reported and corrected as e^±20 (a −inf log-prob on one side alone included). Equal log-probs give
  log ρ_t = 0 even when both are −inf (neither policy can emit the token: they agree; −inf − (−inf) would be NaN).
  A sequence's log ρ_b is a sum of clamped terms, hence finite for any length; weights are computed as
  exp(min(log w, log C)), never exp() of an unbounded sum.
- Tokens whose behaviour log-prob is NaN (the engine did not report one) count as on-policy: log ρ_t = 0, and
  they are left out of the mismatch measures (they carry no information about it). At token level that makes
  their weight 1 and they are never rejected. At sequence and geometric level they add 0 to Σ_t log ρ_t (and
  count in L_b) and, like every token of the sequence, take its weight and its rejection: those corrections
  weight or drop the whole sampled response, not single tokens of it. A response with no behaviour log-prob at
  all has log ρ_b = 0: weight 1, kept.
- Weights are 1 on padding (the loss ignores padding anyway). Sequence and geometric weights and masks are
  computed from the sequence's valid tokens only; a sequence with no valid token gets log ρ_b = 0.
- Reductions over an empty selection are 0 (the ``algo.utils`` convention), maxima too; each lag bucket also
  reports ``token_frac``, its share of the measured tokens, so that an empty bucket's 0 is not read as "no
  mismatch".
- A negative lag (a sample newer than the learner, which the staleness rule never admits) falls in no bucket.
- Everything is tensor-in, tensor-out: no ``.item()``; metrics are detached 0-dim tensors.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from async_vapo.algo.utils import masked_mean, masked_sum

__all__ = ["LAG_BUCKETS", "behavior_log_ratio", "is_weights", "mismatch_metrics", "rejection_mask"]

Level = Literal["token", "sequence", "geometric"]

MAX_LOG_RATIO = 20.0
LAG_BUCKETS = ("lag0", "lag1", "lag2plus")
"""Names of the version-lag buckets: lag 0 (on-policy), 1, and 2 or more."""


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of ``x`` over valid positions; 0 when none is valid (for non-negative quantities)."""
    flat = torch.where(mask.bool(), x, _zero(x)).flatten()
    return torch.cat((flat, _zero(x).view(1))).max()


def behavior_log_ratio(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
    """log ρ_t = log π_proximal − log π_behaviour, clamped to [−20, 20]: [B, T] x3 -> [B, T].

    0 on padding, where the behaviour log-prob is NaN (not reported by the engine) and where the two are equal, −inf
    included (−inf − (−inf) is NaN, which no clamp bounds). A −inf on one side alone clamps to ±20."""
    prox = proximal_logprobs.detach()
    behav = behavior_logprobs.to(prox.dtype)
    use = mask.bool() & ~torch.isnan(behav) & (prox != behav)
    return torch.where(use, (prox - behav).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), _zero(prox))


def _sequence_log_ratio(log_ratio: torch.Tensor, mask: torch.Tensor, level: Level) -> torch.Tensor:
    """The level's statistic in log space, per token: [B, T] -> [B, T] (sequence levels broadcast along T)."""
    if level == "token":
        return log_ratio
    valid = mask.bool()
    total = masked_sum(log_ratio, valid, dim=-1)  # [B]
    if level == "geometric":
        total = total / valid.sum(-1).to(log_ratio.dtype).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"level must be token, sequence or geometric, not {level!r}")
    return total.unsqueeze(-1).expand_as(log_ratio)


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: Level, cap: float
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights of the behaviour correction: [B, T] log ρ (from :func:`behavior_log_ratio`),
    [B, T] mask -> [B, T] weights (1 on padding), detached.

    ``token``: min(ρ_t, cap); ``sequence``: min(Π_t ρ_t, cap) on every token of the sequence; ``geometric``:
    min(exp(mean_t log ρ_t), cap). Metrics (over valid tokens): ``weight_mean``, ``weight_max``,
    ``truncated_frac`` (share of tokens whose weight the cap lowered)."""
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")
    valid = mask.bool()
    log_w = _sequence_log_ratio(log_ratio.detach(), valid, level)
    log_cap = math.log(cap)
    truncated = valid & (log_w > log_cap)
    # exp of the clamped log, and exactly the cap where it binds (exp(log C) need not round to C)
    w = torch.where(truncated, torch.full((), cap, dtype=log_w.dtype, device=log_w.device),
                    torch.exp(log_w.clamp(max=log_cap)))
    w = torch.where(valid, w, torch.ones((), dtype=log_w.dtype, device=log_w.device))
    metrics = {
        "weight_mean": masked_mean(w, valid),
        "weight_max": _masked_max(w, valid),
        "truncated_frac": masked_mean(truncated.to(w.dtype), valid),
    }
    return w, metrics


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, level: Level, low: float, high: float
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The tokens kept by masked IS / IcePop: [B, T] log ρ, [B, T] mask -> [B, T] bool (a subset of ``mask``).

    A token is kept when its level's ratio lies in [low, high] (bounds included): ρ_t (``token``), Π_t ρ_t
    (``sequence``: the whole sequence kept or dropped) or exp(mean_t log ρ_t) (``geometric``). Pass the result as
    the loss's mask, so that rejected tokens leave its denominator. Metrics: ``masked_frac`` (share of valid
    tokens rejected) and ``masked_seq_frac`` (share of sequences with a valid token that lost every token)."""
    if not 0 < low <= high:
        raise ValueError(f"need 0 < low <= high, got [{low}, {high}]")
    valid = mask.bool()
    stat = _sequence_log_ratio(log_ratio.detach(), valid, level)
    keep = valid & (stat >= math.log(low)) & (stat <= math.log(high))
    seqs = valid.any(-1)
    dropped_seq = seqs & ~keep.any(-1)
    dtype = log_ratio.dtype
    metrics = {
        "masked_frac": masked_mean((valid & ~keep).to(dtype), valid),
        "masked_seq_frac": masked_mean(dropped_seq.to(dtype), seqs),
    }
    return keep, metrics


def _lag_masks(lags: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    lags = lags.to(valid.device)
    if lags.dim() == 1:
        lags = lags.unsqueeze(-1)
    lags = torch.broadcast_to(lags, valid.shape)
    return {"lag0": valid & (lags == 0), "lag1": valid & (lags == 1), "lag2plus": valid & (lags >= 2)}


def mismatch_metrics(proximal_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor, mask: torch.Tensor,
                     lags: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """How far the behaviour policy is from the proximal one, over the tokens with a behaviour log-prob.

    Args:
        proximal_logprobs: [B, T] the learner's log-probs at the start of the update.
        behavior_logprobs: [B, T] the engine's (NaN where not reported: left out).
        mask: [B, T] valid response tokens.
        lags: optional [B] or [B, T] integer version lag of each sequence or token (learner version − the
            generating version); adds ``<bucket>/k3``, ``<bucket>/abs_log_ratio_mean``,
            ``<bucket>/abs_log_ratio_max`` and ``<bucket>/token_frac`` for each of :data:`LAG_BUCKETS`.
    Returns detached 0-dim tensors: ``k3`` (token mean), ``abs_log_ratio_mean``, ``abs_log_ratio_max`` (per token),
    ``seq_k3`` (sequence mean of Σ_t k3_t), ``seq_abs_log_ratio_mean``, ``seq_abs_log_ratio_max`` (|Σ_t log ρ_t|
    per sequence), ``measured_frac`` (share of valid tokens that have a behaviour log-prob).
    """
    with torch.no_grad():
        valid = mask.bool()
        measured = valid & ~torch.isnan(behavior_logprobs)
        log_ratio = behavior_log_ratio(proximal_logprobs, behavior_logprobs, measured)
        k3 = torch.where(measured, torch.expm1(log_ratio) - log_ratio, _zero(log_ratio))
        abs_lr = log_ratio.abs()
        seqs = measured.any(-1)
        seq_abs = masked_sum(log_ratio, measured, dim=-1).abs()
        out = {
            "k3": masked_mean(k3, measured),
            "abs_log_ratio_mean": masked_mean(abs_lr, measured),
            "abs_log_ratio_max": _masked_max(abs_lr, measured),
            "seq_k3": masked_mean(masked_sum(k3, measured, dim=-1), seqs),
            "seq_abs_log_ratio_mean": masked_mean(seq_abs, seqs),
            "seq_abs_log_ratio_max": _masked_max(seq_abs, seqs),
            "measured_frac": masked_mean(measured.to(log_ratio.dtype), valid),
        }
        if lags is not None:
            n_measured = measured.sum().to(log_ratio.dtype).clamp(min=1)
            for name, m in _lag_masks(lags, measured).items():
                out[f"{name}/k3"] = masked_mean(k3, m)
                out[f"{name}/abs_log_ratio_mean"] = masked_mean(abs_lr, m)
                out[f"{name}/abs_log_ratio_max"] = _masked_max(abs_lr, m)
                out[f"{name}/token_frac"] = m.sum().to(log_ratio.dtype) / n_measured
    return out
