"""Flat weight buffers: a state dict laid out tensor after tensor in one shared-memory file.

The learner's slots (``slots``), an engine's own receive buffer and the one-process trainer's push buffer
are all this layout, which the engine's workers map and hand to vLLM's ``reload_weights`` as views
(``rollout/worker_ext.py``).
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch


def named_tensors(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A state dict from a mapping or an iterator of ``(name, tensor)`` (references, no copy)."""
    return dict(state.items() if isinstance(state, Mapping) else state)


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def unshared_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy aliased tensors (tied embeddings) so safetensors can store them. Both names are sent: the CPU
    backend keeps a separately packed lm_head even when the checkpoint ties it to the embeddings."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.detach().cpu().clone() if ptr in seen else v.detach().contiguous().cpu()
        seen.add(ptr)
    return out


Layout = list[tuple[str, str, list[int], int]]
"""``(name, dtype, shape, offset)`` of each tensor in a flat weight buffer (offsets in bytes)."""

ALIGN = 64
"""Every tensor of a flat weight buffer starts at a multiple of this many bytes."""


def flat_layout(state: Mapping[str, torch.Tensor], base: int = 0) -> tuple[Layout, int]:
    """Tensor after tensor in state-dict order, each ``ALIGN``-aligned from ``base``; returns the layout
    (absolute offsets) and the bytes after ``base`` that it spans."""
    return meta_layout(((name, t.dtype, t.shape) for name, t in state.items()), base)


def meta_layout(meta: Iterable[tuple[str, torch.dtype, Sequence[int]]], base: int = 0) -> tuple[Layout, int]:
    """:func:`flat_layout` from each tensor's ``(name, dtype, shape)`` alone (nothing gathered or allocated)."""
    layout, offset = [], 0
    for name, dtype, shape in meta:
        offset = -(-offset // ALIGN) * ALIGN
        layout.append((name, str(dtype).removeprefix("torch."), list(shape), base + offset))
        offset += int(torch.Size(shape).numel()) * dtype.itemsize
    if offset == 0:
        raise ValueError("an empty state dict has no weights to load")
    return layout, offset


def copy_into(mm, state: Mapping[str, torch.Tensor], layout: Layout) -> None:
    """Copy ``state`` into the writable buffer ``mm`` at ``layout``'s offsets."""
    for (name, t), (lname, _, _, off) in zip(state.items(), layout, strict=True):
        if name != lname:
            raise ValueError(f"layout names {lname!r} where the state dict has {name!r}")
        size = t.numel() * t.element_size()
        src = t.detach()
        if src.device.type == "cpu":
            # A plain memcpy: torch's copy_ would go through its thread pool, which costs ~10 ms a
            # tensor when the cores are busy (measured here), more than copying the bytes.
            mm[off: off + size] = src.contiguous().view(-1).view(torch.uint8).numpy()
        else:
            flat = torch.frombuffer(mm, dtype=torch.uint8, count=size, offset=off)
            flat.view(t.dtype).view(t.shape).copy_(src)
            del flat


class SharedWeightBuffer:
    """One flat weight buffer in a shared-memory file (the workers' side is in worker_ext).

    Tensors are laid out by :func:`flat_layout` after ``header`` bytes (which the owner may use, see
    ``async_vapo.weights.slots``). The file is created when the first state dict arrives (or a larger
    one). By default it is unlinked once the workers have mapped it (``mapped``), so a crashed process
    leaves nothing behind in /dev/shm and the memory lives as long as the mappings do; ``persistent``
    keeps the name, for buffers that other processes open by path.
    """

    ALIGN = ALIGN

    def __init__(self, directory: str | None = None, *, header: int = 0, persistent: bool = False,
                 prefix: str = "async-vapo-weights-"):
        self.directory = directory or shm_dir()
        self.header = header
        self.persistent = persistent
        self.prefix = prefix
        self.path: str | None = None
        self.capacity = 0
        self._mm: mmap.mmap | None = None
        self._linked = False

    @property
    def mapping(self) -> mmap.mmap | None:
        """The writable mapping of the current file, None before the first write."""
        return self._mm

    @property
    def buffer(self) -> mmap.mmap:
        if self._mm is None:
            raise RuntimeError("the buffer has not been allocated yet")
        return self._mm

    def reserve(self, nbytes: int) -> mmap.mmap:
        """Make the file hold at least ``header + nbytes`` bytes (a new file if it is smaller); returns the
        writable mapping of the whole file."""
        if self.header + nbytes > self.capacity:
            self._allocate(self.header + nbytes)
        return self.buffer

    def write(self, state: Mapping[str, torch.Tensor]) -> tuple[str, int, Layout]:
        """Copy ``state`` into the buffer; returns ``(path, nbytes, layout)`` for the workers'
        ``async_vapo_load_shared`` (``nbytes`` and the layout's offsets count from the start of the file)."""
        layout, span = flat_layout(state, self.header)
        copy_into(self.reserve(span), state, layout)
        assert self.path is not None
        return self.path, self.header + span, layout

    def mapped(self) -> None:
        """The workers have mapped the current file: its name is no longer needed (unless persistent)."""
        if self._linked and self.path is not None and not self.persistent:
            Path(self.path).unlink(missing_ok=True)
            self._linked = False

    def _allocate(self, nbytes: int) -> None:
        self.close()
        fd, path = tempfile.mkstemp(prefix=self.prefix, suffix=".bin", dir=self.directory)
        try:
            os.ftruncate(fd, nbytes)
            self._mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            raise
        os.close(fd)
        self.path, self.capacity, self._linked = path, nbytes, True

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
                pass
            self._mm = None
        if self._linked and self.path is not None:
            Path(self.path).unlink(missing_ok=True)
        self.path, self.capacity, self._linked = None, 0, False


def tensor_nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = getattr(torch, dtype).itemsize
    for d in shape:
        n *= d
    return n


