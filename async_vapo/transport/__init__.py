"""Wire protocol (``messages``) and transports (``zmq_transport`` for deployments, ``inproc`` for one
process and tests) behind the small interfaces of ``base``."""

from __future__ import annotations

from async_vapo.transport.inproc import InprocTransport
from async_vapo.transport.interface import (
    DEFAULT_HWM,
    BackpressureFull,
    BlobReply,
    BlobRequester,
    BlobServer,
    HeartbeatMonitor,
    PeerDead,
    PeerTimeout,
    Publisher,
    Receiver,
    Replier,
    Requester,
    Sender,
    Subscriber,
    Transport,
    connect_with_handshake,
)
from async_vapo.transport.messages import (
    ALL_MESSAGES,
    DEFAULT_MAX_BYTES,
    PROTOCOL_VERSION,
    REJECT_REASONS,
    Ack,
    BatchMsg,
    BatchRequest,
    Body,
    Decoder,
    Envelope,
    GroupsMsg,
    Heartbeat,
    HeldoutResponses,
    ProtocolError,
    Ready,
    RejectCounter,
    Shutdown,
    TensorHeader,
    TransportError,
    WeightsAck,
    WeightsAnnounce,
    WeightsFetch,
    WeightsGroupJoin,
    WeightsGroupOffer,
    encode,
    group_wire_bytes,
    groups_per_request,
    make_envelope,
    new_message_id,
    split_groups,
)
from async_vapo.transport.zmq_transport import (
    ZmqTransport,
    bind_to_random_port,
    blob_checksum,
    recv_tensor_blob,
    send_tensor_blob,
    shared_context,
    verify_checksum,
)

__all__ = [
    "group_wire_bytes", "groups_per_request", "split_groups",
    "ALL_MESSAGES", "DEFAULT_HWM", "DEFAULT_MAX_BYTES", "PROTOCOL_VERSION", "REJECT_REASONS",
    "Ack", "BackpressureFull", "BatchMsg", "BlobReply", "BlobRequester", "BlobServer", "BatchRequest", "Body",
    "Decoder", "Envelope", "GroupsMsg",
    "Heartbeat", "HeartbeatMonitor", "HeldoutResponses", "InprocTransport", "PeerDead", "PeerTimeout", "ProtocolError",
    "Publisher", "Ready", "Receiver", "RejectCounter", "Replier", "Requester", "Sender", "Shutdown",
    "Subscriber", "TensorHeader", "Transport", "TransportError", "WeightsAck", "WeightsAnnounce",
    "WeightsFetch", "WeightsGroupJoin", "WeightsGroupOffer", "ZmqTransport", "bind_to_random_port", "blob_checksum",
    "connect_with_handshake",
    "encode", "make_envelope", "new_message_id", "recv_tensor_blob", "send_tensor_blob", "shared_context",
    "verify_checksum",
]  # fmt: skip
