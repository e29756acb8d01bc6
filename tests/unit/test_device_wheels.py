"""deploy/wheels/ holds what the learner imports beyond the GPU image's torch and transformers (pydantic and its
parts, msgspec), at the versions of this venv, for the image's CPython 3.12 (and 3.10, 3.11) on x86-64:
deploy/device_check.sh unpacks them where they are missing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / "deploy" / "wheels"
CARRIED = {"pydantic": "pydantic", "pydantic_core": "pydantic-core", "annotated_types": "annotated-types",
           "typing_inspection": "typing-inspection", "typing_extensions": "typing-extensions", "msgspec": "msgspec"}
"""Wheel name prefix -> distribution."""
BINARY = {"pydantic_core", "msgspec"}
IMAGE = {"torch", "transformers", "tokenizers", "safetensors", "numpy"}
"""Third-party packages the GPU image has (torch 2.11 + transformers and their dependencies)."""
# the modules deploy/device_check.py imports from the library, at their top level
CHECK_IMPORTS = ["async_vapo.config", "async_vapo.deploy.scale", "async_vapo.learner.export",
                 "async_vapo.learner.process_group", "async_vapo.learner.sharding", "async_vapo.learner.vapo",
                 "async_vapo.models.rl", "async_vapo.models.tiny", "async_vapo.types"]


def _wheels() -> dict[str, list[tuple[str, str]]]:
    """Wheel name prefix -> [(version, tag)] of the files in deploy/wheels."""
    out: dict[str, list[tuple[str, str]]] = {}
    for w in sorted(WHEELS.glob("*.whl")):
        name, ver, py, *_ = w.name[:-4].split("-")
        out.setdefault(name, []).append((ver, py))
    return out


def test_the_wheels_are_this_venvs_versions_for_cpython_3_10_to_3_12():
    wheels = _wheels()
    assert set(wheels) == set(CARRIED), f"deploy/wheels holds {sorted(wheels)}, not {sorted(CARRIED)}"
    for prefix, dist in CARRIED.items():
        versions = {v for v, _ in wheels[prefix]}
        assert versions == {version(dist)}, f"{prefix}: wheels {sorted(versions)}, the venv has {version(dist)}"
        tags = {t for _, t in wheels[prefix]}
        assert tags == ({"cp310", "cp311", "cp312"} if prefix in BINARY else {"py3"}), (prefix, tags)
    for w in WHEELS.glob("*-cp3*.whl"):
        assert "manylinux" in w.name and w.name.endswith("_x86_64.whl"), w.name


def test_each_wheels_requirements_are_carried():
    carried = {dist: version(dist) for dist in CARRIED.values()}
    for w in sorted(WHEELS.glob("*.whl")):
        with zipfile.ZipFile(w) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        for req in re.findall(r"^Requires-Dist: (.+)$", meta, re.M):
            if "extra ==" in req or "python_version <" in req:
                continue
            dist = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-")
            assert dist in carried, f"{w.name} requires {req}, which deploy/wheels does not carry"
            pinned = re.search(r"==\s*([\w.]+)", req)
            if pinned:
                assert carried[dist] == pinned.group(1), f"{w.name} pins {req}; carried {carried[dist]}"


def test_the_check_imports_nothing_beyond_the_image_and_the_wheels():
    # which third-party packages the library modules import directly (the packages' own imports are theirs)
    probe = f"""
import builtins, json, sys
seen, orig = set(), builtins.__import__
def imp(name, globals=None, locals=None, fromlist=(), level=0):
    caller = (globals or {{}}).get("__name__") or ""
    top = name.split(".")[0]
    if level == 0 and caller.startswith("async_vapo") and top not in sys.stdlib_module_names and top != "async_vapo":
        seen.add(top)
    return orig(name, globals, locals, fromlist, level)
builtins.__import__ = imp
import importlib
for m in {CHECK_IMPORTS!r}:
    importlib.import_module(m)
print(json.dumps(sorted(seen)))
"""
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    seen = set(json.loads(res.stdout.splitlines()[-1]))
    assert {"torch", "pydantic", "msgspec"} <= seen  # the probe sees the imports
    carried = IMAGE | {"pydantic", "msgspec"}
    assert seen <= carried, f"not on the GPU image nor in deploy/wheels: {sorted(seen - carried)}"
