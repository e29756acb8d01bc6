#!/usr/bin/env bash
# The learner on a GPU in a few minutes: FSDP2 policy and critic on NCCL, 20k-token responses, value pretraining and
# VAPO updates, chunked = full log-probs, packed = padded (explicit mask, and FlexAttention with its gradients),
# DCP save -> resume, HF export (deploy/device_check.py, stage "learner").
# First, the weight transfer's NCCL step (stage "weights"): a bare NCCL broadcast of 1 GiB in 16 MiB buckets between two
# processes (two GPUs when there are two, else one, which NCCL before 2.30 refuses) against a device memcpy of the same
# bytes. Then a GPU user's first questions (stage "mfu"): tokens/s and model FLOPs utilisation of VAPO updates at the
# Qwen2.5-0.5B and -1.5B shapes with 4k- and 16k-token responses, and peak CUDA memory beside `async-vapo plan`'s.
#
#   deploy/device_check.sh OUT_DIR [device_check.py options]      e.g. --stages mfu --shapes qwen2.5-1.5b, --quick
#   deploy/device_check.sh OUT_DIR --device cpu --shapes tiny --stages mfu        (the CPU smoke run of the mfu stage)
#
# For a machine with torch and transformers but nothing else and no network: the small wheels the learner imports
# (pydantic and its parts, msgspec) travel in deploy/wheels/ (CPython 3.10-3.12, x86_64) and are unpacked into a
# temporary directory when missing; nothing is installed from outside. Results: OUT_DIR/device_check.json and
# OUT_DIR/device_check.log. Runs at most 6 minutes (DEVICE_CHECK_TIMEOUT_S); exit status 0 when every check passed.
set -euo pipefail
OUT=${1:?usage: deploy/device_check.sh OUT_DIR [options]}
shift
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
"$PY" - "$ROOT/deploy/wheels" "$SITE" <<'PYEOF' 2>&1 | tee "$OUT/device_check.log"
import importlib.util, sys, zipfile
from pathlib import Path
wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
need = {"pydantic": ["pydantic-", "pydantic_core-", "annotated_types-", "typing_inspection-", "typing_extensions-"],
        "msgspec": ["msgspec-"]}
for module, prefixes in need.items():
    if importlib.util.find_spec(module) is not None:
        print(f"[device_check.sh] {module}: present")
        continue
    for prefix in prefixes:
        found = [w for w in sorted(wheels.glob(prefix + "*.whl")) if "-py3-none-" in w.name or f"-{tag}-" in w.name]
        if not found:
            sys.exit(f"[device_check.sh] no wheel {prefix}* for {tag} in {wheels}")
        zipfile.ZipFile(found[0]).extractall(site)
        print(f"[device_check.sh] {module}: unpacked {found[0].name}")
PYEOF
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}  # every model is built here: no hub look-up to wait for without a network
NGPU=$("$PY" -c "import torch; print(max(1, torch.cuda.device_count()))")
case " $* " in *" --device cpu "*|*" --device=cpu "*) NGPU=1 ;; esac  # device_check.py hides the GPUs
echo "[device_check.sh] $NGPU device(s); torch $("$PY" -c 'import torch; print(torch.__version__)')" | tee -a "$OUT/device_check.log"
timeout "${DEVICE_CHECK_TIMEOUT_S:-360}" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NGPU" \
    "$ROOT/deploy/device_check.py" "$OUT" "$@" 2>&1 | tee -a "$OUT/device_check.log"
exit "${PIPESTATUS[0]}"
