"""The engine's end: load an announced version into a running engine, by the way the announce allows."""

from __future__ import annotations

from pathlib import Path

from async_vapo.transport.interface import Transport, verify_checksum
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.adapter import check_adapter
from async_vapo.weights.engine import WeightEngine
from async_vapo.weights.fetch import fetch_weights
from async_vapo.weights.slots import WeightsUnavailable, slot_holds


def load_announced(engine: WeightEngine, a: WeightsAnnounce, *, transport: Transport, mode: str,
                   fetch_endpoint: str, chunk_bytes: int, timeout_s: float, engine_id: str, max_bytes: int) -> str:
    """Load the announced version into ``engine`` through its load methods (inside its ``apply_weights``); returns
    the way it came: "shm", "zmq" (fetched from ``fetch_endpoint`` over ``transport``), "file" or "adapter" (a LoRA
    version's PEFT directory, ``weights.adapter``). ``mode`` is
    ``cluster.weights.transfer``. Raises on anything that does not match the announce; after a torn slot load (the
    learner rewrote the slot meanwhile) the engine is invalidated (version -1)."""
    if a.transfer == "file":
        data = Path(a.location).read_bytes()
        if len(data) != a.nbytes or not verify_checksum(data, a.checksum):
            raise ValueError(f"weights file {a.location} does not match its announce ({a.checksum})")
        del data
        engine.load_weights_from_file(a.location, a.version)
        return "file"
    if a.transfer == "adapter":
        check_adapter(a)
        engine.load_adapter(a.location, a.version)
        return "adapter"
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
