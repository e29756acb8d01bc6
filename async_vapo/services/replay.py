"""The replay service: verified groups in (durably), staleness-bounded batches of whole groups out.

Sockets
  * ``in``: PULL, binds ``cluster.ports.replay_port``; GroupsMsg (and Heartbeat) from the verifier. HWM
    ``DEFAULT_HWM`` messages; at the HWM the verifier's PUSH holds (backpressure to the verifier).
  * ``batches``: ROUTER, binds ``cluster.ports.replay_batch_port``; BatchRequest (and READY) from the learner,
    answered by a BatchMsg: ``n_groups`` whole groups as soon as the buffer holds that many admissible
    for ``for_version``, or an *empty* BatchMsg ("not yet") once the request's ``wait_s`` (at most
    ``MAX_HOLD_S``; the learner sends ``cluster.wire.batch_poll_s``) has passed without them; the learner then
    asks again. A request is held in the replay, never the replay in a request: a new request from the same
    learner answers its held one (empty) first, and a slow learner holds nothing here.

Invariant (``async_vapo.staleness``, enforced by :class:`~async_vapo.replay.ReplayBuffer`, not here): a batch for
learner version v never holds a group older than the ``min_version`` the learner sent with its request (the learner
owns the staleness bound; the replay reads none of its own); older groups are dropped and counted.

Validation (the replay is a trust boundary): a group is stored only if its token ids are in the policy's
vocabulary, its log-probs finite and <= 0, its rewards finite and from the verifier's reward set (``correct``
exactly for ``reward_correct``), its version at most the learner's newest + 1, its sizes consistent and its
(uid, version) not already stored; else it is counted in ``rejected_groups_total{reason}``. A batch request
for a version beyond the newest seen + 1, with a floor above its version or more groups than the buffer
holds is refused (``rejected_requests_total{reason}``, answered with an empty batch, never acted on).

Disk full (or any I/O error of the store): the group that failed and the rest of its message are held in
memory, counted (``store_errors_total{errno}``, ``held_groups``), health turns "degraded", and nothing more is
read from ``in`` until the store takes them (retried every second). The pipe then fills to its HWM and the
verifier's pushes hold (``backpressure_total``): backpressure, never a silent drop.

Durability: the buffer lives on a :class:`~async_vapo.replay.GroupStore` at ``RUN_DIR/replay/groups.log``;
a group is stored (``write(2)``) before the next message is read, and a restarted replay serves the
unconsumed groups and continues the cursor (``BatchMsg.cursor`` = groups served so far). A batch request's
``received_cursor`` below that cursor (a learner restarted from a checkpoint, or a reply that was lost) stores the
groups served after it again (``ReplayBuffer.rewind``, counted in ``requeued_groups_total``), so a group the replay
acknowledged is trained on by an update that survives, or dropped with a reason.

The loop waits on both sockets at once (``Transport.wait_any``), so a group or a request is handled as it arrives
and a held request is answered as soon as the groups that fill it are stored; one bad group is counted and
skipped.
"""

from __future__ import annotations

import errno
import time

from async_vapo.replay import GroupStore, ReplayBuffer
from async_vapo.replay.buffer import GroupLimits
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.transport import BatchMsg, BatchRequest, GroupsMsg, Heartbeat, Transport, make_envelope


class ReplayService:
    RETRY_S = 1.0
    """Seconds between attempts to store held groups."""
    MAX_HOLD_S = 5.0
    """The longest a batch request is held for groups still to come (half the learner's default request timeout)."""

    def __init__(self, ctx: ServiceContext, transport: Transport, *, in_endpoint: str | None = None,
                 batch_endpoint: str | None = None, store_path=None, vocab_size: int | None = None):
        """``vocab_size``: the policy's; a group with a token id outside it is refused (None: not checked)."""
        self.ctx = ctx
        cfg, c = ctx.cfg, ctx.cfg.cluster
        store_path = store_path or ctx.run_dir / "replay" / "groups.log"
        store_path.parent.mkdir(parents=True, exist_ok=True)
        self.store = GroupStore(store_path, fsync=c.replay.fsync)
        self.buffer = ReplayBuffer(self.store, None, group_size=cfg.algo.group_size,
                                   limits=GroupLimits.from_config(cfg, vocab_size=vocab_size))
        self.transport = transport
        self.pull = self.transport.receiver(in_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.replay_port),
                                            decoder=ctx.decoder((GroupsMsg, Heartbeat), "in"), bind=True,
                                            peer="verifier")
        self.router = self.transport.replier(batch_endpoint or ctx.endpoint(c.hosts.bind_host,
                                                                            c.ports.replay_batch_port),
                                             decoder=ctx.decoder((BatchRequest,), "batches"), name=ctx.name,
                                             peer="learner")
        self.m = ctx.metrics.replay
        self.rejected = ctx.metrics.get("rejected_groups_total")
        self.store_errors = ctx.metrics.get("store_errors_total")
        self.held = ctx.metrics.get("held_groups")
        self._held: list = []
        self._waiting: list[tuple] = []
        """Batch requests held for groups still to come: (request, answer-empty-at monotonic time)."""
        self._holding = False
        self._retry_at = 0.0
        self.bad_requests = ctx.metrics.get("rejected_requests_total")
        self.requeued = ctx.metrics.get("requeued_groups_total")
        self.requeue_lost = ctx.metrics.get("requeue_lost_groups_total")
        self._stats = self.buffer.stats()
        self._told: tuple[dict[str, int], dict[str, int]] = ({}, {})
        """Stale and late drops by engine already told to the learner (``BatchMsg.stale_dropped_by_engine``,
        ``late_dropped_by_engine``)."""
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
        return self._store(list(msg.groups))

    def _store(self, groups: list) -> int:
        """Store ``groups``; when the disk refuses one (full, I/O error), hold it and the rest of the message
        for a retry (backpressure: nothing more is read meanwhile), never drop them."""
        stored = 0
        for i, g in enumerate(groups):
            try:
                stored += self.buffer.add(g) is not None
            except OSError as exc:
                self._held, self._retry_at = groups[i:], time.monotonic() + self.RETRY_S
                self.store_errors.labels(errno=errno.errorcode.get(exc.errno or 0, "unknown")).inc()
                if not self._holding:
                    self.ctx.log.error("replay: cannot store groups (%s): holding %d, reading nothing more until "
                                       "the store takes them (retry every %.0f s)", exc, len(self._held),
                                       self.RETRY_S)
                    self.ctx.metrics.set_health(status="degraded", reason=f"store: {exc.strerror or exc}")
                self._holding = True
                break
            except Exception:
                self.ctx.processing_error("add_group", f"storing group {getattr(g, 'uid', '?')}")
        else:
            self._held = []
            if self._holding:
                self._holding = False
                self.ctx.log.info("replay: the store takes groups again")
                self.ctx.metrics.set_health(status="ok", reason="")
        self.held.set(len(self._held))
        self._publish_stats()
        return stored

    def handle_request(self, env) -> None:
        req: BatchRequest = env.body
        for held in [w for w in self._waiting if w[0].sender == env.sender]:  # it asked again: it wants the new one
            self._waiting.remove(held)
            self._answer(held[0], None)
        error = self.buffer.request_error(req.n_groups, req.for_version, req.min_version)
        if error is not None:
            self.bad_requests.labels(reason=error).inc()
            self.ctx.log.warning("replay: refused batch request from %s (%s): %s", env.sender, error, req)
            self._answer(env, None)
            return
        try:
            self._rewind(req.received_cursor, env.sender)
        except Exception:
            self.ctx.processing_error("make_batch", f"batch request {req}")
            self._answer(env, None)
            return
        hold = min(req.wait_s, self.MAX_HOLD_S) if req.wait_s > 0 else 0.0  # (NaN: no hold)
        self._serve(env, time.monotonic() + hold)

    def _serve(self, env, answer_by: float) -> None:
        """Answer ``env`` with its batch if the buffer holds it; else hold it until ``answer_by``, then answer
        with none."""
        req: BatchRequest = env.body
        try:
            batch = self.buffer.make_batch(req.n_groups, req.for_version, req.min_version)
        except Exception:
            self.ctx.processing_error("make_batch", f"batch request {req}")
            self._answer(env, None)
            return
        if batch is None and time.monotonic() < answer_by:
            self._waiting.append((env, answer_by))
            self._publish_stats()
            return
        self._answer(env, batch)

    def _serve_waiting(self) -> None:
        waiting, self._waiting = self._waiting, []
        for env, answer_by in waiting:
            self._serve(env, answer_by)

    def _answer(self, env, batch) -> None:
        stats_before = self._stats
        self._publish_stats()
        dropped = self._stats.stale_dropped_total - stats_before.stale_dropped_total
        # by engine since the last answer (not since the last stats, which adds and held requests refresh too)
        now = (self._stats.stale_dropped_by_engine, self._stats.late_dropped_by_engine)
        stale, late = ({e: n - told.get(e, 0) for e, n in counts.items() if n > told.get(e, 0)}
                       for counts, told in zip(now, self._told, strict=True))
        self._told = (dict(now[0]), dict(now[1]))
        if batch is None:
            body = BatchMsg(groups=[], batch_id="", cursor=self._stats.served_groups_total, stale_dropped=dropped,
                            stale_dropped_by_engine=stale, late_dropped_by_engine=late)
        else:
            self.m.batches_total.inc()
            self.m.batch_assembly_seconds.observe(batch.assembly_seconds)
            for age in batch.ages:
                self.m.sample_age_versions.observe(age)
            body = BatchMsg(groups=batch.groups, batch_id=str(batch.batch_id),
                            cursor=self._stats.served_groups_total, stale_dropped=dropped,
                            stale_dropped_by_engine=stale, late_dropped_by_engine=late)
        try:
            self.router.reply(env, make_envelope(body, sender=self.ctx.name),
                              timeout_s=self.ctx.cfg.cluster.wire.send_timeout_s)
        except Exception:
            # The groups were marked consumed: a lost reply loses them (counted), never serves them twice.
            self.ctx.processing_error("reply", f"reply to {env.sender}")

    def _rewind(self, received_cursor: int, sender: str) -> None:
        """Groups served after what the learner's weights include go back into the buffer (a learner restarted
        from a checkpoint, or a lost reply): none acknowledged is lost to a learner's crash."""
        again, missing = self.buffer.rewind(received_cursor)
        if again or missing:
            self.requeued.inc(again)
            self.requeue_lost.inc(missing)
            self.ctx.log.info("replay: %s has received %d groups of the %d served: %d stored again%s", sender,
                              received_cursor, self._stats.served_groups_total, again,
                              f", {missing} no longer in the log (compacted)" if missing else "")

    def step(self, poll_s: float = 0.05) -> None:
        now = time.monotonic()
        timeout = min([poll_s, *(max(0.0, t - now) for _, t in self._waiting)])
        if self._held:  # backpressure: the pipe fills up to its HWM and the verifier holds its sends
            if now >= self._retry_at:
                self._store(self._held)
            else:
                self.transport.wait_any([self.router], min(timeout, self._retry_at - now))
        else:
            self.transport.wait_any([self.pull, self.router], timeout)
            env = self.pull.recv(0)
            while env is not None and not self._held:
                if isinstance(env.body, GroupsMsg):
                    self.handle_groups(env.body)
                env = None if self._held else self.pull.recv(0)
        req = self.router.recv(0)
        while req is not None:
            self.handle_request(req)
            req = self.router.recv(0)
        if self._waiting:
            self._serve_waiting()

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


def model_vocab_size(ctx: ServiceContext) -> int:
    """The policy's vocabulary size, from its ``config.json`` (no model is loaded)."""
    import json
    from pathlib import Path

    from async_vapo.models.base_model import ensure_base_model

    path = Path(ctx.cfg.model.path or ensure_base_model(ctx.cfg, progress=False))
    return int(json.loads((path / "config.json").read_text())["vocab_size"])


def run_replay(ctx: ServiceContext) -> None:
    with make_transport(ctx) as transport:
        svc = ReplayService(ctx, transport, vocab_size=model_vocab_size(ctx))
        try:
            svc.run()
        finally:
            svc.close()


def main(argv: list[str] | None = None) -> int:
    """Replay service: durable, staleness-bounded buffer of verified groups:

        python -m async_vapo.services.replay --config FILE [--run-dir DIR] [key.sub=value ...]
    """
    from async_vapo.services.context import run_service

    return run_service("replay", argv, lambda ctx, args: run_replay(ctx))


if __name__ == "__main__":
    import sys

    sys.exit(main())
