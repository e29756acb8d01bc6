"""The learner's side of the weight broadcast, the same for every way: publish, announce, acks, rotation.

Sockets (from the service's transport)
  * ``weights``: XPUB, binds ``cluster.ports.weights_port``; WeightsAnnounce after each version, and every
    ``cluster.wire.heartbeat_s`` a Heartbeat repeating the latest announce. Never blocks (PUB drops at HWM; the
    heartbeat recovers a dropped announce).
  * ``acks``: PULL, binds ``cluster.ports.acks_port``; WeightsAck and Heartbeat from every engine, and the held-out
    responses of rollout 0's evaluations (HeldoutResponses, kept for the learner: :meth:`WeightBroadcast.take_heldout`).
  * ``weights_fetch``: a blob server, binds ``cluster.ports.weights_fetch_port`` (the slot ways but "shm";
    ``fetch.WeightServer``, served by its own thread).

Rotation (:class:`Rotation`): an engine joins with an ok ack of the latest version (or a heartbeat saying it
serves it); a version counts once every engine in rotation acked it (``broadcast_seconds``). An engine leaves
rotation when it misses a version's ack deadline (``cluster.weights.ack_timeout_s``) or when it has been silent
for ``cluster.wire.peer_dead_s`` (the liveness policy: any envelope on the acks socket is proof of life,
``transport.HeartbeatMonitor``). An engine whose heartbeats say "busy" (rollout 0 during a held-out evaluation,
which takes no weights however long it lasts) is excused from the ack deadline until ``ack_timeout_s`` after it
says it is ready again (``Rotation.excused``). Either way it rejoins with its next ack of the latest version
(engines always load the latest). The learner never waits for acks: they are serviced between batch requests, so a dead
engine costs nothing but its share of the groups; its groups need no special treatment (once older than
the replay's floor they are dropped as stale).

``cluster.weights.transfer = "dist"`` (``async_vapo.weights.collective``): an engine asks for a group
(WeightsGroupJoin on the acks socket), the learner makes one (gloo, or NCCL for an engine on CUDA when the learner
is on CUDA: ``collective.group_backend``), offers it on the weights socket (WeightsGroupOffer) and forms it in a
thread while the engine joins. Each version is then written to its slot as with "auto", announced with the engines
whose groups are formed (``dist_engines``), and streamed to them one after another, each within
``cluster.weights.dist_timeout_s``. An engine whose send fails or times out loses its group (torn down, counted in
``weight_dist_failures_total``) and loads the slot instead; it asks for a new group. Acks and rotation are the same
for every way.

A sharded learner (``learner.sharding.publish_sharded``, every rank) asks :meth:`WeightBroadcast.stream_plan`
first. When every engine heard from within ``cluster.wire.peer_dead_s`` is streamed, the version is announced with
no slot (``location`` empty, :meth:`WeightBroadcast.announce_unheld`) and streamed as its ranks gather it, one
bucket at a time; the sends are reported to :meth:`WeightBroadcast.streamed`. An engine that then fails to load it (its
send failed, or it has just started) acks the failure, :meth:`WeightBroadcast.needs_whole` becomes true, and the learner
publishes the version again, whole, to a slot (``publish(..., again=True)``; on every rank: the learner service's
``REPUBLISH``, from its work while it waits for a batch). Otherwise (an engine on the slot or the fetch, or none known
yet) the version is gathered whole on rank 0 in one walk and published as above.

With ``model.lora`` a version is its adapter (``async_vapo.weights.adapter``): the publish writes a PEFT directory
(``publish``'s tensors are ``Learner.adapter_state()``), engines read it where it lies ("shm", "file", "auto" on this
host) or fetch its files from the ``weights_fetch`` server ("zmq", "auto" elsewhere); no group is offered or streamed,
and "dist" is refused (by the config). With ``model.lora.serve = "merged"`` a version is the merged weights
(``Learner.policy_state()``), published as any whole version is. Announces, acks, rotation, liveness and the heartbeats'
repeated announce (a late engine loads the current adapter) are as for whole weights.

``cluster.weights.transfer = "auto"`` chooses per engine (``async_vapo.weights.choose.WayChooser``, fed by the acks,
which say the way each version came): an engine on this host maps its slot; one on another host fetches, asks for a
group after its first fetch, and is streamed versions over it once its fetches are timed, until the faster way
is kept (a group it no longer needs is torn down). ``engines_by_weight_way{way}`` counts the engines by the way
they use, and the log says which way each engine takes and why.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from async_vapo.transport import (
    Heartbeat,
    HeartbeatMonitor,
    HeldoutResponses,
    WeightsAck,
    WeightsAnnounce,
    WeightsGroupJoin,
    WeightsGroupOffer,
    make_envelope,
)
from async_vapo.weights.choose import WAYS, WayChooser
from async_vapo.weights.layout import named_tensors
from async_vapo.weights.publish import NamedTensors, make_publisher


@dataclass
class Rotation:
    """Engines in rotation and the versions still waiting for their acks (pure bookkeeping, no I/O)."""

    ack_timeout_s: float
    latest: int = 0
    acked: dict[str, int] = field(default_factory=dict)
    """Latest version each engine acked ok."""
    members: set[str] = field(default_factory=set)
    pending: dict[int, float] = field(default_factory=dict)
    """version -> monotonic time it was published."""
    excused: dict[str, float] = field(default_factory=dict)
    """Engine -> monotonic time until which it is excused from ack deadlines: ``inf`` while its heartbeats say
    "busy" (it serves an older version on purpose while it does other work, a held-out evaluation however long, and
    takes the latest when done), then ``ack_timeout_s`` more from its first heartbeat that does not, to load it."""

    def published(self, version: int, now: float) -> None:
        self.latest = version
        self.pending[version] = now

    def on_ack(self, engine: str, version: int, ok: bool, now: float) -> tuple[list[tuple[int, float]], bool]:
        """Record an ack; returns (versions that now count with their broadcast seconds, engine rejoined)."""
        rejoined = False
        if ok:
            # One engine's acks and heartbeats arrive in order on one socket: its last word is what it serves (lower
            # than before only when it followed a learner restarted from an older checkpoint down to new weights)
            self.acked[engine] = version
            if engine not in self.members and self.acked[engine] >= self.latest:
                self.members.add(engine)
                rejoined = True
        return self._complete(now), rejoined

    def _complete(self, now: float) -> list[tuple[int, float]]:
        done = [v for v in self.pending
                if self.members and all(self.acked.get(e, -1) >= v for e in self.members)]
        return [(v, now - self.pending.pop(v)) for v in sorted(done)]

    def leave(self, engine: str) -> bool:
        """Take ``engine`` out of rotation (it is dead); True if it was in. It rejoins like any other."""
        if engine in self.members:
            self.members.discard(engine)
            return True
        return False

    def set_busy(self, engine: str, busy: bool, now: float) -> None:
        """An engine's heartbeat says whether it is busy (see ``excused``)."""
        if busy:
            self.excused[engine] = math.inf
        elif self.excused.get(engine) == math.inf:
            self.excused[engine] = now + self.ack_timeout_s

    def expire(self, now: float) -> list[str]:
        """Take engines that missed a version's deadline out of rotation, excused ones excepted (the version waits
        for their acks); returns them."""
        excused = {e for e, t in self.excused.items() if now <= t}
        self.excused = {e: self.excused[e] for e in excused}
        dropped: list[str] = []
        for v, t in sorted(self.pending.items()):
            if now - t > self.ack_timeout_s:
                late = {e for e in self.members if self.acked.get(e, -1) < v}
                out = sorted(late - excused)
                self.members.difference_update(out)
                dropped += out
                if not late & excused:
                    del self.pending[v]
        return dropped


def default_weights_dir(ctx) -> Path:
    if ctx.cfg.cluster.weights.dir:
        return Path(ctx.cfg.cluster.weights.dir).expanduser() / f"async-vapo-{ctx.cfg.train.name}-{os.getpid()}"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"async-vapo-{ctx.cfg.train.name}-{os.getpid()}"
    return ctx.run_dir / "weights"


MAX_HELDOUT_PARTS = 1024
"""Most messages one held-out set may arrive in (``HeldoutResponses.parts``)."""


class WeightBroadcast:
    """Publishes versions by ``cluster.weights.transfer`` and keeps the engines' rotation (module docstring)."""

    def __init__(self, ctx, transport, *, pub_endpoint: str | None = None, acks_endpoint: str | None = None,
                 fetch_endpoint: str | None = None, weights_dir: Path | None = None, device: str | None = None):
        """``device``: the learner's ("cuda:0", "cpu"; default: the current CUDA device when one is visible),
        which decides whether the learner can make NCCL groups, and their device."""
        import torch

        from async_vapo.weights.collective import check_learner_backend

        c = ctx.cfg.cluster
        self.ctx = ctx
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        check_learner_backend(c.weights.dist_backend, self.device.type)
        self.pub = transport.publisher(pub_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.weights_port),
                                       peer="rollout")
        self.acks = transport.receiver(acks_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.acks_port),
                                       decoder=ctx.decoder((WeightsAck, WeightsGroupJoin, Heartbeat, HeldoutResponses),
                                                           "acks"),
                                       bind=True, peer="rollout")
        self.dir = weights_dir or default_weights_dir(ctx)
        self.rotation = Rotation(c.weights.ack_timeout_s)
        self.liveness = HeartbeatMonitor(c.wire.peer_dead_s)
        self.latest: WeightsAnnounce | None = None
        self._last_beat = 0.0
        self._last_waiting = False
        self.idle: dict[str, bool] = {}
        """Engine -> whether its last heartbeat said it has nothing to generate (``waiting_s``)."""
        m = ctx.metrics
        self.in_rotation = m.get("engines_in_rotation")
        self.dropped = m.get("engines_dropped_total")
        self.dead = m.get("engines_dead_total")
        self.rejoined = m.get("engines_rejoined_total")
        self.failed_loads = m.get("weight_load_failures_total")
        from async_vapo.models import lora

        self.lora = lora.config_of(ctx.cfg) if ctx.cfg.model.lora.adapter_versions else None
        """``model.lora`` served as adapters: each version is its adapter (``weights.adapter``), never streamed over a
        group (``model.lora.serve = "merged"``: None, a version is whole weights like any other)."""
        self.dist = c.weights.transfer in ("dist", "auto") and self.lora is None
        """Engines may get torch.distributed groups ("dist"; "auto" for engines on other hosts)."""
        self.chooser = WayChooser(c.weights.transfer == "auto", c.weights.auto_trials)
        self.by_way = m.get("engines_by_weight_way")
        for w in WAYS:
            self.by_way.labels(way=w).set(0)
        self.groups: dict = {}
        self.heldout: HeldoutResponses | None = None
        """The latest held-out responses an engine sent (rollout 0, after an evaluation), whole, that the learner has
        not scored its critic on yet (:meth:`take_heldout`); a newer set replaces an unscored older one."""
        self._heldout_parts: HeldoutResponses | None = None  # a set arriving in parts: those so far, in order
        """Engine id -> its EngineGroup (formed once its ``group`` is set)."""
        self.unserved: set[str] = set()
        """Engines that failed to load the latest version, which no slot holds (``needs_whole``)."""
        if self.dist:
            self.dist_failures = m.get("weight_dist_failures_total")
            self.dist_seconds = m.get("weight_dist_send_seconds")
        self.publisher = make_publisher(
            c.weights.transfer, self.dir, keep_versions=c.weights.keep_versions, transport=transport,
            fetch_endpoint=fetch_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.weights_fetch_port),
            lora=self.lora, base_model=ctx.cfg.model.path,
            chunk_bytes=c.weights.chunk_bytes, max_bytes=c.wire.max_message_bytes, send_timeout_s=c.wire.send_timeout_s,
            sender=ctx.name, on_served=m.learner.weight_fetch_bytes_total.inc)

    @property
    def server(self):
        """The fetch server of the slots or the adapters (None for "file" and "shm")."""
        return getattr(self.publisher, "server", None)

    def publish(self, version: int, tensors: NamedTensors, min_version: int = -1, *, again: bool = False) -> float:
        """Make ``tensors`` version ``version`` and announce it with the learner's staleness floor
        ``min_version``; returns the seconds spent. ``again``: the version announced last, published once more,
        whole, for engines that could not load it (``needs_whole``): streamed to no engine, its ack deadline
        unchanged."""
        t0 = time.perf_counter()
        if self.dist:
            tensors = named_tensors(tensors)  # read again for each engine's stream
        announce = self.publisher.publish(version, tensors)
        streamed = [] if again else self._streamable()
        self._announce(announce, min_version, streamed, new=not again)
        if streamed:
            self._stream(self.latest, tensors, streamed)
        return time.perf_counter() - t0

    def _streamable(self) -> list[str]:
        """The engines the next version goes to over their groups: formed, and chosen ("auto")."""
        if not self.dist:
            return []
        return sorted(e for e, g in self.groups.items() if g.group is not None and self.chooser.stream(e))

    def _announce(self, announce: WeightsAnnounce, min_version: int, streamed: list[str], *, new: bool = True) -> None:
        self.latest = msgspec.structs.replace(
            announce, min_version=min_version, dist_engines=streamed,
            dist_bucket_bytes=self.ctx.cfg.cluster.weights.dist_bucket_bytes if self.dist else 0)
        if announce.location:  # a slot holds it: every engine can load it
            self.unserved.clear()
        if new or announce.version != self.rotation.latest:
            self.rotation.published(announce.version, time.monotonic())
        self.pub.publish(make_envelope(self.latest, sender=self.ctx.name, policy_version=announce.version))

    # -- a sharded learner's versions (learner.sharding.publish_sharded): streamed, gathered one bucket at a time -
    def stream_plan(self) -> tuple[list[str], bool]:
        """What a sharded learner's next version needs: (the engines to stream it to over their groups, whether it
        is needed whole as well). Whole when an engine heard from within ``cluster.wire.peer_dead_s`` is not
        streamed (it loads its slot or fetches), or when no engine has been heard from yet (those to come load the
        slot); else every engine is streamed and no slot is written, so no rank holds the whole version."""
        streamed = self._streamable()
        alive = {p for p in self.liveness.peers if self.liveness.is_alive(p)}
        return streamed, not alive or not alive <= set(streamed)

    def announce_unheld(self, version: int, meta, engines: list[str], min_version: int = -1) -> WeightsAnnounce:
        """Announce ``version`` to be streamed to ``engines`` (``stream_plan``), which no slot holds (``meta``:
        each tensor's ``(name, wire dtype, shape)`` in the order they are sent); the caller streams it next and
        reports the sends to :meth:`streamed`. An engine whose receive fails then has nothing to load: its failed
        ack makes ``needs_whole`` true."""
        self._announce(self.publisher.announce_unheld(version, meta), min_version, list(engines))
        return self.latest

    def streamed(self, version: int, results: dict) -> None:
        """The sends of ``version`` to engines' groups: ``{engine: seconds or the EngineSync* error}``."""
        for e, r in results.items():
            self._sent(e, version, r)

    def needs_whole(self) -> bool:
        """An engine reported that it could not load the latest version, which no slot holds (it was streamed
        only): the learner is to publish it again, whole (``publish(..., again=True)``)."""
        return bool(self.unserved) and self.latest is not None and not self.latest.location

    # -- "dist": one torch.distributed group per engine ---------------------------------------------------------
    def _offer_group(self, engine: str, workers: int, backend: str = "gloo") -> None:
        import threading

        from async_vapo.weights.collective import EngineGroup, group_backend

        c = self.ctx.cfg.cluster
        if not self.chooser.group_asked(engine):
            self.ctx.log.info("learner: %s asked for a weight group; none offered (it takes its weights by %s)",
                              engine, self.chooser.way(engine) or "its slot")
            return
        old = self.groups.pop(engine, None)
        if old is not None:
            old.close()
        try:
            backend = group_backend(backend, self.device.type)
        except ValueError as e:
            self.ctx.log.warning("learner: no weight group for %s: %s", engine, e)
            line = self.chooser.no_group(engine, str(e))
            if line:
                self.ctx.log.info("learner: %s %s", engine, line)
            return
        g = EngineGroup(engine, workers=workers, bind_host=c.hosts.bind_host, advertise_host=c.hosts.learner_host,
                        timeout_s=c.weights.dist_timeout_s, join_timeout_s=c.weights.dist_join_timeout_s,
                        backend=backend, device=self.device if backend == "nccl" else "cpu",
                        bucket_bytes=c.weights.dist_bucket_bytes)
        self.groups[engine] = g
        self.pub.publish(make_envelope(WeightsGroupOffer(engine_id=engine, backend=backend,
                                                         bucket_bytes=g.bucket_bytes, **g.init_info),
                                       sender=self.ctx.name))
        threading.Thread(target=self._form, args=(g,), daemon=True, name=f"dist-join-{engine}").start()
        self.ctx.log.info("learner: offered %s a %s weight group (%s:%d)", engine, backend,
                          g.init_info["master_addr"], g.init_info["master_port"])

    def _form(self, g) -> None:
        from async_vapo.weights.collective import EngineSyncTimeout

        try:
            g.connect()
            self.ctx.log.info("learner: %s joined its weight group", g.engine_id)
        except EngineSyncTimeout as e:
            self.ctx.log.warning("learner: %s", e)

    def _stream(self, a: WeightsAnnounce, tensors: dict, engines: list[str]) -> None:
        import torch

        from async_vapo.weights.collective import EngineSyncFailed, EngineSyncTimeout, plan_buckets

        buckets = plan_buckets([(n, getattr(torch, d), tuple(sh)) for n, d, sh, _ in a.layout], a.dist_bucket_bytes)
        names = [n for n, *_ in a.layout]
        timeout_s = self.ctx.cfg.cluster.weights.dist_timeout_s
        for e in engines:
            g = self.groups.get(e)
            try:
                got = g.send(buckets, ((n, tensors[n]) for n in names), deadline=time.monotonic() + timeout_s)
            except (EngineSyncTimeout, EngineSyncFailed) as err:
                got = err
            self._sent(e, a.version, got)

    def _sent(self, engine: str, version: int, got) -> None:
        """One engine's send of ``version``: its seconds, or the EngineSync* error that tore its group down."""
        from async_vapo.weights.collective import EngineSyncFailed, EngineSyncTimeout

        if isinstance(got, (EngineSyncTimeout, EngineSyncFailed)):
            self.dist_failures.inc()
            self.groups.pop(engine, None)
            held = self.latest is not None and self.latest.version == version and self.latest.location
            self.ctx.log.warning("learner: version %d not streamed to %s (%s): its group is torn down, %s", version,
                                 engine, got, "it loads the slot" if held else
                                 "no slot holds the version: it is published again, whole, once the engine says so")
            line = self.chooser.failed(engine)
            if line:
                self.ctx.log.info("learner: %s %s", engine, line)
        elif isinstance(got, BaseException):
            raise got
        else:
            self.dist_seconds.observe(got)
            self.chooser.sent(engine, version, got)

    def heartbeat(self, version: int, waiting_s: float = 0.0, stale_dropped: dict[str, int] | None = None,
                  late_dropped: dict[str, int] | None = None, status: str = "ready") -> None:
        """Publish a Heartbeat (every ``cluster.wire.heartbeat_s``, and at once when a wait for a batch starts or ends)
        with the latest announce and, while the learner waits for a batch, how long it has waited, and the groups the
        replay dropped as stale by engine, all and those that arrived stale (the engines' admission makes up lost
        groups by them). ``status`` "draining": the learner has made its last version (rollout 0 evaluates it)."""
        now = time.monotonic()
        self.pub.pump()
        # a wait that starts or ends is published at once: an engine lends its cores by it (lend_cpus)
        if now - self._last_beat >= self.ctx.cfg.cluster.wire.heartbeat_s or (waiting_s > 0) != self._last_waiting:
            self._last_beat, self._last_waiting = now, waiting_s > 0
            self.pub.publish(make_envelope(Heartbeat(service="learner", instance=str(self.ctx.instance),
                                                     served_version=version, weights=self.latest, status=status,
                                                     waiting_s=waiting_s, stale_dropped=dict(stale_dropped or {}),
                                                     late_dropped=dict(late_dropped or {})),
                                           sender=self.ctx.name, policy_version=version))

    def _joined(self, engine: str, counted: list[tuple[int, float]], rejoined: bool, version: int) -> None:
        if rejoined:
            self.rejoined.inc()
            self.ctx.log.info("learner: %s in rotation (serves version %d)", engine, version)
        for v, seconds in counted:
            self.ctx.metrics.learner.broadcast_seconds.observe(seconds)
            # logged as the last ack is read: while the learner updates or waits for a batch, as it arrives
            self.ctx.log.info("learner: version %d loaded by every engine in rotation, the last ack %.2f s after "
                              "its announce", v, seconds)

    def engines_idle(self) -> bool:
        """Every engine in rotation (one at least) has nothing to generate: their cores are the learner's to borrow
        (``cluster.deploy.lend_cpus``)."""
        members = self.rotation.members
        return bool(members) and all(self.idle.get(e, False) for e in list(members))

    def poll(self, timeout_s: float) -> None:
        """Service acks and heartbeats for up to ``timeout_s`` (returns early once the pipe is drained after the
        first); then apply the ack deadline and the liveness policy."""
        env = self.acks.recv(timeout_s)
        while env is not None:
            self.liveness.observe(env)
            body = env.body
            now = time.monotonic()
            if isinstance(body, WeightsGroupJoin):
                if self.dist:
                    self._offer_group(body.engine_id, body.workers, body.backend)
            elif isinstance(body, WeightsAck):
                if not body.ok:
                    self.failed_loads.inc()
                    self.ctx.log.warning("learner: %s failed to load version %d: %s", body.engine_id,
                                         body.version, body.error)
                    if self.latest is not None and body.version == self.latest.version and not self.latest.location:
                        self.unserved.add(body.engine_id)  # the version was streamed only: needs_whole
                else:
                    self._way(body.engine_id, body.via, body.version, body.load_seconds)
                counted, rejoined = self.rotation.on_ack(body.engine_id, body.version, body.ok, now)
                self._joined(body.engine_id, counted, rejoined, body.version)
            elif isinstance(body, Heartbeat) and body.service == "rollout" and body.served_version >= 0:
                self.rotation.set_busy(env.sender, body.status == "busy", now)
                self.idle[env.sender] = body.waiting_s > 0
                # serving a version is as good as having acked it: an engine that was silent rejoins here
                counted, rejoined = self.rotation.on_ack(env.sender, body.served_version, True, now)
                self._joined(env.sender, counted, rejoined, body.served_version)
            elif isinstance(body, HeldoutResponses):
                self._heldout_part(body)
            env = self.acks.recv(0)
        for e in self.rotation.expire(time.monotonic()):
            self.dropped.inc()
            self.ctx.log.warning("learner: %s missed the ack deadline of %.0f s: out of rotation", e,
                                 self.rotation.ack_timeout_s)
        for e in self.liveness.dead_peers():
            if self.rotation.leave(e):
                self.dead.inc()
                self.ctx.log.warning("learner: %s silent for more than %.0f s: out of rotation", e,
                                     self.liveness.dead_after_s)
        self.in_rotation.set(len(self.rotation.members))

    def _heldout_part(self, body: HeldoutResponses) -> None:
        """Assemble a held-out set from its parts (one engine's, in order on its socket): part 0 starts one, each next
        part of the same engine and version extends it, the last completes it; anything else (a part missing, parts
        of a malformed count) drops the incomplete set, logged."""
        if not 0 <= body.part < body.parts <= MAX_HELDOUT_PARTS:
            self.ctx.log.warning("learner: held-out responses of %s: part %d of %d refused", body.engine_id,
                                 body.part, body.parts)
            self._heldout_parts = None
            return
        got = self._heldout_parts
        if body.part == 0:
            if got is not None:
                self.ctx.log.warning("learner: held-out responses of %s for version %d incomplete (%d parts of %d); "
                                     "a new set replaces them", got.engine_id, got.version, got.part + 1, got.parts)
            got = self._heldout_parts = msgspec.structs.replace(body, groups=list(body.groups))
        elif (got is None or (got.engine_id, got.version, got.parts) != (body.engine_id, body.version, body.parts)
              or body.part != got.part + 1):
            self.ctx.log.warning("learner: held-out responses of %s for version %d: part %d out of order, dropped",
                                 body.engine_id, body.version, body.part)
            self._heldout_parts = None
            return
        else:
            got.groups.extend(body.groups)
            got.part = body.part
        if got.part == got.parts - 1:
            self.heldout, self._heldout_parts = got, None

    def take_heldout(self) -> HeldoutResponses | None:
        """The held-out responses received since the last call (the latest set), or None."""
        got, self.heldout = self.heldout, None
        return got

    def _way(self, engine: str, via: str, version: int, seconds: float) -> None:
        """The way ``engine`` loaded ``version``: the chooser's bookkeeping, its log line and the gauge."""
        line = self.chooser.loaded(engine, via, version, seconds)
        if line:
            self.ctx.log.info("learner: %s %s", engine, line)
        e = self.chooser.engines.get(engine)
        if self.chooser.auto and e is not None and e.chosen and e.chosen != "dist":
            g = self.groups.pop(engine, None)  # a group it will not use again
            if g is not None:
                g.close()
        for w, n in self.chooser.counts().items():
            self.by_way.labels(way=w).set(n)

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()
        self.publisher.close()
        shutil.rmtree(self.dir, ignore_errors=True)
