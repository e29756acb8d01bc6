"""torch.distributed for the learner: the process group on the right device, the data-parallel world, and
the batch broadcast from rank 0.

A process group is always initialised: NCCL when CUDA is available, else gloo, with a timeout on every
collective (``learner.dist_timeout_s``), from torchrun's environment when present, else a world of one over a
loopback TCPStore. Each rank's device is ``cuda:LOCAL_RANK`` on GPUs (set as the current device before the
group is made, as NCCL needs), the CPU otherwise. Rank 0 does all I/O; every rank runs the same step loop on
the groups rank 0 broadcasts (``BroadcastSource`` in ``learner.loop``). With more than one rank the models are
sharded by FSDP2 (``learner.sharding``), which does the gradient reduction itself.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import warnings

import torch


def local_device() -> torch.device:
    """This rank's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} CUDA devices are visible")
        return torch.device("cuda", local)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The process-group backend of a device type: NCCL for CUDA, gloo for the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(timeout_s: float = 600.0) -> tuple[int, int]:
    """(rank, world size): torchrun's env:// when set, else a world of one over a loopback TCPStore. Sets this
    rank's CUDA device first on GPUs; every collective fails after ``timeout_s`` instead of hanging."""
    import torch.distributed as dist

    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
    else:
        store = dist.TCPStore("127.0.0.1", 0, 1, True)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
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


def broadcast_object(obj: object = None, src: int = 0) -> object:
    """``obj`` from rank ``src`` on every rank (pickled; what the others pass is ignored)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@contextlib.contextmanager
def single_process_checkpoint():
    """torch.distributed.checkpoint in one process (``no_dist=True``) warns on every call that it assumes so: it
    is the intent here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj``, in rank order (``[obj]`` in a world of one)."""
    import torch.distributed as dist

    world = data_parallel_world()[1]
    if world == 1:
        return [obj]
    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum_(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks, in place (no-op in a world of one)."""
    import torch.distributed as dist

    if data_parallel_world()[1] > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t
