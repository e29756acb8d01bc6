"""The learner service's publish loop with a sharded policy and weight groups (``cluster.weights.transfer =
"dist"``): one torchrun launch of two gloo CPU ranks (``publish_worker.py``, the tiny model of the FSDP tests with
two decoder layers, ``model.dtype`` bfloat16) running ``LearnerService.publish_all`` (directly and as the step
loop's hook) and ``publish_again`` through its ``WeightBroadcast``, with a weight group's engine end
(``rollout-0``) and an engine without a group (``rollout-1``) on rank 0.

* A version that every engine takes over its group is streamed one gathered bucket at a time: ``rollout-0`` gets
  exactly the engine state (``Learner.policy_state``, bit for bit, in its order and dtypes), rank 0 never holds more
  than one bucket of gathered bytes, and no slot holds the version; the step loop's rows carry the push seconds and
  that peak.
* Before any engine is known, and once ``rollout-1`` (no group) is, the version is gathered whole on rank 0 in one
  walk, written to the slot, which ``rollout-1`` maps or fetches exactly, and ``rollout-0`` is streamed from it:
  every rank makes one walk's ``full_tensor()`` calls, not one per way.
* ``rollout-1`` failing to load a streamed-only version makes rank 0's idle work answer ``REPUBLISH`` while its replay
  source waits; every rank publishes the version again, whole, to the slot, and ``rollout-0`` is not streamed it again.

About 40 s here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import launch_two_ranks  # noqa: E402
from publish_worker import BUCKET_BYTES  # noqa: E402

from async_vapo.weights.collective import plan_buckets, version_meta  # noqa: E402


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    from conftest import free_ports

    [port] = free_ports(1)
    _, out = launch_two_ranks(tmp_path_factory, "publish_worker.py", port, name="publish")
    return (torch.load(out / "published.pt", weights_only=False),
            *(torch.load(out / f"figures.{r}", weights_only=False) for r in (0, 1)))


def _exact(got: dict, ref: dict) -> None:
    assert got is not None and list(got) == list(ref)
    for k, v in ref.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_streamed_versions_reach_the_group_exactly_one_bucket_at_a_time(published):
    res, r0, r1 = published
    refs = res["refs"]
    assert all(v.dtype == torch.bfloat16 for v in refs[1].values() if v.is_floating_point())
    assert not torch.equal(next(iter(refs[1].values())), next(iter(refs[2].values())))  # two different versions
    full = res["full_bytes"]
    for v in (1, 2):
        a = res["announces"][v]
        assert a == {"version": v, "location": "", "dist_engines": ["rollout-0"]}
        _exact(res["engine"][v], refs[v])
        assert not res["held"][v] and res["slot"][v] is None  # no slot: nowhere a whole copy
        assert not r0[v]["whole"] and r0[v]["streamed"] == ["rollout-0"]
        assert r0[v]["walks"] == r1[v]["walks"] == 1
        assert r0[v]["gathers"] == r1[v]["gathers"] == r0["dtensors"] > 0
        # one bucket (the plan's largest: a tensor larger than BUCKET_BYTES is a bucket of its own), far from the
        # model
        assert len(plan_buckets(version_meta(refs[v].items()), BUCKET_BYTES)) > 2
        assert 0 < r0[v]["peak_bytes"] <= r0[v]["bucket_bytes"] < full / 4
        assert 0 < r1[v]["peak_bytes"] <= r1[v]["bucket_bytes"]
        row = res["rows"][v]
        assert row["learner/weight_gather_peak_bytes"] == r0[v]["peak_bytes"] and row["time/weight_push_s"] > 0


def test_the_step_loop_publishes_each_update_on_every_rank(published):
    res, r0, r1 = published
    rows = res["loop_rows"]
    assert [r["version"] for r in rows if r["kind"] == "train"] == [3, 4]
    for v in (3, 4):
        assert res["announces"][v] == {"version": v, "location": "", "dist_engines": ["rollout-0"]}
    _exact(res["engine"][4], res["refs"][4])  # the weights the loop's last update made
    assert not torch.equal(res["engine"][3]["model.norm.weight"], res["engine"][4]["model.norm.weight"])
    for row in rows:
        assert row["time/weight_push_s"] > 0
        assert 0 < row["learner/weight_gather_peak_bytes"] <= r0["loop"]["bucket_bytes"]
    assert r0["loop"]["walks"] == r1["loop"]["walks"] == 1 and not r0["loop"]["whole"]


def test_a_version_an_engine_needs_whole_is_built_from_the_one_walk(published):
    res, r0, r1 = published
    refs = res["refs"]
    full = res["full_bytes"]
    for v in (0, 5):
        a = res["announces"][v]
        assert a["location"] and res["held"][v]
        _exact(res["slot"][v], refs[v])  # an engine on this host maps it
        _exact(res["fetched"][v], refs[v])  # one elsewhere fetches it
        assert r0[v]["whole"] and r0[v]["walks"] == r1[v]["walks"] == 1
        assert r0[v]["gathers"] == r1[v]["gathers"] == r0["dtensors"]  # one walk for the slot and the group both
        assert r0[v]["peak_bytes"] > full / 2  # rank 0 holds the whole version, only in this case
        assert 0 < r1[v]["peak_bytes"] <= r1[v]["bucket_bytes"]  # the other ranks still drop each bucket
    assert res["announces"][0]["dist_engines"] == []  # no engine yet
    assert res["announces"][5]["dist_engines"] == ["rollout-0"]
    _exact(res["engine"][5], refs[5])  # streamed from the version built for rollout-1
    assert r0[5]["streamed"] == ["rollout-0"]


def test_an_engine_that_cannot_load_a_streamed_only_version_gets_it_again_whole(published):
    res, r0, r1 = published
    assert "streamed over the engines' weight groups only" in res["unavailable"]
    assert res["needs_whole"]
    assert r0["source"] is None and r1["source"] is None  # REPUBLISH served while the source waited, then stop
    again = res["announces"]["4 again"]
    assert again["version"] == 4 and again["location"] and again["dist_engines"] == []
    assert "4 again" not in res["engine"]  # rollout-0 has version 4 already
    _exact(res["slot"]["4 again"], res["refs"][4])
    _exact(res["fetched"]["4 again"], res["refs"][4])
    assert r0["again"]["whole"] and r0["again"]["walks"] == r1["again"]["walks"] == 1
