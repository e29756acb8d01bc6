"""Versions streamed from the learner into the engines over torch.distributed, through vLLM's weight-transfer API.

Two backends (``cluster.weights.dist_backend``; ``engine_backend`` and ``group_backend`` pick them):

* **gloo** (the CPU, and any engine that asks for it): the engine's end is a weight-transfer engine registered with
  vLLM's ``WeightTransferEngineFactory`` under ``GLOO_BACKEND`` (``register()``, run in every vLLM worker when
  ``async_vapo.rollout.worker_ext`` is imported). vLLM drives it: ``init_weight_transfer_engine`` joins the group,
  ``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` receive one version and load it through
  vLLM's layerwise reload (the same lifecycle as vLLM's own NCCL engine), with the engine's ``model.load_weights``
  per bucket.
* **nccl** (learner and engine both on CUDA): the engine's end is vLLM's own ``NCCLWeightTransferEngine`` in its
  packed mode (buckets of ``bucket_bytes``, two in flight), registered as ``NCCL_BACKEND`` with one addition, a
  watchdog that aborts the communicator when a receive outlives the group's ``timeout_s`` (vLLM's has none). The
  learner's end forms the group as vLLM's trainer does (a ``StatelessProcessGroup`` rendezvous, a
  ``PyNcclCommunicator``) and sends with vLLM's ``packed_nccl_broadcast_producer``, so both ends cut the stream into
  the same buckets; the learner's tensors (on the host) are copied to its CUDA device one at a time as they are
  packed. Not run here (no GPU): ``deploy/device_check.sh`` measures a bare NCCL broadcast on a GPU machine.

The learner's end is ``EngineGroup``: one group per engine, the learner as rank 0 and that engine's workers
after it, each group on a TCPStore of its own. One group per engine because a collective with a member that died
hangs until its timeout and leaves the group unusable: a failed engine's group is torn down (``close``) and an
engine that comes back gets a new group (a new store, a new key prefix), so the others never wait on it.

Invariants:

* Parameters go in buckets of at most ``bucket_bytes`` (a parameter larger than that is a bucket of its own),
  each gathered just before it is sent (``full_tensor()`` on an FSDP shard, vLLM's ``materialize_full_tensor``), so
  no process holds a second copy of the model: the learner one bucket, each worker one bucket. A sharded
  (FSDP2) learner's publish loop streams with ``learner.sharding.publish_sharded`` / ``stream_sharded``: every rank
  walks the same bucket plan and joins each ``full_tensor()``, rank 0 sends. When every engine takes the version
  over its group, no slot is written and no rank holds the whole version; when one needs the slot or the fetch,
  rank 0 builds the whole version from that walk's buckets (``WeightBroadcast.stream_plan``).
* A sync has a deadline: every gloo operation of a group times out after ``timeout_s`` and the whole send checks
  the deadline between buckets; past it ``EngineSyncTimeout`` is raised and the group is closed. NCCL operations
  have no timeout of their own: a watchdog aborts the communicator (``ncclCommAbort``) at the deadline, on the
  learner's side and on the engine's. Nothing waits forever on an engine that never answers.
* The version's metadata (names, dtypes, shapes, bucket bounds) goes to the engine on the control plane (the
  ``update_weights`` call); the bytes go over the group. Version tags, acks and rotation stay on ZeroMQ
  (``async_vapo.weights.sync``).
* An engine whose receive failed part-way holds a mix of two versions: it must load a whole version another way
  (the shared-memory slot or a ZeroMQ fetch) before it serves again.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

GLOO_BACKEND = "async_vapo_gloo"
"""Name of the gloo engine in vLLM's WeightTransferEngineFactory."""
NCCL_BACKEND = "async_vapo_nccl"
"""Name of vLLM's NCCL engine with a receive watchdog in vLLM's WeightTransferEngineFactory."""
VLLM_BACKENDS = {"gloo": GLOO_BACKEND, "nccl": NCCL_BACKEND}
"""Our backend names -> the name the engine is created with (``weight_transfer_config``)."""
NCCL_BUFFERS = 2
"""Packed NCCL buckets in flight (vLLM's default): the next is packed while the previous is broadcast."""
DEFAULT_BUCKET_BYTES = 16 << 20
"""Bucket size: the engine receives the next bucket while it loads one, so smaller buckets overlap more. At 30 M
parameters on this CPU, 16 MiB (8 buckets) pushed in 0.111 s against 0.188 s with 64 MiB (2 buckets)."""


def engine_backend(setting: str, cuda: bool) -> str:
    """The backend an engine is created with (it joins groups of that backend only): ``setting`` is
    ``cluster.weights.dist_backend``; "auto" is NCCL when the engine's workers are on CUDA, else gloo."""
    if setting == "auto":
        return "nccl" if cuda else "gloo"
    if setting == "nccl" and not cuda:
        raise ValueError('cluster.weights.dist_backend = "nccl" needs the engine on a CUDA device and this one has '
                         'none; use "gloo" or "auto"')
    if setting not in VLLM_BACKENDS:
        raise ValueError(f"unknown cluster.weights.dist_backend {setting!r} (auto, gloo, nccl)")
    return setting


def check_learner_backend(setting: str, device: str) -> None:
    """A config error at the learner's start: NCCL asked for, the learner not on CUDA."""
    if setting == "nccl" and device != "cuda":
        raise ValueError(f'cluster.weights.dist_backend = "nccl" needs the learner on a CUDA device; it is on '
                         f'{device} (use "gloo" or "auto")')


def group_backend(engine: str, learner_device: str) -> str:
    """The group the learner makes for an engine created with backend ``engine`` ("gloo" / "nccl"): gloo stays
    gloo whatever the learner's device (CUDA tensors are packed into host buckets); NCCL needs the learner on CUDA
    too. Raises ValueError (the engine then gets no group and loads its slot or fetches it)."""
    if engine == "gloo":
        return "gloo"
    if engine == "nccl":
        if learner_device != "cuda":
            raise ValueError(f"the engine takes weights over NCCL and the learner is on {learner_device}: no group "
                             '(cluster.weights.dist_backend = "gloo" makes both ends use gloo)')
        return "nccl"
    raise ValueError(f"unknown weight-transfer backend {engine!r} (gloo, nccl)")


def engine_init_info(offer: dict[str, Any], backend: str, bucket_bytes: int) -> dict[str, Any]:
    """What the engine passes to vLLM's ``init_weight_transfer_engine`` for a group offer (``WeightsGroupOffer``'s
    fields): our gloo engine's fields, or vLLM's NCCL init info (packed, buckets of ``bucket_bytes``)."""
    if backend == "gloo":
        return {k: offer[k] for k in ("master_addr", "master_port", "world_size", "prefix", "timeout_s")}
    if backend == "nccl":
        return {"master_address": offer["master_addr"], "master_port": offer["master_port"],
                "world_size": offer["world_size"], "rank_offset": 1, "packed": True,
                "packed_buffer_size_bytes": bucket_bytes, "packed_num_buffers": NCCL_BUFFERS,
                "timeout_s": offer["timeout_s"]}
    raise ValueError(f"unknown weight-transfer backend {backend!r} (gloo, nccl)")


class EngineSyncTimeout(TimeoutError):
    """An engine did not join or receive within the sync's deadline; its group was torn down."""


class EngineSyncFailed(RuntimeError):
    """An engine's group broke during a sync (the engine died); its group was torn down."""


def _materialize(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)  # an FSDP shard (DTensor): gathered here, one tensor at a time
    return full() if callable(full) else t


@dataclass(frozen=True)
class Bucket:
    """Tensors sent in one broadcast: their names, dtypes, shapes, and the flat buffer's length in bytes."""
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    nbytes: int


def plan_buckets(meta: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes`` (an oversized tensor alone)."""
    out: list[Bucket] = []
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[list[int]] = []
    size = 0
    for name, dtype, shape in meta:
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        if names and size + n > bucket_bytes:
            out.append(Bucket(names, dtypes, shapes, size))
            names, dtypes, shapes, size = [], [], [], 0
        names.append(name)
        dtypes.append(str(dtype).removeprefix("torch."))
        shapes.append(list(shape))
        size += n
    if names:
        out.append(Bucket(names, dtypes, shapes, size))
    return out


def _views(flat: torch.Tensor, b: Bucket) -> Iterator[tuple[str, torch.Tensor]]:
    off = 0
    for name, dtype_name, shape in zip(b.names, b.dtype_names, b.shapes, strict=True):
        dt = getattr(torch, dtype_name)
        n = int(torch.Size(shape).numel()) * dt.itemsize
        yield name, flat[off: off + n].view(dt).view(shape)
        off += n


# -- the engine's end (runs inside vLLM's workers) ------------------------------------------------------------------

def _weight_transfer_base():
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    return WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo


def register() -> None:
    """Register our engines with vLLM (idempotent); the worker extension's import runs it in every worker."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    for name, cls in ((GLOO_BACKEND, "GlooWeightTransferEngine"), (NCCL_BACKEND, "NcclWeightTransferEngine")):
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, __name__, cls)


def __getattr__(name: str):
    # the vLLM-facing classes are built on first use, so importing this module does not import vLLM
    if name in ("GlooWeightTransferEngine", "GlooInitInfo", "GlooUpdateInfo"):
        _build_engine_classes()
        return globals()[name]
    if name in ("NcclWeightTransferEngine", "NcclInitInfo"):
        _build_nccl_classes()
        return globals()[name]
    raise AttributeError(name)


class _Watchdog:
    """Calls ``abort`` unless stopped within ``seconds`` (NCCL calls have no timeout of their own)."""

    def __init__(self, seconds: float, abort):
        self.fired = False

        def fire():
            self.fired = True
            abort()

        self._timer = threading.Timer(max(0.0, seconds), fire)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        self._timer.cancel()


def _build_nccl_classes() -> None:
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    @dataclass(kw_only=True)
    class NcclInitInfo(NCCLWeightTransferInitInfo):
        timeout_s: float = 0.0
        """A receive still running after this many seconds aborts the communicator (0: no limit)."""

    class NcclWeightTransferEngine(NCCLWeightTransferEngine):
        """vLLM's NCCL engine (packed buckets, layerwise reload) with a watchdog on each receive: a learner that
        died mid-broadcast costs the engine ``timeout_s``, then the receive fails and the engine loads its
        version another way (its group is gone; it asks for a new one)."""

        init_info_cls = NcclInitInfo
        supports_draft_weight_update = False

        def init_transfer_engine(self, init_info) -> None:
            self.shutdown()
            self.timeout_s = init_info.timeout_s
            super().init_transfer_engine(init_info)

        def receive_weights(self, update_info) -> None:
            limit = getattr(self, "timeout_s", 0.0)
            dog = _Watchdog(limit, self.shutdown) if limit > 0 else None
            try:
                super().receive_weights(update_info)
                torch.accelerator.synchronize()
            finally:
                if dog is not None:
                    dog.stop()
            if dog is not None and dog.fired:
                raise TimeoutError(f"NCCL receive ran past {limit:g} s: communicator aborted")

    g = globals()
    g["NcclInitInfo"], g["NcclWeightTransferEngine"] = NcclInitInfo, NcclWeightTransferEngine


def _build_engine_classes() -> None:
    Engine, InitBase, UpdateBase = _weight_transfer_base()

    @dataclass
    class GlooInitInfo(InitBase):
        master_addr: str
        master_port: int
        world_size: int
        prefix: str
        timeout_s: float
        rank_offset: int = 1

    @dataclass
    class GlooUpdateInfo(UpdateBase):
        buckets: list[dict[str, Any]] = field(default_factory=list)
        version: int = -1

    class GlooWeightTransferEngine(Engine):
        """vLLM worker side: joins the learner's gloo group for this engine and receives versions in buckets."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.group = None
            self.store = None
            self.stats: dict[str, float] = {}
            """Seconds of the last version by stage: start_s and finish_s (vLLM's layerwise reload set-up and
            finalisation), recv_s (waiting in broadcasts), load_s (``model.load_weights`` per bucket)."""

        def init_transfer_engine(self, init_info) -> None:
            import torch.distributed as dist

            self.shutdown()
            timeout = timedelta(seconds=init_info.timeout_s)
            self.store = dist.TCPStore(init_info.master_addr, init_info.master_port, init_info.world_size,
                                       is_master=False, timeout=timeout)
            rank = init_info.rank_offset + self.parallel_config.rank
            self.group = dist.ProcessGroupGloo(dist.PrefixStore(init_info.prefix, self.store), rank,
                                               init_info.world_size, timeout)

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            t0 = time.perf_counter()
            initialize_layerwise_reload(self.model)
            self.stats = {"start_s": time.perf_counter() - t0, "recv_s": 0.0, "load_s": 0.0, "finish_s": 0.0,
                          "buckets": 0}

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            t0 = time.perf_counter()
            finalize_layerwise_reload(self.model, self.model_config)
            self.stats["finish_s"] = time.perf_counter() - t0

        def receive_weights(self, update_info) -> None:
            if self.group is None:
                raise RuntimeError("update_weights before init_weight_transfer_engine: no gloo group")
            buckets = [Bucket(**spec) for spec in update_info.buckets]

            def post(b: Bucket):  # the receive of a bucket, in flight on gloo's thread
                flat = torch.empty(b.nbytes, dtype=torch.uint8)
                return flat, self.group.broadcast(flat, 0)

            nxt = post(buckets[0]) if buckets else None
            for i, b in enumerate(buckets):
                t0 = time.perf_counter()
                flat, work = nxt
                work.wait()
                # The next bucket is received while this one loads, so the sender never waits on vLLM's load.
                nxt = post(buckets[i + 1]) if i + 1 < len(buckets) else None
                t1 = time.perf_counter()
                self.model.load_weights(list(_views(flat, b)))
                del flat
                self.stats["recv_s"] += t1 - t0
                self.stats["load_s"] += time.perf_counter() - t1
                self.stats["buckets"] += 1

        def update_weights(self, update_info: dict[str, Any]) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # CPU tensors: nothing to synchronise

        def shutdown(self) -> None:
            self.group = None  # gloo closes its pairs when the group is freed
            self.store = None

    g = globals()
    g["GlooInitInfo"], g["GlooUpdateInfo"], g["GlooWeightTransferEngine"] = (
        GlooInitInfo, GlooUpdateInfo, GlooWeightTransferEngine)


# -- the learner's end ----------------------------------------------------------------------------------------------

class EngineGroup:
    """The learner's end of one engine's group (rank 0; the engine's ``workers`` after it).

    ``init_info`` is what the engine needs to join (``engine_init_info`` turns it into vLLM's
    ``init_weight_transfer_engine`` argument); ``connect`` then forms the group (both sides must be in it at once;
    the learner waits ``join_timeout_s``, default ``timeout_s``, e.g. in a thread while the engine finishes what it
    is generating); ``send`` streams one version, every broadcast within ``timeout_s``; ``close`` tears the group
    down. A group that failed once is closed and never used again.

    ``backend`` "gloo" (default) or "nccl" (``device``: the learner's CUDA device; the group's rendezvous is vLLM's
    ``StatelessProcessGroup`` on a socket this group holds from the start, so the port cannot be taken meanwhile).
    """

    def __init__(self, engine_id: str, *, workers: int = 1, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, timeout_s: float = 60.0, join_timeout_s: float | None = None,
                 backend: str = "gloo", device: torch.device | str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        import torch.distributed as dist

        if backend not in VLLM_BACKENDS:
            raise ValueError(f"unknown weight-transfer backend {backend!r} (gloo, nccl)")
        self.engine_id, self.world_size, self.timeout_s = engine_id, workers + 1, timeout_s
        self.backend, self.bucket_bytes = backend, bucket_bytes
        self.device = torch.device(device or ("cuda" if backend == "nccl" else "cpu"))
        self.join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        self._join_timeout = timedelta(seconds=self.join_timeout_s)
        self.bind_host = bind_host
        self.store = self._listen = None
        if backend == "gloo":
            self.store = dist.TCPStore(bind_host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                       timeout=self._join_timeout)
            port = self.store.port
        else:
            self._listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listen.bind((bind_host, 0))
            self._listen.listen()
            port = self._listen.getsockname()[1]
        self.prefix = f"{engine_id}/{uuid.uuid4().hex}"  # a rejoining engine never meets an old group's keys
        self.init_info = {"master_addr": advertise_host or bind_host, "master_port": port,
                          "world_size": self.world_size, "prefix": self.prefix, "timeout_s": timeout_s}
        self.group = None
        self.closed = False

    def connect(self) -> None:
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError(f"{self.engine_id}: this group was torn down; make a new EngineGroup")
        try:
            if self.backend == "gloo":
                group = dist.ProcessGroupGloo(dist.PrefixStore(self.prefix, self.store), 0, self.world_size,
                                              self._join_timeout)
                group.set_timeout(self._timeout)  # each broadcast from now on
            else:
                group = self._connect_nccl()
            self.group = group
        except Exception as e:  # the store's wait for the engine's workers ran out
            self.close()
            raise EngineSyncTimeout(
                f"{self.engine_id} did not join its group within {self.join_timeout_s:g} s: {e}") from e

    def _connect_nccl(self):
        # As vLLM's trainer (nccl_common.trainer_init), with our join timeout and the socket bound in __init__.
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        listen, self._listen = self._listen, None
        pg = StatelessProcessGroup.create(self.bind_host, listen.getsockname()[1], 0, self.world_size,
                                          store_timeout=max(1, round(self.join_timeout_s)), listen_socket=listen)
        self.store = pg.store
        with unpinned_nccl_env():  # the store's wait above bounds the join; ncclCommInitRank follows at once
            return PyNcclCommunicator(pg, device=self.device)

    def send(self, buckets: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]], *,
             deadline: float | None = None) -> float:
        """Stream one version: ``tensors`` in ``buckets``' order, each converted to its bucket dtype, one bucket
        packed and broadcast at a time. Returns seconds spent; raises EngineSyncTimeout / EngineSyncFailed (the
        group is then closed)."""
        if self.group is None:
            self.connect()
        if self.backend == "nccl":
            return self._send_nccl(buckets, tensors, deadline)
        t0 = time.perf_counter()
        it = iter(tensors)
        # Two buffers: the next bucket is packed (and its shards gathered) while the previous one is in flight.
        size = max((b.nbytes for b in buckets), default=0)
        flats = [torch.empty(size, dtype=torch.uint8) for _ in range(min(2, len(buckets)))]
        works: list = [None] * len(flats)
        try:
            for i, b in enumerate(buckets):
                if deadline is not None and time.monotonic() > deadline:
                    raise EngineSyncTimeout(f"{self.engine_id}: sync deadline passed")
                k = i % len(flats)
                if works[k] is not None:
                    works[k].wait()  # this buffer's previous bucket has gone
                part = flats[k][: b.nbytes]
                for (name, dst) in _views(part, b):
                    got, src = next(it)
                    if got != name:
                        raise ValueError(f"tensor {got!r} came where the bucket plan has {name!r}")
                    dst.copy_(_materialize(src).detach().reshape(dst.shape))
                    del src  # packed: a gathered tensor is freed before the next is gathered
                works[k] = self.group.broadcast(part, 0)
            for w in works:
                if w is not None:
                    w.wait()
        except EngineSyncTimeout:
            self.close()
            raise
        except ValueError:
            raise
        except Exception as e:
            self.close()
            kind = EngineSyncTimeout if "timed out" in str(e).lower() else EngineSyncFailed
            raise kind(f"{self.engine_id}: broadcast failed: {e}") from e
        return time.perf_counter() - t0

    def _send_nccl(self, buckets: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]],
                   deadline: float | None) -> float:
        """vLLM's packed producer over the communicator, fed one tensor at a time (gathered, converted to its wire
        dtype, copied to the device); a watchdog aborts the communicator at the deadline."""
        from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer

        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        plan = [(n, getattr(torch, d)) for b in buckets for n, d in zip(b.names, b.dtype_names, strict=True)]
        group = self.group

        def items():
            it = iter(tensors)
            for name, dtype in plan:
                if time.monotonic() > deadline:
                    raise EngineSyncTimeout(f"{self.engine_id}: sync deadline passed")
                got, src = next(it)
                if got != name:
                    raise ValueError(f"tensor {got!r} came where the bucket plan has {name!r}")
                yield name, _materialize(src).detach().to(device=self.device, dtype=dtype)

        dog = _Watchdog(deadline - time.monotonic(), group.destroy)
        try:
            with torch.cuda.device(self.device):
                packed_nccl_broadcast_producer(items(), group, 0, lambda item: item[1],
                                               buffer_size_bytes=self.bucket_bytes, num_buffers=NCCL_BUFFERS)
        except ValueError:
            dog.stop()
            self.close()
            raise
        except EngineSyncTimeout:
            dog.stop()
            self.close()
            raise
        except Exception as e:
            dog.stop()
            self.close()
            kind = EngineSyncTimeout if dog.fired else EngineSyncFailed
            raise kind(f"{self.engine_id}: NCCL broadcast failed: {e}") from e
        dog.stop()
        if dog.fired:  # aborted while the last buckets drained: what the engine got is not a whole version
            self.close()
            raise EngineSyncTimeout(f"{self.engine_id}: sync deadline passed; communicator aborted")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.closed = True
        if self.group is not None:
            try:
                if self.backend == "nccl":
                    self.group.destroy()  # ncclCommAbort, bounded (vLLM runs it in a thread)
                else:
                    self.group.abort()
            except Exception:  # noqa: BLE001 - an already broken group: freeing it is all that is left
                pass
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        self.group = None
        self.store = None


def update_info(buckets: list[Bucket], version: int, backend: str = "gloo") -> dict[str, Any]:
    """What the engine passes to vLLM's ``update_weights`` for this version (the control plane's share): our gloo
    engine's buckets, or vLLM's NCCL update info (every tensor's name, dtype and shape: its packed consumer cuts the
    same buckets as the learner's producer from them)."""
    if backend == "nccl":
        return {"names": [n for b in buckets for n in b.names],
                "dtype_names": [d for b in buckets for d in b.dtype_names],
                "shapes": [sh for b in buckets for sh in b.shapes]}
    return {"buckets": [b.__dict__ for b in buckets], "version": version}


def version_meta(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                 ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, wire dtype, full shape) per tensor, without gathering (a DTensor's ``shape`` is the global one)."""
    return [(n, dtype or t.dtype, tuple(t.shape)) for n, t in named]

