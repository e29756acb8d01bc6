"""Load the config tree from TOML files layered with ``key.sub=value`` overrides.

A file may name a parent with ``extends = "other.toml"`` (relative to itself); the parent is loaded
first and the child's keys override it. Several files given on the command line are layered left to
right, then the overrides. Every error names the key and the file (or the command line) it came from.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib
from pydantic import ValidationError

from async_vapo.config.schema import Config


class ConfigError(ValueError):
    """A config file or override is malformed, names an unknown key or holds a bad value."""


def _merge(dst: dict, src: Mapping, origin: str, sources: dict[str, str], prefix: str = "") -> None:
    for key, value in src.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _merge(dst[key], value, origin, sources, dotted + ".")
        elif isinstance(value, Mapping):
            dst[key] = {}
            _merge(dst[key], value, origin, sources, dotted + ".")
        else:
            dst[key] = value
        sources[dotted] = origin


def _read_toml(path: Path, sources: dict[str, str], seen: tuple[Path, ...] = ()) -> dict:
    path = path.expanduser().resolve()
    if path in seen:
        raise ConfigError(f"{path}: 'extends' cycle through {' -> '.join(map(str, seen))}")
    try:
        if path.suffix == ".json":  # a run's config.resolved.json
            data = json.loads(path.read_text())
        else:
            data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except (tomllib.TOMLDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {e}") from None
    merged: dict = {}
    parent = data.pop("extends", None)
    if parent is not None:
        if not isinstance(parent, str):
            raise ConfigError(f"{path}: 'extends' must be a file name, got {parent!r}")
        merged = _read_toml(path.parent / parent, sources, seen + (path,))
    _merge(merged, data, str(path), sources)
    return merged


def parse_override(text: str) -> tuple[list[str], Any]:
    """``algo.eps_high=0.3`` -> (["algo", "eps_high"], 0.3). Values are TOML literals; bare words are strings."""
    key, sep, raw = text.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"command line: override {text!r} is not of the form key.sub=value")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    if raw.lower() in ("none", "null"):
        value = None
    return key.split("."), value


def _source_of(loc: tuple, sources: Mapping[str, str]) -> str:
    parts = [str(p) for p in loc]
    for n in range(len(parts), 0, -1):
        src = sources.get(".".join(parts[:n]))
        if src:
            return src
    return "defaults"


def load_config(paths: Iterable[str | Path] = (), overrides: Iterable[str] = ()) -> Config:
    sources: dict[str, str] = {}
    data: dict = {}
    for p in paths:
        _merge(data, _read_toml(Path(p), sources), "", {})
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _merge(data, nested, "command line", sources)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = tuple(err["loc"])
            key = ".".join(str(p) for p in loc) or "<root>"
            lines.append(f"{_source_of(loc, sources)}: {key}: {err['msg']}"
                         + (f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(
                             err.get("input"), dict) else ""))
        raise ConfigError("invalid config:\n  " + "\n  ".join(lines)) from None


def save_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the fully resolved config beside a run's outputs (TOML-like JSON, every field explicit)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.resolved.json"
    out.write_text(json.dumps(cfg.model_dump(mode="json", by_alias=True), indent=2) + "\n")
    return out
