"""The built models that ship inside the package, so a first run need not build them.

``async_vapo/models/shipped/`` holds the embedded default's base model and reward-like critic
(``configs/tiny_cpu.toml``), as ``async-vapo make-base --ship`` copied them from the model cache: each in
the directory it has in the cache (``tiny-base-<key>``, ``tiny-rm-<key>``), with ``MANIFEST.json``
listing the key and every file's SHA-256. When a config asks for a model whose key the manifest lists, the
shipped copy is verified against the manifest and copied into ``model.cache_dir``. A copy that does not
match its manifest is never used: the caller builds the model instead and says why.

The key is the build's cache key (``base_model_key``, ``reward_critic_key``): it covers every setting the
recipe reads and the recipe's version, so a shipped model is used only by configs that would build it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
MANIFEST = "MANIFEST.json"


class ShippedModelError(RuntimeError):
    """A shipped model does not match its manifest."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def manifest(shipped_dir: Path | None = None) -> dict:
    """The manifest (``{"models": {kind: {"dir", "key", "files": {name: sha256}}}, ...}``); empty if none."""
    path = (shipped_dir or SHIPPED_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"models": {}}


def shipped_model(kind: str, key: str, shipped_dir: Path | None = None) -> Path | None:
    """The verified shipped directory of ``kind`` ("base", "reward_critic") built under ``key``; None when
    none ships for that key. Raises :class:`ShippedModelError` when its files do not match the manifest."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    entry = manifest(shipped_dir)["models"].get(kind)
    if entry is None or entry["key"] != key:
        return None
    d = shipped_dir / entry["dir"]
    present = {p.name for p in d.iterdir()} if d.is_dir() else set()
    missing = sorted(set(entry["files"]) - present)
    if missing:
        raise ShippedModelError(f"shipped {kind} model {d} lacks {', '.join(missing)}")
    for name, digest in entry["files"].items():
        got = sha256_file(d / name)
        if got != digest:
            raise ShippedModelError(f"shipped {kind} model file {d / name} has SHA-256 {got[:16]}..., its manifest "
                                    f"says {digest[:16]}...")
    return d


def install_shipped(kind: str, key: str, dest: Path, shipped_dir: Path | None = None) -> bool:
    """Copy the shipped model of ``kind`` built under ``key`` to ``dest`` (a cache directory) after checking
    it; False when none ships for ``key``. Raises :class:`ShippedModelError` on a damaged copy."""
    src = shipped_model(kind, key, shipped_dir)
    if src is None:
        return False
    tmp = dest.with_name(f"{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    try:
        tmp.rename(dest)
    except OSError:  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    return True


def ship(models: dict[str, tuple[str, Path]], shipped_dir: Path | None = None, recipe: str = "") -> Path:
    """Replace the shipped models by ``models`` (kind -> (key, built cache directory)) and write the manifest."""
    import torch
    import transformers

    shipped_dir = shipped_dir or SHIPPED_DIR
    shipped_dir.mkdir(parents=True, exist_ok=True)
    for p in shipped_dir.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
    entries = {}
    for kind, (key, src) in models.items():
        if not (src / "BUILD_DONE").exists():
            raise ShippedModelError(f"{src} is not a finished build (no BUILD_DONE)")
        dst = shipped_dir / src.name
        shutil.copytree(src, dst)
        for p in dst.iterdir():
            p.chmod(0o644)
        entries[kind] = {"dir": src.name, "key": key,
                         "files": {p.name: sha256_file(p) for p in sorted(dst.iterdir()) if p.is_file()}}
    out = {"recipe": recipe, "torch": torch.__version__, "transformers": transformers.__version__, "models": entries}
    (shipped_dir / MANIFEST).write_text(json.dumps(out, indent=2) + "\n")
    return shipped_dir
