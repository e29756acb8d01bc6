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

No sharded model returns a view tensor that needs a gradient: FSDP2 hooks its pre-backward (the all-gather of the
root's weights for backward) on each such output, and an in-place op on a view would drop that hook (FSDP2 warns
"returned a view tensor" at every forward). A linear head with a bias folds its 3-D input through a 2-D matmul and
returns a view (the critic's ``score``: ``[B, S, 1]``); the root's forward hook replaces such outputs by copies.
Bias-free heads (the policies' ``lm_head``) return no view, so their logits are never copied.
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


def _copy_views(module: torch.nn.Module, args, output):
    """Forward hook of a sharded root, run before FSDP2's: outputs (a tensor, or a transformers ``ModelOutput``)
    that are views needing a gradient are replaced by copies (module docstring)."""
    def own(t):
        return t.clone() if isinstance(t, torch.Tensor) and t.requires_grad and t._base is not None else t

    if isinstance(output, dict):  # ModelOutput: item assignment sets the attribute too
        for k, v in list(output.items()):
            output[k] = own(v)
        return output
    return own(output)


def shard(model: torch.nn.Module, mesh, *, compute_dtype: torch.dtype, cpu_offload: bool = False) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; gradients summed over ranks; no view outputs (see module
    docstring)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, output_dtype=None)
    kw = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:  # pinned host memory only where there is a GPU to copy to
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    model.register_forward_hook(_copy_views, prepend=True)  # before FSDP2's post-forward hooks the outputs
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
    call it). What the shared-memory slot, the ZeroMQ fetch and the file ways need (a whole version in one
    place); a weight group can be streamed one gathered bucket at a time instead (``stream_sharded``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


# -- streaming a sharded policy to the engines' weight groups, one bucket gathered at a time -----------------------

def engine_meta(model: torch.nn.Module, dtype: torch.dtype) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, wire dtype, full shape) of every tensor the engines load, without gathering: the names and order of
    ``full_state_dict`` (the model's ``state_dict()``; a DTensor's ``shape`` is the global one), floating tensors
    in ``dtype`` as ``Precision.engine_state`` converts them. The same on every rank."""
    return [(n, dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for n, t in model.state_dict().items()]


class _Gather:
    """Every rank's walk over a bucket plan: per bucket, ``full_tensor()`` of each of its DTensors (a collective),
    cast to its wire dtype (and moved to host memory with ``host``); the bucket is released before the next is
    gathered unless the consumer keeps it. Counts the gathers and the bytes of gathered tensors alive at once
    (``peak_bytes``, from the tensors' lifetimes)."""

    def __init__(self, model: torch.nn.Module, buckets, *, host: bool = False):
        self.state = model.state_dict()  # DTensor shards: references, no gather
        self.buckets = buckets
        self.host = host
        self.gathers = 0
        self.live = 0
        self.peak_bytes = 0

    def _track(self, t: torch.Tensor) -> torch.Tensor:
        import weakref

        n = t.numel() * t.element_size()
        self.live += n
        self.peak_bytes = max(self.peak_bytes, self.live)
        weakref.finalize(t, self._freed, n)
        return t

    def _freed(self, n: int) -> None:
        self.live -= n

    def _one(self, name: str, dtype_name: str) -> torch.Tensor:
        t = self.state[name].detach()
        gathered = callable(getattr(t, "full_tensor", None))
        if gathered:
            self.gathers += 1
            t = t.full_tensor()
        dt = getattr(torch, dtype_name)
        # counted when it is new memory: gathered, converted or copied to the host (a plain host buffer in the wire
        # dtype is shared)
        new = gathered or t.dtype != dt or (self.host and t.device.type != "cpu")
        t = t.to(dt)
        if self.host:
            t = t.cpu()
        return self._track(t) if new else t

    def __iter__(self):
        for b in self.buckets:
            got = [(n, self._one(n, d)) for n, d in zip(b.names, b.dtype_names, strict=True)]
            for i in range(len(got)):
                item, got[i] = got[i], None  # the consumer holds the only reference: freed once it is packed
                yield item
                del item
            del got


def stream_sharded(model: torch.nn.Module, dtype: torch.dtype, groups=None, *, bucket_bytes: int,
                   timeout_s: float | None = None, keep: bool = False) -> dict:
    """Stream a sharded model's weights to the engines' weight groups (``async_vapo.weights.collective.EngineGroup``),
    one bucket gathered at a time, so no rank holds a whole extra copy of the model. A collective: every rank calls
    it; ``groups`` (rank 0's, in order), ``keep`` and ``bucket_bytes`` are rank 0's, sent to the others with one
    ``broadcast_object``.

    For each group, every rank walks the same bucket plan (``plan_buckets`` of ``engine_meta``: the names, order
    and dtypes of ``full_state_dict`` through ``Precision.engine_state``) and gathers each bucket's DTensors with
    ``full_tensor()``; rank 0 feeds them to the group's ``send``, which packs and broadcasts them, and they are
    dropped before the next bucket is gathered. Rank 0's gathered tensors alive at once: one bucket (beside the
    send's own packing buffers, two buckets for gloo, vLLM's for NCCL). Every rank
    gathers the whole plan once per group (the groups' sends are not interleaved: vLLM's NCCL engine cuts its own
    buckets from the whole stream).

    A send that fails or passes its deadline (``timeout_s`` per group, from its start) closes that group; rank 0
    then keeps gathering the rest of the plan without sending, so every rank makes the same ``full_tensor()``
    calls whatever happens to the engines. Any other error is raised on rank 0 after the walk completes.

    ``keep`` (with no groups): one walk, whose gathered tensors rank 0 keeps, in host memory, as ``"state"``: the
    whole version in the engines' dtype, in the names and order of ``full_state_dict`` (what
    ``Learner.policy_state`` returns), for the ways that need it in one place (the shared-memory slot, the ZeroMQ
    fetch). Only then does rank 0 hold a whole copy; the other ranks drop each bucket as always.
    ``publish_sharded`` chooses between the two per version.

    Returns ``{"results": {engine_id: seconds | exception}`` (rank 0's; ``{}`` elsewhere), ``"gathers"``: this
    rank's ``full_tensor()`` calls, ``"peak_bytes"``: the most gathered bytes this rank held at once,
    ``"bucket_bytes"``: the largest bucket of the plan, ``"walks"``: walks over the plan, and with ``keep``
    ``"state"`` (``{}`` on ranks > 0)``}``."""
    import time

    import torch.distributed as dist

    from async_vapo.learner.process_group import broadcast_object
    from async_vapo.weights.collective import EngineSyncFailed, EngineSyncTimeout, plan_buckets

    rank = dist.get_rank() if dist.is_initialized() else 0
    groups = list(groups or []) if rank == 0 else []
    n = len(groups)
    if rank == 0 and keep and n:
        raise ValueError("stream_sharded: keep gathers the version whole for its caller to publish; no groups")
    if dist.is_initialized() and dist.get_world_size() > 1:
        n, bucket_bytes, keep = broadcast_object((n, bucket_bytes, keep))
    buckets = plan_buckets(engine_meta(model, dtype), bucket_bytes)
    results: dict = {}
    state: dict[str, torch.Tensor] = {}
    gathers = peak = 0
    error: BaseException | None = None
    walks = 1 if keep else n
    for k in range(walks):
        walk = _Gather(model, buckets, host=keep and rank == 0)
        it = iter(walk)
        if rank == 0 and keep:
            for name, t in it:
                state[name] = t
        elif rank == 0:
            g = groups[k]
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                results[g.engine_id] = g.send(buckets, it, deadline=deadline)
            except (EngineSyncTimeout, EngineSyncFailed) as e:
                results[g.engine_id] = e
            except Exception as e:  # noqa: BLE001 - raised once the other ranks are through the walk too
                results[g.engine_id] = e
                error = error or e
        for item in it:  # the rest of the plan (all of it on ranks > 0): gathered, not sent
            del item  # freed before the next is gathered
        gathers += walk.gathers
        peak = max(peak, walk.peak_bytes)
    if error is not None:
        raise error
    out = {"results": results, "gathers": gathers, "peak_bytes": peak, "walks": walks,
           "bucket_bytes": max((b.nbytes for b in buckets), default=0)}
    if keep:
        out["state"] = state
    return out


def publish_sharded(model: torch.nn.Module, dtype: torch.dtype, sync=None, version: int = 0, min_version: int = -1,
                    *, again: bool = False) -> dict:
    """Publish a sharded policy's version to the engines without gathering it whole where no engine needs it so.
    A collective: every rank calls it, rank 0 with its ``WeightBroadcast`` (``sync``; None on the others).

    Rank 0 asks ``sync.stream_plan()`` which engines take the version over their weight groups and whether one
    needs it whole (its slot or its fetch), and tells the others (``stream_sharded``'s one ``broadcast_object``):

    * every engine streamed: rank 0 announces the version (its tag, no slot: ``WeightBroadcast.announce_unheld``)
      and every rank walks the bucket plan once per engine group, rank 0 sending each gathered bucket with the
      group's deadline (``cluster.weights.dist_timeout_s``); a group that fails or passes it is torn down and its
      engine rejoins as with an unsharded learner (``WeightBroadcast.streamed``). Rank 0 holds one bucket at a time.
    * some engine needs it whole, or no engine is known yet, or ``again`` (``WeightBroadcast.needs_whole``: an
      engine could not load a version that was streamed only): one walk, whose gathered buckets rank 0 keeps as
      the whole version, and ``sync.publish`` writes it to its slot, announces it and streams it from there to the
      engines that have groups, as for an unsharded learner. The slot must be complete before the announce (the
      engines on this host load it on the announce) and the announce comes before any send (an engine receives
      on it), so these groups are fed from the kept version, not from a second walk.

    Acks, rotation and the metrics are ``WeightBroadcast``'s, as for any version. Returns this rank's
    ``peak_bytes`` (the most gathered bytes it held at once), ``bucket_bytes`` (the plan's largest bucket),
    ``walks`` and ``gathers`` (``full_tensor()`` calls),
    and on rank 0 ``seconds`` (the whole publish), ``whole`` and ``streamed`` (the engines sent the version over
    their groups)."""
    import time

    import torch.distributed as dist

    t0 = time.perf_counter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    engines: list[str] = []
    whole, bucket_bytes, timeout_s, groups = True, 0, None, []
    if rank == 0:
        w = sync.ctx.cfg.cluster.weights
        bucket_bytes, timeout_s = w.dist_bucket_bytes, w.dist_timeout_s
        if not again:
            engines, whole = sync.stream_plan()
        if not whole:
            sync.announce_unheld(version, engine_meta(model, dtype), engines, min_version)
            groups = [sync.groups[e] for e in engines]
    got = stream_sharded(model, dtype, groups, bucket_bytes=bucket_bytes, timeout_s=timeout_s, keep=whole)
    out = {k: got[k] for k in ("peak_bytes", "bucket_bytes", "walks", "gathers")}
    if rank != 0:
        return out
    if whole:
        sync.publish(version, got.pop("state"), min_version, again=again)
        streamed = list(sync.latest.dist_engines)
    else:
        sync.streamed(version, got["results"])
        streamed = sorted(got["results"])
    return {**out, "seconds": time.perf_counter() - t0, "whole": whole, "streamed": streamed}
