"""A sharded learner streams a version to the engines' weight groups one bucket at a time
(``learner.sharding.stream_sharded``): one torchrun launch of two gloo CPU ranks (``stream_worker.py``, the tiny
model of the FSDP tests with two decoder layers, ``model.dtype`` bfloat16) and three fake engines on rank 0, the
second of which dies after its first bucket.

Every engine that stays gets exactly the unsharded engine state (``Learner.policy_state``, bit for bit, in its
order and dtypes); rank 0 never holds more gathered bytes at once than the plan's largest bucket; both ranks make
the same number of ``full_tensor()`` calls (one per DTensor per engine), the dead engine's included, so the
engine after it is streamed normally."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import launch_two_ranks  # noqa: E402
from stream_worker import BUCKET_BYTES, ENGINES  # noqa: E402

from async_vapo.weights.collective import _views, plan_buckets, version_meta  # noqa: E402


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    return launch_two_ranks(tmp_path_factory, "stream_worker.py", name="stream")[1]


def test_engines_get_the_unsharded_state_bucket_by_bucket(streamed):
    full = torch.load(streamed / "full.pt")
    assert full and all(v.dtype == torch.bfloat16 for v in full.values() if v.is_floating_point())
    buckets = plan_buckets(version_meta(full.items()), BUCKET_BYTES)
    assert len(buckets) > 2  # the version really went in several buckets
    for engine in ("good-0", "good-1"):
        flats = torch.load(streamed / f"{engine}.pt")
        assert [f.numel() for f in flats] == [b.nbytes for b in buckets]
        got = dict(kv for flat, b in zip(flats, buckets, strict=True) for kv in _views(flat, b))
        assert list(got) == list(full)
        for k, v in full.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert not (streamed / "dying.pt").exists()


def test_rank_0_holds_one_bucket_and_the_ranks_stay_in_step(streamed):
    r0, r1 = (torch.load(streamed / f"stream.{r}") for r in (0, 1))
    assert r0["results"]["good-0"][0] == "float" and r0["results"]["good-1"][0] == "float"
    assert r0["results"]["dying"][0] in ("EngineSyncFailed", "EngineSyncTimeout"), r0["results"]["dying"]
    assert r1["results"] == {}
    assert r0["gathers"] == r1["gathers"] == len(ENGINES) * r0["dtensors"] > 0
    assert 0 < r0["peak_bytes"] <= r0["bucket_bytes"]
    assert 0 < r1["peak_bytes"] <= r1["bucket_bytes"]  # every rank drops each gathered bucket as well
    full_bytes = sum(v.numel() * v.element_size() for v in torch.load(streamed / "full.pt").values())
    assert r0["peak_bytes"] < full_bytes / 2  # one bucket, far from a copy of the model
