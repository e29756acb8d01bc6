"""Hostile frames against every socket's decoder, in process: fixed cases (10,000-level nesting in every
position, declared lengths of 2**32 - 1, frames of more than 1 MiB) and 50,000 seeded random and mutated
frames per decoder. Nothing but a counted ProtocolError may come out of ``Decoder.decode``.

Budget: about 30 s for the 400,000 random frames (timed and printed, not asserted)."""

from __future__ import annotations

import random
import time

import msgspec
import pytest
from hostile import VALID, _deep, _fixed_cases, _mutate
from hypothesis import given, settings
from hypothesis import strategies as st

from async_vapo.transport import (
    PROTOCOL_VERSION,
    REJECT_REASONS,
    Ack,
    BatchMsg,
    BatchRequest,
    Decoder,
    GroupsMsg,
    Heartbeat,
    ProtocolError,
    Ready,
    Shutdown,
    TensorHeader,
    WeightsAck,
    WeightsAnnounce,
    WeightsFetch,
    WeightsGroupJoin,
    WeightsGroupOffer,
)
from async_vapo.transport.messages import MAX_DEPTH, msgpack_depth

# The allow-list of every socket the services bind or connect (see each service module's socket table).
SOCKETS = {
    "verifier.in / replay.in": (GroupsMsg, Heartbeat),
    "replay.batches": (BatchRequest, Ready),
    "learner.batches": (BatchMsg, Ready),
    "learner.acks": (WeightsAck, WeightsGroupJoin, Heartbeat),
    "rollout.weights": (WeightsAnnounce, WeightsGroupOffer, Heartbeat, Shutdown),
    "learner.weights_fetch": (WeightsFetch,),
    "rollout.fetch_reply": (TensorHeader, Ack),
}
MAX_BYTES = 1 << 20
RANDOM_FRAMES = 50_000


def _check(dec: Decoder, frame: bytes) -> str | None:
    """The reject reason, or None if the frame decoded (then it must be an allowed, current envelope)."""
    try:
        env = dec.decode(frame)
    except ProtocolError as err:
        assert err.reason in REJECT_REASONS
        return err.reason
    assert env.protocol == PROTOCOL_VERSION and isinstance(env.body, dec.allowed)
    return None


@pytest.mark.parametrize("socket", list(SOCKETS))
def test_fixed_hostile_frames_are_counted_rejects(socket):
    for max_bytes in (MAX_BYTES, 4 * MAX_BYTES):  # 1.5 MiB frames: oversized, then decoded and refused
        dec = Decoder(SOCKETS[socket], max_bytes=max_bytes)
        cases = _fixed_cases()
        reasons = {name: _check(dec, frame) for name, frame in cases}
        assert None not in reasons.values(), reasons
        assert dec.rejects.total == len(cases)
        big = {k: v for k, v in reasons.items() if "MiB" in k}
        assert set(big.values()) == ({"oversized"} if max_bytes == MAX_BYTES else {"malformed"}), big


@pytest.mark.parametrize("socket", list(SOCKETS))
def test_random_and_mutated_frames_never_escape_the_decoder(socket):
    rng = random.Random(f"wire-fuzz-{socket}")
    dec = Decoder(SOCKETS[socket], max_bytes=MAX_BYTES)
    t0 = time.perf_counter()
    decoded = 0
    for i in range(RANDOM_FRAMES):
        kind = i % 4
        if kind == 0:
            frame = rng.randbytes(rng.randint(0, 200))
        elif kind == 3 and i % 40 == 3:
            frame = rng.choice(VALID)  # a valid frame now and then: decodes iff the socket allows its type
        else:
            frame = _mutate(rng, rng.choice(VALID))
        decoded += _check(dec, frame) is None
    seconds = time.perf_counter() - t0
    assert dec.rejects.total == RANDOM_FRAMES - decoded
    assert decoded > 0  # the valid frames this socket allows got through
    print(f"{socket}: {RANDOM_FRAMES} frames in {seconds:.1f} s, {decoded} decoded, rejects {dec.rejects.counts}")


_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
                       | st.text(max_size=40) | st.binary(max_size=300),
                       lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner,
                                                                                     max_size=4), max_leaves=40)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(_depth, v), default=-1) if v else 0
    if isinstance(v, dict):
        return 1 + max(map(_depth, v.values()), default=-1) if v else 0
    return 0


@settings(max_examples=300, deadline=None)
@given(_values)
def test_msgpack_depth_matches_a_recursive_reference(value):
    assert msgpack_depth(msgspec.msgpack.encode(value), limit=64) == _depth(value)


def test_msgpack_depth_stops_at_its_limits():
    assert msgpack_depth(_deep(10_000)) == MAX_DEPTH + 1
    assert msgpack_depth(b"\xdd\xff\xff\xff\xff") is None  # declares more items than the frame holds
    assert msgpack_depth(msgspec.msgpack.encode(list(range(10_000)))) is None  # not worth scanning
    assert msgpack_depth(b"\xc1") is None


def test_a_groups_extra_fields_travel_as_text_never_as_nesting():
    # Group.extra is JSON text (a reward function's record fields): a frame that puts a nested map there is a
    # counted reject, and deep JSON inside the text is just characters to the decoder (depth stays 7)
    from async_vapo.transport import encode, make_envelope
    from async_vapo.types import Group, Trajectory

    dec = Decoder((GroupsMsg,), max_bytes=MAX_BYTES)
    g = Group(uid="u", prompt="p", answer="a", prompt_ids=[1], version=0, extra="[" * 5000 + "]" * 5000,
              samples=[Trajectory(response_ids=[1], behavior_logprobs=[0.0], finish_reason="stop")])
    frame = encode(make_envelope(GroupsMsg(groups=[g]), sender="rollout-0"))
    assert _check(dec, frame) is None and msgpack_depth(frame) <= 7
    raw = msgspec.msgpack.decode(frame)
    raw["body"]["groups"][0]["extra"] = "{}"
    assert _check(dec, msgspec.msgpack.encode(raw)) is None  # the frame as re-encoded here decodes
    raw["body"]["groups"][0]["extra"] = {"a": {"b": 1}}
    assert _check(dec, msgspec.msgpack.encode(raw)) == "malformed"
