"""Moving policy versions from the learner to the rollout engines.

    layout   flat weight buffers in shared memory (the bytes every way moves)
    slots    the learner's shared-memory slots, with their sequence-lock headers
    fetch    the learner's fetch server and the engine's chunked fetch over the transport (other hosts)
    engine   WeightEngine: what the weight client may call on an engine (both engines implement it)
    file     one safetensors file per version (shared filesystems)
    base     Publisher: one interface over the ways (publish a version from named tensors)
    receive  the engine's end: load an announced version by the way it allows
    sync     the learner's broadcast: publish, announce, acks, heartbeats, rotation, liveness
    dist     versions streamed over a torch.distributed group per engine (gloo, or NCCL on GPUs)
    choose   "auto": the way each engine takes, by where it is and by timing its first loads
    adapter  model.lora: a version is its adapter, a PEFT directory read where it lies or fetched ("adapter",
             "adapter_zmq")

``benchmarks/weight_sync.py`` measures the ways against a plain memcpy of the same bytes.
"""

from async_vapo.weights.engine import WeightEngine
from async_vapo.weights.fetch import WeightServer, fetch_weights
from async_vapo.weights.file import write_file_version
from async_vapo.weights.layout import Layout, SharedWeightBuffer, copy_into, flat_layout, named_tensors, unshared_state
from async_vapo.weights.publish import FilePublisher, Publisher, SlotPublisher, make_publisher
from async_vapo.weights.receive import load_announced
from async_vapo.weights.slots import (
    HEADER_BYTES,
    SlotWrite,
    WeightSlots,
    WeightsUnavailable,
    read_header,
    slot_announce,
    slot_holds,
    slot_readable,
)
from async_vapo.weights.sync import Rotation, WeightBroadcast, default_weights_dir

__all__ = [
    "HEADER_BYTES", "FilePublisher", "Layout", "Publisher", "Rotation", "SharedWeightBuffer", "SlotPublisher",
    "SlotWrite", "WeightBroadcast", "WeightEngine", "WeightServer", "WeightSlots", "WeightsUnavailable", "copy_into",
    "default_weights_dir", "fetch_weights", "flat_layout", "load_announced", "make_publisher", "named_tensors",
    "read_header", "slot_announce", "slot_holds", "slot_readable", "unshared_state", "write_file_version",
]  # fmt: skip
