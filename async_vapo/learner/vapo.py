"""The learner: VAPO updates (and the PPO / GRPO / DAPO baselines) on torch.

One rollout step's groups become one ``RolloutBatch``; ``Learner.update`` then runs
``ppo_epochs`` passes of mini-batches (one optimiser step each), each split into micro-batches whose
losses are weighted by their share of the mini-batch's tokens (or sequences) — so the token-level loss
is one mean over every valid token of the mini-batch however it is split.

Every log-prob (``old_logprobs``, the ratio's, the behaviour weights', the entropy) is of the distribution the
engines sample from: softmax(logits / ``rollout.temperature``) over the whole vocabulary (the config rejects a
training ``top_p`` < 1), so that on-policy samples have ratio 1 and behaviour weight 1 at any temperature.

Precision (``learner.precision``): parameters, gradients and AdamW moments are float32 whatever ``model.dtype``;
forwards run under autocast to ``model.dtype``, and :meth:`Learner.policy_state` hands out weights in it, the
dtype the engines run. Learning-rate warm-up (``optim.warmup_steps``) counts each optimiser's own steps: the
critic's (value pretraining included) for the critic, the policy's for the policy.

``old_logprobs`` are recomputed by the learner with its weights at the start of the update (the
proximal policy): for on-policy samples these are the weights that generated them. Samples that older
weights generated (asynchronous training, ``async.max_staleness`` > 0) are corrected by the decoupled PPO
objective (``algo.behavior_correction``): each token's clipped surrogate is weighted by
π_proximal / π_behaviour, with the engine's log-probs as π_behaviour, truncated at
``algo.behavior_weight_cap``. ``behavior_logprob_gap`` reports the mean |log π_proximal − log π_behaviour|.

Advantages by algorithm (the math lives in ``async_vapo.algo``):
- vapo / ppo: GAE on the critic's values; actor λ = ``lam_policy`` or, with length-adaptive GAE,
  1 − 1/(α·l) per response; critic targets with ``lam_critic`` (decoupled GAE) or the actor's λ.
- grpo / dapo: group-normalised terminal reward on every token; no critic.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from async_vapo.algo.advantages import broadcast_to_tokens, group_normalized_advantages
from async_vapo.algo.dapo import soft_overlong_punishment
from async_vapo.algo.gae import compute_gae, length_adaptive_lambda
from async_vapo.algo.losses import (
    behavior_weights,
    explained_variance,
    loss_normalizer,
    microbatch_weight,
    policy_loss,
    positive_lm_loss,
    value_loss,
)
from async_vapo.algo.utils import entropy_from_logits, logprobs_from_logits, masked_mean, masked_whiten
from async_vapo.config import Config
from async_vapo.learner.dist import allreduce_gradients, data_parallel_world
from async_vapo.learner.precision import Precision
from async_vapo.models.rl import (
    TokenBatch,
    load_critic,
    load_policy,
    make_token_batch,
    response_logits,
    response_values,
)
from async_vapo.rollout.types import Group


@dataclass
class RolloutBatch:
    tokens: TokenBatch
    rewards: torch.Tensor  # [B] verifier reward (+ overlong shaping)
    correct: torch.Tensor  # [B] bool
    group_ids: torch.Tensor  # [B] long
    versions: torch.Tensor  # [B] long
    behavior_logprobs: torch.Tensor  # [B, T]

    @property
    def lengths(self) -> torch.Tensor:
        return self.tokens.response_mask.sum(-1)


def make_rollout_batch(groups: Sequence[Group], pad_id: int, *, overlong_max_len: int = 0,
                       overlong_buffer: int = 0) -> RolloutBatch:
    prompts, responses, rewards, correct, gids, versions, blp = [], [], [], [], [], [], []
    for g_index, g in enumerate(groups):
        for s in g.samples:
            prompts.append(g.prompt_ids)
            responses.append(s.response_ids)
            rewards.append(s.reward)
            correct.append(s.correct)
            gids.append(g_index)
            versions.append(g.version)
            blp.append(s.behavior_logprobs)
    tokens = make_token_batch(prompts, responses, pad_id)
    behavior = torch.full(tokens.response_mask.shape, float("nan"))  # NaN: not reported by the engine
    for i, lp in enumerate(blp):
        behavior[i, : len(lp)] = torch.as_tensor(lp, dtype=torch.float)
    r = torch.tensor(rewards, dtype=torch.float)
    if overlong_buffer > 0:
        r = r + soft_overlong_punishment(tokens.response_mask.sum(-1), overlong_max_len, overlong_buffer).float()
    return RolloutBatch(tokens, r, torch.tensor(correct), torch.tensor(gids), torch.tensor(versions), behavior)


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
    def __init__(self, cfg: Config, policy_path: str | Path, critic_path: str | Path | None = None):
        self.cfg = cfg
        self.algo = cfg.algo
        torch.manual_seed(cfg.train.seed)
        self.rng = random.Random(cfg.train.seed)
        self.temperature = cfg.rollout.temperature  # of the engines' training samples
        # float32 master weights and optimiser state; forwards under autocast to model.dtype (learner.precision)
        self.policy = load_policy(policy_path, "float32")  # eval mode: no dropout anywhere
        self.precision = Precision(cfg.model.dtype, next(self.policy.parameters()).device.type)
        self.actor_opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.optim.actor_lr,
                                           betas=(cfg.optim.beta1, cfg.optim.beta2),
                                           weight_decay=cfg.optim.weight_decay)
        self.actor_scaler = self.precision.grad_scaler()
        self.critic = self.critic_opt = self.critic_scaler = None
        if self.algo.uses_critic:
            self.critic = load_critic(critic_path or policy_path, "float32")
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.optim.critic_lr,
                                                betas=(cfg.optim.beta1, cfg.optim.beta2),
                                                weight_decay=cfg.optim.weight_decay)
            self.critic_scaler = self.precision.grad_scaler()
        self.version = 0  # policy updates published so far
        self.optimizer_steps = 0  # policy optimiser steps
        self.critic_steps = 0  # critic optimiser steps, value pretraining included
        self.reuse_first_logprobs = True
        """Take the first mini-batch's old log-probs from its own first forward (exact; see ``update``)."""

    # ---------------------------------------------------------------- helpers
    def _lr_scale(self, steps_done: int) -> float:
        """Linear warm-up factor of an optimiser's next step, from the steps it has taken."""
        w = self.cfg.optim.warmup_steps
        return 1.0 if w == 0 else min(1.0, (steps_done + 1) / w)

    def _logits(self, tb: TokenBatch) -> torch.Tensor:
        with self.precision.autocast():
            return response_logits(self.policy, tb, self.temperature)

    def _values(self, tb: TokenBatch) -> torch.Tensor:
        with self.precision.autocast():
            return response_values(self.critic, tb)

    def _minibatches(self, n: int) -> list[list[int]]:
        order = list(range(n))
        self.rng.shuffle(order)
        mb = self.algo.mini_batch_size
        return [order[i: i + mb] for i in range(0, n, mb)]

    def _micro(self, idx: list[int]) -> list[list[int]]:
        k = self.algo.micro_batch_size
        return [idx[i: i + k] for i in range(0, len(idx), k)]

    @torch.no_grad()
    def _forward_old(self, batch: RolloutBatch, skip: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the policy that generated the batch and the critic's values, before any update. The
        log-probs of the rows in ``skip`` are left 0 (the update takes them from its first gradient step)."""
        n, t = batch.tokens.response_mask.shape
        old_lp = torch.zeros(n, t)
        values = torch.zeros(n, t) if self.critic is not None else None
        skipped = set(skip)
        rows = [i for i in range(n) if i not in skipped]
        for idx in self._micro(rows):
            tb = batch.tokens.select(idx)
            old_lp[idx, : tb.response_ids.shape[1]] = logprobs_from_logits(self._logits(tb), tb.response_ids)
        for idx in self._micro(list(range(n))) if values is not None else ():
            tb = batch.tokens.select(idx)
            values[idx, : tb.response_ids.shape[1]] = self._values(tb)
        mask = batch.tokens.response_mask.bool()
        return old_lp.masked_fill(~mask, 0.0), None if values is None else values.masked_fill(~mask, 0.0)

    def _token_rewards(self, batch: RolloutBatch) -> torch.Tensor:
        mask = batch.tokens.response_mask
        last = (batch.lengths - 1).clamp(min=0)
        r = torch.zeros(mask.shape)
        r[torch.arange(len(last)), last] = batch.rewards
        return r * mask

    def _my_micro(self, idx: list[int]) -> list[list[int]]:
        """This data-parallel rank's share of the mini-batch's micro-batches (all of them in a world of one).
        Every rank holds the whole batch and the loss normaliser of the whole mini-batch, so the gradients
        summed over ranks are exactly the single-process gradient (token-level or sequence-level)."""
        rank, world = data_parallel_world()
        return self._micro(idx)[rank::world]

    def _step(self, model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, lr: float,
              steps_done: int) -> float:
        """One optimiser step on the accumulated (loss-scaled) gradients; skipped when they are not finite."""
        allreduce_gradients(model)
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.algo.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr * self._lr_scale(steps_done)
        if torch.isfinite(norm):
            scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return float(norm)

    # ---------------------------------------------------------------- critic-only (value pretraining)
    def pretrain_critic(self, batch: RolloutBatch) -> dict[str, float]:
        """One rollout batch of critic-only training with Monte-Carlo targets (λ = 1): VAPO §3.1."""
        if self.critic is None:
            raise RuntimeError(f"algorithm {self.algo.name!r} has no critic to pretrain")
        mask = batch.tokens.response_mask
        _, values = self._forward_old(batch, skip=range(len(mask)))  # the critic's values only
        _, returns = compute_gae(self._token_rewards(batch), values, mask, 1.0, self.algo.gamma)
        rows = [self._critic_minibatch(batch, idx, returns, values) for idx in self._minibatches(len(mask))]
        return _mean_metrics(rows)

    def _critic_minibatch(self, batch: RolloutBatch, idx: list[int], returns: torch.Tensor,
                          old_values: torch.Tensor) -> dict[str, float]:
        mask = batch.tokens.response_mask
        total = loss_normalizer(mask[idx], True)
        rows = []
        for mi in self._my_micro(idx):
            tb = batch.tokens.select(mi)
            w = tb.response_ids.shape[1]
            v = self._values(tb)
            vl, m = value_loss(v, returns[mi, :w], tb.response_mask, old_values[mi, :w], self.algo.value_clip)
            self.critic_scaler.scale(self.algo.vf_coef * microbatch_weight(tb.response_mask, total, True) * vl
                                     ).backward()
            rows.append({"critic/value_loss": float(vl.detach()), **{f"critic/{k}": float(x) for k, x in m.items()}})
        out = _mean_metrics(rows)
        out["critic/grad_norm"] = self._step(self.critic, self.critic_opt, self.critic_scaler,
                                             self.cfg.optim.critic_lr, self.critic_steps)
        self.critic_steps += 1
        return out

    # ---------------------------------------------------------------- advantages
    def advantages(self, batch: RolloutBatch, values: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
        mask = batch.tokens.response_mask
        stats: dict[str, float] = {}
        if self.algo.uses_critic:
            rewards = self._token_rewards(batch)
            if self.algo.length_adaptive_gae:
                lam_policy = length_adaptive_lambda(batch.lengths.float(), self.algo.alpha)
            else:
                lam_policy = torch.full((len(mask),), self.algo.lam_policy)
            lam_critic = torch.full_like(lam_policy, self.algo.lam_critic) if self.algo.decoupled_gae else lam_policy
            adv, _ = compute_gae(rewards, values, mask, lam_policy, self.algo.gamma)
            _, returns = compute_gae(rewards, values, mask, lam_critic, self.algo.gamma)
            stats.update({"lam_policy/mean": float(lam_policy.mean()), "lam_policy/min": float(lam_policy.min()),
                          "lam_policy/max": float(lam_policy.max())})
        else:
            seq_adv = group_normalized_advantages(batch.rewards, batch.group_ids)
            adv, returns = broadcast_to_tokens(seq_adv, mask), None
        if self.algo.whiten_advantages:
            adv = masked_whiten(adv, mask) * mask
        stats["advantage/mean"] = float(masked_mean(adv, mask))
        return adv, returns, stats

    # ---------------------------------------------------------------- the update
    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One rollout step's worth of policy (and critic) optimisation; publishes version + 1."""
        mask = batch.tokens.response_mask
        plan = [self._minibatches(len(mask)) for _ in range(self.algo.ppo_epochs)]
        # The first mini-batch's old log-probs are its first gradient step's own log-probs (same weights, same
        # tokens): they are taken, detached, from that forward instead of a separate pass (ratio exactly 1 there).
        reuse = set(plan[0][0]) if self.reuse_first_logprobs and data_parallel_world()[1] == 1 else set()
        old_lp, values = self._forward_old(batch, skip=sorted(reuse))
        adv, returns, stats = self.advantages(batch, values)
        nan_behavior = torch.isnan(batch.behavior_logprobs)
        if values is not None:
            stats.update(critic_error_by_age(values, returns, mask, self.version - batch.versions))
        token_level = self.algo.token_level_loss
        eps_high = self.algo.effective_eps_high
        rows: list[dict[str, float]] = []
        fresh = reuse  # rows whose old log-probs the next forward provides: the first mini-batch's, once
        for epoch in plan:
            for idx in epoch:
                total = loss_normalizer(mask[idx], token_level)
                pos_mask_all = mask[idx].bool() & batch.correct[idx, None]
                pos_total = loss_normalizer(pos_mask_all, True)
                mrows = []
                for mi in self._my_micro(idx):
                    tb = batch.tokens.select(mi)
                    w = tb.response_ids.shape[1]
                    logits = self._logits(tb)
                    lp = logprobs_from_logits(logits, tb.response_ids)
                    with torch.no_grad():
                        ent = entropy_from_logits(logits)
                        if fresh:
                            old_lp[mi, :w] = lp.masked_fill(~tb.response_mask.bool(), 0.0)
                        bw_mi = self._behavior_weights(batch, old_lp, nan_behavior, mi, w)
                    pl, m = policy_loss(lp, old_lp[mi, :w], adv[mi, :w], tb.response_mask, self.algo.eps_low,
                                        eps_high, token_level=token_level, entropy=ent, behavior_weights=bw_mi)
                    loss = microbatch_weight(tb.response_mask, total, token_level) * pl
                    row = {"actor/pg_loss": float(pl.detach()), **{f"actor/{k}": float(x) for k, x in m.items()}}
                    if self.algo.pos_lm_coef > 0:
                        correct = batch.correct[mi]
                        ll, lm = positive_lm_loss(lp, tb.response_mask, correct)
                        pos_mask = tb.response_mask.bool() & correct[:, None]
                        loss = loss + self.algo.pos_lm_coef * microbatch_weight(pos_mask, pos_total, True) * ll
                        row.update({f"actor/{k}": float(x) for k, x in lm.items()})
                    if self.algo.entropy_coef > 0:
                        ent_g = entropy_from_logits(logits)
                        loss = loss - self.algo.entropy_coef * microbatch_weight(
                            tb.response_mask, total, token_level) * masked_mean(ent_g, tb.response_mask)
                    self.actor_scaler.scale(loss).backward()
                    mrows.append(row)
                out = _mean_metrics(mrows)
                out["actor/grad_norm"] = self._step(self.policy, self.actor_opt, self.actor_scaler,
                                                    self.cfg.optim.actor_lr, self.optimizer_steps)
                if self.critic is not None:
                    out.update(self._critic_minibatch(batch, idx, returns, values))
                self.optimizer_steps += 1
                rows.append(out)
                fresh = set()
        self.version += 1
        metrics = _mean_metrics(rows)
        metrics.update(stats)
        # tokens without an engine log-prob count as on-policy (weight 1)
        behavior = torch.where(nan_behavior, old_lp, batch.behavior_logprobs)
        metrics["behavior_logprob_gap"] = float(masked_mean((old_lp - behavior).abs(), mask))
        if self.algo.behavior_correction:
            _, bstats = behavior_weights(old_lp, behavior, mask, self.algo.behavior_weight_cap)
            metrics.update({f"actor/{k}": float(v) for k, v in bstats.items()})
        return metrics

    def _behavior_weights(self, batch: RolloutBatch, old_lp: torch.Tensor, nan_behavior: torch.Tensor,
                          rows: list[int], w: int) -> torch.Tensor | None:
        """Decoupled-PPO weights of ``rows`` (the first ``w`` response columns), None when the correction is off.
        Tokens without an engine log-prob count as on-policy (weight 1)."""
        if not self.algo.behavior_correction:
            return None
        old = old_lp[rows, :w]
        behavior = torch.where(nan_behavior[rows, :w], old, batch.behavior_logprobs[rows, :w])
        return behavior_weights(old, behavior, batch.tokens.response_mask[rows, :w], self.algo.behavior_weight_cap)[0]

    # ---------------------------------------------------------------- weights and checkpoints
    def empty_update(self) -> dict[str, float]:
        """A step in which no group was informative (DAPO dynamic sampling): nothing to learn from, but still a
        version, so that engines, replay and checkpoints count steps alike."""
        self.version += 1
        return {"dapo/empty_batch": 1.0}

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The policy's weights as the engines load them: in ``model.dtype`` (the learner's masters are float32)."""
        return self.precision.engine_state(self.policy.state_dict())

    def save(self, path: str | Path, extra: dict | None = None) -> Path:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(tmp / "policy", safe_serialization=True)
        if self.critic is not None:
            self.critic.save_pretrained(tmp / "critic", safe_serialization=True)
        torch.save({
            "actor_opt": self.actor_opt.state_dict(),
            "critic_opt": None if self.critic_opt is None else self.critic_opt.state_dict(),
            "actor_scaler": self.actor_scaler.state_dict(),
            "critic_scaler": None if self.critic_scaler is None else self.critic_scaler.state_dict(),
            "version": self.version, "optimizer_steps": self.optimizer_steps, "critic_steps": self.critic_steps,
            "rng": self.rng.getstate(), "torch_rng": torch.get_rng_state(), "extra": extra or {},
        }, tmp / "learner_state.pt")
        if path.exists():
            import shutil

            shutil.rmtree(path)
        tmp.rename(path)
        return path

    def load_state(self, path: str | Path) -> dict:
        """Restore optimisers, counters and RNG from a checkpoint (models are loaded by the constructor)."""
        state = torch.load(Path(path) / "learner_state.pt", weights_only=False)
        self.actor_opt.load_state_dict(state["actor_opt"])
        if self.critic_opt is not None and state["critic_opt"] is not None:
            self.critic_opt.load_state_dict(state["critic_opt"])
        if state.get("actor_scaler"):  # float16 only (a disabled scaler's state is empty)
            self.actor_scaler.load_state_dict(state["actor_scaler"])
        if self.critic_scaler is not None and state.get("critic_scaler"):
            self.critic_scaler.load_state_dict(state["critic_scaler"])
        self.version, self.optimizer_steps = state["version"], state["optimizer_steps"]
        self.critic_steps = state["critic_steps"]
        self.rng.setstate(state["rng"])
        torch.set_rng_state(state["torch_rng"])
        return state["extra"]
