"""Versions streamed from the learner into the engines over torch.distributed, through vLLM's weight-transfer API.

The engine's end is a weight-transfer engine registered with vLLM's ``WeightTransferEngineFactory`` under
``GLOO_BACKEND`` (``register()``, run in every vLLM worker when ``async_vapo.rollout.worker_ext`` is imported). vLLM
drives it: ``init_weight_transfer_engine`` joins the group, ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` receive one version and load it through vLLM's layerwise reload (the same lifecycle as
vLLM's own NCCL engine), with the engine's ``model.load_weights`` per bucket.

The learner's end is ``EngineGroup``: one gloo group per engine, the learner as rank 0 and that engine's workers
after it, each group on a TCPStore of its own. One group per engine because a collective with a member that died
hangs until its timeout and leaves the group unusable: a failed engine's group is torn down (``close``) and an
engine that comes back gets a new group (a new store, a new key prefix), so the others never wait on it.

Invariants:

* Parameters go in buckets of at most ``bucket_bytes`` (a parameter larger than that is a bucket of its own),
  each gathered just before it is sent (``full_tensor()`` on an FSDP shard, vLLM's ``materialize_full_tensor``), so
  no process holds a second copy of the model: the learner one bucket, each worker one bucket.
* A sync has a deadline: every gloo operation of a group times out after ``timeout_s`` and the whole send checks
  the deadline between buckets; past it ``EngineSyncTimeout`` is raised and the group is closed. Nothing waits
  forever on an engine that never answers.
* The version's metadata (names, dtypes, shapes, bucket bounds) goes to the engine on the control plane (the
  ``update_weights`` call); the bytes go over the group. Version tags, acks and rotation stay on ZeroMQ
  (``async_vapo.weights.sync``).
* An engine whose receive failed part-way holds a mix of two versions: it must load a whole version another way
  (the shared-memory slot or a ZeroMQ fetch) before it serves again.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

GLOO_BACKEND = "async_vapo_gloo"
"""Name of the gloo engine in vLLM's WeightTransferEngineFactory."""
DEFAULT_BUCKET_BYTES = 16 << 20
"""Bucket size: the engine receives the next bucket while it loads one, so smaller buckets overlap more. At 30 M
parameters on this CPU, 16 MiB (8 buckets) pushed in 0.111 s against 0.188 s with 64 MiB (2 buckets)."""


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
    """Register the gloo engine with vLLM (idempotent); the worker extension's import runs it in every worker."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, __name__, "GlooWeightTransferEngine")


def __getattr__(name: str):
    # the vLLM-facing classes are built on first use, so importing this module does not import vLLM
    if name in ("GlooWeightTransferEngine", "GlooInitInfo", "GlooUpdateInfo"):
        _build_engine_classes()
        return globals()[name]
    raise AttributeError(name)


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

    ``init_info`` is what the engine passes to vLLM's ``init_weight_transfer_engine``; ``connect`` then forms the
    group (both sides must be in it at once; the learner waits ``join_timeout_s``, default ``timeout_s``, e.g. in a
    thread while the engine finishes what it is generating); ``send`` streams one version, every broadcast within
    ``timeout_s``; ``close`` tears the group down. A group that failed once is closed and never used again.
    """

    def __init__(self, engine_id: str, *, workers: int = 1, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, timeout_s: float = 60.0, join_timeout_s: float | None = None):
        import torch.distributed as dist

        self.engine_id, self.world_size, self.timeout_s = engine_id, workers + 1, timeout_s
        self.join_timeout_s = timeout_s if join_timeout_s is None else join_timeout_s
        self._timeout = timedelta(seconds=timeout_s)
        self._join_timeout = timedelta(seconds=self.join_timeout_s)
        self.store = dist.TCPStore(bind_host, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=self._join_timeout)
        self.prefix = f"{engine_id}/{uuid.uuid4().hex}"  # a rejoining engine never meets an old group's keys
        self.init_info = {"master_addr": advertise_host or bind_host, "master_port": self.store.port,
                          "world_size": self.world_size, "prefix": self.prefix, "timeout_s": timeout_s}
        self.group = None
        self.closed = False

    def connect(self) -> None:
        import torch.distributed as dist

        if self.closed:
            raise RuntimeError(f"{self.engine_id}: this group was torn down; make a new EngineGroup")
        try:
            group = dist.ProcessGroupGloo(dist.PrefixStore(self.prefix, self.store), 0, self.world_size,
                                          self._join_timeout)
            group.set_timeout(self._timeout)  # each broadcast from now on
            self.group = group
        except Exception as e:  # the store's wait for the engine's workers ran out
            self.close()
            raise EngineSyncTimeout(
                f"{self.engine_id} did not join its group within {self.join_timeout_s:g} s: {e}") from e

    def send(self, buckets: list[Bucket], tensors: Iterable[tuple[str, torch.Tensor]], *,
             deadline: float | None = None) -> float:
        """Stream one version: ``tensors`` in ``buckets``' order, each converted to its bucket dtype, one bucket
        packed and broadcast at a time. Returns seconds spent; raises EngineSyncTimeout / EngineSyncFailed (the
        group is then closed)."""
        if self.group is None:
            self.connect()
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

    def close(self) -> None:
        self.closed = True
        if self.group is not None:
            try:
                self.group.abort()
            except Exception:  # noqa: BLE001 - an already broken group: freeing it is all that is left
                pass
        self.group = None
        self.store = None


def update_info(buckets: list[Bucket], version: int) -> dict[str, Any]:
    """What the engine passes to vLLM's ``update_weights`` for this version (the control plane's share)."""
    return {"buckets": [b.__dict__ for b in buckets], "version": version}


def version_meta(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
                 ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, wire dtype, full shape) per tensor, without gathering (a DTensor's ``shape`` is the global one)."""
    return [(n, dtype or t.dtype, tuple(t.shape)) for n, t in named]

