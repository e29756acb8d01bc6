"""Weight pushes into the running engine: the shared-memory buffer, and every path served end to end."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest
import torch
from conftest import assert_engine_serves

from async_vapo.rollout.engine import SharedWeightBuffer


def _read_back(path: str, nbytes: int, layout) -> dict[str, torch.Tensor]:
    """What a worker sees: views of the mapped file at the layout's offsets (as worker_ext builds them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    data = bytes(buf)
    buf.close()
    out = {}
    for name, dtype, shape, offset in layout:
        dt = getattr(torch, dtype)
        count = int(torch.Size(shape).numel())
        out[name] = torch.frombuffer(bytearray(data[offset: offset + count * dt.itemsize]), dtype=dt).view(shape)
    return out


def test_shared_buffer_holds_every_tensor_at_an_aligned_offset(tmp_path):
    emb = torch.randn(7, 3)
    state = {"embed.weight": emb, "norm.weight": torch.randn(3).bfloat16(), "scale": torch.tensor(2.5),
             "t.weight": torch.randn(3, 5).t(),  # not contiguous
             "lm_head.weight": emb}  # tied: stored under both names
    buf = SharedWeightBuffer(str(tmp_path))
    path, nbytes, layout = buf.write(state)
    assert [name for name, *_ in layout] == list(state)
    assert all(offset % SharedWeightBuffer.ALIGN == 0 for *_, offset in layout)
    # 84, 6, 4, 60 and 84 bytes at offsets rounded up to multiples of 64
    assert [offset for *_, offset in layout] == [0, 128, 192, 256, 320] and nbytes == 320 + 84
    got = _read_back(path, nbytes, layout)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    state["embed.weight"] = emb + 1  # a second push of the same shapes reuses the file in place
    assert buf.write(state)[0] == path
    assert torch.equal(_read_back(path, nbytes, layout)["embed.weight"], emb + 1)
    buf.close()
    assert not Path(path).exists()


def test_shared_buffer_grows_into_a_new_file_and_leaves_none_behind(tmp_path):
    buf = SharedWeightBuffer(str(tmp_path))
    path, _, _ = buf.write({"w": torch.zeros(4)})
    buf.mapped()  # the workers have it: the name goes, the memory stays with the mappings
    assert not Path(path).exists() and list(tmp_path.iterdir()) == []
    assert buf.write({"w": torch.ones(4)})[0] == path  # still written in place
    new_path, nbytes, layout = buf.write({"w": torch.arange(1000.0)})  # larger than the capacity
    assert new_path != path and Path(new_path).exists()
    assert torch.equal(_read_back(new_path, nbytes, layout)["w"], torch.arange(1000.0))
    with pytest.raises(ValueError):
        buf.write({})
    buf.close()
    assert list(tmp_path.iterdir()) == []


# ---- on the real engine (the session's shared one) ------------------------------------------------------------


@pytest.mark.slow
def test_every_push_path_serves_the_pushed_weights(vllm_engine, tiny_base, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    torch.manual_seed(11)

    def perturb() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in policy.parameters():  # tied embeddings stay tied
                p.add_(0.05 * torch.randn_like(p))
        return policy.state_dict()

    try:
        for version, push in enumerate([
            lambda s, v: vllm_engine.load_weights(s, v),  # shared buffer, first push maps it
            lambda s, v: vllm_engine.load_weights(s, v),  # the same buffer, rewritten in place
            lambda s, v: vllm_engine.load_weights(s, v, via="safetensors"),
            lambda s, v: (vllm_engine.release_weight_buffer(), vllm_engine.load_weights(s, v)),  # a new buffer
            lambda s, v: (save_file({k: t.clone() for k, t in s.items()}, tmp_path / f"v{v}.safetensors"),
                          vllm_engine.load_weights_from_file(str(tmp_path / f"v{v}.safetensors"), v)),
        ], start=1):
            push(perturb(), version)
            assert vllm_engine.version == version
            assert set(vllm_engine.last_load_stages) == {"write_s", "rpc_s", "read_s", "reload_s"}
            assert_engine_serves(vllm_engine, policy, tok)
    finally:
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
