"""DAPO batch shaping (Yu et al. 2025, arXiv 2503.14476): dynamic sampling, soft overlong punishment.

Dynamic sampling keeps only groups whose rewards are not all equal (all-correct or all-wrong groups
give GRPO advantage 0 and so no gradient); the caller keeps sampling until the batch is full.

Soft overlong punishment (DAPO "Overlong Reward Shaping"), added to the verifier reward:

    R_len(y) = 0                              if |y| ≤ L_max − L_cache
             = ((L_max − L_cache) − |y|) / L_cache   if L_max − L_cache < |y| ≤ L_max
             = −1                             if |y| > L_max

Choices: a group with a single member counts as "all equal" and is dropped. ``cache_len = 0``
reduces the punishment to the hard step (0 up to L_max, −1 beyond).
"""

from __future__ import annotations

import torch

from async_vapo.algo.advantages import group_degenerate

__all__ = ["dynamic_sampling_keep", "soft_overlong_punishment"]


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: true for samples whose group's rewards are not all equal."""
    return ~group_degenerate(rewards, group_ids)


def soft_overlong_punishment(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """DAPO length penalty R_len per response: [B] lengths (token counts) -> [B] float in [−1, 0]."""
    if cache_len < 0 or cache_len > max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    dtype = lengths.dtype if lengths.is_floating_point() else torch.get_default_dtype()
    length = lengths.to(dtype)
    if cache_len == 0:
        return torch.where(length > max_len, -torch.ones_like(length), torch.zeros_like(length))
    # Linear ramp from 0 at L_max − L_cache to −1 at L_max, then flat at −1.
    return ((max_len - cache_len - length) / cache_len).clamp(-1.0, 0.0)
