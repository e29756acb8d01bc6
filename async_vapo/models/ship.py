"""The built models that ship inside the package, so a first run need not build them.

``async_vapo/models/shipped/`` holds the builds of the shipped tiny configs (the embedded default,
``configs/tiny_cpu.toml``, and the long-response task, ``configs/tiny_long_cpu.toml``): base models and
reward-like critics, as ``async-vapo make-base --ship`` copied them from the model cache, each in the directory
it has in the cache (``tiny-base-<key>``, ``tiny-rm-<key>``), with ``MANIFEST.json`` listing for each its kind,
key, the command that built it and every file's SHA-256. When a config asks for a model whose key the manifest
lists, the shipped copy is verified against the manifest and copied into ``model.cache_dir``. A copy that does
not match its manifest is never used: the caller builds the model instead and says why.

Shipping is what makes a build reproducible across machines: a build is deterministic on one CPU, but kernels
round differently on another and a long SFT amplifies it (the long task's recipe sits near a loss plateau, so
two CPUs can build models of different quality from the same recipe). ``--ship`` from another config adds
its builds beside those shipped; shipping from the same command again replaces that command's builds.

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
    """The manifest (``{"models": [{"kind", "key", "dir", "recipe", "files": {name: sha256}}, ...], ...}``); no
    models if none. A manifest of the earlier one-build-per-kind layout (``{"models": {kind: entry}}``) is read as
    the same list."""
    path = (shipped_dir or SHIPPED_DIR) / MANIFEST
    data = json.loads(path.read_text()) if path.is_file() else {"models": []}
    if isinstance(data.get("models"), dict):
        data["models"] = [{"kind": kind, "recipe": data.get("recipe", ""), **entry}
                          for kind, entry in data["models"].items()]
    return data


def shipped_entry(kind: str, key: str, shipped_dir: Path | None = None) -> dict | None:
    """The manifest's entry of ``kind`` built under ``key``; None when none ships."""
    return next((e for e in manifest(shipped_dir)["models"] if e["kind"] == kind and e["key"] == key), None)


def shipped_model(kind: str, key: str, shipped_dir: Path | None = None) -> Path | None:
    """The verified shipped directory of ``kind`` ("base", "reward_critic") built under ``key``; None when
    none ships for that key. Raises :class:`ShippedModelError` when its files do not match the manifest."""
    shipped_dir = shipped_dir or SHIPPED_DIR
    entry = shipped_entry(kind, key, shipped_dir)
    if entry is None:
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


def _command(recipe: str) -> list[str]:
    """A make-base command line without the flags that do not change what it builds."""
    return [w for w in recipe.split() if w not in ("--force", "--ship")]


def ship(models: dict[str, tuple[str, Path]], shipped_dir: Path | None = None, recipe: str = "") -> Path:
    """Ship ``models`` (kind -> (key, built cache directory)), built by the command ``recipe``, and write the
    manifest. They replace the shipped builds of the same kind and key and those the same command (``--force``
    aside) shipped before; other configs' builds stay."""
    import torch
    import transformers

    shipped_dir = shipped_dir or SHIPPED_DIR
    shipped_dir.mkdir(parents=True, exist_ok=True)
    for _key, src in models.values():
        if not (src / "BUILD_DONE").exists():
            raise ShippedModelError(f"{src} is not a finished build (no BUILD_DONE)")
    new = {(kind, key) for kind, (key, _) in models.items()}
    kept = [e for e in manifest(shipped_dir)["models"]
            if (e["kind"], e["key"]) not in new and _command(e["recipe"]) != _command(recipe)]
    entries = []
    for kind, (key, src) in models.items():
        dst = shipped_dir / src.name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
        for p in dst.iterdir():
            p.chmod(0o644)
        files = {p.name: sha256_file(p) for p in sorted(dst.iterdir()) if p.is_file()}
        entries.append({"kind": kind, "key": key, "dir": src.name, "recipe": recipe, "torch": torch.__version__,
                        "transformers": transformers.__version__, "files": files})
    listed = {e["dir"] for e in kept + entries}
    for p in shipped_dir.iterdir():
        if p.is_dir() and p.name not in listed:
            shutil.rmtree(p)
    out = {"models": kept + entries}
    (shipped_dir / MANIFEST).write_text(json.dumps(out, indent=2) + "\n")
    return shipped_dir
