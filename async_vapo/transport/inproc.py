"""In-process transport: the same interfaces, timeouts and named errors as ZeroMQ, on ``queue.Queue``.

Every service takes its transport, so the whole pipeline (rollout -> verifier -> replay -> learner) runs
in one process on this one (tests/integration/test_pipeline.py); unit tests use it too. Envelopes still go
through ``encode`` and the receiving socket's ``Decoder``, so everything in-process exercises the wire
format and its checks.

Mapping to the ZeroMQ behaviour (see ``zmq_transport``):

* pipe (Sender/Receiver): one bounded queue per endpoint, ``maxsize`` = HWM of whichever side
  created it (the receiver, when it exists first). A full queue blocks ``send`` for at most
  ``timeout_s``, then BackpressureFull. Senders may come before the receiver (their frames wait, as
  with a connected PUSH); two *binding* receivers on one endpoint are an error ("address in use"),
  several connecting receivers share the queue (load-balanced, as PULLs on a bound PUSH).
* request/reply: the requester's own bounded inbox travels with each request as its route; a
  replier that never answers, or does not exist, costs the requester one PeerTimeout. A reply to a
  closed requester raises PeerDead, to a full one BackpressureFull.
* publish/subscribe: each subscriber has a bounded inbox; ``publish`` drops for a full subscriber
  (counted in ``dropped``) and never blocks; new subscribers get the latest envelope on ``pump``.
* blobs (BlobRequester/BlobServer): as request/reply, a reply being the list of its frames; the server's
  thread reads the endpoint's request queue. A blob is passed as the bytes the handler made (``bytes`` are
  immutable; a view is copied), so the requester's checks see what a socket would have carried.

Endpoints are plain names; a trailing ``*`` is replaced by a fresh unique suffix. Thread-safe at
the hub; each endpoint object belongs to one thread.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

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
    check_timeout,
)
from async_vapo.transport.messages import Decoder, Envelope, Ready, TransportError, encode


class _Inbox:
    """A bounded queue its owner can close (so writers can tell a gone peer from a full one)."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"hwm must be >= 1, got {maxsize}")
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.closed = False

    def get(self, timeout_s: float) -> Any | None:
        try:
            return self.q.get(timeout=timeout_s) if timeout_s > 0 else self.q.get_nowait()
        except queue.Empty:
            return None

    def put(self, item: Any, timeout_s: float) -> bool:
        try:
            if timeout_s > 0:
                self.q.put(item, timeout=timeout_s)
            else:
                self.q.put_nowait(item)
        except queue.Full:
            return False
        return True


class _Closable:
    _closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.endpoint} is closed")


class InprocSender(_Closable, Sender):
    def __init__(self, hub: InprocTransport, endpoint: str, bind: bool, hwm: int) -> None:
        self._hub = hub
        self._bound = bind
        self.endpoint = hub._claim(endpoint) if bind else endpoint
        self._inbox = hub._pipe(self.endpoint, hwm)

    def send_frame(self, frame: bytes, timeout_s: float) -> None:
        self._check_open()
        if not self._inbox.put(bytes(frame), check_timeout(timeout_s)):
            raise BackpressureFull(self.endpoint, timeout_s)

    def close(self) -> None:
        if not self._closed and self._bound:
            self._hub._release(self.endpoint)
        self._closed = True


class InprocReceiver(_Closable, Receiver):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, bind: bool, hwm: int) -> None:
        self.decoder = decoder
        self._hub = hub
        self._bound = bind
        self.endpoint = hub._claim(endpoint) if bind else endpoint
        self._inbox = hub._pipe(self.endpoint, hwm)

    def recv_frame(self, timeout_s: float) -> Frame | None:
        self._check_open()
        return self._inbox.get(check_timeout(timeout_s))

    def _has_input(self) -> bool:
        return not self._inbox.q.empty()

    def close(self) -> None:
        if not self._closed and self._bound:
            self._hub._release(self.endpoint)
        self._closed = True


class InprocRequester(_Closable, Requester):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, name: str, hwm: int) -> None:
        self.endpoint = endpoint
        self.name = name
        self.decoder = decoder.with_allowed(Ready)
        self._requests = hub._request_queue(endpoint, hwm)
        self._inbox = _Inbox(hwm)

    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        self._check_open()
        return self._requests.put((self._inbox, bytes(frame)), timeout_s)

    def _recv_reply(self, timeout_s: float) -> Frame | None:
        return self._inbox.get(timeout_s)

    def close(self) -> None:
        self._closed = True
        self._inbox.closed = True


class InprocReplier(_Closable, Replier):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, name: str, hwm: int) -> None:
        super().__init__()
        self.name = name
        self.decoder = decoder.with_allowed(Ready)
        self._hub = hub
        self.endpoint = hub._claim(endpoint)
        self._requests = hub._request_queue(self.endpoint, hwm)

    def _recv_request(self, timeout_s: float) -> tuple[_Inbox, Frame] | None:
        self._check_open()
        return self._requests.get(timeout_s)

    def _has_input(self) -> bool:
        return not self._requests.q.empty()

    def _send_reply(self, route: _Inbox, frame: bytes, timeout_s: float) -> None:
        self._check_open()
        if route.closed:
            raise PeerDead(f"requester of {self.endpoint}")
        if not route.put(frame, timeout_s):
            raise BackpressureFull(f"{self.endpoint} -> requester", timeout_s)

    def close(self) -> None:
        if not self._closed:
            self._hub._release(self.endpoint)
        self._closed = True


class InprocBlobRequester(_Closable, BlobRequester):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, max_blob_bytes: int, hwm: int) -> None:
        self.endpoint = endpoint
        self.decoder = decoder
        self.max_blob_bytes = max_blob_bytes
        self._requests = hub._request_queue(endpoint, hwm)
        self._inbox = _Inbox(hwm)

    def _send_request(self, frame: bytes, timeout_s: float) -> bool:
        self._check_open()
        return self._requests.put((self._inbox, bytes(frame)), timeout_s)

    def _recv_reply(self, timeout_s: float) -> list[Frame] | None:
        self._check_open()
        return self._inbox.get(timeout_s)

    def close(self) -> None:
        self._closed = True
        self._inbox.closed = True


class InprocBlobServer(_Closable, BlobServer):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, handler: Callable[[Envelope], BlobReply],
                 send_timeout_s: float, on_sent: Callable[[int], None] | None, hwm: int) -> None:
        super().__init__(decoder=decoder, handler=handler, send_timeout_s=send_timeout_s, on_sent=on_sent)
        self._hub = hub
        self.endpoint = hub._claim(endpoint)
        self._requests = hub._request_queue(self.endpoint, hwm)
        self._start()

    def _recv_request(self, timeout_s: float) -> tuple[_Inbox, Frame] | None:
        return self._requests.get(timeout_s)

    def _send_reply(self, route: _Inbox, frames: list[Frame], timeout_s: float) -> None:
        if route.closed:
            raise PeerDead(f"requester of {self.endpoint}")
        if not route.put([bytes(f) for f in frames], timeout_s):
            raise BackpressureFull(f"{self.endpoint} -> requester", timeout_s)

    def _close_socket(self) -> None:
        if not self._closed:
            self._hub._release(self.endpoint)
        self._closed = True


class _Topic:
    def __init__(self) -> None:
        self.subscribers: list[_Inbox] = []
        self.joined: list[_Inbox] = []


class InprocPublisher(_Closable, Publisher):
    def __init__(self, hub: InprocTransport, endpoint: str, hwm: int) -> None:
        self._hub = hub
        self.endpoint = hub._claim(endpoint)
        self._topic = hub._topic(self.endpoint)
        self.subscribers_seen = 0
        self.dropped = 0
        self._latest: bytes | None = None

    def _deliver(self, inboxes: list[_Inbox], frame: bytes) -> None:
        for inbox in inboxes:
            if not inbox.closed and not inbox.put(frame, 0):
                self.dropped += 1

    def pump(self) -> int:
        self._check_open()
        with self._hub._lock:
            new, self._topic.joined = self._topic.joined, []
            self._topic.subscribers = [s for s in self._topic.subscribers if not s.closed]
        self.subscribers_seen += len(new)
        if new and self._latest is not None:
            self._deliver(self._topic.subscribers, self._latest)
        return len(new)

    def publish(self, env: Envelope) -> None:
        self.pump()
        self._latest = encode(env)
        with self._hub._lock:
            subscribers = list(self._topic.subscribers)
        self._deliver(subscribers, self._latest)

    def wait_for_subscribers(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + check_timeout(timeout_s)
        self.pump()
        while self.subscribers_seen < n:
            if time.monotonic() >= deadline:
                raise PeerTimeout(self.endpoint, timeout_s, f"{n} subscriptions (saw {self.subscribers_seen})")
            time.sleep(0.002)
            self.pump()

    def close(self) -> None:
        if not self._closed:
            self._hub._release(self.endpoint)
        self._closed = True


class InprocSubscriber(_Closable, Subscriber):
    def __init__(self, hub: InprocTransport, endpoint: str, decoder: Decoder, hwm: int) -> None:
        self.endpoint = endpoint
        self.decoder = decoder
        self._inbox = _Inbox(hwm)
        with hub._lock:
            topic = hub._topic(endpoint)
            topic.subscribers.append(self._inbox)
            topic.joined.append(self._inbox)

    def recv_frame(self, timeout_s: float) -> Frame | None:
        self._check_open()
        return self._inbox.get(check_timeout(timeout_s))

    def _has_input(self) -> bool:
        return not self._inbox.q.empty()

    def close(self) -> None:
        self._closed = True
        self._inbox.closed = True


class InprocTransport(Transport):
    """The hub of one process's in-process endpoints (create one and share it; no global state)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._pipes: dict[str, _Inbox] = {}
        self._requests: dict[str, _Inbox] = {}
        self._topics: dict[str, _Topic] = {}
        self._bound: set[str] = set()
        self._ids = itertools.count(1)
        self._made: list = []

    # hub bookkeeping (used by the endpoint classes)
    def _claim(self, endpoint: str) -> str:
        with self._lock:
            if endpoint.endswith("*"):
                endpoint = f"{endpoint[:-1]}inproc-{next(self._ids)}"
            if endpoint in self._bound:
                raise TransportError(f"cannot bind {endpoint}: address in use")
            self._bound.add(endpoint)
            return endpoint

    def _release(self, endpoint: str) -> None:
        # Queues outlive their binder, as ZeroMQ peers reconnect to a re-bound endpoint.
        with self._lock:
            self._bound.discard(endpoint)

    def _pipe(self, endpoint: str, hwm: int) -> _Inbox:
        with self._lock:
            if endpoint not in self._pipes:
                self._pipes[endpoint] = _Inbox(hwm)
            return self._pipes[endpoint]

    def _request_queue(self, endpoint: str, hwm: int) -> _Inbox:
        with self._lock:
            if endpoint not in self._requests:
                self._requests[endpoint] = _Inbox(hwm)
            return self._requests[endpoint]

    def _topic(self, endpoint: str) -> _Topic:
        with self._lock:
            if endpoint not in self._topics:
                self._topics[endpoint] = _Topic()
            return self._topics[endpoint]

    def _keep(self, obj):
        self._made.append(obj)
        return obj

    # the Transport interface
    def sender(
        self, endpoint: str, *, bind: bool = False, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocSender:
        return self._keep(InprocSender(self, endpoint, bind, hwm))

    def receiver(
        self, endpoint: str, *, decoder: Decoder, bind: bool = True, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocReceiver:
        return self._keep(InprocReceiver(self, endpoint, decoder, bind, hwm))

    def requester(
        self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocRequester:
        return self._keep(InprocRequester(self, endpoint, decoder, name, hwm))

    def replier(
        self, endpoint: str, *, decoder: Decoder, name: str, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocReplier:
        return self._keep(InprocReplier(self, endpoint, decoder, name, hwm))

    def publisher(
        self, endpoint: str, *, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocPublisher:
        return self._keep(InprocPublisher(self, endpoint, hwm))

    def subscriber(
        self, endpoint: str, *, decoder: Decoder, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocSubscriber:
        return self._keep(InprocSubscriber(self, endpoint, decoder, hwm))

    def blob_requester(
        self, endpoint: str, *, decoder: Decoder, max_blob_bytes: int, hwm: int = DEFAULT_HWM,
        peer: str | None = None,
    ) -> InprocBlobRequester:
        return InprocBlobRequester(self, endpoint, decoder, max_blob_bytes, hwm)

    def blob_server(
        self, endpoint: str, *, decoder: Decoder, handler: Callable[[Envelope], BlobReply], send_timeout_s: float,
        on_sent: Callable[[int], None] | None = None, hwm: int = DEFAULT_HWM, peer: str | None = None,
    ) -> InprocBlobServer:
        return self._keep(InprocBlobServer(self, endpoint, decoder, handler, send_timeout_s, on_sent, hwm))

    def close(self) -> None:
        made, self._made = self._made, []
        for obj in made:
            obj.close()
