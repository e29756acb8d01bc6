"""The step loop: one implementation for the one-process trainer and the learner service.

    value pretraining: critic-only steps on the initial policy (skipped when resumed), each on a new batch or, with
                       ``algo.value_pretrain_pool``, on a pool of batches fetched once (:class:`PretrainPool`)
    each update:  groups from the source -> DAPO dynamic sampling -> Learner.update (or, when no group is
                  informative, an empty step that still makes a version) -> publish the version ->
                  metric row -> evaluation and checkpoint cadence

Where a step's scored groups come from is a :class:`BatchSource`:

* ``InProcessSource`` (``async_vapo.trainer``) generates them with this process's engine and grades them with its
  verifier pool (the one-process trainer: staleness 0, each batch from the weights the learner holds);
* ``ReplaySource`` (``async_vapo.services.learner``) fetches them from the replay service;
* :class:`BroadcastSource` wraps either for data-parallel ranks: rank 0 broadcasts what its source returned,
  the other ranks receive it, and every rank runs this same loop on the same groups. Only rank 0 (the
  *leader*) decides when to stop and to checkpoint, publishes and writes rows; the others run until their
  source says stop. A sharded learner (FSDP2) gathers its weights for a publish and writes its checkpoint
  shards on every rank: the other ranks receive the leader's checkpoint decision each step. Its publish is
  either ``publish_collective`` on every rank (the learner service with weight groups: each version gathered
  one bucket at a time as it is streamed, ``learner.sharding.publish_sharded``) or ``policy_state`` on every
  rank and ``publish`` on the leader.

Rows (``metrics.jsonl``): ``kind`` = pretrain / train, with the step, version, wall seconds, the generated
groups' statistics (``rollout/*``), the learner's metrics, the source's timing and its own row metrics, and
``time/learn_s``, ``time/weight_push_s``, ``time/step_s``, and what ``publish_collective`` adds
(``learner/weight_gather_peak_bytes``). ``train.max_minutes`` counts from the start of
the loop (value pretraining included). Checkpoints (``checkpoints/step_N``) every
``train.checkpoint_every`` updates, at the end, and when stopped mid-run; their ``extra`` holds the step,
the samples seen and the source's cursor (:meth:`BatchSource.state`), from which :meth:`StepLoop.resume`
continues.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch

from async_vapo.algo.dapo import dynamic_sampling_keep
from async_vapo.config import Config
from async_vapo.learner.process_group import broadcast_object
from async_vapo.metrics.rows import group_stats
from async_vapo.types import Group

log = logging.getLogger(__name__)

Timing = dict[str, float]


class BatchSource(Protocol):
    """Where the loop's groups come from."""

    def next_groups(self, n: int) -> tuple[list[Group], Timing] | None:
        """``n`` scored groups and the time it took by stage; None when the run is to stop."""

    def row_metrics(self, kept: Sequence[Group], version: int) -> dict[str, float]:
        """Source-specific metrics of the step that used ``kept`` and made ``version``."""

    def state(self) -> dict:
        """What a checkpoint keeps to resume the source (a cursor)."""

    def restore(self, state: dict) -> None:
        """Continue from a checkpoint's :meth:`state`."""

    def close(self) -> None: ...


class Control(str):
    """What rank 0's batch source may answer instead of groups: a request for work on every rank (a collective,
    such as publishing the current version again), which :class:`BroadcastSource` broadcasts and hands to its
    ``on_control`` on every rank; then the source is asked again. The sources themselves never make one: the
    service that composes them does (``services.learner``)."""


class BroadcastSource:
    """Data-parallel ranks: rank 0 (``inner`` set) broadcasts each answer of its source, the other ranks
    (``inner`` None) receive it. A None answer (stop) is broadcast once; ``close`` on rank 0 sends it if
    the loop ended on its own decision (done, out of time), so the other ranks' loops end too. A :class:`Control`
    answer is run by ``on_control`` on every rank, after which the source is asked again."""

    def __init__(self, inner: BatchSource | None, world: int, on_control: Callable[[Control], object] | None = None):
        self.inner, self.world, self.on_control = inner, world, on_control
        self.stopped = False

    def next_groups(self, n: int) -> tuple[list[Group], Timing] | None:
        if self.stopped:
            return None
        while True:
            got = self.inner.next_groups(n) if self.inner is not None else None
            if self.world > 1:
                got = broadcast_object(got if self.inner is not None else None)
            if not isinstance(got, Control):
                break
            if self.on_control is None:
                raise RuntimeError(f"the source answered {got!r} and no on_control hook is set")
            self.on_control(got)
        self.stopped = got is None
        return got

    def row_metrics(self, kept: Sequence[Group], version: int) -> dict[str, float]:
        return self.inner.row_metrics(kept, version) if self.inner is not None else {}

    def state(self) -> dict:
        return self.inner.state() if self.inner is not None else {}

    def restore(self, state: dict) -> None:
        if self.inner is not None:
            self.inner.restore(state)

    def close(self) -> None:
        if self.inner is not None and not self.stopped and self.world > 1:
            broadcast_object(None)
        self.stopped = True
        if self.inner is not None:
            self.inner.close()


def informative(groups: Sequence[Group]) -> list[bool]:
    """Per group: its rewards are not all equal (``algo.dapo.dynamic_sampling_keep``, DAPO's rule)."""
    if not groups:
        return []
    rewards = torch.tensor([s.reward for g in groups for s in g.samples], dtype=torch.float64)
    ids = torch.tensor([i for i, g in enumerate(groups) for _ in g.samples])
    keep = dynamic_sampling_keep(rewards, ids)
    first = torch.tensor([0] + [len(g.samples) for g in groups[:-1]]).cumsum(0)
    return [bool(keep[i]) if len(g.samples) else False for i, g in zip(first.tolist(), groups, strict=True)]


def dynamic_sampling(groups: list[Group], fetch_more: Callable[[], list[Group] | None], want: int,
                     max_rounds: int) -> tuple[list[Group], list[Group]]:
    """DAPO dynamic sampling: keep the informative groups, fetching more for at most ``max_rounds`` rounds
    until ``want`` are kept (``fetch_more`` returning None stops early). Returns (the kept groups, at most
    ``want``; every group seen, for statistics)."""
    seen = list(groups)
    kept = [g for g, k in zip(groups, informative(groups), strict=True) if k]
    for _ in range(max_rounds):
        if len(kept) >= want:
            break
        more = fetch_more()
        if more is None:
            break
        seen += more
        kept += [g for g, k in zip(more, informative(more), strict=True) if k]
    return kept[:want], seen


class PretrainPool:
    """Value pretraining's pool (``algo.value_pretrain_pool``): batches of the base policy fetched once, then
    dealt to the pretraining steps pass after pass without generating. Pass 0 deals the batches as they were
    fetched (each fresh to the critic when it trains on it); every later pass reshuffles all the pool's groups
    into new batches of ``per_step`` groups, by an RNG of ``seed`` alone, so that every data-parallel rank deals
    the same batches."""

    def __init__(self, groups: list[Group], per_step: int, seed: int, timing: Timing | None = None):
        if not groups:
            raise ValueError("value pretraining's pool holds no valid group")
        self.groups, self.per_step, self.timing = groups, per_step, timing or {}
        self.batches_per_pass = -(-len(groups) // per_step)
        self._rng = random.Random(seed)
        self._pass, self._order = 0, list(groups)

    @classmethod
    def fill(cls, fetch: Callable[[Timing], list[Group] | None], batches: int, per_step: int, seed: int
             ) -> PretrainPool | None:
        """``batches`` fetches of ``per_step`` groups (None if the source stopped first)."""
        timing: Timing = {}
        t0 = time.perf_counter()
        groups: list[Group] = []
        for _ in range(batches):
            got = fetch(timing)
            if got is None:
                return None
            groups += got
        timing["time/value_pretrain_pool_s"] = time.perf_counter() - t0
        return cls(groups, per_step, seed, timing)

    def pass_of(self, step: int) -> int:
        return step // self.batches_per_pass

    def fresh(self, step: int) -> bool:
        """The critic has not trained on the batch of ``step`` yet (the first pass)."""
        return self.pass_of(step) == 0

    def batch(self, step: int) -> list[Group]:
        """The groups of pretraining step ``step`` (steps are asked for in order)."""
        p, j = self.pass_of(step), step % self.batches_per_pass
        while self._pass < p:
            self._pass += 1
            self._order = list(self.groups)
            self._rng.shuffle(self._order)
        return self._order[j * self.per_step: (j + 1) * self.per_step]


def _fmt(m: dict[str, float], keys: Sequence[tuple[str, str]]) -> dict[str, str]:
    return {short: f"{m[k]:.3g}" for k, short in keys if k in m}


class StepLoop:
    """Runs value pretraining and the updates of one run (see the module docstring).

    ``leader``: this rank writes rows, publishes, evaluates and checkpoints, and decides when to stop.
    Hooks, each optional: ``publish(version, state) -> seconds`` (the version to the engines; ``state`` is the policy's
    weights, or with ``model.lora`` served as adapters its adapter, that a sharded learner gathers on every rank for it
    (``publish_state()``), else None: the hook takes from the learner what it sends, ``policy_state()`` or with
    ``model.lora`` the adapter alone, so no merged copy is built that nothing reads (``model.lora.serve = "merged"``:
    the merged weights are what it sends)), or instead ``publish_collective(version) -> row metrics``, run on every rank
    of a sharded learner, which gathers what it sends itself (``learner.sharding.publish_sharded``: one bucket at a time
    where every engine takes the version over its weight group) and returns the leader's ``time/weight_push_s`` and any
    other figures for its row; ``evaluate(step)``
    (held-out evaluation, which writes its own row), ``on_row(row)`` (after each row is written, e.g. to
    Prometheus), ``busy(stage)`` (a context manager around learning), ``should_stop()`` (checked between
    steps), ``wall()`` (the rows' ``wall_s``), ``heldout_critic()`` (every rank: the critic's quality on held-out
    responses, ``critic/heldout_ev`` and its reference levels, ``learner.critic_quality``; without it value
    pretraining judges the critic by each batch's ``critic/fresh_ev``, taken before the critic trains on it).
    """

    def __init__(self, cfg: Config, learner, source: BatchSource, *, pad_id: int, run_dir: Path, log_writer=None,
                 leader: bool = True, publish: Callable[[int, dict | None], float] | None = None,
                 publish_collective: Callable[[int], dict] | None = None,
                 evaluate: Callable[[int], object] | None = None, on_row: Callable[[dict], None] | None = None,
                 busy: Callable[[str], contextlib.AbstractContextManager] | None = None,
                 should_stop: Callable[[], bool] | None = None, wall: Callable[[], float] | None = None,
                 progress: bool = False, logger: logging.Logger | None = None,
                 heldout_critic: Callable[[], dict[str, float]] | None = None):
        self.cfg, self.learner, self.source = cfg, learner, source
        self._heldout_critic = heldout_critic
        self.run_dir, self.writer, self.leader = run_dir, log_writer, leader
        if publish is not None and publish_collective is not None:
            raise ValueError("StepLoop: publish or publish_collective, not both")
        self._publish, self._evaluate, self._on_row = publish, evaluate, on_row
        self._publish_collective = publish_collective
        self._busy = busy or (lambda stage: contextlib.nullcontext())
        self._should_stop = should_stop or (lambda: False)
        self._t0 = time.perf_counter()
        self.wall = wall or (lambda: time.perf_counter() - self._t0)
        self.progress, self.log = progress, logger or log
        self.start_step = self.step = self.last_checkpoint = 0
        self.samples_seen = 0
        self.resumed = False
        self.pad_id = pad_id
        from async_vapo.replay.buffer import GroupLimits

        vocab = learner.policy.get_input_embeddings().num_embeddings if hasattr(learner, "policy") else None
        self.limits = GroupLimits.from_config(cfg, vocab_size=vocab)
        self.invalid_groups: dict[str, int] = {}
        """Groups refused before learning, by reason (``_valid``)."""
        self._step_invalid = 0

    def make_batch(self, groups: Sequence[Group]):
        from async_vapo.learner.vapo import make_rollout_batch

        return make_rollout_batch(groups, self.pad_id, overlong_max_len=self.cfg.rollout.max_response_tokens,
                                  overlong_buffer=self.cfg.algo.overlong_buffer)

    # -- state ----------------------------------------------------------------------------------------------
    def resume(self, extra: dict) -> None:
        """Continue from a checkpoint's ``extra`` (the learner has loaded its state already)."""
        self.start_step = self.step = self.last_checkpoint = extra.get("step", self.learner.version)
        self.samples_seen = extra.get("samples_seen", 0)
        self.source.restore(extra)
        self.resumed = True

    def checkpoint(self, step: int) -> Path:
        self.last_checkpoint = step
        path = self.learner.save(self.run_dir / "checkpoints" / f"step_{step}",
                                 extra={"step": step, "samples_seen": self.samples_seen, **self.source.state()})
        self.log.info("checkpoint %s", path)
        if self.leader and self.cfg.train.keep_checkpoints:
            from async_vapo.learner.rundir import prune_checkpoints

            for old in prune_checkpoints(self.run_dir, self.cfg.train.keep_checkpoints, self.cfg.train.keep_weights):
                self.log.info("checkpoint %s pruned (train.keep_checkpoints = %d%s)", old,
                              self.cfg.train.keep_checkpoints, ": weights kept" if old.exists() else "")
        return path

    def _write(self, row: dict) -> None:
        if self.writer is not None:
            self.writer.write(row)
        if self._on_row is not None:
            self._on_row(row)

    def _fetch(self, timing: Timing) -> list[Group] | None:
        got = self.source.next_groups(self.cfg.algo.prompts_per_step)
        if got is None:
            return None
        groups, t = got
        for k, v in t.items():
            timing[k] = timing.get(k, 0.0) + v
        return self._valid(groups)

    def _valid(self, groups: list[Group]) -> list[Group]:
        """The groups the learner may train on: a group with a token outside the policy's vocabulary, a
        non-finite or positive log-prob, or a reward outside the verifier's set never reaches an update
        (each is counted in ``invalid_groups``, by reason, and logged)."""
        from async_vapo.replay.buffer import validate_group

        ok = []
        for g in groups:
            reason = validate_group(g, limits=self.limits)
            if reason is None:
                ok.append(g)
            else:
                self.invalid_groups[reason] = self.invalid_groups.get(reason, 0) + 1
                self._step_invalid += 1
                self.log.warning("group %s refused before learning: %s", getattr(g, "uid", "?"), reason)
        return ok

    # -- phases ---------------------------------------------------------------------------------------------
    def pretrain(self) -> bool:
        """Value pretraining; False if the source stopped first. With a pool its batches are fetched before the first
        step (their generation is in step 0's row, ``time/value_pretrain_pool_s``) and every step trains on them."""
        from tqdm import tqdm

        a = self.cfg.algo
        if not a.uses_critic or a.value_pretrain_steps == 0 or self.resumed:
            return True
        from async_vapo.learner.critic_quality import PlateauStop

        stop = PlateauStop(a.value_pretrain_steps, min_steps=a.value_pretrain_min_steps,
                           patience=a.value_pretrain_patience, min_delta=a.value_pretrain_min_delta,
                           target=a.value_pretrain_target_ev)
        last: dict = {}
        judged_by = "critic/fresh_ev"
        bar = tqdm(range(a.value_pretrain_steps), desc="value pretraining",
                   disable=not (self.progress and self.leader), dynamic_ncols=True)
        pool: PretrainPool | None = None
        if a.value_pretrain_pool:
            # value_pretrain_batches: the pool's, as many as the rollout generates for version 0
            pool = PretrainPool.fill(self._fetch, a.value_pretrain_batches, a.prompts_per_step, self.cfg.train.seed)
            if pool is None:
                return False
        for k in bar:
            t0 = time.perf_counter()
            timing: Timing = pool.timing if pool is not None and k == 0 else {}  # the pool's generation: step 0's
            groups = self._fetch(timing) if pool is None else pool.batch(k)
            if groups is None:
                return False
            if not groups:  # every group refused (counted in invalid_groups): nothing to fit the critic to
                continue
            t1 = time.perf_counter()
            with self._busy("learn"):
                if pool is None:
                    m = self.learner.pretrain_critic(self.make_batch(groups))
                else:
                    m = self.learner.pretrain_critic(self.make_batch(groups), fresh=pool.fresh(k))
                    m["value_pretrain/pool_pass"] = pool.pass_of(k)
                if self._heldout_critic is not None:
                    m |= self._heldout_critic()
            # every rank sees the same metrics, so every rank takes the same decision; the held-out responses may
            # arrive during pretraining (the services: rollout 0's), and from then on the plateau is theirs
            measure = "critic/heldout_ev" if "critic/heldout_ev" in m else "critic/fresh_ev"
            if measure != judged_by:
                stop.restart()
                judged_by = measure
            done = stop.update(m.get(measure, float("nan")))
            last = m
            if self.leader:
                row = {"kind": "pretrain", "step": k, "version": self.learner.version, "wall_s": self.wall(),
                       **group_stats(groups, "rollout"), **m, **timing, "time/learn_s": time.perf_counter() - t1,
                       "time/step_s": time.perf_counter() - t0}
                self._write(row)
                bar.set_postfix(_fmt(row, [("critic/value_loss", "vloss"), ("critic/heldout_ev", "heldout_ev"),
                                           ("critic/fresh_ev", "fresh_ev")]))
            if done:
                break
        if self.leader:
            self._report_pretraining(stop, last)
        return True

    def _report_pretraining(self, stop, m: dict) -> None:
        """Say why value pretraining stopped, and warn when it ends with a critic no better than a value function
        that knows only each problem's length (``critic/heldout_ev_length_only``, where the task can tell)."""
        ev, ref = m.get("critic/heldout_ev"), m.get("critic/heldout_ev_length_only")
        self.log.info("value pretraining stopped after %d steps: %s", stop.steps,
                      stop.reason or "its steps ran out (batches refused)")
        if ev is not None and ref is not None and not ev > ref:
            self.log.warning("value pretraining ended with a critic no better than length-only on held-out responses:"
                             " explained variance %.3f, length only %.3f; the policy's advantages will carry little "
                             "signal before the last tokens (more value_pretrain_steps, another critic_lr, or a "
                             "critic design that reads the prefix)", ev, ref)

    def train(self) -> bool:
        """Updates until ``train.total_steps`` (or out of time, or stopped); True when done or out of time."""
        from tqdm import tqdm

        cfg, a = self.cfg, self.cfg.algo
        total = cfg.train.total_steps
        bar = tqdm(total=total, initial=self.step, desc=f"{a.name} updates",
                   disable=not (self.progress and self.leader), dynamic_ncols=True)
        try:
            while not self.leader or (self.step < total and not self._should_stop()):
                t0 = time.perf_counter()
                timing: Timing = {}
                self._step_invalid = 0
                groups = self._fetch(timing)
                if groups is None:
                    return False
                kept = groups
                if a.dynamic_sampling:
                    kept, groups = dynamic_sampling(groups, functools.partial(self._fetch, timing), a.prompts_per_step,
                                                    a.max_resample_rounds)
                self.samples_seen += sum(len(g.samples) for g in groups)
                t1 = time.perf_counter()
                with self._busy("learn"):
                    m = self.learner.update(self.make_batch(kept)) if kept else self.learner.empty_update()
                t2 = time.perf_counter()
                self.step += 1
                # a sharded learner publishes (gathers its weights) and writes checkpoints on every rank
                # (collectives): the other ranks follow the leader's decisions. With publish_collective the version
                # is gathered bucket by bucket as it is sent, and whole on rank 0 only when an engine needs it so
                # (learner.sharding.publish_sharded); with publish it is gathered whole for the hook, which an
                # unsharded learner's hook takes itself (a LoRA version is its adapter: no merged state to build)
                sharded = getattr(self.learner, "sharded", False)
                pushed: dict = {}
                if self._publish_collective is not None:
                    with self._busy("publish"):
                        pushed = self._publish_collective(self.learner.version) or {}
                state = self.learner.publish_state() if sharded and self._publish_collective is None else None
                if not self.leader:
                    if sharded and broadcast_object(None):
                        self.checkpoint(self.step)
                    continue
                push_s = pushed.get("time/weight_push_s", 0.0)
                if self._publish is not None:
                    with self._busy("publish"):
                        push_s = self._publish(self.learner.version, state)
                row = {"kind": "train", "step": self.step, "version": self.learner.version, "wall_s": self.wall(),
                       "samples_seen": self.samples_seen, "groups_kept": len(kept),
                       "learner/invalid_groups": self._step_invalid, **group_stats(groups, "rollout"),
                       **m, **self.source.row_metrics(kept, self.learner.version), **timing, "time/learn_s": t2 - t1,
                       **pushed, "time/weight_push_s": push_s, "time/step_s": time.perf_counter() - t0}
                self._write(row)
                bar.update(1)
                bar.set_postfix(_fmt(row, [("rollout/accuracy", "acc"), ("rollout/response_length", "len"),
                                           ("critic/explained_variance", "ev"), ("time/step_s", "s/step")]))
                if not self.progress:
                    self.log.info("step %d version %d acc %.3f (%.1f s)", self.step, self.learner.version,
                                  row.get("rollout/accuracy", float("nan")), row["time/step_s"])
                limit = cfg.train.max_minutes
                out_of_time = limit is not None and time.perf_counter() - self._t0 > 60 * limit
                done = self.step >= total or out_of_time
                if self._evaluate is not None and (self.step % cfg.train.eval_every == 0 or done):
                    self._evaluate(self.step)
                save = bool(cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0) or done
                if sharded:
                    broadcast_object(save)
                if save:
                    self.checkpoint(self.step)
                if out_of_time:
                    return True
            return self.step >= total
        finally:
            bar.close()

    def run(self) -> bool:
        """Pretraining and updates; True when the run finished (done or out of time). A leader stopped
        mid-run checkpoints what it learned since the last checkpoint."""
        try:
            finished = self.pretrain() and self.train()
        finally:
            if self.leader:
                self.source.close()  # tells the other ranks to stop
        # the other ranks of a sharded learner stop when the leader's stop reaches them, and write their shards
        if (self.leader or getattr(self.learner, "sharded", False)) and not finished \
                and self.step > self.last_checkpoint:
            self.checkpoint(self.step)
        return finished
