"""KL penalty to a reference policy, per token (REINFORCE++, arXiv 2501.03262, §3; InstructGPT's KL-in-reward).

With log r_t = log π_ref(y_t) − log π(y_t) on tokens sampled from π (Schulman, "Approximating KL divergence", 2020):

    k1_t = −log r_t                      unbiased for KL(π ‖ π_ref), can be negative per token
    k2_t = ½ (log r_t)²                  biased, ≥ 0, low variance
    k3_t = (r_t − 1) − log r_t           unbiased, ≥ 0

REINFORCE++ puts r_t = −β·KL_t in each token's reward with k1 (its eq. for the token-level KL penalty), the
reference being the initial (SFT) policy and π the policy that generated the samples; the learner passes its
proximal log-probs (the weights at the start of the update) as π.

Choices: the log ratio is clamped to [−20, 20] as everywhere in ``algo`` (a −inf reference log-prob gives a large,
finite penalty); 0 on padding; no gradient (a reward).
"""

from __future__ import annotations

from typing import Literal

import torch

from async_vapo.algo.utils import masked_mean

__all__ = ["kl_penalty", "kl_metrics"]

Estimator = Literal["k1", "k2", "k3"]
_MAX_LOG_RATIO = 20.0


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, estimator: Estimator = "k1"
               ) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate: [B, T] x3 -> [B, T] detached, 0 on padding (module docstring)."""
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_r = torch.where(valid, (ref_logprobs.detach().to(logprobs.dtype) - logprobs.detach()).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO), zero)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.expm1(log_r) - log_r
    else:
        raise ValueError(f"estimator must be k1, k2 or k3, not {estimator!r}")
    return torch.where(valid, kl, zero)


def kl_metrics(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Token means of the three estimators (``k1``, ``k2``, ``k3``) and the sequence mean of Σ_t k1 (``seq_k1``)."""
    valid = mask.bool()
    out = {k: masked_mean(kl_penalty(logprobs, ref_logprobs, valid, k), valid) for k in ("k1", "k2", "k3")}
    k1 = kl_penalty(logprobs, ref_logprobs, valid, "k1")
    out["seq_k1"] = masked_mean(k1.sum(-1), valid.any(-1))
    return out
