"""Groups travel in bounded chunks: a whole step of long responses in one GroupsMsg is over the frame limit and
rejected, while ``split_groups``' chunks (whole groups, in order) each fit under half of it and decode; a single
group over the limit is a named error; ``group_wire_bytes`` bounds the encoded size from above."""

from __future__ import annotations

import random

import pytest

from async_vapo.transport import (
    BatchMsg,
    Decoder,
    GroupsMsg,
    ProtocolError,
    encode,
    group_wire_bytes,
    groups_per_request,
    make_envelope,
    split_groups,
)
from async_vapo.types import Group, Trajectory


def long_group(uid: str, samples: int, tokens: int, rng: random.Random) -> Group:
    return Group(uid=uid, prompt="solve " * 20, answer="42", prompt_ids=[rng.randrange(150_000) for _ in range(120)],
                 version=3, samples=[Trajectory(response_ids=[rng.randrange(150_000) for _ in range(tokens)],
                                                behavior_logprobs=[-rng.random() for _ in range(tokens)],
                                                finish_reason="length", reward=1.0, correct=True, verdict="correct")
                                     for _ in range(samples)])


def test_a_step_of_long_responses_travels_in_chunks_under_the_frame_limit():
    rng = random.Random(0)
    step = [long_group(f"g{i}", 4, rng.randint(2_000, 6_000), rng) for i in range(12)]
    limit = 400_000  # cluster.wire.max_message_bytes of this test; one group is ~100-200 kB
    dec = Decoder((GroupsMsg,), max_bytes=limit)
    with pytest.raises(ProtocolError) as err:
        dec.decode(encode(make_envelope(GroupsMsg(groups=step), sender="rollout-0")))
    assert err.value.reason == "oversized"  # the whole step does not fit
    chunks = split_groups(step, limit // 2)
    assert len(chunks) > 1 and [g for c in chunks for g in c] == step  # whole groups, in order
    for c in chunks:
        frame = encode(make_envelope(GroupsMsg(groups=c), sender="rollout-0"))
        assert len(frame) <= limit // 2 + 512  # the envelope adds a few hundred bytes at most
        assert dec.decode(frame).body.groups == c
    for g in step:
        body = encode(make_envelope(GroupsMsg(groups=[g]), sender="x"))
        assert len(encode(make_envelope(GroupsMsg(groups=[]), sender="x"))) + group_wire_bytes(g) >= len(body)


def test_a_group_over_the_limit_is_a_named_error():
    g = long_group("huge", 8, 10_000, random.Random(1))
    with pytest.raises(ValueError, match="'huge' takes .* bytes on the wire.*max_message_bytes"):
        split_groups([g], 100_000)


def test_groups_per_request_fits_a_batch_reply_under_the_limit():
    rng = random.Random(2)
    groups = [long_group(f"g{i}", 4, 3_000, rng) for i in range(10)]
    biggest = max(group_wire_bytes(g) for g in groups)
    k = groups_per_request(300_000, biggest)
    assert k >= 1
    frame = encode(make_envelope(BatchMsg(groups=groups[:k], batch_id="1", cursor=k), sender="replay"))
    assert len(frame) <= 300_000 + 512
    assert groups_per_request(10, biggest) == 1  # never zero: a request asks for at least one group
