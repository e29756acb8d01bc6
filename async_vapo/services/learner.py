"""The learner service: value pretraining, then VAPO updates on batches from the replay; publishes weights.

Sockets (rank 0 only)
  * ``batches``: DEALER (IMMEDIATE), connects to the replay's ROUTER (``cluster.hosts.replay_host:replay_batch_port``);
    READY handshake at start, then BatchRequests(n_groups = as many of the step's prompts_per_step groups as one
    reply of at most half of ``cluster.wire.max_message_bytes`` carries, for_version = v,
    min_version = v − max_staleness, received_cursor = the replay cursor of the last batch received, or of the
    checkpoint resumed from: the replay stores again what it served after it, so a restarted learner or a lost
    reply loses no group; -1 before either is known) at a time, each bounded by ``cluster.wire.batch_request_timeout_s``
    (PeerTimeout: counted in ``replay_timeouts_total``, logged, asked again) and with wait_s =
    ``cluster.wire.batch_poll_s``: the replay holds it until the groups are there, or answers with an empty
    BatchMsg ("not enough admissible groups yet") after that long; the learner services acks and asks again.
  * ``weights`` (XPUB) and ``acks`` (PULL): the weight broadcast, ``async_vapo.weights.sync``.

The step loop is ``async_vapo.learner.loop`` (the one-process trainer runs the same one) over a
:class:`ReplaySource`. Weights (``async_vapo.weights``): each version goes out by ``cluster.weights.transfer``
(shared-memory slots mapped by engines on this host and fetched over ZeroMQ by the others, or a safetensors
file per version, or streams over the engines' torch.distributed weight groups) and the rotation of engines
follows their acks and heartbeats (``WeightBroadcast``). With ``model.lora`` a version is the policy's adapter
(``weights.adapter``: a PEFT directory the engines read where it lies or fetch over ZeroMQ) and the rollout engines
are started with vLLM's LoRA support. ``broadcast_seconds`` is the time from the start of the
write to the last ack of the engines in rotation. A sharded learner with weight groups ("dist", "auto") publishes
on every rank (``learner.sharding.publish_sharded``): a version that every engine takes over its group is gathered
one bucket at a time as it is sent and written to no slot; it is gathered whole on rank 0 only when an engine needs
it so (its slot or its fetch, or none known yet), and published again, whole, when an engine reports that it could
not load a streamed-only version (rank 0's ``idle``, run while its ``ReplaySource`` waits, answers ``REPUBLISH``,
which every rank runs).

torch.distributed: a process group is always initialised (``learner.dist``: NCCL on GPUs, gloo on the CPU): from
torchrun's environment when present, else a world of one over a loopback TCPStore. With several ranks, rank 0 does
all I/O and broadcasts each batch (``learner.loop.BroadcastSource``); every rank runs the step loop on it with
FSDP2-sharded models, each computing its share of every mini-batch (``learner.vapo``), so that the update equals a
single process's (tests/integration/test_data_parallel.py). Logged metrics cover every rank's micro-batches.
The checkpoint to resume from is rank 0's decision, broadcast to the others; with ``resume_since`` (a file written
when the cluster started) it is the run's newest checkpoint written since, when there is one: ranks that a
supervisor or torchrun restarts (a learner spanning hosts re-forms its group that way) continue from there.

Outputs in the run directory, as the one-process trainer: ``metrics.jsonl`` (``kind`` = pretrain / train;
eval rows come from rollout 0; with a critic, ``critic_eval`` rows: the critic scored on the held-out responses
rollout 0 sends after each evaluation, ``critic/heldout_*`` as the one-process trainer's eval rows hold them, which
value pretraining is judged on once they are here; a learner of several ranks does not score the last evaluation's,
sent after its step loop ended), ``checkpoints/step_N/`` (policy, critic, optimisers, version, and in
``extra`` the step, the replay cursor and samples seen) every ``train.checkpoint_every`` updates, at the end
and when stopped mid-run (``--resume auto`` continues from the latest), ``summary.json`` and a ``DONE``
marker. After the last update the service keeps serving /metrics and heartbeats until it is stopped, the heartbeats
saying it is done ("draining"), so that rollout 0 evaluates that last version even when it is not due by
``train.eval_every`` (a run stopped by ``train.max_minutes``); start_cluster.sh --wait stops the cluster on DONE once
that evaluation is written.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from async_vapo.learner.loop import Control
from async_vapo.learner.process_group import broadcast_object, destroy_process_group, init_process_group
from async_vapo.learner.rundir import latest_checkpoint
from async_vapo.metrics.prom import ServiceMetrics
from async_vapo.metrics.rows import open_row_writer
from async_vapo.models import lora
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.staleness import StalenessPolicy, token_lags
from async_vapo.transport import (
    BatchMsg,
    BatchRequest,
    PeerTimeout,
    Transport,
    group_wire_bytes,
    groups_per_request,
    heldout_prefix,
    make_envelope,
)
from async_vapo.weights import WeightBroadcast

REPUBLISH = Control("republish")
"""Every rank publishes the current version again, whole (a sharded learner whose version was streamed to the
engines' weight groups only, and an engine could not load it; ``learner.sharding.publish_sharded``)."""
SCORE_CRITIC = Control("score_critic")
"""Every rank takes rank 0's latest held-out responses (rollout 0's, after an evaluation) and scores the critic on
them (a collective where the critic is sharded); rank 0 writes the ``kind="critic_eval"`` row."""


def export_row(metrics: ServiceMetrics, row: dict, version: int) -> None:
    """Set the learner's gauges from one metrics row (``version``: the learner's after it).

    A value that is undefined for the step (NaN, or None) sets its gauge to NaN, which the exposition format
    carries as ``NaN`` and Grafana draws as a gap: the explained variance of returns that do not vary, for
    instance. The gauge then says "undefined at the last update" rather than keep an older update's value."""
    lm = metrics.learner

    def value(key: str) -> float:
        v = row[key]
        return math.nan if v is None else float(v)

    if row["kind"] == "pretrain":
        lm.value_pretrain_steps_total.inc()
    if row.get("learner/invalid_groups"):
        metrics.get("invalid_groups_total").inc(row["learner/invalid_groups"])
    for kind, key in (("policy", "actor/pg_loss"), ("value", "critic/value_loss"), ("pos_lm", "actor/pos_lm_nll")):
        if key in row:
            lm.loss.labels(kind=kind).set(value(key))
    for gauge, key in ((lm.reward, "rollout/reward"), (lm.accuracy, "rollout/accuracy"),
                       (lm.entropy, "actor/entropy"), (lm.explained_variance, "critic/explained_variance")):
        if key in row:
            gauge.set(value(key))
    for side in ("low", "high"):
        if f"actor/clipfrac_{side}" in row:
            lm.clipfrac.labels(side=side).set(value(f"actor/clipfrac_{side}"))
    for key in row:  # critic_age/<a>/<what>: the critic's error on samples <a> versions old
        if key.startswith("critic_age/") and not key.endswith("/samples"):
            _, age, what = key.split("/")
            metrics.get(f"critic_{what}_by_age").labels(age=age).set(value(key))
    if "mismatch/k3" in row:  # learner.vapo's mismatch/* and correction/*; a lag bucket left out of the row (no
        # token of that lag in the update) sets its gauges to NaN
        kl, abs_lr = metrics.get("mismatch_kl_nats"), metrics.get("mismatch_abs_log_ratio")
        for lag, prefix in (("all", "mismatch/"), ("0", "mismatch/lag0/"), ("1", "mismatch/lag1/"),
                            ("2+", "mismatch/lag2plus/")):
            present = f"{prefix}k3" in row
            kl.labels(lag=lag).set(value(f"{prefix}k3") if present else math.nan)
            for stat in ("mean", "max"):
                key = f"{prefix}abs_log_ratio_{stat}"
                abs_lr.labels(stat=stat, lag=lag).set(value(key) if present else math.nan)
        for stat in ("mean", "max"):
            metrics.get("mismatch_seq_abs_log_ratio").labels(stat=stat).set(value(f"mismatch/seq_abs_log_ratio_{stat}"))
        metrics.get("mismatch_seq_kl_nats").set(value("mismatch/seq_k3"))
        for key, gauge, labels in (("correction/truncated_frac", "correction_truncated_ratio", {}),
                                   ("correction/weight_mean", "correction_weight", {"stat": "mean"}),
                                   ("correction/weight_max", "correction_weight", {"stat": "max"}),
                                   ("correction/masked_frac", "correction_masked_ratio", {"unit": "token"}),
                                   ("correction/masked_seq_frac", "correction_masked_ratio", {"unit": "sequence"})):
            if key in row:
                g = metrics.get(gauge)
                (g.labels(**labels) if labels else g).set(value(key))
    lm.version.set(version)
    if "time/step_s" in row:
        lm.step_seconds.observe(row["time/step_s"])
    metrics.set_health(policy_version=version, step=row.get("step", 0), phase=row["kind"])


class ReplaySource:
    """The learner's batch source: whole groups from the replay service, within the staleness bound.

    It knows batches only. While it waits it calls ``idle(waited_s, wait_s)`` (the service's other work for up to
    ``wait_s``: the weight broadcast's heartbeats and acks); an answer other than None from ``idle`` is returned
    in place of groups, uninterpreted, as long as no group of this call has been received (the service's
    :class:`~async_vapo.learner.loop.Control`). ``next_groups`` returns None once the service is stopped."""

    def __init__(self, ctx: ServiceContext, transport, learner, policy: StalenessPolicy,
                 idle: Callable[[float, float], object | None], row_extra: Callable[[], dict] | None = None):
        """``row_extra``: the service's own figures for each row (beside the replay's)."""
        c = ctx.cfg.cluster
        self.ctx, self.learner, self.policy, self.idle, self.row_extra = ctx, learner, policy, idle, row_extra
        self.req = transport.requester(ctx.endpoint(c.hosts.replay_host, c.ports.replay_batch_port),
                                       decoder=ctx.decoder((BatchMsg,), "batches"), name=ctx.name, peer="replay")
        self.max_reply_bytes = c.wire.max_message_bytes // 2
        # the largest group expected on the wire: the config's longest responses, 64 KiB for prompt and text until
        # a larger one is seen
        self.group_bytes = ctx.cfg.algo.group_size * (8 * ctx.cfg.rollout.max_response_tokens + 512) + 65536
        self.per_request = groups_per_request(self.max_reply_bytes, self.group_bytes)
        self.cursor = 0
        self.cursor_known = False
        """Whether ``cursor`` says what this learner's weights include (from a reply, or a checkpoint)."""
        self.stale_dropped: dict[str, int] = {}
        """Groups the replay dropped as stale since this learner started, by the engine that generated them (the
        heartbeat's ``stale_dropped``: each engine gives them back to its admission budget)."""
        self.late_dropped: dict[str, int] = {}
        """Of those, the groups that reached the replay already stale (the heartbeat's ``late_dropped``)."""
        m = ctx.metrics
        self.replay_timeouts = m.get("replay_timeouts_total")
        self.stale_rejected = m.get("stale_groups_rejected_total")
        self.wait_seconds = m.get("batch_wait_seconds_total")

    def handshake(self) -> bool:
        while not self.ctx.stop.is_set():
            try:
                self.req.handshake(self.ctx.cfg.cluster.wire.batch_request_timeout_s)
                return True
            except PeerTimeout as exc:
                self.replay_timeouts.inc()
                self.ctx.log.warning("learner: replay not answering READY yet: %s", exc)
                self.idle(0.0, 0.0)
        return False

    def next_groups(self, n: int):
        """``n`` whole groups admissible for the current version, with the wait; None when stopped first. They come
        in replies of at most ``per_request`` groups each (half the frame limit, whatever the response length)."""
        c, v = self.ctx.cfg.cluster, self.learner.version
        floor = self.policy.floor(v)
        t0 = time.perf_counter()
        got: list = []
        try:
            while not self.ctx.stop.is_set():
                other = self.idle(time.perf_counter() - t0, 0.0)
                if other is not None and not got:
                    return other
                received = self.cursor if self.cursor_known else -1
                env = make_envelope(BatchRequest(n_groups=min(n - len(got), self.per_request), for_version=v,
                                                 min_version=floor, received_cursor=received,
                                                 wait_s=c.wire.batch_poll_s),
                                    sender=self.ctx.name, policy_version=v)
                asked = time.perf_counter()
                try:
                    reply = self.req.request(env, c.wire.batch_request_timeout_s)
                except PeerTimeout as exc:
                    self.replay_timeouts.inc()
                    # a reply too large for the frame limit never arrives: ask for fewer groups (the replay stores
                    # again what it served after the cursor sent, so nothing is lost)
                    self.per_request = max(1, self.per_request // 2)
                    self.ctx.log.warning("learner: %s", exc)
                    continue
                batch: BatchMsg = reply.body
                if batch.cursor < self.cursor:
                    self.ctx.log.warning("learner: replay cursor %d is behind the checkpoint's %d (replay store "
                                         "replaced?)", batch.cursor, self.cursor)
                self.cursor, self.cursor_known = batch.cursor, True
                for counts, new in ((self.stale_dropped, batch.stale_dropped_by_engine),
                                    (self.late_dropped, batch.late_dropped_by_engine)):
                    for engine, k in new.items():
                        counts[engine] = counts.get(engine, 0) + k
                ok = [g for g in batch.groups if self.policy.usable(g.version, v, floor)]
                if len(ok) != len(batch.groups):  # the replay enforces the bound; never use what breaks it
                    self.stale_rejected.inc(len(batch.groups) - len(ok))
                if ok:
                    got += ok
                    self.group_bytes = max(self.group_bytes, *(group_wire_bytes(g) for g in ok))
                    self.per_request = min(self.per_request,
                                           groups_per_request(self.max_reply_bytes, self.group_bytes))
                    if len(got) >= n:
                        return got, {"time/wait_batch_s": time.perf_counter() - t0}
                    continue
                # the replay held the request for batch_poll_s (a refused one comes back at once: wait the rest)
                self.idle(time.perf_counter() - t0, max(0.0, c.wire.batch_poll_s - (time.perf_counter() - asked)))
            return None
        finally:
            self.wait_seconds.inc(time.perf_counter() - t0)

    def row_metrics(self, kept, version: int) -> dict[str, float]:
        versions = [g.version for g in kept] or [version - 1]
        lags = token_lags(kept, version - 1)  # the batch was for the version before the update
        counter = self.ctx.metrics.get("trained_tokens_by_lag_total")
        for bucket, n in lags["by_lag"].items():
            counter.labels(lag=bucket).inc(n)
        return {"replay/max_age": (version - 1) - min(versions), "replay/cursor": self.cursor,
                "replay/token_lag_mean": lags["mean"], "replay/token_lag_max": lags["max"],
                "replay/multi_version_samples": lags["multi_version_frac"],
                **(self.row_extra() if self.row_extra is not None else {})}

    def state(self) -> dict:
        return {"replay_cursor": self.cursor}

    def restore(self, state: dict) -> None:
        self.cursor = state.get("replay_cursor", 0)
        self.cursor_known = "replay_cursor" in state

    def close(self) -> None:
        pass


class LearnerService:
    def __init__(self, ctx: ServiceContext, transport: Transport | None, resume: str | None = None,
                 resume_since: str | None = None):
        """``transport``: rank 0's (ranks > 0 do no I/O and may pass None). ``resume``: a checkpoint, "auto" (the
        run's newest) or None; ``resume_since``: a file, see the module docstring."""
        import torch
        from transformers import AutoTokenizer

        from async_vapo.learner.loop import BroadcastSource, StepLoop
        from async_vapo.learner.vapo import Learner
        from async_vapo.models.base_model import ensure_base_model
        from async_vapo.models.reward import resolve_critic_path

        self.ctx = ctx
        cfg = ctx.cfg
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.rank, self.world = init_process_group(cfg.learner.dist_timeout_s)
        if self.world > 1:
            ctx.log.info("learner: rank %d of %d (local rank %s of the agent of rendezvous rank %s)", self.rank,
                         self.world, os.environ.get("LOCAL_RANK", "?"), os.environ.get("GROUP_RANK", "?"))
        base = ensure_base_model(cfg, progress=False)
        self.tokenizer = AutoTokenizer.from_pretrained(str(base))
        policy_path = base
        ckpt = None
        if self.rank == 0:
            ckpt = newest_checkpoint_since(ctx.run_dir, Path(resume_since)) if resume_since else None
            if ckpt is None:
                ckpt = latest_checkpoint(ctx.run_dir) if resume == "auto" else (Path(resume) if resume else None)
        if self.world > 1:  # every rank loads the checkpoint rank 0 chose
            ckpt = broadcast_object(None if ckpt is None else str(ckpt))
            ckpt = None if ckpt is None else Path(ckpt)
        if ckpt is not None and (ckpt / "critic").exists():
            critic_path = ckpt / "critic"
        else:
            critic_path = resolve_critic_path(cfg, base, progress=False)
        if ckpt is not None and (ckpt / "policy").exists():  # a sharded learner's checkpoint has only dcp/
            policy_path = ckpt / "policy"
        self.learner = Learner(cfg, policy_path, critic_path, reference_path=base)
        self.staleness = StalenessPolicy.from_config(cfg)
        """The bound (``async_vapo.staleness``): the learner owns it and sends its floor with every batch request
        and every announce."""
        self.sync = self.replay = self.log = None
        leader = self.rank == 0
        if leader:
            self.sync = WeightBroadcast(ctx, transport, device=str(self.learner.device))
            self.replay = ReplaySource(ctx, transport, self.learner, self.staleness, self.idle,
                                       row_extra=self._row_extra)
            self.log = open_row_writer(cfg, ctx.run_dir / "metrics.jsonl", ctx.metrics)
        self.heldout = None
        """The critic's held-out responses (``learner.critic_quality.HeldoutCritic``), the latest rollout 0 sent."""
        self.lend = self._lend_threads() if leader else None
        """(own, every): the torch threads of the learner's own cores and of every core it may run on, when the
        engines lend theirs (``cluster.deploy.lend_cpus``); None: no lending."""
        self._forwards = self._lent_forwards = 0
        self.lm = ctx.metrics.learner
        self.last_publish: dict = {}
        """``publish_sharded``'s figures for the last version this rank published with ``publish_all``."""
        # a LoRA version is its adapter, published whole (publish_state), never streamed as the base's weights
        self.streams = (self.learner.sharded and self.learner.lora is None
                        and cfg.cluster.weights.transfer in ("dist", "auto"))
        """Each version is published by every rank (``publish_all``): gathered one bucket at a time as it is streamed
        to the engines' weight groups, whole on rank 0 only for engines that need it so."""
        self.loop = StepLoop(cfg, self.learner,
                             BroadcastSource(self.replay, self.world, on_control=self.control),
                             pad_id=self.tokenizer.pad_token_id, run_dir=ctx.run_dir, log_writer=self.log,
                             leader=leader, publish=self.publish if leader and not self.streams else None,
                             publish_collective=self.publish_all if self.streams else None,
                             on_row=self._export if leader else None, busy=self.busy, should_stop=ctx.stop.is_set,
                             wall=ctx.elapsed, logger=ctx.log,
                             # value pretraining is judged on rollout 0's held-out responses once they are here
                             heldout_critic=self._heldout_metrics if self.learner.critic is not None else None)
        if ckpt is not None:
            self.loop.resume(self.learner.load_state(ckpt))
            ctx.log.info("learner: resumed from %s at version %d", ckpt, self.learner.version)
        self.lm.version.set(self.learner.version)

    def _lend_threads(self) -> tuple[int, int] | None:
        """Cores follow the work on a CPU host (``cluster.deploy.lend_cpus``; start_cluster.sh lets the learner run
        on every core, with its own share as ``train.threads``): while every engine in rotation waits for a version,
        each forward of the policy or the critic, and the backward that follows in the same thread, runs on every
        core; on its own share again once an engine generates. Set at each forward (a pre-hook), in the thread that
        runs the update: torch's intra-op thread count is the calling thread's. The hook is on each model's backbone
        (``base_model_prefix``), which every forward passes through: the chunked log-probs
        (``learner.logprob_chunk_tokens``) and the frozen critic's trunk call it without the outer model."""
        import torch

        if not self.ctx.cfg.cluster.deploy.lend_cpus or self.world > 1 or self.learner.device.type != "cpu":
            return None
        own, every = torch.get_num_threads(), len(os.sched_getaffinity(0))
        if every <= own:
            return None
        for model in (self.learner.policy, self.learner.critic):
            if model is not None:  # on the backbone: the chunked log-probs and the critic's trunk call it directly
                getattr(model, model.base_model_prefix, model).register_forward_pre_hook(self._threads)
        self.ctx.log.info("learner: %d torch threads of its own, %d while every engine waits for a version (the "
                          "engines lend their cores: cluster.deploy.lend_cpus)", own, every)
        return own, every

    def _threads(self, *_) -> None:
        import torch

        own, every = self.lend
        lent = self.sync.engines_idle()
        self._forwards += 1
        self._lent_forwards += lent
        n = every if lent else own
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _row_extra(self) -> dict:
        """The service's own figures for each row: engines in rotation, and with lending the share of the update's
        forwards that ran on the engines' cores too."""
        row = {"cluster/engines_in_rotation": len(self.sync.rotation.members)}
        if self.lend is not None:
            row["cluster/lent_forward_frac"] = self._lent_forwards / max(1, self._forwards)
            self._forwards = self._lent_forwards = 0
        return row

    def floor(self, version: int) -> int:
        """The staleness floor: the oldest weights a batch for ``version`` may come from. The learner owns it;
        the replay enforces it per request and the engines admit generation by it (both are sent it)."""
        return self.staleness.floor(version)

    def idle(self, waited_s: float, wait_s: float) -> Control | None:
        """Rank 0's work while it waits for a batch: heartbeats, acks (for up to ``wait_s``), and the weight
        broadcast's one request of every rank: :data:`REPUBLISH` when an engine could not load a version that was
        streamed only (``WeightBroadcast.needs_whole``)."""
        self.sync.heartbeat(self.learner.version, waiting_s=waited_s, stale_dropped=self.replay.stale_dropped,
                            late_dropped=self.replay.late_dropped)
        self.sync.poll(wait_s)
        if self.streams and self.sync.needs_whole():
            return REPUBLISH
        return SCORE_CRITIC if self.sync.heldout is not None else None

    @contextmanager
    def busy(self, stage: str) -> Iterator[None]:
        """``ctx.busy(stage)``; on rank 0 an update ("learn") services the weight broadcast from a thread meanwhile,
        as ``idle`` does while the learner waits: heartbeats go on, and each ack is read when it arrives, so the
        rotation and a version's "loaded by every engine" line and ``broadcast_seconds`` say when the engines loaded
        it (read after the update, they said when the next version was made). The broadcast is the thread's alone
        meanwhile: an update publishes nothing, and starting and joining the thread order the hand-over."""
        with self.ctx.busy(stage):
            if stage != "learn" or self.sync is None:
                yield
                return
            done = threading.Event()

            def serve() -> None:
                while not done.is_set():
                    self.sync.heartbeat(self.learner.version, stale_dropped=self.replay.stale_dropped,
                                        late_dropped=self.replay.late_dropped)
                    self.sync.poll(0.1)

            thread = threading.Thread(target=serve, daemon=True, name="learner-weights")
            thread.start()
            try:
                yield
            finally:
                done.set()
                thread.join()
                if self.lend is not None:  # lent cores are for updates: the rest runs on the learner's own share
                    import torch

                    torch.set_num_threads(self.lend[0])

    def control(self, what: Control) -> None:
        """A :class:`Control` of rank 0, on every rank (``BroadcastSource``)."""
        if what == SCORE_CRITIC:
            self.score_critic()
        elif what == REPUBLISH:
            self.publish_again()
        else:
            raise ValueError(f"unknown control {what!r}")

    def score_critic(self) -> None:
        """On every rank: the critic scored on rank 0's latest held-out responses (``HeldoutResponses``), which
        become the set value pretraining is judged on; rank 0 writes a ``kind="critic_eval"`` row (``step``: the
        evaluated version, ``version``: the learner's). Responses that cannot be scored (a token outside the
        vocabulary, no sample) are logged and counted, and change nothing."""
        from async_vapo.learner.critic_quality import HeldoutCritic

        body = self.sync.take_heldout() if self.rank == 0 else None
        got = (body.engine_id, body.version, body.groups) if body is not None else None
        if self.world > 1:
            got = broadcast_object(got)
        if got is None or self.learner.critic is None:
            return
        engine, version, groups = got
        t0 = time.perf_counter()
        try:
            heldout = HeldoutCritic.from_config(self.ctx.cfg, heldout_prefix(groups), self.tokenizer.pad_token_id,
                                                self._decode)
            m = heldout(self.learner)
        except Exception:
            if self.rank == 0:
                self.ctx.processing_error("critic_eval", f"held-out responses of {engine} for version {version}")
            return
        self.heldout = heldout
        if self.rank == 0:
            self.log.write({"kind": "critic_eval", "step": version, "version": self.learner.version,
                            "wall_s": self.ctx.elapsed(), **m, "time/critic_score_s": time.perf_counter() - t0})
            self.ctx.log.info("learner: critic on %d held-out responses of version %d: explained variance %.3f",
                              int(m.get("critic/heldout_responses", 0)), version, m.get("critic/heldout_ev", math.nan))

    def _heldout_metrics(self) -> dict[str, float]:
        """The critic on the latest held-out responses (every rank), or nothing before rollout 0 sent any."""
        return self.heldout(self.learner) if self.heldout is not None else {}

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def publish(self, version: int, state: dict | None = None) -> float:
        """Version ``version`` to the engines: the policy's weights (``state`` when a sharded learner gathered them
        on every rank, else taken here), or with ``model.lora`` served as adapters the policy's adapter alone
        (``weights.adapter``: the engines load it over their base; the merged weights are never built; with
        ``model.lora.serve = "merged"`` the merged weights, as whole weights go)."""
        if state is None:  # an unsharded learner's (a sharded one gathered it on every rank: publish_state)
            state = self.learner.publish_state()
        elif self.learner.publishes_adapter and not all(k.startswith(lora.PEFT_PREFIX) for k in state):
            raise ValueError("a LoRA version is its adapter (Learner.publish_state), not the policy's weights")
        return self.sync.publish(version, state, self.floor(version))

    def publish_all(self, version: int, again: bool = False) -> dict[str, float]:
        """A sharded learner's publish with weight groups, on every rank (``learner.sharding.publish_sharded``);
        returns the leader's row figures: ``time/weight_push_s`` and ``learner/weight_gather_peak_bytes``, the most
        gathered bytes rank 0 held at once (one bucket where every engine was streamed, else the whole version)."""
        from async_vapo.learner.sharding import publish_sharded

        got = self.last_publish = publish_sharded(self.learner.policy, self.learner.precision.compute_dtype,
                                                  self.sync, version, self.floor(version), again=again)
        if self.rank != 0:
            return {}
        if again:
            self.ctx.log.info("learner: version %d published again, whole, for an engine that could not load it",
                              version)
        return {"time/weight_push_s": got["seconds"], "learner/weight_gather_peak_bytes": got["peak_bytes"]}

    def publish_again(self) -> None:
        """The latest version once more, whole (on every rank: :data:`REPUBLISH`)."""
        self.publish_all(self.learner.version, again=True)

    # -- metrics -------------------------------------------------------------------------------------------------
    def _export(self, row: dict) -> None:
        export_row(self.ctx.metrics, row, self.learner.version)

    # -- run ------------------------------------------------------------------------------------------------------
    def run(self) -> None:
        v = self.learner.version
        state = None
        if self.streams:  # a collective
            self.publish_all(v)
        elif not self.learner.publishes_adapter or self.learner.sharded:
            state = self.learner.publish_state()  # a collective when the learner is sharded
        if self.rank != 0:
            self.loop.run()
            return None
        if not self.streams:
            self.publish(v, state)
        self.ctx.ready(policy_version=v, phase="handshake")
        if not self.replay.handshake():
            self.loop.source.close()
            return None
        finished = self.loop.run()
        if finished:
            step = self.loop.step
            summary = {"run_dir": str(self.ctx.run_dir), "steps": step, "version": self.learner.version,
                       "wall_s": self.ctx.elapsed(), "samples_seen": self.loop.samples_seen,
                       "replay_cursor": self.replay.cursor, "learner_ranks": self.world}
            (self.ctx.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            (self.ctx.run_dir / "DONE").write_text(f"{step}\n")
            self.ctx.metrics.set_health(phase="done")
            self.ctx.log.info("learner: done after %d updates", step)
        while not self.ctx.stop.is_set():  # keep heartbeats and /metrics up until stopped
            # "draining" once finished: rollout 0 evaluates the last version (one out of time included)
            self.sync.heartbeat(self.learner.version, status="draining" if finished else "ready")
            self.sync.poll(0.5)
            if self.world == 1 and self.sync.heldout is not None:  # the last evaluation's (the other ranks are gone)
                self.score_critic()
        return None

    def close(self) -> None:
        if self.replay is not None:
            self.replay.req.close()
        if self.sync is not None:
            self.sync.pub.close()
            self.sync.acks.close()
        if self.sync is not None:
            self.sync.close()
        if self.log is not None:
            self.log.close()
        destroy_process_group()


def newest_checkpoint_since(run_dir: Path, marker: Path) -> Path | None:
    """The run's newest complete checkpoint (highest step) among those written after ``marker`` was, or None: the
    rule of a restarted learner under deploy/start_cluster.sh, whose supervisor config is the marker."""
    from async_vapo.learner.rundir import checkpoint_dirs

    since = marker.stat().st_mtime
    steps = [(n, p) for n, p in checkpoint_dirs(run_dir) if (p / "learner_state.pt").stat().st_mtime > since]
    return steps[-1][1] if steps else None


def run_learner(ctx: ServiceContext, resume: str | None = None, resume_since: str | None = None) -> None:
    with make_transport(ctx) as transport:
        svc = LearnerService(ctx, transport, resume, resume_since)
        try:
            svc.run()
        finally:
            svc.close()


LEARNER_USAGE = """Learner service: value pretraining, VAPO updates, weight broadcast.

    python -m async_vapo.services.learner --config FILE [--run-dir DIR] [--resume CKPT|auto] [key.sub=value ...]
    torchrun --nproc-per-node N -m async_vapo.services.learner ...   (ranks > 0 serve /metrics on port + rank)
    torchrun --nnodes H --rdzv-backend c10d ... -m async_vapo.services.learner --node-rank I --host-addr ADDR ...
                                                  (one agent per learner host: deploy/start_cluster.sh)
"""


def main(argv: list[str] | None = None) -> int:
    """The learner service's entry point (:data:`LEARNER_USAGE`), under torchrun or alone."""
    import sys

    from async_vapo.services.context import run_service, service_arg_parser

    agent = os.getppid()  # torchrun's agent, when there is one
    parser = service_arg_parser("learner", LEARNER_USAGE)
    parser.add_argument("--resume", help="checkpoint directory, or 'auto' for the run's latest")
    parser.add_argument("--resume-since", metavar="FILE",
                        help="resume from the run's newest checkpoint written after FILE when there is one (else "
                             "--resume): ranks that torchrun or a supervisor restarts continue where the group was")
    parser.add_argument("--node-rank", type=int,
                        help="under torchrun: this agent's place among the learner hosts; global rank = NODE_RANK x "
                             "ranks per agent + local rank, so that rank 0 is on the first learner host")
    parser.add_argument("--host-addr", metavar="ADDR",
                        help="under torchrun: the address the other learner hosts reach this one at; gloo connects "
                             "over the interface that holds it (GLOO_SOCKET_IFNAME, unless set)")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from async_vapo.learner.process_group import die_with_agent, gloo_interface_for, rank_by_node

        die_with_agent(agent)
        known = parser.parse_args(argv)
        if known.node_rank is not None:
            rank_by_node(known.node_rank)
        if known.host_addr:
            gloo_interface_for(known.host_addr)
    rank = int(os.environ.get("RANK", "0"))
    if rank:
        argv = ["--instance", str(rank), *argv]
    return run_service("learner", argv, lambda ctx, args: run_learner(ctx, resume=args.resume,
                                                                      resume_since=args.resume_since), parser)


if __name__ == "__main__":
    import sys

    sys.exit(main())
