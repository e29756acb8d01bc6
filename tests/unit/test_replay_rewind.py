"""The replay's rewind: groups served after what a learner's weights include (it restarted from a checkpoint, or a
reply was lost) are read back from the log and stored again, once each, durably; the next batches serve them or
drop them with a reason; groups compaction removed are counted as lost."""

from __future__ import annotations

from collections import Counter

from async_vapo.replay import DROP_FUTURE, DROP_STALE, GroupStore, ReplayBuffer
from async_vapo.types import Group, Trajectory


def _group(uid: str, version: int) -> Group:
    samples = [Trajectory(response_ids=[3, 4, len(uid)], behavior_logprobs=[-0.1, -0.2, -0.3], finish_reason="stop",
                          reward=1.0 if i % 2 else -1.0, correct=bool(i % 2), verdict="ok") for i in range(2)]
    return Group(uid=uid, prompt="1+1=", answer="2", prompt_ids=[1, 2], version=version, samples=samples)


def _key(g: Group) -> tuple:
    return g.uid, g.version, tuple(tuple(s.response_ids) for s in g.samples)


def _buffer(path, staleness: int = 1) -> ReplayBuffer:
    return ReplayBuffer(GroupStore(path, fsync="never"), max_staleness=staleness, group_size=2)


def test_a_learner_restarted_from_a_checkpoint_gets_the_groups_it_lost(tmp_path):
    buf = _buffer(tmp_path / "groups.log")

    def add(v: int) -> None:  # the engines' groups of version v arrive once the learner has published v
        for k in range(2):
            buf.add(_group(f"p{v}{k}", v))

    add(0)
    b1 = buf.make_batch(2, learner_version=0)  # update 1 (checkpointed: cursor 2)
    add(1)
    b2 = buf.make_batch(2, learner_version=1)  # update 2 (lost with the learner)
    add(2)
    assert [g.uid for g in b1.groups] == ["p00", "p01"] and [g.uid for g in b2.groups] == ["p10", "p11"]
    assert buf.rewind(-1) == (0, 0) and buf.rewind(4) == (0, 0)  # unknown / everything received: nothing to do
    # the learner resumes at version 1 with cursor 2: batch 2's groups come back, and are served again
    assert buf.rewind(2) == (2, 0)
    again = buf.make_batch(2, learner_version=1)
    assert [_key(g) for g in again.groups] == [_key(g) for g in b2.groups]
    assert buf.store.cursor.consumed_total == 6  # the cursor counts every serving: it never goes back
    # that reply is lost and the request repeated with cursor 2: batch 2 and its repeat hold the same groups, which
    # are stored once; a second repeat finds them live and stores nothing
    assert buf.rewind(2) == (2, 0)
    assert buf.rewind(2) == (0, 0)
    assert Counter(g.uid for _, g in buf.store.live()) == {"p10": 1, "p11": 1}
    assert buf.stats().dropped_total == {DROP_FUTURE: 2}  # version 2: weights the resumed learner never made


def test_rewound_groups_are_durable_and_out_of_bound_ones_are_dropped_with_a_reason(tmp_path):
    path = tmp_path / "groups.log"
    buf = _buffer(path)
    for v in range(4):  # four updates of one group each, at learner versions 0..3
        buf.add(_group(f"p{v}", v))
        assert [g.version for g in buf.make_batch(1, learner_version=v).groups] == [v]
    assert buf.rewind(1) == (3, 0)  # a learner back at version 1 (checkpoint after update 1): groups of 1, 2, 3
    buf.store.close()
    buf = _buffer(path)  # the replay restarts: the groups stored again are in the log
    assert sorted(g.version for _, g in buf.store.live()) == [1, 2, 3]
    batch = buf.make_batch(1, learner_version=1, min_version=0)
    assert [g.version for g in batch.groups] == [1]
    assert buf.stats().dropped_total == {DROP_FUTURE: 2}  # made by weights the resumed learner no longer has
    buf.add(_group("late", 0))
    assert buf.rewind(4) == (1, 0)  # the group of version 1 again; at version 3 it is too old
    assert buf.make_batch(1, learner_version=3) is None
    assert buf.stats().dropped_total[DROP_STALE] == 2  # it, and the late group of version 0


def test_groups_compacted_away_are_counted_as_lost(tmp_path):
    buf = _buffer(tmp_path / "groups.log")
    for k in range(4):
        buf.add(_group(f"p{k}", 0))
    buf.make_batch(2, learner_version=0)
    buf.store.compact()  # the log keeps a snapshot and the 2 live groups: the served ones are gone from it
    buf.make_batch(2, learner_version=0)
    assert buf.rewind(0) == (2, 2)
    assert sorted(g.uid for _, g in buf.store.live()) == ["p2", "p3"]
