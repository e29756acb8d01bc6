"""The learner service with a LoRA policy sharded over two gloo CPU ranks (``lora_publish_worker.py``): every version
reaches its announce as the adapter alone, a PEFT directory the engines check and load, which holds the learner's
adapter of that version, whichever rank holds which shard. About 20 s here."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import launch_two_ranks  # noqa: E402

from async_vapo.models import lora  # noqa: E402


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    _, out = launch_two_ranks(tmp_path_factory, "lora_publish_worker.py", name="publish")
    return torch.load(out / "published.pt", weights_only=False), [
        torch.load(out / f"adapter.{r}", weights_only=False) for r in (0, 1)]


def test_each_version_of_a_sharded_lora_learner_is_announced_as_its_adapter(published):
    res, (a0, a1) = published
    announced = res["announced"]
    assert sorted(announced) == [0, 1, 2] and [r["version"] for r in res["rows"]] == [1, 2]
    for got in announced.values():
        assert got["transfer"] == "adapter" and got["files"] == sorted([lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS])
        assert all(".lora_A." in k or ".lora_B." in k for k in got["tensors"])  # no base weight is ever sent
    # version 0 is the fresh adapter (B = 0: the base model), version 2 the learner's adapter after both updates
    assert all(torch.count_nonzero(t) == 0 for k, t in announced[0]["tensors"].items() if ".lora_B." in k)
    assert a0.keys() == a1.keys() == announced[2]["tensors"].keys()
    for k, t in announced[2]["tensors"].items():
        assert torch.equal(t, a0[k]) and torch.equal(a0[k], a1[k]), k
    moved = [k for k in a0 if not torch.equal(announced[1]["tensors"][k], announced[2]["tensors"][k])]
    assert moved  # the second update changed the adapter that went out
    assert all(r["time/weight_push_s"] > 0 for r in res["rows"])
