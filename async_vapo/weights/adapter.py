"""A version as its LoRA adapter (``model.lora``): one PEFT adapter directory per version.

The learner's policy is a frozen base plus an adapter, so a version is its adapter alone: megabytes where the full
weights are gigabytes. :class:`AdapterPublisher` writes each version as a PEFT directory (``adapter_config.json``,
``adapter_model.safetensors``) under ``directory`` (``/dev/shm`` by default: memory, no disk) and announces it with
``transfer = "adapter"``. The announce describes the version's *blob*: its two files end to end (``layout``: each
file's name, ``"uint8"``, its size and offset, weights first), with the blob's size and crc32. The engine's end
(``receive.load_announced``) takes the version one of two ways, and loads it with ``WeightEngine.load_adapter``,
which hands a directory to vLLM's ``LoRARequest``:

* the learner's directory, where it lies (the engine shares the learner's host, or ``cluster.weights.dir`` is a
  shared filesystem): checked against the announce (:func:`check_adapter`; a mismatch fails the load);
* fetched over the learner's transport (``cluster.weights.transfer`` "zmq", or "auto" where the directory is not
  readable here: another host): the publisher given a ``fetch_endpoint`` serves each kept version's blob from
  memory through ``fetch.WeightServer``, in crc32-checked chunks within the fetch's deadline
  (``fetch.fetch_weights``); the engine checks the whole blob against the announce and writes its files into a
  directory of its own on its host's tmpfs (:class:`AdapterInbox`), which vLLM then loads.

Either way the check, the fetch, the write and vLLM's load are the engine's step of the push: the seconds of
``receive.load_announced``, acked to the learner as a slot load's are (``WeightsAck.load_seconds``,
``broadcast_seconds``). Announces, acks, heartbeats (which repeat the latest announce: an engine that joins late
loads the current adapter), the ack deadline and drop/rejoin are the weight broadcast's, the same as for whole
weights (``sync.WeightBroadcast``).

Invariants: a directory is complete before it is announced (written beside and renamed into place); the newest
``keep`` versions are kept (directory and, with a fetch server, blob), so an engine that loads a version announced
``keep - 1`` versions ago still finds it. A blob's file names are the two of :data:`ADAPTER_FILES` and nothing else
(an engine writes no other file, whatever an announce says). Streaming an adapter over a torch.distributed group
(``cluster.weights.transfer = "dist"``) is not done: the config refuses it with ``model.lora``, naming the ways
that work (and so does ``publish.make_publisher``).
"""

from __future__ import annotations

import atexit
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from async_vapo.models import lora
from async_vapo.transport.interface import Transport, blob_checksum, verify_checksum
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.fetch import WeightServer, fetch_weights
from async_vapo.weights.layout import shm_dir
from async_vapo.weights.publish import Publisher
from async_vapo.weights.slots import WeightsUnavailable

ADAPTER_FILES = (lora.ADAPTER_WEIGHTS, lora.ADAPTER_CONFIG)
"""The files of a version's PEFT directory, in the order of its blob."""


def adapter_blob(directory: Path) -> tuple[bytes, list[tuple[str, str, list[int], int]]]:
    """The blob of the PEFT directory ``directory`` (its :data:`ADAPTER_FILES` end to end) and its layout."""
    parts = [(name, (Path(directory) / name).read_bytes()) for name in ADAPTER_FILES]
    layout, offset = [], 0
    for name, data in parts:
        layout.append((name, "uint8", [len(data)], offset))
        offset += len(data)
    return b"".join(data for _, data in parts), layout


class AdapterPublisher(Publisher):
    """The learner's end: each version's adapter as a PEFT directory under ``directory``, newest ``keep`` kept.
    ``config``: the adapter's ``peft.LoraConfig`` (the learner's ``lora``). With ``fetch_endpoint``, a fetch server
    on ``transport`` serves the kept versions' blobs to engines on other hosts (``server``); the remaining keywords
    are ``fetch.WeightServer``'s."""

    def __init__(self, directory: Path | None, config, *, keep: int = 2, base_model: str | None = None,
                 transport: Transport | None = None, fetch_endpoint: str | None = None, chunk_bytes: int = 16 << 20,
                 max_bytes: int = 256 << 20, send_timeout_s: float = 5.0, sender: str = "learner",
                 on_served: Callable[[int], None] | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if fetch_endpoint is not None and transport is None:
            raise ValueError("a fetch server needs a transport")
        self._own = directory is None  # a directory of its own, removed by close
        if directory is None:
            directory = Path(shm_dir()) / f"async-vapo-lora-{os.getpid()}"
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config, self.keep, self.base_model = config, keep, base_model
        self.dirs: list[Path] = []
        self.blobs: dict[int, bytes] = {}
        """Version -> its blob, for the fetch server (whose thread reads it: one dict operation at a time, and a blob
        is never changed, only replaced)."""
        self.server: WeightServer | None = None
        if fetch_endpoint is not None:
            self.server = WeightServer(transport, self, fetch_endpoint, chunk_bytes=chunk_bytes, max_bytes=max_bytes,
                                       send_timeout_s=send_timeout_s, sender=sender, on_served=on_served)

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightsAnnounce:
        """Write version ``version``'s adapter (PEFT names, ``Learner.adapter_state``) and return its announce."""
        final = self.directory / f"adapter-v{version}"
        tmp = self.directory / f".adapter-v{version}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        lora.save_adapter(tmp, tensors, self.config, self.base_model)
        blob, layout = adapter_blob(tmp)
        if final.exists():  # a version published again (a resumed learner): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        if final in self.dirs:
            self.dirs.remove(final)
        self.dirs.append(final)
        if self.server is not None:
            self.blobs[version] = blob
        while len(self.dirs) > self.keep:
            old = self.dirs.pop(0)
            self.blobs.pop(int(old.name.removeprefix("adapter-v")), None)
            shutil.rmtree(old, ignore_errors=True)
        return WeightsAnnounce(version=version, transfer="adapter", location=str(final), nbytes=len(blob),
                               checksum=blob_checksum(blob), format="peft", layout=layout)

    # -- the fetch server's store (fetch.VersionStore) -----------------------------------------------------------
    def nbytes(self, version: int) -> int:
        return len(self._blob(version))

    def read(self, version: int, start: int, stop: int) -> bytes:
        blob = self._blob(version)
        if not 0 <= start < stop <= len(blob):
            raise WeightsUnavailable(f"bytes [{start}, {stop}) outside version {version}'s adapter of {len(blob)}")
        return blob[start:stop]

    def _blob(self, version: int) -> bytes:
        blob = self.blobs.get(version)
        if blob is None:
            raise WeightsUnavailable(f"the learner no longer holds the adapter of version {version}")
        return blob

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.blobs.clear()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


def _check_layout(a: WeightsAnnounce) -> None:
    """Raise unless ``a.layout`` is an adapter blob's: the files of :data:`ADAPTER_FILES`, end to end, filling
    ``a.nbytes`` (an engine writes files by these names)."""
    offset = 0
    for entry, name in zip(a.layout, ADAPTER_FILES, strict=False):
        if tuple(entry[:2]) != (name, "uint8") or len(entry[2]) != 1 or entry[3] != offset or entry[2][0] < 0:
            raise ValueError(f"the announce of adapter version {a.version} has a malformed layout: {a.layout}")
        offset += entry[2][0]
    if len(a.layout) != len(ADAPTER_FILES) or offset != a.nbytes:
        raise ValueError(f"the announce of adapter version {a.version} has a malformed layout: {a.layout} "
                         f"({a.nbytes} bytes)")


def check_adapter(a: WeightsAnnounce) -> None:
    """Raise unless the adapter directory of announce ``a`` holds the blob it announced (size and checksum):
    WeightsUnavailable when it is not readable here, ValueError when it does not match."""
    _check_layout(a)
    try:
        blob, _ = adapter_blob(Path(a.location))
    except OSError as exc:
        raise WeightsUnavailable(f"the adapter directory {a.location} of version {a.version} is not readable here "
                                 f"({exc})") from exc
    if len(blob) != a.nbytes or not verify_checksum(blob, a.checksum):
        raise ValueError(f"adapter {a.location} does not match its announce ({a.checksum}, {a.nbytes} bytes)")


class AdapterInbox:
    """The engine's end of a fetched adapter: each version's PEFT directory under ``directory`` (this host's tmpfs by
    default), the newest ``keep`` kept: vLLM reads a directory again when an adapter that running requests still use
    went out of its cache, and an engine holds ``EngineSpec.max_loras`` (4 by default) at most."""

    def __init__(self, directory: Path | None = None, keep: int = 4):
        self.directory = Path(directory or Path(shm_dir()) / f"async-vapo-lora-in-{os.getpid()}")
        self.keep = keep
        self.dirs: list[Path] = []

    def fetch(self, transport: Transport, endpoint: str, a: WeightsAnnounce, *, chunk_bytes: int, timeout_s: float,
              engine_id: str, max_bytes: int) -> Path:
        """Fetch the blob of adapter announce ``a`` from the learner's fetch server at ``endpoint`` and write it as a
        PEFT directory; returns the directory. Raises as ``fetch_weights`` does, and ValueError when the blob does
        not match the announce (the chunks' crc32 passed, the whole does not: nothing is written)."""
        _check_layout(a)
        blob = bytearray(a.nbytes)
        fetch_weights(transport, endpoint, a.version, a.nbytes, blob, chunk_bytes=chunk_bytes, timeout_s=timeout_s,
                      engine_id=engine_id, max_bytes=max_bytes)
        if not verify_checksum(blob, a.checksum):
            raise ValueError(f"the fetched adapter of version {a.version} does not match its announce "
                             f"({a.checksum}, {a.nbytes} bytes)")
        return self.write(a, memoryview(blob))

    def write(self, a: WeightsAnnounce, blob: memoryview) -> Path:
        """The files of the checked blob of ``a`` as a PEFT directory (complete before it is returned)."""
        if not self.dirs:
            self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"adapter-v{a.version}"
        tmp = self.directory / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        for name, _, (size, ), offset in a.layout:
            (tmp / name).write_bytes(blob[offset: offset + size])
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        if final in self.dirs:
            self.dirs.remove(final)
        self.dirs.append(final)
        while len(self.dirs) > self.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        return final

    def close(self) -> None:
        self.dirs.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


_inbox: AdapterInbox | None = None


def inbox() -> AdapterInbox:
    """This process's :class:`AdapterInbox` (an engine's: one per rollout process), removed at exit."""
    global _inbox
    if _inbox is None:
        _inbox = AdapterInbox()
        atexit.register(_inbox.close)
    return _inbox
