"""The engine's side of the weight protocol, the mirror of the learner's ``sync.WeightBroadcast``.

Sockets (from the service's transport)
  * ``weights``: SUB, connects to the learner's XPUB (``cluster.hosts.learner_host:weights_port``);
    WeightsAnnounce, WeightsGroupOffer, Shutdown, and Heartbeat whose ``weights`` repeats the latest announce (a
    missed announce is recovered within ``cluster.wire.heartbeat_s``; XPUB also re-sends the latest to a new
    subscriber).
  * ``acks``: PUSH, connects to the learner's PULL (``cluster.ports.acks_port``); one WeightsAck per load (ok or not,
    with load seconds and the way it came) — the first one, for the served version at start, registers the engine —
    WeightsGroupJoin when the engine asks for a torch.distributed group, a Heartbeat every
    ``cluster.wire.heartbeat_s``, and from rollout 0 after an evaluation the held-out responses the learner scores
    its critic on (HeldoutResponses).
  * ``weights_fetch``: a blob requester for the length of one fetch, connects to the learner's blob server
    (``cluster.ports.weights_fetch_port``; ``weights.fetch``).

Ways (``cluster.weights.transfer``; the learner announces each version's shared-memory slot with its layout): with
"auto", an engine whose host shares the slot (the file exists and its header carries the announced token) has its
workers map it and load from it in place; another fetches the bytes in crc32-checked chunks from the learner's
``weights_fetch`` socket (``cluster.hosts.learner_host:weights_fetch_port``) into its own shared buffer and loads
that. Either way the load is checked against the slot's header before and after (a slot rewritten meanwhile fails
the load, and the engine serves nothing until it has loaded the newest version), and is acked. With "file" the
learner writes a safetensors file instead; the engine verifies its checksum and loads it. With "auto" an engine that
had to fetch (the learner's slot is not readable here: another host) and can join a torch.distributed group asks for
one after that first fetch; the learner then streams it versions over the group while it times both ways, and keeps
the faster (``async_vapo.weights.choose``). With "dist" it asks at start. A learner that restarted (its announces
carry a new slot token) knows no group: the engine asks again. A failed stream falls back to the slot, and a failed
load is retried every 5 s (logged once per version).

An engine always moves to the *latest* announced version (down too, after a learner resumed from an older
checkpoint), so one that fell behind (and was taken out of rotation by the learner) rejoins with its next ack.

A load that fails is acked as failed and tried again every 5 s; one whose pause or load misses its deadline
(``TimeoutError`` from the engine) is an engine failure: acked as failed, then raised, so that the service exits and
its supervisor restarts it (nothing half-loaded is served meanwhile: the engine serves version -1).

The client drives the engine only through ``weights.engine.WeightEngine``, which both engines implement: every
version reaches it through one method, ``engine.apply_weights(version, load)``, and the engine decides what
"quiescent" means around ``load`` (between two generate calls for a lock-step engine; paused requests for a
continuous one), so this client never knows how the engine generates. The client never sets the engine's state: a
receive that failed part-way is ``engine.invalidate()``. Fetches go over the service's transport
(``Transport.blob_requester``), the same one its announces and acks use.

Each load counts in ``weight_transfers_total{via}``, sets ``weight_way{way}`` (1 for the way of the last load), is
logged with its way and acked with it (``WeightsAck.via``). The service learns of the learner through
:attr:`EngineWeightClient.latest` and the callbacks it passes (announces, the learner's heartbeats, loads).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from async_vapo.transport import (
    Heartbeat,
    HeldoutResponses,
    Shutdown,
    WeightsAck,
    WeightsAnnounce,
    WeightsGroupJoin,
    WeightsGroupOffer,
    make_envelope,
)
from async_vapo.transport.interface import Transport
from async_vapo.weights.choose import WAYS
from async_vapo.weights.engine import WeightEngine
from async_vapo.weights.receive import load_announced
from async_vapo.weights.slots import slot_readable

RETRY_S = 5.0
"""A failed load is tried again this long after."""


class EngineWeightClient:
    """Keeps one engine on the learner's latest version (see the module docstring).

    ``ctx``: the service's context (config, log, metrics, ``send`` with backpressure, ``stop``); ``transport``: the
    service's (announces, acks and fetches); ``engine``: driven through ``WeightEngine`` only.
    Callbacks, each optional: ``on_announce(announce, previous_learner_version)`` for every announce and heartbeat
    copy, ``on_learner_waiting(seconds)`` for the learner's heartbeats, ``on_dropped(stale, late)`` with the
    learner's counts of this engine's groups the replay dropped as stale, and of those that arrived stale (cumulative,
    from its heartbeats),
    ``on_loaded(version, way)`` after each load.
    """

    def __init__(self, ctx, transport: Transport, engine: WeightEngine, *,
                 on_announce: Callable[[WeightsAnnounce, int], None] | None = None,
                 on_learner_waiting: Callable[[float], None] | None = None,
                 on_dropped: Callable[[int, int], None] | None = None,
                 on_loaded: Callable[[int, str], None] | None = None):
        c = ctx.cfg.cluster
        self.ctx, self.transport, self.engine = ctx, transport, engine
        self.engine_id = ctx.name
        self.on_announce, self.on_learner_waiting, self.on_loaded = on_announce, on_learner_waiting, on_loaded
        self.on_dropped = on_dropped
        self.acks = transport.sender(ctx.endpoint(c.hosts.learner_host, c.ports.acks_port), peer="learner")
        weights_in = (WeightsAnnounce, WeightsGroupOffer, Heartbeat, Shutdown)
        self.sub = transport.subscriber(ctx.endpoint(c.hosts.learner_host, c.ports.weights_port),
                                        decoder=ctx.decoder(weights_in, "weights"), peer="learner")
        self.m = ctx.metrics.rollout
        self.m_way = ctx.metrics.get("weight_way")
        self.m.served_version.set(engine.version)
        self.latest: WeightsAnnounce | None = None
        """The learner's last word (an announce, or a heartbeat's copy of it); None before the first."""
        self.learner_version = 0
        self.learner_done = False
        self._waiting_since: float | None = None
        """The learner's heartbeats say it has finished ("draining": its last update made, done or out of time)."""
        self.failed_versions: set[int] = set()
        self._next_retry = 0.0
        self._last_beat = 0.0
        self.mode = c.weights.transfer
        self.remote = False
        """"auto": the learner's slot is not readable here (found at the first fetch): groups are worth asking for."""
        self.backend = engine.weight_backend
        """The groups the engine can join ("gloo" / "nccl"; None: none)."""
        self._learner_token: str | None = None
        self.in_group = False
        self._group_asked = -math.inf
        self._streamed_version: int | None = None
        """"dist": the version of the last WeightsAnnounce (not a heartbeat's copy) naming this engine: the learner
        streams that one right after announcing it."""
        self.held = False
        """Loads wait (:meth:`poll` takes the learner's messages but loads nothing) and heartbeats say "busy": the
        service's held-out evaluation of the served version runs beside its generation (``RolloutService``)."""

    # -- the protocol -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Register with the learner: ack the version served now, and with "dist" ask for a group."""
        self.ack(self.engine.version, True, 0.0)
        if self.mode == "dist":
            self.ask_group()

    def wants_group(self) -> bool:
        """Whether this engine takes torch.distributed groups: "dist", or "auto" on another host than the
        learner's; only if the engine has a weight-transfer backend."""
        return self.backend is not None and (self.mode == "dist" or (self.mode == "auto" and self.remote))

    def poll(self, timeout_s: float) -> int | None:
        """Take what the learner sent (waiting up to ``timeout_s`` for the first message), then load the latest
        version if the engine does not serve it (unless loads are :attr:`held`); returns the version loaded now, or
        None."""
        env = self.sub.recv(timeout_s)
        while env is not None:
            self._receive(env)
            env = self.sub.recv(0)
        if self.wants_group() and not self.in_group \
                and time.monotonic() - self._group_asked > self.ctx.cfg.cluster.weights.dist_join_timeout_s:
            self.ask_group()  # no offer came (or the join failed): ask again
        if self.latest is not None and self.latest.version != self.engine.version and not self.held:
            if self.latest.version not in self.failed_versions or time.monotonic() >= self._next_retry:
                return self.load(self.latest)
        return None

    def _receive(self, env) -> None:
        body = env.body
        if isinstance(body, WeightsAnnounce):
            self._on_announce(body)
            self._streamed_version = body.version if self.engine_id in body.dist_engines else None
        elif isinstance(body, WeightsGroupOffer):
            if self.wants_group() and body.engine_id == self.engine_id:
                # an offer older than the learner's wait for it is closed already: ask again instead
                if time.time() - env.sent_at < self.ctx.cfg.cluster.weights.dist_join_timeout_s:
                    self.join_group(body)
                else:
                    self.ask_group()
        elif isinstance(body, Heartbeat):
            if body.weights is not None:
                self._on_announce(body.weights)
            if body.service == "learner":
                self.learner_done = body.status == "draining"
            if body.service == "learner" and self.on_learner_waiting is not None:
                self.on_learner_waiting(body.waiting_s)
            if body.service == "learner" and self.on_dropped is not None:
                self.on_dropped(body.stale_dropped.get(self.engine_id, 0), body.late_dropped.get(self.engine_id, 0))
        elif isinstance(body, Shutdown):
            self.ctx.log.info("%s: shutdown announced by %s: %s", self.engine_id, env.sender, body.reason)
            self.ctx.stop.set()

    def _on_announce(self, a: WeightsAnnounce) -> None:
        # One publisher, delivered in order: its last word is the truth, even a lower version (a learner
        # restarted from an older checkpoint), so the engine follows it down as well as up.
        self.latest = a
        if a.token and a.token != self._learner_token:
            if self._learner_token is not None and self.in_group:  # a new learner: the old group is gone
                self.in_group = False
                self._group_asked = -math.inf
            self._learner_token = a.token
        previous, self.learner_version = self.learner_version, a.version
        if self.on_announce is not None:
            self.on_announce(a, previous)

    def load(self, a: WeightsAnnounce) -> int | None:
        """Load ``a`` into the engine and ack it (ok or not); the version loaded, or None on a failure."""
        t0 = time.perf_counter()
        ok, error, way, seconds = True, "", "", 0.0
        try:
            with self.ctx.busy("load_weights"):
                way, seconds = self._load(a)
            self.m.weight_transfers_total.labels(via=way).inc()
        except TimeoutError as exc:  # the engine's pause or load missed its deadline: an engine failure
            self.ack(a.version, False, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}", via=way)
            self.ctx.log.error("%s: loading version %d missed its deadline (%s): the engine is failed, the service "
                               "exits for its supervisor to restart it", self.engine_id, a.version, exc)
            raise
        except Exception as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
            self._next_retry = time.monotonic() + RETRY_S
            if a.version not in self.failed_versions:  # retried every RETRY_S: log once per version
                self.failed_versions.add(a.version)
                self.ctx.processing_error("load_weights", f"loading version {a.version}")
        total = time.perf_counter() - t0
        if ok:
            self.m.weight_load_seconds.observe(total)
            self.m.served_version.set(a.version)
            for w in WAYS:
                self.m_way.labels(way=w).set(1 if w == way else 0)
            self.ctx.metrics.set_health(served_version=a.version)
            self.ctx.log.info("%s: serving version %d via %s (load %.2f s)", self.engine_id, a.version, way, total)
            if self.mode == "auto" and way == "zmq" and not self.remote and not slot_readable(a.location, a.token):
                self.remote = True  # another host than the learner's: its group may be faster than the fetch
                if self.backend is not None:
                    self.ctx.log.info("%s: the learner's slot is not readable here (another host): asking for a "
                                      "%s weight group to time against the fetch", self.engine_id, self.backend)
                    self.ask_group()
        self.ack(a.version, ok, seconds if ok else total, error, via=way)
        if ok and self.on_loaded is not None:
            self.on_loaded(a.version, way)
        return a.version if ok else None

    def _load(self, a: WeightsAnnounce) -> tuple[str, float]:
        """Load ``a`` through the engine's one entry point; returns the way it came ("dist", "shm", "zmq" or
        "file") and the seconds of that way (a failed group receive before a fetch is not counted: "auto" compares
        the ways by them)."""
        return self.engine.apply_weights(a.version, lambda: self._move(a))

    def _move(self, a: WeightsAnnounce) -> tuple[str, float]:
        c = self.ctx.cfg.cluster
        if self.in_group and self._streamed_version == a.version:
            import torch

            from async_vapo.weights.collective import plan_buckets, update_info

            self._streamed_version = None
            buckets = plan_buckets([(n, getattr(torch, d), tuple(sh)) for n, d, sh, _ in a.layout],
                                   a.dist_bucket_bytes)
            t0 = time.perf_counter()
            try:
                self.engine.receive_weights_dist(update_info(buckets, a.version, self.backend or "gloo"), a.version)
                return "dist", time.perf_counter() - t0
            except Exception as exc:  # the group is broken: a mix of two versions may be loaded
                self.engine.invalidate()
                self.in_group = False
                self.ctx.log.warning("%s: version %d over the weight group failed (%s: %s); %s, and asking for a new "
                                     "group", self.engine_id, a.version, type(exc).__name__, exc,
                                     "loading the slot" if a.location else "no slot holds it (streamed only): the "
                                     "learner publishes it again, whole, on the failed ack")
                self.ask_group()
        t0 = time.perf_counter()
        way = load_announced(self.engine, a, transport=self.transport, mode=c.weights.transfer,
                             fetch_endpoint=self.ctx.endpoint(c.hosts.learner_host, c.ports.weights_fetch_port),
                             chunk_bytes=c.weights.chunk_bytes, timeout_s=c.wire.batch_request_timeout_s,
                             engine_id=self.engine_id, max_bytes=c.wire.max_message_bytes)
        return way, time.perf_counter() - t0

    def ask_group(self) -> None:
        """Ask the learner for a torch.distributed group for weights (it answers with WeightsGroupOffer)."""
        self._group_asked = time.monotonic()
        self.ctx.send(self.acks, make_envelope(
            WeightsGroupJoin(engine_id=self.engine_id, workers=self.ctx.cfg.rollout.tensor_parallel_size,
                             backend=self.backend or "gloo"),
            sender=self.engine_id, policy_version=self.engine.version), "group join")

    def join_group(self, offer: WeightsGroupOffer) -> None:
        """Join the offered group through vLLM's init_weight_transfer_engine (bounded by the offer's timeout)."""
        from async_vapo.weights.collective import engine_init_info

        self.in_group = False
        if offer.backend != self.backend:
            self.ctx.log.warning("%s: offered a %s weight group, but the engine takes %s ones; the slot serves",
                                 self.engine_id, offer.backend, self.backend)
            return
        fields = {k: getattr(offer, k) for k in ("master_addr", "master_port", "world_size", "prefix", "timeout_s")}
        try:
            with self.ctx.busy("load_weights"):
                self.engine.join_weight_group(engine_init_info(fields, offer.backend, offer.bucket_bytes))
        except Exception as exc:
            self.ctx.log.warning("%s: joining the weight group failed (%s: %s); the slot serves meanwhile",
                                 self.engine_id, type(exc).__name__, exc)
            return
        self.in_group = True
        self.ctx.log.info("%s: in its %s weight group (%s:%d)", self.engine_id, offer.backend, offer.master_addr,
                          offer.master_port)

    def ack(self, version: int, ok: bool, seconds: float, error: str = "", via: str = "") -> None:
        self.ctx.send(self.acks, make_envelope(WeightsAck(engine_id=self.engine_id, version=version, ok=ok,
                                                          load_seconds=seconds, error=error, via=via),
                                               sender=self.engine_id, policy_version=self.engine.version), "ack")

    def send_heldout(self, version: int, groups: list, part: int = 0, parts: int = 1) -> None:
        """Part ``part`` of ``parts`` of the graded held-out responses of an evaluation of ``version`` to the learner,
        which scores its critic on them (``critic/heldout_*``); from the thread that owns the acks socket (the
        service's loop)."""
        self.ctx.send(self.acks, make_envelope(HeldoutResponses(engine_id=self.engine_id, version=version,
                                                                groups=groups, part=part, parts=parts),
                                               sender=self.engine_id, policy_version=self.engine.version),
                      "held-out responses")

    def heartbeat(self, force: bool = False, status: str | None = None) -> None:
        """Tell the learner this engine is alive and the version it serves (every ``cluster.wire.heartbeat_s``);
        ``status`` "busy": it serves that version on purpose while it does other work (:meth:`beating`, or loads
        :attr:`held`), the default while loads are held; else "ready"."""
        status = status or ("busy" if self.held else "ready")
        now = time.monotonic()
        if force or now - self._last_beat >= self.ctx.cfg.cluster.wire.heartbeat_s:
            self._last_beat = now
            waited = 0.0 if self._waiting_since is None else max(1e-3, now - self._waiting_since)
            env = make_envelope(Heartbeat(service="rollout", instance=str(self.ctx.instance),
                                          served_version=self.engine.version, status=status, waiting_s=waited),
                                sender=self.engine_id, policy_version=self.engine.version)
            self.ctx.send(self.acks, env, "heartbeat")

    def waiting(self, idle: bool) -> None:
        """The service's loop has nothing to generate (its budget spent, or no learner yet), or has work again; the
        learner hears it at once (a heartbeat's ``waiting_s``) and borrows the engine's cores meanwhile on a CPU host
        (``cluster.deploy.lend_cpus``)."""
        if idle == (self._waiting_since is not None):
            return
        self._waiting_since = time.monotonic() if idle else None
        self.heartbeat(force=True)

    @contextmanager
    def beating(self) -> Iterator[None]:
        """Heartbeats ("busy") every ``cluster.wire.heartbeat_s`` from a thread while the service's loop does one
        long piece of work that takes no weights (a held-out evaluation), however long: the learner neither
        declares the engine dead (``cluster.wire.peer_dead_s``) nor drops it from rotation for the versions it
        publishes meanwhile (``WeightBroadcast``: a busy engine is excused from the ack deadline). A "ready"
        heartbeat at the end says the engine takes versions again. The thread also reads what the learner sends
        (its heartbeats: how long it has waited for a batch, which lends its cores to this engine with
        ``cluster.deploy.lend_cpus``; the latest announce, kept for the loop to load after the work; a shutdown);
        an offer of a weight group waits for the loop. The ``acks`` and weights sockets are the thread's alone
        meanwhile: the loop neither sends nor polls while it works, and starting and joining the thread order the
        hand-over (a ZeroMQ socket may move between threads so), so the learner reads one ordered stream."""
        done = threading.Event()
        deferred: list = []

        def beat() -> None:
            every = self.ctx.cfg.cluster.wire.heartbeat_s
            due = time.monotonic() + every
            while not done.is_set():
                env = self.sub.recv(min(0.05, every))
                while env is not None:
                    if isinstance(env.body, WeightsGroupOffer):
                        deferred.append(env)
                    else:
                        self._receive(env)
                    env = self.sub.recv(0)
                if time.monotonic() >= due and not done.is_set():
                    self.heartbeat(force=True, status="busy")
                    due = time.monotonic() + every

        self._waiting_since = None  # it works: its cores are not the learner's to borrow meanwhile
        self.heartbeat(force=True, status="busy")
        thread = threading.Thread(target=beat, daemon=True, name=f"{self.engine_id}-heartbeats")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            for env in deferred:
                self._receive(env)
            self.heartbeat(force=True)

    def close(self) -> None:
        for sock in (self.acks, self.sub):
            sock.close()
