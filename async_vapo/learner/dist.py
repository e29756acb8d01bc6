"""torch.distributed for the learner: the process group, the data-parallel world, gradient all-reduce and
the batch broadcast from rank 0.

A process group is always initialised (gloo on CPU, NCCL on GPUs): from torchrun's environment when
present, else a world of one over a loopback TCPStore. Rank 0 does all I/O; every rank runs the same step
loop on the groups rank 0 broadcasts (``BroadcastSource`` in ``learner.loop``).
"""

from __future__ import annotations

import os

import torch


def init_process_group() -> tuple[int, int]:
    """(rank, world size): torchrun's env:// when set, else a world of one over a loopback TCPStore."""
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend)
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_world() -> tuple[int, int]:
    """(rank, world size) of the initialised torch.distributed group, (0, 1) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def allreduce_gradients(model: torch.nn.Module) -> None:
    """Sum every parameter's gradient over the data-parallel ranks (one flat all-reduce; a rank that had no
    micro-batch contributes zeros). No-op in a world of one."""
    import torch.distributed as dist

    if data_parallel_world()[1] == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset: offset + n].view_as(p.grad))
        offset += n


def broadcast_object(obj: object = None, src: int = 0) -> object:
    """``obj`` from rank ``src`` on every rank (pickled; what the others pass is ignored)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
