"""The rollout service: one vLLM engine per process, generating groups continuously, stamped with the
weight version that generated them.

Sockets (engine ``rollout-i``)
  * ``groups``: PUSH, connects to the verifier (``cluster.hosts.verifier_host:verifier_port``); GroupsMsg of the
    groups of one ``generate`` call. At the HWM the push holds and so does generation (backpressure).
  * ``weights`` (SUB) and ``acks`` (PUSH): the engine's side of the weight protocol,
    :class:`~async_vapo.weights.client.EngineWeightClient` (announces, group offers, acks, heartbeats, the ways
    weights come). The service polls it between two generate calls, so a version is loaded between them.

Admission (:class:`~async_vapo.staleness.Admission`, the one staleness rule of ``async_vapo.staleness``): before each
generate call the engine asks whether its served version may still make groups the learner can use, and whether its
share of the batches those versions can feed is spent (reasons ``no_learner``, ``stale_weights``,
``version_budget``, counted in ``admission_rejects_total``; budgets topped up after a refill timeout or when the
learner reports it starves, in ``admission_refills_total``). ``max_staleness`` is the learner's: every announce
carries its staleness floor (``min_version``), and nothing is generated before the first one arrives.

Evaluation: rollout 0 evaluates the held-out split (``rollout.generate.evaluate``, with its own one-worker
``VerifierPool``) whenever it serves the learner's latest version and that is a multiple of
``train.eval_every`` or the last one (``train.total_steps``), and appends ``kind="eval"`` rows, in the
one-process trainer's format, to ``RUN_DIR/metrics.jsonl`` (shared with the learner, see
:class:`~async_vapo.metrics.jsonl.JsonlWriter`).
"""

from __future__ import annotations

import math
import time

from async_vapo.metrics.rows import open_row_writer
from async_vapo.rollout.generate import PromptEncoder, Rollout, evaluate, generate_groups
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.staleness import Admission
from async_vapo.tasks import PromptSampler
from async_vapo.transport import GroupsMsg, Transport, WeightsAnnounce, make_envelope, split_groups
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
        self.weights = EngineWeightClient(ctx, transport, engine, on_announce=self._on_announce,
                                          on_learner_waiting=self.admission.learner_waiting,
                                          on_loaded=lambda version, way: self.admission.versions_changed())
        self.m = ctx.metrics.rollout
        self.encoder = PromptEncoder.from_config(cfg, tokenizer)
        self.evaluated: set[int] = set()
        self.metrics_log = (open_row_writer(cfg, ctx.run_dir / "metrics.jsonl", ctx.metrics)
                            if ctx.instance == 0 else None)
        self.eval_pool = None
        self.samples_generated = 0

    def _on_announce(self, a: WeightsAnnounce, previous: int) -> None:
        self.admission.announced(a.version, a.min_version)

    def admit(self) -> str | None:
        """None when a generate call may start now, else the reason it may not (counted, and a refill logged)."""
        refills, starving = self.admission.refills, self.admission.starving
        reason = "no_learner" if self.weights.latest is None else self.admission.check(
            self.engine.version, self.weights.learner_version)
        if self.admission.refills > refills:
            self.ctx.metrics.get("admission_refills_total").inc()
            why = (f"the learner has waited {self.admission.starved_s:.0f} s for groups since this engine last "
                   "shipped" if starving else f"no new version for {self.admission.refill_s:.0f} s")
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
        latest = self.weights.latest
        if latest is None or latest.version != v:  # catching up: evaluate the learner's weights only
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
        self.weights.start()
        self.ctx.ready(served_version=self.engine.version)
        while not self.ctx.stop.is_set():
            self.weights.poll(0.0)
            self.weights.heartbeat()
            self.maybe_evaluate()
            if self.admit() is not None:
                self.weights.poll(0.2)
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
        self.groups_out.close()
        self.weights.close()
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
