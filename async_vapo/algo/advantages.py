"""Critic-free advantages: group-relative (GRPO, DAPO, Dr. GRPO, RLOO) and REINFORCE++'s batch-normalised returns.

    GRPO       A_i = (R_i − mean_group(R)) / (std_group(R) + eps),  the same A_i on every token of response i
    Dr. GRPO   A_i = R_i − mean_group(R)                    (Liu et al. 2025, arXiv 2503.20783, eq. 3: no std)
    RLOO       A_i = R_i − 1/(k−1) Σ_{j≠i} R_j = k/(k−1)·(R_i − mean_group(R))
                                                            (Ahmadian et al. 2024, arXiv 2402.14740, eq. 6)
    REINFORCE++  G_t = Σ_{s≥t} γ^(s−t)·r_s,  r_s = −β·KL_s + [s = last]·R_i;  A_t = (G_t − mean_batch G) / std_batch G
                 (Hu 2025, arXiv 2501.03262, §3: token-level KL penalty in the reward, global advantage
                 normalisation); REINFORCE++-baseline puts R_i − mean_group(R) in place of R_i

Groups are the samples of one prompt, identified by an integer ``group_ids[b]``; ids need be neither
sorted nor contiguous. Everything is one pass of scatter reductions, no loop over groups.

Departures and choices:
- std is the unbiased (Bessel-corrected, n − 1) sample std, as in DeepSeekMath's GRPO and its
  common implementations (TRL, verl's ``torch.std``).
- A group with a single member, or whose rewards are all exactly equal, gets advantage 0 (tested
  with min == max, not with std < tol, so rounding in the mean cannot leak a tiny non-zero signal): for GRPO,
  Dr. GRPO and RLOO alike (RLOO's leave-one-out baseline is undefined for one sample).
- REINFORCE++'s batch statistics are over every valid token of the batch (the returns are per token), with the
  population std and ``masked_whiten``'s eps 1e-8; a batch whose returns are all equal gets 0. "Global batch" is the
  update's whole batch, which every learner rank holds. The KL estimate per token is the caller's
  (``algo.kl.kl_penalty``); the paper's REINFORCE++-baseline later moved its KL to the loss as k2 — here both
  variants keep the k1 penalty in the reward (one mechanism, the paper's REINFORCE++ one).
"""

from __future__ import annotations

import torch

from async_vapo.algo.gae import compute_gae
from async_vapo.algo.utils import masked_whiten

__all__ = ["broadcast_to_tokens", "group_normalized_advantages", "reinforce_pp_advantages", "rloo_advantages"]


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


def _group_stats(rewards: torch.Tensor, group_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float rewards [B], dense ids [B], members per group [G], group means [G])."""
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    idx, n_groups = _dense_ids(group_ids)
    counts = rewards.new_zeros(n_groups).index_add_(0, idx, torch.ones_like(rewards))
    mean = rewards.new_zeros(n_groups).index_add_(0, idx, rewards) / counts
    return rewards, idx, counts, mean


def group_normalized_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, eps: float = 1e-6, scale: bool = True
) -> torch.Tensor:
    """GRPO advantages (R − group mean) / (group std + eps): [B], [B] int -> [B]; ``scale=False``: R − group mean
    (Dr. GRPO).

    Unbiased std; 0 for single-member or constant-reward groups (see module docstring).
    """
    if not scale:
        rewards, idx, _, mean = _group_stats(rewards, group_ids)
        adv = rewards - mean[idx]
        return torch.where(group_degenerate(rewards, group_ids), torch.zeros_like(adv), adv)
    rewards, idx, counts, mean = _group_stats(rewards, group_ids)
    centred = rewards - mean[idx]
    sq = rewards.new_zeros(counts.numel()).index_add_(0, idx, centred.square())
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    adv = centred / (std[idx] + eps)
    return torch.where(group_degenerate(rewards, group_ids), torch.zeros_like(adv), adv)


def broadcast_to_tokens(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each sequence's advantage on all of its valid tokens: [B], [B, T] -> [B, T], 0 elsewhere."""
    return torch.where(mask.bool(), seq_adv.unsqueeze(-1), torch.zeros_like(seq_adv).unsqueeze(-1))


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO: each sample's reward minus the mean of the other samples of its group: [B], [B] int -> [B].

    Computed as k/(k−1)·(R_i − mean) (the same number, one pass); 0 for a one-sample group (no other sample to
    leave out) and for a group whose rewards are all equal.
    """
    rewards, idx, counts, mean = _group_stats(rewards, group_ids)
    k = counts[idx]
    adv = (rewards - mean[idx]) * k / (k - 1).clamp(min=1)
    return torch.where(group_degenerate(rewards, group_ids), torch.zeros_like(adv), adv)


def reinforce_pp_advantages(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """REINFORCE++: the returns-to-go of the token rewards, normalised over every valid token of the batch:
    [B, T], [B, T] -> [B, T], 0 on padding.

    ``token_rewards``: r_t = −β·KL_t on every token plus the outcome reward (REINFORCE++-baseline: minus its group's
    mean) on the last valid one. G_t = Σ_{s≥t} γ^(s−t) r_s is GAE with V = 0 and λ = 1 (``compute_gae``), so
    masked positions are skipped as there.
    """
    returns, _ = compute_gae(token_rewards, torch.zeros_like(token_rewards), mask, 1.0, gamma)
    return masked_whiten(returns, mask)
