"""The engine's end: load an announced version into a running engine, by the way the announce allows."""

from __future__ import annotations

from pathlib import Path

from async_vapo.transport.interface import Transport, verify_checksum
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.adapter import check_adapter, inbox
from async_vapo.weights.engine import WeightEngine
from async_vapo.weights.fetch import fetch_weights
from async_vapo.weights.slots import WeightsUnavailable, slot_holds


def load_announced(engine: WeightEngine, a: WeightsAnnounce, *, transport: Transport, mode: str,
                   fetch_endpoint: str, chunk_bytes: int, timeout_s: float, engine_id: str, max_bytes: int) -> str:
    """Load the announced version into ``engine`` through its load methods (inside its ``apply_weights``); returns
    the way it came: "shm", "zmq" (fetched from ``fetch_endpoint`` over ``transport``), "file", or for a LoRA
    version (``weights.adapter``) "adapter" (the learner's PEFT directory, read where it lies) or "adapter_zmq" (its
    files fetched, written into a directory of the engine's own). ``mode`` is ``cluster.weights.transfer``. Raises
    on anything that does not match the announce; after a torn slot load (the learner rewrote the slot meanwhile) the
    engine is invalidated (version -1)."""
    if a.transfer == "file":
        data = Path(a.location).read_bytes()
        if len(data) != a.nbytes or not verify_checksum(data, a.checksum):
            raise ValueError(f"weights file {a.location} does not match its announce ({a.checksum})")
        del data
        engine.load_weights_from_file(a.location, a.version)
        return "file"
    if a.transfer == "adapter":
        return _load_adapter(engine, a, transport=transport, mode=mode, fetch_endpoint=fetch_endpoint,
                             chunk_bytes=chunk_bytes, timeout_s=timeout_s, engine_id=engine_id, max_bytes=max_bytes)
    if a.transfer != "shm":
        raise ValueError(f"transfer {a.transfer!r} is not one an engine loads (shm, file, adapter)")
    if not a.layout:
        raise ValueError(f"the announce of version {a.version} has no layout")
    if not a.location:
        raise WeightsUnavailable(f"version {a.version} was streamed over the engines' weight groups only: no slot "
                                 "holds it (the learner publishes it again, whole, once it hears of this failure)")
    if mode != "zmq" and slot_holds(a.location, a.version, a.token):
        layout = [(n, d, s, off + a.base) for n, d, s, off in a.layout]
        try:
            engine.load_weights_from_shared(a.location, a.base + a.nbytes, layout, a.version)
        finally:
            if not slot_holds(a.location, a.version, a.token):
                engine.invalidate()  # torn: serve nothing until the newest version is loaded
                raise WeightsUnavailable(f"the learner rewrote the slot of version {a.version} during the load")
        return "shm"
    if mode == "shm":
        raise WeightsUnavailable(f"slot {a.location} of version {a.version} is not readable on this host "
                                 '(cluster.weights.transfer = "shm"; "auto" fetches it over ZeroMQ)')
    dst = engine.receive_buffer(a.nbytes)
    fetch_weights(transport, fetch_endpoint, a.version, a.nbytes, dst, chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                  engine_id=engine_id, max_bytes=max_bytes)
    del dst
    engine.load_received(a.layout, a.version)
    return "zmq"


def _load_adapter(engine: WeightEngine, a: WeightsAnnounce, *, transport: Transport, mode: str, fetch_endpoint: str,
                  chunk_bytes: int, timeout_s: float, engine_id: str, max_bytes: int) -> str:
    """A LoRA version: the learner's directory where it is readable here (but with "zmq"), checked against the
    announce (a mismatch raises ValueError); else ("zmq", and "auto" on another host) its blob fetched into this
    process's ``adapter.inbox``. Then vLLM's load. As for a slot, "shm" and "file" never fetch: a directory not
    readable here is WeightsUnavailable. Whatever raises before vLLM's load leaves the engine's version as it was."""
    if mode != "zmq":
        try:
            check_adapter(a)
        except WeightsUnavailable:
            if mode in ("shm", "file"):
                raise
        else:
            engine.load_adapter(a.location, a.version)
            return "adapter"
    path = inbox().fetch(transport, fetch_endpoint, a, chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                         engine_id=engine_id, max_bytes=max_bytes)
    engine.load_adapter(str(path), a.version)
    return "adapter_zmq"
