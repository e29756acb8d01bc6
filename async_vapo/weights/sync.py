"""The learner's side of the weight broadcast, the same for every way: publish, announce, acks, rotation.

Sockets (from the service's transport)
  * ``weights``: XPUB, binds ``cluster.ports.weights_port``; WeightsAnnounce after each version, and every
    ``cluster.wire.heartbeat_s`` a Heartbeat repeating the latest announce. Never blocks (PUB drops at HWM; the
    heartbeat recovers a dropped announce).
  * ``acks``: PULL, binds ``cluster.ports.acks_port``; WeightsAck and Heartbeat from every engine.

Rotation (:class:`Rotation`): an engine joins with an ok ack of the latest version (or a heartbeat saying it
serves it); a version counts once every engine in rotation acked it (``broadcast_seconds``). An engine leaves
rotation when it misses a version's ack deadline (``cluster.weights.ack_timeout_s``) or when it has been silent
for ``cluster.wire.peer_dead_s`` (the liveness policy: any envelope on the acks socket is proof of life,
``transport.HeartbeatMonitor``). Either way it rejoins with its next ack of the latest version (engines always
load the latest). The learner never waits for acks: they are serviced between batch requests, so a dead
engine costs nothing but its share of the groups; its groups need no special treatment (once older than
the replay's floor they are dropped as stale).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from async_vapo.transport import Heartbeat, HeartbeatMonitor, WeightsAck, WeightsAnnounce, make_envelope
from async_vapo.weights.base import NamedTensors, make_publisher


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

    def expire(self, now: float) -> list[str]:
        """Take engines that missed a version's deadline out of rotation; returns them."""
        dropped: list[str] = []
        for v, t in sorted(self.pending.items()):
            if now - t > self.ack_timeout_s:
                late = sorted(e for e in self.members if self.acked.get(e, -1) < v)
                self.members.difference_update(late)
                dropped += late
                del self.pending[v]
        return dropped


def default_weights_dir(ctx) -> Path:
    if ctx.cfg.cluster.weights.dir:
        return Path(ctx.cfg.cluster.weights.dir).expanduser() / f"async-vapo-{ctx.cfg.train.name}-{os.getpid()}"
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm / f"async-vapo-{ctx.cfg.train.name}-{os.getpid()}"
    return ctx.run_dir / "weights"


class WeightBroadcast:
    """Publishes versions by ``cluster.weights.transfer`` and keeps the engines' rotation (module docstring)."""

    def __init__(self, ctx, transport, *, pub_endpoint: str | None = None, acks_endpoint: str | None = None,
                 fetch_endpoint: str | None = None, weights_dir: Path | None = None):
        c = ctx.cfg.cluster
        self.ctx = ctx
        self.pub = transport.publisher(pub_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.weights_port),
                                       peer="rollout")
        self.acks = transport.receiver(acks_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.acks_port),
                                       decoder=ctx.decoder((WeightsAck, Heartbeat), "acks"), bind=True, peer="rollout")
        self.dir = weights_dir or default_weights_dir(ctx)
        self.rotation = Rotation(c.weights.ack_timeout_s)
        self.liveness = HeartbeatMonitor(c.wire.peer_dead_s)
        self.latest: WeightsAnnounce | None = None
        self._last_beat = 0.0
        m = ctx.metrics
        self.in_rotation = m.gauge("engines_in_rotation", "Rollout engines whose acks a new version waits for.")
        self.dropped = m.counter("engines_dropped_total", "Engines taken out of rotation for missing an ack.")
        self.dead = m.counter("engines_dead_total",
                              "Engines taken out of rotation for silence (cluster.wire.peer_dead_s).")
        self.rejoined = m.counter("engines_rejoined_total", "Engines back in rotation after acking the latest.")
        self.failed_loads = m.counter("weight_load_failures_total", "Acks reporting a failed weight load.")
        self.publisher = make_publisher(
            c.weights.transfer, self.dir, keep_versions=c.weights.keep_versions,
            fetch_endpoint=fetch_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.weights_fetch_port),
            chunk_bytes=c.weights.chunk_bytes, max_bytes=c.wire.max_message_bytes, send_timeout_s=c.wire.send_timeout_s,
            sender=ctx.name, on_served=m.learner.weight_fetch_bytes_total.inc,
            security=getattr(transport, "security", None))

    @property
    def server(self):
        """The fetch server of the slot way (None for "file" and "shm")."""
        return getattr(self.publisher, "server", None)

    def publish(self, version: int, tensors: NamedTensors, min_version: int = -1) -> float:
        """Make ``tensors`` version ``version`` and announce it with the learner's staleness floor
        ``min_version``; returns the seconds spent."""
        t0 = time.perf_counter()
        self.latest = msgspec.structs.replace(self.publisher.publish(version, tensors), min_version=min_version)
        self.rotation.published(version, time.monotonic())
        self.pub.publish(make_envelope(self.latest, sender=self.ctx.name, policy_version=version))
        return time.perf_counter() - t0

    def heartbeat(self, version: int) -> None:
        now = time.monotonic()
        self.pub.pump()
        if now - self._last_beat >= self.ctx.cfg.cluster.wire.heartbeat_s:
            self._last_beat = now
            self.pub.publish(make_envelope(Heartbeat(service="learner", instance=str(self.ctx.instance),
                                                     served_version=version, weights=self.latest),
                                           sender=self.ctx.name, policy_version=version))

    def _joined(self, engine: str, counted: list[tuple[int, float]], rejoined: bool, version: int) -> None:
        if rejoined:
            self.rejoined.inc()
            self.ctx.log.info("learner: %s in rotation (serves version %d)", engine, version)
        for v, seconds in counted:
            self.ctx.metrics.learner.broadcast_seconds.observe(seconds)
            self.ctx.log.info("learner: version %d acked by every engine in rotation in %.2f s", v, seconds)

    def poll(self, timeout_s: float) -> None:
        """Service acks and heartbeats for up to ``timeout_s`` (returns early once the pipe is drained after the
        first); then apply the ack deadline and the liveness policy."""
        env = self.acks.recv(timeout_s)
        while env is not None:
            self.liveness.observe(env)
            body = env.body
            now = time.monotonic()
            if isinstance(body, WeightsAck):
                if not body.ok:
                    self.failed_loads.inc()
                    self.ctx.log.warning("learner: %s failed to load version %d: %s", body.engine_id,
                                         body.version, body.error)
                counted, rejoined = self.rotation.on_ack(body.engine_id, body.version, body.ok, now)
                self._joined(body.engine_id, counted, rejoined, body.version)
            elif isinstance(body, Heartbeat) and body.service == "rollout" and body.served_version >= 0:
                # serving a version is as good as having acked it: an engine that was silent rejoins here
                counted, rejoined = self.rotation.on_ack(env.sender, body.served_version, True, now)
                self._joined(env.sender, counted, rejoined, body.served_version)
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

    def close(self) -> None:
        self.publisher.close()
        shutil.rmtree(self.dir, ignore_errors=True)
