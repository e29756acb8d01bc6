"""`async-vapo make-base`: build the embedded default's tiny base model.

A character tokenizer and a small Qwen2-architecture model are supervised on *imperfect*
demonstrations of the chain-arithmetic task (each step wrong with probability
``demo_step_error_rate``), so that the base model knows the format and how to compute, but samples
mistakes often enough that its held-out accuracy starts low and non-zero — room for RL to show.
Deterministic in ``base_model.seed``; built once into the cache and reused by later runs.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from pathlib import Path

import torch

from async_vapo.config import Config
from async_vapo.models.tiny import build_char_tokenizer, build_tiny_qwen2, save_hf
from async_vapo.tasks import arith, load_task

BUILD_VERSION = 1  # bump when the recipe changes, so cached models are rebuilt


def base_model_key(cfg: Config) -> str:
    task = {k: getattr(cfg.task, k) for k in ("seed", "min_ops", "max_ops", "num_train", "num_eval")}
    if cfg.task.labels:  # only when set, so that the unlabelled task's keys (and shipped builds) stay as they were
        task["labels"] = True
    # a setting left at None is not part of the key, so that keys made before it existed stay valid
    base = {k: v for k, v in cfg.base_model.model_dump().items() if not (k == "sft_min_ops" and v is None)}
    spec = {"v": BUILD_VERSION, "base": base, "task": task}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def base_model_path(cfg: Config) -> Path:
    return Path(cfg.model.cache_dir).expanduser() / f"tiny-base-{base_model_key(cfg)}"


def ensure_base_model(cfg: Config, *, progress: bool = True) -> Path:
    """The policy's starting checkpoint: ``model.path`` if set, else the (cached) embedded base model."""
    if cfg.model.path:
        path = Path(cfg.model.path).expanduser()
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"model.path {path} has no config.json (expected an HF model directory; a GGUF "
                                    f"file becomes one with `async-vapo import-gguf FILE {path}`)")
        return path
    if cfg.task.kind != "arith":
        raise ValueError("the embedded base model is built for task.kind='arith'; set model.path for other tasks")
    path = base_model_path(cfg)
    if (path / "BUILD_DONE").exists():
        return path
    if use_shipped("base", base_model_key(cfg), path):
        return path
    return make_base(cfg, path, progress=progress)


def use_shipped(kind: str, key: str, path: Path) -> bool:
    """Install the shipped model of ``kind`` built under ``key`` at ``path`` (``async_vapo.models.ship``) and
    say so on stderr; False when none ships for the key or the shipped copy is damaged (then it says why)."""
    import sys

    from async_vapo.models.ship import ShippedModelError, install_shipped

    what = {"base": "base model", "reward_critic": "reward-like critic"}[kind]
    try:
        if not install_shipped(kind, key, path):
            print(f"[make-base] no shipped {what} for this config (key {key}): building it into {path}",
                  file=sys.stderr)
            return False
    except ShippedModelError as e:
        print(f"[make-base] not using the shipped {what}: {e}; building it instead", file=sys.stderr)
        return False
    print(f"[make-base] {what}: the shipped build (SHA-256 checked) copied to {path}", file=sys.stderr)
    return True


def sft_pools(cfg: Config) -> tuple[list, list]:
    """The demonstrations' problems: the task's training split, and (``base_model.sft_min_ops``) chains of
    ``sft_min_ops .. task.min_ops - 1`` operations, shorter than any held-out problem, so that none is one."""
    train, _ = load_task(cfg)
    bm, t = cfg.base_model, cfg.task
    if bm.sft_min_ops is None or bm.sft_min_ops >= t.min_ops:
        return train, []
    return train, arith.make_splits(min(t.num_train, 4000), 0, t.seed + 1, bm.sft_min_ops, t.min_ops - 1,
                                    t.labels)[0]


def make_base(cfg: Config, out: Path, *, progress: bool = True) -> Path:
    bm = cfg.base_model
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    torch.manual_seed(bm.seed)
    rng = random.Random(bm.seed)
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(
        len(tok), hidden_size=bm.hidden_size, num_layers=bm.num_layers, num_heads=bm.num_heads,
        num_kv_heads=bm.num_kv_heads, intermediate_size=bm.intermediate_size,
        max_position_embeddings=bm.max_position_embeddings, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id, seed=bm.seed)
    train, short = sft_pools(cfg)
    prompt_ids = {p.uid: tok(cfg.task.prompt_template.format(prompt=p.prompt)).input_ids for p in train + short}
    opt = torch.optim.AdamW(model.parameters(), lr=bm.sft_lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, bm.sft_steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return bm.sft_lr * (step + 1) / warmup
        frac = (step - warmup) / max(1, bm.sft_steps - warmup)
        return bm.sft_lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    from tqdm import tqdm

    model.train()
    t0 = time.perf_counter()
    bar = tqdm(range(bm.sft_steps), desc="make-base (SFT on imperfect demos)", disable=not progress,
               dynamic_ncols=True)
    ema = None
    for step in bar:
        batch = rng.sample(train, bm.sft_batch_size) if len(train) >= bm.sft_batch_size else train
        if short:  # half of the batch from the shorter chains
            batch = batch[: len(batch) - len(batch) // 2] + rng.sample(short, min(len(short), len(batch) // 2))
        seqs, loss_masks = [], []
        for p in batch:
            resp = tok(arith.demonstration(p, rng, bm.demo_step_error_rate)).input_ids + [tok.eos_token_id]
            seqs.append(prompt_ids[p.uid] + resp)
            loss_masks.append([0] * len(prompt_ids[p.uid]) + [1] * len(resp))
        width = max(map(len, seqs))
        ids = torch.full((len(seqs), width), tok.pad_token_id, dtype=torch.long)
        lm = torch.zeros((len(seqs), width))
        for i, (s, m) in enumerate(zip(seqs, loss_masks, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            lm[i, : len(m)] = torch.tensor(m, dtype=torch.float)
        attn = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view_as(lm[:, 1:])
        loss = (nll * lm[:, 1:]).sum() / lm[:, 1:].sum()
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = float(loss.detach()) if ema is None else 0.98 * ema + 0.02 * float(loss.detach())
        if step % 20 == 0:
            bar.set_postfix(loss=f"{ema:.3f}")
    model.eval()
    tmp = out.with_name(out.name + ".tmp")
    save_hf(model, tok, tmp)
    meta = {"key": base_model_key(cfg), "params": sum(p.numel() for p in model.parameters()),
            "sft_seconds": round(time.perf_counter() - t0, 1), "final_sft_loss": ema,
            "base_model": bm.model_dump()}
    (tmp / "async_vapo_base.json").write_text(json.dumps(meta, indent=2) + "\n")
    (tmp / "BUILD_DONE").write_text("ok\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
