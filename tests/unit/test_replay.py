"""Replay buffer and group store: the staleness bound at its edge, whole-group FIFO batches, durability
(reopen, killed writer, torn tails, mid-file corruption, compaction), rejects, and a property test that
checks bound / exactly-once / no-loss / age histogram against a naive reference model."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from async_vapo.replay import (
    DROP_FUTURE,
    DROP_OVERFLOW,
    DROP_STALE,
    CorruptLogError,
    GroupStore,
    InvalidGroupError,
    ReplayBuffer,
    StoreLockedError,
)
from async_vapo.replay.store import FILE_MAGIC
from async_vapo.types import Group, Trajectory, enc_hook

REPO = Path(__file__).resolve().parents[2]
RECORD_MAGIC_TORN = b"\xabVR\x01\xff\x00\x00\x00"  # a record header declaring 255 bytes, then nothing
_uid = iter(range(10**9))


def make_group(version: int, size: int = 4, tokens: int = 3, uid: str | None = None) -> Group:
    n = next(_uid)
    samples = [
        Trajectory(
            response_ids=[(n + i + t) % 1000 for t in range(tokens)],
            behavior_logprobs=[-0.01 * (t + 1) for t in range(tokens)],
            finish_reason="stop",
            reward=float(i % 2),
            correct=bool(i % 2),
            verdict="ok",
        )
        for i in range(size)
    ]
    return Group(uid=uid or f"g{n}", prompt="1+1=", answer="2", prompt_ids=[1, 2, 3], version=version, samples=samples)


def record_offsets(path: Path) -> list[int]:
    """Byte offset of every record in a log (walks the framing, no CRC check)."""
    data = path.read_bytes()
    offs, off = [], len(FILE_MAGIC)
    while off < len(data):
        offs.append(off)
        off += 12 + int.from_bytes(data[off + 4 : off + 8], "little")
    return offs


# --- the staleness bound -----------------------------------------------------------------------


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
def test_staleness_bound_is_exact_at_the_boundary(max_staleness):
    v = 10
    buf = ReplayBuffer(GroupStore(None), max_staleness=max_staleness)
    too_old = buf.add(make_group(v - max_staleness - 1))  # age = max_staleness + 1
    oldest_ok = buf.add(make_group(v - max_staleness))  # age = max_staleness
    current = buf.add(make_group(v))  # age = 0
    assert buf.admission_floor(v) == v - max_staleness
    assert buf.num_admissible(v) == 2

    batch = buf.make_batch(2, learner_version=v)
    assert batch is not None
    assert batch.seqs == [oldest_ok, current]
    assert batch.ages == [max_staleness, 0]
    assert batch.versions == [v - max_staleness, v]
    assert batch.min_version == v - max_staleness
    assert batch.learner_version == v
    stats = buf.stats()
    assert stats.stale_dropped_total == 1
    assert stats.dropped_total == {DROP_STALE: 1}
    assert too_old not in buf.store
    assert len(buf) == 0
    assert buf.make_batch(1, learner_version=v) is None  # the stale group is never served later


def test_group_arriving_already_stale_is_dropped_at_once():
    buf = ReplayBuffer(GroupStore(None), max_staleness=1)
    assert buf.make_batch(1, learner_version=5) is None
    buf.add(make_group(3))  # age 2 for the learner at 5
    buf.add(make_group(4))  # age 1
    assert len(buf) == 1 and buf.stats().dropped_total == {DROP_STALE: 1}


def test_restart_remembers_the_learner_version_of_the_last_batch(tmp_path):
    path = tmp_path / "replay.log"
    buf = ReplayBuffer(GroupStore(path), max_staleness=1)
    buf.add(make_group(4))
    assert buf.make_batch(1, learner_version=5) is not None
    buf.store.close()
    buf = ReplayBuffer(GroupStore(path), max_staleness=1)
    buf.add(make_group(3))  # age 2 for the learner at 5: dropped on arrival, not left to take up room
    assert len(buf) == 0 and buf.stats().dropped_total == {DROP_STALE: 1}
    buf.store.close()


def test_group_from_the_future_is_dropped():
    # Only a learner restored from an older checkpoint can see a group newer than itself.
    buf = ReplayBuffer(GroupStore(None), max_staleness=2)
    buf.add(make_group(7))
    buf.add(make_group(5))
    batch = buf.make_batch(1, learner_version=5)
    assert batch is not None and batch.versions == [5]
    assert buf.stats().dropped_total == {DROP_FUTURE: 1}


def test_zero_staleness_serves_only_the_current_version():
    buf = ReplayBuffer(GroupStore(None), max_staleness=0)
    v = 0
    served = []
    for _ in range(6):
        # The rollout still holds the previous weights for part of its groups.
        for lag in (1, 0, 1, 0, 0):
            buf.add(make_group(max(0, v - lag)))
        batch = buf.make_batch(2, learner_version=v)
        assert batch is not None
        assert batch.versions == [v, v] and batch.ages == [0, 0]
        served += batch.seqs
        v += 1
    assert buf.stats().max_age_served == 0
    assert buf.stats().age_histogram == {0: len(served)}
    assert buf.stats().stale_dropped_total > 0


def test_admission_floor_with_lookahead_and_clamp():
    buf = ReplayBuffer(GroupStore(None), max_staleness=2)
    assert buf.admission_floor(10) == 8
    assert buf.admission_floor(10, lookahead=1) == 9
    assert buf.admission_floor(1) == 0


# --- batch assembly ------------------------------------------------------------------------------


def test_batches_hold_whole_groups():
    store = GroupStore(None)
    buf = ReplayBuffer(store, max_staleness=3)
    added = {}
    for size in (1, 5, 3, 8, 2, 4):
        g = make_group(2, size=size)
        added[buf.add(g)] = g
    batch = buf.make_batch(4, learner_version=2)
    assert batch is not None
    assert [len(g.samples) for g in batch.groups] == [1, 5, 3, 8]
    for seq, g in zip(batch.seqs, batch.groups, strict=True):
        assert g == added[seq]
    assert buf.make_batch(3, learner_version=2) is None  # 2 left: not split to fill up
    assert len(buf) == 2


def test_fifo_by_version_then_arrival():
    buf = ReplayBuffer(GroupStore(None), max_staleness=10)
    seqs = {}
    for i, version in enumerate([3, 1, 2, 1, 3, 2]):
        seqs[i] = buf.add(make_group(version))
    batch = buf.make_batch(4, learner_version=3)
    assert batch is not None
    assert batch.versions == [1, 1, 2, 2]
    assert batch.seqs == [seqs[1], seqs[3], seqs[2], seqs[5]]
    assert batch.ages == [2, 2, 1, 1]
    assert buf.make_batch(2, learner_version=3).seqs == [seqs[0], seqs[4]]


def test_returns_none_when_not_enough_and_consumes_nothing():
    buf = ReplayBuffer(GroupStore(None), max_staleness=1)
    buf.add(make_group(0))
    buf.add(make_group(0))
    assert buf.make_batch(3, learner_version=0) is None
    assert len(buf) == 2 and buf.stats().batches_total == 0
    buf.add(make_group(0))
    batch = buf.make_batch(3, learner_version=0)
    assert batch is not None and batch.batch_id == 1 and len(batch.groups) == 3
    with pytest.raises(ValueError):
        buf.make_batch(0, learner_version=0)


def test_capacity_drops_the_oldest_as_overflow():
    buf = ReplayBuffer(GroupStore(None), max_staleness=5, capacity_groups=3)
    seqs = [buf.add(make_group(v)) for v in (2, 1, 3, 2, 3)]
    # Oldest first: version 1 (seqs[1]), then the first version 2 (seqs[0]).
    assert sorted(s for s, _ in buf.store.live()) == sorted([seqs[2], seqs[3], seqs[4]])
    assert buf.stats().dropped_total == {DROP_OVERFLOW: 2}


def test_age_histogram_and_stats():
    buf = ReplayBuffer(GroupStore(None), max_staleness=3)
    for version in (0, 1, 1, 2):
        buf.add(make_group(version))
    buf.make_batch(2, learner_version=2)  # ages 2, 1
    buf.make_batch(2, learner_version=3)  # ages 2, 1
    s = buf.stats()
    assert s.age_histogram == {1: 2, 2: 2}
    assert s.max_age_served == 2
    assert s.batches_total == 2 and s.served_groups_total == 4 and s.added_total == 4 and s.stored_groups == 0


# --- validation --------------------------------------------------------------------------------


def test_invalid_groups_are_rejected_with_a_reason():
    buf = ReplayBuffer(GroupStore(None), max_staleness=1, group_size=4)
    bad_logprobs = make_group(0)
    bad_logprobs.samples[2].behavior_logprobs.pop()
    cases = {
        "empty_samples": Group(uid="e", prompt="p", answer="a", prompt_ids=[1], version=0, samples=[]),
        "negative_version": make_group(-1),
        "bad_version": make_group(True),
        "group_size_mismatch": make_group(0, size=3),
        "logprobs_length_mismatch": bad_logprobs,
        "not_a_group": {"uid": "dict"},
    }
    for group in cases.values():
        assert buf.add(group) is None
    assert buf.stats().rejected_total == dict.fromkeys(cases, 1)
    assert len(buf) == 0 and buf.store.next_seq == 1
    with pytest.raises(InvalidGroupError) as err:
        buf.add(make_group(0, size=5), strict=True)
    assert err.value.reason == "group_size_mismatch"
    assert buf.add(make_group(0)) == 1


# --- durability --------------------------------------------------------------------------------


def test_reopen_restores_unconsumed_groups_and_cursor(tmp_path):
    path = tmp_path / "replay.log"
    buf = ReplayBuffer(GroupStore(path, fsync="always"), max_staleness=2)
    groups = {buf.add(make_group(v)): None for v in (0, 0, 1, 1, 1, 2, 2, 2, 2, 2)}
    first = buf.make_batch(3, learner_version=2)
    second = buf.make_batch(3, learner_version=2)
    consumed = set(first.seqs) | set(second.seqs)
    live_before = dict(buf.store.live())
    buf.store.close()

    store = GroupStore(path)
    assert store.recovery.torn_tail_truncations == 0
    assert dict(store.live()) == live_before
    assert set(live_before) == set(groups) - consumed
    assert store.cursor.batch_id == 2 and store.cursor.consumed_total == 6
    assert store.cursor.learner_version == 2
    buf = ReplayBuffer(store, max_staleness=2)
    assert buf.stats().age_histogram == {2: 2, 1: 3, 0: 1}
    third = buf.make_batch(4, learner_version=2)
    assert third.batch_id == 3
    assert set(third.seqs) == set(live_before)
    assert not set(third.seqs) & consumed
    assert buf.make_batch(1, learner_version=2) is None
    assert buf.add(make_group(2)) == 11  # seqs are never reused
    store.close()


def test_acknowledged_groups_survive_a_killed_writer(tmp_path):
    path = tmp_path / "replay.log"
    code = f"""
import sys
sys.path.insert(0, {str(REPO)!r})
from async_vapo.replay import GroupStore, ReplayBuffer
from async_vapo.types import Group, Trajectory, enc_hook
buf = ReplayBuffer(GroupStore({str(path)!r}, fsync="never"), max_staleness=1)
t = Trajectory(response_ids=list(range(60)), behavior_logprobs=[-0.5] * 60, finish_reason="stop")
i = 0
while True:
    seq = buf.add(Group(uid=f"u{{i}}", prompt="p", answer="a", prompt_ids=[1], version=0, samples=[t] * 8))
    if i == 5:
        buf.make_batch(2, learner_version=0)
    print(seq, flush=True)
    i += 1
"""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    acked = [int(proc.stdout.readline()) for _ in range(40)]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()

    store = GroupStore(path)
    live = dict(store.live())
    assert store.cursor.batch_id == 1 and store.cursor.consumed_total == 2
    assert set(acked) - {1, 2} <= set(live)  # everything acked is back; the consumed two are not
    assert 1 not in live and 2 not in live
    assert all(g.uid == f"u{seq - 1}" and len(g.samples) == 8 for seq, g in live.items())
    store.close()


def _write_groups(path: Path, n: int) -> list[Group]:
    groups = [make_group(0) for _ in range(n)]
    with GroupStore(path, fsync="never") as store:
        for g in groups:
            store.append(g)
    return groups


@pytest.mark.parametrize("cut", ["mid_header", "mid_payload", "one_byte_short"])
def test_torn_tail_is_truncated_and_counted(tmp_path, cut):
    path = tmp_path / "replay.log"
    groups = _write_groups(path, 5)
    last = record_offsets(path)[-1]
    size = path.stat().st_size
    keep = {"mid_header": last + 5, "mid_payload": (last + size) // 2, "one_byte_short": size - 1}[cut]
    os.truncate(path, keep)

    store = GroupStore(path)
    assert store.recovery.torn_tail_truncations == 1
    assert store.recovery.truncated_bytes == keep - last
    assert [g for _, g in store.live()] == groups[:4]
    assert path.stat().st_size == last
    store.append(groups[4])  # appends after the repaired tail are readable
    store.close()
    store = GroupStore(path)
    assert store.recovery.torn_tail_truncations == 0
    assert [g for _, g in store.live()] == groups
    store.close()


@pytest.mark.parametrize("garbage", [b"\x00" * 4096, random.Random(1).randbytes(333),
                                     b"\xabVR\x01" + random.Random(2).randbytes(40)], ids=["zeros", "random", "magic"])
def test_garbage_after_the_last_record_is_truncated(tmp_path, garbage):
    path = tmp_path / "replay.log"
    groups = _write_groups(path, 5)
    size = path.stat().st_size
    with open(path, "ab") as f:
        f.write(garbage)
    store = GroupStore(path)
    assert store.recovery.torn_tail_truncations == 1
    assert store.recovery.truncated_bytes == len(garbage)
    assert [g for _, g in store.live()] == groups
    assert path.stat().st_size == size
    store.close()


def test_corruption_in_the_middle_raises_with_file_and_offset(tmp_path):
    path = tmp_path / "replay.log"
    _write_groups(path, 5)
    bad = record_offsets(path)[2]
    data = bytearray(path.read_bytes())
    data[bad + 20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError) as err:
        GroupStore(path)
    assert err.value.offset == bad
    assert str(path) in str(err.value) and str(bad) in str(err.value)
    assert path.read_bytes() == bytes(data)  # nothing was truncated


def test_a_complete_last_record_with_a_bad_crc_is_corruption_not_a_torn_tail(tmp_path):
    # The last append was acknowledged (write(2) returned): cutting it off would silently lose a group.
    path = tmp_path / "replay.log"
    _write_groups(path, 5)
    last = record_offsets(path)[-1]
    data = bytearray(path.read_bytes())
    data[last + 20] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match="complete record with a bad CRC") as err:
        GroupStore(path)
    assert err.value.offset == last and "replay fsck" in str(err.value)
    assert path.read_bytes() == bytes(data)


def test_stale_drops_are_counted_by_the_engine_that_made_each_group():
    # all of them, and apart those that arrived below the learner's floor
    buf = ReplayBuffer(GroupStore(None), max_staleness=0)
    for version, engine in ((0, "rollout-0"), (0, "rollout-1"), (1, "rollout-1")):
        g = make_group(version)
        g.engine = engine
        buf.add(g)
    assert buf.make_batch(1, learner_version=1) is not None  # the two of version 0 went stale waiting
    for engine in ("rollout-0", "rollout-1", "rollout-1", ""):
        late = make_group(0)
        late.engine = engine
        assert buf.add(late) is not None  # stored, then dropped on arrival: below the last request's floor
    stats = buf.stats()
    assert stats.stale_dropped_total == 6
    assert stats.stale_dropped_by_engine == {"rollout-0": 2, "rollout-1": 3}  # naming no engine: left out
    assert stats.late_dropped_by_engine == {"rollout-0": 1, "rollout-1": 2}


def test_a_group_naming_no_engine_encodes_as_before():
    # protocol 8 groups (and replay logs) have no engine field: such a group decodes, and one without an engine
    # encodes to the same bytes as before the field existed
    g = make_group(3)
    assert b"engine" not in msgspec.msgpack.encode(g, enc_hook=enc_hook)
    g.engine = "rollout-2"
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(g, enc_hook=enc_hook), type=Group)
    assert back.engine == "rollout-2"


def test_fsck_reports_quarantines_and_rewrites(tmp_path):
    from async_vapo.cli import main as cli
    from async_vapo.replay.store import fsck

    path = tmp_path / "replay.log"
    store = GroupStore(path, fsync="never")
    groups = [make_group(0, uid=f"g{i}") for i in range(6)]
    seqs = [store.append(g) for g in groups]
    store.mark_consumed([seqs[0], seqs[2]], batch_id=1, learner_version=0)  # names a group fsck will lose
    store.close()
    offsets = record_offsets(path)
    data = bytearray(path.read_bytes())
    for victim in (offsets[3], offsets[6]):  # the last payload bytes of the appends of g2 and g5
        data[victim - 1] ^= 0x01  # a letter of the last verdict: the record still decodes, its CRC fails
    data += RECORD_MAGIC_TORN  # and a torn tail: an incomplete last write
    path.write_bytes(bytes(data))
    report = fsck(path)
    assert [d.kind for d in report.damaged] == ["corrupt", "corrupt", "torn_tail"]
    assert report.groups_lost == 2 and report.unidentified_records == 0
    assert [d.records[0].split()[2] for d in report.damaged[:2]] == ["uid=g2", "uid=g5"]
    assert report.dangling_references == 1 and report.live_groups == 3  # g1, g3, g4 (g0 was served)
    assert path.read_bytes() == bytes(data)  # a report only
    assert cli(["replay", "fsck", str(path)]) == 1
    assert cli(["replay", "fsck", str(path), "--apply"]) == 0
    quarantine = list(tmp_path.glob("replay.log.quarantine-*"))
    assert len([q for q in quarantine if q.suffix != ".json"]) == 1
    store = GroupStore(path)
    assert [g.uid for _, g in store.live()] == ["g1", "g3", "g4"]
    assert store.cursor.consumed_total == 1 and store.next_seq == seqs[-1] + 1  # seqs are never reused
    store.close()
    assert fsck(path).clean


def test_not_a_log_file_raises(tmp_path):
    path = tmp_path / "replay.log"
    path.write_bytes(b"hello world, not a log")
    with pytest.raises(CorruptLogError):
        GroupStore(path)


def test_compaction_keeps_exactly_the_live_groups(tmp_path):
    path = tmp_path / "replay.log"
    store = GroupStore(path, fsync="never")
    seqs = [store.append(make_group(i // 4)) for i in range(20)]
    store.mark_consumed(seqs[:8], batch_id=1, learner_version=2)
    store.mark_dropped(seqs[8:13], reason="stale")
    live = dict(store.live())
    assert set(live) == set(seqs[13:])
    before = path.stat().st_size
    store.compact()
    assert path.stat().st_size < before
    assert dict(store.live()) == live
    assert store.append(make_group(5)) == 21
    store.close()

    store = GroupStore(path)
    assert store.recovery.records == 1 + 7 + 1  # snapshot, the live groups, the append after compaction
    assert set(dict(store.live())) == set(seqs[13:]) | {21}
    assert all(store.get(s) == g for s, g in live.items())
    assert store.cursor.batch_id == 1 and store.cursor.consumed_total == 8 and store.cursor.max_consumed_seq == 8
    assert store.dropped_counts == {"stale": 5}
    assert store.served_ages == {2: 4, 1: 4}
    assert store.next_seq == 22
    store.close()


def test_automatic_compaction_and_leftover_temp_file(tmp_path):
    path = tmp_path / "replay.log"
    store = GroupStore(path, fsync="never", compact_min_bytes=0)
    buf = ReplayBuffer(store, max_staleness=0)
    for _ in range(30):
        buf.add(make_group(0))
        buf.make_batch(1, learner_version=0)
    buf.add(make_group(0))
    assert store.size_bytes < 3 * len(FILE_MAGIC) + 4096  # snapshot + at most a few records
    store.close()
    tmp = path.with_name(path.name + ".compact.tmp")
    tmp.write_bytes(b"half-written compaction")
    store = GroupStore(path)
    assert store.recovery.removed_compaction_tmp and not tmp.exists()
    assert len(store) == 1 and store.cursor.batch_id == 30 and store.next_seq == 32
    store.close()


def test_fsync_policies(tmp_path, monkeypatch):
    calls = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))

    def run(policy, **kw):
        calls.clear()
        store = GroupStore(tmp_path / f"{policy}{kw}.log", fsync=policy, **kw)
        calls.clear()  # creation fsyncs the new file and its directory
        seqs = [store.append(make_group(0)) for _ in range(10)]
        appends = len(calls)
        store.mark_consumed(seqs[:1], batch_id=1, learner_version=0)
        consume = len(calls) - appends
        store.close()
        return appends, consume, len(calls) - appends - consume

    assert run("always") == (10, 1, 0)
    assert run("batch", fsync_every=4) == (2, 1, 0)  # at 4 and 8 appends; the consume at once; none pending
    assert run("batch", fsync_every=3) == (3, 1, 0)  # 3, 6, 9; consume syncs the 10th with it
    assert run("never") == (0, 0, 0)
    calls.clear()
    store = GroupStore(tmp_path / "b.log", fsync="batch", fsync_every=100)
    calls.clear()
    store.append(make_group(0))
    assert calls == []
    store.close()
    assert len(calls) == 1  # close syncs what is pending


def test_one_owner_per_log_file(tmp_path):
    path = tmp_path / "replay.log"
    store = GroupStore(path)
    with pytest.raises(StoreLockedError):
        GroupStore(path)
    store.close()
    GroupStore(path).close()


def test_store_rejects_misuse():
    store = GroupStore(None)
    s = store.append(make_group(0))
    with pytest.raises(KeyError):
        store.mark_consumed([s + 1], batch_id=1, learner_version=0)
    store.mark_consumed([s], batch_id=1, learner_version=0)
    with pytest.raises(KeyError):
        store.mark_dropped([s], reason="stale")  # already consumed
    t = store.append(make_group(0))
    with pytest.raises(ValueError):
        store.mark_consumed([t], batch_id=1, learner_version=0)  # batch ids strictly increase


# --- property test: random interleavings against a naive reference model ------------------------


class Reference:
    """The buffer's documented policy, written as plainly as possible."""

    def __init__(self, max_staleness: int, capacity: int):
        self.s, self.capacity = max_staleness, capacity
        self.live: dict[int, int] = {}  # seq -> version
        self.dropped: Counter[str] = Counter()
        self.last_v: int | None = None
        self.last_served_v: int | None = None

    def _oldest(self) -> list[int]:
        return sorted(self.live, key=lambda seq: (self.live[seq], seq))

    def add(self, seq: int, version: int) -> None:
        if self.last_v is not None and self.last_v - version > self.s:
            self.dropped[DROP_STALE] += 1
            return
        self.live[seq] = version
        while len(self.live) > self.capacity:
            del self.live[self._oldest()[0]]
            self.dropped[DROP_OVERFLOW] += 1

    def batch(self, n: int, v: int) -> list[int] | None:
        self.last_v = v
        for seq, version in list(self.live.items()):
            if v - version > self.s or version > v:
                del self.live[seq]
                self.dropped[DROP_STALE if version < v else DROP_FUTURE] += 1
        if len(self.live) < n:
            return None
        chosen = self._oldest()[:n]
        for seq in chosen:
            del self.live[seq]
        self.last_served_v = v
        return chosen

    def restart(self) -> None:
        self.last_v = self.last_served_v


GENERATE = st.tuples(st.just("generate"), st.integers(0, 5), st.integers(1, 3))  # rollout lag, groups
BATCH = st.tuples(st.just("batch"), st.integers(1, 4), st.just(0))  # groups per batch
OPS = st.one_of(
    GENERATE,
    GENERATE,
    BATCH,
    BATCH,
    st.tuples(st.just("generate_invalid"), st.just(0), st.just(0)),
    st.tuples(st.just("restart"), st.just(0), st.just(0)),
    st.tuples(st.just("compact"), st.just(0), st.just(0)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_staleness=st.integers(0, 3),
    capacity=st.integers(2, 10),
    auto_compact=st.booleans(),
    ops=st.lists(OPS, max_size=40),
)
# After a restart, a group that is already stale for the last served learner version is dropped on arrival.
@example(
    max_staleness=0,
    capacity=5,
    auto_compact=False,
    ops=[("generate", 0, 1), ("batch", 1, 0)] * 3 + [("restart", 0, 0), ("generate", 5, 1)],
)
def test_random_interleavings_keep_every_invariant(max_staleness, capacity, auto_compact, ops):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "replay.log"
        compact_min = 0 if auto_compact else 1 << 30

        def open_buffer() -> ReplayBuffer:
            store = GroupStore(path, fsync="never", compact_min_bytes=compact_min)
            return ReplayBuffer(store, max_staleness=max_staleness, group_size=2, capacity_groups=capacity)

        ref = Reference(max_staleness, capacity)
        buf = open_buffer()
        learner_v = 0
        added: dict[int, Group] = {}
        served: list[int] = []
        served_ages: Counter[int] = Counter()
        last_batch_id = 0
        rejected = 0

        def check_batch(batch, n: int) -> None:
            nonlocal learner_v, last_batch_id
            assert batch.batch_id == last_batch_id + 1
            last_batch_id = batch.batch_id
            assert len(batch.groups) == n == len(batch.seqs)
            for seq, group, age, version in zip(batch.seqs, batch.groups, batch.ages, batch.versions, strict=True):
                assert group == added[seq]  # whole, intact, the group stored under that seq
                assert version == group.version and age == learner_v - group.version
                assert 0 <= age <= max_staleness, f"bound broken: age {age} > {max_staleness}"
                assert seq not in served, f"group {seq} served twice"
                served.append(seq)
                served_ages[age] += 1
            assert batch.min_version == min(batch.versions)
            learner_v += 1  # the update is made and published

        for op, a, b in ops:
            if op == "generate":
                for _ in range(b):
                    g = make_group(max(0, learner_v - a), size=2)
                    seq = buf.add(g)
                    assert seq is not None and seq not in added
                    added[seq] = g
                    ref.add(seq, g.version)
            elif op == "generate_invalid":
                assert buf.add(make_group(learner_v, size=3)) is None
                rejected += 1
            elif op == "batch":
                expected = ref.batch(a, learner_v)
                batch = buf.make_batch(a, learner_version=learner_v)
                assert (batch is None) == (expected is None)
                if batch is not None:
                    assert batch.seqs == expected  # FIFO by version, then arrival
                    check_batch(batch, a)
            elif op == "restart":
                buf.store.close()
                buf = open_buffer()
                ref.restart()
                rejected = 0
            elif op == "compact":
                buf.store.compact()
            stats = buf.stats()
            assert stats.stored_groups == len(ref.live)
            assert sorted(s for s, _ in buf.store.live()) == sorted(ref.live)
            assert stats.dropped_total == {k: v for k, v in ref.dropped.items() if v}
            assert stats.age_histogram == dict(served_ages)
            assert stats.max_age_served == (max(served_ages) if served_ages else None)
            assert sum(stats.rejected_total.values()) == rejected
            assert stats.served_groups_total == len(served) and stats.batches_total == last_batch_id

        # Drain: serve what is admissible, then one version jump past the bound drops the rest as stale.
        while (batch := buf.make_batch(1, learner_version=learner_v)) is not None:
            check_batch(batch, 1)
        learner_v += max_staleness + 1
        assert buf.make_batch(1, learner_version=learner_v) is None
        assert len(buf) == 0
        stats = buf.stats()
        never_served = set(added) - set(served)
        assert sum(stats.dropped_total.values()) == len(never_served)  # each unserved group dropped once
        assert stats.added_total == len(added)
        assert stats.served_groups_total == len(served) == len(set(served))
        assert stats.age_histogram == dict(served_ages)
        buf.store.close()


def test_the_learners_min_version_is_the_floor():
    # The replay's own max_staleness (5) would admit all three; the learner's floor (3) is what counts.
    buf = ReplayBuffer(GroupStore(None), max_staleness=5)
    for v in (1, 2, 3):
        buf.add(make_group(v))
    batch = buf.make_batch(1, learner_version=3, min_version=3)
    assert batch is not None and batch.versions == [3]
    assert buf.stats().dropped_total[DROP_STALE] == 2
    buf.add(make_group(2))  # arrives below the floor of the last request: dropped at once
    assert len(buf) == 0 and buf.stats().dropped_total[DROP_STALE] == 3
    with pytest.raises(ValueError, match="above learner_version"):
        buf.make_batch(1, learner_version=3, min_version=4)
