"""A reward-model-like critic for the embedded default (``model.critic_init = "reward"``).

VAPO's critic starts from a reward model (§3.1): a head trained to score *whole* responses, read at
the last token. At earlier tokens such a head has never been supervised, so its values there are
biased, and with λ < 1 that bias flows straight into GAE advantages. That is what value pretraining
is for. To give the toy the same starting point, this module builds an outcome reward model the way
one is built: from the base model, on labelled responses (the task's imperfect demonstrations, the
distribution the base model imitates, labelled by the verifier's rule), with a regression loss on the
verifier's reward **at the last response token only**. Cached beside the base model.

Gently: the trunk is the base model's and stays close to it. Only the value head learns at
``reward_model.lr``; the trunk learns at ``reward_model.trunk_lr`` (default 0: frozen, so the trunk's
next-token NLL is the base model's). Training every parameter at 1e-3 (build version 1) moved the
weights by a median 27 % and took the trunk's NLL from 0.108 to 9.58 nats: a critic started from it had
lost what the base model knew. The build records the trunk's NLL on held-out demonstrations before and
after (``trunk_nll_base``, ``trunk_nll``). The demonstrations are graded as the run grades responses
(``verifier.answer_format``), and that grading is part of the cache key.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

from async_vapo.config import Config
from async_vapo.models.base_model import base_model_key, use_shipped
from async_vapo.models.rl import load_critic, make_token_batch, response_values
from async_vapo.tasks import arith, load_task
from async_vapo.verify.check import check_answer

BUILD_VERSION = 2  # 2: head (and an optional gentle trunk lr), graded by the configured format


def reward_critic_key(cfg: Config) -> str:
    spec = {"v": BUILD_VERSION, "base": base_model_key(cfg), "rm": cfg.reward_model.model_dump(),
            "reward": [cfg.verifier.reward_correct, cfg.verifier.reward_incorrect], "grading": _grading(cfg)}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def reward_critic_path(cfg: Config) -> Path:
    return Path(cfg.model.cache_dir).expanduser() / f"tiny-rm-{reward_critic_key(cfg)}"


def resolve_critic_path(cfg: Config, base_path: Path, *, progress: bool = True, build: bool = True) -> Path | None:
    """Where the critic starts: ``model.critic_path`` if set; the reward-like critic for
    ``critic_init = "reward"`` (cached, else shipped, else built; ``build=False``: its path only); else None
    (the policy's base with a zero value head)."""
    if cfg.model.critic_path:
        return Path(cfg.model.critic_path).expanduser()
    if cfg.model.critic_init != "reward" or not cfg.algo.uses_critic:
        return None
    if cfg.task.kind != "arith" or cfg.model.path:
        raise ValueError("model.critic_init='reward' builds a reward head for the embedded arith task; "
                         "for other models set model.critic_path to a reward/value model")
    if cfg.verifier.reward_fn:
        raise ValueError("model.critic_init='reward' labels demonstrations with the maths check; with "
                         "verifier.reward_fn set, give the critic with model.critic_path")
    path = reward_critic_path(cfg)
    if (path / "BUILD_DONE").exists() or not build:
        return path
    if use_shipped("reward_critic", reward_critic_key(cfg), path):
        return path
    return make_reward_critic(cfg, base_path, path, progress=progress)


def _grading(cfg: Config) -> dict:
    """What decides a demonstration's label: the verifier's answer format and the reference it compares with."""
    return {"answer_format": cfg.verifier.answer_format, "task_answer": cfg.task.answer}


def _labelled(problems, tok, cfg: Config, rng: random.Random) -> tuple[list, list, list]:
    prompts, responses, rewards = [], [], []
    v = cfg.verifier
    for p in problems:
        text = arith.demonstration(p, rng, cfg.base_model.demo_step_error_rate)
        ok = check_answer(text, p.answer, answer_format=v.answer_format)[0]
        prompts.append(tok(cfg.task.prompt_template.format(prompt=p.prompt)).input_ids)
        responses.append(tok(text).input_ids + [tok.eos_token_id])
        rewards.append(v.reward_correct if ok else v.reward_incorrect)
    return prompts, responses, rewards


def _head_and_trunk(critic: torch.nn.Module) -> tuple[list, list]:
    head = list(critic.score.parameters())
    ids = {id(p) for p in head}
    return head, [p for p in critic.parameters() if id(p) not in ids]


def trunk_nll(base_path: Path, critic: torch.nn.Module, tok, demos: tuple[list, list, list]) -> float:
    """Next-token NLL (nats per response token) of ``demos`` under the base model's LM head over the critic's
    trunk: how much of the base model the critic's trunk still holds (the base model's own NLL when untouched)."""
    from async_vapo.algo.utils import logprobs_from_logits, masked_mean
    from async_vapo.models.rl import load_policy, response_logits

    policy = load_policy(base_path)
    prefix = critic.base_model_prefix
    getattr(policy, policy.base_model_prefix).load_state_dict(getattr(critic, prefix).state_dict())
    prompts, responses, _ = demos
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(prompts), 32):
            tb = make_token_batch(prompts[i: i + 32], responses[i: i + 32], tok.pad_token_id)
            lp = logprobs_from_logits(response_logits(policy, tb), tb.response_ids)
            n = int(tb.response_mask.sum())
            nll -= float(masked_mean(lp, tb.response_mask)) * n
            tokens += n
    return nll / max(tokens, 1)


def _median_relative_change(base_path: Path, critic: torch.nn.Module) -> float:
    """Median over the trunk's tensors of ||W - W_base|| / ||W_base||."""
    base = load_critic(base_path)
    prefix = critic.base_model_prefix
    b = getattr(base, prefix).state_dict()
    changes = [float((w - b[k]).norm() / b[k].norm().clamp(min=1e-12))
               for k, w in getattr(critic, prefix).state_dict().items()]
    return float(torch.tensor(changes).median())


def make_reward_critic(cfg: Config, base_path: Path, out: Path, *, progress: bool = True) -> Path:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    rm = cfg.reward_model
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(rm.seed)
    rng = random.Random(rm.seed)
    tok = AutoTokenizer.from_pretrained(str(base_path))
    train, held = load_task(cfg)
    critic = load_critic(base_path, cfg.model.dtype)
    head, trunk = _head_and_trunk(critic)
    for p in trunk:
        p.requires_grad_(rm.trunk_lr > 0)  # frozen: no backward through the trunk at all
    groups = [{"params": head, "lr": rm.lr}] + ([{"params": trunk, "lr": rm.trunk_lr}] if rm.trunk_lr > 0 else [])
    opt = torch.optim.AdamW(groups, weight_decay=0.01)
    held_demos = _labelled(held, tok, cfg, random.Random(rm.seed + 1))
    nll_base = trunk_nll(base_path, critic, tok, held_demos)
    t0 = time.perf_counter()
    bar = tqdm(range(rm.steps), desc="reward-like critic (loss at the last token)", disable=not progress,
               dynamic_ncols=True)
    ema = None
    for _ in bar:
        prompts, responses, rewards = _labelled(rng.sample(train, rm.batch_size), tok, cfg, rng)
        tb = make_token_batch(prompts, responses, tok.pad_token_id)
        last = tb.response_mask.sum(-1) - 1
        values = response_values(critic, tb)
        loss = torch.nn.functional.mse_loss(values[torch.arange(len(last)), last], torch.tensor(rewards))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head + trunk, 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.set_postfix(mse=f"{ema:.3f}")
    # How the head scores held-out demonstrations: at the last token (what it was trained on) and at
    # the first response token (never supervised: the bias value pretraining has to remove).
    with torch.no_grad():
        prompts, responses, rewards = held_demos
        tb = make_token_batch(prompts, responses, tok.pad_token_id)
        values = response_values(critic, tb)
        last = tb.response_mask.sum(-1) - 1
        r = torch.tensor(rewards)
        v_last, v_first = values[torch.arange(len(last)), last], values[:, 0]
        meta = {"steps": rm.steps, "seconds": round(time.perf_counter() - t0, 1), "train_mse_ema": ema,
                "heldout_mse_last_token": float(((v_last - r) ** 2).mean()),
                "heldout_sign_accuracy_last_token": float(((v_last > 0) == (r > 0)).float().mean()),
                "heldout_mse_first_token": float(((v_first - r) ** 2).mean()),
                "heldout_mean_value_first_token": float(v_first.mean()),
                "heldout_mean_reward": float(r.mean()), "trunk_nll_base": nll_base,
                "trunk_nll": trunk_nll(base_path, critic, tok, held_demos),
                "trunk_relative_change_median": _median_relative_change(base_path, critic),
                "grading": _grading(cfg), "reward_model": rm.model_dump()}
    for p in trunk:
        p.requires_grad_(True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    critic.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "async_vapo_reward_critic.json").write_text(json.dumps(meta, indent=2) + "\n")
    (tmp / "BUILD_DONE").write_text("ok\n")
    try:
        tmp.rename(out)
    except OSError:  # another process finished the same deterministic build first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if progress:
        tqdm.write(f"reward-like critic: held-out MSE {meta['heldout_mse_last_token']:.3f} at the last token, "
                   f"{meta['heldout_mse_first_token']:.3f} at the first; trunk NLL {meta['trunk_nll']:.3f} "
                   f"(base {meta['trunk_nll_base']:.3f}) (built in {meta['seconds']:.0f}s)",
                   file=sys.stderr)  # stdout carries only the paths (`async-vapo make-base`)
    return out
