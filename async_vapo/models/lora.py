"""LoRA adapters on the policy (``model.lora``) and on the critic's trunk (``model.critic_lora``), built with ``peft``
through transformers' adapter integration.

:func:`add_lora` injects one adapter (peft's ``default``) into a plain causal LM in place: each target linear layer
becomes a peft ``LoraLayer`` (its frozen ``base_layer`` plus ``lora_A``/``lora_B``), the base weights are frozen
and only the adapter parameters require gradients. The model stays its transformers class, so everything that
drives a policy (``models.rl``'s forwards, FSDP2's per-layer sharding, DCP checkpoints) drives it unchanged; its
``state_dict`` keys carry peft's names (``...q_proj.base_layer.weight``, ``...q_proj.lora_A.default.weight``).

Invariants:

* A state dict of a LoRA policy maps to exactly two other forms, both pure functions here, used by the learner,
  the weight path and ``async-vapo export`` alike: :func:`adapter_tensors` (the adapter alone, under the names of a
  PEFT ``adapter_model.safetensors``: ``base_model.model.<module>.lora_A.weight``) and :func:`merged_state`
  (W + (alpha / r) B A per target layer under the plain model's names: what a model without LoRA loads).
* B starts at zero (peft's default initialisation), so a fresh adapter is the base model exactly.
* A LoRA critic (:func:`add_critic_lora`) trains its adapters and its whole value head (``score``, a design's extra
  layers included); its checkpoint's ``critic/`` is the merged critic (:func:`merged_state`: the head's tensors are
  not adapter targets and pass through), an ordinary critic directory.
* ``lora_dropout`` is 0 (``model.lora.dropout``): the learner's forwards run in eval mode anyway.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

ADAPTER = "default"  # peft's adapter name; the only adapter a policy has
PEFT_PREFIX = "base_model.model."  # the prefix of every key in a PEFT adapter_model.safetensors
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""


def peft_config(rank: int, alpha: float, target_modules: Iterable[str], dropout: float = 0.0):
    """The ``peft.LoraConfig`` of ``model.lora``."""
    from peft import LoraConfig

    if rank < 1:
        raise ValueError(f"a LoRA adapter needs rank >= 1, got {rank}")
    return LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(target_modules),
                      bias="none")


def config_of(cfg, model: str = "policy") -> object | None:
    """The ``peft.LoraConfig`` of a run's ``Config`` for ``model`` ("policy": ``model.lora``, "critic":
    ``model.critic_lora``); None when that LoRA is off."""
    lc = {"policy": cfg.model.lora, "critic": cfg.model.critic_lora}[model]
    return peft_config(lc.rank, lc.alpha, lc.target_modules, lc.dropout) if lc.enabled else None


def add_lora(model: torch.nn.Module, config) -> torch.nn.Module:
    """Inject the adapter of ``config`` (a ``peft.LoraConfig``) into ``model`` in place and return it: base weights
    frozen, adapter parameters trainable (B zero: the model's outputs are unchanged). A target that matches no
    layer of the model is an error (peft's)."""
    model.add_adapter(config, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return model


def add_critic_lora(critic: torch.nn.Module, config) -> torch.nn.Module:
    """:func:`add_lora` on a critic's trunk, its value head (``score``) trainable in full. The targets are the trunk's
    linear layers (the head's are not named like them); a target that names a head layer is refused, since the head
    is trained whole."""
    add_lora(critic, config)
    if any(".lora_" in n for n, _ in critic.score.named_parameters()):
        raise ValueError(f"model.critic_lora.target_modules {sorted(config.target_modules)} name a layer of the value "
                         "head, which is trained in full: target the trunk's layers only")
    critic.score.requires_grad_(True)
    return critic


def has_lora(model: torch.nn.Module) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def lora_config_of(model: torch.nn.Module):
    """The ``peft.LoraConfig`` the adapter of ``model`` was built with."""
    return model.peft_config[ADAPTER]


def scaling(config) -> float:
    """alpha / r: the factor of B A in each target layer (peft's plain LoRA; rsLoRA is not used)."""
    return config.lora_alpha / config.r


def _module_of(key: str, part: str) -> str | None:
    """``prefix`` of ``prefix.<part>.default.weight`` (or None if ``key`` is not such a key)."""
    tail = f".{part}.{ADAPTER}.weight"
    return key[: -len(tail)] if key.endswith(tail) else None


def adapter_tensors(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter of a LoRA policy's state dict under the names of a PEFT ``adapter_model.safetensors``
    (``base_model.model.<module>.lora_A.weight`` / ``lora_B``), in key order."""
    out = {}
    for k, v in state.items():
        for part in ("lora_A", "lora_B"):
            mod = _module_of(k, part)
            if mod is not None:
                out[f"{PEFT_PREFIX}{mod}.{part}.weight"] = v
    if not out:
        raise ValueError("the state dict holds no LoRA adapter (no '.lora_A.default.weight' keys)")
    return out


def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The plain model's state dict of a LoRA policy's: each target layer's W + ``scale`` B A (computed in float32,
    returned in W's dtype) under ``<module>.weight``, its bias under ``<module>.bias``; every other tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if ".lora_A." in k or ".lora_B." in k:
            continue
        if ".base_layer." in k:
            mod, leaf = k.split(".base_layer.")
            if leaf == "weight":
                a, b = state[f"{mod}.lora_A.{ADAPTER}.weight"], state[f"{mod}.lora_B.{ADAPTER}.weight"]
                v = (v.float() + scale * (b.float() @ a.float())).to(v.dtype)
            out[f"{mod}.{leaf}"] = v
        else:
            out[k] = v
    return out


def save_adapter(directory: str | Path, tensors: Mapping[str, torch.Tensor], config,
                 base_model_name_or_path: str | None = None) -> Path:
    """A PEFT adapter directory: ``adapter_config.json`` and ``adapter_model.safetensors`` (``tensors`` as
    :func:`adapter_tensors` names them), which ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    d = config.to_dict()
    d["base_model_name_or_path"] = base_model_name_or_path
    d["target_modules"] = sorted(d["target_modules"])
    d["peft_type"] = "LORA"
    (directory / ADAPTER_CONFIG).write_text(json.dumps(d, indent=2, sort_keys=True, default=str))
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    return directory


def load_adapter_config(directory: str | Path):
    """The ``peft.LoraConfig`` saved in a PEFT adapter directory (or in a checkpoint's ``hf_meta/policy``)."""
    from peft import LoraConfig

    return LoraConfig.from_pretrained(str(directory))


def load_adapter(model: torch.nn.Module, directory: str | Path, config) -> torch.nn.Module:
    """Set the adapter of ``model`` (:func:`add_lora` with ``config``) from the PEFT adapter directory ``directory``
    (``model.lora.init_from``: an exported adapter, a checkpoint's ``policy_adapter/``, or one trained elsewhere with
    peft). Its rank, alpha and target modules must be ``config``'s, and its tensors exactly the model's adapter's, by
    name and shape; anything else is a ``ValueError`` that says what differs, before any tensor is set."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / ADAPTER_CONFIG).is_file() or not (directory / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"{directory} is not a PEFT adapter directory ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    saved = load_adapter_config(directory)
    differ = [f"{name}: {a} there, {b} here" for name, a, b in (
        ("rank", saved.r, config.r), ("alpha", float(saved.lora_alpha), float(config.lora_alpha)),
        ("target_modules", sorted(saved.target_modules), sorted(config.target_modules))) if a != b]
    if differ:
        raise ValueError(f"the adapter in {directory} is not the one model.lora builds ({'; '.join(differ)})")
    tensors = load_file(str(directory / ADAPTER_WEIGHTS))
    own = {}  # PEFT name -> the model's parameter
    for k, p in model.named_parameters():
        for part in ("lora_A", "lora_B"):
            mod = _module_of(k, part)
            if mod is not None:
                own[f"{PEFT_PREFIX}{mod}.{part}.weight"] = p
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    wrong = sorted(k for k in set(own) & set(tensors) if tuple(own[k].shape) != tuple(tensors[k].shape))
    if missing or extra or wrong:
        raise ValueError(f"the adapter in {directory} does not fit this model: {len(missing)} tensors missing "
                         f"{missing[:2]}, {len(extra)} unknown {extra[:2]}, {len(wrong)} of another shape {wrong[:2]}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(tensors[k].to(p.dtype))
    return model


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves an adapter of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is above vLLM's largest max_lora_rank ({VLLM_LORA_RANKS[-1]})")
