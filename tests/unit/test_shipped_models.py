"""The built models shipped in the package (async_vapo.models.ship): used when their build key matches,
checked against their SHA-256 manifest, rebuilt (and said so) when damaged."""

from __future__ import annotations

import json

import pytest

from async_vapo.config import load_config
from async_vapo.models import ship
from async_vapo.models.base_model import base_model_key, base_model_path, ensure_base_model, make_base
from async_vapo.models.reward import reward_critic_key

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "train.threads=1"]


@pytest.mark.parametrize("config", ["configs/tiny_cpu.toml", "configs/tiny_long_cpu.toml"])
def test_the_shipped_models_are_those_the_tiny_configs_build(config):
    """The embedded default's and the long task's base model and critic ship, under the keys their configs build
    them with, intact. When this fails after a recipe or config change: `async-vapo make-base --config CONFIG
    --force --ship` rebuilds them and replaces that config's shipped copies."""
    cfg = load_config([config])
    assert ship.shipped_entry("base", base_model_key(cfg)) is not None
    assert ship.shipped_entry("reward_critic", reward_critic_key(cfg)) is not None
    size = 0
    for kind, key in (("base", base_model_key(cfg)), ("reward_critic", reward_critic_key(cfg))):
        d = ship.shipped_model(kind, key)  # raises on a file that does not match its SHA-256
        assert {"model.safetensors", "config.json", "tokenizer.json", "BUILD_DONE"} <= {p.name for p in d.iterdir()}
        size += sum(p.stat().st_size for p in d.iterdir())
    assert size < 10 * 2**20


@pytest.fixture()
def shipped(tmp_path, monkeypatch):
    """A shipped directory holding a fast build of FAST's base model."""
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path / 'build'}"])
    built = make_base(cfg, base_model_path(cfg), progress=False)
    monkeypatch.setattr(ship, "SHIPPED_DIR", tmp_path / "shipped")
    ship.ship({"base": (base_model_key(cfg), built)}, recipe="test")
    return tmp_path / "shipped", built


def test_a_cold_cache_gets_the_shipped_build(tmp_path, shipped, capsys):
    shipped_dir, built = shipped
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path / 'cold'}"])
    path = ensure_base_model(cfg, progress=False)
    assert path == base_model_path(cfg) and path.parent == tmp_path / "cold"
    assert {p.name: p.read_bytes() for p in path.iterdir()} == {p.name: p.read_bytes() for p in built.iterdir()}
    assert "the shipped build (SHA-256 checked)" in capsys.readouterr().err
    manifest = json.loads((shipped_dir / "MANIFEST.json").read_text())
    assert [(e["kind"], e["recipe"], e["dir"]) for e in manifest["models"]] == [("base", "test", built.name)]


def test_a_damaged_shipped_build_is_rebuilt_with_the_reason(tmp_path, shipped, capsys):
    shipped_dir, built = shipped
    weights = shipped_dir / built.name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path / 'cold'}"])
    path = ensure_base_model(cfg, progress=False)
    err = capsys.readouterr().err
    assert "not using the shipped base model" in err and "model.safetensors has SHA-256" in err
    assert (path / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()  # rebuilt


def test_another_config_builds_its_own(tmp_path, shipped, capsys):
    cfg = load_config([], FAST + ["base_model.seed=1", f"model.cache_dir={tmp_path / 'cold'}"])
    path = ensure_base_model(cfg, progress=False)
    assert "no shipped base model for this config" in capsys.readouterr().err
    assert json.loads((path / "async_vapo_base.json").read_text())["key"] == base_model_key(cfg)


def test_a_second_config_ships_beside_the_first_and_a_reship_replaces_its_own(tmp_path, shipped):
    """Two configs' builds ship side by side; shipping again from one command replaces only that command's."""
    shipped_dir, built = shipped
    other = load_config([], FAST + ["base_model.seed=1", f"model.cache_dir={tmp_path / 'build'}"])
    other_built = make_base(other, base_model_path(other), progress=False)
    ship.ship({"base": (base_model_key(other), other_built)}, recipe="other")
    first = load_config([], FAST + [f"model.cache_dir={tmp_path / 'build'}"])
    assert ship.shipped_model("base", base_model_key(first)) == shipped_dir / built.name
    assert ship.shipped_model("base", base_model_key(other)) == shipped_dir / other_built.name
    again = load_config([], FAST + ["base_model.seed=2", f"model.cache_dir={tmp_path / 'build'}"])
    again_built = make_base(again, base_model_path(again), progress=False)
    ship.ship({"base": (base_model_key(again), again_built)}, recipe="other")
    assert ship.shipped_model("base", base_model_key(other)) is None
    assert not (shipped_dir / other_built.name).exists()
    assert ship.shipped_model("base", base_model_key(first)) is not None
    assert sorted(p.name for p in shipped_dir.iterdir() if p.is_dir()) == sorted([built.name, again_built.name])


def test_a_manifest_of_the_one_build_per_kind_layout_still_reads(tmp_path):
    old = {"recipe": "async-vapo make-base --config configs/tiny_cpu.toml --ship", "torch": "2.13.0+cpu",
           "models": {"base": {"dir": "tiny-base-abc", "key": "abc", "files": {}},
                      "reward_critic": {"dir": "tiny-rm-def", "key": "def", "files": {}}}}
    (tmp_path / "MANIFEST.json").write_text(json.dumps(old))
    assert ship.shipped_entry("base", "abc", tmp_path)["dir"] == "tiny-base-abc"
    assert ship.shipped_entry("reward_critic", "def", tmp_path)["recipe"] == old["recipe"]
    assert ship.shipped_entry("base", "def", tmp_path) is None
