"""One interface over the ways a version leaves the learner.

A :class:`Publisher` takes a version as an iterator (or mapping) of named tensors, makes it available to the
engines and returns the announce that tells them where it is. The ways:

* :class:`SlotPublisher` (``cluster.weights.transfer`` auto / shm / zmq): the version goes into one of the
  learner's shared-memory slots (``slots``); engines on this host map the slot, the others fetch it from the
  fetch server (``fetch``) over the learner's transport (ZeroMQ between hosts);
* :class:`FilePublisher` ("file"): one safetensors file per version (``file``);
* ``adapter.AdapterPublisher`` (any of them but "dist", with ``model.lora``): the version's LoRA adapter as a PEFT
  directory, fetched over the transport by engines that cannot read it where it lies ("auto", "zmq").

The engine's end of every way is ``receive.load_announced``. Announces, acks, heartbeats and the rotation
of engines are the same for every way (``sync.WeightBroadcast``). A torch.distributed broadcast into
vLLM's weight-transfer API is a further Publisher with its own engine end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from async_vapo.transport.interface import Transport
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.fetch import WeightServer
from async_vapo.weights.file import write_file_version
from async_vapo.weights.layout import meta_layout, named_tensors
from async_vapo.weights.slots import HEADER_BYTES, WeightSlots, slot_announce

NamedTensors = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]


class Publisher(ABC):
    """The learner's end of one way: publish a version, say where it is."""

    @abstractmethod
    def publish(self, version: int, tensors: NamedTensors) -> WeightsAnnounce: ...

    @abstractmethod
    def close(self) -> None: ...


class SlotPublisher(Publisher):
    """Versions in ``slots`` shared-memory slots under ``directory``; with ``fetch_endpoint``, a fetch server
    for engines on other hosts, on ``transport``."""

    def __init__(self, directory: Path, slots: int, *, transport: Transport | None = None,
                 fetch_endpoint: str | None = None, chunk_bytes: int = 16 << 20, max_bytes: int = 256 << 20,
                 send_timeout_s: float = 5.0, sender: str = "learner", on_served: Callable[[int], None] | None = None):
        self.slots = WeightSlots(directory, slots)
        self.server: WeightServer | None = None
        if fetch_endpoint is not None:
            if transport is None:
                self.slots.close()
                raise ValueError("a fetch server needs a transport")
            try:
                self.server = WeightServer(transport, self.slots, fetch_endpoint, chunk_bytes=chunk_bytes,
                                           max_bytes=max_bytes, send_timeout_s=send_timeout_s, sender=sender,
                                           on_served=on_served)
            except BaseException:
                self.slots.close()
                raise

    def publish(self, version: int, tensors: NamedTensors) -> WeightsAnnounce:
        return slot_announce(self.slots.write(version, named_tensors(tensors)))

    def announce_unheld(self, version: int, meta: Iterable[tuple[str, torch.dtype, Sequence[int]]]
                        ) -> WeightsAnnounce:
        """The announce of a version that no slot holds (``location`` empty): its layout from each tensor's
        ``(name, dtype, shape)``, as a slot would lay it out, and this learner's token. A sharded learner announces
        so a version it streams to every engine over their weight groups (``learner.sharding.publish_sharded``),
        never gathering it whole; neither a slot load nor a fetch can serve it."""
        layout, span = meta_layout(meta)
        return WeightsAnnounce(version=version, transfer="shm", location="", nbytes=span, checksum="",
                               format="flat", layout=layout, base=HEADER_BYTES, token=self.slots.token.hex())

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        self.slots.close()


class FilePublisher(Publisher):
    """One safetensors file per version under ``directory``; the newest ``keep`` are kept."""

    def __init__(self, directory: Path, keep: int):
        self.directory, self.keep = directory, keep
        self.files: list[Path] = []

    def publish(self, version: int, tensors: NamedTensors) -> WeightsAnnounce:
        a = write_file_version(self.directory, version, named_tensors(tensors))
        self.files.append(Path(a.location))
        while len(self.files) > self.keep:
            self.files.pop(0).unlink(missing_ok=True)
        return a

    def close(self) -> None:
        for f in self.files:
            f.unlink(missing_ok=True)


def make_publisher(transfer: str, directory: Path, *, keep_versions: int, transport: Transport | None,
                   fetch_endpoint: str | None, lora=None, base_model: str | None = None, **server_args) -> Publisher:
    """The publisher of ``cluster.weights.transfer``: "file", or slots with a fetch server on ``transport`` ("auto",
    "zmq") or without one ("shm": every engine shares this host). With ``lora`` (the policy's ``peft.LoraConfig``,
    ``model.lora``) each version is its adapter (``adapter.AdapterPublisher``), a PEFT directory under
    ``directory``, with a fetch server for "auto" and "zmq"; "dist" is refused."""
    directory.mkdir(parents=True, exist_ok=True)
    if transfer not in ("auto", "shm", "zmq", "file", "dist"):  # "dist" keeps the slots of "auto" as its fallback
        raise ValueError(f"unknown weight transfer {transfer!r} (auto, shm, zmq, file, dist)")
    if lora is not None:
        from async_vapo.weights.adapter import AdapterPublisher

        if transfer == "dist":
            raise ValueError('model.lora with cluster.weights.transfer = "dist": an adapter is not streamed over '
                             'torch.distributed groups; use "auto", "shm", "zmq" or "file"')
        serve = transfer in ("auto", "zmq")
        return AdapterPublisher(directory, lora, keep=max(2, keep_versions), base_model=base_model,
                                transport=transport if serve else None,
                                fetch_endpoint=fetch_endpoint if serve else None, **(server_args if serve else {}))
    if transfer == "file":
        return FilePublisher(directory, keep_versions)
    return SlotPublisher(directory, max(2, keep_versions), transport=transport,
                         fetch_endpoint=None if transfer == "shm" else fetch_endpoint, **server_args)
