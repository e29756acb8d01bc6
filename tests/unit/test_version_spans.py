"""A version for every token: the spans on the wire (protocol 8), their validation at the replay, and logs written
before them."""

import msgspec
import pytest

from async_vapo.replay.buffer import REJECT_SPANS, validate_group
from async_vapo.transport.messages import PROTOCOL_VERSION
from async_vapo.types import Group, Trajectory, enc_hook, spans_error, token_versions


def _traj(n: int, spans=()) -> Trajectory:
    return Trajectory(response_ids=list(range(1, n + 1)), behavior_logprobs=[-0.5] * n, finish_reason="stop",
                      version_spans=list(spans))


def _group(version: int, *samples: Trajectory) -> Group:
    return Group(uid="u", prompt="p", answer="a", prompt_ids=[1, 2], version=version, samples=list(samples))


def test_each_token_gets_the_version_of_its_span():
    # 6 tokens: 0-1 by version 3, 2-4 by version 4, 5 by version 6
    assert token_versions(_traj(6, [(3, 0), (4, 2), (6, 5)]), default=0) == [3, 3, 4, 4, 4, 6]
    assert token_versions(_traj(3), default=7) == [7, 7, 7]  # no spans: the group's version throughout
    g = _group(3, _traj(6, [(3, 0), (4, 2)]), _traj(2))
    assert g.token_versions(0) == [3, 3, 4, 4, 4, 4] and g.token_versions(1) == [3, 3]
    assert g.spans_of(1) == [(3, 0)]


def test_spans_survive_the_wire_and_a_log_written_before_them_still_decodes():
    g = _group(3, _traj(4, [(3, 0), (5, 1)]))
    raw = msgspec.msgpack.Encoder(enc_hook=enc_hook).encode(g)
    back = msgspec.msgpack.decode(raw, type=Group)
    assert back.samples[0].version_spans == [(3, 0), (5, 1)]
    # a record of protocol 7 has no version_spans key at all
    old = {"uid": "u", "prompt": "p", "answer": "a", "prompt_ids": [1, 2], "version": 2,
           "samples": [{"response_ids": [5, 6], "behavior_logprobs": [-1.0, -1.0], "finish_reason": "stop"}]}
    before = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=Group)
    assert before.samples[0].version_spans == [] and before.token_versions(0) == [2, 2]
    assert PROTOCOL_VERSION >= 8


@pytest.mark.parametrize("spans,error", [
    ([(3, 1)], "token 0"),
    ([(3, 0), (3, 2)], "increase"),
    ([(3, 0), (4, 0)], "increase"),
    ([(4, 0), (3, 2)], "increase"),
    ([(3, 0), (4, 9)], "past the response"),
    ([(2, 0)], "older than the group"),
])
def test_malformed_spans_are_named_and_refused_at_the_replay(spans, error):
    t = _traj(4, spans)
    assert error in spans_error(t, group_version=3)
    assert validate_group(_group(3, t)) == REJECT_SPANS


def test_a_group_is_as_old_as_its_oldest_token():
    ok = _group(3, _traj(4, [(3, 0), (4, 2)]), _traj(4, [(4, 0)]))
    assert validate_group(ok) is None
    claims_newer = _group(4, _traj(4, [(4, 0)]), _traj(4, [(5, 0)]))
    assert validate_group(claims_newer) is None
    hides_an_old_token = _group(4, _traj(4, [(4, 0), (5, 2)]))
    assert validate_group(hides_an_old_token) is None  # its oldest token is 4: fine
    understated = _group(2, _traj(4, [(3, 0), (4, 2)]))
    assert validate_group(understated) == REJECT_SPANS  # says 2, its oldest token is 3


def test_token_lags_count_each_token_by_the_weights_that_sampled_it():
    from async_vapo.staleness import token_lags

    # learner at 5; sample 0: 2 tokens of 3, 2 of 5; sample 1: 3 tokens of 3 (group version 3)
    g = _group(3, _traj(4, [(3, 0), (5, 2)]), _traj(3))
    got = token_lags([g], learner_version=5)
    assert got["by_lag"] == {"0": 2, "1": 0, "2": 5, "3+": 0}
    assert got["max"] == 2 and got["mean"] == (2 * 0 + 5 * 2) / 7 and got["multi_version_frac"] == 0.5


def test_the_learners_batch_carries_each_tokens_version_and_its_lag_reaches_the_mismatch_split():
    import torch

    from async_vapo.algo.mismatch import mismatch_metrics
    from async_vapo.learner.vapo import make_rollout_batch

    g = _group(3, _traj(4, [(3, 0), (5, 2)]), _traj(2))
    batch = make_rollout_batch([g], pad_id=0)
    assert batch.token_versions[0].tolist() == [3, 3, 5, 5] and batch.token_versions[1, :2].tolist() == [3, 3]
    lags = 5 - batch.token_versions  # the learner at 5: tokens sampled by 5 lag 0, by 3 lag 2
    m = mismatch_metrics(torch.zeros_like(batch.behavior_logprobs).masked_fill(~batch.tokens.response_mask.bool(), 0),
                         batch.behavior_logprobs.nan_to_num(0.0), batch.tokens.response_mask, lags)
    assert float(m["lag0/token_frac"]) == pytest.approx(2 / 6)
    assert float(m["lag2plus/token_frac"]) == pytest.approx(4 / 6)
