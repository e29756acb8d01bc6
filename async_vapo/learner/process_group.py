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
import sys
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


def rank_by_node(node: int, environ: dict | None = None) -> int:
    """Make this torchrun rank's global rank ``node * LOCAL_WORLD_SIZE + LOCAL_RANK`` (``RANK`` in ``environ``,
    default ``os.environ``; ``GROUP_RANK`` keeps the agent's rendezvous rank) and return it.

    torchrun's c10d rendezvous numbers its agents in the order of their addresses and ignores ``--node-rank``;
    deploy/start_cluster.sh gives every learner agent its host's place among the learner hosts (``node``), so that
    rank 0, which does all of the learner's I/O, runs on the first learner host whatever the rendezvous decided. The
    result is a permutation of torchrun's ranks (every agent runs ``LOCAL_WORLD_SIZE`` ranks), and the process group
    still meets over torchrun's store (``MASTER_ADDR``/``MASTER_PORT``), which every rank joins as a client."""
    env = os.environ if environ is None else environ
    local, local_world, world = (int(env[k]) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE"))
    nodes, rest = divmod(world, local_world)
    if rest or not 0 <= node < nodes:
        raise RuntimeError(f"learner node rank {node} does not fit torchrun's world: {world} ranks of "
                           f"{local_world} per agent make {world / local_world:g} agents (node ranks 0..{nodes - 1})")
    rank = node * local_world + local
    env["RANK"] = str(rank)
    return rank


def gloo_interface_for(addr: str, environ: dict | None = None) -> str | None:
    """Point gloo at the network interface that holds ``addr`` (``GLOO_SOCKET_IFNAME`` in ``environ``, default
    ``os.environ``) unless it is set already, and return the interface (None: no interface here holds ``addr``).

    Gloo otherwise takes the address its host name resolves to, which on many machines (containers, and hosts whose
    /etc/hosts maps the name to 127.0.x.1) is a loopback address: the ranks on other hosts are then told to connect
    to 127.0.0.1 and the group never forms. deploy/start_cluster.sh gives each learner agent the address the other
    learner hosts reach it at (``--host-addr``: an address, or a host name as the hostfile gives it, resolved here)."""
    import socket

    import psutil

    env = os.environ if environ is None else environ
    if env.get("GLOO_SOCKET_IFNAME"):
        return env["GLOO_SOCKET_IFNAME"]
    try:
        addr = socket.gethostbyname(addr)
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == addr for a in addrs):
            env["GLOO_SOCKET_IFNAME"] = name
            return name
    return None


def die_with_agent(agent_pid: int) -> None:
    """Under torchrun on Linux: SIGKILL this rank when its agent (``agent_pid``, its parent) dies.

    torchrun starts every rank in a session of its own, so the ranks of an agent that was killed (by a supervisor
    after its stop grace, or SIGKILL) would otherwise run on outside the process group that a restart or
    deploy/stop_cluster.sh kills, holding their ports and GPUs. Exits at once when the agent is already gone."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) != 0:
        warnings.warn(f"prctl(PR_SET_PDEATHSIG) failed (errno {ctypes.get_errno()}): this rank outlives its agent",
                      stacklevel=2)
    elif os.getppid() != agent_pid:
        os._exit(1)


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
