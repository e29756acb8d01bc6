"""Weights for engines on other hosts than the learner's, over the transport's blob link.

The learner's ``WeightServer`` (a ``Transport.blob_server``, served by its own thread, so a fetch does not wait for
the update in progress) answers ``WeightsFetch(version, index)`` with chunk ``index`` of ``version`` in its store
(a ``TensorHeader`` with its crc32, and the raw bytes), or with ``Ack(ok=False)`` when the store does not hold it.
The store is the learner's shared-memory slots (``slots.WeightSlots``), or with ``model.lora`` the adapter
publisher's blobs (``adapter.AdapterPublisher``: a version's PEFT files end to end, the engine writes them into a
directory of its own);
``fetch_weights`` keeps a window of requests in flight over a ``Transport.blob_requester`` and writes the chunks
into the engine's own shared buffer. Both take the service's transport: ZeroMQ between hosts (CURVE admitting only
rollouts, ``transport.zmq_transport``), in-process in one process's tests. The wire format is the one of protocol 7.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Protocol

from async_vapo.transport.interface import BlobReply, Transport, blob_checksum
from async_vapo.transport.messages import Ack, Decoder, Envelope, TensorHeader, WeightsFetch, make_envelope
from async_vapo.weights.slots import WeightsUnavailable


class VersionStore(Protocol):
    """What a fetch server serves: the bytes of each version it holds (``slots.WeightSlots``,
    ``adapter.AdapterPublisher``). Both raise WeightsUnavailable for a version not held (any more)."""

    def nbytes(self, version: int) -> int: ...

    def read(self, version: int, start: int, stop: int) -> bytes: ...


class WeightServer:
    """The learner's fetch endpoint (bound at ``endpoint`` on ``transport``, admitting rollouts), served by the
    blob server's thread.

    Request: ``WeightsFetch(engine_id, version, index)``. Reply: a ``TensorHeader`` and the raw bytes
    ``[index * chunk_bytes, ...)`` of the version (``count`` chunks in all, crc32 in ``checksum``), or one envelope
    ``Ack(ok=False, error)`` when the version is not held. A malformed request is counted in ``decoder.rejects`` and
    dropped; the thread keeps serving. ``on_served(nbytes)`` after each chunk sent."""

    def __init__(self, transport: Transport, store: VersionStore, endpoint: str, *, chunk_bytes: int, max_bytes: int,
                 send_timeout_s: float, sender: str = "learner", on_served: Callable[[int], None] | None = None):
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.store = store
        self.chunk_bytes = chunk_bytes
        self.sender = sender
        self.decoder = Decoder((WeightsFetch,), max_bytes=max_bytes, name="weights_fetch")
        self.server = transport.blob_server(endpoint, decoder=self.decoder, handler=self._answer,
                                            send_timeout_s=send_timeout_s, on_sent=on_served, peer="rollout")
        self.endpoint = self.server.endpoint

    def _answer(self, env: Envelope) -> BlobReply:
        req = env.body
        try:
            # the version's size comes from the store; chunk `index` of it
            start = req.index * self.chunk_bytes
            total = self.store.nbytes(req.version)
            stop = min(start + self.chunk_bytes, total)
            if req.index < 0 or start >= total:
                raise WeightsUnavailable(f"chunk {req.index} outside version {req.version} ({total} bytes)")
            data = self.store.read(req.version, start, stop)
        except WeightsUnavailable as exc:
            return make_envelope(Ack(acked_id=env.id, ok=False, error=str(exc)), sender=self.sender,
                                 reply_to=env.id), None
        header = TensorHeader(version=req.version, name="flat", dtype="uint8", shape=[len(data)], nbytes=len(data),
                              checksum=blob_checksum(data), index=req.index,
                              count=math.ceil(total / self.chunk_bytes))
        return make_envelope(header, sender=self.sender, policy_version=req.version, reply_to=env.id), data

    def close(self) -> None:
        self.server.close()


def fetch_weights(transport: Transport, endpoint: str, version: int, nbytes: int, dst, *, chunk_bytes: int,
                  timeout_s: float, engine_id: str, max_bytes: int, window: int = 4) -> dict[str, float]:
    """Fetch ``nbytes`` of ``version`` from the WeightServer at ``endpoint`` on ``transport`` into the writable
    buffer ``dst``.

    Raises WeightsUnavailable (the learner no longer holds the version), PeerTimeout (no reply within
    ``timeout_s``), ProtocolError (a corrupt or mismatched chunk). Returns ``{"fetch_s", "chunks"}``.
    """
    t0 = time.perf_counter()
    count = math.ceil(nbytes / chunk_bytes)
    dst = memoryview(dst).cast("B")
    if dst.nbytes < nbytes:
        raise ValueError(f"destination of {dst.nbytes} bytes for {nbytes}")
    decoder = Decoder((TensorHeader, Ack), max_bytes=max_bytes, name="weights_fetch_reply")
    requests = [make_envelope(WeightsFetch(engine_id=engine_id, version=version, index=i), sender=engine_id)
                for i in range(count)]
    link = transport.blob_requester(endpoint, decoder=decoder, max_blob_bytes=chunk_bytes, peer="learner")
    try:
        for i, reply, raw in link.exchange(requests, window=window, timeout_s=timeout_s):
            h = reply.body
            if raw is None:
                if isinstance(h, Ack) and not h.ok:
                    raise WeightsUnavailable(h.error)
                raise decoder.reject("not_allowed", f"{type(h).__name__} as a fetch reply")
            start = i * chunk_bytes
            if h.version != version or h.index != i or raw.nbytes != min(chunk_bytes, nbytes - start):
                raise decoder.reject("malformed", f"chunk {h.index} of version {h.version} ({raw.nbytes} bytes) "
                                                  f"does not answer the request for chunk {i} of version {version} "
                                                  f"of {nbytes} bytes")
            dst[start: start + raw.nbytes] = raw
    finally:
        link.close()
    return {"fetch_s": time.perf_counter() - t0, "chunks": count}
