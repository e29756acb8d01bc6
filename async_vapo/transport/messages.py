"""The one module of wire messages: every struct that crosses a process boundary, and its codec.

Each frame on a socket is one msgpack-encoded :class:`Envelope`. The envelope carries the protocol
version, a message id, the sender, the send time, the sender's policy version where it has one, the
id of the request it answers (``reply_to``), and a ``body``: exactly one of the tagged structs below
(tag field ``"type"``, explicit tag names so a class rename never changes the wire).

Rollout data reuses :class:`async_vapo.types.Group` / ``Trajectory`` unchanged: the structs
that the in-process trainer passes around are the ones on the wire. Their token ids and log-probs are
packed arrays and travel as one msgpack ``bin`` each (int32 / float32, little-endian; see
``async_vapo.types``): as one msgpack number per token, decoding a message of 16 groups x 8
samples took ~6x as long as ZeroMQ took to move it (``benchmarks/transport.py``).

Invariants
  * A frame is checked against its socket's ``max_bytes`` before a single byte is decoded.
  * A frame decodes to an Envelope whose ``protocol == PROTOCOL_VERSION`` and whose body type is one
    the socket allows, or it raises :class:`ProtocolError` with a reason in :data:`REJECT_REASONS`,
    counted by the decoder's :class:`RejectCounter`. Nothing else escapes ``Decoder.decode``: any other
    exception while decoding (a recursion or memory error from a hostile frame) is a counted reject too.
  * Nesting is bounded by the schema: every struct forbids unknown fields, so the decoder never descends
    into a value it has no type for (skipping an unknown field would recurse into whatever it holds), and
    no field is typed ``Any``. The deepest valid frame is 7 levels (envelope, body, groups, group,
    samples, sample, field); a 10,000-level frame fails at its first level that does not fit the schema.
    Any change of fields (adding one included) bumps :data:`PROTOCOL_VERSION`.
  * Receiving ZeroMQ sockets also set ``ZMQ_MAXMSGSIZE`` to the socket's limit, so libzmq drops (and
    disconnects) a peer sending a larger frame before allocating it.

Size: groups travel in bounded chunks, never a whole step in one frame. A sender splits its groups with
:func:`split_groups` into messages of at most half the frame limit (whole groups; a group alone above it is a
named error), and the learner asks the replay for as many groups per :class:`BatchRequest` as fit
(:func:`groups_per_request`), so that no response length makes a frame oversized.

Flow control is the transports' high-water marks plus named errors (``BackpressureFull``), not
credits: the replay -> learner leg is already pull-based (one :class:`BatchRequest` per batch), and
on the rollout -> verifier -> replay legs a full pipe is a signal the sender handles by a named
policy (hold generation / retry), so a ``Credit`` message would duplicate what the HWM does.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Literal, Union

import msgspec

from async_vapo.types import Group, enc_hook

log = logging.getLogger(__name__)

REJECT_REASONS = ("oversized", "malformed", "unknown_type", "wrong_version", "not_allowed", "too_deep")
"""Every reason a frame is rejected for (also the label values of services' reject counters)."""


class TransportError(Exception):
    """Base of every error a transport raises (defined beside the codec so ProtocolError can be one)."""


class ProtocolError(TransportError):
    """A frame that is not a valid envelope for this socket; ``reason`` is one of REJECT_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"unknown reject reason {reason!r}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail

PROTOCOL_VERSION = 12
"""Version of the envelope and every body below; a peer speaking another version is rejected.

2: token ids and log-probs in groups are packed bytes (int32 / float32 LE) instead of msgpack arrays.
3: weights travel as flat shared-memory slots (transfer "shm", layout in the announce), fetched in
   chunks over ZeroMQ by engines on other hosts (``WeightsFetch.index``).
4: unknown fields are rejected (nesting bounded by the schema); ``WeightsAnnounce.min_version`` (the
   learner's staleness floor).
5: ``BatchRequest.received_cursor`` (groups served after it are stored again: a restarted learner loses none).
6: weights over torch.distributed ("dist"): ``WeightsGroupJoin``, ``WeightsGroupOffer``,
   ``WeightsAnnounce.dist_engines`` and ``dist_bucket_bytes``.
7: ``WeightsAck.via`` (the way the version came; "auto" chooses per engine from it), ``WeightsGroupJoin.backend``
   and ``WeightsGroupOffer.backend`` / ``bucket_bytes`` (gloo or NCCL groups).
8: ``Trajectory.version_spans``: the weight version of every token (``(version, first token index)`` pairs), for
   engines that update weights in flight; ``Group.version`` is the oldest token's. A replay log written before
   (no spans) still opens: its samples are wholly of their group's version.
9: ``Group.engine`` (the engine that generated it), ``BatchMsg.stale_dropped_by_engine`` /
   ``late_dropped_by_engine`` and ``Heartbeat.stale_dropped`` / ``late_dropped``: groups dropped as stale go back to
   their engine's admission budget (``async_vapo.staleness``). A replay log written before still opens (its groups
   name no engine).
10: ``Group.extra``: the problem record's extra fields (JSON text) for a reward function that takes them
   (``async_vapo.verify.reward_fn``). A replay log written before still opens (its groups carry none).
11: ``Trajectory.env_spans`` (the environment's tokens of a multi-turn response: no loss on them) and
   ``tool_calls`` / ``tool_errors`` / ``tool_seconds``. A replay log written before still opens (its samples are
   wholly the model's); a single-turn group encodes as before (every new field at its default is omitted).
12: ``HeldoutResponses`` (rollout 0 -> learner, on the acks socket): the held-out responses of an evaluation, on which
   the learner scores its critic (``critic/heldout_*``)."""

DEFAULT_MAX_BYTES = 256 * 2**20
"""Default size limit of one frame (a socket carrying batches of long responses may need more)."""

TransferKind = Literal["shm", "file", "zmq", "nccl", "adapter"]  # adapter: a LoRA version (weights.adapter)
ServiceStatus = Literal["starting", "ready", "busy", "draining", "error"]


class _Body(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True):
    """Base of every envelope body; subclasses name their wire tag explicitly."""


# rollout -> verifier (unscored groups), verifier -> replay (groups with rewards/verdicts)
class GroupsMsg(_Body, tag="groups"):
    groups: list[Group]


_GROUP_OVERHEAD = 256  # msgpack map keys, lengths and small fields of a group (measured < 200)
_SAMPLE_OVERHEAD = 160  # the same per sample


def group_wire_bytes(g: Group) -> int:
    """An upper bound on ``g``'s encoded size: 4 bytes per prompt token, 8 per response token (id + log-prob),
    its strings and a fixed overhead per group and per sample."""
    n = _GROUP_OVERHEAD + 4 * len(g.prompt_ids) + len(g.uid) + len(g.prompt.encode()) + len(g.answer.encode())
    n += len(g.engine) + len(g.extra.encode())
    for s in g.samples:
        n += _SAMPLE_OVERHEAD + 4 * len(s.response_ids) + 4 * len(s.behavior_logprobs) + len(s.verdict)
        n += len(s.finish_reason) + 16 * len(s.env_spans)
    return n


def split_groups(groups: list[Group], max_bytes: int) -> list[list[Group]]:
    """``groups`` in order, in chunks of whole groups of at most ``max_bytes`` each (:func:`group_wire_bytes`).
    A group alone above ``max_bytes`` cannot travel: a ValueError names it and the limit."""
    chunks: list[list[Group]] = []
    size = 0
    for g in groups:
        n = group_wire_bytes(g)
        if n > max_bytes:
            raise ValueError(f"group {g.uid!r} takes {n} bytes on the wire, above the {max_bytes} a message may carry "
                             f"(half of cluster.wire.max_message_bytes): raise that limit")
        if not chunks or size + n > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(g)
        size += n
    return chunks


def groups_per_request(max_bytes: int, group_bytes: int) -> int:
    """Groups of ``group_bytes`` (the largest expected) that one BatchMsg of at most ``max_bytes`` carries (>= 1)."""
    return max(1, max_bytes // max(1, group_bytes))


# learner -> replay: "n groups for update for_version, none generated before min_version"
class BatchRequest(_Body, tag="batch_request"):
    n_groups: int
    for_version: int
    min_version: int
    received_cursor: int = -1
    """Groups ever served that the learner's weights include (the cursor of its last batch, or its checkpoint's
    after a restart); the replay stores again what it served after that (``ReplayBuffer.rewind``). -1: unknown."""
    wait_s: float = 0.0
    """How long the replay may hold the request for groups still to come before it answers with none (0: answer
    now); the replay caps it at ``ReplayService.MAX_HOLD_S``."""


# replay -> learner (reply to BatchRequest)
class BatchMsg(_Body, tag="batch"):
    groups: list[Group]
    batch_id: str
    cursor: int
    """Replay's count of groups handed out so far (monotonic; lets the learner spot a replay restart)."""
    stale_dropped: int = 0
    """Groups discarded for this batch because they were older than min_version."""
    stale_dropped_by_engine: dict[str, int] = {}
    """Groups dropped as stale (on arrival or waiting) since the last answer, by the engine that generated them
    (``Group.engine``; groups that name none are left out)."""
    late_dropped_by_engine: dict[str, int] = {}
    """Of those, the groups dropped on arrival (already below the floor when they reached the replay)."""


# any -> any: generic reply
class Ack(_Body, tag="ack"):
    acked_id: str
    ok: bool = True
    error: str = ""


# learner -> rollout (PUB): weights of `version` are ready to fetch
class WeightsAnnounce(_Body, tag="weights_announce"):
    version: int
    transfer: TransferKind
    location: str
    """Slot file ("shm", see ``async_vapo.weights``), safetensors file ("file"), or rendezvous address. Empty
    for "shm": no slot holds the version (a sharded learner streamed it to ``dist_engines`` only, gathering one
    bucket at a time; an engine that did not receive it that way waits for the learner to publish it again)."""
    nbytes: int
    """Bytes of the payload (for "shm": of the tensors, after ``base``)."""
    checksum: str
    """``"<algo>:<hex>"`` of the whole payload ("file"; see ``zmq_transport.blob_checksum``); "shm" checks
    each fetched chunk instead, and local readers the slot's header."""
    format: str = "safetensors"
    layout: list[tuple[str, str, list[int], int]] = []
    """"shm": ``(name, dtype, shape, offset)`` of every tensor, offsets from the start of the data."""
    base: int = 0
    """"shm": offset of the data in the slot file (its header comes first)."""
    token: str = ""
    """"shm": the learner's random token, also in the slot's header (same token = same memory)."""
    min_version: int = -1
    """The learner's staleness floor at this version: the oldest weights its next batch may come from (the
    learner owns the bound; engines admit generation by it). -1: not stated."""
    dist_engines: list[str] = []
    """``cluster.weights.transfer = "dist"``: engines the learner streams this version to over their
    torch.distributed groups right after this announce (``async_vapo.weights.collective``), in ``layout`` order and
    in buckets of ``dist_bucket_bytes``; the others (and one whose receive fails) load the slot."""
    dist_bucket_bytes: int = 0


# rollout -> learner: "send me chunk `index` of weights `version`" (answered by TensorHeader + raw chunk, or
# by Ack(ok=False) when the version is no longer held)
class WeightsFetch(_Body, tag="weights_fetch"):
    engine_id: str
    version: int
    index: int = 0


# learner -> rollout: header frame of one raw tensor frame (transfer "zmq"); nbytes is checked on receipt
class TensorHeader(_Body, tag="tensor_header"):
    version: int
    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    checksum: str
    index: int = 0
    count: int = 1


# rollout -> learner: engine `engine_id` loaded (or failed to load) `version`
class WeightsAck(_Body, tag="weights_ack"):
    engine_id: str
    version: int
    ok: bool
    load_seconds: float
    """Seconds of the load by the way it came (a failed group receive before a fetch is not counted in it)."""
    error: str = ""
    via: str = ""
    """The way the version came: "dist", "shm", "zmq" or "file"; a LoRA version's adapter "adapter" (the learner's
    directory) or "adapter_zmq" (fetched); "" when the load failed."""


# rollout -> learner (acks socket): "give me a torch.distributed group for weights" ("dist": at start; "auto": after
# its first fetch, i.e. on another host than the learner's; and after a failed receive)
class WeightsGroupJoin(_Body, tag="weights_group_join"):
    engine_id: str
    workers: int = 1
    """vLLM workers of the engine (its tensor-parallel size): ranks 1..workers of the group."""
    backend: str = "gloo"
    """The weight-transfer engine the engine was created with, the only groups it can join: "gloo" or "nccl"."""


# learner -> rollouts (weights PUB): the group made for ``engine_id`` (the others ignore it); the engine passes
# these fields to vLLM's init_weight_transfer_engine
class WeightsGroupOffer(_Body, tag="weights_group_offer"):
    engine_id: str
    master_addr: str
    master_port: int
    world_size: int
    prefix: str
    timeout_s: float
    backend: str = "gloo"
    bucket_bytes: int = 0
    """"nccl": the packed buckets' size (both ends must cut the stream alike)."""


# any -> any: liveness; the learner's heartbeat repeats its latest announce so a dropped PUB is recovered
class Heartbeat(_Body, tag="heartbeat"):
    service: str
    instance: str
    served_version: int | None = None
    status: ServiceStatus = "ready"
    weights: WeightsAnnounce | None = None
    waiting_s: float = 0.0
    """The learner's: how long it has been waiting for its next batch (0: not waiting). An engine's: how long it has
    had nothing to generate (budget spent; the learner borrows its cores meanwhile: ``cluster.deploy.lend_cpus``)."""
    stale_dropped: dict[str, int] = {}
    """The learner's: groups the replay dropped as stale since this learner started, by the engine that generated
    them (cumulative, so a lost heartbeat loses nothing): each engine gives them back to its admission budget
    (``async_vapo.staleness``)."""
    late_dropped: dict[str, int] = {}
    """The learner's: of those, the groups that reached the replay already stale."""


# rollout 0 -> learner (acks socket): the graded held-out responses of its evaluation of ``version`` (or fresh ones at
# the training temperature, ``rollout.critic_eval_problems``), for the learner to score its critic on; a set larger
# than half a frame travels in ``parts`` messages of whole groups, ``part`` 0 first
HELDOUT_MAX_RESPONSES = 4096
"""Most responses of one held-out set: rollout 0 sends the first groups up to this many, the learner scores as many."""


def heldout_prefix(groups: list[Group]) -> list[Group]:
    """The first whole groups of ``groups`` with at most :data:`HELDOUT_MAX_RESPONSES` responses together."""
    kept, n = [], 0
    for g in groups:
        n += len(g.samples)
        if n > HELDOUT_MAX_RESPONSES:
            break
        kept.append(g)
    return kept


class HeldoutResponses(_Body, tag="heldout_responses"):
    engine_id: str
    version: int
    groups: list[Group]
    part: int = 0
    parts: int = 1


# requester <-> replier, subscriber handshake: "I am up and speak PROTOCOL_VERSION"
class Ready(_Body, tag="ready"):
    service: str
    instance: str = ""


# controller/any -> any: stop after the message in progress
class Shutdown(_Body, tag="shutdown"):
    reason: str = ""


Body = Union[  # noqa: UP007 - msgspec needs a runtime union object
    GroupsMsg, BatchRequest, BatchMsg, Ack, WeightsAnnounce, WeightsFetch, TensorHeader, WeightsAck,
    WeightsGroupJoin, WeightsGroupOffer, Heartbeat, HeldoutResponses, Ready, Shutdown,
]
ALL_MESSAGES: tuple[type, ...] = Body.__args__
MESSAGE_TAGS: dict[str, type] = {msgspec.inspect.type_info(t).tag: t for t in ALL_MESSAGES}


class Envelope(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One frame on the wire."""

    protocol: int
    """PROTOCOL_VERSION of the sender (required: a frame without it is malformed)."""
    id: str
    sender: str
    """Service instance that built the envelope, e.g. ``"rollout-0"`` (heartbeat monitors key on it)."""
    sent_at: float
    """Unix time at construction."""
    policy_version: int | None = None
    """The sender's current weight version, where it has one."""
    reply_to: str | None = None
    """Id of the request this envelope answers (request/reply sockets match on it)."""
    body: Body


def new_message_id() -> str:
    return uuid.uuid4().hex


def make_envelope(
    body: Any, *, sender: str, policy_version: int | None = None, reply_to: str | None = None
) -> Envelope:
    return Envelope(protocol=PROTOCOL_VERSION, id=new_message_id(), sender=sender, sent_at=time.time(),
                    policy_version=policy_version, reply_to=reply_to, body=body)


_ENCODER = msgspec.msgpack.Encoder(enc_hook=enc_hook)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)


def encode(env: Envelope) -> bytes:
    if not isinstance(env, Envelope):
        raise TypeError(f"encode takes an Envelope, got {type(env).__name__}")
    return _ENCODER.encode(env)


class _Probe(msgspec.Struct):
    """Loosest reading of a frame, used only to name why the strict decode failed."""

    protocol: Any = None
    body: Any = None


_PROBE_DECODER = msgspec.msgpack.Decoder(_Probe)


class RejectCounter:
    """Counts rejected frames by reason, feeds an optional callback, logs at most once per
    ``log_every_s`` per reason (with the number suppressed since). Thread-safe; may be shared."""

    def __init__(
        self, name: str = "", *, callback: Callable[[str], None] | None = None, log_every_s: float = 10.0
    ) -> None:
        self.name = name
        self.callback = callback
        self.log_every_s = log_every_s
        self.counts: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._lock = threading.Lock()
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, reason: str, detail: str = "") -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[reason] += 1
            last = self._last_log.get(reason)
            emit = last is None or now - last >= self.log_every_s
            if emit:
                self._last_log[reason] = now
                suppressed, self._suppressed[reason] = self._suppressed[reason], 0
            else:
                self._suppressed[reason] += 1
        if emit:
            log.warning("%s: rejected frame (%s): %s%s", self.name or "decoder", reason, detail,
                        f" [{suppressed} more since last report]" if suppressed else "")
        if self.callback is not None:
            self.callback(reason)


class Decoder:
    """The decoder of one socket: size limit first, then strict decode, then the socket's allow-list."""

    def __init__(
        self,
        allowed: tuple[type, ...],
        max_bytes: int = DEFAULT_MAX_BYTES,
        *,
        rejects: RejectCounter | None = None,
        name: str = "",
    ) -> None:
        unknown = [t for t in allowed if t not in ALL_MESSAGES]
        if unknown or not allowed:
            raise ValueError(f"allowed must be a non-empty tuple of message types, got {allowed!r}")
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.allowed = tuple(allowed)
        self.max_bytes = max_bytes
        self.rejects = rejects if rejects is not None else RejectCounter(name)
        self._decode = _ENVELOPE_DECODER.decode

    def with_allowed(self, *extra: type) -> Decoder:
        """The same limits and counter, allowing ``extra`` types too."""
        allowed = self.allowed + tuple(t for t in extra if t not in self.allowed)
        return Decoder(allowed, self.max_bytes, rejects=self.rejects)

    def reject(self, reason: str, detail: str = "") -> ProtocolError:
        """Count a rejection and return the error to raise (also used by blob receivers)."""
        self.rejects.record(reason, detail)
        return ProtocolError(reason, detail)

    def decode(self, frame: bytes | bytearray | memoryview) -> Envelope:
        nbytes = frame.nbytes if isinstance(frame, memoryview) else len(frame)
        if nbytes > self.max_bytes:
            raise self.reject("oversized", f"{nbytes} bytes > max_bytes {self.max_bytes}")
        try:
            env = self._decode(frame)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise self.reject(*_classify(frame, exc)) from None
        except RecursionError:
            raise self.reject("too_deep", "nesting beyond the recursion limit") from None
        except Exception as exc:  # noqa: BLE001 - a hostile frame never escapes as anything but a reject
            raise self.reject("malformed", f"{type(exc).__name__}: {exc}"[:200]) from None
        if env.protocol != PROTOCOL_VERSION:
            raise self.reject("wrong_version", f"protocol {env.protocol} != {PROTOCOL_VERSION} from {env.sender!r}")
        if not isinstance(env.body, self.allowed):
            raise self.reject("not_allowed", f"{type(env.body).__name__} from {env.sender!r}")
        return env


MAX_DEPTH = 32
"""Nesting a rejected frame may have for :func:`_classify` to look into it (valid frames have at most 7)."""
_SCAN_ITEMS = 4096
_U16 = struct.Struct(">H").unpack_from
_U32 = struct.Struct(">I").unpack_from
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2,
          0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0), 0xC7: (1, 1),
          0xC8: (2, 1), 0xC9: (4, 1)}  # str/bin/ext: (bytes of the length, bytes after it before the payload)


def msgpack_depth(frame, limit: int = MAX_DEPTH, max_items: int = _SCAN_ITEMS) -> int | None:
    """Container nesting of the first msgpack value in ``frame`` without decoding it (iterative, no
    recursion); ``limit + 1`` as soon as it is deeper than ``limit``; None when it is not worth knowing
    (more than ``max_items`` items, a declared length beyond the frame, or an invalid byte)."""
    mv = memoryview(frame).cast("B")
    n, pos, depth, deepest, items = len(mv), 0, 0, 0, 0
    stack = [1]
    while stack:
        if stack[-1] == 0:
            stack.pop()
            depth -= 1
            continue
        stack[-1] -= 1
        items += 1
        if pos >= n or items > max_items:
            return None
        b = mv[pos]
        pos += 1
        if b <= 0x7F or b >= 0xE0:
            continue
        if b <= 0x8F or 0x90 <= b <= 0x9F or b in (0xDC, 0xDD, 0xDE, 0xDF):
            if b <= 0x8F:
                count = (b & 0x0F) * 2
            elif b <= 0x9F:
                count = b & 0x0F
            else:
                width = 2 if b in (0xDC, 0xDE) else 4
                if pos + width > n:
                    return None
                count = (_U16 if width == 2 else _U32)(mv, pos)[0] * (2 if b >= 0xDE else 1)
                pos += width
            if count > n - pos:
                return None
            if count:
                depth += 1
                deepest = max(deepest, depth)
                if depth > limit:
                    return limit + 1
                stack.append(count)
        elif 0xA0 <= b <= 0xBF:
            pos += b & 0x1F
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            width, extra = _SIZED[b]
            if pos + width > n:
                return None
            length = mv[pos] if width == 1 else (_U16 if width == 2 else _U32)(mv, pos)[0]
            pos += width + extra + length
        else:  # 0xC1: never valid
            return None
        if pos > n:
            return None
    return deepest


def _classify(frame: bytes | bytearray | memoryview, exc: Exception) -> tuple[str, str]:
    depth = msgpack_depth(frame)
    if depth is None:
        return "malformed", str(exc)
    if depth > MAX_DEPTH:
        return "too_deep", f"nesting beyond {MAX_DEPTH} levels"
    try:
        probe = _PROBE_DECODER.decode(frame)
    except RecursionError:
        return "too_deep", "nesting beyond the recursion limit"
    except Exception:  # noqa: BLE001 - only names the reason of a frame that already failed
        return "malformed", str(exc)
    if not isinstance(probe.protocol, int) or isinstance(probe.protocol, bool):
        return "malformed", str(exc)
    if probe.protocol != PROTOCOL_VERSION:
        return "wrong_version", f"protocol {probe.protocol!r} != {PROTOCOL_VERSION}"
    tag = probe.body.get("type") if isinstance(probe.body, dict) else None
    if isinstance(tag, str) and tag not in MESSAGE_TAGS:
        return "unknown_type", f"body type {tag[:64]!r}"
    return "malformed", str(exc)
