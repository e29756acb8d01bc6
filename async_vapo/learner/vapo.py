"""The learner: VAPO updates (and the PPO / GRPO / DAPO baselines) on torch.

One rollout step's groups become one ``RolloutBatch``; ``Learner.update`` then runs
``ppo_epochs`` passes of mini-batches (one optimiser step each), each split into micro-batches whose
losses are weighted by their share of the mini-batch's tokens (or sequences) — so the token-level loss
is one mean over every valid token of the mini-batch however it is split.

Every log-prob (``old_logprobs``, the ratio's, the behaviour weights', the entropy) is of the distribution the
engines sample from: softmax(logits / ``rollout.temperature``) over the whole vocabulary (the config rejects a
training ``top_p`` < 1), so that on-policy samples have ratio 1 and behaviour weight 1 at any temperature.

Devices and data parallelism: every tensor of an update lives on the rank's device (``learner.dist``). With more
than one rank the policy and the critic are sharded per decoder layer by FSDP2 (``learner.sharding``); every rank
computes its share of each mini-batch's micro-batches (and of the old-log-prob / value forward), each weighted by
the whole mini-batch's loss normaliser, and FSDP2 sums the gradients, so that the update is the one-process update.
Micro-batches hold ``algo.micro_batch_size`` sequences, or with ``algo.max_tokens_per_micro_batch`` a token budget,
balanced across ranks by tokens. ``learner.logprob_chunk_tokens`` computes log-probs from hidden states in chunks.

Multi-turn samples (``rollout.env``): the environment's tokens (``Trajectory.env_spans``) stay in the sequence, where
the policy and the critic read them, and are 0 in ``response_mask``, which every loss, normaliser, GAE step,
mismatch statistic and entropy term reads: they are state, never actions. The outcome reward sits on the last model
token (:meth:`Learner._token_rewards`).

Precision (``learner.precision``): parameters, gradients and AdamW moments are float32 whatever ``model.dtype``;
forwards run in ``model.dtype`` (autocast in one process, FSDP2's ``MixedPrecisionPolicy`` when sharded), and
:meth:`Learner.policy_state` hands out weights in it, the dtype the engines run. Learning-rate warm-up
(``optim.warmup_steps``) counts each optimiser's own steps: the critic's (value pretraining included) for the
critic, the policy's for the policy.

``old_logprobs`` are recomputed by the learner with its weights at the start of the update (the
proximal policy): for on-policy samples these are the weights that generated them. The engine's log-probs
(π_behaviour) differ from them by staleness (samples of older weights, ``async.max_staleness`` > 0) and by numerics
(an engine in another dtype or with other kernels). Every update measures the gap (``mismatch/*``: k3 KL estimate,
|log ρ| per token and per sequence, by version lag; ``algo.mismatch.mismatch_metrics``) and, with
``algo.behavior_correction``, corrects for it (decoupled PPO): each token's clipped surrogate is weighted by a
truncated ρ = π_proximal / π_behaviour at token, sequence or geometric level (``algo.behavior_weight``,
``algo.behavior_weight_cap``), and ``algo.behavior_mask`` removes the tokens or sequences whose ratio leaves
[``behavior_mask_low``, ``behavior_mask_high``] from the policy loss: numerator and denominator of the token mean
(or of the sequence means), so the kept tokens' loss is that of a batch without the rejected ones
(``correction/*`` reports weights and masked shares). The mask is computed per update from the whole batch's
proximal log-probs, so with a mask the first mini-batch's old log-probs come from their own forward rather than
from its first gradient step. ``behavior_logprob_gap`` reports the mean |log π_proximal − log π_behaviour|.

Advantages by algorithm (the math lives in ``async_vapo.algo``):
- vapo / ppo: GAE on the critic's values; actor λ = ``lam_policy`` or, with length-adaptive GAE,
  1 − 1/(α·l) per response; critic targets with ``lam_critic`` (decoupled GAE) or the actor's λ.
- grpo / dapo / gspo / gspo_token / cispo: group-normalised terminal reward on every token; no critic. dr_grpo: the
  group mean subtracted, no std; rloo: the leave-one-out group mean subtracted.
- reinforce_pp / reinforce_pp_baseline: per-token returns of the outcome reward (minus its group's mean) and
  −β·KL_t to the initial policy, normalised over the batch (``algo.advantages.reinforce_pp_advantages``).

The KL penalty (``algo.effective_kl_coef`` > 0: reinforce_pp by default, vapo / ppo when set) puts −β·KL_t in each
token's reward, KL_t (``algo.kl``) from the proximal log-probs and those of a frozen copy of the initial policy, the
reference, that the learner builds from ``reference_path`` (the base model; a resumed run passes it, not the
checkpoint) and keeps beside the policy (``deploy.scale`` counts its weights). The proximal log-probs are then
needed for every row before the advantages, so the first mini-batch's are not taken from its first gradient step.

Policy losses by ``algo.policy_objective``: PPO's clipped surrogate (``algo.losses.policy_loss``; Dr. GRPO divides
its sum by rows · ``rollout.max_response_tokens``), GSPO's sequence-ratio clip (``gspo_loss``, ``gspo_eps_*``) or
CISPO's clipped stop-gradient weights (``cispo_loss``, upper bound 1 + ``eps_high``). Each takes the ratio against
the proximal log-probs and composes with the behaviour weights and the rejection mask as the PPO surrogate does.

The critic's design (``model.critic_head_layers``, ``model.critic_logprobs``; ``models.rl.CriticDesign``) is built
from the config over whatever critic it starts from. A log-prob design reads each row's behaviour log-probs
(``RolloutBatch.behavior_logprobs``, the tokens' before each value) in every critic forward: the values before an
update, the critic's training steps, value pretraining and the held-out critic quality alike.
"""

from __future__ import annotations

import math
import random
import types
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from async_vapo.algo.advantages import (
    broadcast_to_tokens,
    group_normalized_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)
from async_vapo.algo.dapo import soft_overlong_punishment
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
from async_vapo.algo.mismatch import LAG_BUCKETS, behavior_log_ratio, is_weights, mismatch_metrics, rejection_mask
from async_vapo.algo.utils import entropy_from_logits, logprobs_from_logits, masked_mean, masked_whiten
from async_vapo.config import Config
from async_vapo.learner import sharding
from async_vapo.learner.precision import Precision
from async_vapo.learner.process_group import (
    all_gather_objects,
    all_reduce_sum_,
    data_parallel_world,
    local_device,
    single_process_checkpoint,
)
from async_vapo.models import lora
from async_vapo.models.rl import (
    SHARED,
    CriticDesign,
    TokenBatch,
    TrunkStateCache,
    attn_implementation,
    build_critic,
    build_policy,
    chunked_response_logprobs,
    head_values,
    load_critic,
    load_policy,
    make_token_batch,
    reads_logprobs,
    resolve_packing,
    response_logits,
    response_values,
    trunk_states,
)
from async_vapo.types import Group


def _dist_initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@dataclass
class RolloutBatch:
    tokens: TokenBatch
    rewards: torch.Tensor  # [B] verifier reward (+ overlong shaping)
    correct: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    versions: torch.Tensor  # [B] long: each sample's group version (its oldest token's)
    behavior_logprobs: torch.Tensor  # [B, T]
    token_versions: torch.Tensor | None = None  # [B, T] long: the version that sampled each response token

    @property
    def lengths(self) -> torch.Tensor:
        return self.tokens.response_mask.sum(-1)

    def to(self, device: torch.device | str) -> RolloutBatch:
        return RolloutBatch(self.tokens.to(device), self.rewards.to(device), self.correct.to(device),
                            self.group_ids.to(device), self.versions.to(device), self.behavior_logprobs.to(device),
                            None if self.token_versions is None else self.token_versions.to(device))


def make_rollout_batch(groups: Sequence[Group], pad_id: int, *, overlong_max_len: int = 0,
                       overlong_buffer: int = 0) -> RolloutBatch:
    prompts, responses, rewards, correct, gids, versions, blp, tv = [], [], [], [], [], [], [], []
    for g_index, g in enumerate(groups):
        for i, s in enumerate(g.samples):
            tv.append(g.token_versions(i))
            prompts.append(g.prompt_ids)
            responses.append(s.response_ids)
            rewards.append(s.reward)
            correct.append(s.correct)
            gids.append(g_index)
            versions.append(g.version)
            blp.append(s.behavior_logprobs)
    tokens = make_token_batch(prompts, responses, pad_id)
    for i, s in enumerate(s for g in groups for s in g.samples):  # environment tokens: context, not actions
        for first, count in s.env_spans:
            tokens.response_mask[i, first: first + count] = 0
    behavior = torch.full(tokens.response_mask.shape, float("nan"))  # NaN: not reported by the engine
    for i, lp in enumerate(blp):
        behavior[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float)
    token_versions = torch.tensor(versions, dtype=torch.long)[:, None].expand(tokens.response_mask.shape).clone()
    for i, v in enumerate(tv):  # padding keeps the sample's group version
        token_versions[i, : len(v)] = torch.as_tensor(v, dtype=torch.long)
    r = torch.tensor(rewards, dtype=torch.float)
    if overlong_buffer > 0:
        r = r + soft_overlong_punishment(tokens.response_mask.sum(-1), overlong_max_len, overlong_buffer).float()
    return RolloutBatch(tokens, r, torch.tensor(correct), torch.tensor(gids), torch.tensor(versions), behavior,
                        token_versions)


def _mean_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    """Mean of each metric over ``rows``. An explained variance is NaN where it is undefined (targets that do
    not vary), not broken: it is averaged over the rows that define it (NaN when none does). Every other NaN
    (a loss, a gradient norm) propagates, so that it shows."""
    acc: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        for k, v in row.items():
            acc[k].append(v)
    out = {}
    for k, v in acc.items():
        if k.endswith("explained_variance"):
            v = [x for x in v if not math.isnan(x)] or [math.nan]
        out[k] = sum(v) / len(v)
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor shard gathered (a collective), a plain tensor as it is; detached."""
    t = t.detach()
    return t.full_tensor() if callable(getattr(t, "full_tensor", None)) else t


def critic_error_by_age(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, ages: torch.Tensor
                        ) -> dict[str, float]:
    """The critic's error on the samples of each age (learner version − the version that generated them;
    0 = on-policy): ``critic_age/<a>/explained_variance`` (over valid tokens; NaN when the targets do not
    vary, see ``algo.losses.explained_variance``), ``.../value_error_abs`` (mean |V − target| per token) and
    ``.../samples``."""
    out: dict[str, float] = {}
    mask = mask.bool()
    for age in sorted(set(ages.tolist())):
        m = mask & (ages == age)[:, None]
        v, r = values[m], returns[m]
        out[f"critic_age/{age}/explained_variance"] = float(explained_variance(values, returns, m))
        out[f"critic_age/{age}/value_error_abs"] = float((v - r).abs().mean())
        out[f"critic_age/{age}/samples"] = float((ages == age).sum())
    return out


class Learner:
    def __init__(self, cfg: Config, policy_path: str | Path, critic_path: str | Path | None = None,
                 reference_path: str | Path | None = None):
        """``reference_path``: the initial policy of the KL penalty (``algo.effective_kl_coef`` > 0), None =
        ``policy_path``; a resumed learner passes the base model here."""
        self.cfg = cfg
        self.algo = cfg.algo
        torch.manual_seed(cfg.train.seed)
        self.rng = random.Random(cfg.train.seed)
        # a decoupled critic schedule's mini-batches: drawn apart, so that the actor's are the same whatever it is
        self.critic_rng = random.Random(f"critic-{cfg.train.seed}")
        # algo.critic_replay_batches: the batches before the current one that the critic's steps also train on
        self._critic_window: deque = deque(maxlen=self.algo.critic_replay_batches - 1)
        self.temperature = cfg.rollout.temperature  # of the engines' training samples
        self.device = local_device()
        self.rank, self.world = data_parallel_world()
        self.sharded = self.world > 1 or cfg.learner.fsdp == "on"  # FSDP2 (learner.sharding)
        if self.sharded and cfg.model.dtype == "float16":
            raise ValueError("model.dtype = float16 needs loss scaling, which is per rank and would diverge across "
                             "sharded learner ranks; use bfloat16 with FSDP2 (learner.fsdp)")
        if self.sharded and not _dist_initialized():
            raise ValueError("learner.fsdp = on needs a torch.distributed process group "
                             "(learner.dist.init_process_group, or torchrun)")
        # float32 master weights and optimiser state; forwards in model.dtype (learner.precision: autocast in one
        # process, FSDP2's MixedPrecisionPolicy when sharded)
        self.precision = Precision(cfg.model.dtype, self.device.type, autocast=not self.sharded)
        self._mesh = None
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        # learner.packing: None, "mask" or "flex" (FlexAttention: the models load with attn_implementation
        # "flex_attention"; see models.rl.resolve_packing)
        self.packing = resolve_packing(cfg.learner.packing, cfg.learner.packed_attention, self.device.type,
                                       cfg.learner.share_prompts)
        attn = attn_implementation(self.packing)
        # model.lora: adapters on the frozen policy (models.lora); the optimiser gets the adapter parameters only
        # A sharded LoRA model is sharded like any other (its frozen base weights and its adapters alike, per decoder
        # layer); a version is its adapter, gathered on every rank (adapter_state), never the base's weight stream
        self.lora = lora.config_of(cfg)
        # model.critic_lora: adapters on the critic's trunk, its value head trained in full (models.lora)
        self.critic_lora = lora.config_of(cfg, "critic") if self.algo.uses_critic else None
        self.policy = self._load(lambda: self._with_lora(build_policy(policy_path, attn_implementation=attn)),
                                 lambda: self._with_lora(load_policy(policy_path, attn_implementation=attn),
                                                         start=True))
        self._sources = {"policy": policy_path, "critic": critic_path or policy_path}  # for the HF files of a save
        self.actor_opt = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad],
                                           lr=cfg.optim.actor_lr,
                                           betas=(cfg.optim.beta1, cfg.optim.beta2),
                                           weight_decay=cfg.optim.weight_decay)
        self.actor_scaler = self.precision.grad_scaler()
        self.critic = self.critic_opt = self.critic_scaler = None
        # model.critic_trunk = "frozen": the trunk's states of each response computed once and kept (TrunkStateCache)
        self.critic_frozen = self.algo.uses_critic and cfg.model.critic_trunk == "frozen"
        if self.critic_frozen and (self.sharded or self.critic_lora is not None):
            raise ValueError('model.critic_trunk = "frozen" needs one learner process and no model.critic_lora')
        self._trunk_cache = TrunkStateCache(cfg.model.critic_feature_cache_mb * 2**20) if self.critic_frozen else None
        if self.algo.uses_critic:
            path = critic_path or policy_path
            # model.critic_head_layers / critic_logprobs: the value head's design (models.rl.CriticDesign)
            design = CriticDesign.from_config(cfg)
            self.critic = self._load(
                lambda: self._with_critic_lora(build_critic(path, attn_implementation=attn, design=design)),
                lambda: self._with_critic_lora(load_critic(path, attn_implementation=attn, design=design)))
            if self.critic_frozen:  # model.critic_trunk = "frozen": the value head alone trains
                for name, p in self.critic.named_parameters():
                    p.requires_grad_(name.startswith("score."))
            self.critic_opt = torch.optim.AdamW(self._critic_param_groups(), lr=cfg.optim.critic_lr,
                                                betas=(cfg.optim.beta1, cfg.optim.beta2),
                                                weight_decay=cfg.optim.weight_decay)
            self.critic_scaler = self.precision.grad_scaler()
        self._critic_reads_logprobs = self.critic is not None and reads_logprobs(self.critic)
        self.reference = None  # the KL penalty's frozen initial policy
        if self.algo.effective_kl_coef > 0:
            ref = reference_path or policy_path
            self.reference = self._load(lambda: build_policy(ref, attn_implementation=attn),
                                        lambda: load_policy(ref, attn_implementation=attn))
            self.reference.requires_grad_(False)
        if self._critic_reads_logprobs and self.packing == SHARED:
            raise ValueError("learner.share_prompts cannot serve a critic design that reads log-probs (a group's "
                             "first response tokens are scored at one shared position); turn one of them off")
        self.version = 0  # policy updates published so far
        self.optimizer_steps = 0  # policy optimiser steps
        self.critic_steps = 0  # critic optimiser steps, value pretraining included
        self.reuse_first_logprobs = True
        """Take the first mini-batch's old log-probs from its own first forward (exact; see ``update``)."""

    def _with_lora(self, model: torch.nn.Module, start: bool = False) -> torch.nn.Module:
        """``model`` with the adapter of ``model.lora`` injected (base frozen), or as it is without LoRA; ``start``
        (the weights' load, not a sharded learner's meta-device build): the adapter set from ``model.lora.init_from``
        when given (a resume then restores the checkpoint's over it)."""
        if self.lora is None:
            return model
        model = lora.add_lora(model, self.lora)
        if start and self.cfg.model.lora.init_from:
            lora.load_adapter(model, self.cfg.model.lora.init_from, self.lora)
        return model

    def _with_critic_lora(self, critic: torch.nn.Module) -> torch.nn.Module:
        """``critic`` with the adapter of ``model.critic_lora`` on its trunk (trunk frozen, value head trainable),
        or as it is without."""
        return critic if self.critic_lora is None else lora.add_critic_lora(critic, self.critic_lora)

    def _load(self, build, load_full) -> torch.nn.Module:
        """A float32 model on this rank's device (eval mode: no dropout anywhere); sharded with FSDP2 when there is
        more than one rank, its weights read once by rank 0."""
        lc = self.cfg.learner
        if not self.sharded:
            model = load_full().to(self.device)
            if lc.activation_checkpointing:
                sharding.enable_activation_checkpointing(model)
            return model
        model = sharding.load_sharded(build, load_full, self._mesh, self.device,
                                      compute_dtype=self.precision.compute_dtype, cpu_offload=lc.cpu_offload,
                                      activation_checkpointing=lc.activation_checkpointing)
        model.chunked_response_logprobs = types.MethodType(chunked_response_logprobs, model)
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "chunked_response_logprobs")
        return model

    # ---------------------------------------------------------------- helpers
    def _critic_param_groups(self) -> list[dict]:
        """The critic optimiser's parameter groups: one, or with ``optim.critic_head_lr`` the trunk's and then the
        value head's (``score``, a design's extra layers included), each with its own rate (:meth:`_critic_lrs`)."""
        params = [p for p in self.critic.parameters() if p.requires_grad]  # model.critic_lora: a frozen trunk
        if self.cfg.optim.critic_head_lr is None or self.critic_frozen:  # frozen: the head's group alone
            return [{"params": params}]
        head = {id(p) for p in self.critic.score.parameters()}
        return [{"params": [p for p in params if id(p) not in head]},
                {"params": [p for p in params if id(p) in head]}]

    def _critic_lrs(self) -> list[float]:
        """The rate of each critic parameter group at the next step before warm-up: ``optim.critic_lr`` (and
        ``critic_head_lr``) on ``optim.critic_lr_schedule``, which decays with the updates made (``self.version``;
        value pretraining runs at version 0, at the full rate)."""
        o = self.cfg.optim
        lrs = [o.critic_lr] if o.critic_head_lr is None else [o.critic_lr, o.critic_head_lr]
        if self.critic_frozen:  # model.critic_trunk = "frozen": one group, the head's (critic_head_lr if set)
            lrs = lrs[-1:]
        total = self.cfg.train.total_steps
        if o.critic_lr_schedule == "constant" or total == 0:
            return lrs
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(self.version, total) / total))
        factor = o.critic_lr_min_ratio + (1.0 - o.critic_lr_min_ratio) * cosine
        return [lr * factor for lr in lrs]

    def _lr_scale(self, steps_done: int, warmup: int | None = None) -> float:
        """Linear warm-up factor of an optimiser's next step, from the steps it has taken (over ``warmup`` steps;
        None: ``optim.warmup_steps``)."""
        w = self.cfg.optim.warmup_steps if warmup is None else warmup
        return 1.0 if w == 0 else min(1.0, (steps_done + 1) / w)

    def _logprobs(self, tb: TokenBatch, entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropy) of the response tokens; the entropy carries a gradient only if ``entropy_grad``.
        With ``learner.logprob_chunk_tokens`` from hidden states in chunks (``chunked_response_logprobs``)."""
        chunk, packed = self.cfg.learner.logprob_chunk_tokens, self.packing or False
        dtype = self.precision.compute_dtype
        with self.precision.autocast():
            if chunk:
                fn = getattr(self.policy, "chunked_response_logprobs", None)  # FSDP's registered forward method
                args = (tb, self.temperature, chunk, packed, dtype)
                lp, ent = fn(*args) if fn is not None else chunked_response_logprobs(self.policy, *args)
                return lp, ent if entropy_grad else ent.detach()
            logits = response_logits(self.policy, tb, self.temperature, packed, dtype)
        lp = logprobs_from_logits(logits, tb.response_ids)
        if entropy_grad:
            return lp, entropy_from_logits(logits)
        with torch.no_grad():
            return lp, entropy_from_logits(logits)

    def _values(self, tb: TokenBatch, batch: RolloutBatch, rows: list[int]) -> torch.Tensor:
        """The critic's values of ``tb`` = ``batch.tokens.select(rows)``; a log-prob design reads the rows' behaviour
        log-probs (``models.rl.logprob_features``: those of the tokens before each one)."""
        lp = batch.behavior_logprobs[rows, : tb.response_ids.shape[1]] if self._critic_reads_logprobs else None
        if self.critic_frozen:
            return self._frozen_values(tb, lp)
        with self.precision.autocast():
            return response_values(self.critic, tb, self.packing or False, self.precision.compute_dtype, logprobs=lp)

    def _cache_metrics(self) -> dict[str, float]:
        """A frozen trunk's state cache: its size and the responses read from it / run through the trunk so far."""
        c = self._trunk_cache
        if c is None:
            return {}
        return {"critic/trunk_cache_mb": c.bytes / 2**20, "critic/trunk_cache_hits": float(c.hits),
                "critic/trunk_cache_misses": float(c.misses)}

    def _frozen_values(self, tb: TokenBatch, lp: torch.Tensor | None) -> torch.Tensor:
        """``model.critic_trunk = "frozen"``: the value head on the trunk's states of ``tb``, each response's run
        through the trunk once (without a gradient) and then read from the cache while it holds them."""
        packed, dtype = self.packing or False, self.precision.compute_dtype

        @torch.no_grad()
        def compute(sub: TokenBatch) -> torch.Tensor:
            with self.precision.autocast():
                return trunk_states(self.critic, sub, packed, dtype)

        states = self._trunk_cache.states(tb, compute)
        with self.precision.autocast():
            return head_values(self.critic, states, tb.response_mask, lp)

    def _minibatches(self, n: int, size: int | None = None, rng: random.Random | None = None) -> list[list[int]]:
        """The rows 0..n-1 shuffled (by ``rng``, None: ``self.rng``) into mini-batches of ``size`` (None:
        ``algo.mini_batch_size``)."""
        order = list(range(n))
        (self.rng if rng is None else rng).shuffle(order)
        mb = self.algo.mini_batch_size if size is None else size
        return [order[i: i + mb] for i in range(0, n, mb)]

    def _plan(self, idx: list[int], seq_tokens: list[int], groups: Sequence[int] = ()) -> list[list[list[int]]]:
        """Per rank, its micro-batches of the rows ``idx``: ``micro_batch_size`` rows each, dealt round-robin; or,
        with ``algo.max_tokens_per_micro_batch``, rows balanced across ranks by tokens (longest first, each to the
        rank with the fewest so far) and packed into micro-batches of at most that many padded tokens (rows ×
        longest row; a row above the budget alone). ``seq_tokens[i]``: row i's prompt + response tokens; ``groups[i]``:
        its group, by which rows are ordered with ``learner.share_prompts`` (without a token budget)."""
        world = self.world
        budget = self.algo.max_tokens_per_micro_batch
        if not budget:
            k = self.algo.micro_batch_size
            if groups and self.packing == SHARED:  # a group's rows side by side: they share their prompt
                first: dict[int, int] = {}
                for i in idx:
                    first.setdefault(groups[i], len(first))
                idx = sorted(idx, key=lambda i: first[groups[i]])
            micro = [idx[i: i + k] for i in range(0, len(idx), k)]
            return [micro[r::world] for r in range(world)]
        order = sorted(idx, key=lambda i: (-seq_tokens[i], i))
        per_rank: list[list[int]] = [[] for _ in range(world)]
        load = [0] * world
        for i in order:
            r = min(range(world), key=lambda k: (load[k], k))
            per_rank[r].append(i)
            load[r] += seq_tokens[i]
        plans = []
        for rows in per_rank:
            micro: list[list[int]] = []
            for i in rows:  # longest first: a micro-batch's first row is its longest
                if micro and (len(micro[-1]) + 1) * seq_tokens[micro[-1][0]] <= budget:
                    micro[-1].append(i)
                else:
                    micro.append([i])
            plans.append(micro)
        return plans

    def _my_micro(self, idx: list[int], seq_tokens: list[int], groups: Sequence[int] = ()
                  ) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches of ``idx`` as (rows, real). Every rank holds the whole batch and the loss
        normaliser of the whole mini-batch, so the gradients summed over ranks are exactly the one-process
        gradient (token-level or sequence-level). Sharded ranks run the same number of forward/backward passes
        (FSDP2's collectives are per pass): a rank with fewer real micro-batches runs a zero-weight one."""
        plans = self._plan(idx, seq_tokens, groups)
        mine = [(m, True) for m in plans[self.rank]]
        if self.sharded:
            mine += [([idx[0]], False)] * (max(len(p) for p in plans) - len(mine))
        return mine

    @staticmethod
    def _seq_tokens(batch: RolloutBatch) -> list[int]:
        return batch.tokens.attention_mask.sum(-1).tolist()

    @torch.no_grad()
    def _forward_old(self, batch: RolloutBatch, skip: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the policy that generated the batch and the critic's values, before any update. Each rank
        computes its share of the rows and the shares are summed over ranks (every other row is zero). The
        log-probs of the rows in ``skip`` are left 0 (the update takes them from its first gradient step; every
        rank must pass the same ``skip``)."""
        n, t = batch.tokens.response_mask.shape
        dev = batch.tokens.response_mask.device
        old_lp = torch.zeros(n, t, device=dev)
        values = torch.zeros(n, t, device=dev) if self.critic is not None else None
        seq_tokens, groups = self._seq_tokens(batch), batch.group_ids.tolist()
        skipped = set(skip)
        rows = [i for i in range(n) if i not in skipped]
        for idx, real in self._my_micro(rows, seq_tokens, groups) if rows else ():
            tb = batch.tokens.select(idx)
            lp, _ = self._logprobs(tb)
            if real:
                old_lp[idx, : tb.response_ids.shape[1]] = lp
        for idx, real in self._my_micro(list(range(n)), seq_tokens, groups) if values is not None else ():
            tb = batch.tokens.select(idx)
            v = self._values(tb, batch, idx)
            if real:
                values[idx, : tb.response_ids.shape[1]] = v
        all_reduce_sum_(old_lp)
        if values is not None:
            all_reduce_sum_(values)
        mask = batch.tokens.response_mask.bool()
        return old_lp.masked_fill(~mask, 0.0), None if values is None else values.masked_fill(~mask, 0.0)

    @torch.no_grad()
    def _reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """The reference policy's log-probs of the batch's response tokens (0 on padding), each rank computing its
        share of the rows as in :meth:`_forward_old`."""
        n, t = batch.tokens.response_mask.shape
        ref_lp = torch.zeros(n, t, device=batch.tokens.response_mask.device)
        seq_tokens, groups = self._seq_tokens(batch), batch.group_ids.tolist()
        for idx, real in self._my_micro(list(range(n)), seq_tokens, groups):
            tb = batch.tokens.select(idx)
            with self.precision.autocast():
                logits = response_logits(self.reference, tb, self.temperature, self.packing or False,
                                         self.precision.compute_dtype)
            if real:
                ref_lp[idx, : tb.response_ids.shape[1]] = logprobs_from_logits(logits, tb.response_ids)
        all_reduce_sum_(ref_lp)
        return ref_lp.masked_fill(~batch.tokens.response_mask.bool(), 0.0)

    def _gather_rows(self, rows: list[dict[str, float]]) -> list[dict[str, float]]:
        """Every rank's micro-batch metric rows (so that each rank reports the whole mini-batch's metrics)."""
        return [r for part in all_gather_objects(rows) for r in part] if self.world > 1 else rows

    def _token_rewards(self, batch: RolloutBatch, outcome: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T]: ``outcome`` (None: the batch's rewards) on each response's last valid token, 0 elsewhere."""
        mask = batch.tokens.response_mask
        t = mask.shape[-1]  # the last model token (environment tokens may follow it or lie between the model's)
        last = (t - 1 - mask.flip(-1).to(torch.int8).argmax(-1)).clamp(min=0)
        r = torch.zeros(mask.shape, device=mask.device)
        r[torch.arange(len(last)), last] = (batch.rewards if outcome is None else outcome).to(r.dtype)
        return r * mask

    def _step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
              lr: float | Sequence[float], steps_done: int, warmup: int | None = None) -> float:
        """One optimiser step on the accumulated (loss-scaled) gradients; skipped when they are not finite. Sharded
        gradients were summed over ranks by FSDP2 in backward; the norm is the whole model's on every rank. ``lr``:
        one rate for every parameter group, or one per group, each warmed up alike."""
        lrs = [lr] * len(opt.param_groups) if isinstance(lr, float | int) else list(lr)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.algo.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor: the norm of the sharded gradients
            norm = norm.full_tensor()
        for g, base in zip(opt.param_groups, lrs, strict=True):
            g["lr"] = base * self._lr_scale(steps_done, warmup)
        if torch.isfinite(norm):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    # ---------------------------------------------------------------- critic-only (value pretraining)
    def pretrain_critic(self, batch: RolloutBatch, fresh: bool = True) -> dict[str, float]:
        """One rollout batch of critic-only training with Monte-Carlo targets (λ = 1): VAPO §3.1.
        ``value_pretrain_epochs`` passes of shuffled mini-batches of ``critic_mini_batch_size``. ``fresh``: the critic
        has not trained on these responses, so that its EV before the step is a held-out one (``critic/fresh_ev``);
        else it is reported as ``critic/pool_ev`` (a value-pretraining pool's batch seen before)."""
        if self.critic is None:
            raise RuntimeError(f"algorithm {self.algo.name!r} has no critic to pretrain")
        batch = batch.to(self.device)
        mask = batch.tokens.response_mask
        seq_tokens = self._seq_tokens(batch)
        _, values = self._forward_old(batch, skip=range(len(mask)))  # the critic's values only
        _, returns = compute_gae(self._token_rewards(batch), values, mask, 1.0, self.algo.gamma)
        before = {"critic/fresh_ev" if fresh else "critic/pool_ev": float(explained_variance(values, returns, mask))}
        size = self.algo.effective_critic_mini_batch_size
        rows = [self._critic_minibatch(batch, idx, seq_tokens, returns, values)
                for _ in range(self.algo.value_pretrain_epochs) for idx in self._minibatches(len(mask), size)]
        return _mean_metrics(rows) | before | {"critic/steps": float(len(rows))} | self._cache_metrics()

    @torch.no_grad()
    def critic_values(self, batch: RolloutBatch) -> torch.Tensor:
        """The critic's value of the state before each response token of ``batch`` ([B, T], 0 at padding), without
        training on it: the held-out critic quality (``learner.critic_quality``). Every rank of a sharded learner
        calls it."""
        if self.critic is None:
            raise RuntimeError(f"algorithm {self.algo.name!r} has no critic")
        batch = batch.to(self.device)
        return self._forward_old(batch, skip=range(len(batch.rewards)))[1]

    def _critic_minibatch(self, batch: RolloutBatch, idx: list[int], seq_tokens: list[int], returns: torch.Tensor,
                          old_values: torch.Tensor) -> dict[str, float]:
        mask = batch.tokens.response_mask
        total = loss_normalizer(mask[idx], True)
        rows = []
        for mi, real in self._my_micro(idx, seq_tokens, batch.group_ids.tolist()):
            tb = batch.tokens.select(mi)
            w = tb.response_ids.shape[1]
            v = self._values(tb, batch, mi)
            vl, m = value_loss(v, returns[mi, :w], tb.response_mask, old_values[mi, :w], self.algo.value_clip)
            weight = microbatch_weight(tb.response_mask, total, True) if real else 0.0
            self.critic_scaler.scale(self.algo.vf_coef * weight * vl).backward()
            if real:
                rows.append({"critic/value_loss": float(vl.detach()),
                             **{f"critic/{k}": float(x) for k, x in m.items()}})
        out = _mean_metrics(self._gather_rows(rows))
        out["critic/grad_norm"] = self._step(self.critic, self.critic_opt, self.critic_scaler, self._critic_lrs(),
                                             self.critic_steps, self.cfg.optim.critic_warmup_steps)
        out["critic/lr"] = self.critic_opt.param_groups[0]["lr"]  # the trunk's, warm-up included
        if len(self.critic_opt.param_groups) > 1:
            out["critic/head_lr"] = self.critic_opt.param_groups[1]["lr"]
        self.critic_steps += 1
        return out

    # ---------------------------------------------------------------- advantages
    def advantages(self, batch: RolloutBatch, values: torch.Tensor | None, kl: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        """Per-token advantages (and the critic's returns) by ``algo.advantage_estimator`` (module docstring).
        ``kl``: [B, T] per-token KL estimate to the reference, put as −kl_coef·kl in the token rewards (GAE's and
        REINFORCE++'s); None = no penalty."""
        mask = batch.tokens.response_mask
        stats: dict[str, float] = {}
        estimator = self.algo.advantage_estimator
        penalty = 0.0 if kl is None else self.algo.effective_kl_coef * kl
        if estimator == "gae":
            rewards = self._token_rewards(batch) - penalty
            if values is None:  # algo.zero_values: V ≡ 0
                values = torch.zeros_like(rewards)
            if self.algo.length_adaptive_gae:
                lam_policy = length_adaptive_lambda(batch.lengths.float(), self.algo.alpha)
            else:
                lam_policy = torch.full((len(mask),), self.algo.lam_policy, device=mask.device)
            lam_critic = torch.full_like(lam_policy, self.algo.lam_critic) if self.algo.decoupled_gae else lam_policy
            adv, _ = compute_gae(rewards, values, mask, lam_policy, self.algo.gamma)
            _, returns = compute_gae(rewards, values, mask, lam_critic, self.algo.gamma)
            stats.update({"lam_policy/mean": float(lam_policy.mean()), "lam_policy/min": float(lam_policy.min()),
                          "lam_policy/max": float(lam_policy.max())})
        elif estimator in ("reinforce_pp", "reinforce_pp_baseline"):
            outcome = batch.rewards
            if estimator == "reinforce_pp_baseline":
                outcome = group_normalized_advantages(batch.rewards, batch.group_ids, scale=False)
            rewards = self._token_rewards(batch, outcome) - penalty
            adv, returns = reinforce_pp_advantages(rewards, mask, self.algo.gamma), None
        else:
            if estimator == "rloo":
                seq_adv = rloo_advantages(batch.rewards, batch.group_ids)
            else:  # grpo (and dapo, gspo, cispo), dr_grpo
                seq_adv = group_normalized_advantages(batch.rewards, batch.group_ids, scale=estimator == "grpo")
            adv, returns = broadcast_to_tokens(seq_adv, mask), None
        if self.algo.whiten_advantages:
            adv = masked_whiten(adv, mask) * mask
        stats["advantage/mean"] = float(masked_mean(adv, mask))
        return adv, returns, stats

    # ---------------------------------------------------------------- the update
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One rollout step's worth of policy (and critic) optimisation; publishes version + 1."""
        batch = batch.to(self.device)
        mask = batch.tokens.response_mask
        seq_tokens, groups = self._seq_tokens(batch), batch.group_ids.tolist()
        plan = [self._minibatches(len(mask)) for _ in range(self.algo.ppo_epochs)]
        # the critic steps on the actor's mini-batches, or on its own schedule after the actor's steps
        follows, critic_before = self.algo.critic_follows_actor, self.critic_steps
        # The first mini-batch's old log-probs are its first gradient step's own log-probs (same weights, same
        # tokens): they are taken, detached, from that forward instead of a separate pass (ratio exactly 1 there).
        # One unsharded process only: sharded ranks split micro-batches differently in the two passes.
        # A rejection mask needs every row's proximal log-probs before the first mini-batch's loss normaliser.
        masking = self.algo.behavior_correction and self.algo.behavior_mask != "off"
        # the KL penalty's rewards need every row's proximal log-probs before the advantages
        first = self.reuse_first_logprobs and not self.sharded and not masking and self.reference is None
        reuse = set(plan[0][0]) if first else set()
        old_lp, values = self._forward_old(batch, skip=sorted(reuse))
        kl, kl_stats = None, {}
        if self.reference is not None:
            ref_lp = self._reference_logprobs(batch)
            kl = kl_penalty(old_lp, ref_lp, mask, self.algo.kl_estimator)
            kl_stats = {f"kl_ref/{k}": float(v) for k, v in kl_metrics(old_lp, ref_lp, mask).items()}
        adv, returns, stats = self.advantages(batch, values, kl)
        stats.update(kl_stats)
        nan_behavior = torch.isnan(batch.behavior_logprobs)
        keep, correction = mask, {}  # the policy loss's tokens: all valid ones, or those the mask keeps
        if masking:
            keep, correction = rejection_mask(behavior_log_ratio(old_lp, batch.behavior_logprobs, mask), mask,
                                              self.algo.behavior_mask, self.algo.behavior_mask_low,
                                              self.algo.behavior_mask_high)
        lags = self.version - batch.versions  # 0 = generated by the weights being updated
        token_lags = lags if batch.token_versions is None else self.version - batch.token_versions
        if values is not None:
            stats.update(critic_error_by_age(values, returns, mask, lags))
            # before the update: the critic has not trained on these responses (a held-out measure)
            stats["critic/fresh_ev"] = float(explained_variance(values, returns, mask))
        token_level = self.algo.token_level_loss
        max_tokens = self._max_tokens()
        rows: list[dict[str, float]] = []
        fresh = reuse  # rows whose old log-probs the next forward provides: the first mini-batch's, once
        for epoch in plan:
            for idx in epoch:
                total = loss_normalizer(keep[idx], token_level, max_tokens)
                ent_total = loss_normalizer(mask[idx], token_level)  # the bonus keeps every token (losses docstring)
                pos_mask_all = mask[idx].bool() & batch.correct[idx, None]
                pos_total = loss_normalizer(pos_mask_all, True)
                mrows = []
                for mi, real in self._my_micro(idx, seq_tokens, groups):
                    tb = batch.tokens.select(mi)
                    w = tb.response_ids.shape[1]
                    keep_mi = keep[mi, :w]
                    lp, ent = self._logprobs(tb, entropy_grad=self.algo.entropy_coef > 0)
                    with torch.no_grad():
                        if fresh:
                            old_lp[mi, :w] = lp.detach().masked_fill(~tb.response_mask.bool(), 0.0)
                        bw_mi = self._behavior_weights(batch, old_lp, mi, w)
                    pl, m = self._policy_loss(lp, old_lp[mi, :w], adv[mi, :w], keep_mi, ent, bw_mi)
                    loss = microbatch_weight(keep_mi, total, token_level, max_tokens=max_tokens) * pl
                    row = {"actor/pg_loss": float(pl.detach()), **{f"actor/{k}": float(x) for k, x in m.items()}}
                    if self.algo.pos_lm_coef > 0:
                        correct = batch.correct[mi]
                        ll, lm = positive_lm_loss(lp, tb.response_mask, correct)
                        pos_mask = tb.response_mask.bool() & correct[:, None]
                        loss = loss + self.algo.pos_lm_coef * microbatch_weight(pos_mask, pos_total, True) * ll
                        row.update({f"actor/{k}": float(x) for k, x in lm.items()})
                    if self.algo.entropy_coef > 0:
                        el, _ = entropy_loss(ent, tb.response_mask, token_level)
                        loss = loss + self.algo.entropy_coef * microbatch_weight(
                            tb.response_mask, ent_total, token_level) * el
                    self.actor_scaler.scale(loss if real else 0.0 * loss).backward()
                    if real:
                        mrows.append(row)
                out = _mean_metrics(self._gather_rows(mrows))
                out["actor/grad_norm"] = self._step(self.policy, self.actor_opt, self.actor_scaler,
                                                    self.cfg.optim.actor_lr, self.optimizer_steps)
                if self.critic is not None and follows:
                    out.update(self._critic_minibatch(batch, idx, seq_tokens, returns, values))
                self.optimizer_steps += 1
                rows.append(out)
                fresh = set()
        if self.critic is not None and not follows:
            rows += self._critic_own_steps(batch, returns, values)
        self.version += 1
        metrics = _mean_metrics(rows)
        metrics.update(stats)
        if self.critic is not None:
            metrics["critic/steps"] = float(self.critic_steps - critic_before)
            metrics.update(self._cache_metrics())
        # tokens without an engine log-prob count as on-policy (weight 1)
        behavior = torch.where(nan_behavior, old_lp, batch.behavior_logprobs)
        metrics["behavior_logprob_gap"] = float(masked_mean((old_lp - behavior).abs(), mask))
        metrics.update(self._mismatch_metrics(batch, old_lp, token_lags, correction))
        return metrics

    def _critic_own_steps(self, batch: RolloutBatch, returns: torch.Tensor, values: torch.Tensor
                          ) -> list[dict[str, float]]:
        """The critic's own schedule after the actor's steps: ``critic_epochs`` passes of shuffled mini-batches of
        ``critic_mini_batch_size`` over ``batch`` and, with ``algo.critic_replay_batches``, over the kept batches
        before it too (their values and λ_critic returns recomputed now; each step on one batch's rows, the steps
        shuffled over the window). ``batch`` is then kept for the next updates."""
        window = [(batch, returns, values)]
        for old in self._critic_window:  # newest first
            old = old.to(self.device)
            _, old_values = self._forward_old(old, skip=range(len(old.rewards)))  # the critic's values only
            window.append((old, self.advantages(old, old_values)[1], old_values))
        if self._critic_window.maxlen:
            self._critic_window.appendleft(batch)
        size, epochs = self.algo.effective_critic_mini_batch_size, self.algo.effective_critic_epochs
        steps = [(w, idx) for _ in range(epochs) for w, (b, _, _) in enumerate(window)
                 for idx in self._minibatches(len(b.rewards), size, self.critic_rng)]
        if len(window) > 1:
            self.critic_rng.shuffle(steps)
        rows = [self._critic_minibatch(window[w][0], idx, self._seq_tokens(window[w][0]), window[w][1],
                                       window[w][2]) for w, idx in steps]
        if rows:
            rows[0]["critic/replay_batches"] = float(len(window))
        return rows

    def _max_tokens(self) -> int | None:
        """L of Dr. GRPO's constant loss normaliser (``rollout.max_response_tokens``); None for the other objectives."""
        return self.cfg.rollout.max_response_tokens if self.algo.constant_loss_normalizer else None

    def _policy_loss(self, lp: torch.Tensor, old_lp: torch.Tensor, adv: torch.Tensor, keep: torch.Tensor,
                     ent: torch.Tensor, bw: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The policy loss of one micro-batch by ``algo.policy_objective`` (module docstring)."""
        a, token_level = self.algo, self.algo.token_level_loss
        if a.policy_objective in ("gspo", "gspo_token"):
            return gspo_loss(lp, old_lp, adv, keep, a.gspo_eps_low, a.gspo_eps_high, token_level=token_level,
                             entropy=ent, behavior_weights=bw, token_variant=a.policy_objective == "gspo_token")
        if a.policy_objective == "cispo":
            return cispo_loss(lp, old_lp, adv, keep, a.effective_eps_high, token_level=token_level, entropy=ent,
                              behavior_weights=bw)
        return policy_loss(lp, old_lp, adv, keep, a.eps_low, a.effective_eps_high, token_level=token_level,
                           entropy=ent, behavior_weights=bw, max_tokens=self._max_tokens())

    def _mismatch_metrics(self, batch: RolloutBatch, old_lp: torch.Tensor, lags: torch.Tensor,
                          correction: dict[str, torch.Tensor]) -> dict[str, float]:
        """``mismatch/*`` of the whole batch (a lag bucket only when it holds tokens) and ``correction/*``: the
        weights' and the mask's statistics. Lags are per token when the batch carries each token's version (an
        engine that updates weights in flight), else per sequence (``Group.version``)."""
        mask = batch.tokens.response_mask
        out = {f"mismatch/{k}": float(v) for k, v in mismatch_metrics(old_lp, batch.behavior_logprobs, mask,
                                                                      lags).items()}
        for bucket in LAG_BUCKETS:
            if out[f"mismatch/{bucket}/token_frac"] == 0.0:
                for k in [k for k in out if k.startswith(f"mismatch/{bucket}/")]:
                    del out[k]
        if self.algo.behavior_correction and self.algo.behavior_weight != "off":
            _, wstats = is_weights(behavior_log_ratio(old_lp, batch.behavior_logprobs, mask), mask,
                                   self.algo.behavior_weight, self.algo.behavior_weight_cap)
            correction = {**correction, **wstats}
            out["actor/behavior_weight_mean"] = float(wstats["weight_mean"])  # the name before correction/*
        out.update({f"correction/{k}": float(v) for k, v in correction.items()})
        return out

    def _behavior_weights(self, batch: RolloutBatch, old_lp: torch.Tensor, rows: list[int], w: int
                          ) -> torch.Tensor | None:
        """Truncated importance weights of ``rows`` (the first ``w`` response columns; whole sequences, as sequence
        and geometric weights need), None when no weight applies. A token without an engine log-prob has log ρ = 0:
        weight 1 at token level, its sequence's weight at sequence and geometric level (``algo.mismatch``)."""
        if not self.algo.behavior_correction or self.algo.behavior_weight == "off":
            return None
        mask = batch.tokens.response_mask[rows, :w]
        log_ratio = behavior_log_ratio(old_lp[rows, :w], batch.behavior_logprobs[rows, :w], mask)
        return is_weights(log_ratio, mask, self.algo.behavior_weight, self.algo.behavior_weight_cap)[0]

    # ---------------------------------------------------------------- weights and checkpoints
    def empty_update(self) -> dict[str, float]:
        """A step in which no group was informative (DAPO dynamic sampling): nothing to learn from, but still a
        version, so that engines, replay and checkpoints count steps alike."""
        self.version += 1
        return {"dapo/empty_batch": 1.0}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the engines load them: in ``model.dtype`` (the learner's masters are float32), on
        the host. A sharded policy is gathered whole on rank 0, the others get ``{}`` (a collective: every rank must
        call it): what a sharded learner publishes with ``cluster.weights.transfer`` shm, zmq or file, and what the
        one-process trainer loads. The learner service with weight groups ("dist", "auto") does not call it for a
        sharded policy: ``learner.sharding.publish_sharded`` streams each version one gathered bucket at a time and
        builds the whole version on rank 0 from that same walk only when an engine needs it so."""
        if self.sharded:
            state = sharding.full_state_dict(self.policy)
        else:
            state = {k: v.cpu() for k, v in self.policy.state_dict().items()}
        if self.lora is not None and state:  # the merged weights: what an engine without the adapter serves
            state = lora.merged_state(state, lora.scaling(self.lora))
        return self.precision.engine_state(state)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The policy's LoRA adapter (``model.lora``) as a PEFT ``adapter_model.safetensors`` names it, on the host in
        float32 (the masters: adapters are small, and vLLM casts them to its dtype as it loads them). A sharded policy
        gathers its adapter's tensors alone (a collective: every rank must call it, and every rank gets the adapter);
        the frozen base is never gathered for a version."""
        if self.lora is None:
            raise ValueError("the policy has no LoRA adapter (model.lora.rank = 0)")
        return lora.adapter_tensors({k: _full(v).cpu() for k, v in self.policy.state_dict().items() if ".lora_" in k})

    @property
    def publishes_adapter(self) -> bool:
        """A version goes to the engines as its adapter (``model.lora.serve = "adapter"``), else as the policy's weights
        (merged with ``serve = "merged"``)."""
        return self.cfg.model.lora.adapter_versions

    def publish_state(self) -> dict[str, torch.Tensor]:
        """What a version sends: the adapter with ``model.lora`` served as adapters (:meth:`adapter_state`), else the
        weights (:meth:`policy_state`: merged with ``model.lora.serve = "merged"``). A collective when the learner is
        sharded."""
        return self.adapter_state() if self.publishes_adapter else self.policy_state()

    def _train_state(self) -> dict:
        """Models and optimisers as torch.distributed.checkpoint state (each rank's shards when sharded)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        state = {}
        msd, osd = get_state_dict(self.policy, self.actor_opt)
        state["policy"], state["actor_opt"] = msd, osd
        if self.critic is not None:
            msd, osd = get_state_dict(self.critic, self.critic_opt)
            state["critic"], state["critic_opt"] = msd, osd
        return state

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        """A resumable checkpoint: ``dcp/`` (policy, critic and both AdamW states, written by every rank as its
        shards with torch.distributed.checkpoint, so any number of ranks can resume from it), ``learner_state.pt``
        (counters, RNG, loss scalers, ``extra``), ``hf_meta/`` (config and tokenizer files, from which
        ``async-vapo export`` writes HF directories) and, from an unsharded learner, ``policy/`` and ``critic/`` in HF
        format. With ``model.lora``: ``policy_adapter/`` (a PEFT adapter directory) instead of ``policy/``, and the
        adapter's config in ``hf_meta/policy``; the frozen base is in ``dcp/`` too, so a resume from the base model's
        directory restores the same policy. Written to ``path.tmp`` and renamed."""
        import shutil

        import torch.distributed.checkpoint as dcp

        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        if self.rank == 0:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        self._barrier()
        with single_process_checkpoint():
            dcp.save(self._train_state(), checkpoint_id=str(tmp / "dcp"), no_dist=self.world == 1)
        # collectives when sharded, so before rank 0 writes alone: the adapter, and a LoRA critic's whole state
        adapter = self.adapter_state() if self.lora is not None else None
        critic_state = None
        if self.critic_lora is not None:
            critic_state = (sharding.full_state_dict(self.critic) if self.sharded else
                            {k: v.detach().cpu() for k, v in self.critic.state_dict().items()})
        if self.rank == 0:
            from async_vapo.learner.export import write_meta

            write_meta(self.policy, self._sources["policy"], tmp / "hf_meta" / "policy")
            if self.critic is not None:
                write_meta(self.critic, self._sources["critic"], tmp / "hf_meta" / "critic")
            if self.lora is not None:  # the adapter's config beside the base's (export), and the adapter itself
                self.lora.save_pretrained(str(tmp / "hf_meta" / "policy"))
                lora.save_adapter(tmp / "policy_adapter", adapter, self.lora, str(self._sources["policy"]))
            elif not self.sharded:
                self.policy.save_pretrained(tmp / "policy", safe_serialization=True)
            if self.critic_lora is not None:  # the adapter's config (export), and the merged critic: a plain one
                self.critic_lora.save_pretrained(str(tmp / "hf_meta" / "critic"))
                self._save_merged_critic(tmp / "critic", critic_state)
            elif not self.sharded and self.critic is not None:
                self.critic.save_pretrained(tmp / "critic", safe_serialization=True)
            torch.save({
                "actor_scaler": self.actor_scaler.state_dict(),
                "critic_scaler": None if self.critic_scaler is None else self.critic_scaler.state_dict(),
                "version": self.version, "optimizer_steps": self.optimizer_steps, "critic_steps": self.critic_steps,
                "rng": self.rng.getstate(), "critic_rng": self.critic_rng.getstate(),
                "torch_rng": torch.get_rng_state(), "extra": extra or {},
                "world": self.world,
            }, tmp / "learner_state.pt")
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
        self._barrier()
        return path

    def _save_merged_critic(self, directory: Path, state: dict[str, torch.Tensor]) -> None:
        """A LoRA critic as an ordinary critic directory (``model.critic_lora``): its trunk's weights merged with the
        adapters, its head as trained; ``load_critic`` reads it, and a resume from it restores the exact critic (its
        base and adapters come from ``dcp/``)."""
        from safetensors.torch import save_file

        from async_vapo.learner.export import write_meta

        merged = lora.merged_state(state, lora.scaling(self.critic_lora))
        self.critic.config.architectures = [type(self.critic).__name__]  # as save_pretrained records it: a critic
        write_meta(self.critic, self._sources["critic"], directory)
        save_file({k: v.contiguous() for k, v in merged.items()}, str(directory / "model.safetensors"),
                  metadata={"format": "pt"})

    def _barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()

    def _load_state_before_dcp(self, path: Path) -> dict:
        """A checkpoint of the earlier one-process format (``policy/``, ``critic/`` and optimiser states in
        ``learner_state.pt``): the models came from its HF directories through the constructor."""
        if not (path / "learner_state.pt").is_file():
            raise FileNotFoundError(f"{path} is not a learner checkpoint (no dcp/ and no learner_state.pt)")
        meta = torch.load(path / "learner_state.pt", weights_only=False)
        if "actor_opt" not in meta:
            raise FileNotFoundError(f"{path} is not a learner checkpoint (no dcp/ directory)")
        if self.sharded:
            raise ValueError(f"{path} is a one-process checkpoint of the format before DCP: resume it in one process "
                             "(its next checkpoint can then resume on any number of ranks)")
        self.actor_opt.load_state_dict(meta["actor_opt"])
        if self.critic_opt is not None and meta.get("critic_opt") is not None:
            self.critic_opt.load_state_dict(meta["critic_opt"])
        return self._restore_counters(meta)

    def load_state(self, path: str | Path) -> dict:
        """Restore models, optimisers, counters and RNG from a checkpoint written by any number of ranks."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = Path(path)
        if not (path / "dcp").is_dir():
            return self._load_state_before_dcp(path)
        state = self._train_state()
        with single_process_checkpoint():
            dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=self.world == 1)
        set_state_dict(self.policy, self.actor_opt, model_state_dict=state["policy"],
                       optim_state_dict=state["actor_opt"])
        if self.critic is not None:
            set_state_dict(self.critic, self.critic_opt, model_state_dict=state["critic"],
                           optim_state_dict=state["critic_opt"])
        return self._restore_counters(torch.load(path / "learner_state.pt", weights_only=False))

    def _restore_counters(self, meta: dict) -> dict:
        if meta.get("actor_scaler"):  # float16 only (a disabled scaler's state is empty)
            self.actor_scaler.load_state_dict(meta["actor_scaler"])
        if self.critic_scaler is not None and meta.get("critic_scaler"):
            self.critic_scaler.load_state_dict(meta["critic_scaler"])
        self.version, self.optimizer_steps = meta["version"], meta["optimizer_steps"]
        self.critic_steps = meta["critic_steps"]
        self.rng.setstate(meta["rng"])
        if "critic_rng" in meta:  # a checkpoint from before the critic's own schedule has none
            self.critic_rng.setstate(meta["critic_rng"])
        torch.set_rng_state(meta["torch_rng"])
        return meta["extra"]
