"""The learner on a GPU, end to end, in a few minutes (run by deploy/device_check.sh; results as JSON).

On one GPU (NCCL, a mesh of one) or more (torchrun), with a Qwen2.5-0.5B-shaped model built here with random
weights and the character tokenizer (no hub): FSDP2 policy and critic in bf16 compute / fp32 masters, activation
checkpointing, token-budget micro-batches, log-probs from hidden states in chunks; value pretraining and VAPO
updates on responses of ``--response-tokens`` tokens. Checks, each recorded with its measured error:

* finite losses and moved weights;
* chunked log-probs = full-logit log-probs; packed forward = padded forward;
* FlexAttention packing (a BlockMask of the sequences, learner.packed_attention = flex) = the padded SDPA forward,
  log-probs and gradients, in float32 (on CUDA only: FlexAttention has no backward on the CPU);
* DCP save -> resume gives the same next update (loss and gradient norm);
* ``async-vapo export`` of the checkpoint gives the learner's logits in transformers;
* tokens/s of an update and peak GPU memory, beside ``async-vapo plan``'s state memory (float32 masters and AdamW
  moments of policy and critic, one model's float32 gradients) and its whole prediction;
* the weight transfer's NCCL step (``nccl_weight_transfer``, before the rest): a bare NCCL broadcast of 1 GiB
  (about Qwen2.5-0.5B's bf16 weights) in 16 MiB buckets (``cluster.weights.dist_bucket_bytes``) between two fresh
  processes, against a device memcpy of the same bytes; issue 15's goal is the broadcast within 2x the memcpy. Two
  GPUs when there are two (a learner's and an engine's), else both processes on one GPU, which NCCL before 2.30
  refuses ("Duplicate GPU"; 2.30 has NCCL_MULTI_RANK_GPU_ENABLE, set here): then the row is skipped with NCCL's
  error. On the CPU (``--tiny``) the same step runs over gloo as a smoke test and is recorded as skipped.

vLLM is not on the device machine: the engine steps, and the weight transfer through vLLM's NCCL weight-transfer
engine (``async_vapo.weights.collective``), are recorded as skipped with that reason.

A GPU user's first questions (stage ``mfu``, one check row ``mfu_<shape>_<response tokens>`` per configuration):
how fast is a VAPO update, how close to the GPU's peak, and does ``async-vapo plan``'s memory hold? At the
Qwen2.5-0.5B and Qwen2.5-1.5B shapes (random weights; the published config.json's hidden size, layers, heads, KV
heads, intermediate size, vocabulary and tied embeddings), the learner as it runs (``async_vapo.learner.vapo.Learner``:
policy and critic sharded with FSDP2, bf16 compute / fp32 masters and AdamW, activation checkpointing, log-probs in
4096-token chunks, token-budget micro-batches) runs one warm-up update and ``--mfu-steps`` timed updates (CUDA
events) at each response length (``--mfu-lengths``, 4096 and 16384), every response at that full length after a
``--mfu-prompt-tokens`` prompt; each update is the old-log-prob and value forwards, then the policy's and the
critic's forward + backward and their optimiser steps. Reported: tokens/s (prompt + response tokens of the batch
over the update's time), MFU, and ``torch.cuda.max_memory_allocated()`` over the timed updates beside
``async_vapo.deploy.scale.estimate`` (what ``async-vapo plan`` prints) for the same settings, with their ratio and
the goal: within 15 %.

MFU = model FLOPs of the update / seconds / peak dense bf16 FLOP/s of the GPU (read from its name in
:data:`PEAK_BF16`, printed beside the result; H200 989 TFLOP/s), with the model FLOPs (:func:`update_flops`) counted
as PaLM's Appendix B (Chowdhery et al. 2022, arXiv:2204.02311: 6N + 12·L·H·Q·T per token for forward + backward)
and Chinchilla's Appendix F (Hoffmann et al. 2022, arXiv:2203.15556: backward = 2x forward) count them, per row of
T = P + R tokens (P prompt, R response), for a decoder of L layers, hidden h, H heads and K KV heads of size d,
intermediate size I, vocabulary V:

* matmuls: a forward multiplies every token by each layer's weights, N_L = h·H·d (q) + 2·h·K·d (k, v) + H·d·h (o)
  + 3·h·I (gate, up, down) multiply-adds, 2·N_L FLOPs; forward + backward 6·N_L (the backward forms the gradients of
  the inputs and of the weights, 2x the forward);
* the heads: the policy's LM head (V·h, the tied embedding matrix) runs on the R response positions only (the
  learner's chunked log-probs), the critic's value head (h·1) on all T; the embedding lookup is no matmul;
* attention, causal: query i (1-based) meets i keys, QK^T and AV 2·H·d·i FLOPs each, so a forward of a row costs
  2·L·H·d·T·(T+1), forward + backward 3x that. This is half of PaLM's 12·L·H·Q·T per token, which counts the
  masked half of the score matrix too; flash / memory-efficient SDPA kernels skip it. The row's
  ``mfu_palm_attention`` gives the MFU with PaLM's count for comparison;
* an update = the policy's forward of every row (old log-probs; the FSDP learner takes none from the first
  gradient step) + the critic's forward (values) + ``ppo_epochs`` x the policy's forward + backward +
  ``critic_epochs`` x the critic's forward + backward. Not counted: activation checkpointing's recomputed forwards
  (hardware FLOPs, not model FLOPs), norms, rotary, softmax, the losses and the optimiser steps.

On the CPU (``--device cpu``, with ``--shapes tiny``; the test ``tests/integration/test_device_check.py``) the same
stage runs a 2-layer model at short lengths over gloo: the peak is then a measured bf16 matrix product on this
machine (no datasheet figure), and the memory comparison is skipped (``torch.cuda.max_memory_allocated`` has no CPU
counterpart; the plan's prediction is still recorded).

Time: the script has ``--budget-s`` (default DEVICE_CHECK_TIMEOUT_S - 30 s) and runs its stages in the order
``weights`` (the NCCL step), ``mfu``, ``learner`` (the checks above it). Before each MFU configuration it estimates
the configuration's time (building and loading the models at ``LOAD_S_PER_BPARAM`` s per billion parameters,
updates at the lowest MFU measured so far or ``ASSUMED_MFU`` before the first) and shrinks it to one timed update or
skips it, with the estimate in the row's reason, when it would run into the time kept for the ``learner`` stage
(``LEARNER_STAGE_S``); the ``learner`` stage is skipped when less than that is left. The JSON is rewritten after
every check, so a run stopped by the timeout keeps what it measured.

    python deploy/device_check.py OUT_DIR [--tiny] [--stages weights,mfu,learner] [--quick] [--device auto|cpu]
        [--shapes qwen2.5-0.5b,qwen2.5-1.5b|tiny] [--mfu-lengths 4096,16384] [--mfu-steps 2] [--budget-s S]
    (--tiny: 2-layer models, any device, for a smoke test; --quick: the mfu stage at the 0.5B shape, one timed update)
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BROADCAST = r"""
import datetime, json, os, sys, time
import torch, torch.distributed as dist
rank, port, backend, dev = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], torch.device(sys.argv[4])
nbytes, bucket, reps = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
cuda = dev.type == "cuda"
def sync():
    if cuda:
        torch.cuda.synchronize(dev)
try:
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    pattern = lambda: (torch.arange(nbytes, dtype=torch.int64) % 251).to(torch.uint8).to(dev)
    buf = pattern() if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    ack = torch.zeros(1, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(reps + 1):  # the first is the warm-up (NCCL connects lazily)
        sync()
        t0 = time.perf_counter()
        for off in range(0, nbytes, bucket):
            dist.broadcast(buf[off: off + bucket], src=0)
        dist.broadcast(ack, src=1)  # the receiver has every bucket
        sync()
        times.append(time.perf_counter() - t0)
    flag = torch.tensor([int(torch.equal(buf, pattern())) if rank == 1 else 0], dtype=torch.uint8, device=dev)
    dist.broadcast(flag, src=1)
    out = {"broadcast_s": times[1:], "received_exact": bool(flag.item())}
    if rank == 0:
        dst = torch.empty_like(buf)
        copies = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            dst.copy_(buf)
            sync()
            copies.append(time.perf_counter() - t0)
        out["memcpy_s"] = copies[1:]
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)
except Exception as e:
    print(json.dumps({"error": f"{type(e).__name__}: {e}"}), flush=True)
    sys.exit(3)
"""
"""A bare broadcast between two processes (rank 0 sends), each bucket then a one-byte ack back, and rank 0's memcpy of
the same bytes on its device; prints JSON."""

QWEN25_05B = dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864)
QWEN25_15B = dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960)
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
QWEN_VOCAB = 151_936
SHAPES = {"qwen2.5-0.5b": (QWEN25_05B, QWEN_VOCAB), "qwen2.5-1.5b": (QWEN25_15B, QWEN_VOCAB), "tiny": (TINY, 512)}
"""The MFU stage's shapes: (decoder shape, vocabulary). The Qwen2.5 ones are the published config.json's (both tie
the embeddings; 0.49 B and 1.54 B parameters)."""

PEAK_BF16 = (  # (name contains, dense bf16 tensor-core FLOP/s): the vendors' datasheets, without sparsity
    ("H200 NVL", 835e12), ("H200", 989e12), ("GH200", 989e12), ("H100 NVL", 835e12), ("H100 PCIe", 756e12),
    ("H100", 989e12), ("A100", 312e12), ("L40S", 362e12),
)
ASSUMED_MFU = 0.2
"""The MFU the time estimate assumes before a configuration has been measured."""
LOAD_S_PER_BPARAM = 40.0
"""Estimated seconds to build, save and load (policy and critic) a model, per billion parameters."""
LEARNER_STAGE_S = 150.0
"""Time kept for the ``learner`` stage (a 0.5B model at 20k tokens, DCP save and resume, export); an estimate."""


def build(directory: Path, shape: dict, vocab: int, max_len: int, device: str = "cpu", dtype=None) -> None:
    """A Qwen2 model of ``shape`` with random weights (seed 0) and the character tokenizer, saved in ``directory``;
    built on ``device`` (initialising 1.5 B weights on the CPU takes long), saved in ``dtype`` (None: float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from async_vapo.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                      num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_heads"],
                      num_key_value_heads=shape["num_kv_heads"], max_position_embeddings=max_len,
                      tie_word_embeddings=True, rope_theta=1e6, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))


def groups(n_groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int, eos: int,
           full_length: bool = False):
    """Random groups; responses of ``response_tokens`` less up to 10 % (``full_length``: all of it)."""
    import random

    from async_vapo.types import Group, Trajectory

    rng = random.Random(0)
    out = []
    for g in range(n_groups):
        samples = []
        for k in range(group_size):
            n = response_tokens - (0 if full_length else rng.randint(0, response_tokens // 10))
            ids = [rng.randrange(3, vocab) for _ in range(n - 1)] + [eos]
            samples.append(Trajectory(response_ids=ids, behavior_logprobs=[], finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2)))
        out.append(Group(uid=f"g{g}", prompt="p", answer="a", version=0, samples=samples,
                         prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_tokens)]))
    return out


class Checks:
    """Check rows by name; on the writing rank the JSON is rewritten after every row, so that a run stopped by its
    timeout keeps what it measured (``complete`` false until the end)."""

    def __init__(self, out: Path, writer: bool = True):
        self.out, self.rows, self.writer, self.extra = out, {}, writer, {}

    def record(self, name: str, ok: bool, **values) -> None:
        self.rows[name] = {"ok": bool(ok), **values}
        print(f"[device_check] {name}: {'ok' if ok else 'FAILED'} {values}", flush=True)
        if self.writer:
            self.write(complete=False)

    def write(self, extra: dict | None = None, complete: bool = True) -> bool:
        self.extra.update(extra or {})
        ok = all(r["ok"] for r in self.rows.values() if not r.get("skipped"))
        if self.writer:
            text = json.dumps({"ok": ok, "complete": complete, "checks": self.rows, **self.extra}, indent=2,
                              default=str) + "\n"
            tmp = self.out / "device_check.json.tmp"
            tmp.write_text(text)
            tmp.replace(self.out / "device_check.json")
        return ok


# ---------------------------------------------------------------- the MFU stage

def update_flops(shape, rows: list[tuple[int, int]], *, ppo_epochs: int = 1, critic_epochs: int = 1,
                 critic: bool = True) -> dict[str, float]:
    """Model FLOPs of one VAPO update of ``rows`` ((prompt tokens, response tokens) each) for a decoder of ``shape``
    (``async_vapo.deploy.scale.ModelShape``): the module docstring's formula. Returns the total, its attention part,
    the policy's and the critic's forward FLOPs over the batch, and the per-token figures."""
    h, n_layers = shape.hidden_size, shape.num_layers
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    n_layer = h * q + 2 * h * kv + q * h + 3 * h * shape.intermediate_size  # matmul weights of one decoder layer
    dense = attention = policy_head = critic_head = 0
    for p, r in rows:
        t = p + r
        dense += 2 * n_layers * n_layer * t
        attention += 2 * n_layers * q * t * (t + 1)  # causal: query i meets i keys, QK^T and AV 2*q*i each
        policy_head += 2 * h * shape.vocab_size * r
        critic_head += 2 * h * t
    policy_fwd = dense + attention + policy_head
    critic_fwd = (dense + attention + critic_head) if critic else 0
    passes_policy = 1 + 3 * ppo_epochs  # old log-probs + forward and backward (backward = 2 x forward)
    passes_critic = (1 + 3 * critic_epochs) if critic else 0  # values + forward and backward
    total = passes_policy * policy_fwd + passes_critic * critic_fwd
    tokens = sum(p + r for p, r in rows)
    return {"total": float(total), "attention": float(attention * (passes_policy + passes_critic)),
            "policy_forward": float(policy_fwd), "critic_forward": float(critic_fwd), "tokens": tokens,
            "per_token": total / tokens, "matmul_params_per_layer": n_layer}


def peak_bf16(device_name: str) -> tuple[float | None, str]:
    """The dense bf16 peak of a GPU by its name (:data:`PEAK_BF16`) and where it came from; None when unknown."""
    for key, flops in PEAK_BF16:
        if key.lower() in device_name.lower():
            return flops, f"datasheet: {key} dense bf16 {flops / 1e12:g} TFLOP/s"
    return None, f"no datasheet figure for {device_name!r} in device_check.PEAK_BF16"


def measured_matmul_flops(device, n: int, reps: int = 5) -> float:
    """FLOP/s of an n x n x n bf16 matrix product on ``device`` (best of ``reps`` after a warm-up)."""
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    best = math.inf
    for i in range(reps + 1):
        seconds = _timed(device, lambda: torch.mm(a, b))
        if i:
            best = min(best, seconds)
    return 2 * n**3 / best


def _timed(device, fn) -> float:
    """Seconds ``fn()`` takes: CUDA events on a GPU (after every kernel it queued ended), else the wall clock."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mfu_overrides(model_dir: Path, response_tokens: int, rows: int, budget: int, world: int) -> list[str]:
    """The learner's config for the MFU stage: as the long-response configs run it (FSDP2, bf16, checkpointing,
    chunked log-probs, a token budget per micro-batch), one optimiser step per update."""
    return [f"model.path={model_dir}", "model.critic_init=base", "model.dtype=bfloat16", "task.kind=arith",
            f"rollout.max_response_tokens={response_tokens}", "algo.name=vapo", "algo.group_size=2",
            f"algo.prompts_per_step={rows // 2}", f"algo.mini_batch_size={rows}", "algo.micro_batch_size=1",
            f"algo.max_tokens_per_micro_batch={budget}", "learner.fsdp=on", "learner.activation_checkpointing=true",
            "learner.logprob_chunk_tokens=4096", "optim.actor_lr=1e-6", "optim.critic_lr=1e-6",
            f"async.learner_devices={world}"]


@dataclass
class MfuRun:
    """What every configuration of the MFU stage shares."""
    checks: Checks
    args: argparse.Namespace
    device: object
    world: int
    rank: int
    deadline: float
    peak: float
    summary: dict
    seen_mfu: list = field(default_factory=list)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def mfu_stage(checks: Checks, args, device, world: int, rank: int, deadline: float) -> None:
    """The MFU stage (module docstring): per shape one model and one Learner, per response length one warm-up and
    ``args.mfu_steps`` timed updates; each configuration skipped or shrunk when its estimate passes ``deadline``."""
    import torch

    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else platform.processor() or platform.machine()
    peak, source = peak_bf16(name) if cuda else (None, "no datasheet figure for a CPU")
    matmul = measured_matmul_flops(device, 8192 if cuda else 512)
    if args.peak_tflops:
        peak, source = args.peak_tflops * 1e12, f"--peak-tflops {args.peak_tflops:g}"
    elif peak is None:
        peak, source = matmul, ("measured: an n x n x n bf16 matrix product here (n = 8192 on a GPU, 512 on the "
                                f"CPU), the best of 5; {source}")
    summary = {"device": name, "peak_bf16_flops": peak, "peak_source": source, "matmul_bf16_flops_measured": matmul,
               "formula": "update_flops in deploy/device_check.py (module docstring): matmuls 2 FLOPs per weight per "
                          "token forward, x3 forward + backward; causal attention 2*L*H*d*T*(T+1) per row forward; "
                          "policy head on response tokens; old log-probs and values forward-only; no recompute",
               "rows": []}
    checks.extra["mfu"] = summary
    print(f"[device_check] mfu: {name}; peak {peak / 1e12:.1f} TFLOP/s ({source}); measured bf16 matmul "
          f"{matmul / 1e12:.2f} TFLOP/s", flush=True)
    run = MfuRun(checks, args, device, world, rank, deadline, peak, summary)
    for shape_name in args.shapes:
        mfu_shape(run, shape_name)


def mfu_shape(run: MfuRun, shape_name: str) -> None:
    """One shape: its model built once (bf16, on the device), one Learner for every length (loaded at the first)."""
    import gc

    import torch

    args = run.args
    lengths, prompt = args.mfu_lengths, args.mfu_prompt_tokens
    budget = args.mfu_budget or 4 * (prompt + min(lengths))
    # rows per update: --mfu-micro-batches micro-batches of as many full rows as the token budget holds (even:
    # groups of 2); the longest update's row count is the mini-batch, so every update is one optimiser step
    rows = {r: 2 * max(1, args.mfu_micro_batches * max(1, budget // (prompt + r)) // 2) for r in lengths}
    state: dict = {}
    with tempfile.TemporaryDirectory() as d:
        model_dir = Path(d) / "model"
        for resp in lengths:
            label = f"mfu_{shape_name}_{resp}"
            try:
                row = mfu_length(run, state, model_dir, shape_name, resp, rows[resp], max(rows.values()), budget)
                if row is not None:
                    ok = (row["finite"] and 0 < row["mfu"] <= 1 and row["tokens_per_s"] > 0
                          and row["memory_within_15pct"] is not False)
                    run.summary["rows"].append({k: row[k] for k in (
                        "shape", "response_tokens", "tokens_per_s", "mfu", "peak_gpu_memory_gib", "plan_gib",
                        "memory_within_15pct")})
                    run.checks.record(label, ok, **row)
            except Exception:
                run.checks.record(label, False, traceback=traceback.format_exc())
        state.clear()  # the Learner: its models and optimiser states
        gc.collect()
        if run.cuda:
            torch.cuda.empty_cache()


def hf_shape(shape: dict, vocab: int):
    """``async_vapo.deploy.scale.ModelShape`` of a :data:`SHAPES` entry, as :func:`build` writes its config.json."""
    from async_vapo.deploy.scale import ModelShape

    return ModelShape.from_hf_config({"model_type": "qwen2", "vocab_size": vocab, "hidden_size": shape["hidden_size"],
                                      "intermediate_size": shape["intermediate_size"],
                                      "num_hidden_layers": shape["num_layers"],
                                      "num_attention_heads": shape["num_heads"],
                                      "num_key_value_heads": shape["num_kv_heads"], "tie_word_embeddings": True})


def mfu_length(run: MfuRun, state: dict, model_dir: Path, shape_name: str, resp: int, rows: int, mini_batch: int,
               budget: int) -> dict | None:
    """One response length: the estimate against the time left (skip or shrink; rank 0 decides for all), the model
    built if this is the shape's first length, then the timed updates; the check row, or None when skipped (the
    skip recorded here)."""
    import torch

    from async_vapo.config import load_config
    from async_vapo.deploy.scale import Cluster, GiB, estimate, resolve_shape
    from async_vapo.learner.process_group import broadcast_object
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.tiny import build_char_tokenizer

    args, prompt, world = run.args, run.args.mfu_prompt_tokens, run.world
    cfg = load_config([], mfu_overrides(model_dir, resp, mini_batch, budget, world))
    dims, vocab = SHAPES[shape_name]
    shape = hf_shape(dims, vocab)
    flops = update_flops(shape, [(prompt, resp)] * rows, ppo_epochs=cfg.algo.ppo_epochs,
                         critic_epochs=cfg.algo.effective_critic_epochs)
    rate = run.peak * (min(run.seen_mfu) if run.seen_mfu else ASSUMED_MFU)
    load_s = 0.0 if state.get("learner") else LOAD_S_PER_BPARAM * shape.params() / 1e9
    steps, note = args.mfu_steps, None
    left = run.deadline - time.monotonic()
    need = load_s + (1 + steps) * flops["total"] / world / rate
    if need > left and steps > 1 and load_s + 2 * flops["total"] / world / rate <= left:
        note = f"shrunk to 1 timed update: {steps} estimated at {need:.0f} s, {left:.0f} s left"
        steps, need = 1, load_s + 2 * flops["total"] / world / rate
    steps, need, left, note = broadcast_object((steps, need, left, note))  # every rank takes rank 0's way
    if need > left:
        run.checks.record(f"mfu_{shape_name}_{resp}", True, skipped=True, estimated_s=need, left_s=left,
                          reason=f"estimated {need:.0f} s (load {load_s:.0f} s, {1 + steps} updates at MFU "
                                 f"{rate / run.peak:.2f}) > {left:.0f} s left of --budget-s: run --stages mfu "
                                 f"--shapes {shape_name} --mfu-lengths {resp}")
        return None
    if not state.get("learner"):
        t0 = time.perf_counter()
        if run.rank == 0:
            build(model_dir, dims, vocab, prompt + max(args.mfu_lengths) + 64, device=str(run.device),
                  dtype=torch.bfloat16)
        torch.distributed.barrier()
        if resolve_shape(str(model_dir))[0] != shape:
            raise RuntimeError(f"the built model's config.json is not {shape}")
        state["learner"] = Learner(cfg, model_dir)
        state["load_s"] = time.perf_counter() - t0
        if not state["learner"].sharded:
            raise RuntimeError("the MFU stage runs the FSDP2 learner (learner.fsdp = on)")
    learner = state["learner"]
    tok = build_char_tokenizer()  # build's tokenizer
    batch = make_rollout_batch(groups(rows // 2, 2, prompt, resp, vocab, tok.eos_token_id, full_length=True),
                               tok.pad_token_id)
    metrics: dict = {}

    def update() -> None:
        metrics.update(learner.update(batch))

    warm = _timed(run.device, update)
    if run.cuda:
        torch.cuda.reset_peak_memory_stats(run.device)
    times = [_timed(run.device, update) for _ in range(steps)]
    peak_mem = torch.cuda.max_memory_allocated(run.device) if run.cuda else None
    seconds = sum(times) / len(times)
    achieved = flops["total"] / world / seconds
    run.seen_mfu.append(achieved / run.peak)
    # what `async-vapo plan` prints for this config, this model's config.json and these prompts (its step time's
    # published figures: this GPU's, where the plan has them)
    gpu_gib = torch.cuda.get_device_properties(run.device).total_memory / GiB if run.cuda else 80.0
    plan_gpu = next((g for key, g in (("H200", "h200"), ("H100", "h100-80g"), ("A100", "a100-80g"))
                     if run.cuda and key in run.summary["device"]), None)
    plan_shape, _ = resolve_shape(str(model_dir))  # the plan reads model.path/config.json
    plan = estimate(cfg, plan_shape, Cluster(gpu_memory_gib=gpu_gib, prompt_tokens=prompt, gpu=plan_gpu or "h200"),
                    engines=1)
    tokens = int(batch.tokens.attention_mask.sum())
    row = {"shape": shape_name, "params_per_model": shape.params(), "world": world, "response_tokens": resp,
           "prompt_tokens": prompt, "rows": rows, "tokens_per_update": tokens, "max_tokens_per_micro_batch": budget,
           "micro_batches_per_update": -(-rows // plan.setup.rows), "build_and_load_s": state["load_s"],
           "warmup_s": warm,
           "update_s": times, "update_mean_s": seconds, "tokens_per_s": tokens / seconds / world,
           "response_tokens_per_s": rows * resp / seconds / world, "model_flops_per_update": flops["total"],
           "model_flops_per_token": flops["per_token"],
           "attention_share_of_flops": flops["attention"] / flops["total"], "achieved_flops_per_s": achieved,
           "peak_bf16_flops": run.peak, "mfu": achieved / run.peak,
           "mfu_palm_attention": (flops["total"] + flops["attention"]) / world / seconds / run.peak,
           "plan_learner_tokens_per_s": plan.profile.learner_tokens_s_per_gpu if plan_gpu else None,
           "plan_gpu": plan_gpu,
           "plan_gib": plan.learner["total"] / GiB,
           "plan_parts_gib": {k: v / GiB for k, v in plan.learner.items() if k != "total"},
           "plan_rows_per_micro_batch": plan.setup.rows,
           "finite": all(math.isfinite(metrics[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss"))}
    if note:
        row["note"] = note
    if run.cuda:
        ratio = peak_mem / plan.learner["total"]
        row.update(peak_gpu_memory_gib=peak_mem / GiB, peak_over_plan=ratio, memory_goal="peak within 15 % of the plan",
                   memory_within_15pct=abs(ratio - 1) <= 0.15)
    else:
        row.update(peak_gpu_memory_gib=None, memory_within_15pct=None,
                   memory_skipped_reason="no CUDA device: torch.cuda.max_memory_allocated has no CPU counterpart (the "
                                         "process's resident memory also holds glibc's freed heap: "
                                         "benchmarks/learner_memory.py)")
    return row


def flex_check(checks: Checks, model_dir: Path, short, cuda: bool) -> None:
    """FlexAttention packing (learner.packed_attention = flex, auto on CUDA) against the padded SDPA forward, one
    float32 model each, unsharded on this rank's device: log-probs and gradients of the two-sequence packed row (the
    BlockMask must keep the second sequence off the first), then the forward of a second packed length (a
    recompile of the FlexAttention kernel). FlexAttention has no backward on the CPU: skipped there."""
    if not cuda:
        checks.record("flex_packed_equals_padded", True, skipped=True,
                      reason="FlexAttention has no backward on the CPU (torch: 'FlexAttention does not support "
                             "backward on CPU'); the CPU forward is tests/unit/test_long_sequences.py")
        return
    import torch

    from async_vapo.models.rl import chunked_response_logprobs, load_policy

    try:
        dev = short.input_ids.device
        padded_model = load_policy(model_dir).to(dev)
        flex_model = load_policy(model_dir, attn_implementation="flex_attention").to(dev)
        mask = short.response_mask.bool()
        t0 = time.perf_counter()
        lp, _ = chunked_response_logprobs(padded_model, short, 1.0, 512)
        (lp[mask].sum() / mask.sum()).backward()
        flex_lp, _ = chunked_response_logprobs(flex_model, short, 1.0, 512, packed="flex")
        (flex_lp[mask].sum() / mask.sum()).backward()
        t1 = time.perf_counter()
        err_lp = float((flex_lp - lp).detach()[mask].abs().max())
        diff = sum(float((q.grad - p.grad).float().pow(2).sum()) for p, q in
                   zip(padded_model.parameters(), flex_model.parameters(), strict=True))
        norm = sum(float(p.grad.float().pow(2).sum()) for p in padded_model.parameters())
        rel = math.sqrt(diff / max(norm, 1e-30))
        one = short.select([0])
        with torch.no_grad():
            lp1, _ = chunked_response_logprobs(padded_model, one, 1.0, 512)
            flex1, _ = chunked_response_logprobs(flex_model, one, 1.0, 512, packed="flex")
        err_one = float((flex1 - lp1)[one.response_mask.bool()].abs().max())
        checks.record("flex_packed_equals_padded", max(err_lp, err_one) < 1e-3 and rel < 1e-3,
                      packed_tokens=int(short.attention_mask.sum()), max_abs_logprob_error=err_lp,
                      relative_gradient_error=rel, second_length_max_abs_logprob_error=err_one,
                      first_forward_backward_s=t1 - t0)
        del padded_model, flex_model
        torch.cuda.empty_cache()
    except Exception:
        checks.record("flex_packed_equals_padded", False, traceback=traceback.format_exc())


def weight_transfer(checks: Checks, cuda: bool, tiny: bool, timeout_s: float = 150.0) -> None:
    """The weight transfer's NCCL step (module docstring), in two fresh processes outside torchrun's group."""
    import os
    import socket
    import statistics
    import subprocess

    import torch

    ngpu = torch.cuda.device_count() if cuda else 0
    devices = ("cuda:0", "cuda:1") if ngpu >= 2 else ("cuda:0", "cuda:0") if cuda else ("cpu", "cpu")
    backend = "nccl" if cuda else "gloo"
    nbytes, bucket, reps = ((4 << 20, 1 << 20, 3) if tiny and not cuda else (1 << 30, 16 << 20, 5))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    drop = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
            "MASTER_ADDR", "MASTER_PORT", "GROUP_WORLD_SIZE", "ROLE_NAME"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("TORCHELASTIC_")}
    env["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"  # NCCL >= 2.30, experimental: two ranks on one GPU
    row = {"backend": backend, "devices": list(devices), "same_gpu": cuda and devices[0] == devices[1],
           "bytes": nbytes, "bucket_bytes": bucket, "reps": reps}
    procs = [subprocess.Popen([sys.executable, "-c", BROADCAST, str(r), str(port), backend, devices[r], str(nbytes),
                               str(bucket), str(reps)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = []
    try:
        for proc in procs:
            outs.append(proc.communicate(timeout=timeout_s))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        checks.record("nccl_weight_transfer", False, error=f"no result within {timeout_s:g} s", **row)
        return
    results = []
    for out, err in outs:
        lines = [x for x in out.splitlines() if x.startswith("{")]
        results.append(json.loads(lines[-1]) if lines else {"error": err[-2000:]})
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        refused = any("Duplicate GPU" in e or "invalid usage" in e.lower() for e in errors)
        if refused and row["same_gpu"]:
            checks.record("nccl_weight_transfer", False, skipped=True, errors=errors,
                          nccl_version=".".join(map(str, torch.cuda.nccl.version())),
                          reason="NCCL refused two ranks on one GPU (supported from NCCL 2.30 with "
                                 "NCCL_MULTI_RANK_GPU_ENABLE=1); nothing measured: this step needs two GPUs here",
                          **row)
        else:
            checks.record("nccl_weight_transfer", False, errors=errors, **row)
        return
    r0 = results[0]
    bcast, mem = statistics.median(r0["broadcast_s"]), statistics.median(r0["memcpy_s"])
    row.update(broadcast_median_s=bcast, memcpy_median_s=mem, broadcast_over_memcpy=bcast / mem,
               goal="broadcast <= 2x memcpy", goal_met=bcast / mem <= 2.0, broadcast_gb_per_s=nbytes / bcast / 1e9,
               memcpy_gb_per_s=nbytes / mem / 1e9, broadcast_s=r0["broadcast_s"], memcpy_s=r0["memcpy_s"],
               received_exact=results[1]["received_exact"], nccl_version=r0["nccl_version"])
    if cuda:
        checks.record("nccl_weight_transfer", row["received_exact"], **row)
    else:
        checks.record("nccl_weight_transfer", row["received_exact"], skipped=True,
                      reason="no CUDA device: the same two-process broadcast ran over gloo, a smoke test of this "
                             "step", **row)


STAGES = ("weights", "mfu", "learner")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--tiny", action="store_true", help="2-layer models and short sequences (a smoke test)")
    p.add_argument("--response-tokens", type=int, default=20_000, help="the learner stage's responses")
    p.add_argument("--vocab", type=int, default=151_936, help="the learner stage's vocabulary")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    p.add_argument("--quick", action="store_true", help="the mfu stage alone, 0.5B shape, one timed update")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto", help="cpu: hide any GPU")
    p.add_argument("--shapes", help=f"the mfu stage's shapes, of {', '.join(SHAPES)} (default: the two Qwen2.5 "
                                    "shapes; tiny with --tiny)")
    p.add_argument("--mfu-lengths", help="response lengths (default 4096,16384; 64,256 with --shapes tiny)")
    p.add_argument("--mfu-prompt-tokens", type=int, help="prompt of every row (default 256; 16 with tiny)")
    p.add_argument("--mfu-steps", type=int, default=2, help="timed updates per length, after one warm-up")
    p.add_argument("--mfu-micro-batches", type=int, default=2, help="micro-batches per update (rows follow)")
    p.add_argument("--mfu-budget", type=int, default=0,
                   help="algo.max_tokens_per_micro_batch (default 4 x (prompt + shortest length))")
    p.add_argument("--peak-tflops", type=float, help="the GPU's peak instead of the datasheet table")
    p.add_argument("--budget-s", type=float,
                   help="seconds for the whole run (default DEVICE_CHECK_TIMEOUT_S - 30, i.e. 330)")
    args = p.parse_args(argv)
    args.stages = [x for x in args.stages.split(",") if x]
    if args.quick:
        args.stages, args.shapes, args.mfu_steps = ["mfu"], args.shapes or "qwen2.5-0.5b", 1
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"unknown stage(s) {sorted(unknown)}: of {', '.join(STAGES)}")
    args.shapes = (args.shapes or ("tiny" if args.tiny else "qwen2.5-0.5b,qwen2.5-1.5b")).split(",")
    if set(args.shapes) - set(SHAPES):
        p.error(f"unknown shape(s) {sorted(set(args.shapes) - set(SHAPES))}: of {', '.join(SHAPES)}")
    tiny = args.shapes == ["tiny"]
    args.mfu_lengths = [int(x) for x in (args.mfu_lengths or ("64,256" if tiny else "4096,16384")).split(",")]
    args.mfu_prompt_tokens = args.mfu_prompt_tokens or (16 if tiny else 256)
    if args.budget_s is None:
        import os

        args.budget_s = float(os.environ.get("DEVICE_CHECK_TIMEOUT_S", 360)) - 30
    return args


def main() -> int:
    started = time.monotonic()
    args = parse_args()
    if args.device == "cpu":
        import os

        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initialises CUDA
    deadline = started + args.budget_s
    import torch

    from async_vapo.learner.process_group import data_parallel_world, init_process_group, local_device

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    init_process_group(300)
    rank, world = data_parallel_world()
    cuda = torch.cuda.is_available()
    checks = Checks(out, writer=rank == 0)
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "world": world, "stages": args.stages,
           "device": torch.cuda.get_device_name() if cuda else "cpu", "budget_s": args.budget_s}
    checks.extra["environment"] = env
    stage_s = env["stage_s"] = {}
    t0 = time.monotonic()
    if "weights" in args.stages:
        checks.record("vllm_engine_steps", True, skipped=True,
                      reason="vLLM is not installed on the device machine (torch and transformers only)")
    if rank == 0 and "weights" in args.stages:
        import importlib.util

        no_vllm = importlib.util.find_spec("vllm") is None
        checks.record("vllm_nccl_weight_transfer", True, skipped=True,
                      reason=("vLLM is not installed on the device machine: " if no_vllm
                              else "this check starts no vLLM engine: ")
                      + "the learner's NCCL group and send (vLLM's PyNcclCommunicator and packed producer) and the "
                        "engine's receive (vLLM's NCCL weight-transfer engine with our watchdog, "
                        "async_vapo.weights.collective) did not run; nccl_weight_transfer measures the bare broadcast")
        try:
            weight_transfer(checks, cuda, args.tiny)
        except Exception:
            checks.record("nccl_weight_transfer", False, traceback=traceback.format_exc())
        stage_s["weights"] = time.monotonic() - t0
    if "mfu" in args.stages:
        t0 = time.monotonic()
        keep = LEARNER_STAGE_S if "learner" in args.stages else 0.0
        try:
            mfu_stage(checks, args, local_device(), world, rank, deadline - keep)
        except Exception:
            checks.record("mfu", False, traceback=traceback.format_exc())
        stage_s["mfu"] = time.monotonic() - t0
    if "learner" in args.stages:
        t0 = time.monotonic()
        left = deadline - time.monotonic()
        if left < LEARNER_STAGE_S and not args.tiny:
            checks.record("learner_stage", True, skipped=True,
                          reason=f"{left:.0f} s left of --budget-s, the learner stage is estimated at "
                                 f"{LEARNER_STAGE_S:.0f} s: run --stages learner")
        else:
            learner_stage(checks, args, env, rank, world, cuda)
        stage_s["learner"] = time.monotonic() - t0
    env["elapsed_s"] = time.monotonic() - started  # from the script's start (torchrun's start-up before it)
    ok = checks.write() if rank == 0 else True
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


def learner_stage(checks: Checks, args, env: dict, rank: int, world: int, cuda: bool) -> None:
    """The learner end to end (module docstring's list): value pretraining and a VAPO update on 20k-token
    responses, chunked = full, packed = padded, FlexAttention, DCP resume, export."""
    import torch
    import transformers

    from async_vapo.config import load_config
    from async_vapo.deploy.scale import Cluster, estimate, resolve_shape
    from async_vapo.learner.export import export
    from async_vapo.learner.sharding import full_state_dict
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.rl import response_logits

    shape = TINY if args.tiny else QWEN25_05B
    resp = 200 if args.tiny else args.response_tokens
    vocab = 512 if args.tiny else args.vocab
    env.update(shape=shape, vocab=vocab, response_tokens=resp)
    try:
        with tempfile.TemporaryDirectory() as d:
            d = Path(d)
            if rank == 0:
                build(d / "model", shape, vocab, resp + 512)
            torch.distributed.barrier()
            budget = resp + 300
            cfg = load_config([], [
                f"model.path={d / 'model'}", "model.critic_init=base", "model.dtype=bfloat16",
                "task.kind=arith", f"rollout.max_response_tokens={resp}", "algo.group_size=2",
                "algo.prompts_per_step=2", "algo.mini_batch_size=4", "algo.micro_batch_size=1",
                f"algo.max_tokens_per_micro_batch={budget}", "algo.value_pretrain_steps=1",
                "learner.fsdp=on", "learner.activation_checkpointing=true", "learner.logprob_chunk_tokens=4096",
                "optim.actor_lr=1e-5", "optim.critic_lr=1e-5", f"async.learner_devices={world}"])
            eos = transformers.AutoTokenizer.from_pretrained(str(d / "model")).eos_token_id
            batch = make_rollout_batch(groups(2, 2, 200, resp, vocab, eos), 0)
            tokens = int(batch.tokens.attention_mask.sum())
            learner = Learner(cfg, d / "model")
            params = sum(p.numel() for p in learner.policy.parameters())
            env["params_per_model"] = params
            before = {n: p.detach().to_local().clone() for n, p in learner.policy.named_parameters()}

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            m_pre = learner.pretrain_critic(batch)
            t1 = time.perf_counter()
            m1 = learner.update(batch)
            t2 = time.perf_counter()
            finite = all(math.isfinite(m_pre[k]) for k in ("critic/value_loss", "critic/grad_norm")) and all(
                math.isfinite(m1[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/value_loss"))
            checks.record("finite_losses", finite, pretrain=m_pre, update=m1)
            moved = sum(not torch.equal(before[n], p.detach().to_local()) for n, p in learner.policy.named_parameters())
            checks.record("weights_moved", moved == len(before), moved=moved, of=len(before))
            peak = torch.cuda.max_memory_allocated() if cuda else None
            # async-vapo plan's figures for this config (rows at their longest: 200 + resp tokens)
            plan = estimate(cfg, resolve_shape(str(d / "model"))[0], Cluster(prompt_tokens=200), engines=1)
            # one update: the old-log-prob and value forward, then policy and critic forward + backward; the peak
            # also spans value pretraining and the first update, which makes the policy's AdamW state
            checks.record("throughput", True, tokens=tokens, value_pretrain_s=t1 - t0, update_s=t2 - t1,
                          update_tokens_per_s=tokens / (t2 - t1), peak_gpu_memory_gib=peak and peak / 2**30,
                          planned_state_gib=plan.learner["state"] / 2**30, plan_gib=plan.learner["total"] / 2**30)

            # chunked = full, packed = padded (bf16 compute: the same hidden states, so close to exact)
            short = batch.tokens.select([0, 1])
            cut = min(2048, short.response_ids.shape[1])
            short.response_ids, short.response_mask = short.response_ids[:, :cut], short.response_mask[:, :cut]
            short.input_ids = short.input_ids[:, : short.prompt_len + cut]
            short.attention_mask = short.attention_mask[:, : short.prompt_len + cut]
            short.position_ids = short.position_ids[:, : short.prompt_len + cut]
            short = short.to(learner.device)
            mask = short.response_mask.bool()
            with torch.no_grad():
                from async_vapo.algo.utils import logprobs_from_logits

                full = logprobs_from_logits(response_logits(learner.policy, short), short.response_ids)
                chunked, _ = learner.policy.chunked_response_logprobs(short, 1.0, 512, False, torch.bfloat16)
                packed, _ = learner.policy.chunked_response_logprobs(short, 1.0, 512, True, torch.bfloat16)
            err_c = float((full - chunked)[mask].abs().max())
            err_p = float((chunked - packed)[mask].abs().max())
            checks.record("chunked_equals_full", err_c < 2e-2, max_abs_logprob_error=err_c)
            checks.record("packed_equals_padded", err_p < 5e-2, max_abs_logprob_error=err_p)
            flex_check(checks, d / "model", short, cuda)

            # DCP save -> resume: the same next update
            # the weights at the save, gathered on rank 0 (a copy: on the CPU they may be views of the parameters)
            saved = {k: v.clone() for k, v in full_state_dict(learner.policy).items()}
            ckpt = learner.save(d / "ckpt", extra={"cursor": 1})
            m2 = learner.update(batch)
            again = Learner(cfg, d / "model")
            again.load_state(ckpt)
            m2b = again.update(batch)
            rel = {k: abs(m2b[k] - m2[k]) / max(abs(m2[k]), 1e-12) for k in ("actor/grad_norm", "critic/grad_norm",
                                                                            "critic/value_loss")}
            checks.record("dcp_resume_same_next_step", max(rel.values()) < 1e-3, relative_error=rel)

            # export: transformers loads it and gives the logits of the learner's weights at the save (float32)
            if rank == 0:
                from torch.distributed.checkpoint.state_dict import set_model_state_dict

                hf = export(ckpt, d / "export")
                dev = learner.device
                exported = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).to(dev)
                reference = transformers.AutoModelForCausalLM.from_pretrained(str(d / "model"), dtype=torch.float32)
                set_model_state_dict(reference, saved)
                reference = reference.to(dev).eval()
                one = short.select([0])
                with torch.no_grad():
                    err = float((response_logits(exported, one) - response_logits(reference, one)).abs().max())
                checks.record("export_same_logits", err < 1e-4, max_abs_logit_error=err)
    except Exception:
        checks.record("no_exception", False, traceback=traceback.format_exc())


if __name__ == "__main__":
    sys.exit(main())
