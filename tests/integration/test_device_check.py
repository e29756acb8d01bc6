"""deploy/device_check.sh, the GPU check, kept runnable: on the CPU (gloo, a mesh of one) with a 2-layer model
(``--tiny``) it runs every check and writes its JSON; the weight transfer's NCCL step runs over gloo there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_device_check_runs_every_check_on_a_tiny_model(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([str(ROOT / "deploy/device_check.sh"), str(tmp_path), "--tiny"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["ok"]
    assert set(report["checks"]) == {"vllm_engine_steps", "finite_losses", "weights_moved", "throughput",
                                     "chunked_equals_full", "packed_equals_padded", "flex_packed_equals_padded",
                                     "dcp_resume_same_next_step", "export_same_logits", "vllm_nccl_weight_transfer",
                                     "nccl_weight_transfer"}
    assert report["checks"]["vllm_engine_steps"]["skipped"]
    assert report["checks"]["flex_packed_equals_padded"]["skipped"]  # CUDA only
    assert report["checks"]["vllm_nccl_weight_transfer"]["skipped"]
    # no GPU: the weight transfer's step ran over gloo between two processes, exactly, and is skipped as NCCL
    bcast = report["checks"]["nccl_weight_transfer"]
    assert bcast["skipped"] and bcast["backend"] == "gloo" and bcast["received_exact"] and bcast["ok"]
    assert bcast["broadcast_median_s"] > 0 and bcast["memcpy_median_s"] > 0 and bcast["bytes"] == 4 << 20
    assert (tmp_path / "device_check.log").read_text().count("[device_check]") >= 11
