"""vLLM's "RotaryEmbedding: Failed to load weights" at every in-place load: the rotary layer holds only its computed
cos/sin cache, which no checkpoint holds and which the reload puts back unchanged (``async_vapo.rollout.worker_ext``).
A load on the session's engine emits no such warning, and still serves exactly the loaded weights."""

from __future__ import annotations

import torch
from conftest import assert_engine_serves


def test_a_load_warns_about_no_layer_and_serves_the_weights(vllm_engine, tiny_base, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.rollout.worker_ext import computed_only_layers

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p, generator=torch.Generator().manual_seed(5)))
    path = tmp_path / "v1.safetensors"
    save_file({k: t.clone().contiguous() for k, t in policy.state_dict().items()}, path)
    # the layers whose only tensors are computed buffers: in HF's model as in vLLM's, the rotary embedding alone
    assert computed_only_layers(policy) == {"Qwen2RotaryEmbedding"}
    try:
        for _ in range(2):  # the first load installs the filter; the second finds it there
            (stats,) = vllm_engine.llm.collective_rpc("async_vapo_load_weights", args=(str(path),))
            assert stats["not_loaded"] == []  # nothing shown: before the filter, ["RotaryEmbedding"] at every load
            assert stats["quiet_layers"] >= 1  # vLLM did warn about its rotary layer, and that warning was dropped
            assert_engine_serves(vllm_engine, policy, tok)  # the cos/sin cache it kept is the right one
    finally:
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
