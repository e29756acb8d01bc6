"""FSDP2 for the learner's policy and critic: each decoder layer its own ``fully_shard`` unit on a 1-D device
mesh over the data-parallel ranks, the embeddings, final norm and heads in the root unit.

Initialisation loads the weights once: rank 0 reads the checkpoint into host memory, every rank builds the
model on the meta device, shards it, allocates its shards with ``to_empty`` on its device and receives its
shards from rank 0 (``set_model_state_dict(..., broadcast_from_rank0=True)``). Buffers that are not in a
checkpoint (a rotary embedding's ``inv_freq``) hold garbage after ``to_empty``: they are recomputed from the
model's config.

Gradients are summed over ranks, not averaged (``gradient_divide_factor`` 1): every rank weights its
micro-batches by the whole mini-batch's loss normaliser (``learner.vapo``), so the sum is the one-process
gradient. Mixed precision is FSDP2's ``MixedPrecisionPolicy``: parameters all-gathered in ``model.dtype`` for
compute, gradients reduced and master weights and AdamW state kept in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of an HF causal-LM or token-classification model (``<backbone>.layers``)."""
    backbone = getattr(model, model.base_model_prefix, None)
    layers = getattr(backbone, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers at {model.base_model_prefix}.layers to shard")
    return list(layers)


def _reinit_nonpersistent_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Recompute buffers that no checkpoint holds (rotary ``inv_freq``) after ``to_empty``: each module that has
    one is rebuilt on the CPU from its config and its buffers copied."""
    for name, sub in model.named_modules():
        names = [b for b in sub._non_persistent_buffers_set if getattr(sub, b, None) is not None]
        if not names:
            continue
        if not hasattr(sub, "config"):
            raise ValueError(f"{name or 'model'} ({type(sub).__name__}) has non-persistent buffers {names} that "
                             "cannot be recomputed after meta-device initialisation (no config to rebuild from)")
        with torch.device("cpu"):
            fresh = type(sub)(sub.config)
        for b in names:
            setattr(sub, b, getattr(fresh, b).to(device))


def shard(model: torch.nn.Module, mesh, *, compute_dtype: torch.dtype, cpu_offload: bool = False) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks (see module docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, output_dtype=None)
    kw = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:  # pinned host memory only where there is a GPU to copy to
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def load_sharded(build: Callable[[], torch.nn.Module], load_full: Callable[[], torch.nn.Module], mesh,
                 device: torch.device, *, compute_dtype: torch.dtype, cpu_offload: bool = False,
                 activation_checkpointing: bool = False) -> torch.nn.Module:
    """A sharded model whose weights rank 0 loaded once (``load_full``, host memory) and broadcast.

    ``build()`` makes the model's modules (called under the meta device, on every rank)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = load_full().state_dict() if dist.get_rank() == 0 else {}
    with torch.device("meta"):
        model = build()
    model.eval()
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    shard(model, mesh, compute_dtype=compute_dtype, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else device)
    _reinit_nonpersistent_buffers(model, torch.device("cpu") if cpu_offload else device)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant, so it composes with FSDP2)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights in host memory on rank 0, ``{}`` on the others (a collective: every rank must
    call it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
