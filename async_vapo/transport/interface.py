"""Small transport interfaces, their shared behaviour, and the named errors.

Five shapes of link, each an ABC with one concrete level per transport (``zmq_transport``,
``inproc``):

* :class:`Sender` / :class:`Receiver` -- a PUSH/PULL pipe (fan-in or fan-out of envelopes).
* :class:`Requester` / :class:`Replier` -- request/reply, matched by ``Envelope.reply_to``; a reply
  that does not answer the request in flight (a late answer to one that timed out) is discarded, so
  a dead or slow peer costs one ``PeerTimeout``, never a wedged socket.
* :class:`Publisher` / :class:`Subscriber` -- one-to-many announcements (weights). A publisher never
  blocks; it re-sends its latest envelope to each newly joined subscriber (see ``pump``).
* :class:`BlobRequester` / :class:`BlobServer` -- windowed request/reply for bulk bytes (the weight fetch):
  several requests in flight, each answered by a header envelope plus a raw blob (size-capped, crc32-checked:
  :func:`check_blob`) or by one envelope (a refusal), matched to its request by ``reply_to``; the server answers
  from a thread of its own.
* :class:`Transport` -- the factory of all of the above for one transport.

Every blocking call takes a finite ``timeout_s`` and either completes or raises a named error
(:class:`BackpressureFull`, :class:`PeerTimeout`) or returns ``None`` (receives); nothing waits
forever. Receivers skip frames the socket's :class:`~async_vapo.transport.messages.Decoder` rejects
(counted by reason and logged) and keep receiving. Objects are not thread-safe: one thread per object.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from async_vapo.transport.messages import (
    Decoder,
    Envelope,
    ProtocolError,
    Ready,
    TensorHeader,
    TransportError,
    WeightsAnnounce,
    encode,
    make_envelope,
)

log = logging.getLogger(__name__)

DEFAULT_HWM = 100
"""Default high-water mark, in messages, of each side of a link."""

Frame = bytes | memoryview

BlobReply = tuple[Envelope, Frame | None]
"""A :class:`BlobServer`'s answer to one request: a header envelope (a ``TensorHeader`` declaring the blob's
``nbytes`` and ``checksum``) and the raw blob, or one envelope and None (a refusal)."""

__all__ = [
    "DEFAULT_HWM", "BackpressureFull", "BlobReply", "BlobRequester", "BlobServer", "HeartbeatMonitor", "PeerDead",
    "PeerTimeout", "ProtocolError", "Publisher", "Receiver", "Replier", "Requester", "Sender", "Subscriber",
    "Transport", "TransportError", "blob_checksum", "check_blob", "connect_with_handshake", "verify_checksum",
]  # fmt: skip


class PeerTimeout(TransportError):
    """The peer did not answer (or could not be reached) within the timeout."""

    def __init__(self, peer: str, timeout_s: float, what: str = "reply") -> None:
        super().__init__(f"no {what} from {peer} within {timeout_s:.3g} s")
        self.peer, self.timeout_s, self.what = peer, timeout_s, what


class PeerDead(TransportError):
    """A peer has been silent past its heartbeat deadline, or is gone from the socket."""

    def __init__(self, peer: str, silent_s: float = math.inf) -> None:
        super().__init__(f"peer {peer} is dead (silent for {silent_s:.3g} s)")
        self.peer, self.silent_s = peer, silent_s


class BackpressureFull(TransportError):
    """The link stayed at its high-water mark for the whole send timeout."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        super().__init__(f"{endpoint}: still at high-water mark after {timeout_s:.3g} s")
        self.endpoint, self.timeout_s = endpoint, timeout_s


def check_timeout(timeout_s: float) -> float:
    if not (0 <= timeout_s < math.inf):
        raise ValueError(f"timeout_s must be finite and >= 0, got {timeout_s!r}")
    return float(timeout_s)


class _Endpoint(ABC):
    endpoint: str

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Sender(_Endpoint):
    """Sending end of a pipe."""

    def send(self, env: Envelope, timeout_s: float) -> None:
        """Raises BackpressureFull if the pipe stays full for ``timeout_s``."""
        self.send_frame(encode(env), timeout_s)

    @abstractmethod
    def send_frame(self, frame: bytes, timeout_s: float) -> None:
        """Send an already encoded frame (forwarding; tests of the receiving decoder)."""


class Receiver(_Endpoint):
    """Receiving end of a pipe; also the shape of a subscriber."""

    decoder: Decoder

    @abstractmethod
    def recv_frame(self, timeout_s: float) -> Frame | None:
        """One raw frame, or None after ``timeout_s``."""

    def _has_input(self) -> bool:
        """Whether a frame may be waiting (for :meth:`Transport.wait_any`; True when unknown)."""
        return True

    def recv(self, timeout_s: float) -> Envelope | None:
        """The next valid envelope, or None after ``timeout_s``; rejected frames are counted and skipped."""
        deadline = time.monotonic() + check_timeout(timeout_s)
        while True:
            frame = self.recv_frame(max(0.0, deadline - time.monotonic()))
            if frame is None:
                return None
            try:
                return self.decoder.decode(frame)
            except ProtocolError:
                continue


class Subscriber(Receiver):
    """Receiving end of a publisher's announcements (subscribed to everything it publishes)."""


class Publisher(_Endpoint):
    """One-to-many; ``publish`` never blocks (a subscriber at its HWM misses the message)."""

    subscribers_seen: int
    """Subscriptions seen since creation (joins, not current members)."""

    @abstractmethod
    def publish(self, env: Envelope) -> None:
        """Send to every subscriber, after :meth:`pump`; the envelope becomes the latest."""

    @abstractmethod
    def pump(self) -> int:
        """Process subscriptions that arrived; re-send the latest envelope if any subscriber is new.
        Returns the number of new subscriptions. Call it from the publishing loop when idle."""

    @abstractmethod
    def wait_for_subscribers(self, n: int, timeout_s: float) -> None:
        """Handshake: return once ``n`` subscriptions have been seen, else raise PeerTimeout."""


class Requester(_Endpoint):
    """Request/reply client: one request in flight; replies matched by ``reply_to``."""

    name: str
    decoder: Decoder

    @abstractmethod
    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        """Queue the frame to the peer; False if that was impossible within ``timeout_s``."""

    @abstractmethod
    def _recv_reply(self, timeout_s: float) -> Frame | None: ...

    def request(self, env: Envelope, timeout_s: float) -> Envelope:
        """The reply to ``env``; PeerTimeout if none arrives within ``timeout_s`` (send included)."""
        deadline = time.monotonic() + check_timeout(timeout_s)
        if not self._send_request(encode(env), timeout_s):
            raise PeerTimeout(self.endpoint, timeout_s, "connection")
        while True:
            frame = self._recv_reply(max(0.0, deadline - time.monotonic()))
            if frame is None:
                raise PeerTimeout(self.endpoint, timeout_s)
            try:
                reply = self.decoder.decode(frame)
            except ProtocolError:
                continue
            if reply.reply_to == env.id:
                return reply
            log.debug("%s: discarding reply to %s (waiting for %s)", self.endpoint, reply.reply_to, env.id)

    def handshake(self, timeout_s: float) -> Envelope:
        """Exchange READY with the replier: proves it is up and speaks our protocol version."""
        return self.request(make_envelope(Ready(service=self.name), sender=self.name), timeout_s)


class Replier(_Endpoint):
    """Request/reply server: ``recv`` a request, later ``reply`` to it. READY requests are answered
    here and never returned."""

    MAX_PENDING = 10_000
    name: str
    decoder: Decoder

    def __init__(self) -> None:
        self._pending: OrderedDict[str, Any] = OrderedDict()

    @abstractmethod
    def _recv_request(self, timeout_s: float) -> tuple[Any, Frame] | None:
        """(route back to the requester, frame), or None after ``timeout_s``."""

    def _has_input(self) -> bool:
        """Whether a request may be waiting (for :meth:`Transport.wait_any`; True when unknown)."""
        return True

    @abstractmethod
    def _send_reply(self, route: Any, frame: bytes, timeout_s: float) -> None:
        """Raises BackpressureFull (peer's queue full) or PeerDead (peer gone)."""

    def recv(self, timeout_s: float) -> Envelope | None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        while True:
            got = self._recv_request(max(0.0, deadline - time.monotonic()))
            if got is None:
                return None
            route, frame = got
            try:
                env = self.decoder.decode(frame)
            except ProtocolError:
                continue
            if isinstance(env.body, Ready):
                answer = make_envelope(Ready(service=self.name), sender=self.name, reply_to=env.id)
                try:
                    self._send_reply(route, encode(answer), 0.1)
                except TransportError as exc:
                    log.warning("%s: READY answer to %s lost: %s", self.endpoint, env.sender, exc)
                continue
            self._pending[env.id] = route
            if len(self._pending) > self.MAX_PENDING:
                old, _ = self._pending.popitem(last=False)
                log.warning("%s: more than %d unanswered requests; forgot %s", self.endpoint, self.MAX_PENDING, old)
            return env

    def reply(self, request: Envelope, response: Envelope, timeout_s: float = 1.0) -> None:
        """Send ``response`` (its ``reply_to`` set to ``request.id``) to whoever sent ``request``."""
        try:
            route = self._pending.pop(request.id)
        except KeyError:
            raise TransportError(f"{self.endpoint}: no pending request {request.id}") from None
        if response.reply_to != request.id:
            response = msgspec.structs.replace(response, reply_to=request.id)
        self._send_reply(route, encode(response), check_timeout(timeout_s))


# ---- bulk bytes: checked blobs, and the windowed request/reply that carries them ----------------------------

_CHECKSUMS = {
    "crc32": lambda b: f"{zlib.crc32(b) & 0xFFFFFFFF:08x}",
    "blake2b": lambda b: hashlib.blake2b(b, digest_size=16).hexdigest(),
}


def blob_checksum(blob, algo: str = "crc32") -> str:
    """``"<algo>:<hex>"`` of a buffer: crc32 (fast, catches corruption/mix-ups) or blake2b."""
    return f"{algo}:{_CHECKSUMS[algo](memoryview(blob).cast('B'))}"


def verify_checksum(blob, checksum: str) -> bool:
    """Whether ``blob`` matches ``checksum``; ValueError on an unknown algorithm."""
    algo, _, _ = checksum.partition(":")
    if algo not in _CHECKSUMS:
        raise ValueError(f"unknown checksum algorithm {algo!r}")
    return blob_checksum(blob, algo) == checksum


def check_blob(header: Frame, raw: Frame, decoder: Decoder, *, max_blob_bytes: int, verify: bool = True
               ) -> tuple[Envelope, memoryview]:
    """The checks of a received ``[header, raw]`` blob, each counted in ``decoder.rejects`` and raised as
    ProtocolError: raw frame <= max_blob_bytes ("oversized"), the header through ``decoder`` (its size limit first),
    a blob header type ("not_allowed"), declared nbytes == received ("malformed"), checksum ("malformed"). The
    returned view is ``raw``'s memory, not a copy."""
    raw = memoryview(raw)
    if raw.nbytes > max_blob_bytes:
        raise decoder.reject("oversized", f"blob of {raw.nbytes} bytes > max_blob_bytes {max_blob_bytes}")
    env = decoder.decode(header)
    body = env.body
    if not isinstance(body, (TensorHeader, WeightsAnnounce)):
        raise decoder.reject("not_allowed", f"{type(body).__name__} as a blob header")
    if body.nbytes != raw.nbytes:
        raise decoder.reject("malformed", f"header declares {body.nbytes} bytes, blob frame has {raw.nbytes}")
    if verify:
        try:
            ok = verify_checksum(raw, body.checksum)
        except ValueError as exc:
            raise decoder.reject("malformed", str(exc)) from None
        if not ok:
            raise decoder.reject("malformed", f"checksum mismatch (declared {body.checksum})")
    return env, raw


class BlobRequester(_Endpoint):
    """The client of a :class:`BlobServer`: windowed request/reply for bulk bytes (the weight fetch).

    :meth:`exchange` keeps up to ``window`` requests in flight and sends the next one for each reply taken, so
    the server never queues more than ``window`` replies for one requester. Replies may come in any order; each is
    matched to its request by ``Envelope.reply_to``. Short-lived: one per exchange, closed by its caller (the
    transport does not keep it for its own ``close``)."""

    decoder: Decoder
    max_blob_bytes: int

    @abstractmethod
    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        """Queue the frame to the server; False if that was impossible within ``timeout_s``."""

    @abstractmethod
    def _recv_reply(self, timeout_s: float) -> list[Frame] | None:
        """The frames of the next reply (one, or header and raw), or None after ``timeout_s``."""

    def exchange(self, requests: Sequence[Envelope], *, window: int, timeout_s: float
                 ) -> Iterator[tuple[int, Envelope, memoryview | None]]:
        """``(i, reply, raw)`` for each of ``requests``, as the replies arrive: ``i`` the request's position,
        ``raw`` the blob checked by :func:`check_blob` against the header ``reply`` (cap ``max_blob_bytes``,
        declared size, checksum), or None for a one-envelope reply. Every wait (room to send a request, the next
        reply) is bounded by ``timeout_s``: PeerTimeout past it. A reply that fails its checks, has another number
        of frames, or answers no request in flight raises ProtocolError (counted in ``decoder.rejects``)."""
        check_timeout(timeout_s)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        in_flight: dict[str, int] = {}
        sent = 0

        def ask() -> None:
            nonlocal sent
            env = requests[sent]
            if not self._send_request(encode(env), timeout_s):
                raise PeerTimeout(self.endpoint, timeout_s, "room to send a request")
            in_flight[env.id] = sent
            sent += 1

        while sent < min(window, len(requests)):
            ask()
        while in_flight:
            parts = self._recv_reply(timeout_s)
            if parts is None:
                raise PeerTimeout(self.endpoint, timeout_s, f"reply to request {min(in_flight.values())}")
            if len(parts) == 1:
                reply, raw = self.decoder.decode(parts[0]), None
            elif len(parts) == 2:
                reply, raw = check_blob(parts[0], parts[1], self.decoder, max_blob_bytes=self.max_blob_bytes)
            else:
                raise self.decoder.reject("malformed", f"reply of {len(parts)} frames")
            i = in_flight.pop(reply.reply_to, None) if reply.reply_to is not None else None
            if i is None:
                raise self.decoder.reject("malformed", f"a reply to {reply.reply_to}, which no request in flight is")
            yield i, reply, raw
            if sent < len(requests):
                ask()


class BlobServer(_Endpoint):
    """The server of :class:`BlobRequester` s, answering from a thread of its own, so that a long task of its
    owner's (a learner's update) never delays a reply.

    Each valid request goes to ``handler``, whose :data:`BlobReply` goes back to the requester with ``reply_to``
    set to the request. A request the decoder rejects is counted in ``decoder.rejects`` and dropped. A reply that
    cannot be sent within ``send_timeout_s`` (the requester is gone, or its pipe stays full: it will ask again) is
    logged and dropped. ``on_sent(nbytes)`` follows each blob sent. The thread serves until :meth:`close`; it alone
    uses the server's socket once started."""

    POLL_S = 0.2
    """How often the thread looks at its stop flag while no request comes."""
    decoder: Decoder

    def __init__(self, *, decoder: Decoder, handler: Callable[[Envelope], BlobReply], send_timeout_s: float,
                 on_sent: Callable[[int], None] | None = None) -> None:
        self.decoder = decoder
        self.handler = handler
        self.send_timeout_s = check_timeout(send_timeout_s)
        self.on_sent = on_sent
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _start(self) -> None:
        """Start serving (the concrete class, once bound)."""
        self._thread = threading.Thread(target=self._run, name=f"blob-server {self.endpoint}", daemon=True)
        self._thread.start()

    @abstractmethod
    def _recv_request(self, timeout_s: float) -> tuple[Any, Frame] | None:
        """(route back to the requester, frame), or None after ``timeout_s``."""

    @abstractmethod
    def _send_reply(self, route: Any, frames: list[Frame], timeout_s: float) -> None:
        """Raises BackpressureFull (the requester's pipe stays full) or PeerDead (it is gone)."""

    @abstractmethod
    def _close_socket(self) -> None: ...

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                got = self._recv_request(self.POLL_S)
                if got is not None:
                    self._handle(*got)
        finally:
            self._close_socket()

    def _handle(self, route: Any, frame: Frame) -> None:
        """Answer one request: the thread's work, and only the thread's (it sends on the server's socket)."""
        try:
            request = self.decoder.decode(frame)
        except ProtocolError:  # counted and logged (rate-limited) by the decoder
            return
        reply, raw = self.handler(request)
        if reply.reply_to != request.id:
            reply = msgspec.structs.replace(reply, reply_to=request.id)
        frames: list[Frame] = [encode(reply)]
        if raw is not None:
            raw = memoryview(raw).cast("B")
            if reply.body.nbytes != raw.nbytes:
                raise ValueError(f"header declares {reply.body.nbytes} bytes, blob has {raw.nbytes}")
            frames.append(raw)
        try:
            self._send_reply(route, frames, self.send_timeout_s)
        except TransportError as exc:
            log.warning("%s: could not answer %s: %s", self.endpoint, request.sender, exc)
            return
        if raw is not None and self.on_sent is not None:
            self.on_sent(raw.nbytes)

    def close(self) -> None:
        self._stop.set()
        if self._thread is None:
            self._close_socket()
        elif self._thread is not threading.current_thread():
            self._thread.join(timeout=5)


class Transport(ABC):
    """Factory of the endpoints of one transport; ``close`` closes every endpoint it made.

    ``peer``: the role at the other end of the socket (replay, verifier, rollout, learner): for a socket that
    binds, the only role allowed to connect; for one that connects, the role of the server it trusts. A
    transport that authenticates (ZeroMQ with CURVE, ``transport.security``) enforces it; one that does not
    (in-process) ignores it.

    ``endpoint`` strings are transport addresses ("tcp://127.0.0.1:5555", "ipc:///tmp/x"); a trailing
    ``*`` asks for a free one (random port), and the bound object's ``endpoint`` reports it.
    """

    @abstractmethod
    def sender(
        self, endpoint: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Sender: ...

    @abstractmethod
    def receiver(
        self, endpoint: str, *, decoder: Decoder, bind: bool = True, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Receiver: ...

    @abstractmethod
    def requester(
        self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Requester: ...

    @abstractmethod
    def replier(
        self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Replier: ...

    @abstractmethod
    def publisher(
        self, endpoint: str, *, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Publisher: ...

    @abstractmethod
    def subscriber(
        self, endpoint: str, *, decoder: Decoder, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> Subscriber: ...

    @abstractmethod
    def blob_requester(
        self, endpoint: str, *, decoder: Decoder, max_blob_bytes: int, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> BlobRequester:
        """Connected to the :class:`BlobServer` at ``endpoint``; closed by the caller, not by :meth:`close`."""

    @abstractmethod
    def blob_server(
        self, endpoint: str, *, decoder: Decoder, handler: Callable[[Envelope], BlobReply], send_timeout_s: float,
        on_sent: Callable[[int], None] | None = None, hwm: int = DEFAULT_HWM, peer: str | None = None,
    ) -> BlobServer:
        """Bound at ``endpoint`` and already serving ``handler`` from its thread."""

    def wait_any(self, endpoints: list[Receiver | Replier], timeout_s: float) -> None:
        """Return when one of ``endpoints`` (made by this transport) may have something to read, or after
        ``timeout_s``: one wait for a service that reads several sockets, instead of a poll of each in turn.
        This default looks every millisecond; a transport with a real poller overrides it."""
        deadline = time.monotonic() + check_timeout(timeout_s)
        while not any(e._has_input() for e in endpoints) and time.monotonic() < deadline:
            time.sleep(0.001)

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def connect_with_handshake(
    transport: Transport, endpoint: str, *, decoder: Decoder, name: str, timeout_s: float
) -> Requester:
    """A requester whose replier has answered READY; PeerTimeout (and nothing left open) otherwise."""
    req = transport.requester(endpoint, decoder=decoder, name=name)
    try:
        req.handshake(timeout_s)
    except BaseException:
        req.close()
        raise
    return req


class HeartbeatMonitor:
    """Last time each peer (``Envelope.sender``) was heard from; silent past ``dead_after_s`` = dead.

    Any envelope is proof of life (services send ``Heartbeat`` only when otherwise idle). A dead peer
    becomes alive again on its next envelope. Thread-safe.
    """

    def __init__(self, dead_after_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not dead_after_s > 0:
            raise ValueError(f"dead_after_s must be positive, got {dead_after_s}")
        self.dead_after_s = dead_after_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._dead: set[str] = set()
        self._lock = threading.Lock()

    @property
    def peers(self) -> list[str]:
        with self._lock:
            return sorted(self._last)

    def expect(self, peer: str) -> None:
        """Start a peer's clock before it has spoken (so one that never speaks is declared dead)."""
        with self._lock:
            self._last.setdefault(peer, self._clock())

    def observe(self, env_or_peer: Envelope | str) -> None:
        peer = env_or_peer if isinstance(env_or_peer, str) else env_or_peer.sender
        with self._lock:
            self._last[peer] = self._clock()
            revived = peer in self._dead
            self._dead.discard(peer)
        if revived:
            log.info("peer %s is alive again", peer)

    def forget(self, peer: str) -> None:
        with self._lock:
            self._last.pop(peer, None)
            self._dead.discard(peer)

    def silent_s(self, peer: str) -> float:
        """Seconds since ``peer`` was last heard from (KeyError if never expected or seen)."""
        with self._lock:
            return self._clock() - self._last[peer]

    def is_alive(self, peer: str) -> bool:
        with self._lock:
            last = self._last.get(peer)
            return last is not None and self._clock() - last <= self.dead_after_s

    def dead_peers(self) -> list[str]:
        now = self._clock()
        with self._lock:
            dead = sorted(p for p, t in self._last.items() if now - t > self.dead_after_s)
            newly = [p for p in dead if p not in self._dead]
            self._dead.update(newly)
        for p in newly:
            log.warning("peer %s is dead (no envelope for %.3g s)", p, self.dead_after_s)
        return dead

    def check(self, peer: str | None = None) -> None:
        """Raise PeerDead for ``peer`` (or for the first dead peer) if it is past its deadline."""
        if peer is None:
            dead = self.dead_peers()
            if dead:
                raise PeerDead(dead[0], self.silent_s(dead[0]))
            return
        with self._lock:
            last = self._last.get(peer)
            silent = math.inf if last is None else self._clock() - last
        if silent > self.dead_after_s:
            with self._lock:
                self._dead.add(peer)
            raise PeerDead(peer, silent)
