"""Critic-free, group-relative advantages (GRPO, DAPO baselines).

    A_i = (R_i − mean_group(R)) / (std_group(R) + eps),  the same A_i on every token of response i

Groups are the samples of one prompt, identified by an integer ``group_ids[b]``; ids need be neither
sorted nor contiguous. Everything is one pass of scatter reductions, no loop over groups.

Departures and choices:
- std is the unbiased (Bessel-corrected, n − 1) sample std, as in DeepSeekMath's GRPO and its
  common implementations (TRL, verl's ``torch.std``).
- A group with a single member, or whose rewards are all exactly equal, gets advantage 0 (tested
  with min == max, not with std < tol, so rounding in the mean cannot leak a tiny non-zero signal).
"""

from __future__ import annotations

import torch

__all__ = ["broadcast_to_tokens", "group_normalized_advantages"]


def _dense_ids(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer ids to 0..G-1; returns (per-sample dense id [B], G)."""
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, uniq.numel()


def group_degenerate(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] bool: the sample's group's rewards are all equal (true for a single-member group)."""
    idx, n_groups = _dense_ids(group_ids)
    empty = rewards.new_zeros(n_groups)
    gmin = empty.scatter_reduce(0, idx, rewards, reduce="amin", include_self=False)
    gmax = empty.scatter_reduce(0, idx, rewards, reduce="amax", include_self=False)
    return (gmin == gmax)[idx]


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages (R − group mean) / (group std + eps): [B], [B] int -> [B].

    Unbiased std; 0 for single-member or constant-reward groups (see module docstring).
    """
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    idx, n_groups = _dense_ids(group_ids)
    counts = rewards.new_zeros(n_groups).index_add_(0, idx, torch.ones_like(rewards))
    mean = rewards.new_zeros(n_groups).index_add_(0, idx, rewards) / counts
    centred = rewards - mean[idx]
    sq = rewards.new_zeros(n_groups).index_add_(0, idx, centred.square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    adv = centred / (std[idx] + eps)
    return torch.where(group_degenerate(rewards, group_ids), torch.zeros_like(adv), adv)


def broadcast_to_tokens(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's advantage on all of its valid tokens: [B], [B, T] -> [B, T], 0 elsewhere."""
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1), torch.zeros_like(seq_adv).unsqueeze(-1))
