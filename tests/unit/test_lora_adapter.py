"""``weights.adapter``: a LoRA version as a PEFT directory with its checksum, the newest ``keep`` kept; the engine's
end refuses one whose bytes do not match the announce (the engine's load itself: tests/integration/test_lora_engine)."""

from __future__ import annotations

import pytest
import torch

from async_vapo.models import lora
from async_vapo.weights.adapter import AdapterPublisher, check_adapter


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"{lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, 8, generator=g),
            f"{lora.PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(8, 4, generator=g)}


def test_versions_are_peft_directories_with_their_checksums(tmp_path):
    from safetensors.torch import load_file

    pub = AdapterPublisher(tmp_path, lora.peft_config(4, 8, ["q_proj"]), keep=2)
    announces = [pub.publish(v, adapter(v)) for v in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-v2", "adapter-v3"]  # the newest 2, no temp dirs
    a = announces[-1]
    assert a.transfer == "adapter" and a.version == 3
    check_adapter(a)
    loaded = load_file(str(tmp_path / "adapter-v3" / lora.ADAPTER_WEIGHTS))
    for k, v in adapter(3).items():
        torch.testing.assert_close(loaded[k], v, rtol=0, atol=0)
    assert lora.load_adapter_config(tmp_path / "adapter-v3").r == 4
    path = tmp_path / "adapter-v3" / lora.ADAPTER_WEIGHTS
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its announce"):
        check_adapter(a)
    pub.close()
    assert not any(tmp_path.iterdir())


def test_a_publisher_on_tmpfs_removes_its_own_directory():
    pub = AdapterPublisher(None, lora.peft_config(4, 8, ["q_proj"]))
    pub.publish(1, adapter(1))
    assert (pub.directory / "adapter-v1" / lora.ADAPTER_WEIGHTS).is_file()
    pub.close()
    assert not pub.directory.exists()
