"""FSDP2 on one gloo rank (``async_vapo.learner.sharding``): the learner's forwards through a sharded policy and
critic return no view tensors, so FSDP2 has no "returned a view tensor" warning to give (an in-place op on such a
view would drop FSDP2's pre-backward hook and skip the all-gather), and their gradients are the unwrapped model's.

Tolerance: gradients atol 1e-6 (one rank, float32: the same sums; measured ~1e-8)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

from async_vapo.algo.utils import logprobs_from_logits
from async_vapo.learner import sharding
from async_vapo.models.rl import (
    CriticDesign,
    apply_critic_design,
    chunked_response_logprobs,
    make_token_batch,
    response_logits,
    response_values,
)

CONFIG = {"vocab_size": 40, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "num_labels": 1, "classifier_dropout": 0.0}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo group (a file store: no port) and its 1-D mesh, as a sharded learner's (learner.fsdp = on)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    finally:
        dist.destroy_process_group()


def _batch():
    return make_token_batch([[1, 2, 3], [4, 5]], [[6, 7, 8, 9, 3], [10, 11]], 0)


def _sharded(make, mesh) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(unwrapped, sharded) copies of one freshly initialised model, sharded as the learner shards (per decoder
    layer, weights loaded by rank 0), a policy with the chunked log-prob method registered as the learner does."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    torch.manual_seed(0)
    ref = make().eval()
    model = sharding.load_sharded(make, lambda: ref, mesh, torch.device("cpu"), compute_dtype=torch.float32)
    if hasattr(model, "lm_head"):
        model.chunked_response_logprobs = types.MethodType(chunked_response_logprobs, model)
        register_fsdp_forward_method(model, "chunked_response_logprobs")
    return ref, model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def _forward_backward(model, fn) -> list[str]:
    """Run ``fn(model)`` (a scalar) forward and backward; the FSDP2 view warnings it raised."""
    model.zero_grad(set_to_none=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(model).backward()
    return [str(w.message) for w in caught if "returned a view tensor" in str(w.message)]


def _policy_full(model):
    b = _batch()
    lp = logprobs_from_logits(response_logits(model, b, temperature=0.7), b.response_ids)
    return torch.where(b.response_mask.bool(), lp * torch.arange(1.0, 6.0), 0.0).sum()


def _policy_chunked(model):
    b = _batch()
    fn = getattr(model, "chunked_response_logprobs", None)
    lp, ent = fn(b, 0.7, 3) if fn is not None else chunked_response_logprobs(model, b, 0.7, 3)
    return torch.where(b.response_mask.bool(), lp - 0.3 * ent, 0.0).sum()


def _critic(model):
    b = _batch()
    lp = torch.full(b.response_ids.shape, -0.5)
    v = response_values(model, b, logprobs=lp)
    return torch.where(b.response_mask.bool(), (v - 1.0).square(), 0.0).sum()


def _policy():
    return AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG))


def _critic_of(design):
    return lambda: apply_critic_design(AutoModelForTokenClassification.from_config(Qwen2Config(**CONFIG)), design)


CASES = {
    "policy-logits": (_policy, _policy_full),
    "policy-chunked": (_policy, _policy_chunked),
    "critic-linear": (_critic_of(CriticDesign()), _critic),
    "critic-layers": (_critic_of(CriticDesign(head_layers=1)), _critic),
    "critic-layers+logprobs": (_critic_of(CriticDesign(head_layers=1, logprobs=True)), _critic),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_forwards_return_no_views_and_the_unwrapped_gradients(mesh, case):
    make, fn = CASES[case]
    ref, model = _sharded(make, mesh)
    assert sharding.is_sharded(model)
    assert _forward_backward(model, fn) == []
    _forward_backward(ref, fn)
    want, got = _grads(ref), _grads(model)
    assert got.keys() == want.keys()
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=1e-6, msg=name)
        # not vacuous: every trunk weight has a gradient (behind a design's zero-initialised outputs some have none)
        assert name.startswith("score.") or g.abs().max() > 0, name
