"""The replay buffer between verifier and learner: whole groups in, staleness-bounded batches out.

Versions and the bound are ``async_vapo.staleness``'s (the one rule): a batch for the learner at version v holds only
groups with ``floor ≤ version ≤ v``, the floor being the one the learner sends with each request (``min_version``; it
owns the bound) or, for a buffer made with a ``max_staleness`` of its own (tests, tools), ``v − max_staleness``. The
replay service makes its buffer without one: until the learner's first request after a restart there is no floor,
and groups are kept until that request says which are stale.

Selection. A batch is made of whole groups (never a split one: group-normalised advantages and the
token-level loss both need every sample of a prompt). Groups are taken oldest admissible version
first, then by arrival (seq), so that nothing goes stale while younger data is used. ``make_batch``
first drops every stored group that can never be admissible again (age > max_staleness: "stale"; a
version above the learner's, which only a learner restored from an older checkpoint can see:
"future_version"), then returns None if fewer than ``num_groups`` admissible groups are left; the
caller waits and asks again. A group that arrives already stale for the learner version of the last
``make_batch`` is dropped at once. Above ``capacity_groups`` the oldest (same order) are dropped as
"overflow". Every drop is recorded in the store with its reason and counted, so every group ever
added is served exactly once or dropped with a reason.

Invalid groups (not a Group, no samples, negative or non-integer version, wrong group size, token ids and behaviour
log-probs of different lengths, malformed version spans (``types.spans_error``) or a version that is not its oldest
token's, and against :class:`GroupLimits`: token ids outside the vocabulary, non-finite or positive log-probs, rewards
outside the verifier's set, a version beyond the learner's newest + 1, a (uid, version) already stored) are rejected:
counted by reason and logged, and ``add`` returns None; ``add(..., strict=True)`` raises ``InvalidGroupError`` instead.
Store I/O errors always propagate: a group that was not stored was not acknowledged.

Recovery. The buffer holds no state of its own beyond an index: constructing it over an existing
store restores the unconsumed groups, the cursor (batch ids continue), the drop counters and the
served-age histogram. Reject counts are per process (rejected groups are never stored).

Rewind (a learner that lost updates). The learner says with every batch request how many groups ever served its
weights include (``received_cursor``: the cursor of the last batch it received, or of its checkpoint after a
restart). When the store has served more, those groups never reached an update that survived (the learner died
after they were served, or the reply was lost): :meth:`ReplayBuffer.rewind` reads them back from the log and stores
them again (new seqs, same groups), unless the same (uid, version) is live already, so each is live once; the next
``make_batch`` serves them or drops them with a reason (a version above the resumed learner's is "future_version",
one below its floor "stale"). Groups served before a compaction cannot be read back: counted, logged, lost.

Thread-safe: every public method holds one lock.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from dataclasses import dataclass, replace

import msgspec

from async_vapo.replay.store import GroupStore
from async_vapo.staleness import DROP_FUTURE, DROP_STALE, StalenessPolicy, drop_reason
from async_vapo.types import Group, env_spans_error, spans_error

logger = logging.getLogger(__name__)

DROP_OVERFLOW = "overflow"

REJECT_NOT_A_GROUP = "not_a_group"
REJECT_EMPTY = "empty_samples"
REJECT_BAD_VERSION = "bad_version"
REJECT_NEGATIVE_VERSION = "negative_version"
REJECT_GROUP_SIZE = "group_size_mismatch"
REJECT_LOGPROBS_LENGTH = "logprobs_length_mismatch"
REJECT_TOKEN_RANGE = "token_out_of_vocab"
REJECT_LOGPROBS = "bad_logprobs"
REJECT_REWARD = "bad_reward"
REJECT_VERSION_RANGE = "version_out_of_range"
REJECT_DUPLICATE = "duplicate_uid"
REJECT_FIELDS = "bad_fields"
REJECT_SPANS = "bad_version_spans"

LOGPROB_SLACK = 1e-5
"""A log-probability may exceed 0 by this much (float rounding of a log-softmax), never more."""


@dataclass(frozen=True)
class GroupLimits:
    """What a valid group looks like at a trust boundary (each check is skipped when its limit is None).

    ``vocab_size``: every token id in [0, vocab_size); ``rewards``: the verifier's reward set, and ``correct``
    true exactly for ``reward_correct``; ``max_version``: the newest version a group may carry (the learner's
    newest + 1)."""

    group_size: int | None = None
    vocab_size: int | None = None
    rewards: frozenset[float] | None = None
    reward_correct: float | None = None
    max_version: int | None = None

    @classmethod
    def from_config(cls, cfg, vocab_size: int | None = None) -> GroupLimits:
        v = cfg.verifier
        return cls(group_size=cfg.algo.group_size, vocab_size=vocab_size,
                   rewards=frozenset({float(v.reward_correct), float(v.reward_incorrect)}),
                   reward_correct=float(v.reward_correct))


class InvalidGroupError(ValueError):
    """``add(..., strict=True)`` of a group that fails validation; ``reason`` is the counted label."""

    def __init__(self, reason: str):
        super().__init__(f"invalid group: {reason}")
        self.reason = reason


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    """Whole groups for one update (replay -> learner)."""

    batch_id: int
    """Strictly increasing from 1, across restarts."""
    groups: list[Group]
    seqs: list[int]
    """Store seq of each group."""
    learner_version: int
    """v: the batch makes update v + 1."""
    min_version: int
    versions: list[int]
    ages: list[int]
    """learner_version - version per group, in versions; each in [0, max_staleness]."""
    assembly_seconds: float


class ReplayStats(msgspec.Struct, frozen=True, kw_only=True):
    stored_groups: int
    added_total: int
    """Groups ever stored (survives restarts)."""
    batches_total: int
    served_groups_total: int
    stale_dropped_total: int
    dropped_total: dict[str, int]
    """By reason: stale, overflow, future_version (survives restarts)."""
    rejected_total: dict[str, int]
    """By reason, since this process started."""
    age_histogram: dict[int, int]
    """Served groups per age in versions, over every batch ever served."""
    max_age_served: int | None
    torn_tail_truncations: int
    stale_dropped_by_engine: dict[str, int] = {}
    """Groups dropped as stale since this process started (on arrival or waiting), by the engine that generated them
    (``Group.engine``; groups that name none are left out)."""
    late_dropped_by_engine: dict[str, int] = {}
    """Of those, the groups dropped on arrival (already below the learner's floor when stored: they finished after the
    learner had moved past them)."""


def _ids_in_range(ids, vocab_size: int) -> bool:
    return not ids or (min(ids) >= 0 and max(ids) < vocab_size)


def validate_group(group: object, group_size: int | None = None, limits: GroupLimits | None = None) -> str | None:
    """The reject reason for ``group``, or None when it may be stored (or trained on)."""
    if not isinstance(group, Group):
        return REJECT_NOT_A_GROUP
    if isinstance(group.version, bool) or not isinstance(group.version, int):
        return REJECT_BAD_VERSION
    if group.version < 0:
        return REJECT_NEGATIVE_VERSION
    if not group.samples:
        return REJECT_EMPTY
    limits = limits or GroupLimits()
    size = group_size if group_size is not None else limits.group_size
    if size is not None and len(group.samples) != size:
        return REJECT_GROUP_SIZE
    if any(len(s.response_ids) != len(s.behavior_logprobs) for s in group.samples):
        return REJECT_LOGPROBS_LENGTH
    if limits.max_version is not None and group.version > limits.max_version:
        return REJECT_VERSION_RANGE
    if not group.prompt_ids or any(s.finish_reason not in ("stop", "length") for s in group.samples):
        return REJECT_FIELDS
    if any(spans_error(s, group.version) is not None or env_spans_error(s) is not None for s in group.samples):
        return REJECT_SPANS
    if any(s.version_spans for s in group.samples) and min(
            group.spans_of(i)[0][0] for i in range(len(group.samples))) != group.version:
        return REJECT_SPANS  # the group's version must be its oldest token's
    if limits.vocab_size is not None and not (
            _ids_in_range(group.prompt_ids, limits.vocab_size)
            and all(_ids_in_range(s.response_ids, limits.vocab_size) for s in group.samples)):
        return REJECT_TOKEN_RANGE
    for s in group.samples:
        lps = s.behavior_logprobs
        if lps and not (all(map(math.isfinite, lps)) and max(lps) <= LOGPROB_SLACK):
            return REJECT_LOGPROBS
        if not math.isfinite(s.reward) or (limits.rewards is not None and s.reward not in limits.rewards):
            return REJECT_REWARD
        if limits.reward_correct is not None and bool(s.correct) != (s.reward == limits.reward_correct):
            return REJECT_REWARD
    return None


class ReplayBuffer:
    """Staleness-bounded FIFO-by-version group buffer over a ``GroupStore`` (see module docstring)."""

    def __init__(
        self,
        store: GroupStore,
        max_staleness: int | None,
        group_size: int | None = None,
        capacity_groups: int = 4096,
        seed: int = 0,
        limits: GroupLimits | None = None,
    ):
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.store = store
        self.policy = None if max_staleness is None else StalenessPolicy(max_staleness)
        """The buffer's own bound, for requests without a floor; None: every request brings the learner's."""
        self.group_size = group_size
        self.capacity_groups = capacity_groups
        # Selection is deterministic (FIFO by version, then seq); the seed is kept for the
        # interface's sake and for any future tie-breaking that needs randomness.
        self.seed = seed
        self._lock = threading.RLock()
        self._rejected: dict[str, int] = {}
        self._late_by_engine: dict[str, int] = {}
        self._stale_by_engine: dict[str, int] = {}
        self._versions: list[int] = []
        self._by_version: dict[int, dict[int, None]] = {}
        self.limits = limits or GroupLimits(group_size=group_size)
        self._keys: dict[int, tuple[str, int]] = {}  # seq -> (uid, version) of every live group
        self._live: set[tuple[str, int]] = set()
        self._newest_seen = -1  # newest version stored or asked for: bounds what may arrive (+ 1)
        for seq, group in store.live():
            self._index_add(seq, group.version, group.uid)
        self._learner_version = store.cursor.learner_version
        self._floor = None if self._learner_version is None or self.policy is None else \
            self.policy.floor(self._learner_version)
        with self._lock:
            self._enforce_capacity()

    # --- public API ------------------------------------------------------------------------------

    def add(self, group: Group, *, strict: bool = False) -> int | None:
        """Validate and durably store ``group``; its seq, or None when rejected (see module docstring)."""
        with self._lock:
            reason = validate_group(group, self.group_size, self._limits_now())
            if reason is None and (group.uid, group.version) in self._live:
                reason = REJECT_DUPLICATE  # the same group sent twice (a retry, or a replayed message)
            if reason is not None:
                self._rejected[reason] = self._rejected.get(reason, 0) + 1
                logger.warning("rejected group %s: %s", getattr(group, "uid", "?"), reason)
                if strict:
                    raise InvalidGroupError(reason)
                return None
            seq = self.store.append(group)
            self._index_add(seq, group.version, group.uid)
            if self._floor is not None and group.version < self._floor:
                self._drop([seq], DROP_STALE)
                if group.engine:  # late: its engine's admission gives its share back (async_vapo.staleness)
                    self._late_by_engine[group.engine] = self._late_by_engine.get(group.engine, 0) + 1
            else:
                self._enforce_capacity()
            return seq

    def make_batch(self, num_groups: int, learner_version: int, min_version: int | None = None) -> Batch | None:
        """``num_groups`` whole groups for the learner at ``learner_version``, or None if too few.

        ``min_version``: the learner's staleness floor (the cluster's learner sends it with every request: it
        owns the bound); None: the buffer's own policy's."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if learner_version < 0:
            raise ValueError(f"learner_version must be >= 0, got {learner_version}")
        start = time.perf_counter()
        with self._lock:
            if min_version is None and self.policy is None:
                raise ValueError("a request without min_version, to a buffer without a bound of its own")
            floor = self.policy.floor(learner_version) if min_version is None else min_version
            if floor > learner_version:
                raise ValueError(f"min_version {floor} is above learner_version {learner_version}")
            self._learner_version, self._floor = learner_version, floor
            dropped: dict[str, list[int]] = {DROP_STALE: [], DROP_FUTURE: []}
            for ver in self._versions:
                reason = drop_reason(ver, learner_version, floor)
                if reason is not None:
                    dropped[reason] += self._by_version[ver]
            for reason, seqs in dropped.items():
                self._drop(seqs, reason)
            if sum(len(self._by_version[ver]) for ver in self._versions) < num_groups:
                return None
            seqs: list[int] = []
            for ver in self._versions:
                for s in self._by_version[ver]:
                    seqs.append(s)
                    if len(seqs) == num_groups:
                        break
                if len(seqs) == num_groups:
                    break
            groups = [self.store.get(s) for s in seqs]
            batch_id = self.store.cursor.batch_id + 1
            self.store.mark_consumed(seqs, batch_id, learner_version)
            for s, g in zip(seqs, groups, strict=True):
                self._index_remove(s, g.version)
            versions = [g.version for g in groups]
            return Batch(
                batch_id=batch_id,
                groups=groups,
                seqs=seqs,
                learner_version=learner_version,
                min_version=min(versions),
                versions=versions,
                ages=[learner_version - ver for ver in versions],
                assembly_seconds=time.perf_counter() - start,
            )

    def rewind(self, received_cursor: int) -> tuple[int, int]:
        """Store again the groups served after the first ``received_cursor`` (see the module docstring); returns
        (groups stored again, groups no longer in the log). A cursor at or beyond the store's is a no-op."""
        with self._lock:
            if received_cursor < 0 or received_cursor >= self.store.cursor.consumed_total:
                return 0, 0
            groups, missing = self.store.served_after(received_cursor)
            again = 0
            for g in groups:
                if (g.uid, g.version) in self._live:  # stored again by an earlier rewind and not served since
                    continue
                seq = self.store.append(g)
                self._index_add(seq, g.version, g.uid)
                again += 1
            self._enforce_capacity()
            logger.info("rewind to cursor %d: %d groups stored again, %d no longer in the log", received_cursor,
                        again, missing)
            return again, missing

    def admission_floor(self, learner_version: int, lookahead: int = 0) -> int:
        """Lowest version a group started now may carry and still be usable.

        ``lookahead`` is how many updates the learner is expected to publish before the group
        arrives; rollout should not start a group whose weights are older than this.
        """
        return max(0, learner_version + lookahead - self._bound())

    def num_admissible(self, learner_version: int) -> int:
        """Stored groups a batch for ``learner_version`` could use now."""
        with self._lock:
            floor = learner_version - self._bound()
            return sum(len(self._by_version[v]) for v in self._versions
                       if drop_reason(v, learner_version, floor) is None)

    def _bound(self) -> int:
        """max_staleness: the buffer's own, else the one the learner's last request implied, else 0."""
        if self.policy is not None:
            return self.policy.max_staleness
        if self._floor is not None and self._learner_version is not None:
            return self._learner_version - self._floor
        return 0

    def stats(self) -> ReplayStats:
        with self._lock:
            store = self.store
            ages = store.served_ages
            dropped = store.dropped_counts
            return ReplayStats(
                stored_groups=len(store),
                added_total=store.next_seq - 1,
                batches_total=store.cursor.batch_id,
                served_groups_total=store.cursor.consumed_total,
                stale_dropped_total=dropped.get(DROP_STALE, 0),
                dropped_total=dropped,
                rejected_total=dict(self._rejected),
                age_histogram=ages,
                max_age_served=max(ages) if ages else None,
                torn_tail_truncations=store.recovery.torn_tail_truncations,
                stale_dropped_by_engine=dict(self._stale_by_engine),
                late_dropped_by_engine=dict(self._late_by_engine),
            )

    def __len__(self) -> int:
        return len(self.store)

    # --- internals -------------------------------------------------------------------------------

    def _limits_now(self) -> GroupLimits:
        """The configured limits with the version bound of now: nothing newer than the learner's newest + 1
        (unknown until the learner's first batch request, which is persisted)."""
        if self._learner_version is None:
            return self.limits
        return replace(self.limits, max_version=self._learner_version + 1)

    def request_error(self, num_groups: int, learner_version: int, min_version: int | None) -> str | None:
        """Why a batch request must not be acted on, or None. A learner advances one version per batch (a
        resumed one may go back), so a request beyond the newest version seen (asked for or stored) + 1 is
        not one; nor is a floor above the version, or more groups than the buffer can ever hold."""
        if not 1 <= num_groups <= self.capacity_groups:
            return "bad_group_count"
        if learner_version < 0 or (min_version is not None and min_version > learner_version):
            return "bad_version"
        newest = max(self._newest_seen, -1 if self._learner_version is None else self._learner_version)
        if learner_version > max(newest, 0) + 1:
            return "future_version"
        return None

    def _index_add(self, seq: int, version: int, uid: str) -> None:
        self._keys[seq] = (uid, version)
        self._live.add((uid, version))
        self._newest_seen = max(self._newest_seen, version)
        bucket = self._by_version.get(version)
        if bucket is None:
            bucket = self._by_version[version] = {}
            bisect.insort(self._versions, version)
        bucket[seq] = None

    def _index_remove(self, seq: int, version: int) -> None:
        self._live.discard(self._keys.pop(seq, ("", -1)))
        bucket = self._by_version[version]
        del bucket[seq]
        if not bucket:
            del self._by_version[version]
            self._versions.pop(bisect.bisect_left(self._versions, version))

    def _drop(self, seqs: list[int], reason: str) -> None:
        if not seqs:
            return
        groups = [self.store.get(s) for s in seqs]
        versions = [g.version for g in groups]
        if reason == DROP_STALE:
            for g in groups:
                if g.engine:
                    self._stale_by_engine[g.engine] = self._stale_by_engine.get(g.engine, 0) + 1
        self.store.mark_dropped(seqs, reason)
        for s, ver in zip(seqs, versions, strict=True):
            self._index_remove(s, ver)
        logger.info("dropped %d groups: %s", len(seqs), reason)

    def _enforce_capacity(self) -> None:
        excess = len(self.store) - self.capacity_groups
        if excess <= 0:
            return
        oldest: list[int] = []
        for ver in self._versions:
            for s in self._by_version[ver]:
                oldest.append(s)
                if len(oldest) == excess:
                    break
            if len(oldest) == excess:
                break
        self._drop(oldest, DROP_OVERFLOW)
