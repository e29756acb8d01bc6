"""The staleness rule, written once: which groups a learner may train on, and which an engine may still start.

Versions. The learner at version ``v`` has published ``v`` optimiser updates and holds weights ``v``; the batch it
asks for makes update ``v + 1``. A group's ``version`` is the version of the weights that generated it. Its *age*
for the learner at ``v`` is ``v − version``: the number of updates published since the weights that generated it.

The rule (:class:`StalenessPolicy`): a batch for the learner at version v holds only groups with
``floor(v) ≤ version ≤ v``, where ``floor(v) = v − max_staleness``. Every trained group has
0 ≤ age ≤ max_staleness; with max_staleness = 0 every batch comes from the learner's current weights only, i.e.
synchronous on-policy PPO. A version above the learner's is possible only after the learner restarted from an older
checkpoint ("future_version"); below the floor is "stale". Both are dropped, counted by reason, never trained on.

How this maps to the spec's wording. VAPO_SPEC.md says "a batch used for update v+1 may only hold trajectories
whose version ≥ v + 1 − max_staleness" and "max_staleness = 0 is synchronous on-policy PPO". Read with the tag =
generating weights, the first sentence at max_staleness = 0 would demand data from weights v + 1, which do not
exist until that very update is made; the two sentences are consistent only if the spec's tag counts the update a
trajectory is generated *for* (data from weights v feeds update v + 1, so tag = generating version + 1). Under that
reading the spec's ``tag ≥ v + 1 − max_staleness`` is exactly ``version ≥ v − max_staleness`` here. We keep
``Group.version`` = generating weights (what the rollout stamps) and state the bound as above.

Who owns it. The learner is the one reader of ``async.max_staleness`` (:meth:`StalenessPolicy.from_config`): it
sends its floor with every batch request (the replay enforces it per request) and with every weights announce
(``min_version``: the engines take the bound from it, :meth:`StalenessPolicy.from_floor`). The replay and the
engines never read the bound from their own config, so a cluster cannot run with two.

Admission (:class:`Admission`, the engine's side). Nothing is generated before the learner's first announce (reason
``no_learner``: a resumed learner may be far ahead of the base weights). Before starting a group the engine knows
its served version ``s`` and the learner's latest announced version ``L``. A group started now is consumed at a
learner version ≥ L, so it is usable only if ``s ≥ floor(L)``:

  * ``s < floor(L)`` -> do not generate, wait for weights (reason ``stale_weights``);
  * a group of version s can only feed updates made at learner versions up to s + max_staleness, and the learner
    takes one batch per update (``prompts_per_step`` groups, plus the value-pretraining batches, all at version 0,
    and DAPO's resampling rounds). So, counted from the learner version the engine first saw (its base b), the
    engine's groups while it serves s are worth generating only while it has made fewer than its 1/N share of
    (s − b + max_staleness + 1) batches (reason ``version_budget``), the pretraining batches added when b = 0. The
    bound is cumulative: an engine faster than the learner runs max_staleness batches ahead and then makes one batch
    per version, never a batch that can only go stale (a bound per version would let it make max_staleness + 1
    batches of every version, of which the learner uses one). With max_staleness = 0 every engine generates exactly
    its share of one batch per version and then waits for the next weights: synchronous on-policy training. With
    several engines each keeps to its own share, so a faster engine does not make up a slower one's (the learner
    waits for the slower, or for the refill below); the engines cannot see each other's counts.
  * a budget that is spent while no new version arrives for ``refill_s`` is topped up by one share (groups lost to
    a crash elsewhere must not starve the learner forever). A learner that is merely slow must not trigger it (the
    share would only go stale, generated on the learner's time): the wait is at least twice the longest interval
    seen between two of the learner's versions (from version 1 on: version 0's includes value pretraining). Sooner
    when the learner says it starves: its heartbeats carry how long it has waited for its batch, and a wait of
    ``starved_s``, reported that long after the engine last shipped groups or came back from a held-out evaluation
    (so not groups still on their way, nor a wait the evaluation caused), with none of its groups still in the
    engine, tops the budget up at once.
  * groups made and never trained on give their share back, so that an engine's lead does not shrink by every lost
    group for the rest of the run: those the engine aborted (:meth:`Admission.unmade`), and those the replay dropped
    as stale, which it counts per engine and the learner repeats in its heartbeats (:meth:`Admission.dropped`).
    A group that reached the replay already stale (it finished after the learner had moved past it, e.g. a long
    response of an engine that updates weights in flight) is given back at once. A group that went stale *waiting*
    in the replay was one more than the learner could use within the bound (it takes the oldest first): either made
    too late for its window (weights loaded late, so more groups of the old version), a loss, or what the budget's
    maxima leave over when the learner takes fewer (value pretraining stopped on its plateau, DAPO's unused
    resampling rounds), a surplus that, made again, would go stale again at every version. So it is given back only
    when the learner shows it needs it: it reports a wait of ``short_wait_s`` while this engine's budget is spent,
    with ``max_staleness`` ≥ 1 (with 0 the learner waits for every batch, and a group left over is always surplus).
    Drops up to the refilled shares' groups are taken as those shares' surplus first (the learner was only slow).
  * an announce below the learner's last version (a learner restarted from an older checkpoint) starts the count
    again from that version: the groups made since were made for weights that no longer exist, and the learner's
    next versions are new weights that need their groups.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

DROP_STALE = "stale"
DROP_FUTURE = "future_version"


def drop_reason(group_version: int, learner_version: int, floor: int) -> str | None:
    """Why a group of ``group_version`` may not feed the learner at ``learner_version`` whose floor is ``floor``:
    "stale" (below the floor), "future_version" (above the learner's), or None when it may."""
    if group_version < floor:
        return DROP_STALE
    if group_version > learner_version:
        return DROP_FUTURE
    return None


@dataclass(frozen=True)
class StalenessPolicy:
    """The bound of the module docstring: a group of version ``g`` may feed the learner at ``v`` iff
    ``v − max_staleness ≤ g ≤ v``."""

    max_staleness: int

    def __post_init__(self):
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")

    @classmethod
    def from_config(cls, cfg) -> StalenessPolicy:
        """The learner's policy: ``async.max_staleness`` (read here and nowhere else)."""
        return cls(cfg.async_.max_staleness)

    @classmethod
    def from_floor(cls, version: int, min_version: int) -> StalenessPolicy:
        """The policy the learner sent: its version and its floor (a batch request, a weights announce)."""
        return cls(version - min_version)

    def floor(self, learner_version: int) -> int:
        """The oldest weights a batch for ``learner_version`` may come from."""
        return learner_version - self.max_staleness

    def drop_reason(self, group_version: int, learner_version: int, floor: int | None = None) -> str | None:
        """:func:`drop_reason` with ``floor`` (the floor the learner sent) defaulting to this policy's."""
        return drop_reason(group_version, learner_version, self.floor(learner_version) if floor is None else floor)

    def usable(self, group_version: int, learner_version: int, floor: int | None = None) -> bool:
        return self.drop_reason(group_version, learner_version, floor) is None

    def may_generate(self, served: int, learner: int) -> bool:
        """Whether a group generated now by weights ``served`` can still be used once it reaches the learner,
        which is at ``learner`` or later."""
        return served >= self.floor(learner)

    def batches_worth(self, served: int, base: int) -> int:
        """Batches an engine's groups since learner version ``base`` can feed while it serves ``served``: the
        updates from ``base`` to ``served + max_staleness``."""
        return served - base + self.max_staleness + 1


@dataclass
class Admission:
    """Whether an engine may start a group now (the module docstring); pure bookkeeping over a
    :class:`StalenessPolicy`. ``max_staleness`` None: not known yet (the learner's first announce sets it)."""

    max_staleness: int | None
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
    learner: int = 0
    """The learner's latest announced version."""
    last_change: float = field(default_factory=time.monotonic)
    last_shipped: float = -math.inf
    """When this engine last shipped groups."""
    starving: bool = False
    """The learner reported a wait of ``starved_s`` at least ``starved_s`` after ``last_shipped``."""
    version_interval_s: float = 0.0
    """The longest interval seen between two consecutive learner versions, from version 1 on."""
    short_wait_s: float = 0.5
    """A learner wait that shows it is short of groups (for giving back those that went stale waiting)."""
    dropped_seen: tuple[int, int] | None = None
    """The learner's last counts of this engine's groups dropped as stale, and of those that arrived stale (None:
    none heard yet)."""
    given_back: dict[str, int] = field(default_factory=lambda: {"late": 0, "waited": 0})
    """Groups given back to the budget for stale drops, by kind (since this engine started)."""
    waited_pending: int = 0
    """Groups that went stale waiting, to give back when the learner is short of groups."""
    learner_short: bool = False
    """The learner reported a wait of ``short_wait_s`` since the last new version."""
    refill_absorbed: int = 0
    """Groups of the refilled shares matched by stale drops since ``base`` (those drops are not given back)."""
    _version_at: float | None = None

    @property
    def refill_after_s(self) -> float:
        """How long a spent budget waits for a new version before one more share: ``refill_s``, or twice the
        learner's slowest update so far when that is longer."""
        return max(self.refill_s, 2 * self.version_interval_s)

    @property
    def policy(self) -> StalenessPolicy | None:
        return None if self.max_staleness is None else StalenessPolicy(self.max_staleness)

    def share(self) -> int:
        return math.ceil(self.prompts_per_step * self.rounds_per_batch / self.num_engines)

    def budget(self, served: int) -> int:
        """Groups this engine may have made since ``base`` while it serves version ``served``."""
        base = served if self.base is None else self.base
        batches = self.policy.batches_worth(served, base) + (self.pretrain_batches if base == 0 else 0)
        return max(0, batches + self.refills) * self.share()

    def announced(self, version: int, min_version: int, now: float | None = None) -> None:
        """The learner announced ``version`` with its floor ``min_version`` (< 0: none sent): take its bound; a
        new version restarts the refill timer (and times the learner's update), a lower one (a learner restarted
        from an older checkpoint) the count."""
        if version > self.learner:
            now = time.monotonic() if now is None else now
            if self._version_at is not None and self.learner >= 1:
                self.version_interval_s = max(self.version_interval_s, now - self._version_at)
            self._version_at = now
        if min_version >= 0:
            self.max_staleness = StalenessPolicy.from_floor(version, min_version).max_staleness
        elif self.max_staleness is None:  # an announce without a floor (a bare WeightBroadcast.publish): strictest
            self.max_staleness = 0
        if version != self.learner:
            if version < self.learner:
                self.rolled_back(version)
            self.learner = version
            self.versions_changed(now)

    def versions_changed(self, now: float | None = None) -> None:
        self.last_change = time.monotonic() if now is None else now
        self.starving = self.learner_short = False

    def shipped(self, now: float | None = None) -> None:
        """Groups left for the learner now: a wait it reported before says nothing about them."""
        self.last_shipped = time.monotonic() if now is None else now
        self.starving = False

    def resumed(self, now: float | None = None) -> None:
        """The engine generates again after making nothing on purpose (a held-out evaluation): the learner's wait
        meanwhile was the evaluation's, not lost groups', so it counts as starving only once it has gone on
        ``starved_s`` after this, as after a shipment. Only the evaluating engine knows: with several engines the
        others, their budgets spent, still take that wait for lost groups and each make one share more."""
        self.shipped(now)

    def learner_waiting(self, waiting_s: float, now: float | None = None) -> None:
        """The learner's heartbeat: it has waited ``waiting_s`` for its next batch (0: it is not waiting)."""
        now = time.monotonic() if now is None else now
        if waiting_s >= self.starved_s and now - self.last_shipped >= self.starved_s:
            self.starving = True
        if waiting_s >= self.short_wait_s:
            self.learner_short = True

    def check(self, served: int, learner: int, now: float | None = None, in_flight: int = 0) -> str | None:
        """None when a group may start; else the reason it may not. ``in_flight``: this engine's groups started and
        not yet shipped; while there are any, a starving learner waits for them instead of a refill (they are on
        their way, and a share made on top of them would only go stale)."""
        if self.max_staleness is None:
            return "no_learner"
        if self.base is None:
            self.base = learner
        if not self.policy.may_generate(served, learner):
            return "stale_weights"
        if self.made >= self.budget(served) and self.waited_pending and self.learner_short and self.max_staleness:
            give = min(self.waited_pending, self.share())  # groups that went stale waiting, now that they are missed
            self.waited_pending -= give
            self.given_back["waited"] += give
            self.unmade(give)
            self.learner_short = False
        if self.made >= self.budget(served):
            now = time.monotonic() if now is None else now
            if now - self.last_change < self.refill_after_s and not (self.starving and not in_flight):
                return "version_budget"
            self.refills += 1
            self.last_change = now
            self.starving = False
        return None

    def record(self, version: int, groups: int) -> None:
        self.made += groups

    def unmade(self, groups: int = 1) -> None:
        """Groups recorded but never shipped (aborted in the engine): their share of the budget is given back."""
        self.made = max(0, self.made - groups)

    def dropped(self, stale: int, late: int) -> int:
        """The learner's heartbeat: ``stale`` of this engine's groups were dropped as stale by the replay since that
        learner started, ``late`` of them on arrival (the module docstring): the new late ones are given back now,
        the new ones that went stale waiting when the learner is short (:meth:`check`); drops up to a refilled
        share's groups are that share's surplus (those that went stale waiting first). The first counts heard (an
        engine that just started: drops of an earlier process's groups) only set where counting starts; counts below
        the last ones (a restarted learner counts from 0) are all new. Returns the groups given back now."""
        if self.dropped_seen is None:
            self.dropped_seen = (stale, late)
            return 0
        seen_stale, seen_late = self.dropped_seen
        if stale < seen_stale or late < seen_late:
            seen_stale = seen_late = 0
        self.dropped_seen = (stale, late)
        new_late = late - seen_late
        new_waited = max(0, (stale - seen_stale) - new_late)
        surplus = max(0, min(new_late + new_waited, self.refills * self.share() - self.refill_absorbed))
        self.refill_absorbed += surplus
        waited_surplus = min(surplus, new_waited)
        self.waited_pending += new_waited - waited_surplus
        back = new_late - (surplus - waited_surplus)
        self.unmade(back)
        self.given_back["late"] += back
        return back

    def rolled_back(self, version: int) -> None:
        """The learner went back to ``version`` (restarted from a checkpoint): what was made since is for weights
        that no longer exist (or already in the replay, for ``version`` itself), so the count starts again there."""
        self.base, self.made, self.refills, self.refill_absorbed, self.waited_pending = version, 0, 0, 0, 0


LAG_BUCKETS = ("0", "1", "2", "3+")


def token_lags(groups, learner_version: int) -> dict[str, float]:
    """How old the tokens of ``groups`` are for the learner at ``learner_version`` (its version minus the version
    that sampled each token, ``Group.token_versions``): tokens per lag bucket (``LAG_BUCKETS``), their mean and
    max lag, and the fraction of samples generated under more than one version."""
    counts = dict.fromkeys(LAG_BUCKETS, 0)
    total = lag_sum = samples = multi = 0
    worst = 0
    for g in groups:
        for i, t in enumerate(g.samples):
            samples += 1
            multi += len(t.version_spans) > 1
            for v in g.token_versions(i):
                lag = learner_version - v
                counts[LAG_BUCKETS[min(max(lag, 0), 3)]] += 1
                total += 1
                lag_sum += lag
                worst = max(worst, lag)
    return {"by_lag": counts, "mean": lag_sum / total if total else 0.0, "max": worst,
            "multi_version_frac": multi / samples if samples else 0.0}

