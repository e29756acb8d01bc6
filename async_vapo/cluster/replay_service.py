"""The replay service: verified groups in (durably), staleness-bounded batches of whole groups out.

Sockets
  * ``in``: PULL, binds ``cluster.ports.replay_port``; GroupsMsg (and Heartbeat) from the verifier. HWM
    ``DEFAULT_HWM`` messages; at the HWM the verifier's PUSH holds (backpressure to the verifier).
  * ``batches``: ROUTER, binds ``cluster.ports.replay_batch_port``; BatchRequest (and READY) from the learner,
    answered at once by a BatchMsg: ``n_groups`` whole groups when the buffer holds that many admissible
    for ``for_version``, else an *empty* BatchMsg ("not yet"; the learner asks again after
    ``cluster.wire.batch_poll_s``). Replies never wait, so a slow learner holds nothing here.

Invariant (enforced by :class:`~async_vapo.replay.ReplayBuffer`, not here): a batch for learner version
v never holds a group older than the ``min_version`` the learner sent with its request (the learner owns
the staleness bound, v − ``async.max_staleness``); older groups are dropped and counted. The replay's own
``async.max_staleness`` only sets the floor after a restart, until the learner's first request.

Durability: the buffer lives on a :class:`~async_vapo.replay.GroupStore` at ``RUN_DIR/replay/groups.log``;
a group is stored (``write(2)``) before the next message is read, and a restarted replay serves the
unconsumed groups and continues the cursor (``BatchMsg.cursor`` = groups served so far).

The loop alternates the two sockets with short polls; one bad group is counted and skipped.
"""

from __future__ import annotations

import time

from async_vapo.cluster.common import ServiceContext
from async_vapo.replay import GroupStore, ReplayBuffer
from async_vapo.transport import BatchMsg, BatchRequest, GroupsMsg, Heartbeat, Transport, make_envelope


class ReplayService:
    def __init__(self, ctx: ServiceContext, transport: Transport, *, in_endpoint: str | None = None,
                 batch_endpoint: str | None = None, store_path=None):
        self.ctx = ctx
        cfg, c = ctx.cfg, ctx.cfg.cluster
        store_path = store_path or ctx.run_dir / "replay" / "groups.log"
        store_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = GroupStore(store_path, fsync=c.replay.fsync)
        self.buffer = ReplayBuffer(self.store, cfg.async_.max_staleness, group_size=cfg.algo.group_size)
        self.transport = transport
        self.pull = self.transport.receiver(in_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.replay_port),
                                            decoder=ctx.decoder((GroupsMsg, Heartbeat), "in"), bind=True)
        self.router = self.transport.replier(batch_endpoint or ctx.endpoint(c.hosts.bind_host,
                                                                            c.ports.replay_batch_port),
                                             decoder=ctx.decoder((BatchRequest,), "batches"), name=ctx.name)
        self.m = ctx.metrics.replay
        self.rejected = ctx.metrics.counter("rejected_groups_total", "Groups refused by validation, by reason.",
                                            labels=("reason",))
        self._stats = self.buffer.stats()
        self._publish_stats()
        ctx.log.info("replay: %d groups restored from %s, cursor %d; in %s, batches %s", len(self.buffer),
                     self.store.path, self._stats.served_groups_total, self.pull.endpoint, self.router.endpoint)

    def _publish_stats(self) -> None:
        new = self.buffer.stats()
        self.m.stored_groups.set(new.stored_groups)
        self.m.stale_drops_total.inc(max(0, new.stale_dropped_total - self._stats.stale_dropped_total))
        for reason, n in new.rejected_total.items():
            self.rejected.labels(reason=reason).inc(max(0, n - self._stats.rejected_total.get(reason, 0)))
        self._stats = new

    def handle_groups(self, msg: GroupsMsg) -> int:
        stored = 0
        for g in msg.groups:
            try:
                stored += self.buffer.add(g) is not None
            except Exception:
                self.ctx.processing_error("add_group", f"storing group {getattr(g, 'uid', '?')}")
        self._publish_stats()
        return stored

    def handle_request(self, env) -> None:
        req: BatchRequest = env.body
        try:
            batch = self.buffer.make_batch(req.n_groups, req.for_version, req.min_version)
        except Exception:
            self.ctx.processing_error("make_batch", f"batch request {req}")
            batch = None
        stats_before = self._stats
        self._publish_stats()
        dropped = self._stats.stale_dropped_total - stats_before.stale_dropped_total
        if batch is None:
            body = BatchMsg(groups=[], batch_id="", cursor=self._stats.served_groups_total, stale_dropped=dropped)
        else:
            self.m.batches_total.inc()
            self.m.batch_assembly_seconds.observe(batch.assembly_seconds)
            for age in batch.ages:
                self.m.sample_age_versions.observe(age)
            body = BatchMsg(groups=batch.groups, batch_id=str(batch.batch_id),
                            cursor=self._stats.served_groups_total, stale_dropped=dropped)
        try:
            self.router.reply(env, make_envelope(body, sender=self.ctx.name),
                              timeout_s=self.ctx.cfg.cluster.wire.send_timeout_s)
        except Exception:
            # The groups were marked consumed: a lost reply loses them (counted), never serves them twice.
            self.ctx.processing_error("reply", f"reply to {env.sender}")

    def step(self, poll_s: float = 0.05) -> None:
        env = self.pull.recv(poll_s)
        while env is not None:
            if isinstance(env.body, GroupsMsg):
                self.handle_groups(env.body)
            env = self.pull.recv(0)
        req = self.router.recv(poll_s)
        while req is not None:
            self.handle_request(req)
            req = self.router.recv(0)

    def run(self) -> None:
        self.ctx.ready(stored_groups=len(self.buffer))
        last = time.monotonic()
        while not self.ctx.stop.is_set():
            self.step()
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                self.ctx.metrics.set_health(stored_groups=len(self.buffer),
                                            served_groups=self._stats.served_groups_total)

    def close(self) -> None:
        self.pull.close()
        self.router.close()
        self.store.close()


def run_replay(ctx: ServiceContext) -> None:
    from async_vapo.transport import ZmqTransport

    with ZmqTransport() as transport:
        svc = ReplayService(ctx, transport)
        try:
            svc.run()
        finally:
            svc.close()
