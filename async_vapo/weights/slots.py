"""The learner's weight slots: ``slots`` flat shared-memory buffers written round robin.

Each slot is a file under the learner's weights directory (/dev/shm): a 4 KiB header, then the tensors at the
offsets of ``layout.flat_layout``. A slot is rewritten only ``slots`` versions later. Its header works as a
sequence lock: the writer marks it ``WRITING`` before the first byte and ``READY`` with the version after the
last, and a reader checks "ready, this version, this token" before and after it used the bytes (the fetch
server per chunk, the engine around its load). A reader that fell ``slots`` versions behind therefore gets a
named error (``WeightsUnavailable``), never a mix of two versions; it loads the newest version instead.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from async_vapo.transport.messages import TransportError, WeightsAnnounce
from async_vapo.weights.layout import Layout, SharedWeightBuffer, copy_into, flat_layout

HEADER_BYTES = 4096
"""Bytes before a slot's first tensor (the data starts page-aligned)."""
MAGIC = b"AVWSLOT1"
_HEADER = struct.Struct("<8sQqQ16s")  # magic, state, version, data bytes, token
_STATE = struct.Struct("<Q")
_STATE_OFFSET = 8
WRITING, READY = 0, 1


class WeightsUnavailable(TransportError):
    """The version asked for is no longer (or not yet) held by the learner: load the newest instead."""


@dataclass(frozen=True)
class SlotWrite:
    """Where a version went: ``layout`` offsets count from the start of the data (``base`` in the file)."""

    path: str
    version: int
    nbytes: int
    layout: Layout
    base: int
    token: str


def read_header(buf) -> tuple[int, int, int, str] | None:
    """``(state, version, data bytes, token hex)`` of a slot's header, or None if it is not a slot."""
    magic, state, version, nbytes, token = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return None
    return state, version, nbytes, token.hex()


def slot_readable(path: str, token: str) -> bool:
    """Whether the slot file at ``path`` is readable here and is the learner ``token``'s (any version): the
    process runs on the learner's host. "auto" takes that as the engine's place (``weights.choose``)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return False
    h = read_header(head) if len(head) == _HEADER.size else None
    return h is not None and h[3] == token


def slot_holds(path: str, version: int, token: str) -> bool:
    """Whether the slot file at ``path`` is readable here and holds ``version`` of the learner ``token``."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
    except OSError:
        return False
    if len(head) < _HEADER.size:
        return False
    h = read_header(head)
    return h is not None and h[0] == READY and h[1] == version and h[3] == token


class WeightSlots:
    """The learner's side: ``slots`` flat shared-memory buffers written round robin."""

    def __init__(self, directory: Path, slots: int):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        directory.mkdir(parents=True, exist_ok=True)
        self.token = os.urandom(16)
        self.buffers = [SharedWeightBuffer(str(directory), header=HEADER_BYTES, persistent=True, prefix=f"slot{i}-")
                        for i in range(slots)]
        self._next = 0
        self.lock = threading.Lock()  # a slot growing (a new file) against a reader picking it

    def write(self, version: int, state: Mapping) -> SlotWrite:
        layout, span = flat_layout(state, HEADER_BYTES)
        buf = self.buffers[self._next]
        self._next = (self._next + 1) % len(self.buffers)
        with self.lock:
            mm = buf.reserve(span)
        _STATE.pack_into(mm, _STATE_OFFSET, WRITING)  # first: readers of the old version see it go
        copy_into(mm, state, layout)
        mm[:_HEADER.size] = _HEADER.pack(MAGIC, WRITING, version, span, self.token)
        _STATE.pack_into(mm, _STATE_OFFSET, READY)  # last: the version is complete
        assert buf.path is not None
        return SlotWrite(path=buf.path, version=version, nbytes=span,
                         layout=[(n, d, s, off - HEADER_BYTES) for n, d, s, off in layout], base=HEADER_BYTES,
                         token=self.token.hex())

    def _holding(self, version: int):
        """``(mapping, data bytes)`` of the slot that holds ``version`` complete; WeightsUnavailable if none."""
        with self.lock:
            mms = [b.mapping for b in self.buffers if b.mapping is not None]
        for mm in mms:
            try:
                h = read_header(mm)
            except ValueError:  # the slot grew meanwhile and its old mapping was closed
                continue
            if h is not None and h[0] == READY and h[1] == version:
                return mm, h[2]
        raise WeightsUnavailable(f"version {version} is not held any more (the learner keeps {len(self.buffers)})")

    def nbytes(self, version: int) -> int:
        """Data bytes of ``version``; WeightsUnavailable if no slot holds it."""
        return self._holding(version)[1]

    def read(self, version: int, start: int, stop: int) -> bytes:
        """A copy of data bytes ``[start, stop)`` of ``version``; WeightsUnavailable if no slot holds it
        complete, before and after the copy."""
        mm, nbytes = self._holding(version)
        if not 0 <= start < stop <= nbytes:
            raise WeightsUnavailable(f"bytes [{start}, {stop}) outside version {version}'s {nbytes}")
        try:
            data = mm[HEADER_BYTES + start: HEADER_BYTES + stop]
            h = read_header(mm)
        except ValueError:
            h = None
        if h is None or h[0] != READY or h[1] != version:
            raise WeightsUnavailable(f"version {version} was rewritten while it was read")
        return data

    def close(self) -> None:
        with self.lock:
            for b in self.buffers:
                b.close()


def slot_announce(w: SlotWrite) -> WeightsAnnounce:
    return WeightsAnnounce(version=w.version, transfer="shm", location=w.path, nbytes=w.nbytes, checksum="",
                           format="flat", layout=w.layout, base=w.base, token=w.token)
