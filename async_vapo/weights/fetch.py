"""Weights over ZeroMQ for engines on other hosts than the learner's.

The learner's ``WeightServer`` (a ROUTER served by a thread, so a fetch does not wait for the update in
progress) answers ``WeightsFetch(version, index)`` with chunk ``index`` of the slot holding ``version``,
checked by its crc32; ``fetch_weights`` keeps a window of requests in flight and writes the chunks into
the engine's own shared buffer.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import zmq

from async_vapo.transport.interface import PeerTimeout
from async_vapo.transport.messages import (
    Ack,
    Decoder,
    ProtocolError,
    TensorHeader,
    TransportError,
    WeightsFetch,
    encode,
    make_envelope,
)
from async_vapo.transport.zmq_transport import (
    bind,
    blob_checksum,
    check_blob,
    connect,
    frame_cap,
    make_socket,
    recv_parts,
    send_tensor_blob,
    send_until,
    shared_context,
)
from async_vapo.weights.slots import WeightSlots, WeightsUnavailable

log = logging.getLogger(__name__)


class WeightServer:
    """The learner's fetch socket (ROUTER, bound at ``endpoint``), served by a thread.

    Request: ``WeightsFetch(engine_id, version, index)``. Reply: ``[TensorHeader, raw]`` with bytes
    ``[index * chunk_bytes, ...)`` of the version (``count`` chunks in all, crc32 in ``checksum``), or
    one frame ``Ack(ok=False, error)`` when the version is not held. A malformed request is counted in
    ``decoder.rejects`` and dropped; the thread keeps serving.
    """

    def __init__(self, slots: WeightSlots, endpoint: str, *, chunk_bytes: int, max_bytes: int,
                 send_timeout_s: float, sender: str = "learner", on_served=None, security=None):
        """``security`` (``transport.security.Security``): CURVE, admitting only rollout keys."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.slots = slots
        self.chunk_bytes = chunk_bytes
        self.send_timeout_s = send_timeout_s
        self.sender = sender
        self.on_served = on_served
        self.decoder = Decoder((WeightsFetch,), max_bytes=max_bytes, name="weights_fetch")
        self._sock = make_socket(shared_context(), zmq.ROUTER, max_msg_bytes=frame_cap(self.decoder))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if security is not None:
                security.server(self._sock, "rollout")
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
                parts = recv_parts(self._sock, time.monotonic() + 0.2)
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
            try:
                send_until(self._sock, [route, encode(reply)], time.monotonic() + self.send_timeout_s)
            except (TransportError, zmq.ZMQError) as send_exc:  # the requester is gone: nothing to tell
                log.warning("weight server: could not refuse %s: %s", req.engine_id, send_exc)
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
                  engine_id: str, max_bytes: int, window: int = 4, security=None) -> dict[str, float]:
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
    sock = make_socket(shared_context(), zmq.DEALER, max_msg_bytes=max(frame_cap(decoder), chunk_bytes + 4096))
    try:
        if security is not None:
            security.client(sock, "learner")
        connect(sock, endpoint)
        sent = 0

        def ask(index: int) -> None:
            env = make_envelope(WeightsFetch(engine_id=engine_id, version=version, index=index), sender=engine_id)
            if send_until(sock, [encode(env)], time.monotonic() + timeout_s) is None:
                raise PeerTimeout(endpoint, timeout_s, "room to send a fetch request")

        while sent < min(window, count):
            ask(sent)
            sent += 1
        got: set[int] = set()
        while len(got) < count:
            parts = recv_parts(sock, time.monotonic() + timeout_s)
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
