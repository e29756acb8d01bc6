"""The one staleness rule (async_vapo.staleness): its arithmetic, and that the learner is its one reader of the
config."""

import re
from pathlib import Path

import pytest

from async_vapo.staleness import DROP_FUTURE, DROP_STALE, Admission, StalenessPolicy, drop_reason

PACKAGE = Path(__file__).resolve().parents[2] / "async_vapo"


def test_a_batch_for_v_takes_versions_from_v_minus_max_staleness_to_v():
    p = StalenessPolicy(2)
    assert p.floor(10) == 8
    # 7 is stale (age 3 > 2), 8..10 usable (ages 2, 1, 0), 11 is from a future the learner does not have
    assert [p.drop_reason(g, 10) for g in (7, 8, 9, 10, 11)] == [DROP_STALE, None, None, None, DROP_FUTURE]
    assert StalenessPolicy(0).usable(5, 5) and not StalenessPolicy(0).usable(4, 5)  # synchronous: only v itself


def test_the_floor_the_learner_sent_wins_over_the_policys_own():
    assert drop_reason(8, 10, floor=9) == DROP_STALE
    assert StalenessPolicy(5).drop_reason(8, 10, floor=9) == DROP_STALE
    assert StalenessPolicy.from_floor(10, 7).max_staleness == 3


def test_an_engine_may_generate_only_with_weights_the_learner_can_still_use():
    p = StalenessPolicy(1)
    assert p.may_generate(served=4, learner=5) and not p.may_generate(served=3, learner=5)
    # from base 5 serving 5 with a bound of 1: the groups can feed updates from version 5 and 6
    assert p.batches_worth(served=5, base=5) == 2


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="max_staleness"):
        StalenessPolicy(-1)


def test_admission_takes_the_bound_from_the_learners_announces():
    adm = Admission(None, prompts_per_step=4, num_engines=1, refill_s=1e9)
    assert adm.check(served=0, learner=0) == "no_learner"  # nothing before the learner's first announce
    adm.announced(version=0, min_version=-1)  # an announce without a floor: the strictest bound
    assert adm.max_staleness == 0
    adm.announced(version=3, min_version=1)  # the learner's floor says max_staleness = 2
    assert adm.max_staleness == 2 and adm.learner == 3
    assert adm.check(served=0, learner=3) == "stale_weights"  # 0 < 3 - 2
    assert adm.check(served=1, learner=3) is None
    adm.record(1, 4 * 3)  # its share of batches for 1, 2 and 3 (base 3: served 1 counts from there)
    adm.made = adm.budget(1)
    assert adm.check(served=1, learner=3) == "version_budget"
    adm.unmade(1)  # a group aborted in the engine gives its share back
    assert adm.check(served=1, learner=3) is None
    adm.announced(version=2, min_version=0)  # a learner restarted from an older checkpoint: the count restarts
    assert (adm.base, adm.made, adm.learner) == (2, 0, 2)


def test_only_the_learner_reads_the_bound_from_the_config():
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if re.search(r"async_\.max_staleness", p.read_text()))
    assert readers == ["staleness.py"]  # StalenessPolicy.from_config, which the learner calls
    learner = (PACKAGE / "services" / "learner.py").read_text()
    assert "StalenessPolicy.from_config(cfg)" in learner
    for other in ("rollout.py", "replay.py", "verifier.py"):
        assert "from_config" not in re.findall(r"StalenessPolicy\.\w+", (PACKAGE / "services" / other).read_text())
