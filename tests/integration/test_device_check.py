"""deploy/device_check.sh, the GPU check, kept runnable: on the CPU (gloo, a mesh of one) with a 2-layer model
(``--tiny``) it runs every check and writes its JSON; the weight transfer's NCCL step runs over gloo there. The MFU
stage runs on the CPU at a tiny shape and short lengths (``--device cpu --shapes tiny --stages mfu``), and skips what
would overrun its time budget."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, *args: str) -> dict:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([str(ROOT / "deploy/device_check.sh"), str(out), *args], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads((out / "device_check.json").read_text())


def _flops_module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "deploy/device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_device_check_runs_every_check_on_a_tiny_model(tmp_path):
    report = _run(tmp_path, "--tiny", "--stages", "weights,learner")
    assert report["ok"] and report["complete"]
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


def test_mfu_stage_on_the_cpu_reports_throughput_mfu_and_the_plan(tmp_path):
    # the tiny shape runs; the 1.5B shape, estimated at the tiny model's CPU MFU (about 1 %), would take hours of its
    # 330 s budget and is skipped before its model is built
    report = _run(tmp_path, "--device", "cpu", "--shapes", "tiny,qwen2.5-1.5b", "--stages", "mfu",
                  "--mfu-lengths", "64,256", "--mfu-prompt-tokens", "16")
    assert report["ok"] and report["complete"]
    assert set(report["checks"]) == {"mfu_tiny_64", "mfu_tiny_256", "mfu_qwen2.5-1.5b_64", "mfu_qwen2.5-1.5b_256"}
    mfu = report["mfu"]
    assert mfu["peak_source"].startswith("measured") and mfu["peak_bf16_flops"] == mfu["matmul_bf16_flops_measured"]
    dc = _flops_module()
    for length in (64, 256):
        row = report["checks"][f"mfu_tiny_{length}"]
        assert row["ok"] and not row.get("skipped") and row["finite"]
        assert row["response_tokens"] == length and row["tokens_per_update"] == row["rows"] * (16 + length)
        assert len(row["update_s"]) == 2 and all(t > 0 for t in row["update_s"])
        assert row["tokens_per_s"] > 0
        # the MFU is the formula's FLOPs over the measured time and the stated peak, and a fraction of it
        flops = dc.update_flops(dc.hf_shape(*dc.SHAPES["tiny"]), [(16, length)] * row["rows"])["total"]
        assert row["model_flops_per_update"] == flops
        assert math.isclose(row["mfu"], flops / row["update_mean_s"] / mfu["peak_bf16_flops"], rel_tol=1e-9)
        assert 0 < row["mfu"] <= 1 and row["mfu"] < row["mfu_palm_attention"] <= 1
        # the plan's prediction for the same settings; the memory comparison itself needs CUDA
        assert row["plan_gib"] > 0 and row["plan_parts_gib"]["state"] > 0
        assert row["plan_rows_per_micro_batch"] == (4 if length == 64 else 1)  # a budget of 4 x (16 + 64) tokens
        assert row["memory_within_15pct"] is None and "no CUDA device" in row["memory_skipped_reason"]
        skipped = report["checks"][f"mfu_qwen2.5-1.5b_{length}"]
        assert skipped["skipped"] and skipped["estimated_s"] > skipped["left_s"] > 0
        assert "--budget-s" in skipped["reason"]
    assert [(r["shape"], r["response_tokens"]) for r in mfu["rows"]] == [("tiny", 64), ("tiny", 256)]
