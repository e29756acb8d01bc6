"""The cluster's pure bookkeeping: rollout admission control and the learner's rotation of engines
(including the liveness policy's leave and rejoin)."""

from __future__ import annotations

import pytest

from async_vapo.staleness import Admission
from async_vapo.weights import Rotation

# -- admission control ---------------------------------------------------------------------------------------------

def test_admission_with_staleness_zero_is_one_batch_per_version():
    # 2 engines, 8 prompts per update: each engine may generate its share (4 groups) of one batch per version.
    adm = Admission(max_staleness=0, prompts_per_step=8, num_engines=2, refill_s=1e9)
    assert adm.check(served=3, learner=3) is None
    adm.record(3, 4)
    assert adm.check(served=3, learner=3) == "version_budget"
    assert adm.check(served=4, learner=4) is None  # new weights: a new budget


def test_admission_waits_for_weights_beyond_the_bound():
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1)
    assert adm.check(served=5, learner=6) is None  # age 1 at most: usable
    assert adm.check(served=5, learner=7) == "stale_weights"  # could only arrive 2 versions old


def test_admission_budgets_value_pretraining_and_staleness():
    # version 0 feeds 3 pretraining batches and the first update; with max_staleness=1 also the second update.
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, pretrain_batches=3)
    assert adm.check(served=0, learner=0) is None
    assert adm.budget(0) == (3 + 2) * 4
    assert adm.budget(1) == (3 + 3) * 4  # cumulative: one more batch per version


def test_admission_never_makes_a_batch_that_can_only_go_stale():
    # An engine faster than the learner: with a budget per version it made max_staleness + 1 batches of every
    # version while the learner used one, and the rest went stale in the replay. Cumulatively it runs
    # max_staleness batches ahead, then makes one batch per version.
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, refill_s=1e9)
    made = {}
    for v in range(6):  # the learner publishes v; the engine loads it and generates while it may
        while adm.check(served=v, learner=v) is None:
            adm.record(v, 4)
            made[v] = made.get(v, 0) + 1
    assert made == {0: 2, 1: 1, 2: 1, 3: 1, 4: 1, 5: 1}
    # the learner's update at version u takes the u-th batch, of version max(0, u - 1): age 1 at most
    order = [v for v in sorted(made) for _ in range(made[v])]
    assert all(u - order[u] <= 1 for u in range(len(order)))


def test_admission_counts_from_the_version_an_engine_joins_at():
    # an engine (re)started while the learner is at version 10 fills the pipeline once, then one batch a version
    adm = Admission(max_staleness=2, prompts_per_step=6, num_engines=2, pretrain_batches=5, refill_s=1e9)
    assert adm.check(served=10, learner=10) is None
    assert adm.budget(10) == 3 * 3  # max_staleness + 1 batches of its 3-group share; no pretraining after 0
    adm.record(10, 9)
    assert adm.check(served=10, learner=10) == "version_budget"
    assert adm.check(served=11, learner=11) is None


def test_admission_starts_again_from_a_version_the_learner_rolled_back_to():
    # the learner published 5 and 6, the engine spent its budget, then the learner restarted from checkpoint 4:
    # its versions 5 and 6 are new weights, which need their groups (without waiting for a refill)
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, refill_s=1e9)
    adm.check(served=4, learner=4)
    for v in (4, 5, 6):
        while adm.check(served=v, learner=v) is None:
            adm.record(v, 4)
    assert adm.check(served=6, learner=6) == "version_budget"
    adm.rolled_back(4)
    assert adm.check(served=4, learner=4) is None
    adm.record(4, 8)
    assert adm.check(served=4, learner=4) == "version_budget"
    assert adm.check(served=5, learner=5) is None


def test_groups_that_reached_the_replay_stale_give_their_share_back():
    # one engine, staleness 1, its budget spent at version 3; the learner's heartbeats then count 3 of its groups
    # that reached the replay already stale (long responses that finished after the learner had moved past them):
    # they are made again, once, however often the same counts are repeated
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, refill_s=1e9)
    for v in (0, 1, 2, 3):
        while adm.check(served=v, learner=v) is None:
            adm.record(v, 1)
    assert adm.check(served=3, learner=3) == "version_budget"
    assert adm.dropped(0, 0) == 0  # the first counts heard set where counting starts
    assert adm.dropped(3, 3) == 3 and adm.dropped(3, 3) == 0
    for _ in range(3):
        assert adm.check(served=3, learner=3) is None
        adm.record(3, 1)
    assert adm.check(served=3, learner=3) == "version_budget"
    # a restarted learner counts from 0: its counts are all new
    assert adm.dropped(1, 1) == 1 and adm.given_back == {"late": 4, "waited": 0}
    assert adm.check(served=3, learner=3) is None


def test_groups_that_went_stale_waiting_come_back_when_the_learner_is_short():
    # staleness 1: 2 groups made for version 4's window went stale waiting (weights loaded late). Nothing is given
    # back until the learner reports a wait while the budget is spent; then those 2, once.
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, refill_s=1e9)
    for v in range(6):
        while adm.check(served=v, learner=v) is None:
            adm.record(v, 1)
    adm.dropped(0, 0)
    assert adm.dropped(2, 0) == 0 and adm.waited_pending == 2
    assert adm.check(served=5, learner=5) == "version_budget"  # the learner has not waited: maybe surplus
    adm.learner_waiting(0.2)  # a wait shorter than short_wait_s says nothing
    assert adm.check(served=5, learner=5) == "version_budget"
    adm.learner_waiting(0.8)
    assert adm.check(served=5, learner=5) is None and adm.given_back["waited"] == 2
    adm.record(5, 1)
    assert adm.check(served=5, learner=5) is None  # the second one
    adm.record(5, 1)
    adm.learner_waiting(0.8)
    assert adm.check(served=5, learner=5) == "version_budget" and adm.waited_pending == 0


def test_with_staleness_zero_a_group_left_to_go_stale_is_never_made_again():
    # synchronous: the learner waits for every batch, and a group it did not take is surplus
    adm = Admission(max_staleness=0, prompts_per_step=4, num_engines=1, refill_s=1e9)
    adm.record(0, 4)
    adm.dropped(0, 0)
    adm.dropped(2, 0)
    adm.learner_waiting(3.0)
    assert adm.check(served=0, learner=0) == "version_budget" and adm.given_back["waited"] == 0


def test_late_drops_of_an_earlier_process_are_not_given_back():
    adm = Admission(max_staleness=0, prompts_per_step=4, num_engines=1, refill_s=1e9)
    adm.record(0, 4)
    assert adm.dropped(7, 7) == 0 and adm.made == 4  # an engine that just (re)started hears 7 old drops
    assert adm.dropped(8, 8) == 1 and adm.made == 3


def test_a_refilled_share_that_goes_stale_is_not_made_again():
    # staleness 0: the learner was only slow, a refill made a second share of version 0, and the learner used one;
    # the other goes stale. Given back, every later version would again make a share that goes stale.
    adm = Admission(max_staleness=0, prompts_per_step=4, num_engines=1, refill_s=10.0)
    adm.versions_changed(now=0.0)
    adm.record(0, 4)
    assert adm.check(0, 0, now=11.0) is None and adm.refills == 1
    adm.record(0, 4)
    adm.dropped(0, 0)
    adm.versions_changed(now=20.0)
    assert adm.dropped(4, 4) == 0 and adm.refill_absorbed == 4  # the refill's surplus, even arriving late
    assert adm.check(1, 1, now=21.0) is None  # version 1: one share, as without the refill
    adm.record(1, 4)
    assert adm.check(1, 1, now=22.0) == "version_budget"
    assert adm.dropped(6, 6) == 2  # beyond the refilled share: lost groups, made again
    assert adm.check(1, 1, now=23.0) is None


def test_admission_refills_a_spent_budget_after_a_quiet_period():
    adm = Admission(max_staleness=0, prompts_per_step=4, num_engines=1, refill_s=10.0)
    adm.versions_changed(now=100.0)
    adm.record(0, 4)
    assert adm.check(0, 0, now=105.0) == "version_budget"
    assert adm.check(0, 0, now=111.0) is None  # groups were lost somewhere: one more share
    adm.record(0, 4)
    assert adm.check(0, 0, now=112.0) == "version_budget"


def test_a_slow_learner_does_not_trigger_the_refill():
    # updates every 100 s from version 1 on (version 0's interval, with value pretraining, is longer and not counted)
    adm = Admission(max_staleness=0, prompts_per_step=4, num_engines=1, refill_s=60.0)
    adm.announced(0, 0, now=0.0)
    adm.announced(1, 1, now=500.0)
    assert adm.refill_after_s == 60.0
    adm.announced(2, 2, now=600.0)
    assert adm.version_interval_s == 100.0 and adm.refill_after_s == 200.0
    adm.announced(3, 3, now=650.0)  # a faster update does not shorten the wait
    assert adm.refill_after_s == 200.0
    adm.record(3, 4)
    assert adm.check(3, 3, now=720.0) == "version_budget"  # past refill_s, but the learner is only slow
    assert adm.check(3, 3, now=851.0) is None and adm.refills == 1  # twice its slowest update: groups were lost


def _at_its_budget() -> Admission:
    """One engine that has made its whole budget of version 0 (at t = 95), the learner at version 0."""
    adm = Admission(max_staleness=1, prompts_per_step=4, num_engines=1, refill_s=60.0, starved_s=10.0)
    adm.versions_changed(now=90.0)
    while adm.check(served=0, learner=0, now=95.0) is None:
        adm.record(0, 4)
    return adm


def test_admission_makes_up_lost_groups_as_soon_as_the_learner_reports_starving():
    # one engine at its budget; the groups it shipped at t=100 were lost downstream (a verifier died holding them)
    adm = _at_its_budget()
    adm.shipped(now=100.0)
    # waiting, but those groups may still be on their way: not yet
    adm.learner_waiting(12.0, now=105.0)
    assert adm.check(0, 0, now=105.0) == "version_budget"
    # the learner has waited 10 s by the time 10 s have passed since the shipment: one more share at once
    adm.learner_waiting(3.0, now=111.0)  # a wait shorter than starved_s says nothing
    assert adm.check(0, 0, now=111.0) == "version_budget"
    adm.learner_waiting(10.5, now=111.0)
    assert adm.check(0, 0, now=111.0) is None and adm.refills == 1
    adm.record(0, 4)
    assert adm.check(0, 0, now=111.5) == "version_budget"  # one share per report
    adm.shipped(now=118.0)
    adm.versions_changed(now=119.0)  # a new version: the learner got its batch; any earlier report is void
    adm.learner_waiting(0.0, now=120.0)
    assert not adm.starving


def test_admission_does_not_take_a_wait_its_own_evaluation_caused_for_lost_groups():
    # the hour-long SmolLM2 services runs: one refill per held-out evaluation, each share dropped stale later
    adm = _at_its_budget()
    adm.shipped(now=100.0)
    # the engine evaluates from 100 to 140; the learner took the groups, and has waited since 110
    adm.resumed(now=140.0)
    adm.learner_waiting(30.0, now=141.0)
    assert adm.check(0, 0, now=141.0) == "version_budget" and adm.refills == 0
    # the wait goes on starved_s after the evaluation with nothing shipped: now groups were lost
    adm.learner_waiting(40.5, now=150.5)
    assert adm.check(0, 0, now=150.5) is None and adm.refills == 1


def test_admission_waits_for_its_groups_in_flight_before_a_refill():
    # a continuous engine slower than the learner: its budget started, the groups still being generated
    adm = _at_its_budget()
    adm.shipped(now=96.0)
    adm.learner_waiting(15.0, now=110.0)  # starving by the report alone
    assert adm.starving
    assert adm.check(0, 0, now=110.0, in_flight=3) == "version_budget"  # they are on their way
    adm.shipped(now=112.0)  # they left: the report before says nothing about them
    assert not adm.starving and adm.check(0, 0, now=112.0) == "version_budget"
    adm.learner_waiting(26.0, now=123.0)  # still waiting 10 s after: those were lost too
    assert adm.check(0, 0, now=123.0) is None and adm.refills == 1


# -- rotation ------------------------------------------------------------------------------------------------------

def test_rotation_after_a_learner_restarted_from_an_older_checkpoint():
    # a restarted learner at version 20; the engine still serves 22 of the lineage that died, then follows it down
    rot = Rotation(ack_timeout_s=60.0)
    rot.published(20, now=0.0)
    assert rot.on_ack("rollout-0", 22, True, now=0.1) == ([(20, 0.1)], True)  # it serves, and is in
    assert rot.on_ack("rollout-0", 20, True, now=0.2) == ([], False)  # loaded the restarted learner's 20
    rot.published(21, now=1.0)
    assert rot.on_ack("rollout-0", 20, True, now=1.1) == ([], False)  # its 22 was other weights: 21 waits
    assert rot.on_ack("rollout-0", 21, True, now=1.5) == ([(21, 0.5)], False)


def test_rotation_counts_a_version_when_every_member_acked():
    rot = Rotation(ack_timeout_s=10.0)
    rot.published(0, now=0.0)
    assert rot.on_ack("rollout-0", 0, True, now=0.5) == ([(0, 0.5)], True)
    assert rot.on_ack("rollout-1", 0, True, now=0.6) == ([], True)
    rot.published(1, now=1.0)
    assert rot.on_ack("rollout-0", 1, True, now=1.5) == ([], False)  # rollout-1 has not acked yet
    counted, _ = rot.on_ack("rollout-1", 1, True, now=2.0)
    assert counted == [(1, 1.0)]


def test_rotation_drops_a_late_engine_and_takes_it_back_on_the_latest():
    rot = Rotation(ack_timeout_s=5.0)
    rot.published(0, now=0.0)
    rot.on_ack("a", 0, True, now=0.1)
    rot.on_ack("b", 0, True, now=0.1)
    rot.published(1, now=1.0)
    rot.on_ack("a", 1, True, now=1.1)
    assert rot.expire(now=3.0) == []
    assert rot.expire(now=6.5) == ["b"]
    assert rot.members == {"a"}
    rot.published(2, now=7.0)
    assert rot.on_ack("a", 2, True, now=7.2) == ([(2, pytest.approx(0.2))], False)  # b no longer holds it up
    assert rot.on_ack("b", 1, True, now=7.3) == ([], False)  # catching up, not on the latest yet
    assert rot.on_ack("b", 2, False, now=7.4) == ([], False)  # a failed load does not rejoin
    assert rot.on_ack("b", 2, True, now=7.5) == ([], True)
    assert rot.members == {"a", "b"}


def test_rotation_leave_for_silence_and_rejoin_on_the_latest():
    rot = Rotation(ack_timeout_s=100.0)
    rot.published(0, now=0.0)
    rot.on_ack("a", 0, True, now=0.1)
    rot.on_ack("b", 0, True, now=0.1)
    assert rot.leave("b") and not rot.leave("b")  # silent: out once, counted once
    rot.published(1, now=1.0)
    assert rot.on_ack("a", 1, True, now=1.1) == ([(1, pytest.approx(0.1))], False)  # b holds nothing up
    assert rot.on_ack("b", 0, True, now=1.2) == ([], False)  # back, but serving an old version: not yet in
    assert rot.on_ack("b", 1, True, now=1.3) == ([], True)
    assert rot.members == {"a", "b"}
