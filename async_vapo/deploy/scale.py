"""Scale arithmetic in the open (``async-vapo plan``): memory per learner GPU, per engine GPU, bytes and time per
weight sync, for a config, a model shape and a cluster shape. Pure functions over integers; every assumption is a
named argument and is printed with the result.

Learner (FSDP, every parameter fully sharded over ``ranks``; VAPO trains a policy and a critic of the same shape,
each with its own AdamW, both sharded over the same ranks):

* sharded state, per parameter: float32 master weights 4 B + float32 gradients 4 B + AdamW's two moments 8 B
  = 16 B, divided by ``ranks``;
* gathered layers: FSDP unshards one decoder layer at a time and prefetches the next, so 2 layers in the compute
  dtype (2 B), and their gradients before the reduce-scatter (float32, 4 B);
* activations of one micro-batch of ``tokens`` (micro_batch_size x (prompt + response)), with activation
  checkpointing per decoder layer: every layer's input kept (layers x tokens x hidden x 2 B), one layer recomputed
  at a time (34 x tokens x hidden B: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", s·b·h·(34 + 5·a·s/h) at 16 bit, the attention-score term dropped for flash attention), and
  the logits of the whole micro-batch (tokens x vocab x (2 B + 4 B for the float32 log-softmax), not chunked).
  Policy and critic run one after the other: the larger of the two counts (the critic's head is one column).

Engine (vLLM, ``tensor_parallel_size`` GPUs): weights in the engine dtype split over the GPUs; KV cache per token
2 (K and V) x layers x KV heads x head dim x dtype bytes, the KV heads split over the GPUs (replicated when there are
fewer KV heads than GPUs); KV space = gpu_memory_utilization x GPU memory - weights (vLLM's activation peak and
CUDA graphs not subtracted: an upper bound).

Weight sync: every parameter once per engine in the engine dtype; the learner sends to one engine after another
(one torch.distributed group per engine, ``async_vapo.weights.collective``), so a sync to all engines takes
engines x bytes / bandwidth at the stated bandwidth, plus vLLM's reload (not modelled).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30

# Qwen2.5-32B's config.json as published (Qwen/Qwen2.5-32B): the paper config's model when it is not on disk here.
QWEN25_32B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
              "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}
KNOWN_SHAPES = {"qwen2.5-32b": QWEN25_32B}


@dataclass(frozen=True)
class ModelShape:
    """A Llama / Qwen2 decoder (gated MLP, grouped-query attention, RMSNorm; Qwen2 has q/k/v biases)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_embeddings: bool = False
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, d: dict) -> ModelShape:
        heads = d["num_attention_heads"]
        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_layers=d["num_hidden_layers"], num_heads=heads,
                   num_kv_heads=d.get("num_key_value_heads") or heads,
                   head_dim=d.get("head_dim") or d["hidden_size"] // heads,
                   tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                   qkv_bias=d.get("model_type") == "qwen2" or bool(d.get("attention_bias", False)))

    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        mlp = 3 * h * self.intermediate_size
        return attn + mlp + 2 * h  # two RMSNorms

    def params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params() + embed * (1 if self.tie_embeddings else 2) + self.hidden_size

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache bytes per token on one of ``tp`` GPUs."""
        heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * heads_per_gpu * self.head_dim * dtype_bytes


def learner_memory(shape: ModelShape, ranks: int, *, models: int, tokens: int) -> dict[str, int]:
    """Bytes per learner GPU by part (module docstring); ``models``: 2 with a critic, else 1."""
    p, lp, h = shape.params(), shape.layer_params(), shape.hidden_size
    out = {
        "sharded_state": -(-models * p * 16 // ranks),
        "gathered_layers": 2 * lp * (2 + 4),
        "activation_checkpoints": shape.num_layers * tokens * h * 2,
        "layer_recompute": 34 * tokens * h,
        "logits": tokens * shape.vocab_size * (2 + 4),
    }
    out["total"] = sum(out.values())
    return out


def engine_memory(shape: ModelShape, tp: int, *, gpu_bytes: int, utilization: float, dtype_bytes: int,
                  seq_tokens: int) -> dict[str, float]:
    """Bytes per engine GPU and how many sequences of ``seq_tokens`` the KV cache holds at once."""
    weights = -(-shape.params() * dtype_bytes // tp)
    kv_space = int(utilization * gpu_bytes) - weights
    per_seq = shape.kv_bytes_per_token(dtype_bytes, tp) * seq_tokens
    return {"weights": weights, "kv_space": kv_space, "kv_per_sequence": per_seq,
            "sequences": max(0, kv_space) // per_seq}


def weight_sync(shape: ModelShape, engines: int, *, dtype_bytes: int, bandwidth_bytes_s: float) -> dict[str, float]:
    """Bytes of one version per engine, and seconds to send it to one and to every engine at the bandwidth."""
    nbytes = shape.params() * dtype_bytes
    return {"bytes_per_engine": nbytes, "bytes_total": nbytes * engines,
            "seconds_per_engine": nbytes / bandwidth_bytes_s, "seconds_all": nbytes * engines / bandwidth_bytes_s}


def resolve_shape(model_path: str | None, model_config: str | None = None) -> tuple[ModelShape, str]:
    """The model's shape and where it came from: ``--model-config``, ``model.path``/config.json, or the published
    shape of a known model named by the path's last component."""
    if model_config:
        return ModelShape.from_hf_config(json.loads(Path(model_config).read_text())), model_config
    if model_path is None:
        raise ValueError("model.path is not set (the embedded tiny model): give --model-config CONFIG.JSON")
    cfg_file = Path(model_path) / "config.json"
    if cfg_file.is_file():
        return ModelShape.from_hf_config(json.loads(cfg_file.read_text())), str(cfg_file)
    known = KNOWN_SHAPES.get(Path(model_path).name.lower())
    if known is None:
        raise ValueError(f"{cfg_file} not found and {Path(model_path).name!r} is not a known shape "
                         f"({', '.join(KNOWN_SHAPES)}): give --model-config CONFIG.JSON")
    return ModelShape.from_hf_config(known), f"published config.json of {Path(model_path).name} (not on disk)"


DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def report(cfg, *, hosts: int, gpus_per_host: int, gpu_memory_gib: float, bandwidth_gbytes_s: float,
           prompt_tokens: int, model_config: str | None = None) -> str:
    """The text ``async-vapo plan`` prints: placement, then memory and sync arithmetic with their assumptions."""
    from async_vapo.deploy.placement import place

    shape, source = resolve_shape(cfg.model.path, model_config)
    names = [f"host{i}" for i in range(hosts)]
    hostfile = [(names[0], r) for r in ("learner", "replay", "verifier")] + [(h, "rollout") for h in names]
    placement = place(cfg.async_.rollout_devices, cfg.async_.learner_devices,
                      tensor_parallel_size=cfg.rollout.tensor_parallel_size, gpus_per_host=gpus_per_host,
                      hostfile=hostfile)
    r, a, tp = cfg.rollout, cfg.algo, cfg.rollout.tensor_parallel_size
    dt = DTYPE_BYTES[cfg.model.dtype]
    seq = prompt_tokens + r.max_response_tokens
    tokens = a.micro_batch_size * seq
    models = 2 if a.uses_critic else 1
    gpu_bytes = int(gpu_memory_gib * GiB)
    lm = learner_memory(shape, cfg.async_.learner_devices, models=models, tokens=tokens)
    em = engine_memory(shape, tp, gpu_bytes=gpu_bytes, utilization=r.gpu_memory_utilization, dtype_bytes=dt,
                       seq_tokens=seq)
    ws = weight_sync(shape, len(placement.engines), dtype_bytes=dt, bandwidth_bytes_s=bandwidth_gbytes_s * 1e9)
    fits = "fits" if lm["total"] <= gpu_bytes else f"DOES NOT FIT {gpu_memory_gib:g} GiB"
    def row(label: str, value: str) -> str:
        return f"  {label:<68} {value}"

    lines = [
        f"model: {shape.params() / 1e9:.2f} B parameters ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_kv_heads} KV heads); shape from {source}",
        f"cluster: {hosts} host(s) x {gpus_per_host} GPU(s) of {gpu_memory_gib:g} GiB; "
        f"async.rollout_devices : learner_devices = {cfg.async_.rollout_devices} : {cfg.async_.learner_devices}, "
        f"tensor_parallel_size {tp} -> {len(placement.engines)} engine(s)",
        "",
        placement.describe(),
        "",
        f"learner, per GPU ({cfg.async_.learner_devices} FSDP rank(s), {models} model(s): "
        f"{'policy + critic' if models == 2 else 'policy'}; micro-batch {a.micro_batch_size} x ({prompt_tokens} "
        f"prompt + {r.max_response_tokens} response) = {tokens:,} tokens):",
        row("sharded fp32 masters + fp32 grads + AdamW m, v (16 B/param / ranks)", _gib(lm["sharded_state"])),
        row("2 gathered layers (bf16 params + fp32 grads)", _gib(lm["gathered_layers"])),
        row("activation checkpoints (layers x tokens x hidden x 2 B)", _gib(lm["activation_checkpoints"])),
        row("one layer recomputed (34 x tokens x hidden B)", _gib(lm["layer_recompute"])),
        row("logits, not chunked (tokens x vocab x 6 B)", _gib(lm["logits"])),
        row("total", f"{_gib(lm['total'])}  ({fits})"),
        "",
        f"engine, per GPU (tensor parallel {tp}, {cfg.model.dtype}, gpu_memory_utilization "
        f"{r.gpu_memory_utilization:g}):",
        row("weights", _gib(em["weights"])),
        row("KV space (utilization x memory - weights; an upper bound)", _gib(em["kv_space"])),
        row(f"KV cache of one {seq:,}-token sequence", _gib(em["kv_per_sequence"])),
        row("full-length sequences at once per engine",
            f"{em['sequences']:,}  (a group is {a.group_size}; max_num_seqs {r.max_num_seqs})"),
        "",
        f"weight sync ({cfg.model.dtype}, at {bandwidth_gbytes_s:g} GB/s, one engine after another; vLLM's reload "
        "not included):",
        row("bytes per engine", f"{ws['bytes_per_engine'] / 1e9:,.1f} GB"),
        row(f"bytes to all {len(placement.engines)} engine(s)", f"{ws['bytes_total'] / 1e9:,.1f} GB"),
        row("time per engine", f"{ws['seconds_per_engine']:.2f} s"),
        row("time to all engines", f"{ws['seconds_all']:.2f} s"),
    ]
    return "\n".join(lines)
