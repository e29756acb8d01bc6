"""Weights as one safetensors file per version (``cluster.weights.transfer = "file"``): works across hosts over a
shared filesystem; each file is written atomically and announced with its size and crc32."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from async_vapo.transport.interface import blob_checksum
from async_vapo.transport.messages import WeightsAnnounce
from async_vapo.weights.layout import unshared_state


def write_file_version(directory: Path, version: int, state: Mapping) -> WeightsAnnounce:
    """``cluster.weights.transfer = "file"``: ``state`` as one safetensors file, written atomically."""
    from safetensors.torch import save

    data = save(unshared_state(state))
    path = directory / f"policy-v{version}.safetensors"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return WeightsAnnounce(version=version, transfer="file", location=str(path), nbytes=len(data),
                           checksum=blob_checksum(data))
