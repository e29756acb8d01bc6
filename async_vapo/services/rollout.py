"""The rollout service: one vLLM engine per process, generating groups continuously, every token stamped with the
weight version that generated it.

Sockets (engine ``rollout-i``)
  * ``groups``: PUSH, connects to the verifier (``cluster.hosts.verifier_host:verifier_port``); GroupsMsg of the
    groups of one ``generate`` call (lock-step), or of each group as it finishes (continuous). At the HWM the push
    holds and so does the loop (backpressure).
  * ``weights`` (SUB) and ``acks`` (PUSH): the engine's side of the weight protocol,
    :class:`~async_vapo.weights.client.EngineWeightClient` (announces, group offers, acks, heartbeats, the ways
    weights come). The service polls it between two steps of its loop; the client applies a version through the
    engine's one entry point, ``apply_weights``.

Generation (``rollout.generation``): ``lockstep`` calls ``generate`` on ``cluster.rollout.prompts_per_call`` prompts
and ships their groups together, loading new weights between two calls; ``continuous``
(:class:`ContinuousDriver`) keeps vLLM's async engine at ``rollout.max_in_flight`` sequences, a request per group
(with ``rollout.env``, a request per sample and turn: ``rollout.generate.EnvConversation``), ships each group the
moment its samples end, and loads new weights in flight (``rollout.weight_update``: keep, wait
or abort the requests running), each token keeping the version that sampled it (``Trajectory.version_spans``).

Admission (:class:`~async_vapo.staleness.Admission`, the one staleness rule of ``async_vapo.staleness``): before each
generate call (lock-step) or each group's submission (continuous) the engine asks whether its served version may still
make groups the learner can use, and whether its share of the batches those versions can feed is spent (reasons
``no_learner``, ``stale_weights``, ``version_budget``, counted in ``admission_rejects_total``; budgets topped up after a
refill timeout or when the learner reports it starves, in ``admission_refills_total``). ``max_staleness`` is the
learner's: every announce carries its staleness floor (``min_version``), and nothing is generated before the first one
arrives.

Evaluation: rollout 0 evaluates the held-out split (``rollout.generate.evaluate``, with its own one-worker
``VerifierPool``) whenever it serves the learner's latest version and that is a multiple of
``train.eval_every`` or the last one (``train.total_steps``, or the version of a learner that says it has finished:
a run stopped by ``train.max_minutes`` ends with an evaluation of its last version, as the one-process trainer's
does), and appends ``kind="eval"`` rows, in the one-process trainer's format, to ``RUN_DIR/metrics.jsonl`` (shared
with the learner, see :class:`~async_vapo.metrics.jsonl.JsonlWriter`). An evaluation stalls nothing on the learner's
side, however long. With ``cluster.rollout.eval_share`` above 0 (off by default: measured no faster on SmolLM2, see
the setting) a continuous engine evaluates in a thread, beside its training groups: the evaluation's requests take
at most that share of the engine's sequences and the loop goes on filling the rest with training groups and shipping
them as they end, while loads of new versions wait until the evaluation ends (every evaluated token is the evaluated
version's; ``EngineWeightClient.held``) and the heartbeats say "busy". Otherwise, and always on a lock-step
engine, rollout 0 evaluates alone between two generate calls (or two steps of the continuous driver), its heartbeats
sent from a thread meanwhile ("busy", ``EngineWeightClient.beating``): at once (``cluster.rollout.eval_when`` "due"),
or, with "idle", once the engine has made what the due version's budget allows and shipped it (new versions held
until then), so that the evaluation fills the engine's wait for the learner's next version. Either way the learner
keeps the engine alive and in rotation, and the loop takes the learner's latest version as soon as the evaluation
ends. When the algorithm has a critic, rollout 0 then sends the learner the held-out responses to score it on
(``rollout.generate.critic_heldout_groups``: the evaluation's own, or fresh ones with ``rollout.critic_eval_problems``,
their seconds in the eval row's ``time/critic_eval_s``) as a HeldoutResponses message on the acks socket, from its
loop's thread; the learner writes the scores as a ``kind="critic_eval"`` row.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time

from async_vapo.metrics.rows import open_row_writer
from async_vapo.rollout.env import EnvRunner
from async_vapo.rollout.generate import (
    EnvConversation,
    PromptEncoder,
    Rollout,
    critic_heldout_groups,
    generate_groups,
    make_group,
    run_evaluation,
    warn_if_truncated,
)
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.staleness import Admission
from async_vapo.tasks import PromptSampler
from async_vapo.transport import (
    GroupsMsg,
    Transport,
    WeightsAnnounce,
    heldout_prefix,
    make_envelope,
    split_groups,
)
from async_vapo.types import Group
from async_vapo.weights.client import EngineWeightClient


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
        self.admission = Admission(None, a.prompts_per_step, n_engines, pretrain_batches=pretrain_batches,
                                   rounds_per_batch=1 + (a.max_resample_rounds if a.dynamic_sampling else 0),
                                   refill_s=c.rollout.admission_refill_s, starved_s=c.rollout.admission_starved_s)
        self.transport = transport
        self.groups_out = self.transport.sender(ctx.endpoint(c.hosts.verifier_host, c.ports.verifier_port),
                                                peer="verifier")
        self._threads_now: int | None = None
        self._lent_since: float | None = None
        self.engine_threads: tuple[int, int] | None = None
        self.engine_threads = self._engine_threads()
        """(own, every): the engine's OpenMP threads while the learner works and while it waits for a batch
        (``cluster.deploy.lend_cpus``, ``cluster.rollout.engine_threads``); None: the engine keeps its threads."""
        self.weights = EngineWeightClient(ctx, transport, engine, on_announce=self._on_announce,
                                          on_learner_waiting=self._learner_waiting,
                                          on_dropped=self._on_dropped,
                                          on_loaded=self._on_loaded)
        self.continuous = ContinuousDriver(self) if cfg.rollout.generation == "continuous" else None
        self.m = ctx.metrics.rollout
        self.encoder = PromptEncoder.from_config(cfg, tokenizer)
        self.env = EnvRunner.from_config(cfg)  # rollout.env: multi-turn groups (None: one turn)
        self.evaluated: set[int] = set()
        self._eval_due: int | None = None  # cluster.rollout.eval_when = "idle": the version kept for its evaluation
        self.metrics_log = (open_row_writer(cfg, ctx.run_dir / "metrics.jsonl", ctx.metrics)
                            if ctx.instance == 0 else None)
        self.eval_pool = None
        self._eval_thread: threading.Thread | None = None
        self._heldout: queue.SimpleQueue[tuple[int, list[Group]]] = queue.SimpleQueue()
        """(version, groups): held-out responses for the learner's critic, sent from the loop's thread (the
        evaluation may run in another: ``cluster.rollout.eval_share``)."""
        self.samples_generated = 0

    def _engine_threads(self) -> tuple[int, int] | None:
        """Cores follow the work the other way (``cluster.deploy.lend_cpus``): start_cluster.sh starts the one engine
        on every core of a CPU host and sets its own share as ``cluster.rollout.engine_threads``; the engine's forwards
        run on that many threads while the learner works, on every core while it says it waits for a batch."""
        own = self.ctx.cfg.cluster.rollout.engine_threads
        if not own or not self.ctx.cfg.cluster.deploy.lend_cpus:
            return None
        if self.ctx.cfg.rollout.generation != "continuous" or not hasattr(self.engine, "set_threads"):
            self.ctx.log.warning("%s: cluster.rollout.engine_threads needs rollout.generation = \"continuous\": the "
                                 "engine keeps the threads it started with", self.engine_id)
            return None
        every = len(os.sched_getaffinity(0))
        if every <= own:
            return None
        self.ctx.log.info("%s: %d engine threads of its own, %d while the learner waits for a batch (it lends its "
                          "cores: cluster.deploy.lend_cpus)", self.engine_id, own, every)
        self._set_engine_threads(own, own)
        return own, every

    def _learner_waiting(self, waiting_s: float) -> None:
        """Each of the learner's heartbeats: admission hears how long it has waited for a batch, and with
        :meth:`_engine_threads` the engine takes its cores while it waits, gives them back when it works."""
        self.admission.learner_waiting(waiting_s)
        if self.engine_threads is not None:
            own, every = self.engine_threads
            self._set_engine_threads(every if waiting_s > 0 else own, own)

    def _set_engine_threads(self, n: int, own: int) -> None:
        if n == self._threads_now:
            return
        self._lent(n > own)
        self._threads_now = n
        self.ctx.metrics.get("engine_threads").set(n)

        def done(fut) -> None:
            if fut.exception() is not None:
                self.ctx.log.warning("%s: the engine could not set %d threads: %s", self.engine_id, n,
                                     fut.exception())

        self.engine.set_threads(n).add_done_callback(done)

    def _lent(self, lent: bool) -> None:
        """The engine runs on the learner's cores from now on, or no longer: each such span is recorded in the busy
        log as ``engine_lent``."""
        now = time.time()
        if self._lent_since is not None:
            self.ctx.record_busy("engine_lent", self._lent_since, now)
        self._lent_since = now if lent else None

    def _on_announce(self, a: WeightsAnnounce, previous: int) -> None:
        self.admission.announced(a.version, a.min_version)

    def _on_dropped(self, stale: int, late: int) -> None:
        back = self.admission.dropped(stale, late)
        if back:
            self.ctx.metrics.get("admission_given_back_total").labels(kind="late").inc(back)
            self.ctx.log.info("%s: %d of its groups reached the replay already stale: given back to its budget",
                              self.engine_id, back)

    def _on_loaded(self, version: int, way: str) -> None:
        self.admission.versions_changed()
        if self.continuous is not None:
            self.continuous.loaded()

    def admit(self) -> str | None:
        """None when a generate call may start now, else the reason it may not (counted, and a refill logged)."""
        in_flight = len(self.continuous.pending) if self.continuous is not None else 0
        refills, starving = self.admission.refills, self.admission.starving and not in_flight  # the refill's reason
        waited = self.admission.given_back["waited"]
        reason = "no_learner" if self.weights.latest is None else self.admission.check(
            self.engine.version, self.weights.learner_version, in_flight=in_flight)
        if self.admission.given_back["waited"] > waited:
            back = self.admission.given_back["waited"] - waited
            self.ctx.metrics.get("admission_given_back_total").labels(kind="waited").inc(back)
            self.ctx.log.info("%s: the learner is short of groups: %d of its groups that went stale waiting in the "
                              "replay given back to its budget", self.engine_id, back)
        if self.admission.refills > refills:
            self.ctx.metrics.get("admission_refills_total").inc()
            why = (f"the learner has waited {self.admission.starved_s:.0f} s for groups since this engine last "
                   "shipped" if starving else f"no new version for {self.admission.refill_after_s:.0f} s")
            self.ctx.log.warning("%s: %s, with the budget of version %d spent: one more share (groups lost "
                                 "downstream are made up)", self.engine_id, why, self.engine.version)
        if reason is not None:
            self.m.admission_rejects_total.labels(reason=reason).inc()
        return reason

    # -- generation ---------------------------------------------------------------------------------------------
    def generate_once(self) -> list[Group]:
        r = self.ctx.cfg.rollout
        version = self.engine.version
        problems = self.sampler.take(self.per_call)
        self.m.inflight_groups.set(len(problems))
        try:
            # a lock-step call takes no message until it returns, however long (SmolLM2's first batch on one core: 33
            # s); its heartbeats go on from a thread, so the learner neither declares it dead nor drops it meanwhile
            with self.ctx.busy("generate"), self.weights.beating():
                groups = generate_groups(self.engine, self.encoder, problems, version=version,
                                         n=self.ctx.cfg.algo.group_size, temperature=r.temperature, top_p=r.top_p,
                                         max_tokens=r.max_response_tokens, stop_token_ids=self.encoder.stop_ids,
                                         env=self.env)
            self.admission.record(version, len(groups))
            self.ship(groups, version)
        finally:
            self.m.inflight_groups.set(0)
        return groups

    # -- evaluation ---------------------------------------------------------------------------------------------
    def maybe_evaluate(self) -> bool:
        """Evaluate the served version when it is due; whether an evaluation ended now (the learner went on
        meanwhile). The evaluation runs here, alone; with ``cluster.rollout.eval_share`` above 0 a continuous engine
        runs it in a thread instead (:meth:`_evaluate_beside`), beside the training groups, and this returns True
        once it has ended."""
        cfg = self.ctx.cfg
        self._send_heldout()
        if self._eval_thread is not None:
            if self._eval_thread.is_alive():
                return False
            self._eval_thread = None
            self.weights.held = False  # the next poll loads the learner's latest
            self.weights.heartbeat(force=True)
            self.admission.resumed()
            return True
        if self._eval_due is not None:  # eval_when = "idle": kept until the engine has nothing to make
            if not self._nothing_to_make():
                return False
            v, self._eval_due = self._eval_due, None
            with self.weights.beating():
                self._evaluate(v)
            self.weights.held = False
            self.weights.heartbeat(force=True)
            self.admission.resumed()  # the learner's wait meanwhile was the evaluation's
            self._send_heldout()
            return True
        v = self.engine.version
        if self.metrics_log is None or not cfg.cluster.rollout.eval or v in self.evaluated:
            return False
        latest = self.weights.latest
        if latest is None or latest.version != v:  # catching up: evaluate the learner's weights only
            return False
        if v % cfg.train.eval_every and v != cfg.train.total_steps and not self.weights.learner_done:
            return False
        self.evaluated.add(v)
        if self.continuous is not None and cfg.cluster.rollout.eval_share > 0:
            self._evaluate_beside(v)
            return False
        if cfg.cluster.rollout.eval_when == "idle" and not self.weights.learner_done:
            self._eval_due = v  # generation goes on with v, new versions held, until it has nothing to make
            self.weights.held = True
            self.weights.heartbeat(force=True)
            return False
        with self.weights.beating():  # the learner keeps this engine alive and in rotation, however long it takes
            self._evaluate(v)
        self.admission.resumed()  # the learner's wait meanwhile was the evaluation's, not lost groups'
        self._send_heldout()
        return True

    def _send_heldout(self) -> None:
        """Send the learner the held-out responses of the evaluations that ended, in parts of whole groups of at most
        half a frame each (``cluster.wire.max_message_bytes``)."""
        while True:
            try:
                v, groups = self._heldout.get_nowait()
            except queue.Empty:
                return
            try:
                parts = split_groups(heldout_prefix(groups), self.ctx.cfg.cluster.wire.max_message_bytes // 2)
            except ValueError as exc:  # a group alone above the frame limit
                self.ctx.log.warning("%s: the held-out responses of version %d stay here: %s", self.engine_id, v, exc)
                continue
            for i, part in enumerate(parts):
                self.weights.send_heldout(v, part, i, len(parts))

    def _nothing_to_make(self) -> bool:
        """The engine has no group in flight (continuous) and admission refuses the next one (the served version's
        budget spent, or the version stale), or the learner has finished."""
        if self.weights.learner_done:
            return True
        if self.continuous is not None and self.continuous.pending:
            return False
        return self.admit() is not None

    @property
    def evaluating(self) -> bool:
        """A held-out evaluation runs beside generation (continuous engines) now."""
        return self._eval_thread is not None and self._eval_thread.is_alive()

    def _evaluate_beside(self, v: int) -> None:
        """Continuous engines: evaluate version ``v`` in a thread, its requests at most ``cluster.rollout.eval_share``
        of the engine's sequences, while the loop goes on filling the rest with training groups and shipping them.
        Loads wait until it ends (``EngineWeightClient.held``: every evaluated token is ``v``'s), and the heartbeats
        say "busy" meanwhile (the learner excuses the engine from the ack deadline of the versions it publishes)."""
        self.weights.held = True
        self.weights.heartbeat(force=True)
        self._eval_thread = threading.Thread(target=self._evaluate, args=(v,), daemon=True,
                                             name=f"{self.engine_id}-evaluate")
        self._eval_thread.start()

    def _evaluate(self, v: int) -> None:
        from async_vapo.verify.sandbox import VerifierPool

        cfg = self.ctx.cfg
        if self.eval_pool is None:
            self.eval_pool = VerifierPool.from_config(cfg.verifier, num_workers=1)
            pids = self.ctx.run_dir / "pids"
            if pids.is_dir():  # its worker runs in its own session: stop_cluster.sh stops it by PID
                (pids / f"{self.engine_id}.children").write_text(
                    "\n".join(map(str, self.eval_pool.worker_pids)) + "\n")
        try:
            share = cfg.cluster.rollout.eval_share
            engine = self.engine if self.continuous is None or not share else _Share(
                self.engine, max(1, int(self.continuous.max_in_flight * share)))
            rollout = Rollout(cfg, engine, self.eval_pool, self.encoder)
            with self.ctx.busy("evaluate"):
                ev = run_evaluation(rollout, self.eval_set, cfg)
                m = ev.metrics
                if cfg.algo.uses_critic:  # the learner scores its critic on these (HeldoutResponses)
                    groups, timing = critic_heldout_groups(rollout, ev, cfg)
                    m = m | timing
                    self._heldout.put((v, groups))
            if len(self.evaluated) == 1:  # the first evaluation: most responses cut at the cap is worth a warning
                warn_if_truncated(m, cfg, self.ctx.log)
        except Exception:
            if not self.ctx.stop.is_set():  # stopping aborts it: not an error
                self.ctx.processing_error("evaluate", f"evaluation of version {v}")
            return
        self.metrics_log.write({"kind": "eval", "step": v, "version": v, "wall_s": self.ctx.elapsed(),
                                "samples_seen": self.samples_generated, **m})
        self.ctx.log.info("%s: held-out accuracy of version %d: %.3f", self.engine_id, v, m["eval/accuracy"])

    # -- loop -----------------------------------------------------------------------------------------------------
    def run(self) -> None:
        self.weights.start()
        self.ctx.ready(served_version=self.engine.version)
        while not self.ctx.stop.is_set():
            self.weights.poll(0.0)
            self.weights.heartbeat()
            if self.maybe_evaluate():
                # the learner went on while this engine evaluated: take its weights before starting groups, or
                # the groups made up now are of the old version, more of it than the learner can still use
                continue
            if self.continuous is not None:
                self.continuous.step()
                continue
            if self.admit() is not None:
                self.weights.waiting(True)
                self.weights.poll(0.2)
                continue
            self.weights.waiting(False)
            try:
                self.generate_once()
            except Exception:
                if self.ctx.stop.is_set():
                    break
                self.ctx.processing_error("generate", "one generate call")
                time.sleep(1.0)

    def ship(self, groups: list[Group], version: int) -> None:
        """Send ``groups`` to the verifier (in messages of at most half the frame limit) and count them."""
        samples = [s for g in groups for s in g.samples]
        for g in groups:
            g.engine = self.engine_id  # a group the replay drops as stale comes back to this engine's budget
        self.m.generated_samples_total.inc(len(samples))
        self.m.generated_tokens_total.inc(sum(len(s.response_ids) for s in samples))
        if self.env is not None:  # multi-turn samples (rollout.env): turns, environment tokens, tool calls
            get = self.ctx.metrics.get
            get("model_turns_total").inc(sum(len(s.env_spans) + 1 for s in samples))
            get("env_tokens_total").inc(sum(c for s in samples for _, c in s.env_spans))
            get("tool_calls_total").inc(sum(s.tool_calls for s in samples))
            get("tool_errors_total").inc(sum(s.tool_errors for s in samples))
            get("tool_seconds_total").inc(sum(s.tool_seconds for s in samples))
        self.samples_generated += len(samples)
        for part in split_groups(groups, self.ctx.cfg.cluster.wire.max_message_bytes // 2):
            self.ctx.send(self.groups_out, make_envelope(GroupsMsg(groups=part), sender=self.engine_id,
                                                         policy_version=version), "groups")
        self.ctx.metrics.get("groups_shipped_total").inc(len(groups))
        self.admission.shipped()

    def close(self) -> None:
        if self.continuous is not None:
            self.continuous.abort_all()
            if self._eval_thread is not None:  # an evaluation beside generation: its requests end, aborted
                try:
                    for key in self.engine.in_flight_keys():
                        if key.startswith("generate-"):
                            self.engine.abort(key)
                except Exception:  # noqa: S110 - closing: the engine may be gone already
                    pass
                self._eval_thread.join(30)
        self._lent(False)
        self.ctx.write_stats()  # while the engine core and the eval worker are still up
        self.groups_out.close()
        self.weights.close()
        if self.eval_pool is not None:
            self.eval_pool.close()
        if self.metrics_log is not None:
            self.metrics_log.close()


class _Share:
    """A continuous engine whose ``generate`` keeps at most ``max_in_flight`` of its sequences in the engine (the
    held-out evaluation's share beside the training groups); everything else is the engine's."""

    def __init__(self, engine, max_in_flight: int):
        self._engine, self._max = engine, max_in_flight

    def generate(self, prompts, **kwargs):
        return self._engine.generate(prompts, max_in_flight=self._max, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class ContinuousDriver:
    """``rollout.generation = "continuous"``: keeps the engine (``rollout.continuous.ContinuousEngine``) at
    ``rollout.max_in_flight`` sequences, a group at a time as admission allows (the staleness budget is decided per
    group at submission), ships each group the moment its samples end, and aborts in flight a group whose oldest
    token could no longer be trained on (its submission version below the learner's floor) or was made for weights
    of a learner that went back to an older checkpoint. New versions reach the engine through the weights client,
    which the service polls between steps; the engine pauses its requests around each load
    (``rollout.weight_update``). State is per request (``pending``), not per call."""

    def __init__(self, svc: RolloutService):
        r = svc.ctx.cfg.rollout
        self.svc, self.engine, self.m = svc, svc.engine, svc.ctx.metrics
        self.group_size = svc.ctx.cfg.algo.group_size
        self.max_in_flight = max(r.max_in_flight or r.max_num_seqs, self.group_size)
        self.pending: dict[str, tuple] = {}
        """Group key -> (problem, submitted version)."""
        self._n = 0
        self._occupancy = 0.0
        self._occupancy_at = time.monotonic()
        self._reprefilled = 0
        self._busy_since: float | None = None
        """``time.time()`` since when the engine has had requests in flight (the ``generate`` stage is busy)."""

    def step(self) -> None:
        self._drop_unusable()
        submitted = self._fill()
        finished = self.engine.finished(0.05 if self.pending else 0.0)
        for fg in finished:
            self._ship(fg)
        self._observe()
        idle = not submitted and not finished and not self.pending
        self.svc.weights.waiting(idle and not self.svc.evaluating)  # an evaluation beside: its cores are busy
        if idle:
            self.svc.weights.poll(0.2)  # nothing to do until a new version or budget

    def _fill(self) -> int:
        """Submit groups while the engine has room and admission allows; returns how many."""
        r, svc, n = self.svc.ctx.cfg.rollout, self.svc, 0
        while self.engine.in_flight() + self.group_size <= self.max_in_flight and svc.admit() is None:
            problem = svc.sampler.take(1)[0]
            self._n += 1
            key = f"{problem.uid}#{self._n}"
            version = self.engine.version
            prompt_ids, conversations = svc.encoder(problem), None
            if svc.env is not None:  # rollout.env: each sample a conversation, each turn a request of its own
                prompt_ids, conversations = EnvConversation.group(svc.encoder, svc.env, problem, self.group_size,
                                                                  r.max_response_tokens, svc.encoder.stop_ids)
            self.engine.submit(key, prompt_ids, n=self.group_size, temperature=r.temperature, top_p=r.top_p,
                               max_tokens=r.max_response_tokens, stop_token_ids=svc.encoder.stop_ids,
                               conversations=conversations)
            self.pending[key] = (problem, version)
            svc.admission.record(version, 1)
            n += 1
        return n

    def _ship(self, fg) -> None:
        problem, _ = self.pending.pop(fg.key, (None, None))
        if problem is None:  # aborted meanwhile
            return
        if fg.error is not None or not fg.samples:
            self._aborted(fg.key, "error")
            self.svc.ctx.log.warning("%s: group %s failed in the engine: %s", self.svc.engine_id, fg.key, fg.error)
            return
        group = make_group(problem, fg.prompt_ids, fg.samples, fg.submitted_version)
        policy = self.svc.admission.policy
        if policy is not None and not policy.may_generate(group.version, self.svc.weights.learner_version):
            self._aborted(fg.key, "stale")  # the learner moved on while it finished: it would only be dropped
            return
        versions = {tuple(x)[0] for t in group.samples for x in t.version_spans}
        if len(versions) > 1:
            self.m.get("multi_version_groups_total").inc()
        self.m.get("tokens_after_switch_total").inc(sum(
            len(t.response_ids) - t.version_spans[1][1] for t in group.samples if len(t.version_spans) > 1))
        self.m.get("group_ship_seconds").observe(fg.seconds)
        self.svc.ship([group], group.version)

    def _drop_unusable(self) -> None:
        """Abort the groups in flight that can no longer be trained on (their oldest token below the floor) or that
        were made by weights newer than the learner's (it restarted from an older checkpoint)."""
        policy, learner = self.svc.admission.policy, self.svc.weights.learner_version
        if policy is None:
            return
        for key, (_, version) in list(self.pending.items()):
            reason = "stale" if not policy.may_generate(version, learner) else \
                "rolled_back" if version > learner else None
            if reason is not None and self.engine.abort(key):
                self.pending.pop(key, None)
                self._aborted(key, reason)

    def _aborted(self, key: str, reason: str) -> None:
        self.m.get("aborted_groups_total").labels(reason=reason).inc()
        self.svc.admission.unmade(1)

    def _observe(self) -> None:
        n = self.engine.in_flight()
        self.m.get("sequences_in_flight").set(n)
        self.svc.m.inflight_groups.set(len(self.pending))
        now = time.monotonic()
        w = min(1.0, now - self._occupancy_at)  # a time-weighted average over about the last second
        self._occupancy = (1 - w) * self._occupancy + w * min(1.0, n / self.max_in_flight)
        self._occupancy_at = now
        self.m.get("engine_occupancy_ratio").set(self._occupancy)
        self._busy(n > 0)

    def _busy(self, busy: bool, flush_s: float = 5.0) -> None:
        """The ``generate`` stage is busy while requests are in flight: recorded as the lock-step calls' are
        (``ServiceContext.record_busy``), cut every ``flush_s`` so that a long busy span is on disk as it goes."""
        now = time.time()
        if busy and self._busy_since is None:
            self._busy_since = now
            self.svc.ctx.metrics.set_health(busy="generate")
        elif self._busy_since is not None and (not busy or now - self._busy_since >= flush_s):
            self.svc.ctx.record_busy("generate", self._busy_since, now)
            self._busy_since = now if busy else None
            if not busy:
                self.svc.ctx.metrics.set_health(busy="")

    def loaded(self) -> None:
        """A version was loaded: how long generation paused, and the tokens prefilled again."""
        stats = getattr(self.engine, "update_stats", None)
        if stats:
            self.m.get("weight_pause_seconds").observe(stats[-1].total_s)
        total = int(getattr(self.engine, "reprefill_tokens_total", 0))
        self.m.get("reprefill_tokens_total").inc(max(0, total - self._reprefilled))
        self._reprefilled = total

    def abort_all(self) -> None:
        self._busy(False)
        for key in list(self.pending):
            try:
                self.engine.abort(key)
            except Exception:  # closing: the engine may be gone already
                break
        self.pending.clear()


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
    r = cfg.rollout
    if r.generation == "continuous":
        from async_vapo.rollout.continuous import ContinuousEngine

        engine = ContinuousEngine(spec, version=0, weight_update=r.weight_update,
                                  recompute_kv_after_update=r.recompute_kv_after_update)
    else:
        engine = VLLMEngine(spec, version=0)
    ctx.log.info("%s: engine up in %.1f s", ctx.name, engine.start_seconds)
    a = cfg.algo
    pretrain = a.value_pretrain_batches  # the pool's batches with algo.value_pretrain_pool, else one per step
    transport = make_transport(ctx)
    svc = RolloutService(ctx, transport, engine, tokenizer, train_set, eval_set, pretrain_batches=pretrain)
    try:
        svc.run()
    finally:
        svc.close()
        transport.close()
        engine.close()


def main(argv: list[str] | None = None) -> int:
    """Rollout service: one vLLM engine generating version-stamped groups:

        python -m async_vapo.services.rollout --config FILE [--run-dir DIR] [--instance I] [key.sub=value ...]
    """
    from async_vapo.services.context import run_service

    return run_service("rollout", argv, lambda ctx, args: run_rollout(ctx))


if __name__ == "__main__":  # vLLM spawns its engine process: construct it only under this guard
    import sys

    sys.exit(main())
