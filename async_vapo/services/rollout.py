"""The rollout service: one vLLM engine per process, generating groups continuously, stamped with the
weight version that generated them.

Sockets (engine ``rollout-i``)
  * ``groups``: PUSH, connects to the verifier (``cluster.hosts.verifier_host:verifier_port``); GroupsMsg of the
    groups of one ``generate`` call. At the HWM the push holds and so does generation (backpressure).
  * ``weights``: SUB, connects to the learner's XPUB (``cluster.hosts.learner_host:weights_port``);
    WeightsAnnounce, and Heartbeat whose ``weights`` repeats the latest announce (a missed announce is
    recovered within ``cluster.wire.heartbeat_s``; XPUB also re-sends the latest to a new subscriber).
  * ``acks``: PUSH, connects to the learner's PULL (``cluster.ports.acks_port``); one WeightsAck per load
    (ok or not, with load seconds) — the first one, for the served version at start, registers the
    engine — and a Heartbeat every ``cluster.wire.heartbeat_s`` between generate calls.

Weight sync (``async_vapo.weights``): the learner announces each version's shared-memory slot
with its layout. With ``cluster.weights.transfer`` "auto", an engine whose host shares the slot (the file
exists and its header carries the announced token) has its workers map it and load from it in place;
another fetches the bytes in crc32-checked chunks from the learner's ``weights_fetch`` socket
(``cluster.hosts.learner_host:weights_fetch_port``) into its own shared buffer and loads that. Either way the
load happens between two generate calls (the engine is not restarted), is checked against the slot's
header before and after (a slot rewritten meanwhile fails the load, and the engine serves nothing until
it has loaded the newest version), and is acked. With "file" the learner writes a safetensors file
instead; the engine verifies its checksum and loads it. Each load counts in
``weight_transfers_total{via}``, sets ``weight_way{way}`` (1 for the way of the last load), is logged with its way
and acked with it (``WeightsAck.via``).
With "auto" an engine that had to fetch (the learner's slot is not readable here: another host) and can join a
torch.distributed group asks for one after that first fetch; the learner then streams it versions over the group
while it times both ways, and keeps the faster (``async_vapo.weights.choose``). With "dist" it asks at start.
A learner that restarted (its announces carry a new slot token) knows no group: the engine asks again.
An engine always moves to the *latest* announced version (down too, after a learner resumed from an older
checkpoint), so one that fell behind (and was taken out of rotation by the learner) rejoins with its next ack.

Admission control (:class:`Admission`): nothing is generated before the first announce of the learner
arrives (reason ``no_learner``: a resumed learner may be far ahead of the base weights). Before a generate
call the engine knows its served version ``s`` and the learner's latest announced version ``L``. A group
started now is consumed at a learner version ≥ L, so it is usable only if L − s ≤ max_staleness:

  * ``s < L − max_staleness`` -> do not generate, wait for weights (reason ``stale_weights``);
  * a group of version s can only feed updates made at learner versions up to s + max_staleness, and the
    learner takes one batch per update (``prompts_per_step`` groups, plus the value-pretraining batches, all
    at version 0, and DAPO's resampling rounds). So, counted from the learner version the engine first saw
    (its base b), the engine's groups while it serves s are worth generating only while it has made fewer
    than its 1/N share of (s − b + max_staleness + 1) batches (reason ``version_budget``), the pretraining
    batches added when b = 0. The bound is cumulative: an engine faster than the learner runs
    max_staleness batches ahead and then makes one batch per version, never a batch that can only go stale
    (a bound per version would let it make max_staleness + 1 batches of every version, of which the learner
    uses one). With max_staleness = 0 every engine generates exactly its share of one batch per version and
    then waits for the next weights: synchronous on-policy training. Fast problems are not favoured: a
    generate call takes its prompts in sampler order and ships all of them together. With several engines
    each keeps to its own share, so a faster engine does not make up a slower one's (the learner waits for
    the slower, or for the refill below); the engines cannot see each other's counts.
  * a budget that is spent while no new version arrives for ``cluster.rollout.admission_refill_s`` is topped
    up by one share (groups lost to a crash elsewhere must not starve the learner forever; logged, counted in
    ``admission_refills_total``). Sooner when the learner says it starves: its heartbeats carry how long it has
    waited for its batch, and a wait of ``cluster.rollout.admission_starved_s``, reported that long after the
    engine last shipped groups (so not groups still on their way), tops the budget up at once (counted in
    ``admission_refills_total`` too).
  * an announce below the learner's last version (a learner restarted from an older checkpoint) starts the
    count again from that version: the groups made since were made for weights that no longer exist, and
    the learner's next versions are new weights that need their groups.

``max_staleness`` is the learner's: every announce carries its staleness floor (``min_version``), and the
engine takes the bound from it (its own config's ``async.max_staleness`` only until the first announce).

Evaluation: rollout 0 evaluates the held-out split (``rollout.generate.evaluate``, with its own one-worker
``VerifierPool``) whenever it serves the learner's latest version and that is a multiple of
``train.eval_every`` or the last one (``train.total_steps``), and appends ``kind="eval"`` rows, in the
one-process trainer's format, to ``RUN_DIR/metrics.jsonl`` (shared with the learner, see
:class:`~async_vapo.metrics.jsonl.JsonlWriter`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from async_vapo.metrics.rows import open_row_writer
from async_vapo.rollout.generate import PromptEncoder, Rollout, evaluate, generate_groups
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.tasks import PromptSampler
from async_vapo.transport import (
    GroupsMsg,
    Heartbeat,
    Shutdown,
    Transport,
    WeightsAck,
    WeightsAnnounce,
    WeightsGroupJoin,
    WeightsGroupOffer,
    make_envelope,
    split_groups,
)
from async_vapo.types import Group
from async_vapo.weights import load_announced, slot_readable


@dataclass
class Admission:
    """Whether an engine may start a generate call now (see the module docstring); pure bookkeeping."""

    max_staleness: int
    prompts_per_step: int
    num_engines: int
    pretrain_batches: int = 0
    """Value-pretraining batches the learner takes at version 0 (0 when it resumes or has no critic)."""
    rounds_per_batch: int = 1
    """Generation rounds one update may consume (1 + DAPO's max_resample_rounds with dynamic sampling)."""
    refill_s: float = 60.0
    starved_s: float = 10.0
    base: int | None = None
    """The learner version the count starts from: the first one this engine saw (or the one it rolled back to)."""
    made: int = 0
    """Groups generated since ``base``."""
    refills: int = 0
    """Shares added since ``base`` by :meth:`check` after ``refill_s`` without a new version."""
    last_change: float = field(default_factory=time.monotonic)
    last_shipped: float = -math.inf
    """When this engine last shipped groups."""
    starving: bool = False
    """The learner reported a wait of ``starved_s`` at least ``starved_s`` after ``last_shipped``."""

    def share(self) -> int:
        return math.ceil(self.prompts_per_step * self.rounds_per_batch / self.num_engines)

    def budget(self, served: int) -> int:
        """Groups this engine may have made since ``base`` while it serves version ``served``."""
        base = served if self.base is None else self.base
        batches = served - base + self.max_staleness + 1 + (self.pretrain_batches if base == 0 else 0)
        return max(0, batches + self.refills) * self.share()

    def versions_changed(self, now: float | None = None) -> None:
        self.last_change = time.monotonic() if now is None else now
        self.starving = False

    def shipped(self, now: float | None = None) -> None:
        self.last_shipped = time.monotonic() if now is None else now

    def learner_waiting(self, waiting_s: float, now: float | None = None) -> None:
        """The learner's heartbeat: it has waited ``waiting_s`` for its next batch (0: it is not waiting)."""
        now = time.monotonic() if now is None else now
        if waiting_s >= self.starved_s and now - self.last_shipped >= self.starved_s:
            self.starving = True

    def check(self, served: int, learner: int, now: float | None = None) -> str | None:
        """None when a group may start; else the reason it may not."""
        if self.base is None:
            self.base = learner
        if served < learner - self.max_staleness:
            return "stale_weights"
        if self.made >= self.budget(served):
            now = time.monotonic() if now is None else now
            if now - self.last_change < self.refill_s and not self.starving:
                return "version_budget"
            self.refills += 1
            self.last_change = now
            self.starving = False
        return None

    def record(self, version: int, groups: int) -> None:
        self.made += groups

    def rolled_back(self, version: int) -> None:
        """The learner went back to ``version`` (restarted from a checkpoint): what was made since is for weights
        that no longer exist (or already in the replay, for ``version`` itself), so the count starts again there."""
        self.base, self.made, self.refills = version, 0, 0


class RolloutService:
    def __init__(self, ctx: ServiceContext, transport: Transport, engine, tokenizer, train_set, eval_set, *,
                 pretrain_batches: int):
        self.ctx, self.engine, self.tokenizer = ctx, engine, tokenizer
        cfg, c = ctx.cfg, ctx.cfg.cluster
        self.train_set, self.eval_set = train_set, eval_set
        self.engine_id = ctx.name
        # Each engine walks its own seeded order of the training problems.
        self.sampler = PromptSampler(train_set, cfg.train.seed + 7919 * ctx.instance)
        n_engines = cfg.rollout_engines()
        a = cfg.algo
        self.per_call = c.rollout.prompts_per_call or math.ceil(a.prompts_per_step / n_engines)
        self.admission = Admission(cfg.async_.max_staleness, a.prompts_per_step, n_engines,
                                   pretrain_batches=pretrain_batches,
                                   rounds_per_batch=1 + (a.max_resample_rounds if a.dynamic_sampling else 0),
                                   refill_s=c.rollout.admission_refill_s, starved_s=c.rollout.admission_starved_s)
        self.transport = transport
        self.groups_out = self.transport.sender(ctx.endpoint(c.hosts.verifier_host, c.ports.verifier_port),
                                                peer="verifier")
        self.acks = self.transport.sender(ctx.endpoint(c.hosts.learner_host, c.ports.acks_port), peer="learner")
        weights_in = (WeightsAnnounce, WeightsGroupOffer, Heartbeat, Shutdown)
        self.sub = self.transport.subscriber(ctx.endpoint(c.hosts.learner_host, c.ports.weights_port),
                                             decoder=ctx.decoder(weights_in, "weights"), peer="learner")
        self.m = ctx.metrics.rollout
        self.latest: WeightsAnnounce | None = None
        self.learner_version = 0
        self.failed_versions: set[int] = set()
        self.encoder = PromptEncoder.from_config(cfg, tokenizer)
        self.evaluated: set[int] = set()
        self.metrics_log = (open_row_writer(cfg, ctx.run_dir / "metrics.jsonl", ctx.metrics)
                            if ctx.instance == 0 else None)
        self.eval_pool = None
        self.samples_generated = 0
        self._last_beat = 0.0
        self._next_retry = 0.0
        self.m.served_version.set(engine.version)
        self.dist = c.weights.transfer == "dist"
        self.auto = c.weights.transfer == "auto"
        self.remote = False
        """"auto": the learner's slot is not readable here (found at the first fetch): groups are worth asking for."""
        self.backend = getattr(engine, "weight_backend", None)
        """The groups the engine can join ("gloo" / "nccl"; None: none)."""
        self.m_way = m_way = ctx.metrics.get("weight_way")
        for w in ("dist", "shm", "zmq", "file"):
            m_way.labels(way=w).set(0)
        self._learner_token: str | None = None
        self.in_group = False
        self._group_asked = -math.inf
        self._streamed_version: int | None = None
        """"dist": the version of the last WeightsAnnounce (not a heartbeat's copy) naming this engine: the learner
        streams that one right after announcing it."""

    # -- weights --------------------------------------------------------------------------------------------
    def wants_group(self) -> bool:
        """Whether this engine takes torch.distributed groups: "dist", or "auto" on another host than the
        learner's; only if the engine has a weight-transfer backend."""
        return self.backend is not None and (self.dist or (self.auto and self.remote))

    def _on_announce(self, a: WeightsAnnounce) -> None:
        # One publisher, delivered in order: its last word is the truth, even a lower version (a learner
        # restarted from an older checkpoint), so the engine follows it down as well as up.
        self.latest = a
        if a.token and a.token != self._learner_token:
            if self._learner_token is not None and self.in_group:  # a new learner: the old group is gone
                self.in_group = False
                self._group_asked = -math.inf
            self._learner_token = a.token
        if a.min_version >= 0:  # the learner's bound, not this process's copy of the config
            self.admission.max_staleness = a.version - a.min_version
        if a.version != self.learner_version:
            if a.version < self.learner_version:
                self.admission.rolled_back(a.version)
            self.learner_version = a.version
            self.admission.versions_changed()

    def poll_weights(self, timeout_s: float) -> None:
        env = self.sub.recv(timeout_s)
        while env is not None:
            body = env.body
            if isinstance(body, WeightsAnnounce):
                self._on_announce(body)
                self._streamed_version = body.version if self.engine_id in body.dist_engines else None
            elif isinstance(body, WeightsGroupOffer):
                # an offer older than the learner's wait for it is closed already: ask again instead
                fresh = time.time() - env.sent_at < self.ctx.cfg.cluster.weights.dist_join_timeout_s
                if self.wants_group() and body.engine_id == self.engine_id and fresh:
                    self.join_group(body)
                elif self.wants_group() and body.engine_id == self.engine_id:
                    self.ask_group()
            elif isinstance(body, Heartbeat):
                if body.weights is not None:
                    self._on_announce(body.weights)
                if body.service == "learner":
                    self.admission.learner_waiting(body.waiting_s)
            elif isinstance(body, Shutdown):
                self.ctx.log.info("%s: shutdown announced by %s: %s", self.engine_id, env.sender, body.reason)
                self.ctx.stop.set()
            env = self.sub.recv(0)
        if self.wants_group() and not self.in_group \
                and time.monotonic() - self._group_asked > self.ctx.cfg.cluster.weights.dist_join_timeout_s:
            self.ask_group()  # no offer came (or the join failed): ask again
        if self.latest is not None and self.latest.version != self.engine.version:
            if self.latest.version not in self.failed_versions or time.monotonic() >= self._next_retry:
                self.load(self.latest)

    def load(self, a: WeightsAnnounce) -> None:
        t0 = time.perf_counter()
        ok, error, path, seconds = True, "", "", 0.0
        try:
            with self.ctx.busy("load_weights"):
                path, seconds = self._load(a)
            self.m.weight_transfers_total.labels(via=path).inc()
        except Exception as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
            self._next_retry = time.monotonic() + 5.0
            if a.version not in self.failed_versions:  # retried every 5 s: log once per version
                self.failed_versions.add(a.version)
                self.ctx.processing_error("load_weights", f"loading version {a.version}")
        total = time.perf_counter() - t0
        if ok:
            self.m.weight_load_seconds.observe(total)
            self.m.served_version.set(a.version)
            for w in ("dist", "shm", "zmq", "file"):
                self.m_way.labels(way=w).set(1 if w == path else 0)
            self.admission.versions_changed()
            self.ctx.metrics.set_health(served_version=a.version)
            self.ctx.log.info("%s: serving version %d via %s (load %.2f s)", self.engine_id, a.version, path, total)
            if self.auto and path == "zmq" and not self.remote and not slot_readable(a.location, a.token):
                self.remote = True  # another host than the learner's: its group may be faster than the fetch
                if self.backend is not None:
                    self.ctx.log.info("%s: the learner's slot is not readable here (another host): asking for a "
                                      "%s weight group to time against the fetch", self.engine_id, self.backend)
                    self.ask_group()
        self.ack(a.version, ok, seconds if ok else total, error, via=path)

    def _load(self, a: WeightsAnnounce) -> tuple[str, float]:
        """Load ``a`` into the engine; returns the way it came ("dist", "shm", "zmq" or "file") and the seconds of
        that way (a failed group receive before a fetch is not counted: "auto" compares the ways by them)."""
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
                self.engine.version = -1
                self.in_group = False
                self.ctx.log.warning("%s: version %d over the weight group failed (%s: %s); %s, and asking for a new "
                                     "group", self.engine_id, a.version, type(exc).__name__, exc,
                                     "loading the slot" if a.location else "no slot holds it (streamed only): the "
                                     "learner publishes it again, whole, on the failed ack")
                self.ask_group()
        t0 = time.perf_counter()
        way = load_announced(self.engine, a, mode=c.weights.transfer,
                             fetch_endpoint=self.ctx.endpoint(c.hosts.learner_host, c.ports.weights_fetch_port),
                             chunk_bytes=c.weights.chunk_bytes, timeout_s=c.wire.batch_request_timeout_s,
                             engine_id=self.engine_id, max_bytes=c.wire.max_message_bytes,
                             security=getattr(self.transport, "security", None))
        return way, time.perf_counter() - t0

    def ask_group(self) -> None:
        """"dist": ask the learner for a torch.distributed group for weights (it answers with WeightsGroupOffer)."""
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

    def heartbeat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_beat >= self.ctx.cfg.cluster.wire.heartbeat_s:
            self._last_beat = now
            env = make_envelope(Heartbeat(service="rollout", instance=str(self.ctx.instance),
                                          served_version=self.engine.version), sender=self.engine_id,
                                policy_version=self.engine.version)
            self.ctx.send(self.acks, env, "heartbeat")

    # -- generation ---------------------------------------------------------------------------------------------
    def generate_once(self) -> list[Group]:
        r = self.ctx.cfg.rollout
        version = self.engine.version
        problems = self.sampler.take(self.per_call)
        self.m.inflight_groups.set(len(problems))
        try:
            with self.ctx.busy("generate"):
                groups = generate_groups(self.engine, self.encoder, problems, version=version,
                                         n=self.ctx.cfg.algo.group_size, temperature=r.temperature, top_p=r.top_p,
                                         max_tokens=r.max_response_tokens, stop_token_ids=self.encoder.stop_ids)
            self.admission.record(version, len(groups))
            samples = [s for g in groups for s in g.samples]
            self.m.generated_samples_total.inc(len(samples))
            self.m.generated_tokens_total.inc(sum(len(s.response_ids) for s in samples))
            self.samples_generated += len(samples)
            for part in split_groups(groups, self.ctx.cfg.cluster.wire.max_message_bytes // 2):
                self.ctx.send(self.groups_out, make_envelope(GroupsMsg(groups=part), sender=self.engine_id,
                                                             policy_version=version), "groups")
            self.admission.shipped()
        finally:
            self.m.inflight_groups.set(0)
        return groups

    # -- evaluation ---------------------------------------------------------------------------------------------
    def maybe_evaluate(self) -> None:
        cfg = self.ctx.cfg
        v = self.engine.version
        if self.metrics_log is None or not cfg.cluster.rollout.eval or v in self.evaluated:
            return
        if self.latest is None or self.latest.version != v:  # catching up: evaluate the learner's weights only
            return
        if v % cfg.train.eval_every and v != cfg.train.total_steps:
            return
        self.evaluated.add(v)
        from async_vapo.verify.sandbox import VerifierPool

        if self.eval_pool is None:
            self.eval_pool = VerifierPool.from_config(cfg.verifier, num_workers=1)
            pids = self.ctx.run_dir / "pids"
            if pids.is_dir():  # its worker runs in its own session: stop_cluster.sh stops it by PID
                (pids / f"{self.engine_id}.children").write_text(
                    "\n".join(map(str, self.eval_pool.worker_pids)) + "\n")
        try:
            with self.ctx.busy("evaluate"):
                m, _ = evaluate(Rollout(cfg, self.engine, self.eval_pool, self.encoder), self.eval_set, cfg)
        except Exception:
            self.ctx.processing_error("evaluate", f"evaluation of version {v}")
            return
        self.metrics_log.write({"kind": "eval", "step": v, "version": v, "wall_s": self.ctx.elapsed(),
                                "samples_seen": self.samples_generated, **m})
        self.ctx.log.info("%s: held-out accuracy of version %d: %.3f", self.engine_id, v, m["eval/accuracy"])

    # -- loop -----------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.ack(self.engine.version, True, 0.0)
        if self.dist:
            self.ask_group()
        self.ctx.ready(served_version=self.engine.version)
        while not self.ctx.stop.is_set():
            self.poll_weights(0.0)
            self.heartbeat()
            self.maybe_evaluate()
            refills, starving = self.admission.refills, self.admission.starving
            reason = "no_learner" if self.latest is None else self.admission.check(self.engine.version,
                                                                                    self.learner_version)
            if self.admission.refills > refills:
                self.ctx.metrics.get("admission_refills_total").inc()
                why = (f"the learner has waited {self.admission.starved_s:.0f} s for groups since this engine last "
                       "shipped" if starving else f"no new version for {self.admission.refill_s:.0f} s")
                self.ctx.log.warning("%s: %s, with the budget of version %d spent: one more share (groups lost "
                                     "downstream are made up)", self.engine_id, why, self.engine.version)
            if reason is not None:
                self.m.admission_rejects_total.labels(reason=reason).inc()
                self.poll_weights(0.2)
                continue
            try:
                self.generate_once()
            except Exception:
                if self.ctx.stop.is_set():
                    break
                self.ctx.processing_error("generate", "one generate call")
                time.sleep(1.0)

    def close(self) -> None:
        self.ctx.write_stats()  # while the engine core and the eval worker are still up
        for sock in (self.groups_out, self.acks, self.sub):
            sock.close()
        if self.eval_pool is not None:
            self.eval_pool.close()
        if self.metrics_log is not None:
            self.metrics_log.close()


def run_rollout(ctx: ServiceContext) -> None:
    """Start the engine on the base model (version 0) and serve until stopped. Version 0's budget always
    includes the value-pretraining batches: a learner resumed from a checkpoint is past version 0 and
    never asks for its groups, so the rollout need not know whether it resumed."""
    from transformers import AutoTokenizer

    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.tasks import load_task

    cfg = ctx.cfg
    base = ensure_base_model(cfg, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    train_set, eval_set = load_task(cfg)
    longest = PromptEncoder.from_config(cfg, tokenizer).longest(train_set + eval_set)
    spec = EngineSpec.from_config(cfg, base, longest_prompt=longest, instance=ctx.instance)
    ctx.log.info("%s: starting the vLLM engine on %s", ctx.name, base)
    engine = VLLMEngine(spec, version=0)
    ctx.log.info("%s: engine up in %.1f s", ctx.name, engine.start_seconds)
    a = cfg.algo
    pretrain = a.value_pretrain_steps if a.uses_critic else 0
    transport = make_transport(ctx)
    svc = RolloutService(ctx, transport, engine, tokenizer, train_set, eval_set, pretrain_batches=pretrain)
    try:
        svc.run()
    finally:
        svc.close()
        transport.close()
        engine.close()
