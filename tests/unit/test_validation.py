"""Validation at the trust boundaries: what the replay refuses to store, the batch requests it refuses to act
on, and the groups the learner refuses to train on."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
import torch
from conftest import FAST, SourceBase, _groups

from async_vapo.config import load_config
from async_vapo.replay import GroupStore, ReplayBuffer
from async_vapo.replay.buffer import DROP_STALE, GroupLimits, validate_group
from async_vapo.types import Group, Trajectory

LIMITS = GroupLimits(group_size=2, vocab_size=100, rewards=frozenset({1.0, -1.0}), reward_correct=1.0)


def group(uid: str = "g", version: int = 0, **sample) -> Group:
    base = dict(response_ids=[5, 6, 7], behavior_logprobs=[-0.5, -0.1, -2.0], finish_reason="stop", reward=1.0,
                correct=True, verdict="correct")
    samples = [Trajectory(**(base | sample)), Trajectory(**(base | {"reward": -1.0, "correct": False}))]
    return Group(uid=uid, prompt="1+1=", answer="2", prompt_ids=[1, 2, 3], version=version, samples=samples)


BAD = {
    "token_out_of_vocab": group(response_ids=[5, 6, 100], behavior_logprobs=[-1.0] * 3),
    "negative token": group(response_ids=[5, -1, 7]),
    "nan log-prob": group(behavior_logprobs=[-0.5, float("nan"), -1.0]),
    "inf log-prob": group(behavior_logprobs=[-0.5, -math.inf, -1.0]),
    "positive log-prob": group(behavior_logprobs=[-0.5, 0.3, -1.0]),
    "nan reward": group(reward=float("nan")),
    "reward outside the set": group(reward=1e9),
    "correct without the correct reward": group(reward=-1.0, correct=True),
    "finish reason": group(finish_reason="whatever"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_replay_refuses_what_the_learner_cannot_train_on(case):
    buf = ReplayBuffer(GroupStore(None), max_staleness=1, limits=LIMITS)
    assert buf.add(BAD[case]) is None
    assert len(buf) == 0 and sum(buf.stats().rejected_total.values()) == 1
    assert buf.add(group()) is not None  # a good group still goes in


def test_prompt_tokens_are_checked_too():
    g = msgspec.structs.replace(group(), prompt_ids=[1, 2, 300])
    assert validate_group(g, limits=LIMITS) == "token_out_of_vocab"
    assert validate_group(group(), limits=LIMITS) is None


def test_duplicates_and_versions_beyond_the_learner_are_refused():
    buf = ReplayBuffer(GroupStore(None), max_staleness=2, limits=LIMITS)
    assert buf.add(group("a", 0)) is not None
    assert buf.add(group("a", 0)) is None  # the same message again (a retry, a replay of captured traffic)
    assert buf.stats().rejected_total == {"duplicate_uid": 1}
    assert buf.add(group("a", 1)) is not None  # the same prompt from newer weights is another group
    assert buf.make_batch(1, learner_version=3, min_version=1) is not None  # the learner is at version 3
    assert buf.add(group("b", 4)) is not None  # newest + 1: published, not yet asked for
    assert buf.add(group("c", 5)) is None
    assert buf.stats().rejected_total["version_out_of_range"] == 1


def test_a_batch_request_for_a_far_future_version_is_never_acted_on():
    buf = ReplayBuffer(GroupStore(None), max_staleness=1, limits=LIMITS)
    for v in (0, 0, 1):
        buf.add(group(f"u{len(buf)}", v))
    assert buf.request_error(2, 10**9, 10**9 - 1) == "future_version"  # would drop every group as stale
    assert buf.request_error(2, 1, 2) == "bad_version"
    assert buf.request_error(10**6, 1, 0) == "bad_group_count"
    assert buf.request_error(2, 2, 1) is None  # newest stored (1) + 1
    assert len(buf) == 3 and buf.stats().dropped_total.get(DROP_STALE, 0) == 0


class _Source(SourceBase):
    """Two groups per call; the second carries ``poison`` in its first sample."""

    def __init__(self, tok, poison: dict):
        self.tok, self.poison, self.calls = tok, poison, 0

    def next_groups(self, n):
        self.calls += 1
        good, bad = _groups(self.tok)
        bad = msgspec.structs.replace(bad, samples=[msgspec.structs.replace(bad.samples[0], **self.poison),
                                                    *bad.samples[1:]])
        return [good, bad], {}


@pytest.mark.parametrize("poison", [{"behavior_logprobs": [float("nan")] * 3}, {"reward": float("inf")},
                                    {"response_ids": [10**6, 1, 2]}], ids=["nan_logprob", "inf_reward", "token"])
def test_the_learner_refuses_groups_it_cannot_train_on(tmp_path, poison):
    from transformers import AutoTokenizer

    from async_vapo.learner.loop import StepLoop
    from async_vapo.learner.vapo import Learner
    from async_vapo.metrics.jsonl import JsonlWriter
    from async_vapo.models.base_model import ensure_base_model

    if "response_ids" in poison or "behavior_logprobs" in poison:
        n = len(poison.get("response_ids", poison.get("behavior_logprobs")))
        poison.setdefault("behavior_logprobs", [-1.0] * n)
        poison.setdefault("response_ids", [1] * n)
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "train.total_steps=2", "train.checkpoint_every=0"])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    learner = Learner(cfg, base)
    loop = StepLoop(cfg, learner, _Source(tok, poison), pad_id=tok.pad_token_id, run_dir=tmp_path,
                    log_writer=JsonlWriter(tmp_path / "metrics.jsonl"))
    loop.run()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["learner/invalid_groups"] for r in rows] == [1, 1]
    assert [r["groups_kept"] for r in rows] == [1, 1]  # the good group of each call was trained on
    assert all(math.isfinite(r["actor/pg_loss"]) for r in rows)
    assert all(torch.isfinite(p).all() for p in learner.policy.parameters())
    assert sum(loop.invalid_groups.values()) == 2
