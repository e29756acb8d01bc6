"""``async-vapo plan`` with LoRA (``model.lora``): the adapter's parameter count is peft's own on a real model, and
the learner's state is a frozen float32 base plus 16 B per adapter parameter (masters, AdamW m and v, gradients);
configs/qwen2.5-7b_grpo_lora.toml fits the one 8-GPU host it names, with its one learner rank."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from async_vapo.config import load_config
from async_vapo.deploy.scale import (
    QWEN25_7B,
    Cluster,
    LearnerSetup,
    ModelShape,
    search,
    search_hostfile,
    state_bytes,
    weight_sync,
)
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


REPO = Path(__file__).resolve().parents[2]
LORA_7B = REPO / "configs" / "qwen2.5-7b_grpo_lora.toml"


def plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "async_vapo.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_plan_fits_the_7b_lora_config_on_the_host_it_names(tmp_path):
    """The config names its cluster ('# fits: ...'); planned on that cluster's hostfile its one learner rank and seven
    engines fit with no GPU idle. The same placement does not fit without LoRA (the whole policy's 16 B/param on one
    rank), nor with VAPO's full critic beside the adapter: why the LoRA variant is GRPO."""
    text = LORA_7B.read_text()
    m = re.search(r"^# fits: (\d+) hosts x (\d+) GPUs x (\d+) GiB, learner on (\d+) hosts?$", text, re.M)
    assert m
    hosts, gpus, gib, learner_hosts = map(int, m.groups())
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} {r}\n" for h, r in search_hostfile(hosts, learner_hosts)))
    where = ["--hostfile", str(hostfile), "--gpus-per-host", str(gpus), "--gpu-memory-gib", str(gib)]
    r = plan(str(LORA_7B), *where)
    assert r.returncode == 0, (r.stdout, r.stderr)
    out = r.stdout
    assert "DOES NOT FIT" not in out and "(idle)" not in out and "max(generate, learn)" in out
    assert "(1 rank)" in out and "7 engine(s)" in out and "LoRA rank 16" in out
    # 4 B x 7.62e9 frozen base + 16 B x 40,370,176 adapter params = 29.0 GiB; the version is the fp32 adapter
    assert "29.0 GiB" in out and "63.5 GiB  (fits)" in out and "0.2 GB" in out
    merged = plan(str(LORA_7B), *where, "model.lora.serve=merged")  # a version is the whole bf16 model
    assert merged.returncode == 0 and "15.2 GB" in merged.stdout and "63.5 GiB  (fits)" in merged.stdout
    full = plan(str(LORA_7B), *where, "model.lora.rank=0")
    assert full.returncode == 1 and "DOES NOT FIT 80 GiB" in full.stdout
    vapo = plan(str(LORA_7B), *where, "algo.name=vapo")
    assert vapo.returncode == 1 and "142.3 GiB" in vapo.stdout and "176.9 GiB  (DOES NOT FIT 80 GiB)" in vapo.stdout


def test_lora_shards_over_several_learner_ranks(tmp_path):
    """A LoRA learner may be sharded (FSDP2 over its ranks): the config takes several learner ranks, plan --search
    proposes them, and VAPO with LoRA on the policy and the critic (configs/qwen2.5-7b_vapo_lora.toml) fits the one
    8-GPU host it names on four ranks, where one rank holds neither."""
    cfg = load_config([str(LORA_7B)], ["async.learner_devices=2", "async.rollout_devices=6"])
    assert cfg.async_.learner_devices == 2
    cfg = load_config([str(LORA_7B)])
    found, tried = search(cfg, ModelShape.from_hf_config(QWEN25_7B), Cluster(gpu_memory_gib=80), hosts=1,
                          gpus_per_host=8)
    assert found and max(c.learner_devices for c in found) > 1
    vapo_lora = REPO / "configs" / "qwen2.5-7b_vapo_lora.toml"
    assert "# fits: 1 hosts x 8 GPUs x 80 GiB, learner on 1 host" in vapo_lora.read_text()
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} {r}\n" for h, r in search_hostfile(1, 1)))
    where = ["--hostfile", str(hostfile), "--gpus-per-host", "8", "--gpu-memory-gib", "80"]
    r = plan(str(vapo_lora), *where)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "(4 ranks)" in r.stdout and "43.5 GiB  (fits)" in r.stdout and "DOES NOT FIT" not in r.stdout
    one = plan(str(vapo_lora), *where, "async.learner_devices=1", "async.rollout_devices=7",
               "rollout.tensor_parallel_size=1")
    assert one.returncode == 1 and "92.4 GiB  (DOES NOT FIT 80 GiB)" in one.stdout


def test_a_lora_critic_is_counted_as_its_frozen_trunk_and_adapter():
    """model.critic_lora: the critic is 4 B/param (frozen float32 trunk) + 12 B per adapter parameter, and the
    gradients are the larger model's trainable parameters' (the models step one after the other)."""
    shape = ModelShape.from_hf_config(QWEN25_7B)
    p, a = shape.params(), shape.lora_params(16, TARGETS)
    both = LearnerSetup(ranks=1, models=2, seq_tokens=1, rows=1, sharded=False, lora_rank=16, lora_targets=TARGETS,
                        critic_lora_rank=16, critic_lora_targets=TARGETS)
    assert state_bytes(shape, both) == (4 * p + 12 * a) * 2 + 4 * a
    critic_only = LearnerSetup(ranks=1, models=2, seq_tokens=1, rows=1, sharded=False, critic_lora_rank=16,
                               critic_lora_targets=TARGETS)
    assert state_bytes(shape, critic_only) == 12 * p + (4 * p + 12 * a) + 4 * p
    lines = "\n".join(plan(str(LORA_7B), "--hosts", "1", "--gpus-per-host", "8", "algo.name=vapo",
                           "model.critic_lora.rank=16", "--gpu", "h200").stdout.splitlines())
    assert "LoRA rank 16 critic: frozen fp32 trunk" in lines and "57.8 GiB" in lines and "92.4 GiB  (fits)" in lines
