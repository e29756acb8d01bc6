"""Masked reductions and log-prob helpers shared by the losses and estimators.

Conventions: ``x`` and ``mask`` are [B, T] (or broadcastable). ``mask`` is a validity mask, bool or
float 0/1, never a weight: anything non-zero counts as valid. Reductions select with ``torch.where``
rather than multiply, so NaN or inf at masked positions never leaks into a result or a gradient.
An empty selection reduces to 0, not NaN.
"""

from __future__ import annotations

import torch

__all__ = [
    "entropy_from_logits",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over valid positions (all dims when ``dim`` is None)."""
    selected = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return selected.sum() if dim is None else selected.sum(dim)


def _count(x: torch.Tensor, mask: torch.Tensor, dim: int | None) -> torch.Tensor:
    valid = torch.broadcast_to(mask.bool(), x.shape)
    counts = valid.sum() if dim is None else valid.sum(dim)
    return counts.to(x.dtype)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over valid positions; 0 where nothing is valid."""
    return masked_sum(x, mask, dim) / _count(x, mask, dim).clamp(min=1)


def masked_var(
    x: torch.Tensor, mask: torch.Tensor, dim: int | None = None, unbiased: bool = False
) -> torch.Tensor:
    """Variance over valid positions (two-pass). Population variance unless ``unbiased``."""
    mean = masked_mean(x, mask, dim)
    centred = x - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centred.square(), mask, dim)
    n = _count(x, mask, dim)
    return sq / ((n - 1) if unbiased else n).clamp(min=1)


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Whiten ``x`` with the mean and population std of its valid entries; 0 at masked positions.

    ``shift_mean=False`` rescales but keeps the original mean (as in verl/TRL).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros((), dtype=x.dtype, device=x.device))


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels]: [B, T, V], [B, T] -> [B, T].

    For a policy's log-probs, ``logits`` are those of the distribution the tokens were sampled from: the
    model's logits divided by the sampling temperature (``models.rl.response_logits`` divides, in place).

    Never materialises a second [B, T, V] tensor of log-probs: gathers the label logit and
    subtracts logsumexp. Half-precision logits are processed one row at a time in float32 (the
    logsumexp of a 150k vocabulary is too lossy in bf16), so the result is float32 for them.
    """
    if logits.dtype in _LOW_PRECISION:
        rows = zip(logits, labels, strict=True)
        return torch.stack([logprobs_from_logits(row.float(), lab) for row, lab in rows])
    label_logits = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return label_logits - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position: [B, T, V] -> [B, T].

    H = logsumexp(z) − Σ softmax(z)·z. Half precision is handled row by row in float32. With tempered
    logits (z = logits / temperature) this is the entropy of the sampling distribution.
    """
    if logits.dtype in _LOW_PRECISION:
        return torch.stack([entropy_from_logits(row.float()) for row in logits])
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)
