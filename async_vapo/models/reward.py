"""A reward-model-like critic for the embedded default (``model.critic_init = "reward"``).

VAPO's critic starts from a reward model (§3.1): a head trained to score *whole* responses, read at
the last token. At earlier tokens such a head has never been supervised, so its values there are
biased, and with λ < 1 that bias flows straight into GAE advantages. That is what value pretraining
is for. To give the toy the same starting point, this module builds an outcome reward model the way
one is built: from the base model, on labelled responses (the task's imperfect demonstrations, the
distribution the base model imitates, labelled by the verifier's rule), with a regression loss on the
verifier's reward **at the last response token only**. Cached beside the base model.
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

BUILD_VERSION = 1


def reward_critic_key(cfg: Config) -> str:
    spec = {"v": BUILD_VERSION, "base": base_model_key(cfg), "rm": cfg.reward_model.model_dump(),
            "reward": [cfg.verifier.reward_correct, cfg.verifier.reward_incorrect]}
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
    path = reward_critic_path(cfg)
    if (path / "BUILD_DONE").exists() or not build:
        return path
    if use_shipped("reward_critic", reward_critic_key(cfg), path):
        return path
    return make_reward_critic(cfg, base_path, path, progress=progress)


def _labelled(problems, tok, cfg: Config, rng: random.Random) -> tuple[list, list, list]:
    prompts, responses, rewards = [], [], []
    v = cfg.verifier
    for p in problems:
        text = arith.demonstration(p, rng, cfg.base_model.demo_step_error_rate)
        ok = check_answer(text, p.answer)[0]
        prompts.append(tok(cfg.task.prompt_template.format(prompt=p.prompt)).input_ids)
        responses.append(tok(text).input_ids + [tok.eos_token_id])
        rewards.append(v.reward_correct if ok else v.reward_incorrect)
    return prompts, responses, rewards


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
    opt = torch.optim.AdamW(critic.parameters(), lr=rm.lr, weight_decay=0.01)
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
        torch.nn.utils.clip_grad_norm_(critic.parameters(), 1.0)
        opt.step()
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        bar.set_postfix(mse=f"{ema:.3f}")
    # How the head scores held-out demonstrations: at the last token (what it was trained on) and at
    # the first response token (never supervised: the bias value pretraining has to remove).
    with torch.no_grad():
        prompts, responses, rewards = _labelled(held, tok, cfg, random.Random(rm.seed + 1))
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
                "heldout_mean_reward": float(r.mean()), "reward_model": rm.model_dump()}
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
                   f"{meta['heldout_mse_first_token']:.3f} at the first (built in {meta['seconds']:.0f}s)",
                   file=sys.stderr)  # stdout carries only the paths (`async-vapo make-base`)
    return out
