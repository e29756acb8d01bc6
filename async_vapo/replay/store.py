"""Durable storage of verified groups: an append-only log of CRC-checked msgpack records.

File layout::

    file   = FILE_MAGIC (8 bytes) record*
    record = RECORD_MAGIC (4 bytes) | length: u32 LE | crc: u32 LE | payload (length bytes)
    crc    = crc32(length bytes + payload)
    payload = msgpack of one of AppendRecord | ConsumeRecord | DropRecord | SnapshotRecord (tagged union)

Each group gets a sequence number (``seq``, from 1, never reused, not even across compaction). A group
is *live* from its AppendRecord until a ConsumeRecord (served in a batch) or a DropRecord (never used,
with a reason) names its seq. Opening a store replays the log and rebuilds the live groups, the
consumption cursor and the counters; the log is the only source of truth, memory is a cache of it.

Acknowledgement and fsync. ``append`` / ``mark_*`` return only after the record has been handed to
the kernel with ``write(2)`` (no user-space buffering), so an acknowledged record survives a crash of
this *process*. Whether it survives a crash of the *machine* (power loss, kernel panic) depends on
``fsync``:

* ``"always"``: every record is fsynced before the call returns. Nothing acknowledged is ever lost.
* ``"batch"`` (default): append/drop records are fsynced once ``fsync_every`` of them are pending
  (and on ``sync()``, ``compact()``, ``close()``); a machine crash can lose at most the last
  ``fsync_every - 1`` acknowledged appends/drops. ConsumeRecords are fsynced at once, because
  forgetting one would serve those groups to the learner a second time after a restart, and there
  is only one per batch. (Forgetting a drop is harmless: the group is dropped again on restart.)
* ``"never"``: the kernel decides when to write back. Fastest; for tests and throw-away runs.

Recovery policy.

* Torn tail: a crash in the middle of ``write`` leaves a partial last record (or the file system
  leaves garbage/zeros after the last record). A bad record (wrong magic, length past the end of the
  file, CRC mismatch) after which no valid record can be found anywhere in the rest of the file is a
  torn tail: the file is truncated to the end of the last good record, the loss is counted in
  ``recovery`` and logged as a warning, and the store opens normally. A torn record was never
  acknowledged (``append`` had not returned), so truncating it loses nothing that was promised.
  Only an *incomplete* record counts as torn: its header or its declared payload runs past the end of
  the file, or the bytes there are not a record at all (no record magic: zeros or garbage).
* Corruption: a *complete* record whose CRC does not match (magic right, the whole declared payload in
  the file), at the tail or anywhere else, or a bad record followed by at least one valid record, means
  acknowledged data was damaged (bit rot, a foreign writer). That raises ``CorruptLogError`` naming the
  file and byte offset and the store does not open: silently cutting or skipping it would lose groups
  that ``add`` promised to keep (or serve consumed ones again), and the accounting "served or dropped
  with a reason" would be wrong. ``async-vapo replay fsck PATH`` (:func:`fsck`) reports what is damaged
  and, with ``--apply``, moves the damaged bytes to a quarantine file and rewrites the log from the
  records that are whole.
* A record that passes its CRC but does not decode, or contradicts the log (a duplicate seq, a
  consume of a group that is not live), is also a ``CorruptLogError``: it is a bug or a format
  change, not a torn write.

Compaction rewrites the log as FILE_MAGIC + one SnapshotRecord (next seq, cursor, counters) + one
AppendRecord per live group, into ``<path>.compact.tmp``, fsyncs it, ``os.replace``s it over the log
and fsyncs the directory, so a crash at any moment leaves either the old or the new log (a leftover
temp file is deleted on open). It runs automatically when the log is at least ``compact_min_bytes``
and more than half of it is dead records.

One process owns a log file at a time (``flock``; a second opener gets ``StoreLockedError``). The
store is not thread-safe; ``ReplayBuffer`` serialises access to it.

``path=None`` gives an in-memory store with the same semantics and no durability, for tests and
the one-process trainer.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import msgspec

from async_vapo.types import Group, enc_hook

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX
    fcntl = None

logger = logging.getLogger(__name__)

FILE_MAGIC = b"AVRLOG\x00\x01"
RECORD_MAGIC = b"\xabVR\x01"
_HEADER = struct.Struct("<4sII")
_LEN = struct.Struct("<I")
MAX_RECORD_BYTES = 1 << 30
"""A length field above this is treated as damage, not as a record to read."""

FsyncPolicy = Literal["always", "batch", "never"]


class CorruptLogError(RuntimeError):
    """The log is damaged somewhere other than its tail; ``path`` and ``offset`` say where."""

    def __init__(self, path: str, offset: int, why: str):
        super().__init__(f"{path}: corrupt record at byte offset {offset}: {why}")
        self.path, self.offset, self.why = path, offset, why


class StoreLockedError(RuntimeError):
    """Another open store (this process or another) holds the log file."""


# --- records (store -> its own log file) ---------------------------------------------------------


class AppendRecord(msgspec.Struct, tag="append", kw_only=True):
    """A verified group became live under ``seq``."""

    seq: int
    group: Group


class ConsumeRecord(msgspec.Struct, tag="consume", kw_only=True):
    """Groups ``seqs`` were served in batch ``batch_id`` to the learner at ``learner_version``."""

    batch_id: int
    learner_version: int
    seqs: list[int]


class DropRecord(msgspec.Struct, tag="drop", kw_only=True):
    """Groups ``seqs`` will never be used, because of ``reason`` (stale, overflow, ...)."""

    reason: str
    seqs: list[int]


class SnapshotRecord(msgspec.Struct, tag="snapshot", kw_only=True):
    """Everything the dropped history contributed, written first by compaction."""

    next_seq: int
    batch_id: int
    learner_version: int | None
    max_consumed_seq: int
    consumed_total: int
    dropped: dict[str, int]
    served_ages: dict[int, int]


Record = AppendRecord | ConsumeRecord | DropRecord | SnapshotRecord


class Cursor(msgspec.Struct, frozen=True, kw_only=True):
    """How far consumption has gone. ``batch_id`` 0 / ``max_consumed_seq`` 0: nothing consumed yet."""

    batch_id: int = 0
    learner_version: int | None = None
    """Learner version of the last consumed batch."""
    max_consumed_seq: int = 0
    """Highest seq ever consumed. Not a watermark: selection is by version, so lower seqs may be live."""
    consumed_total: int = 0


class RecoveryReport(msgspec.Struct, frozen=True, kw_only=True):
    """What opening the store found."""

    records: int = 0
    """Valid records replayed."""
    live_groups: int = 0
    torn_tail_truncations: int = 0
    """1 when a torn tail was cut off on open, else 0."""
    truncated_bytes: int = 0
    removed_compaction_tmp: bool = False


class GroupStore:
    """Groups by seq, with their fate recorded durably (see the module docstring)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        fsync: FsyncPolicy = "batch",
        fsync_every: int = 64,
        compact_min_bytes: int = 64 << 20,
    ):
        if fsync not in ("always", "batch", "never"):
            raise ValueError(f"fsync must be 'always', 'batch' or 'never', got {fsync!r}")
        if fsync_every < 1:
            raise ValueError(f"fsync_every must be >= 1, got {fsync_every}")
        self.path = None if path is None else Path(path)
        self.fsync = fsync
        self.fsync_every = fsync_every
        self.compact_min_bytes = compact_min_bytes
        self._encoder = msgspec.msgpack.Encoder(enc_hook=enc_hook)  # groups hold packed arrays
        self._decoder = msgspec.msgpack.Decoder(Record)
        self._buf = bytearray()
        self._live: dict[int, Group] = {}
        self._live_bytes: dict[int, int] = {}
        self._next_seq = 1
        self._cursor = Cursor()
        self._dropped: dict[str, int] = {}
        self._served_ages: dict[int, int] = {}
        self._fd: int | None = None
        self._size = 0
        self._pending_sync = 0
        self._closed = False
        self.recovery = RecoveryReport()
        if self.path is not None:
            self._open()

    # --- public API ------------------------------------------------------------------------------

    def append(self, group: Group) -> int:
        """Store ``group`` durably (per the fsync policy) and return its seq."""
        self._check_open()
        seq = self._next_seq
        size = self._write(AppendRecord(seq=seq, group=group), urgent=False)
        self._apply_append(seq, group, size)
        return seq

    def mark_consumed(self, seqs: Iterable[int], batch_id: int, learner_version: int) -> None:
        """Record that live groups ``seqs`` were served in batch ``batch_id`` (ids strictly increase)."""
        self._check_open()
        seqs = list(seqs)
        if not seqs:
            raise ValueError("mark_consumed needs at least one seq")
        if batch_id <= self._cursor.batch_id:
            raise ValueError(f"batch_id {batch_id} must exceed the cursor's {self._cursor.batch_id}")
        self._require_live(seqs)
        rec = ConsumeRecord(batch_id=batch_id, learner_version=learner_version, seqs=seqs)
        self._write(rec, urgent=True)
        self._apply(rec)
        self._maybe_compact()

    def mark_dropped(self, seqs: Iterable[int], reason: str) -> None:
        """Record that live groups ``seqs`` will never be used, because of ``reason``."""
        self._check_open()
        seqs = list(seqs)
        if not seqs:
            return
        if not reason:
            raise ValueError("a drop needs a reason")
        self._require_live(seqs)
        rec = DropRecord(reason=reason, seqs=seqs)
        self._write(rec, urgent=False)
        self._apply(rec)
        self._maybe_compact()

    def live(self) -> list[tuple[int, Group]]:
        """The live groups, by seq."""
        return list(self._live.items())

    def get(self, seq: int) -> Group:
        return self._live[seq]

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, seq: object) -> bool:
        return seq in self._live

    @property
    def cursor(self) -> Cursor:
        return self._cursor

    @property
    def next_seq(self) -> int:
        """The seq the next append gets; ``next_seq - 1`` groups were ever appended."""
        return self._next_seq

    @property
    def dropped_counts(self) -> dict[str, int]:
        """Groups dropped so far, by reason, over the whole life of the log."""
        return dict(self._dropped)

    @property
    def served_ages(self) -> dict[int, int]:
        """Groups served so far, by age (learner version of the batch minus group version)."""
        return dict(sorted(self._served_ages.items()))

    @property
    def size_bytes(self) -> int:
        return self._size

    def served_after(self, consumed_total: int) -> tuple[list[Group], int]:
        """The groups served after the first ``consumed_total`` groups ever served, in the order they were served,
        read back from the log (memory keeps live groups only), and how many of them compaction has removed from
        it (only a log's own history can be read back). In memory (``path=None``) nothing is kept: ``([], n)``."""
        self._check_open()
        behind = max(0, self._cursor.consumed_total - consumed_total)
        if self.path is None or behind == 0:
            return [], behind
        groups: dict[int, Group] = {}
        served: list[int] = []
        total = 0
        for rec in read_log(self.path):
            if isinstance(rec, AppendRecord):
                groups[rec.seq] = rec.group
            elif isinstance(rec, SnapshotRecord):
                total = rec.consumed_total
            elif isinstance(rec, ConsumeRecord):
                if total >= consumed_total:
                    served += rec.seqs
                elif total + len(rec.seqs) > consumed_total:  # a batch that straddles the cursor: its tail
                    served += rec.seqs[consumed_total - total:]
                total += len(rec.seqs)
        found = [groups[s] for s in served if s in groups]
        return found, behind - len(found)

    def sync(self) -> None:
        """fsync whatever is pending (no-op in memory or with nothing pending)."""
        if self._fd is not None and self._pending_sync:
            os.fsync(self._fd)
            self._pending_sync = 0

    def compact(self) -> None:
        """Rewrite the log as a snapshot plus the live groups; atomic (see the module docstring)."""
        self._check_open()
        if self.path is None:
            return
        tmp = self._tmp_path()
        records: list[Record] = [self._snapshot()]
        records += [AppendRecord(seq=s, group=g) for s, g in self._live.items()]
        sizes: dict[int, int] = {}
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            chunks = [FILE_MAGIC]
            for rec in records:
                data = self._frame(rec)
                if isinstance(rec, AppendRecord):
                    sizes[rec.seq] = len(data)
                chunks.append(data)
            _write_all(fd, b"".join(chunks))
            os.fsync(fd)
            new_fd = os.open(tmp, os.O_RDWR | os.O_APPEND)
        finally:
            os.close(fd)
        try:
            self._lock(new_fd)
            os.replace(tmp, self.path)
            _fsync_dir(self.path.parent)
        except BaseException:
            os.close(new_fd)
            raise
        old = self._fd
        self._fd = new_fd
        self._size = os.fstat(new_fd).st_size
        self._live_bytes = sizes
        self._pending_sync = 0
        if old is not None:
            os.close(old)
        logger.info("%s: compacted to %d live groups, %d bytes", self.path, len(self._live), self._size)

    def close(self) -> None:
        """fsync (unless ``fsync="never"``) and release the file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._fd is not None:
            try:
                if self.fsync != "never":
                    self.sync()
            finally:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> GroupStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- state -----------------------------------------------------------------------------------

    def _apply_append(self, seq: int, group: Group, size: int) -> None:
        self._live[seq] = group
        self._live_bytes[seq] = size
        self._next_seq = max(self._next_seq, seq + 1)

    def _apply(self, rec: Record) -> None:
        if isinstance(rec, ConsumeRecord):
            for s in rec.seqs:
                age = rec.learner_version - self._live.pop(s).version
                self._live_bytes.pop(s, None)
                self._served_ages[age] = self._served_ages.get(age, 0) + 1
            c = self._cursor
            self._cursor = Cursor(
                batch_id=rec.batch_id,
                learner_version=rec.learner_version,
                max_consumed_seq=max(c.max_consumed_seq, *rec.seqs),
                consumed_total=c.consumed_total + len(rec.seqs),
            )
        elif isinstance(rec, DropRecord):
            for s in rec.seqs:
                del self._live[s]
                self._live_bytes.pop(s, None)
            self._dropped[rec.reason] = self._dropped.get(rec.reason, 0) + len(rec.seqs)
        elif isinstance(rec, SnapshotRecord):
            self._next_seq = rec.next_seq
            self._cursor = Cursor(
                batch_id=rec.batch_id,
                learner_version=rec.learner_version,
                max_consumed_seq=rec.max_consumed_seq,
                consumed_total=rec.consumed_total,
            )
            self._dropped = dict(rec.dropped)
            self._served_ages = dict(rec.served_ages)
        else:  # AppendRecord goes through _apply_append, which needs the record's size
            raise TypeError(type(rec))

    def _snapshot(self) -> SnapshotRecord:
        c = self._cursor
        return SnapshotRecord(
            next_seq=self._next_seq,
            batch_id=c.batch_id,
            learner_version=c.learner_version,
            max_consumed_seq=c.max_consumed_seq,
            consumed_total=c.consumed_total,
            dropped=dict(self._dropped),
            served_ages=dict(self._served_ages),
        )

    def _require_live(self, seqs: list[int]) -> None:
        if len(set(seqs)) != len(seqs):
            raise ValueError(f"duplicate seqs in {seqs}")
        missing = [s for s in seqs if s not in self._live]
        if missing:
            raise KeyError(f"seqs not live (unknown, consumed or dropped): {missing}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("store is closed")

    # --- file I/O --------------------------------------------------------------------------------

    def _frame(self, rec: Record) -> bytes:
        self._encoder.encode_into(rec, self._buf)
        n = len(self._buf)
        if n > MAX_RECORD_BYTES:
            raise ValueError(f"record of {n} bytes exceeds MAX_RECORD_BYTES={MAX_RECORD_BYTES}")
        length = _LEN.pack(n)
        crc = zlib.crc32(self._buf, zlib.crc32(length))
        return _HEADER.pack(RECORD_MAGIC, n, crc) + self._buf

    def _write(self, rec: Record, *, urgent: bool) -> int:
        """Frame and write ``rec``; returns its size on disk (0 in memory)."""
        if self._fd is None:
            return 0
        data = self._frame(rec)
        try:
            _write_all(self._fd, data)
        except BaseException:
            # Never leave a partial record in front of later ones: that would turn a harmless torn
            # tail into mid-file corruption on the next open.
            os.ftruncate(self._fd, self._size)
            raise
        self._size += len(data)
        self._pending_sync += 1
        if self.fsync == "always" or (self.fsync == "batch" and (urgent or self._pending_sync >= self.fsync_every)):
            self.sync()
        return len(data)

    def _maybe_compact(self) -> None:
        if self.path is None or self._size < self.compact_min_bytes:
            return
        if 2 * sum(self._live_bytes.values()) < self._size - len(FILE_MAGIC):
            # The record that triggered this is already durable; a failed compaction only means the
            # log stays long, so it is logged rather than failing the caller.
            try:
                self.compact()
            except OSError:
                logger.exception("%s: compaction failed; the log is unchanged", self.path)
                self._tmp_path().unlink(missing_ok=True)

    def _tmp_path(self) -> Path:
        assert self.path is not None
        return self.path.with_name(self.path.name + ".compact.tmp")

    def _lock(self, fd: int) -> None:
        if fcntl is None:  # pragma: no cover
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(f"{self.path} is already open in another GroupStore") from None

    def _open(self) -> None:
        assert self.path is not None
        path = str(self.path)
        tmp = self._tmp_path()
        created = not self.path.exists()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._lock(fd)
            # A temp file from a compaction that crashed before its rename: the log itself is whole.
            removed_tmp = tmp.exists()
            if removed_tmp:
                tmp.unlink()
                logger.warning("%s: removed leftover %s from an interrupted compaction", path, tmp.name)
            with open(fd, "rb", closefd=False) as f:
                data = f.read()
            if len(data) < len(FILE_MAGIC) and FILE_MAGIC.startswith(data):
                # New file, or a crash while writing its first bytes.
                os.ftruncate(fd, 0)
                os.write(fd, FILE_MAGIC)
                os.fsync(fd)
                if created:
                    _fsync_dir(self.path.parent)
                self._size = len(FILE_MAGIC)
                self.recovery = RecoveryReport(removed_compaction_tmp=removed_tmp)
            else:
                if not data.startswith(FILE_MAGIC):
                    raise CorruptLogError(path, 0, "not a replay log (bad file magic)")
                records, good_end = self._replay(data)
                torn = good_end < len(data)
                if torn:
                    logger.warning(
                        "%s: torn tail at byte offset %d: truncated %d bytes (a write interrupted by a crash)",
                        path,
                        good_end,
                        len(data) - good_end,
                    )
                    os.ftruncate(fd, good_end)
                    os.fsync(fd)
                self._size = good_end
                self.recovery = RecoveryReport(
                    records=records,
                    live_groups=len(self._live),
                    torn_tail_truncations=int(torn),
                    truncated_bytes=len(data) - good_end,
                    removed_compaction_tmp=removed_tmp,
                )
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _replay(self, data: bytes) -> tuple[int, int]:
        """Apply every valid record in ``data``; return (records applied, end of the last good one)."""
        path = str(self.path)
        off = len(FILE_MAGIC)
        n = 0
        prev_seq = 0
        while off < len(data):
            end = _valid_record_end(data, off)
            if end is None:
                if _complete_record(data, off):
                    raise CorruptLogError(path, off, "complete record with a bad CRC (acknowledged data damaged; "
                                                     f"`async-vapo replay fsck {path}` quarantines it)")
                if _next_valid_record(data, off + 1) is not None:
                    raise CorruptLogError(path, off, "bad record (magic, length or CRC) followed by valid records "
                                                     f"(`async-vapo replay fsck {path}` quarantines it)")
                return n, off
            try:
                rec = self._decoder.decode(memoryview(data)[off + _HEADER.size : end])
            except msgspec.DecodeError as e:
                raise CorruptLogError(path, off, f"record passes its CRC but does not decode: {e}") from None
            try:
                if isinstance(rec, AppendRecord):
                    if rec.seq <= prev_seq:
                        raise ValueError(f"seq {rec.seq} not above the previous {prev_seq}")
                    prev_seq = rec.seq
                    self._apply_append(rec.seq, rec.group, end - off)
                else:
                    if isinstance(rec, (ConsumeRecord, DropRecord)):
                        self._require_live(rec.seqs)
                    self._apply(rec)
            except (KeyError, ValueError) as e:
                raise CorruptLogError(path, off, f"record contradicts the log: {e}") from None
            n += 1
            off = end
        return n, off


def read_log(path: str | os.PathLike[str]) -> Iterator[Record]:
    """Every whole record of the log at ``path``, in order, up to the first one that is not whole (a torn tail,
    or damage: ``fsck`` tells them apart). Read-only; the log may be open in a ``GroupStore`` meanwhile."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(FILE_MAGIC):
        raise CorruptLogError(str(path), 0, "not a replay log (bad file magic)")
    decoder = msgspec.msgpack.Decoder(Record)
    off = len(FILE_MAGIC)
    while off < len(data):
        end = _valid_record_end(data, off)
        if end is None:
            return
        yield decoder.decode(memoryview(data)[off + _HEADER.size : end])
        off = end


def _valid_record_end(data: bytes, off: int) -> int | None:
    """End offset of the record at ``off`` if its magic, length and CRC are all right, else None."""
    if off + _HEADER.size > len(data):
        return None
    magic, length, crc = _HEADER.unpack_from(data, off)
    end = off + _HEADER.size + length
    if magic != RECORD_MAGIC or length > MAX_RECORD_BYTES or end > len(data):
        return None
    payload = memoryview(data)[off + _HEADER.size : end]
    if zlib.crc32(payload, zlib.crc32(_LEN.pack(length))) != crc:
        return None
    return end


def _complete_record(data: bytes, off: int) -> bool:
    """Whether a whole record (magic, a sane length, every payload byte) is at ``off``, whatever its CRC."""
    if off + _HEADER.size > len(data):
        return False
    magic, length, _ = _HEADER.unpack_from(data, off)
    return magic == RECORD_MAGIC and length <= MAX_RECORD_BYTES and off + _HEADER.size + length <= len(data)


def _next_valid_record(data: bytes, start: int) -> int | None:
    """Offset of the first valid record at or after ``start``, if any."""
    pos = data.find(RECORD_MAGIC, start)
    while pos != -1:
        if _valid_record_end(data, pos) is not None:
            return pos
        pos = data.find(RECORD_MAGIC, pos + 1)
    return None


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --- fsck ----------------------------------------------------------------------------------------


class DamagedRegion(msgspec.Struct, kw_only=True):
    offset: int
    length: int
    kind: Literal["torn_tail", "corrupt"]
    """torn_tail: an incomplete last write (never acknowledged); corrupt: damaged bytes of whole records."""
    records: list[str] = []
    """What the damaged bytes held, where a record in them still decodes (its CRC aside)."""


class FsckReport(msgspec.Struct, kw_only=True):
    path: str
    records_kept: int
    damaged: list[DamagedRegion]
    groups_lost: int
    """Appended groups whose records are damaged (identified ones; ``unidentified_records`` may hold more)."""
    unidentified_records: int
    """Damaged regions, or parts of them, in which no record decodes."""
    dangling_references: int
    """Seqs that whole consume/drop records name but no whole append record holds (dropped from them)."""
    live_groups: int
    quarantine: str | None = None

    @property
    def clean(self) -> bool:
        return not self.damaged


def fsck(path: str | os.PathLike[str], *, apply: bool = False) -> FsckReport:
    """Check a replay log; with ``apply``, quarantine its damaged bytes and rewrite it from the whole records.

    The store must not be open (the log's lock is taken). The rewritten log is compact (a snapshot and the
    live groups, as ``GroupStore.compact`` writes) and opens normally; the damaged bytes go, unchanged, to
    ``<path>.quarantine-<unix seconds>`` beside a JSON report of the same name with ``.json`` appended.
    """
    import json
    import time

    path = Path(path)
    fd = os.open(path, os.O_RDWR)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise StoreLockedError(f"{path} is open in a running replay: stop it first") from None
        with open(fd, "rb", closefd=False) as f:
            data = f.read()
        if not data.startswith(FILE_MAGIC):
            raise CorruptLogError(str(path), 0, "not a replay log (bad file magic)")
        decoder = msgspec.msgpack.Decoder(Record)
        mem = GroupStore(None)
        good: list[Record] = []
        damaged: list[DamagedRegion] = []
        off = len(FILE_MAGIC)
        while off < len(data):
            end = _valid_record_end(data, off)
            rec = None
            if end is not None:
                try:
                    rec = decoder.decode(memoryview(data)[off + _HEADER.size:end])
                except msgspec.DecodeError:
                    rec = None
            if rec is not None:
                good.append(rec)
                off = end
                continue
            nxt = _next_valid_record(data, off + 1)
            stop = len(data) if nxt is None else nxt
            torn = nxt is None and not _complete_record(data, off)
            damaged.append(DamagedRegion(offset=off, length=stop - off, kind="torn_tail" if torn else "corrupt",
                                         records=_describe(data, off, stop, decoder)))
            off = stop
        lost = sum(1 for d in damaged if d.kind == "corrupt" for r in d.records if r.startswith("append"))
        unidentified = sum(1 for d in damaged if d.kind == "corrupt" and not d.records)
        dangling = 0
        for rec in good:
            if isinstance(rec, AppendRecord):
                if rec.seq not in mem._live and rec.seq >= mem._next_seq:
                    mem._apply_append(rec.seq, rec.group, 0)
                continue
            if isinstance(rec, (ConsumeRecord, DropRecord)):
                seqs = [s for s in dict.fromkeys(rec.seqs) if s in mem._live]
                dangling += len(rec.seqs) - len(seqs)
                if not seqs:
                    continue
                rec = msgspec.structs.replace(rec, seqs=seqs)
            mem._apply(rec)
        # Seqs are never reused: past every seq a whole record names, and every damaged append that still decodes.
        named = [int(r.split("seq=")[1].split()[0]) for d in damaged for r in d.records if r.startswith("append")]
        named += [s for rec in good if isinstance(rec, (ConsumeRecord, DropRecord)) for s in rec.seqs]
        mem._next_seq = max([mem._next_seq, *(n + 1 for n in named)])
        report = FsckReport(path=str(path), records_kept=len(good), damaged=damaged, groups_lost=lost,
                            unidentified_records=unidentified, dangling_references=dangling,
                            live_groups=len(mem._live))
        if not apply or report.clean:
            return report
        stamp = int(time.time())
        quarantine = path.with_name(f"{path.name}.quarantine-{stamp}")
        with open(quarantine, "wb") as q:
            for d in damaged:
                q.write(data[d.offset:d.offset + d.length])
            q.flush()
            os.fsync(q.fileno())
        report = msgspec.structs.replace(report, quarantine=str(quarantine))
        Path(f"{quarantine}.json").write_text(json.dumps(msgspec.to_builtins(report), indent=2) + "\n")
        tmp = path.with_name(path.name + ".fsck.tmp")
        records: list[Record] = [mem._snapshot()] + [AppendRecord(seq=s, group=g) for s, g in mem._live.items()]
        with open(tmp, "wb") as f:
            f.write(FILE_MAGIC + b"".join(mem._frame(r) for r in records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        return report
    finally:
        os.close(fd)


def _describe(data: bytes, start: int, stop: int, decoder) -> list[str]:
    """Records that still decode (CRC ignored) in ``data[start:stop]``, as "append seq=3 uid=..." lines."""
    out = []
    pos = data.find(RECORD_MAGIC, start, stop)
    while pos != -1 and pos + _HEADER.size <= stop:
        _, length, _ = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if end <= stop:
            try:
                rec = decoder.decode(memoryview(data)[pos + _HEADER.size:end])
            except msgspec.DecodeError:
                rec = None
            if isinstance(rec, AppendRecord):
                out.append(f"append seq={rec.seq} uid={rec.group.uid} version={rec.group.version}")
            elif rec is not None:
                out.append(f"{type(rec).__name__} {msgspec.to_builtins(rec)}"[:200])
        pos = data.find(RECORD_MAGIC, pos + 1, stop)
    return out
