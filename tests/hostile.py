"""Hostile wire frames shared by the decoder fuzz test (tests/unit/test_wire_fuzz.py) and the test of every
bound port over real sockets (tests/integration/test_hostile_frames.py)."""

from __future__ import annotations

import random
import struct
import time

import msgspec

from async_vapo.transport import (
    PROTOCOL_VERSION,
    Ack,
    BatchMsg,
    BatchRequest,
    GroupsMsg,
    Heartbeat,
    Ready,
    Shutdown,
    TensorHeader,
    WeightsAck,
    WeightsAnnounce,
    WeightsFetch,
    encode,
    make_envelope,
)
from async_vapo.types import Group, Trajectory


def _group(n: int = 2) -> Group:
    return Group(uid="u", prompt="1+1=", answer="2", prompt_ids=[1, 2, 3], version=3,
                 samples=[Trajectory(response_ids=[4, 5, 6], behavior_logprobs=[-0.5, -0.1, -0.2],
                                     finish_reason="stop", reward=1.0, correct=True, verdict="correct")
                          for _ in range(n)])


ANNOUNCE = WeightsAnnounce(version=3, transfer="shm", location="/dev/shm/x", nbytes=64, checksum="",
                           format="flat", layout=[("w", "float32", [4, 4], 0)], base=4096, token="ab",
                           min_version=2)
VALID = [encode(make_envelope(b, sender="fuzz", policy_version=3)) for b in (
    GroupsMsg(groups=[_group(), _group(1)]), Heartbeat(service="rollout", instance="0", served_version=3,
                                                       weights=ANNOUNCE),
    BatchRequest(n_groups=4, for_version=3, min_version=2), Ready(service="learner"),
    BatchMsg(groups=[_group()], batch_id="1", cursor=4),
    WeightsAck(engine_id="rollout-0", version=3, ok=True, load_seconds=0.1),
    ANNOUNCE, Shutdown(reason="done"), WeightsFetch(engine_id="rollout-0", version=3, index=1),
    TensorHeader(version=3, name="flat", dtype="uint8", shape=[8], nbytes=8, checksum="crc32:00000000"),
    Ack(acked_id="x", ok=False, error="gone"))]


def _deep(levels: int, leaf: bytes = b"\xc0") -> bytes:
    return b"\x91" * levels + leaf  # [[[...[nil]...]]]


def _envelope_with(body: bytes, extra: bytes = b"") -> bytes:
    """An envelope map whose body is the raw msgpack ``body`` (and optional raw extra key/value bytes)."""
    head = msgspec.msgpack.encode({"protocol": PROTOCOL_VERSION, "id": "i", "sender": "s", "sent_at": 0.0})
    n = 5 + (1 if extra else 0)
    return bytes([0x80 | n]) + head[1:] + msgspec.msgpack.encode("body") + body + extra


def _fixed_cases() -> list[tuple[str, bytes]]:
    deep = 10_000
    groups_body = msgspec.msgpack.encode({"type": "groups"})
    cases = [
        ("deep array", _deep(deep)),
        ("deep map", b"\x81\xa1k" * deep + b"\xc0"),
        ("deep body", _envelope_with(_deep(deep))),
        ("deep unknown field", _envelope_with(msgspec.msgpack.encode({"type": "heartbeat"}),
                                              msgspec.msgpack.encode("x") + _deep(deep))),
        ("deep unknown body field", _envelope_with(b"\x82" + groups_body[1:] + msgspec.msgpack.encode("junk")
                                                   + _deep(deep))),
        ("deep in groups", _envelope_with(b"\x82" + groups_body[1:] + msgspec.msgpack.encode("groups")
                                          + _deep(deep))),
    ]
    for name, prefix in (("array32", b"\xdd"), ("map32", b"\xdf"), ("str32", b"\xdb"), ("bin32", b"\xc6"),
                         ("ext32", b"\xc9")):
        huge = prefix + struct.pack(">I", 2**32 - 1) + (b"\x01" if name == "ext32" else b"")
        cases.append((f"{name} of 2**32-1", huge + b"\x00" * 16))
        cases.append((f"{name} of 2**32-1 in body", _envelope_with(huge)))
    cases.append(("1.5 MiB of noise", random.Random(1).randbytes(3 << 19)))
    cases.append(("1.5 MiB string", msgspec.msgpack.encode("x" * (3 << 19))))
    return cases


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 6)):
        op = rng.randrange(7)
        pos = rng.randrange(len(b) + 1)
        if op == 0 and b:  # flip bits
            b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert a random byte
            b.insert(pos, rng.randrange(256))
        elif op == 2 and b:  # delete
            del b[min(pos, len(b) - 1)]
        elif op == 3:  # truncate
            del b[pos:]
        elif op == 4:  # splice a container header with a huge or deep count
            b[pos:pos] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff\xff\xff\x00",
                                     _deep(rng.randint(50, 3000))])
        elif op == 5:  # replace a byte with a msgpack type byte
            if b:
                b[min(pos, len(b) - 1)] = rng.choice([0xC1, 0xC0, 0xDC, 0xDE, 0xD9, 0xCB, 0xD7, 0x9F, 0x8F])
        else:  # duplicate a slice
            j = rng.randrange(len(b) + 1)
            b[pos:pos] = b[min(pos, j):max(pos, j)]
    return bytes(b)


def hostile_frames(rng: random.Random, i: int, max_bytes: int) -> list[bytes]:
    fixed = [f for _, f in _fixed_cases()]
    kind = i % 6
    if kind == 0:
        return [fixed[(i // 6) % len(fixed)]]
    if kind == 1:
        return [rng.randbytes(rng.randint(0, 300))]
    if kind == 2:
        return [_mutate(rng, rng.choice(VALID))]
    if kind == 3:
        return [_deep(rng.randint(5_000, 20_000))]
    if kind == 4:
        return [rng.randbytes(8), rng.randbytes(8), rng.randbytes(8)]  # a frame count no socket expects
    return [rng.randbytes(max_bytes + rng.choice([1, 1000, 3 << 20]))]  # over the limit: a little, a lot


def blast(kind: str, endpoint: str, seed: str, n: int, max_bytes: int) -> int:
    """Send ``n`` hostile messages to ``endpoint`` from a ``kind`` socket; returns how many were sent."""
    import zmq

    rng = random.Random(seed)
    zctx = zmq.Context()
    sock = zctx.socket(getattr(zmq, kind))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, 50)
    sock.connect(endpoint)
    try:
        sent = 0
        for i in range(n):
            try:
                sock.send_multipart(hostile_frames(rng, i, max_bytes))
                sent += 1
            except zmq.Again:  # no connection: dropped for an oversized frame (reconnecting), or refused by CURVE
                time.sleep(0.01)
        time.sleep(0.5)  # let libzmq flush before the socket goes
        return sent
    finally:
        sock.close()
        zctx.term()


if __name__ == "__main__":  # python tests/hostile.py KIND ENDPOINT SEED N MAX_BYTES: one stranger's socket
    import sys

    kind, endpoint, seed, n, max_bytes = sys.argv[1:6]
    print(f"sent {blast(kind, endpoint, seed, int(n), int(max_bytes))}", flush=True)
