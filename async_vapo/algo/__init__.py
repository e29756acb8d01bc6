"""Pure tensor math of VAPO and its baselines: GAE, losses (PPO, GSPO, CISPO), group and REINFORCE++ advantages,
the KL penalty, DAPO shaping."""

from async_vapo.algo.advantages import (
    broadcast_to_tokens,
    group_normalized_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from async_vapo.algo.dapo import dynamic_sampling_keep, soft_overlong_punishment
from async_vapo.algo.gae import compute_gae, length_adaptive_lambda
from async_vapo.algo.kl import kl_metrics, kl_penalty
from async_vapo.algo.losses import (
    cispo_loss,
    entropy_loss,
    explained_variance,
    gspo_loss,
    loss_normalizer,
    microbatch_weight,
    policy_loss,
    positive_lm_loss,
    value_loss,
)
from async_vapo.algo.mismatch import behavior_log_ratio, is_weights, mismatch_metrics, rejection_mask
from async_vapo.algo.utils import (
    entropy_from_logits,
    logprobs_from_logits,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "behavior_log_ratio",
    "broadcast_to_tokens",
    "cispo_loss",
    "compute_gae",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "entropy_loss",
    "explained_variance",
    "group_normalized_advantages",
    "gspo_loss",
    "is_weights",
    "kl_metrics",
    "kl_penalty",
    "length_adaptive_lambda",
    "logprobs_from_logits",
    "loss_normalizer",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "microbatch_weight",
    "mismatch_metrics",
    "policy_loss",
    "positive_lm_loss",
    "reinforce_pp_advantages",
    "rejection_mask",
    "rloo_advantages",
    "soft_overlong_punishment",
    "value_loss",
]
