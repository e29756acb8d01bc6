"""Load the config tree from TOML files layered with ``key.sub=value`` overrides.

A file may name a parent with ``extends = "other.toml"`` (relative to itself); the parent is loaded
first and the child's keys override it. Several files given on the command line are layered left to
right, then the overrides. Every error names the key and the file (or the command line) it came from.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import tomllib
from pydantic import BaseModel, ValidationError

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
    except IsADirectoryError:
        raise ConfigError(f"{path}: a directory, not a config file") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None
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


def _source_of(loc: tuple, sources: Mapping[str, str], message: str = "") -> str:
    """Where the value at ``loc`` came from: a file, "command line" or "defaults".

    A cross-field check reports a section (or the root) as ``loc``; its source is that of the keys under it
    that its message names (each file or the command line once, in that order), else of every key set under it.
    """
    key = ".".join(str(p) for p in loc)
    if key in sources and not any(k.startswith(key + ".") for k in sources):
        return sources[key]
    under = [k for k in sources if not key or k.startswith(key + ".")]
    leaves = [k for k in under if not any(other.startswith(k + ".") for other in under)]
    named = [k for k in leaves if re.search(rf"(?<![\w.]){re.escape(k)}\b|\b{re.escape(k.rsplit('.', 1)[-1])}\b",
                                            message)]
    found = list(dict.fromkeys(sources[k] for k in (named or leaves)))
    if found:
        return ", ".join(found)
    for n in range(len(loc) - 1, 0, -1):  # a value under a key that a file or the command line set whole
        src = sources.get(".".join(str(p) for p in loc[:n]))
        if src:
            return src
    return "defaults"


def _schema_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, type[BaseModel] | None]:
    """Every dotted key of the schema (sections and fields, by their TOML names) -> its model, if a section."""
    keys: dict[str, type[BaseModel] | None] = {}
    for name, field in model.model_fields.items():
        dotted = prefix + (field.alias or name)
        sub = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation,
                                                                                     BaseModel) else None
        keys[dotted] = sub
        if sub is not None:
            keys.update(_schema_keys(sub, dotted + "."))
    return keys


def did_you_mean(key: str) -> str | None:
    """The schema's key nearest to the unknown dotted ``key``: in its own section first, else the same name in
    another section, else the nearest dotted key (difflib); None when nothing is near."""
    keys = _schema_keys()
    section, _, name = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    close = difflib.get_close_matches(name, siblings, n=1, cutoff=0.6)
    if close:
        return f"{section}.{close[0]}" if section else close[0]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == name and k != key]
    if elsewhere:
        return elsewhere[0]
    close = difflib.get_close_matches(key, list(keys), n=1, cutoff=0.75)
    return close[0] if close else None


def _describe(err: dict, sources: Mapping[str, str]) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "<root>"
    source = _source_of(loc, sources, str(err["msg"]))
    if err["type"] == "extra_forbidden":
        near = did_you_mean(key)
        return f"{source}: {key}: unknown key" + (f"; did you mean {near}?" if near else "")
    got = (f" (got {err['input']!r})" if err["type"] != "missing" and not isinstance(err.get("input"), dict)
           else "")
    return f"{source}: {key}: {err['msg']}{got}"


def _name_after_the_file(data: dict, paths: list[Path], sources: Mapping[str, str]) -> None:
    """``train.name`` = the last config file's stem (``configs/foo.toml`` -> ``foo``, so runs/foo), unless one of the
    files on the command line or an override sets it: a name inherited through ``extends`` names the parent's runs,
    not this file's."""
    own = {"command line", *(str(p.expanduser().resolve()) for p in paths)}
    train = data.setdefault("train", {})
    if paths and isinstance(train, dict) and sources.get("train.name") not in own:
        train["name"] = paths[-1].stem


def load_config(paths: Iterable[str | Path] = (), overrides: Iterable[str] = ()) -> Config:
    sources: dict[str, str] = {}
    data: dict = {}
    paths = [Path(p) for p in paths]
    for p in paths:
        _merge(data, _read_toml(p, sources), "", {})
    for text in overrides:
        keys, value = parse_override(text)
        nested: Any = value
        for k in reversed(keys):
            nested = {k: nested}
        _merge(data, nested, "command line", sources)
    _name_after_the_file(data, paths, sources)
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        lines = [_describe(err, sources) for err in e.errors()]
        raise ConfigError("invalid config: " + lines[0] if len(lines) == 1 else
                          "invalid config:\n  " + "\n  ".join(lines)) from None


def save_resolved(cfg: Config, run_dir: Path) -> Path:
    """Write the fully resolved config beside a run's outputs (TOML-like JSON, every field explicit)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    out = run_dir / "config.resolved.json"
    out.write_text(json.dumps(cfg.model_dump(mode="json", by_alias=True), indent=2) + "\n")
    return out
