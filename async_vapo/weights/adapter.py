"""A version as its LoRA adapter (``model.lora``): one PEFT adapter directory per version on tmpfs.

The learner's policy is a frozen base plus an adapter, so a version is its adapter alone: megabytes where the full
weights are gigabytes. :class:`AdapterPublisher` writes each version as a PEFT directory (``adapter_config.json``,
``adapter_model.safetensors``) under ``directory`` (``/dev/shm`` by default: memory, no disk) and announces it with
``transfer = "adapter"``, the size and crc32 of its weights file; the engine's end (``receive.load_announced``)
checks both and calls ``WeightEngine.load_adapter``, which hands the directory to vLLM's ``LoRARequest``. That
load is the whole engine step: its seconds are the push's, as a slot load's are.

Invariants: a directory is complete before it is announced (written beside and renamed into place); the newest
``keep`` versions are kept, so an engine that loads a version announced ``keep - 1`` versions ago still finds it.
Engines on another host need the directory on a filesystem they share (as ``transfer = "file"`` does); streaming the
adapter's tensors over ZeroMQ or a torch.distributed group is not done yet.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch

from async_vapo.models import lora
from async_vapo.transport.interface import blob_checksum, verify_checksum
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.layout import shm_dir
from async_vapo.weights.publish import Publisher


class AdapterPublisher(Publisher):
    """The learner's end: each version's adapter as a PEFT directory under ``directory``, newest ``keep`` kept.
    ``config``: the adapter's ``peft.LoraConfig`` (the learner's ``lora``)."""

    def __init__(self, directory: Path | None, config, *, keep: int = 2, base_model: str | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._own = directory is None  # a directory of its own, removed by close
        if directory is None:
            directory = Path(shm_dir()) / f"async-vapo-lora-{os.getpid()}"
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config, self.keep, self.base_model = config, keep, base_model
        self.dirs: list[Path] = []

    def publish(self, version: int, tensors: Mapping[str, torch.Tensor]) -> WeightsAnnounce:
        """Write version ``version``'s adapter (PEFT names, ``Learner.adapter_state``) and return its announce."""
        final = self.directory / f"adapter-v{version}"
        tmp = self.directory / f".adapter-v{version}.tmp"
        if tmp.exists():
            shutil.rmtree(tmp)
        lora.save_adapter(tmp, tensors, self.config, self.base_model)
        data = (tmp / lora.ADAPTER_WEIGHTS).read_bytes()
        if final.exists():  # a version published again (a resumed learner): replaced whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        if final in self.dirs:
            self.dirs.remove(final)
        self.dirs.append(final)
        while len(self.dirs) > self.keep:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)
        return WeightsAnnounce(version=version, transfer="adapter", location=str(final), nbytes=len(data),
                               checksum=blob_checksum(data), format="peft")

    def close(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.dirs.clear()
        if self._own:
            shutil.rmtree(self.directory, ignore_errors=True)


def check_adapter(a: WeightsAnnounce) -> None:
    """Raise unless the adapter directory of announce ``a`` holds the weights it announced (size and checksum)."""
    path = Path(a.location) / lora.ADAPTER_WEIGHTS
    data = path.read_bytes()
    if len(data) != a.nbytes or not verify_checksum(data, a.checksum):
        raise ValueError(f"adapter {path} does not match its announce ({a.checksum}, {a.nbytes} bytes)")
