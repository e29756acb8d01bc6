"""ZeroMQ implementation of the transport interfaces, and the raw-bytes path for weights.

Sockets of a deployment (HWM per side, in messages; the stable service binds, the others connect):

=====================  ===========  ========  ===========================  ============================================
link                   pattern      binds     at the HWM                   timeouts and liveness
=====================  ===========  ========  ===========================  ============================================
rollout -> verifier    PUSH/PULL    verifier  PUSH blocks -> send polls    send: timeout_s then BackpressureFull [1];
(GroupsMsg)                                   POLLOUT, BackpressureFull    recv: poll timeout_s, None; Heartbeat on the
                                                                           pipe when idle -> HeartbeatMonitor
verifier -> replay     PUSH/PULL    replay    same                         same
(GroupsMsg)
learner <-> replay     DEALER/      replay    DEALER IMMEDIATE=1 [2];      request: one timeout_s for send + reply,
(BatchRequest ->       ROUTER                 ROUTER_MANDATORY: reply to   PeerTimeout; late replies discarded by
 BatchMsg, Ready)                             full/gone peer raises [3]    reply_to; READY handshake at start
learner -> rollouts    XPUB/SUB     learner   PUB drops (learner never     recv: poll timeout_s; wait_for_subscribers
(WeightsAnnounce,                             blocks on a slow rollout)    is the slow-joiner handshake; latest
 Heartbeat, Shutdown)                         [4]                          re-sent to each new subscriber [4]
rollout -> learner     PUSH/PULL    learner   as rollout -> verifier       as rollout -> verifier
(WeightsAck)
weights fetch          DEALER/      learner   ROUTER_MANDATORY; at most   [header, raw] frames: header <= max_bytes,
(WeightsFetch ->       ROUTER       (thread)  4 chunk requests in flight   raw <= chunk bytes and == header nbytes,
 TensorHeader + raw,   (blob_*)               per engine (credit window)   crc32 verified [5]; each wait timeout_s,
 or Ack(ok=False))                            [3]                          then PeerTimeout
=====================  ===========  ========  ===========================  ============================================

[1] The sender handles BackpressureFull by a named policy (the rollout holds generation). A PUSH/PULL
    pipe cannot lose a message to a slow joiner: a connected PUSH queues until its PULL is up.
[2] Nothing is queued for a peer that is not connected, so a dead replay is a PeerTimeout, not a backlog
    delivered later.
[3] BackpressureFull (the requester's pipe is full) or PeerDead (it is gone), instead of a silent drop.
[4] A dropped or missed announce is recovered: XPUB sees each join and re-sends the latest envelope, and
    the learner's periodic Heartbeat repeats ``weights``.
[5] ``ZmqBlobRequester`` / ``ZmqBlobServer`` (``interface.BlobRequester`` / ``BlobServer``), and
    ``send_tensor_blob`` / ``recv_tensor_blob`` on a plain socket; the raw frame is sent zero-copy.

Every socket: ``linger=0`` (close never waits, so it drops what is still queued: a sender that must
deliver its last messages waits for the peer's Ack before closing), TCP keepalive (an idle connection to a host that
has gone is closed), every receive behind a poll with a timeout, every send non-blocking plus a bounded poll. The
request/reply sockets (DEALER/ROUTER) also have ZMTP heartbeats (``HEARTBEAT_IVL`` 1 s, ``HEARTBEAT_TIMEOUT`` 3 s),
so a vanished peer is disconnected instead of holding a pipe open. The streams (PUSH/PULL, XPUB/SUB) have none:
their readers stall by design (a verifier checking, a rollout evaluating), and libzmq drops a connection whose
reader has stalled with a full pipe for the heartbeat timeout, losing what was in flight (:func:`make_socket`). On
them a peer process that dies is seen when its kernel closes the connection, and a host that has gone by TCP
keepalive on an idle connection (about 25 s) or, with data unacknowledged, by the kernel's retransmission limit
(``tcp_retries2``, about 15 minutes); whether a rollout is alive the learner decides from the rollout's own
heartbeats (``HeartbeatMonitor``, ``cluster.wire.peer_dead_s``).
One shared :func:`shared_context` per process; sockets belong to one thread each.

A hard cap at the ZMTP layer (``zmq.MAXMSGSIZE``) is deliberately not set: it disconnects the peer
silently, whereas the decoder's size check rejects the frame, counts it and keeps the connection.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq

from async_vapo.transport.interface import (
    DEFAULT_HWM,
    BackpressureFull,
    BlobReply,
    BlobRequester,
    BlobServer,
    Frame,
    PeerDead,
    PeerTimeout,
    Publisher,
    Receiver,
    Replier,
    Requester,
    Sender,
    Subscriber,
    Transport,
    check_blob,
    check_timeout,
)

# the checksums live with the blob checks in ``interface``; still importable from here, as before
from async_vapo.transport.interface import blob_checksum as blob_checksum
from async_vapo.transport.interface import verify_checksum as verify_checksum
from async_vapo.transport.messages import (
    Decoder,
    Envelope,
    Ready,
    TensorHeader,
    TransportError,
    WeightsAnnounce,
    encode,
)
from async_vapo.transport.security import Security

ZMTP_HEARTBEAT_IVL_MS = 1000
ZMTP_HEARTBEAT_TIMEOUT_MS = 3000
TCP_KEEPALIVE_IDLE_S, TCP_KEEPALIVE_INTVL_S, TCP_KEEPALIVE_CNT = 10, 5, 3
"""Kernel keepalive on every TCP connection: an idle connection to a host that has gone is closed after about 25 s.
The kernel answers the probes, so a reader that stalls is never taken for a dead peer."""


def shared_context() -> zmq.Context:
    """The process's context (pyzmq makes a fresh one in a forked child)."""
    return zmq.Context.instance()


MAXMSGSIZE_SLACK = 64 * 1024
"""A receiving socket's ``ZMQ_MAXMSGSIZE`` is its decoder's ``max_bytes`` plus this: a frame a little over the
limit still reaches the decoder and is counted ("oversized"); a larger one never gets allocated (libzmq
disconnects its sender, which reconnects)."""


XPUB_MAX_SUBSCRIPTION_BYTES = 4096
"""Largest message a publisher accepts from a subscriber: its subscribers subscribe to everything (1 byte), and
the CURVE handshake's INITIATE command (a few hundred bytes) is bounded by the same limit."""


def frame_cap(decoder: Decoder) -> int:
    return decoder.max_bytes + MAXMSGSIZE_SLACK


def make_socket(ctx: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM, max_msg_bytes: int | None = None,
                zmtp_heartbeats: bool = True) -> zmq.Socket:
    """A socket with this project's options: linger 0, HWMs, TCP keepalive, ZMTP heartbeats unless
    ``zmtp_heartbeats`` is False, and (``max_msg_bytes``) the largest inbound frame libzmq accepts: a peer sending a
    larger one is disconnected before the frame is allocated.

    Streams whose reader may stall while its pipe is full (PUSH/PULL, XPUB/SUB) go without ZMTP heartbeats: at the
    high-water mark libzmq stops reading the connection, PINGs go unanswered, and after ``HEARTBEAT_TIMEOUT`` both ends
    drop it, losing what was in the kernel's buffers; on a SUB the reconnect can also abort libzmq at the reader's
    next receive (``Assertion failed: _input_stopped``, libzmq 4.3.5, zeromq/libzmq#3937). What tells a dead peer
    there instead: the module docstring."""
    if hwm < 1:
        raise ValueError(f"hwm must be >= 1, got {hwm}")
    sock = ctx.socket(kind)
    if max_msg_bytes is not None:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, TCP_KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, TCP_KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, TCP_KEEPALIVE_CNT)
    if zmtp_heartbeats:
        sock.setsockopt(zmq.HEARTBEAT_IVL, ZMTP_HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ZMTP_HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, ZMTP_HEARTBEAT_TIMEOUT_MS)
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the endpoint actually bound ("tcp://127.0.0.1:*" -> a free port)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot bind {endpoint}: {exc}") from exc
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def bind_to_random_port(sock: zmq.Socket, host: str = "tcp://127.0.0.1") -> str:
    """Bind to a port the OS picks (no probe-then-bind race) and return the full endpoint."""
    return bind(sock, f"{host}:*")


def connect(sock: zmq.Socket, endpoint: str) -> str:
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise TransportError(f"cannot connect to {endpoint}: {exc}") from exc
    return endpoint


def _ms(seconds: float) -> int:
    return max(0, math.ceil(seconds * 1000))


def _attach(sock: zmq.Socket, endpoint: str, do_bind: bool, security: Security | None = None,
            peer: str | None = None) -> str:
    """Bind or connect ``sock``; under CURVE (``security``) first make it a server admitting only role ``peer``
    (bind) or a client trusting only role ``peer``'s key (connect)."""
    try:
        if security is not None:
            (security.server if do_bind else security.client)(sock, peer)
        return bind(sock, endpoint) if do_bind else connect(sock, endpoint)
    except BaseException:
        sock.close(linger=0)
        raise


def send_until(sock: zmq.Socket, frames: list, deadline: float, *, track: bool = False):
    """Send a (multipart) message without blocking past ``deadline``; None if it stayed full."""
    while True:
        try:
            if len(frames) == 1:
                return sock.send(frames[0], zmq.NOBLOCK, copy=False, track=track) or True
            return sock.send_multipart(frames, zmq.NOBLOCK, copy=False, track=track) or True
        except zmq.Again:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(_ms(remaining), zmq.POLLOUT):
            return None


def recv_parts(sock: zmq.Socket, deadline: float) -> list[zmq.Frame] | None:
    while True:
        try:
            return sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(_ms(remaining), zmq.POLLIN):
            return None


def _recv_single(sock: zmq.Socket, decoder: Decoder, timeout_s: float, nparts: int = 1) -> list[Frame] | None:
    """The next message with exactly ``nparts`` frames (others are counted as malformed and skipped)."""
    deadline = time.monotonic() + check_timeout(timeout_s)
    while True:
        parts = recv_parts(sock, deadline)
        if parts is None:
            return None
        if len(parts) == nparts:
            return [p.buffer for p in parts]
        decoder.reject("malformed", f"{len(parts)} frames where {nparts} expected")


class ZmqSender(Sender):
    def __init__(self, ctx: zmq.Context, endpoint: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
                 security: Security | None = None, peer: str | None = None) -> None:
        self._sock = make_socket(ctx, zmq.PUSH, hwm=hwm, zmtp_heartbeats=False)
        self.endpoint = _attach(self._sock, endpoint, bind, security, peer)

    def send_frame(self, frame: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        if send_until(self._sock, [frame], deadline) is None:
            raise BackpressureFull(self.endpoint, timeout_s)

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqReceiver(Receiver):
    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, bind: bool = True, hwm: int = DEFAULT_HWM,
        security: Security | None = None, peer: str | None = None,
    ) -> None:
        self.decoder = decoder
        self._sock = make_socket(ctx, zmq.PULL, hwm=hwm, max_msg_bytes=frame_cap(decoder), zmtp_heartbeats=False)
        self.endpoint = _attach(self._sock, endpoint, bind, security, peer)

    def recv_frame(self, timeout_s: float) -> Frame | None:
        parts = _recv_single(self._sock, self.decoder, timeout_s)
        return None if parts is None else parts[0]

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqRequester(Requester):
    """DEALER (not REQ): a request that times out leaves no send/recv state machine to wedge."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        security: Security | None = None, peer: str | None = None,
    ) -> None:
        self.name = name
        self.decoder = decoder.with_allowed(Ready)
        self._sock = make_socket(ctx, zmq.DEALER, hwm=hwm, max_msg_bytes=frame_cap(decoder))
        self._sock.setsockopt(zmq.IMMEDIATE, 1)
        self.endpoint = _attach(self._sock, endpoint, False, security, peer)

    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        return send_until(self._sock, [frame], time.monotonic() + timeout_s) is not None

    def _recv_reply(self, timeout_s: float) -> Frame | None:
        parts = _recv_single(self._sock, self.decoder, timeout_s)
        return None if parts is None else parts[0]

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqReplier(Replier):
    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        security: Security | None = None, peer: str | None = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.decoder = decoder.with_allowed(Ready)
        self._sock = make_socket(ctx, zmq.ROUTER, hwm=hwm, max_msg_bytes=frame_cap(decoder))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = _attach(self._sock, endpoint, True, security, peer)

    def _recv_request(self, timeout_s: float) -> tuple[bytes, Frame] | None:
        parts = _recv_single(self._sock, self.decoder, timeout_s, nparts=2)
        return None if parts is None else (bytes(parts[0]), parts[1])

    def _send_reply(self, route: bytes, frame: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock.send_multipart([route, frame], zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # ROUTER_MANDATORY: this requester's pipe is full
                if time.monotonic() >= deadline:
                    raise BackpressureFull(f"{self.endpoint} -> {route.hex()}", timeout_s) from None
                time.sleep(0.001)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EHOSTUNREACH:
                    raise PeerDead(route.hex()) from None
                raise

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqPublisher(Publisher):
    """XPUB, so subscriptions are visible: they drive the READY handshake and the re-send of the latest."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, hwm: int = DEFAULT_HWM,
                 security: Security | None = None, peer: str | None = None) -> None:
        self.subscribers_seen = 0
        self._latest: bytes | None = None
        # It receives only subscriptions, and ours are to everything (one byte). libzmq keeps subscriptions in a
        # trie that it frees recursively, one level per byte: a peer subscribing to a 64 KiB topic crashed the
        # process (stack overflow in libzmq's reaper thread) when it disconnected.
        self._sock = make_socket(ctx, zmq.XPUB, hwm=hwm, max_msg_bytes=XPUB_MAX_SUBSCRIPTION_BYTES,
                                 zmtp_heartbeats=False)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.endpoint = _attach(self._sock, endpoint, True, security, peer)

    def _send(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # only with XPUB_NODROP, which is not set; PUB drops at HWM
            pass

    def pump(self) -> int:
        new = 0
        while True:
            try:
                event = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            new += event[:1] == b"\x01"
        self.subscribers_seen += new
        if new and self._latest is not None:
            self._send(self._latest)
        return new

    def publish(self, env: Envelope) -> None:
        self.pump()
        self._latest = encode(env)
        self._send(self._latest)

    def wait_for_subscribers(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        self.pump()
        while self.subscribers_seen < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeout(self.endpoint, timeout_s, f"{n} subscriptions (saw {self.subscribers_seen})")
            self._sock.poll(_ms(remaining), zmq.POLLIN)
            self.pump()

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqSubscriber(Subscriber):
    def __init__(self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, hwm: int = DEFAULT_HWM,
                 security: Security | None = None, peer: str | None = None) -> None:
        self.decoder = decoder
        self._sock = make_socket(ctx, zmq.SUB, hwm=hwm, max_msg_bytes=frame_cap(decoder), zmtp_heartbeats=False)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = _attach(self._sock, endpoint, False, security, peer)

    def recv_frame(self, timeout_s: float) -> Frame | None:
        parts = _recv_single(self._sock, self.decoder, timeout_s)
        return None if parts is None else parts[0]

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqBlobRequester(BlobRequester):
    """DEALER, connected. No ``IMMEDIATE``: the first requests may wait in the pipe for the connection, as a fetch's
    do. Inbound frames are capped at the larger of the decoder's limit and a blob."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, max_blob_bytes: int, hwm: int = DEFAULT_HWM,
        security: Security | None = None, peer: str | None = None,
    ) -> None:
        self.decoder = decoder
        self.max_blob_bytes = max_blob_bytes
        self._sock = make_socket(ctx, zmq.DEALER, hwm=hwm,
                                 max_msg_bytes=max(frame_cap(decoder), max_blob_bytes + 4096))
        self.endpoint = _attach(self._sock, endpoint, False, security, peer)

    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        return send_until(self._sock, [frame], time.monotonic() + timeout_s) is not None

    def _recv_reply(self, timeout_s: float) -> list[Frame] | None:
        parts = recv_parts(self._sock, time.monotonic() + timeout_s)
        return None if parts is None else [p.buffer for p in parts]

    def close(self) -> None:
        self._sock.close(linger=0)


class ZmqBlobServer(BlobServer):
    """ROUTER, bound, with ``ROUTER_MANDATORY``: a reply to a requester that has gone raises PeerDead (logged by
    the thread, which keeps serving) instead of vanishing. Requests of another number of frames than two (identity,
    envelope) are counted as malformed and skipped. The blob goes out zero-copy."""

    def __init__(
        self, ctx: zmq.Context, endpoint: str, *, decoder: Decoder, handler: Callable[[Envelope], BlobReply],
        send_timeout_s: float, on_sent: Callable[[int], None] | None = None, hwm: int = DEFAULT_HWM,
        security: Security | None = None, peer: str | None = None,
    ) -> None:
        super().__init__(decoder=decoder, handler=handler, send_timeout_s=send_timeout_s, on_sent=on_sent)
        self._sock = make_socket(ctx, zmq.ROUTER, hwm=hwm, max_msg_bytes=frame_cap(decoder))
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.endpoint = _attach(self._sock, endpoint, True, security, peer)
        self._start()

    def _recv_request(self, timeout_s: float) -> tuple[bytes, Frame] | None:
        parts = _recv_single(self._sock, self.decoder, timeout_s, nparts=2)
        return None if parts is None else (bytes(parts[0]), parts[1])

    def _send_reply(self, route: bytes, frames: list[Frame], timeout_s: float) -> None:
        try:
            sent = send_until(self._sock, [route, *frames], time.monotonic() + timeout_s)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerDead(route.hex()) from None
            raise TransportError(f"{self.endpoint} -> {route.hex()}: {exc}") from exc
        if sent is None:
            raise BackpressureFull(f"{self.endpoint} -> {route.hex()}", timeout_s)

    def _close_socket(self) -> None:
        self._sock.close(linger=0)


class ZmqTransport(Transport):
    """Makes ZeroMQ endpoints on one context (default: the process's shared one). With ``security`` every
    socket is CURVE-authenticated and encrypted, and each one names the role at its other end (``peer``):
    the role allowed to connect to a bound socket, or the role of the server a socket connects to
    (``transport.security``). Without it ``peer`` is ignored."""

    def __init__(self, ctx: zmq.Context | None = None, *, security: Security | None = None) -> None:
        self.ctx = ctx if ctx is not None else shared_context()
        self.security = security
        self._made: list = []

    def _keep(self, obj):
        self._made.append(obj)
        return obj

    def _sec(self, peer: str | None) -> dict:
        return {"security": self.security, "peer": peer}

    def sender(self, endpoint: str, *, bind: bool = False, hwm: int = DEFAULT_HWM, peer: str | None = None
               ) -> ZmqSender:
        return self._keep(ZmqSender(self.ctx, endpoint, bind=bind, hwm=hwm, **self._sec(peer)))

    def receiver(
        self, endpoint: str, *, decoder: Decoder, bind: bool = True, hwm: int = DEFAULT_HWM, peer: str | None = None
    ) -> ZmqReceiver:
        return self._keep(ZmqReceiver(self.ctx, endpoint, decoder=decoder, bind=bind, hwm=hwm, **self._sec(peer)))

    def requester(self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
                  peer: str | None = None) -> ZmqRequester:
        return self._keep(ZmqRequester(self.ctx, endpoint, decoder=decoder, name=name, hwm=hwm, **self._sec(peer)))

    def replier(self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
                peer: str | None = None) -> ZmqReplier:
        return self._keep(ZmqReplier(self.ctx, endpoint, decoder=decoder, name=name, hwm=hwm, **self._sec(peer)))

    def publisher(self, endpoint: str, *, hwm: int = DEFAULT_HWM, peer: str | None = None) -> ZmqPublisher:
        return self._keep(ZmqPublisher(self.ctx, endpoint, hwm=hwm, **self._sec(peer)))

    def subscriber(self, endpoint: str, *, decoder: Decoder, hwm: int = DEFAULT_HWM, peer: str | None = None
                   ) -> ZmqSubscriber:
        return self._keep(ZmqSubscriber(self.ctx, endpoint, decoder=decoder, hwm=hwm, **self._sec(peer)))

    def blob_requester(self, endpoint: str, *, decoder: Decoder, max_blob_bytes: int, hwm: int = DEFAULT_HWM,
                       peer: str | None = None) -> ZmqBlobRequester:
        return ZmqBlobRequester(self.ctx, endpoint, decoder=decoder, max_blob_bytes=max_blob_bytes, hwm=hwm,
                                **self._sec(peer))

    def blob_server(self, endpoint: str, *, decoder: Decoder, handler: Callable[[Envelope], BlobReply],
                    send_timeout_s: float, on_sent: Callable[[int], None] | None = None, hwm: int = DEFAULT_HWM,
                    peer: str | None = None) -> ZmqBlobServer:
        return self._keep(ZmqBlobServer(self.ctx, endpoint, decoder=decoder, handler=handler,
                                        send_timeout_s=send_timeout_s, on_sent=on_sent, hwm=hwm, **self._sec(peer)))

    def wait_any(self, endpoints: list, timeout_s: float) -> None:
        poller = zmq.Poller()
        for e in endpoints:
            poller.register(e._sock, zmq.POLLIN)
        poller.poll(_ms(check_timeout(timeout_s)))

    def close(self) -> None:
        made, self._made = self._made, []
        for obj in made:
            obj.close()


# ---- raw-bytes path for big payloads (weights) -------------------------------------------------

def _as_bytes_view(blob) -> memoryview:
    view = memoryview(blob)
    if not view.c_contiguous:
        raise ValueError("blob must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def send_tensor_blob(
    sock: zmq.Socket, header_env: Envelope, blob, *, timeout_s: float, route: bytes | None = None
) -> zmq.MessageTracker:
    """Send ``[header, raw]`` without copying ``blob``; ``route`` prefixes a ROUTER identity.

    The header's body (TensorHeader or WeightsAnnounce) must declare ``nbytes == len(blob)``. Do not
    modify ``blob`` until the returned tracker is done (zero-copy: ZeroMQ reads it in the background).
    Raises BackpressureFull if the socket stays full for ``timeout_s``.
    """
    view = _as_bytes_view(blob)
    body = header_env.body
    if not isinstance(body, (TensorHeader, WeightsAnnounce)):
        raise TypeError(f"a blob header is a TensorHeader or WeightsAnnounce, got {type(body).__name__}")
    if body.nbytes != view.nbytes:
        raise ValueError(f"header declares {body.nbytes} bytes, blob has {view.nbytes}")
    frames = ([route] if route is not None else []) + [encode(header_env), view]
    tracker = send_until(sock, frames, time.monotonic() + check_timeout(timeout_s), track=True)
    if tracker is None:
        raise BackpressureFull(sock.getsockopt_string(zmq.LAST_ENDPOINT) or "blob socket", timeout_s)
    return tracker


def recv_tensor_blob(
    sock: zmq.Socket, decoder: Decoder, *, timeout_s: float, max_blob_bytes: int, verify: bool = True
) -> tuple[Envelope, memoryview] | None:
    """The next ``(header, raw)``, or None after ``timeout_s``.

    Checks, each counted in ``decoder.rejects`` and raised as ProtocolError: two frames ("malformed"),
    raw frame <= max_blob_bytes ("oversized"), the header through ``decoder`` (its size limit first),
    a blob header type ("not_allowed"), declared nbytes == received ("malformed"), checksum
    ("malformed"). The returned view keeps the received frame alive without a copy.
    """
    deadline = time.monotonic() + check_timeout(timeout_s)
    parts = recv_parts(sock, deadline)
    if parts is None:
        return None
    if len(parts) != 2:
        raise decoder.reject("malformed", f"blob message of {len(parts)} frames")
    return check_blob(parts[0].buffer, parts[1].buffer, decoder, max_blob_bytes=max_blob_bytes, verify=verify)
