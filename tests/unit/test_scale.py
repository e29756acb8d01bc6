"""`async-vapo plan`'s arithmetic: parameter counts against real models, memory and sync sizes by hand."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from async_vapo.deploy.scale import (
    LOGIT_BYTES,
    QWEN25_32B,
    GiB,
    LearnerSetup,
    ModelShape,
    Profile,
    engine_memory,
    learner_assumptions,
    learner_memory,
    micro_batch_rows,
    resolve_shape,
    search_hostfile,
    step_seconds,
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


def _tiny() -> ModelShape:
    return ModelShape(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2,
                      head_dim=2)


def test_learner_memory_by_hand():
    s = _tiny()
    # layer: attn 4x4 + 2x4x4 + 4x4 = 64, mlp 3x4x8 = 96, norms 8 -> 168; root: 2 x 10 x 4 + 4 = 84;
    # params 2 x 168 + 84 = 420
    assert (s.layer_params(), s.root_params(), s.params()) == (168, 84, 420)
    setup = LearnerSetup(ranks=3, models=2, seq_tokens=5, rows=1, compute_bytes=2, sharded=True,
                         activation_checkpointing=True, logprob_chunk_tokens=0)
    m = learner_memory(s, setup)
    # masters + AdamW moments of both models, the gradients of one (each model's freed at its optimiser step)
    assert m["state"] == (2 * 420 * 12 + 420 * 4) // 3 == 3920
    assert m["gathered"] == (2 * 168 + 84) * (2 + 4) == 2520  # two layers and the root unit, bf16 + fp32 grads
    assert m["activations"] == 2 * 5 * 4 * 2 + 34 * 5 * 4 == 760  # layer inputs + one layer at 16 bit
    assert m["logits"] == 5 * 10 * 16 == 800  # the whole micro-batch's logits, entropy without a gradient
    assert (m["total"], m["host"]) == (3920 + 2520 + 760 + 800, 0)
    # each setting moves its own part only
    assert learner_memory(s, replace(setup, logprob_chunk_tokens=2))["logits"] == 2 * 10 * 24
    assert learner_memory(s, replace(setup, logprob_chunk_tokens=64))["logits"] == 5 * 10 * 24  # above the tokens
    assert learner_memory(s, replace(setup, entropy_grad=True))["logits"] == 5 * 10 * 28
    assert learner_memory(s, replace(setup, activation_checkpointing=False))["activations"] == 2 * 34 * 5 * 4
    off = learner_memory(s, replace(setup, cpu_offload=True))
    assert (off["state"], off["host"], off["total"]) == (0, 3920, 2520 + 760 + 800)
    assert learner_memory(s, replace(setup, models=1))["state"] == 420 * 16 // 3
    assert learner_memory(s, replace(setup, rows=3))["activations"] == 3 * 760
    # one unsharded float32 rank (the CPU): the whole state, no 16-bit copies, 4-byte activations
    one = learner_memory(s, replace(setup, ranks=1, sharded=False, compute_bytes=4))
    assert (one["state"], one["gathered"]) == (2 * 420 * 12 + 420 * 4, 0)
    assert one["activations"] == 2 * 5 * 4 * 4 + 34 * 5 * 4 * 2 and one["logits"] == 5 * 10 * 16
    assert learner_memory(s, replace(setup, ranks=1, sharded=False))["gathered"] == 420 * 2  # autocast's cache


def test_learner_assumptions_name_the_gradients_of_one_model():
    s = _tiny()
    setup = LearnerSetup(ranks=2, models=2, seq_tokens=5, rows=1)
    state = dict(learner_assumptions(s, setup))["state"]
    assert "12 B/param x 2 model(s) + fp32 grads: 4 B/param x 1 model" in state and "/ 2 ranks" in state
    assert "one after the other" in state
    assert "one after the other" not in dict(learner_assumptions(s, replace(setup, models=1)))["state"]


@pytest.mark.parametrize("budget, mbs, seq, mini, ranks", [
    (24576, 8, 21504, 512, 8), (43008, 8, 21504, 512, 8), (4096, 32, 400, 128, 1), (4096, 32, 400, 128, 2),
    (0, 8, 300, 64, 4), (0, 8, 300, 6, 1), (1000, 4, 3000, 16, 2), (8192, 2, 100, 6, 4),
])
def test_micro_batch_rows_is_what_the_learner_plans(budget, mbs, seq, mini, ranks):
    from async_vapo.learner.vapo import Learner

    learner = SimpleNamespace(world=ranks, algo=SimpleNamespace(max_tokens_per_micro_batch=budget,
                                                                micro_batch_size=mbs))
    plans = Learner._plan(learner, list(range(mini)), [seq] * mini)
    assert micro_batch_rows(budget, mbs, seq, mini, ranks) == max(len(m) for p in plans for m in p)


def test_the_paper_config_is_read_as_the_learner_runs_it():
    from async_vapo.config import load_config

    cfg = load_config([REPO / "configs/qwen2.5-32b_vapo.toml"], [])
    s = LearnerSetup.from_config(cfg, ranks=16, prompt_tokens=1024)
    # 24,576-token budget over 21,504-token rows: one row per micro-batch; chunks of 4,096; both models; bf16
    assert (s.rows, s.tokens, s.logprob_chunk_tokens, s.models, s.compute_bytes) == (1, 21504, 4096, 2, 2)
    assert s.sharded and s.activation_checkpointing


def test_step_time_predicts_the_measured_async_and_sync_runs():
    """benchmarks/results/async_vs_sync_long: each stage's rate alone on its core, and the seconds per update of
    the synchronous (max_staleness 0) and asynchronous (1) runs. Rates in samples/s x a response length; the length
    cancels, what is tested is the model: the stages in turn, or overlapped."""
    res = json.loads((REPO / "benchmarks/results/async_vs_sync_long/async_vs_sync.json").read_text())
    alone = res["stage_alone_samples_per_s"]
    per_update = 32 * 8  # configs/tiny_long_cpu.toml: prompts_per_step x group_size
    tokens = 300
    for staleness in (0, 1):
        t = step_seconds(generated_tokens=per_update * tokens, learned_tokens=per_update * tokens,
                         generation_tokens_s=alone["generate"] * tokens, learner_tokens_s=alone["learn"] * tokens,
                         max_staleness=staleness)
        measured = res["runs"][str(staleness)]["seconds_per_update"]
        assert t["step_s"] == pytest.approx(measured, rel=0.15), (staleness, t, measured)


def test_a_profile_file_is_read_and_checked(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"generation_tokens_per_s_per_gpu": 900, "learner_tokens_per_s_per_gpu": 1200,
                             "generation_tokens_per_s_per_gpu_by_tp": {"4": 700}, "hardware": "8 x H100"}))
    p = Profile.load(str(f))
    assert (p.generation(1), p.generation(4), p.learner_tokens_s_per_gpu) == (900, 700, 1200)
    assert "8 x H100" in p.source
    f.write_text(json.dumps({"generation_tokens_per_s_per_gpu": 900}))
    with pytest.raises(ValueError, match="learner_tokens_per_s_per_gpu"):
        Profile.load(str(f))


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
             "rollout.tensor_parallel_size=4", "learner.cpu_offload=false", "--hosts", "4", "--gpus-per-host", "8")
    assert r.returncode == 1, r.stderr  # nothing to run: the learner does not fit
    out = r.stdout
    assert "32.76 B parameters" in out and "6 engine(s)" in out
    assert "rollout-5   host3  CUDA_VISIBLE_DEVICES=4,5,6,7" in out
    # (2 x 12 + 4) B x 32.76e9 / 8 ranks = 106.8 GiB; the learner's settings, not a micro-batch of 8 unchunked rows
    assert "106.8 GiB" in out and "DOES NOT FIT 80 GiB" in out
    assert "micro-batch 1 x 21,504 = 21,504 tokens" in out and "chunked, 4,096 tokens at a time" in out
    assert "65.5 GB" in out and "7.86 s" in out


def test_the_shipped_configs_fit_the_clusters_they_name(tmp_path):
    """Each GPU config names its cluster in a comment ('# fits: H hosts x G GPUs x M GiB, learner on L host(s)') and
    writes its placement; planned on that cluster's hostfile it fits, leaves no GPU idle and overlaps generation
    with learning."""
    for name in ("qwen2.5-32b_vapo.toml", "qwen2.5-7b_vapo.toml"):
        text = (REPO / "configs" / name).read_text()
        m = re.search(r"^# fits: (\d+) hosts x (\d+) GPUs x (\d+) GiB, learner on (\d+) hosts?$", text, re.M)
        assert m, name
        hosts, gpus, gib, learner_hosts = map(int, m.groups())
        hostfile = tmp_path / f"{name}.hosts"
        hostfile.write_text("".join(f"{h} {r}\n" for h, r in search_hostfile(hosts, learner_hosts)))
        r = plan(str(REPO / "configs" / name), "--hostfile", str(hostfile), "--gpus-per-host", str(gpus),
                 "--gpu-memory-gib", str(gib))
        assert r.returncode == 0, (name, r.stdout, r.stderr)
        assert "DOES NOT FIT" not in r.stdout and "(idle)" not in r.stdout, r.stdout
        assert "async.max_staleness 0" not in r.stdout and "max(generate, learn)" in r.stdout


def test_plan_takes_start_clusters_hostfile_and_prints_its_placement(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("n1 learner\nn1 replay\nn1 verifier\nn2 learner\nn1 rollout\nn2 rollout\nn3 rollout\n")
    shape = ["async.rollout_devices=16", "async.learner_devices=8", "rollout.tensor_parallel_size=2"]
    cfg = str(REPO / "configs/qwen2.5-32b_vapo.toml")
    r = plan(cfg, "--hostfile", str(hosts), "--gpus-per-host", "8", *shape)
    assert r.returncode in (0, 1), r.stderr
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    s = subprocess.run([sys.executable, "-m", "async_vapo.deploy.launch", "plan", "--config", cfg, "--dry-run",
                        "--run-dir", str(tmp_path / "run"), "--hostfile", str(hosts), "--gpus-per-host", "8",
                        *shape], capture_output=True, text=True, env=env, timeout=60)
    assert s.returncode == 0, s.stderr
    at = s.stdout.index("PLACEMENT_TABLE=")
    table = shlex.split(s.stdout[at:])[0].split("=", 1)[1].splitlines()  # the script evaluates it as shell
    assert len(table) > 5 and "\n".join(table) in r.stdout
    assert "learner-1   n2  CUDA_VISIBLE_DEVICES=0,1,2,3  (node 1 of 2: ranks 4-7)" in table
    assert "8 ranks / 8 ranks" not in r.stdout and "/ 8 ranks" in r.stdout


def test_search_lists_placements_that_fit_fastest_first(tmp_path):
    # without offload the 32B state needs more learner GPUs than 4 hosts of 80 GiB leave beside the logits
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--hosts", "8", "--gpus-per-host", "8", "--search",
             "learner.cpu_offload=false", "async.max_staleness=1")
    assert r.returncode == 0, r.stderr
    rows = [ln.split() for ln in r.stdout.splitlines() if ln[:3].strip().isdigit() and " of " not in ln]
    assert rows and all(float(x[6]) <= 80 for x in rows)
    steps = [float(x[11]) for x in rows]
    assert steps == sorted(steps)
    best = next(ln for ln in r.stdout.splitlines() if ln.startswith("best: ")).split()[1:]
    lines = r.stdout.split("hostfile (host role", 1)[1].splitlines()[1:]
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(ln.strip() + "\n" for ln in lines))
    assert "host1 learner" in hostfile.read_text()  # 32 ranks over 4 hosts: the best's learner hosts are written
    # the best one's overrides on the hostfile it printed fit, at the step time it listed
    again = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--hostfile", str(hostfile), "--gpus-per-host", "8",
                 "learner.cpu_offload=false", "async.max_staleness=1", *best)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"{steps[0]:,.0f} s" in again.stdout and "(idle)" not in again.stdout


def test_plan_exits_non_zero_when_nothing_fits():
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--hosts", "1", "--gpus-per-host", "8", "--search",
             "learner.cpu_offload=false")
    assert r.returncode == 1 and "NOTHING FITS" in r.stdout


def test_plan_refusals_are_clear():
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "async.rollout_devices=32", "async.learner_devices=8",
             "rollout.tensor_parallel_size=1", "--hosts", "2",
             "--gpus-per-host", "8")
    assert r.returncode == 1 and r.stdout.startswith("DOES NOT FIT: 32 engine(s)")  # does not fit: 1, as memory
    r = plan(str(REPO / "configs/tiny_cpu.toml"), "--hosts", "1", "--gpus-per-host", "8")
    assert r.returncode == 2 and "--model-config" in r.stderr
    r = plan(str(REPO / "configs/tiny_cpu.toml"), "--hosts", "0", "--gpus-per-host", "8")
    assert r.returncode == 2 and ">= 1" in r.stderr
    r = plan(str(REPO / "configs/tiny_cpu.toml"), "--gpus-per-host", "8")
    assert r.returncode == 2 and "--hosts N or --hostfile" in r.stderr


def test_start_cluster_dry_run_runs_the_plans_memory_check(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{h} {r}\n" for h, r in search_hostfile(4, 2)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}

    def dry_run(*overrides):
        return subprocess.run([str(REPO / "deploy/start_cluster.sh"), "--config",
                               str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--run-dir", str(tmp_path / "run"),
                               "--hostfile", str(hostfile), "--gpus-per-host", "8", "--dry-run", "--", *overrides],
                              capture_output=True, text=True, env=env, timeout=120)

    r = dry_run()
    assert r.returncode == 0, r.stderr
    assert "#   total on the GPU" in r.stdout and "(fits)" in r.stdout and "# commands (RUN_DIR" in r.stdout
    r = dry_run("learner.cpu_offload=false")  # 16 ranks holding their state: 90.0 GiB each
    assert r.returncode == 1 and "DOES NOT FIT 80 GiB" in r.stdout
    assert "start_cluster: the plan does not fit its GPUs" in r.stderr and "# commands" not in r.stdout
    assert not (tmp_path / "run").exists()


def test_plan_with_hosts_puts_the_learner_on_as_few_hosts_as_hold_it():
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--hosts", "4", "--gpus-per-host", "8")
    assert r.returncode == 0, r.stdout + r.stderr  # 16 ranks of 8 per host: two learner hosts
    assert "learner-1   host1  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7  (node 1 of 2: ranks 8-15)" in r.stdout
    r = plan(str(REPO / "configs/qwen2.5-32b_vapo.toml"), "--hosts", "4", "--gpus-per-host", "8",
             "async.learner_devices=8", "async.rollout_devices=24")
    assert "learner-1" not in r.stdout
    assert "learner     host0  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7  (8 ranks)" in r.stdout


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops create, from creation until freed (what a GPU allocator is
    asked for, without its caching)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.held: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if type(t) is not torch.Tensor:
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self.held:
                continue
            self.held[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self.held.pop(key, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["chunked", "whole", "whole_entropy_grad"])
def test_logit_bytes_are_the_head_codes_measured_peak(kind, dtype):
    """The plan's bytes per token x vocab entry (LOGIT_BYTES) against the peak of the learner's own log-prob code,
    forward and backward, on a head of ``tokens`` x ``vocab`` logits: within 15 %."""
    from torch.utils.checkpoint import checkpoint

    from async_vapo.algo.utils import entropy_from_logits, logprobs_from_logits
    from async_vapo.models.rl import _head_logprobs

    tokens, vocab, hidden = 256, 8192, 16
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False).to(dtype)
    h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    probe = _LiveBytes()
    with probe:
        if kind == "chunked":
            lp, _ = checkpoint(_head_logprobs, head, h, labels, 1.0, use_reentrant=False)
            loss = lp.sum()
        else:
            logits = head(h).float()
            lp = logprobs_from_logits(logits[None], labels[None])
            with torch.set_grad_enabled(kind == "whole_entropy_grad"):
                ent = entropy_from_logits(logits[None])
            loss = lp.sum() + (0.01 * ent.sum() if kind == "whole_entropy_grad" else 0)
            del logits
        loss.backward()
    measured = probe.peak / (tokens * vocab)
    assert abs(LOGIT_BYTES[kind] - measured) <= 0.15 * measured, (kind, dtype, measured)
