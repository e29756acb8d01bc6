"""What generation produces and the learner consumes: groups of version-tagged samples.

Typed msgspec structs, so the same objects travel in-process and, encoded as msgpack, between services.
A group holds the G samples of one prompt. Each token carries the weight version that sampled it: a sample's
``version_spans`` lists ``(version, index of its first token)`` pairs, in order, from index 0 (an engine that updates
weights in flight switches versions mid-response); empty means every token is the group's ``version``. A group's
``version`` is its oldest token's (the staleness rule of ``async_vapo.staleness`` applies to it, the rule users of
prime-rl know), so a group is as stale as its oldest token.

Token ids and log-probs are packed arrays: ``response_ids`` and ``prompt_ids`` hold ``array("i")``
(int32) and ``behavior_logprobs`` holds ``array("f")`` (float32), whatever sequence the constructor
was given (a list from vLLM, a tuple, an array, or packed bytes from the wire). They work where the
code uses lists of numbers (``len``, indexing, iteration, ``==``, ``pop``, ``list(...)``,
``torch.as_tensor``), and each goes on the wire as one msgpack ``bin`` of little-endian bytes
(:data:`enc_hook`): a message of 128 samples is a few hundred byte strings instead of ~18,000 msgpack
numbers, each of which cost a Python object to decode (``benchmarks/transport.py``).

Departures from plain lists, on purpose:
  * log-probs are float32. vLLM computes them in float32 and the learner casts them to float32
    (``make_rollout_batch``), so values from the engine lose nothing; other floats are rounded.
  * a token id outside int32 is an ``OverflowError`` at construction (no vocabulary is that large).

Decoding also accepts a msgpack array of numbers for these fields (the wire form before protocol 2),
so a replay log written by an older version still opens.
"""

from __future__ import annotations

import sys
from array import array
from typing import Annotated

import msgspec

INT32 = "i"
FLOAT32 = "f"
if array(INT32).itemsize != 4 or array(FLOAT32).itemsize != 4:  # pragma: no cover - no such platform in use
    raise ImportError("async_vapo needs a platform where array('i') and array('f') hold 4-byte items")
_BIG_ENDIAN = sys.byteorder == "big"

PackedInts = bytes | list[Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]]
"""What a token-id field decodes from (packed int32 LE, or a msgpack array); it holds ``array('i')``."""
PackedFloats = bytes | list[float]
"""What a log-prob field decodes from (packed float32 LE, or a msgpack array); it holds ``array('f')``."""


def _to_native_order(source, packed: array) -> None:  # pragma: no cover - big-endian hosts only
    if type(source) is bytes:  # wire bytes are little-endian
        packed.byteswap()


def _enc_hook_big_endian(obj: object) -> bytes:  # pragma: no cover - big-endian hosts only
    swapped = array(obj.typecode, obj)
    swapped.byteswap()
    return swapped.tobytes()


enc_hook = _enc_hook_big_endian if _BIG_ENDIAN else array.tobytes
"""msgspec encoder hook for anything holding a Group (``msgspec.msgpack.Encoder(enc_hook=enc_hook)``):
a packed array goes on the wire as its little-endian bytes, any other unsupported object is a
TypeError. On little-endian hosts it is ``array.tobytes`` itself: a C call, which here encodes a
message 2.5x faster than a Python hook function."""


class Trajectory(msgspec.Struct, kw_only=True, gc=False, forbid_unknown_fields=True, omit_defaults=True):
    """One response. ``reward``/``correct``/``verdict`` are filled by the verifier.

    ``gc=False``: it holds only numbers, strings and arrays, so it can be in no reference cycle. ``omit_defaults``: a
    field at its default is not encoded (a lock-step sample's empty ``version_spans`` costs nothing on the wire).
    """

    response_ids: PackedInts
    """Generated token ids; holds ``array('i')``."""
    behavior_logprobs: PackedFloats
    """Log-prob of each generated token under the weights that generated it; holds ``array('f')``."""
    finish_reason: str
    reward: float = 0.0
    correct: bool = False
    verdict: str = "unverified"
    version_spans: list[tuple[int, int]] = []
    """``(version, first token index)`` per weight version that sampled this response, in order from index 0;
    empty: every token is the group's ``version`` (a lock-step engine, or a log written before protocol 8)."""
    env_spans: list[tuple[int, int]] = []
    """``(first token index, token count)`` of each run of environment tokens in ``response_ids`` (a multi-turn
    rollout, ``async_vapo.rollout.env``: tool output and the chat template's turn markers), in order, disjoint; the
    other response tokens are the model's. Environment tokens stay in the sequence (the model reads them) but are
    not the policy's actions: their ``behavior_logprobs`` are 0, and the learner leaves them out of every loss,
    its denominators, GAE's steps and the mismatch and entropy terms (:func:`model_token_mask`). Empty: every token
    is the model's (single-turn, or a log written before protocol 11)."""
    tool_calls: int = 0
    """Tool calls the environment ran for this sample (a multi-turn rollout)."""
    tool_errors: int = 0
    """Of those, the calls that did not end with status ``ok`` (an exception, a timeout, a limit, a kill)."""
    tool_seconds: float = 0.0
    """Wall seconds of this sample's tool calls."""

    def __post_init__(self) -> None:
        # Runs after construction and after decoding (once per sample of every message), so it is inline.
        ids, lps = self.response_ids, self.behavior_logprobs
        self.response_ids = packed_ids = array(INT32, ids)
        self.behavior_logprobs = packed_lps = array(FLOAT32, lps)
        if _BIG_ENDIAN:  # pragma: no cover
            _to_native_order(ids, packed_ids)
            _to_native_order(lps, packed_lps)


class Group(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """The samples of one prompt (rollout -> verifier -> replay -> learner); ``version`` is the oldest version of any
    of its tokens."""

    uid: str
    prompt: str
    answer: str
    prompt_ids: PackedInts
    """Prompt token ids; holds ``array('i')``."""
    version: int
    samples: list[Trajectory]
    engine: str = ""
    """The rollout engine that generated it (its service name; empty: generated in-process, or a log written before
    protocol 9): a group the replay drops as stale gives its share back to that engine's admission budget
    (``async_vapo.staleness``)."""
    extra: str = ""
    """The problem record's extra fields (``Problem.extra``) as the text of a JSON object, for a reward function that
    takes them (``async_vapo.verify.reward_fn``); empty: none (the maths check, a generated task, or a log written
    before protocol 10). Text, not a nested value: the wire's schema stays flat, so its nesting stays bounded."""

    def __post_init__(self) -> None:
        ids = self.prompt_ids
        self.prompt_ids = packed = array(INT32, ids)
        if _BIG_ENDIAN:  # pragma: no cover
            _to_native_order(ids, packed)

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    def token_versions(self, i: int) -> list[int]:
        """The version of each response token of sample ``i``."""
        return token_versions(self.samples[i], self.version)

    def spans_of(self, i: int) -> list[tuple[int, int]]:
        """Sample ``i``'s version spans, the group's version from index 0 when it has none recorded."""
        return [tuple(x) for x in self.samples[i].version_spans] or [(self.version, 0)]


def token_versions(sample: Trajectory, default: int) -> list[int]:
    """One version per response token of ``sample`` from its spans (``default`` for a sample without spans)."""
    n = len(sample.response_ids)
    spans = [tuple(x) for x in sample.version_spans] or [(default, 0)]
    out: list[int] = []
    for k, (version, first) in enumerate(spans):
        end = spans[k + 1][1] if k + 1 < len(spans) else n
        out += [version] * (max(end, first) - first)
    return out[:n]


def spans_error(sample: Trajectory, group_version: int) -> str | None:
    """What is wrong with ``sample``'s version spans for a group of ``group_version``, or None: they start at token 0,
    their first indices strictly increase and stay within the response, their versions strictly increase (weights
    only move forward within one request; a learner that went back aborts the requests of newer versions) and none
    is older than the group's version, which is the oldest of all its samples' first spans."""
    spans = sample.version_spans
    if not spans:
        return None
    n = len(sample.response_ids)
    if spans[0][1] != 0:
        return "the first span does not start at token 0"
    for (v0, i0), (v1, i1) in zip(spans, spans[1:], strict=False):
        if not (v1 > v0 and i1 > i0):
            return "spans whose versions or first indices do not increase"
    if spans[-1][1] >= max(n, 1):
        return "a span starting past the response"
    if spans[0][0] < group_version:
        return "a token older than the group's version"
    return None


def model_token_mask(sample: Trajectory) -> list[bool]:
    """One flag per response token of ``sample``: True for the model's tokens, False for the environment's
    (``env_spans``)."""
    keep = [True] * len(sample.response_ids)
    for first, count in sample.env_spans:
        keep[first: first + count] = [False] * len(keep[first: first + count])
    return keep


def env_spans_error(sample: Trajectory) -> str | None:
    """What is wrong with ``sample``'s environment spans, or None: each has a positive count, they are in order and
    disjoint, and they lie within the response."""
    end = 0
    for first, count in sample.env_spans:
        if count < 1 or first < end:
            return "environment spans that are empty, overlap or are out of order"
        end = first + count
    if end > len(sample.response_ids):
        return "an environment span past the response"
    return None
