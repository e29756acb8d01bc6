"""HF directories from learner checkpoints: ``async-vapo export CKPT OUT [--model policy|critic] [--dtype ...]``.

A checkpoint (``Learner.save``) keeps the weights and optimiser states as torch.distributed.checkpoint shards in
``dcp/``, however many ranks wrote them, and the small files that make an HF directory (config, generation
config, tokenizer) in ``hf_meta/<model>/``. Export builds the model from that config on the host, reads its
weights from the shards (DCP reshards to one process) and writes ``save_pretrained`` output with the tokenizer
files beside it: a directory that transformers and vLLM load. A critic of another design than the linear head
(``model.critic_head_layers``, ``model.critic_logprobs``) is rebuilt with it from its config, and its export loads
again with ``models.rl.load_critic``.

A policy trained with LoRA (``model.lora``: its adapter's config in ``hf_meta/policy/adapter_config.json``) is
rebuilt with its adapter; export writes the adapter alone as a PEFT adapter directory (``adapter_config.json``,
``adapter_model.safetensors``: what ``peft.PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load over the
base model), or with ``merge`` the merged weights (W + (alpha / r) B A) as an ordinary HF directory.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_NOT_COPIED = {"model.safetensors.index.json", "BUILD_DONE", "adapter_config.json"}  # an adapter is no HF model


def write_meta(model: torch.nn.Module, source: str | Path | None, dest: Path) -> None:
    """The small files of an HF directory: the model's config, and the source directory's other non-weight files
    (tokenizer, generation config)."""
    dest.mkdir(parents=True, exist_ok=True)
    if source is not None and Path(source).is_dir():
        for f in Path(source).iterdir():
            if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and f.name not in _NOT_COPIED:
                shutil.copy2(f, dest / f.name)
    model.config.save_pretrained(str(dest))  # after the copy: the critic's config is not its source's


def export(ckpt: str | Path, out: str | Path, model: str = "policy", dtype: str = "float32", merge: bool = False
           ) -> Path:
    """Write ``model`` (policy or critic) of checkpoint ``ckpt`` as an HF directory ``out``; a LoRA policy as a PEFT
    adapter directory, or with ``merge`` as the merged HF model (``merge`` changes nothing for a model without
    LoRA). A LoRA critic (``model.critic_lora``) is always merged: its value head is trained in full, not an
    adapter."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    from async_vapo.learner.precision import DTYPES
    from async_vapo.learner.process_group import single_process_checkpoint
    from async_vapo.models import lora
    from async_vapo.models.rl import DESIGN_KEY, CriticDesign, apply_critic_design

    ckpt, out = Path(ckpt), Path(out)
    meta = ckpt / "hf_meta" / model
    if model not in ("policy", "critic"):
        raise ValueError(f"model must be 'policy' or 'critic', got {model!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if not (ckpt / "dcp").is_dir() or not (meta / "config.json").is_file():
        raise FileNotFoundError(f"{ckpt} is not a learner checkpoint with a {model} "
                                f"(needs dcp/ and {meta}/config.json)")
    config = AutoConfig.from_pretrained(str(meta))
    auto = AutoModelForCausalLM if model == "policy" else AutoModelForTokenClassification
    design = CriticDesign.from_dict(getattr(config, DESIGN_KEY, None))  # a critic's value head (models.rl)
    if hasattr(config, DESIGN_KEY):
        delattr(config, DESIGN_KEY)
    net = auto.from_config(config, dtype=torch.float32).eval()
    if model == "critic":
        apply_critic_design(net, design)
    adapter = lora.load_adapter_config(meta) if (meta / lora.ADAPTER_CONFIG).is_file() else None
    if adapter is not None:
        lora.add_lora(net, adapter)
    state = {model: get_model_state_dict(net)}
    with single_process_checkpoint():
        dcp.load(state, checkpoint_id=str(ckpt / "dcp"), no_dist=True)
    set_model_state_dict(net, state[model])
    if out.exists():
        shutil.rmtree(out)
    if adapter is not None:
        trained = {k: v.to(DTYPES[dtype]) for k, v in net.state_dict().items()}
        if not merge and model == "policy":
            return lora.save_adapter(out, lora.adapter_tensors(trained), adapter, adapter.base_model_name_or_path)
        net = auto.from_config(config, dtype=torch.float32).eval()
        if model == "critic":
            apply_critic_design(net, design)
        net.load_state_dict(lora.merged_state(state[model], lora.scaling(adapter)))
    net = net.to(DTYPES[dtype])
    write_meta(net, meta, out)
    net.save_pretrained(str(out), safe_serialization=True)
    return out
