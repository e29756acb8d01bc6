"""`async-vapo plan`'s arithmetic: parameter counts against real models, memory and sync sizes by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from async_vapo.deploy.scale import (
    QWEN25_32B,
    GiB,
    ModelShape,
    engine_memory,
    learner_memory,
    resolve_shape,
    weight_sync,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("arch, extra", [
    ("qwen2", dict(tie_word_embeddings=False)),
    ("qwen2", dict(tie_word_embeddings=True)),
    ("llama", dict(tie_word_embeddings=False, attention_bias=False)),
])
def test_parameter_count_matches_the_real_model(arch, extra):
    import transformers

    d = dict(model_type=arch, vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=8, num_key_value_heads=2, **extra)
    config = transformers.AutoConfig.for_model(**d)
    model = transformers.AutoModelForCausalLM.from_config(config)
    real = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf_config(d).params() == real


def test_qwen25_32b_by_hand():
    s = ModelShape.from_hf_config(QWEN25_32B)
    # per layer: q 5120x5120 + k, v 5120x1024 each + o 5120x5120 + biases 5120 + 2x1024
    #            + gate/up/down 3 x 5120 x 27648 + two norms 2 x 5120 = 487,605,248
    assert s.layer_params() == 2 * 5120 * 5120 + 2 * 5120 * 1024 + 5120 + 2048 + 3 * 5120 * 27648 + 2 * 5120
    assert s.layer_params() == 487_605_248
    # 64 layers + embedding and lm_head 2 x 152064 x 5120 + final norm 5120 = 32,763,876,352 (Qwen quotes 32.5 B)
    assert s.params() == 64 * 487_605_248 + 2 * 152064 * 5120 + 5120 == 32_763_876_352
    # KV per token in bf16: 2 (K, V) x 64 layers x 8 heads x 128 x 2 B = 256 KiB; TP 4 splits heads, TP 16 cannot
    assert s.kv_bytes_per_token(2) == 262_144
    assert s.kv_bytes_per_token(2, tp=4) == 65_536
    assert s.kv_bytes_per_token(2, tp=16) == 2 * 64 * 1 * 128 * 2


def test_learner_memory_by_hand():
    s = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                   head_dim=2)
    # layer: attn 4x4 + 2x4x4 + 4x4 = 64, mlp 3x4x8 = 96, norms 8 -> 168; params 2x168 + 2x40 + 4 = 420
    assert (s.layer_params(), s.params()) == (168, 420)
    m = learner_memory(s, 3, models=2, tokens=5)
    assert m["sharded_state"] == -(-2 * 420 * 16 // 3) == 4480
    assert m["gathered_layers"] == 2 * 168 * 6
    assert m["activation_checkpoints"] == 2 * 5 * 4 * 2
    assert m["layer_recompute"] == 34 * 5 * 4
    assert m["logits"] == 5 * 10 * 6
    assert m["total"] == 4480 + 2016 + 80 + 680 + 300


def test_engine_memory_and_sync_by_hand():
    s = ModelShape.from_hf_config(QWEN25_32B)
    e = engine_memory(s, 4, gpu_bytes=80 * GiB, utilization=0.85, dtype_bytes=2, seq_tokens=21504)
    assert e["weights"] == 32_763_876_352 * 2 // 4
    assert e["kv_space"] == int(0.85 * 80 * GiB) - e["weights"]
    assert e["kv_per_sequence"] == 65_536 * 21504
    assert e["sequences"] == e["kv_space"] // e["kv_per_sequence"] == 40
    w = weight_sync(s, 6, dtype_bytes=2, bandwidth_bytes_s=50e9)
    assert w["bytes_per_engine"] == 65_527_752_704  # the ~65 GB per version of issue 15
    assert w["seconds_all"] == pytest.approx(6 * 65_527_752_704 / 50e9)


def test_shape_sources(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**QWEN25_32B, "num_hidden_layers": 2}))
    assert resolve_shape(str(tmp_path / "m"))[0].num_layers == 2
    assert resolve_shape("models/Qwen2.5-32B")[1].startswith("published config.json of Qwen2.5-32B")
    with pytest.raises(ValueError, match="not a known shape.*--model-config"):
        resolve_shape(str(tmp_path / "Other-7B"))
    with pytest.raises(ValueError, match="embedded tiny model"):
        resolve_shape(None)


def plan(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "async_vapo.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_plan_for_the_paper_config():
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "async.rollout_devices=24", "async.learner_devices=8",
             "rollout.tensor_parallel_size=4", "--hosts", "4", "--gpus-per-host", "8")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "32.76 B parameters" in out and "6 engine(s)" in out
    assert "rollout-5   host3  CUDA_VISIBLE_DEVICES=4,5,6,7" in out
    assert "122.1 GiB" in out and "DOES NOT FIT 80 GiB" in out  # policy + critic, 16 B/param over 8 ranks
    assert "65.5 GB" in out and "7.86 s" in out


def test_plan_refusals_are_clear():
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "async.rollout_devices=32", "--hosts", "2",
             "--gpus-per-host", "8")
    assert r.returncode == 2 and "async-vapo plan: 32 engine(s)" in r.stderr
    r = plan(str(REPO / "configs/tiny_cpu.toml"), "--hosts", "1", "--gpus-per-host", "8")
    assert r.returncode == 2 and "--model-config" in r.stderr
    r = plan(str(REPO / "configs/tiny_cpu.toml"), "--hosts", "0", "--gpus-per-host", "8")
    assert r.returncode == 2 and ">= 1" in r.stderr
