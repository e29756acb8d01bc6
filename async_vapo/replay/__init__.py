"""Replay: durable, staleness-bounded storage of verified groups between verifier and learner.

``GroupStore`` keeps groups and their fate (consumed / dropped) in a CRC-checked append-only log;
``ReplayBuffer`` turns it into batches of whole groups that never break the staleness bound.
"""

from async_vapo.replay.buffer import (
    DROP_FUTURE,
    DROP_OVERFLOW,
    DROP_STALE,
    Batch,
    InvalidGroupError,
    ReplayBuffer,
    ReplayStats,
    validate_group,
)
from async_vapo.replay.store import CorruptLogError, Cursor, GroupStore, RecoveryReport, StoreLockedError

__all__ = [
    "DROP_FUTURE",
    "DROP_OVERFLOW",
    "DROP_STALE",
    "Batch",
    "CorruptLogError",
    "Cursor",
    "GroupStore",
    "InvalidGroupError",
    "RecoveryReport",
    "ReplayBuffer",
    "ReplayStats",
    "StoreLockedError",
    "validate_group",
]
