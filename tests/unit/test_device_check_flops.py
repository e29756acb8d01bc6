"""The MFU stage's FLOP count (deploy/device_check.py ``update_flops``): hand-computed values, a naive per-query
loop for causal attention, and PaLM's per-token formula in the long-sequence limit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from async_vapo.deploy.scale import ModelShape

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dc():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "deploy/device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


TOY = ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=2, num_kv_heads=1,
                 head_dim=2, tie_embeddings=True, qkv_bias=True)


def test_update_flops_by_hand(dc):
    # one layer, h 4, 2 heads and 1 KV head of 2, I 8, V 10; one row of 1 prompt + 2 response tokens (T = 3)
    # matmul weights: q 4*4 + k, v 2*4*2 + o 4*4 + gate, up, down 3*4*8 = 16 + 16 + 16 + 96 = 144
    # forward, dense 2*144*3 = 864; causal attention 2*1*4*3*4 = 96 (queries meet 1, 2, 3 keys: 4*4*(1+2+3));
    # policy head on the 2 response tokens 2*4*10*2 = 160; critic head on all 3: 2*4*1*3 = 24
    # policy forward 864 + 96 + 160 = 1120, critic 864 + 96 + 24 = 984
    # update: (1 old log-prob forward + 3 forward-backward) x each: 4*1120 + 4*984 = 8416; attention 8 x 96 = 768
    f = dc.update_flops(TOY, [(1, 2)])
    assert f["matmul_params_per_layer"] == 144
    assert (f["policy_forward"], f["critic_forward"], f["total"], f["attention"]) == (1120, 984, 8416, 768)
    assert f["tokens"] == 3 and f["per_token"] == 8416 / 3
    # epochs multiply the forward-backward passes only; no critic: the policy's alone
    g = dc.update_flops(TOY, [(1, 2)], ppo_epochs=2, critic_epochs=3, critic=False)
    assert g["total"] == 7 * 1120 and g["critic_forward"] == 0


def test_causal_attention_against_a_per_query_loop(dc):
    shape = dc.hf_shape(*dc.SHAPES["tiny"])
    rows = [(5, 7), (3, 20)]
    q = shape.num_heads * shape.head_dim
    # each query i (1-based) of a row: QK^T over its i keys and AV over them, 2*q*i multiply-add FLOPs each
    loop = sum(2 * 2 * q * i for p, r in rows for i in range(1, p + r + 1)) * shape.num_layers
    f = dc.update_flops(shape, rows)
    assert f["attention"] == loop * (4 + 4)  # forward + 3x forward-backward, policy and critic
    # attention's share of a row depends only on its length: rows of one length concatenated scale it by their count
    assert dc.update_flops(shape, [(5, 7)] * 3)["total"] == 3 * dc.update_flops(shape, [(5, 7)])["total"]


def test_long_sequence_limit_is_palm_with_causal_attention_halved(dc):
    # PaLM (arXiv:2204.02311, App. B): 6N + 12*L*H*Q*T per token for forward + backward, N the matmul weights; with
    # the causal half of the scores only, 6N + 6*L*H*Q*T. No head (its cost is the tied embedding's: a response
    # token's 2*V*h per forward) and no prompt: one forward-backward of the policy is 3/4 of its 4 passes.
    shape = dc.hf_shape(*dc.SHAPES["qwen2.5-0.5b"])
    t = 16384
    f = dc.update_flops(shape, [(t, 0)], critic=False)
    per_token = 0.75 * f["total"] / t
    n = shape.num_layers * f["matmul_params_per_layer"]
    palm_causal = 6 * n + 6 * shape.num_layers * shape.num_heads * shape.head_dim * t
    assert per_token == pytest.approx(palm_causal, rel=1 / t)
    assert f["matmul_params_per_layer"] * shape.num_layers == pytest.approx(0.358e9, rel=0.01)  # 0.36 B non-embedding


def test_peak_by_device_name(dc):
    assert dc.peak_bf16("NVIDIA H200")[0] == 989e12
    assert dc.peak_bf16("NVIDIA H200 NVL")[0] == 835e12
    assert dc.peak_bf16("NVIDIA H100 PCIe")[0] == 756e12
    assert dc.peak_bf16("NVIDIA A100-SXM4-80GB")[0] == 312e12
    assert dc.peak_bf16("Some GPU")[0] is None
