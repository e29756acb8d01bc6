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
    ``starved_s``, reported that long after the engine last shipped groups (so not groups still on their way), tops
    the budget up at once.
  * groups made in time and never trained on give their share back: those the engine aborted
    (:meth:`Admission.unmade`), and those that reached the replay already stale (a group that finished after the
    learner had moved past it, e.g. a long response of an engine that updates weights in flight), which the replay
    counts per engine and the learner repeats in its heartbeats (:meth:`Admission.dropped_late`). Without that an
    engine's lead shrinks by every such group for the rest of the run. A refill's share is the exception: the learner
    may never need it (it was only slow), and then it goes stale; late drops up to the refilled groups are taken as
    that surplus and not made again. Groups that went stale *waiting* in the replay are not given back: the learner
    takes the oldest first, so such a group was one more than the learner could use within the bound, and the
    engine cannot tell one made too late for its window (weights loaded late: more groups of the old version) from
    what the budget's maxima leave over when the learner takes fewer (value pretraining stopped on its plateau,
    DAPO's unused resampling rounds), which, made again, would go stale again at every version.
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
    late_seen: int | None = None
    """The learner's last count of this engine's groups that reached the replay already stale (None: none heard)."""
    late_given_back: int = 0
    """Groups given back to the budget for late drops (since this engine started)."""
    refill_absorbed: int = 0
    """Groups of the refilled shares matched by late drops since ``base`` (those drops are not given back)."""
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
        if self.max_staleness is None:
            return "no_learner"
        if self.base is None:
            self.base = learner
        if not self.policy.may_generate(served, learner):
            return "stale_weights"
        if self.made >= self.budget(served):
            now = time.monotonic() if now is None else now
            if now - self.last_change < self.refill_after_s and not self.starving:
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

    def dropped_late(self, total: int) -> int:
        """The learner's heartbeat: ``total`` of this engine's groups reached the replay already stale since that
        learner started. Each new one was made and will never be trained on: its share of the budget is given back,
        unless it matches a refilled share's group (the module docstring). The first count heard (an engine that
        just started: drops of an earlier process's groups) only sets where counting starts; a count below the last
        one (a restarted learner counts from 0) is all new. Returns the groups given back."""
        if self.late_seen is None:
            self.late_seen = total
            return 0
        new = total - self.late_seen if total >= self.late_seen else total
        self.late_seen = total
        if new <= 0:
            return 0
        surplus = min(new, self.refills * self.share() - self.refill_absorbed)
        self.refill_absorbed += max(0, surplus)
        back = new - max(0, surplus)
        self.unmade(back)
        self.late_given_back += back
        return back

    def rolled_back(self, version: int) -> None:
        """The learner went back to ``version`` (restarted from a checkpoint): what was made since is for weights
        that no longer exist (or already in the replay, for ``version`` itself), so the count starts again there."""
        self.base, self.made, self.refills, self.refill_absorbed = version, 0, 0, 0


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

