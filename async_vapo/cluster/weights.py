"""Moving a new policy version from the learner to the rollout engines of a cluster.

The learner writes each version once, with one memcpy per tensor, into one of ``slots`` flat buffers
in shared memory (``WeightSlots``; round robin, so the newest ``slots`` versions are held). Each slot
is a file under the learner's weights directory (/dev/shm): a 4 KiB header, then the tensors at the
offsets of ``flat_layout``. The announce carries the slot's path, the layout (names, dtypes, shapes,
offsets), the version and the learner's random token. An engine then takes one of two ways in:

* ``shm`` (an engine on the learner's host): its vLLM workers map the slot file (once per slot, kept
  between versions) and hand views of it to ``reload_weights``; no byte is copied before vLLM's own copy.
  The engine knows it shares the learner's memory when the slot file exists and its header carries the
  announced token.
* ``zmq`` (an engine on another host): it fetches the slot's bytes from the learner's fetch socket
  (``WeightServer``, a ROUTER served by a thread of the learner, so a fetch does not wait for the update
  in progress) in chunks of ``chunk_bytes``, a window of ``window`` requests in flight, each chunk checked
  against its crc32, into its own shared buffer, and loads that as in ``shm``.

A slot is rewritten only ``slots`` versions later. Its header works as a sequence lock: the writer marks
it ``WRITING`` before the first byte and ``READY`` with the version after the last, and a reader checks
"ready, this version, this token" before and after it used the bytes (the fetch server per chunk, the
engine around its load). A reader that fell ``slots`` versions behind therefore gets a named error
(``WeightsUnavailable``), never a mix of two versions; it loads the newest version instead.

``benchmarks/weight_sync.py`` measures both ways against the safetensors file the learner used to write
(``cluster.weight_transfer = "file"``, still available: it works across hosts over a shared
filesystem).
"""

from __future__ import annotations

import logging
import math
import os
import struct
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq

from async_vapo.rollout.engine import Layout, SharedWeightBuffer, copy_into, flat_layout
from async_vapo.transport.base import PeerTimeout
from async_vapo.transport.messages import (
    Ack,
    Decoder,
    ProtocolError,
    TensorHeader,
    TransportError,
    WeightsAnnounce,
    WeightsFetch,
    encode,
    make_envelope,
)
from async_vapo.transport.zmq_transport import (
    _recv_parts,
    _send_until,
    bind,
    blob_checksum,
    check_blob,
    connect,
    make_socket,
    send_tensor_blob,
    shared_context,
    verify_checksum,
)

log = logging.getLogger(__name__)

HEADER_BYTES = 4096
"""Bytes before a slot's first tensor (the data starts page-aligned)."""
MAGIC = b"AVWSLOT1"
_HEADER = struct.Struct("<8sQqQ16s")  # magic, state, version, data bytes, token
_STATE = struct.Struct("<Q")
_STATE_OFFSET = 8
WRITING, READY = 0, 1


class WeightsUnavailable(TransportError):
    """The version asked for is no longer (or not yet) held by the learner: load the newest instead."""


@dataclass(frozen=True)
class SlotWrite:
    """Where a version went: ``layout`` offsets count from the start of the data (``base`` in the file)."""

    path: str
    version: int
    nbytes: int
    layout: Layout
    base: int
    token: str


def read_header(buf) -> tuple[int, int, int, str] | None:
    """``(state, version, data bytes, token hex)`` of a slot's header, or None if it is not a slot."""
    magic, state, version, nbytes, token = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return None
    return state, version, nbytes, token.hex()


def slot_holds(path: str, version: int, token: str) -> bool:
    """Whether the slot file at ``path`` is readable here and holds ``version`` of the learner ``token``."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return False
    if len(head) < _HEADER.size:
        return False
    h = read_header(head)
    return h is not None and h[0] == READY and h[1] == version and h[3] == token


class WeightSlots:
    """The learner's side: ``slots`` flat shared-memory buffers written round robin."""

    def __init__(self, directory: Path, slots: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        directory.mkdir(parents=True, exist_ok=True)
        self.token = os.urandom(16)
        self.buffers = [SharedWeightBuffer(str(directory), header=HEADER_BYTES, persistent=True, prefix=f"slot{i}-")
                        for i in range(slots)]
        self._next = 0
        self.lock = threading.Lock()  # a slot growing (a new file) against a reader picking it

    def write(self, version: int, state: Mapping) -> SlotWrite:
        layout, span = flat_layout(state, HEADER_BYTES)
        buf = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        with self.lock:
            mm = buf.reserve(span)
        _STATE.pack_into(mm, _STATE_OFFSET, WRITING)  # first: readers of the old version see it go
        copy_into(mm, state, layout)
        mm[:_HEADER.size] = _HEADER.pack(MAGIC, WRITING, version, span, self.token)
        _STATE.pack_into(mm, _STATE_OFFSET, READY)  # last: the version is complete
        assert buf.path is not None
        return SlotWrite(path=buf.path, version=version, nbytes=span,
                         layout=[(n, d, s, off - HEADER_BYTES) for n, d, s, off in layout], base=HEADER_BYTES,
                         token=self.token.hex())

    def _holding(self, version: int):
        """``(mapping, data bytes)`` of the slot that holds ``version`` complete; WeightsUnavailable if none."""
        with self.lock:
            mms = [b.mapping for b in self.buffers if b.mapping is not None]
        for mm in mms:
            try:
                h = read_header(mm)
            except ValueError:  # the slot grew meanwhile and its old mapping was closed
                continue
            if h is not None and h[0] == READY and h[1] == version:
                return mm, h[2]
        raise WeightsUnavailable(f"version {version} is not held any more (the learner keeps {len(self.buffers)})")

    def nbytes(self, version: int) -> int:
        """Data bytes of ``version``; WeightsUnavailable if no slot holds it."""
        return self._holding(version)[1]

    def read(self, version: int, start: int, stop: int) -> bytes:
        """A copy of data bytes ``[start, stop)`` of ``version``; WeightsUnavailable if no slot holds it
        complete, before and after the copy."""
        mm, nbytes = self._holding(version)
        if not 0 <= start < stop <= nbytes:
            raise WeightsUnavailable(f"bytes [{start}, {stop}) outside version {version}'s {nbytes}")
        try:
            data = mm[HEADER_BYTES + start: HEADER_BYTES + stop]
            h = read_header(mm)
        except ValueError:
            h = None
        if h is None or h[0] != READY or h[1] != version:
            raise WeightsUnavailable(f"version {version} was rewritten while it was read")
        return data

    def close(self) -> None:
        with self.lock:
            for b in self.buffers:
                b.close()


class WeightServer:
    """The learner's fetch socket (ROUTER, bound at ``endpoint``), served by a thread.

    Request: ``WeightsFetch(engine_id, version, index)``. Reply: ``[TensorHeader, raw]`` with bytes
    ``[index * chunk_bytes, ...)`` of the version (``count`` chunks in all, crc32 in ``checksum``), or
    one frame ``Ack(ok=False, error)`` when the version is not held. A malformed request is counted in
    ``decoder.rejects`` and dropped; the thread keeps serving.
    """

    def __init__(self, slots: WeightSlots, endpoint: str, *, chunk_bytes: int, max_bytes: int,
                 send_timeout_s: float, sender: str = "learner", on_served=None):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        self.send_timeout_s = send_timeout_s
        self.sender = sender
        self.on_served = on_served
        self.decoder = Decoder((WeightsFetch,), max_bytes=max_bytes, name="weights_fetch")
        self._sock = make_socket(shared_context(), zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.endpoint = bind(self._sock, endpoint)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weight-server", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                parts = _recv_parts(self._sock, time.monotonic() + 0.2)
                if parts is not None:
                    self._serve(parts)
        finally:
            self._sock.close(linger=0)

    def _serve(self, parts: list) -> None:
        if len(parts) != 2:
            self.decoder.reject("malformed", f"fetch request of {len(parts)} frames")
            return
        route = parts[0].bytes
        try:
            env = self.decoder.decode(parts[1].buffer)
        except ProtocolError:  # counted and logged (rate-limited) by the decoder
            return
        req = env.body
        try:
            # the version's size comes from the slot; chunk `index` of it
            start = req.index * self.chunk_bytes
            total = self.slots.nbytes(req.version)
            stop = min(start + self.chunk_bytes, total)
            if req.index < 0 or start >= total:
                raise WeightsUnavailable(f"chunk {req.index} outside version {req.version} ({total} bytes)")
            data = self.slots.read(req.version, start, stop)
        except WeightsUnavailable as exc:
            reply = make_envelope(Ack(acked_id=env.id, ok=False, error=str(exc)), sender=self.sender,
                                  reply_to=env.id)
            _send_until(self._sock, [route, encode(reply)], time.monotonic() + self.send_timeout_s)
            return
        header = TensorHeader(version=req.version, name="flat", dtype="uint8", shape=[len(data)], nbytes=len(data),
                              checksum=blob_checksum(data), index=req.index,
                              count=math.ceil(total / self.chunk_bytes))
        try:
            send_tensor_blob(self._sock, make_envelope(header, sender=self.sender, policy_version=req.version,
                                                       reply_to=env.id),
                             data, timeout_s=self.send_timeout_s, route=route)
        except (TransportError, zmq.ZMQError) as exc:  # the requester is gone or full: it will ask again
            log.warning("weight server: could not answer %s: %s", req.engine_id, exc)
            return
        if self.on_served is not None:
            self.on_served(len(data))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def fetch_weights(endpoint: str, version: int, nbytes: int, dst, *, chunk_bytes: int, timeout_s: float,
                  engine_id: str, max_bytes: int, window: int = 4) -> dict[str, float]:
    """Fetch ``nbytes`` of ``version`` from a WeightServer into the writable buffer ``dst``.

    Raises WeightsUnavailable (the learner no longer holds the version), PeerTimeout (no reply within
    ``timeout_s``), ProtocolError (a corrupt or mismatched chunk). Returns ``{"fetch_s", "chunks"}``.
    """
    t0 = time.perf_counter()
    count = math.ceil(nbytes / chunk_bytes)
    dst = memoryview(dst).cast("B")
    if dst.nbytes < nbytes:
        raise ValueError(f"destination of {dst.nbytes} bytes for {nbytes}")
    decoder = Decoder((TensorHeader, Ack), max_bytes=max_bytes, name="weights_fetch_reply")
    sock = make_socket(shared_context(), zmq.DEALER)
    try:
        connect(sock, endpoint)
        sent = 0

        def ask(index: int) -> None:
            env = make_envelope(WeightsFetch(engine_id=engine_id, version=version, index=index), sender=engine_id)
            if _send_until(sock, [encode(env)], time.monotonic() + timeout_s) is None:
                raise PeerTimeout(endpoint, timeout_s, "room to send a fetch request")

        while sent < min(window, count):
            ask(sent)
            sent += 1
        got: set[int] = set()
        while len(got) < count:
            parts = _recv_parts(sock, time.monotonic() + timeout_s)
            if parts is None:
                raise PeerTimeout(endpoint, timeout_s, f"chunk of version {version}")
            if len(parts) == 1:
                body = decoder.decode(parts[0].buffer).body
                if isinstance(body, Ack) and not body.ok:
                    raise WeightsUnavailable(body.error)
                raise decoder.reject("not_allowed", f"{type(body).__name__} as a fetch reply")
            header_env, raw = check_blob(parts, decoder, max_blob_bytes=chunk_bytes, verify=True)
            h = header_env.body
            start = h.index * chunk_bytes
            if (h.version != version or h.index in got or not 0 <= h.index < count
                    or raw.nbytes != min(chunk_bytes, nbytes - start)):
                raise decoder.reject("malformed", f"chunk {h.index} of version {h.version} ({raw.nbytes} bytes) "
                                                  f"does not fit version {version} of {nbytes} bytes")
            dst[start: start + raw.nbytes] = raw
            got.add(h.index)
            if sent < count:
                ask(sent)
                sent += 1
    finally:
        sock.close(linger=0)
    return {"fetch_s": time.perf_counter() - t0, "chunks": count}


# ---- the two ends as the services use them (and benchmarks/weight_sync.py measures them) -------------------


def slot_announce(w: SlotWrite) -> WeightsAnnounce:
    return WeightsAnnounce(version=w.version, transfer="shm", location=w.path, nbytes=w.nbytes, checksum="",
                           format="flat", layout=w.layout, base=w.base, token=w.token)


def write_file_version(directory: Path, version: int, state: Mapping) -> WeightsAnnounce:
    """``cluster.weight_transfer = "file"``: ``state`` as one safetensors file, written atomically."""
    from safetensors.torch import save

    from async_vapo.rollout.engine import _unshared

    data = save(_unshared(state))
    path = directory / f"policy-v{version}.safetensors"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return WeightsAnnounce(version=version, transfer="file", location=str(path), nbytes=len(data),
                           checksum=blob_checksum(data))


def load_announced(engine, a: WeightsAnnounce, *, mode: str, fetch_endpoint: str, chunk_bytes: int,
                   timeout_s: float, engine_id: str, max_bytes: int) -> str:
    """Load the announced version into ``engine`` (a VLLMEngine); returns the way it came: "shm", "zmq" or
    "file". ``mode`` is ``cluster.weight_transfer``. Raises on anything that does not match the announce;
    after a torn slot load (the learner rewrote the slot meanwhile) the engine's version is -1."""
    if a.transfer == "file":
        data = Path(a.location).read_bytes()
        if len(data) != a.nbytes or not verify_checksum(data, a.checksum):
            raise ValueError(f"weights file {a.location} does not match its announce ({a.checksum})")
        del data
        engine.load_weights_from_file(a.location, a.version)
        return "file"
    if a.transfer != "shm":
        raise ValueError(f"transfer {a.transfer!r} is not one an engine loads (shm, file)")
    if not a.layout:
        raise ValueError(f"the announce of version {a.version} has no layout")
    if mode != "zmq" and slot_holds(a.location, a.version, a.token):
        layout = [(n, d, s, off + a.base) for n, d, s, off in a.layout]
        try:
            engine.load_weights_from_shared(a.location, a.base + a.nbytes, layout, a.version)
        finally:
            if not slot_holds(a.location, a.version, a.token):
                engine.version = -1  # torn: serve nothing until the newest version is loaded
                raise WeightsUnavailable(f"the learner rewrote the slot of version {a.version} during the load")
        return "shm"
    if mode == "shm":
        raise WeightsUnavailable(f"slot {a.location} of version {a.version} is not readable on this host "
                                 '(cluster.weight_transfer = "shm"; "auto" fetches it over ZeroMQ)')
    dst = engine.receive_buffer(a.nbytes)
    fetch_weights(fetch_endpoint, a.version, a.nbytes, dst, chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                  engine_id=engine_id, max_bytes=max_bytes)
    del dst
    engine.load_received(a.layout, a.version)
    return "zmq"
