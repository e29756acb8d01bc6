"""``async-vapo plan`` with LoRA (``model.lora``): the adapter's parameter count is peft's own on a real model, and
the learner's state is a frozen float32 base plus 16 B per adapter parameter (masters, AdamW m and v, gradients)."""

from __future__ import annotations

from async_vapo.deploy.scale import QWEN25_7B, LearnerSetup, ModelShape, state_bytes, weight_sync
from async_vapo.models import lora
from async_vapo.models.tiny import build_char_tokenizer, build_tiny_qwen2

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_the_adapter_count_is_peft_s():
    tok = build_char_tokenizer()
    model = build_tiny_qwen2(len(tok), hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                             intermediate_size=96, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, seed=0)
    shape = ModelShape.from_hf_config(model.config.to_dict())
    assert shape.params() == sum(p.numel() for p in model.parameters())
    lora.add_lora(model, lora.peft_config(8, 16, TARGETS[:3]))
    adapter = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # per layer: q 8 x (64 + 64), k and v 8 x (64 + 32) each = 1024 + 768 + 768 = 2560; x 3 layers
    assert adapter == shape.lora_params(8, TARGETS[:3]) == 7680


def test_lora_state_and_sync_bytes_of_the_7b_model():
    shape = ModelShape.from_hf_config(QWEN25_7B)
    p, a = shape.params(), shape.lora_params(16, TARGETS)
    assert 0.004 < a / p < 0.007  # rank 16 on every linear layer of Qwen2.5-7B: about half a percent
    full = LearnerSetup(ranks=1, models=1, seq_tokens=1, rows=1, sharded=False)
    with_lora = LearnerSetup(ranks=1, models=1, seq_tokens=1, rows=1, sharded=False, lora_rank=16,
                             lora_targets=TARGETS)
    assert state_bytes(shape, full) == 16 * p
    assert state_bytes(shape, with_lora) == 4 * p + 16 * a
    critic = LearnerSetup(ranks=4, models=2, seq_tokens=1, rows=1, lora_rank=16, lora_targets=TARGETS)
    assert state_bytes(shape, critic) == (4 * p + 12 * a + 12 * p + 4 * p) // 4
    ws = weight_sync(shape, 2, dtype_bytes=2, bandwidth_bytes_s=1e9, adapter_params=a)
    assert ws["bytes_per_engine"] == 4 * a and ws["bytes_total"] == 8 * a
