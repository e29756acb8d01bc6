"""Scale arithmetic in the open (``async-vapo plan``): memory per learner rank and per engine GPU, bytes and time
per weight sync, and an estimated step time, for a config, a model shape and a cluster. Pure functions over
integers; every assumption is a named argument or a setting of the config, and is printed with the result.

The learner as ``async_vapo.learner.vapo.Learner`` runs it (its settings, read from the config):

* micro-batches: ``algo.max_tokens_per_micro_batch`` > 0 packs rows of at most that many padded tokens (rows x
  longest row; a row longer than the budget alone: ``Learner._plan``); 0 takes ``algo.micro_batch_size`` rows. The
  plan takes every row at its longest (prompt + ``rollout.max_response_tokens``), the worst micro-batch.
  ``tests/unit/test_scale.py`` checks :func:`micro_batch_rows` against ``Learner._plan`` itself (importing the
  learner here would import torch: a minute on a loaded machine, for a few integer divisions).
* sharding (``learner.sharding``): FSDP2 with more than one rank or ``learner.fsdp = "on"``; each decoder layer a
  unit, the embeddings, final norm and heads in the root unit.
* policy and critic (``algo.uses_critic``), each with its own AdamW, both sharded over the same ranks; their
  forwards and backwards run one after the other, so the activations of one of them are live at a time (the
  policy's: its head has ``vocab`` columns, the critic's one).

Learner memory per rank (bytes):

* state: per parameter of each model a float32 master 4 B + AdamW's two moments 8 B = 12 B, and float32 gradients
  4 B per parameter of one model: the learner runs the policy's backward and optimiser step, then the critic's, and
  frees each model's gradients at its step (``zero_grad(set_to_none=True)``), so with a critic 28 B per parameter of
  one model, without 16 B; with the KL penalty's reference policy (``algo.effective_kl_coef`` > 0: REINFORCE++) its
  frozen float32 weights, 4 B per parameter more; divided by the ranks when sharded; in host memory instead with
  ``learner.cpu_offload`` (FSDP2's CPUOffloadPolicy);
* sharded: the gathered units in compute dtype plus their float32 gradients before the reduce-scatter
  (``reduce_dtype`` float32): two decoder layers (one running, one prefetched) and the root unit (embeddings and
  head, which FSDP2 keeps gathered through the forward); unsharded with a 16-bit dtype: autocast's cached 16-bit
  copy of the running model's weights;
* activations of one micro-batch of ``tokens``: with ``learner.activation_checkpointing`` every layer's input
  (layers x tokens x hidden x compute bytes) and one layer recomputed at a time; without, every layer's. A layer
  keeps 34 x tokens x hidden bytes at 16 bit (Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models", s·b·h·(34 + 5·a·s/h), the attention-score term dropped: SDPA / flash attention),
  scaled by compute bytes / 2;
* logits: ``learner.logprob_chunk_tokens`` > 0 computes them that many tokens at a time under checkpointing,
  else the whole micro-batch at once; tokens x vocab x the peak bytes per logit of the learner's own head code,
  :data:`LOGIT_BYTES` (the compute-dtype logits, their float32 copy, the softmax the entropy reads, and their
  gradients: measured by counting live tensors, ``tests/unit/test_scale.py``).

The parts are live tensors, what a GPU's allocator is asked for. A learner on the CPU also keeps what glibc's heap
holds after tensors are freed: with glibc's default (dynamic) mmap threshold, FSDP2's per-layer gathered parameters
and unsharded gradients on 2 gloo ranks left as much again resident as the live tensors' peak
(``benchmarks/learner_memory.py --glibc-default``); not counted here.

Engine (vLLM, ``tensor_parallel_size`` GPUs): weights in the engine dtype split over the GPUs; KV cache per token
2 (K and V) x layers x KV heads x head dim x dtype bytes, the KV heads split over the GPUs (replicated when there are
fewer KV heads than GPUs); KV space = gpu_memory_utilization x GPU memory - weights (vLLM's activation peak and
CUDA graphs not subtracted: an upper bound).

Weight sync: every parameter once per engine in the engine dtype; the learner sends to one engine after another
(one torch.distributed group per engine, ``async_vapo.weights.collective``), so a sync to all engines takes
engines x bytes / bandwidth at the stated bandwidth, plus vLLM's reload (not modelled).

Step time (:func:`step_seconds`): an update generates ``prompts_per_step x group_size`` responses and learns from
them. With ``async.max_staleness = 0`` the stages take turns (generate, then learn, then sync); with staleness >= 1
generation of the next batch overlaps learning, so a step is the slower of the two, plus the sync. Rates come from
a measured profile (``--profile``: generation and learner tokens/s per GPU) or, without one, from a GPU's
published memory bandwidth and bf16 peak at stated efficiencies (:data:`GPUS`); both scale linearly with GPUs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from async_vapo.staleness import StalenessPolicy

GiB = 2**30

# config.json as published (Qwen/Qwen2.5-32B, Qwen/Qwen2.5-7B): the shipped configs' models when not on disk here.
QWEN25_32B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 5120, "intermediate_size": 27648,
              "num_hidden_layers": 64, "num_attention_heads": 40, "num_key_value_heads": 8,
              "tie_word_embeddings": False}
QWEN25_7B = {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584, "intermediate_size": 18944,
             "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
             "tie_word_embeddings": False}
KNOWN_SHAPES = {"qwen2.5-32b": QWEN25_32B, "qwen2.5-7b": QWEN25_7B}

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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

    def root_params(self) -> int:
        """FSDP2's root unit: embeddings, the LM head (unless tied) and the final norm."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2) + self.hidden_size

    def params(self) -> int:
        return self.num_layers * self.layer_params() + self.root_params()

    def lora_params(self, rank: int, targets) -> int:
        """Parameters of a LoRA adapter of ``rank`` on the decoder's linear layers named in ``targets``
        (``model.lora``): r x (in + out) per target layer, A and B."""
        h, q, kv, m = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, m),
                "up_proj": (h, m), "down_proj": (m, h)}
        return self.num_layers * sum(rank * sum(dims[t]) for t in targets if t in dims)

    def kv_bytes_per_token(self, dtype_bytes: int, tp: int = 1) -> int:
        """KV cache bytes per token on one of ``tp`` GPUs."""
        heads_per_gpu = max(1, self.num_kv_heads // tp)
        return 2 * self.num_layers * heads_per_gpu * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class LearnerSetup:
    """What of the learner's settings decides its memory (module docstring); :meth:`from_config` reads them."""
    ranks: int
    models: int
    """2 with a critic (``algo.uses_critic``), else 1."""
    seq_tokens: int
    """The longest row: longest prompt + ``rollout.max_response_tokens``."""
    rows: int
    """Rows of the largest micro-batch (:func:`micro_batch_rows`)."""
    compute_bytes: int = 2
    sharded: bool = True
    activation_checkpointing: bool = True
    logprob_chunk_tokens: int = 0
    cpu_offload: bool = False
    budget: int = 0
    """``algo.max_tokens_per_micro_batch`` (0: ``algo.micro_batch_size`` rows)."""
    reference: bool = False
    """A frozen reference policy for the KL penalty (``algo.effective_kl_coef`` > 0): its float32 weights."""
    entropy_grad: bool = False
    """The entropy bonus has a gradient (``algo.entropy_coef`` > 0): unchunked logits keep more for its backward."""
    lora_rank: int = 0
    """``model.lora.rank``: 0 = the whole policy trained; else a frozen float32 base and an adapter on
    ``lora_targets``."""
    lora_targets: tuple[str, ...] = ()
    critic_lora_rank: int = 0
    """``model.critic_lora.rank``: 0 = the whole critic trained; else its frozen float32 trunk, an adapter on
    ``critic_lora_targets`` and its value head (not counted: hidden size + 1 parameters)."""
    critic_lora_targets: tuple[str, ...] = ()

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_tokens

    @classmethod
    def from_config(cls, cfg, *, ranks: int, prompt_tokens: int, budget: int | None = None) -> LearnerSetup:
        a, lc = cfg.algo, cfg.learner
        seq = prompt_tokens + cfg.rollout.max_response_tokens
        budget = a.max_tokens_per_micro_batch if budget is None else budget
        sharded = ranks > 1 or lc.fsdp == "on"
        return cls(ranks=ranks, models=2 if a.uses_critic else 1, seq_tokens=seq,
                   rows=micro_batch_rows(budget, a.micro_batch_size, seq, a.mini_batch_size, ranks),
                   compute_bytes=DTYPE_BYTES[cfg.model.dtype], sharded=sharded,
                   activation_checkpointing=lc.activation_checkpointing,
                   logprob_chunk_tokens=lc.logprob_chunk_tokens, cpu_offload=lc.cpu_offload and sharded,
                   budget=budget, reference=a.effective_kl_coef > 0, entropy_grad=a.entropy_coef > 0,
                   lora_rank=cfg.model.lora.rank, lora_targets=tuple(cfg.model.lora.target_modules),
                   critic_lora_rank=cfg.model.critic_lora.rank,
                   critic_lora_targets=tuple(cfg.model.critic_lora.target_modules))


LOGIT_BYTES = {"chunked": 24, "whole": 16, "whole_entropy_grad": 28}
"""Peak bytes per response token per vocabulary entry of the learner's log-prob and entropy code, forward and
backward, counted as live tensors on the CPU (``tests/unit/test_scale.py`` measures them again and holds these
within 15 %; the same within 0.3 B for bfloat16 and float32 compute): ``chunked`` = ``models.rl.
chunked_response_logprobs``'s checkpointed chunk (its recompute keeps the bf16 and float32 logits, the softmax the
entropy reads and their gradients; 20 B when the entropy also has a gradient); ``whole`` = ``response_logits`` then
``logprobs_from_logits`` with the entropy under no_grad, and with its gradient (the entropy bonus)."""


def logit_bytes(s: LearnerSetup) -> int:
    """:data:`LOGIT_BYTES` for the learner's setup."""
    if s.logprob_chunk_tokens:
        return LOGIT_BYTES["chunked"]
    return LOGIT_BYTES["whole_entropy_grad" if s.entropy_grad else "whole"]


def micro_batch_rows(budget: int, micro_batch_size: int, seq_tokens: int, mini_batch_size: int, ranks: int) -> int:
    """Rows of the largest micro-batch ``Learner._plan`` makes of a mini-batch whose rows all have ``seq_tokens``
    tokens: up to ``budget // seq_tokens`` (at least 1) with a token budget, else ``micro_batch_size``; never more
    than a rank's share of the mini-batch."""
    share = -(-mini_batch_size // ranks)
    rows = max(1, budget // seq_tokens) if budget else micro_batch_size
    return max(1, min(rows, share if budget else mini_batch_size))


def state_bytes(shape: ModelShape, s: LearnerSetup) -> int:
    """Masters and AdamW moments of every model (12 B/param), one model's gradients (4 B/param) and a reference
    policy's float32 weights (4 B/param) on a rank. With LoRA (``model.lora``, ``model.critic_lora``) a model is its
    frozen float32 base (4 B/param) and the adapter's masters and moments (12 B per adapter parameter); the gradients
    are the larger model's trainable parameters' (the models step one after the other)."""
    p = shape.params()

    def model(rank: int, targets) -> tuple[int, int]:  # (bytes of weights and AdamW state, trainable parameters)
        if not rank:
            return 12 * p, p
        adapter = shape.lora_params(rank, targets)
        return 4 * p + 12 * adapter, adapter

    policy, policy_trained = model(s.lora_rank, s.lora_targets)
    critic, critic_trained = model(s.critic_lora_rank, s.critic_lora_targets) if s.models > 1 else (0, 0)
    grads = 4 * max(policy_trained, critic_trained)
    return (policy + critic + grads + 4 * s.reference * p) // (s.ranks if s.sharded else 1)


def learner_memory(shape: ModelShape, s: LearnerSetup) -> dict[str, int]:
    """Bytes per learner rank by part (module docstring), ``total`` on the device and ``host`` in host memory."""
    p, h, cb, t = shape.params(), shape.hidden_size, s.compute_bytes, s.tokens
    state = state_bytes(shape, s)
    out = {"state": 0 if s.cpu_offload else state}
    if s.sharded:
        out["gathered"] = (2 * shape.layer_params() + shape.root_params()) * (cb + 4)
    else:
        out["gathered"] = p * cb if cb < 4 else 0  # autocast's weight cache
    layer = 34 * t * h * cb // 2
    if s.activation_checkpointing:
        out["activations"] = shape.num_layers * t * h * cb + layer
    else:
        out["activations"] = shape.num_layers * layer
    logit_tokens = min(s.logprob_chunk_tokens, t) if s.logprob_chunk_tokens else t
    out["logits"] = logit_tokens * shape.vocab_size * logit_bytes(s)
    out["total"] = sum(out.values())
    out["host"] = state if s.cpu_offload else 0
    return out


def learner_assumptions(shape: ModelShape, s: LearnerSetup) -> list[tuple[str, str]]:
    """(label, what it assumed) for each line of :func:`learner_memory`, in its order."""
    div = f" / {s.ranks} ranks" if s.sharded else " (one unsharded rank)"
    critic = (f"LoRA rank {s.critic_lora_rank} critic: frozen fp32 trunk 4 B/param + "
              f"{shape.lora_params(s.critic_lora_rank, s.critic_lora_targets):,} adapter params x 16 B"
              if s.critic_lora_rank else "critic: 12 B/param + its grads 4 B/param")
    return [
        ("state", (f"LoRA rank {s.lora_rank}: frozen fp32 policy base 4 B/param + "
                   f"{shape.lora_params(s.lora_rank, s.lora_targets):,} adapter params x 16 B (masters, AdamW m, v, "
                   f"grads)" + (f" + {critic}" if s.models > 1 else "")
                   if s.lora_rank else
                   f"fp32 policy: 12 B/param + its grads 4 B/param + {critic}"
                   if s.critic_lora_rank and s.models > 1 else
                   f"fp32 masters + AdamW m, v: 12 B/param x {s.models} model(s) + fp32 grads: 4 B/param x 1 model")
                  + (" (policy and critic step one after the other, each model's grads freed at its step)"
                     if s.models > 1 else "")
                  + (" + the KL penalty's frozen reference policy: fp32 weights 4 B/param" if s.reference else "")
                  + div
                  + ("; in host memory (learner.cpu_offload)" if s.cpu_offload else "")),
        ("gathered", "2 decoder layers + root unit (embeddings, head) gathered, "
                     f"{s.compute_bytes} B + fp32 grad 4 B/param" if s.sharded else
                     f"autocast's {s.compute_bytes}-byte weight cache" if s.compute_bytes < 4 else "none (float32)"),
        ("activations", f"micro-batch {s.rows} x {s.seq_tokens:,} = {s.tokens:,} tokens; "
                        + ("checkpointed: layer inputs + one layer recomputed (34 x tokens x hidden)"
                           if s.activation_checkpointing else "no checkpointing: 34 x tokens x hidden per layer")),
        ("logits", (f"chunked, {s.logprob_chunk_tokens:,} tokens at a time" if s.logprob_chunk_tokens
                    else "not chunked: the whole micro-batch") + f" x vocab x {logit_bytes(s)} B (measured peak)"),
    ]


def engine_memory(shape: ModelShape, tp: int, *, gpu_bytes: int, utilization: float, dtype_bytes: int,
                  seq_tokens: int) -> dict[str, float]:
    """Bytes per engine GPU and how many sequences of ``seq_tokens`` the KV cache holds at once."""
    weights = -(-shape.params() * dtype_bytes // tp)
    kv_space = int(utilization * gpu_bytes) - weights
    per_seq = shape.kv_bytes_per_token(dtype_bytes, tp) * seq_tokens
    return {"weights": weights, "kv_space": kv_space, "kv_per_sequence": per_seq,
            "sequences": max(0, kv_space) // per_seq}


def weight_sync(shape: ModelShape, engines: int, *, dtype_bytes: int, bandwidth_bytes_s: float,
                adapter_params: int = 0) -> dict[str, float]:
    """Bytes of one version per engine, and seconds to send it to one and to every engine at the bandwidth. With
    LoRA (``adapter_params`` > 0) a version is its float32 adapter (``weights.adapter``)."""
    nbytes = adapter_params * 4 if adapter_params else shape.params() * dtype_bytes
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


# ---------------------------------------------------------------- step time

@dataclass(frozen=True)
class Gpu:
    """A GPU's published figures (the vendors' datasheets: HBM bandwidth, dense bf16 tensor-core peak)."""
    name: str
    memory_gib: float
    bandwidth_bytes_s: float
    bf16_flops: float


GPUS = {g.name: g for g in (
    Gpu("a100-80g", 80, 2.039e12, 312e12),  # A100 80GB SXM datasheet
    Gpu("h100-80g", 80, 3.35e12, 989e12),  # H100 SXM5 datasheet (dense, without sparsity)
    Gpu("h200", 141, 4.8e12, 989e12),  # H200 SXM datasheet
)}
DEFAULT_HOST_MEMORY_GIB = 2048.0
"""Memory of a learner host without ``--host-memory-gib``: an 8-GPU DGX A100 (640 GB), H100 or H200 has 2 TiB."""
DECODE_BANDWIDTH_EFFICIENCY = 0.5
"""Share of the HBM bandwidth a batched vLLM decode step reaches (weights + KV cache read once per step)."""
LEARNER_MFU = 0.35
"""Model FLOPs utilisation of the FSDP learner (forward 2, backward 4 FLOPs per parameter per token)."""


@dataclass(frozen=True)
class Profile:
    """Throughput per GPU: generated tokens/s of an engine divided by its GPUs, learner tokens/s (prompt + response
    tokens of a batch over the update's time) per rank."""
    generation_tokens_s_per_gpu: float
    learner_tokens_s_per_gpu: float
    source: str
    per_tp: dict[int, float] = field(default_factory=dict)
    """Measured generation tokens/s per GPU by tensor-parallel size, where the profile has them."""

    @classmethod
    def load(cls, path: str) -> Profile:
        """A JSON file ``{"generation_tokens_per_s_per_gpu": G, "learner_tokens_per_s_per_gpu": L,
        ["generation_tokens_per_s_per_gpu_by_tp": {"4": G4, ...}], ["hardware": "..."]}``."""
        d = json.loads(Path(path).read_text())
        try:
            g, lt = float(d["generation_tokens_per_s_per_gpu"]), float(d["learner_tokens_per_s_per_gpu"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: needs generation_tokens_per_s_per_gpu and learner_tokens_per_s_per_gpu "
                             f"(numbers): {e}") from None
        if g <= 0 or lt <= 0:
            raise ValueError(f"{path}: rates must be > 0")
        by_tp = {int(k): float(v) for k, v in d.get("generation_tokens_per_s_per_gpu_by_tp", {}).items()}
        return cls(g, lt, f"measured profile {path}" + (f" ({d['hardware']})" if "hardware" in d else ""), by_tp)

    def generation(self, tp: int) -> float:
        return self.per_tp.get(tp, self.generation_tokens_s_per_gpu)


def published_profile(shape: ModelShape, gpu: Gpu, *, tp: int, dtype_bytes: int, utilization: float,
                      context_tokens: int, max_num_seqs: int, models: int, checkpointing: bool,
                      epochs: int) -> Profile:
    """Rates from ``gpu``'s published figures: a decode step of an engine reads its weights and the KV cache of its
    running sequences once (at DECODE_BANDWIDTH_EFFICIENCY of the bandwidth), the sequences being as many as the
    KV space holds at ``context_tokens`` each, up to ``max_num_seqs``; the learner runs a no-grad forward (old
    log-probs, values: 2 FLOPs/param/token) and per epoch forward + backward (6, + 2 recomputing with activation
    checkpointing) of each model at LEARNER_MFU of the bf16 peak."""
    e = engine_memory(shape, tp, gpu_bytes=int(gpu.memory_gib * GiB), utilization=utilization,
                      dtype_bytes=dtype_bytes, seq_tokens=context_tokens)
    seqs = max(1, min(max_num_seqs, int(e["sequences"])))
    step_bytes = e["weights"] + seqs * shape.kv_bytes_per_token(dtype_bytes, tp) * context_tokens
    gen = seqs / (step_bytes / (gpu.bandwidth_bytes_s * DECODE_BANDWIDTH_EFFICIENCY)) / tp
    flops = models * shape.params() * (2 + epochs * (6 + (2 if checkpointing else 0)))
    learn = gpu.bf16_flops * LEARNER_MFU / flops
    return Profile(gen, learn, f"published figures of {gpu.name} (bandwidth {gpu.bandwidth_bytes_s / 1e12:g} TB/s x "
                               f"{DECODE_BANDWIDTH_EFFICIENCY:g}, bf16 {gpu.bf16_flops / 1e12:g} TFLOP/s x MFU "
                               f"{LEARNER_MFU:g})")


def step_seconds(*, generated_tokens: float, learned_tokens: float, generation_tokens_s: float,
                 learner_tokens_s: float, max_staleness: int, sync_s: float = 0.0) -> dict[str, float]:
    """Seconds per update (module docstring): generate + learn + sync when the stages take turns
    (``max_staleness`` 0), max(generate, learn) + sync when generation overlaps learning."""
    gen, learn = generated_tokens / generation_tokens_s, learned_tokens / learner_tokens_s
    step = (gen + learn if max_staleness == 0 else max(gen, learn)) + sync_s
    return {"generate_s": gen, "learn_s": learn, "sync_s": sync_s, "step_s": step}


# ---------------------------------------------------------------- the report and the search

def _gib(n: float) -> str:
    return f"{n / GiB:,.1f} GiB"


def _row(label: str, value: str) -> str:
    if ": " in label:  # "part: assumption" -> the value beside the part, the assumption after it
        part, why = label.split(": ", 1)
        return f"  {part:<60} {value:>11}  ({why})"
    return f"  {label:<60} {value:>11}"


@dataclass(frozen=True)
class Cluster:
    """What ``plan`` is told about the hardware; every field is printed."""
    gpu_memory_gib: float = 80.0
    bandwidth_gbytes_s: float = 50.0
    prompt_tokens: int = 1024
    mean_response_tokens: int | None = None
    """None: half of ``rollout.max_response_tokens``."""
    gpu: str = "h100-80g"
    profile: Profile | None = None
    host_memory_gib: float = DEFAULT_HOST_MEMORY_GIB
    """Memory of a learner host: what its ranks' offloaded state (``learner.cpu_offload``) must fit."""
    host_memory_source: str = "a DGX's 2 TiB, the default"

    def mean_response(self, cfg) -> int:
        return self.mean_response_tokens or max(1, cfg.rollout.max_response_tokens // 2)


@dataclass
class Estimate:
    """One placement's memory, fit and step time."""
    learner: dict[str, int]
    setup: LearnerSetup
    engine: dict[str, float]
    sync: dict[str, float]
    time: dict[str, float]
    profile: Profile
    fits_learner: bool
    fits_engine: bool
    host: int = 0
    """Bytes of host memory per learner host: its ranks' offloaded state."""
    fits_host: bool = True

    @property
    def fits(self) -> bool:
        return self.fits_learner and self.fits_engine and self.fits_host

    def misfits(self, cl: Cluster) -> list[str]:
        """What does not fit, in words (empty: everything fits)."""
        return ([] if self.fits_learner else [f"a learner rank needs {_gib(self.learner['total'])} of a "
                                               f"{cl.gpu_memory_gib:g} GiB GPU"]) + (
            [] if self.fits_engine else ["an engine's KV cache holds no full-length sequence"]) + (
            [] if self.fits_host else [f"a learner host needs {_gib(self.host)} of host memory, more than its "
                                       f"{cl.host_memory_gib:,g} GiB ({cl.host_memory_source})"])


def estimate(cfg, shape: ModelShape, cl: Cluster, *, engines: int, budget: int | None = None,
             ranks_per_host: int | None = None) -> Estimate:
    """Memory, fit and step time of ``cfg`` with ``engines`` engines (its own devices and TP size) and
    ``ranks_per_host`` learner ranks on a learner host (None: every rank on one)."""
    r, a = cfg.rollout, cfg.algo
    tp, dt = r.tensor_parallel_size, DTYPE_BYTES[cfg.model.dtype]
    gpu_bytes = int(cl.gpu_memory_gib * GiB)
    s = LearnerSetup.from_config(cfg, ranks=cfg.async_.learner_devices, prompt_tokens=cl.prompt_tokens,
                                 budget=budget)
    lm = learner_memory(shape, s)
    em = engine_memory(shape, tp, gpu_bytes=gpu_bytes, utilization=r.gpu_memory_utilization, dtype_bytes=dt,
                       seq_tokens=s.seq_tokens)
    ws = weight_sync(shape, engines, dtype_bytes=dt, bandwidth_bytes_s=cl.bandwidth_gbytes_s * 1e9,
                     adapter_params=(shape.lora_params(s.lora_rank, s.lora_targets)
                                     if cfg.model.lora.adapter_versions else 0))
    mean_resp = cl.mean_response(cfg)
    profile = cl.profile or published_profile(
        shape, GPUS[cl.gpu], tp=tp, dtype_bytes=dt, utilization=r.gpu_memory_utilization,
        context_tokens=cl.prompt_tokens // 2 + mean_resp, max_num_seqs=r.max_num_seqs, models=s.models,
        checkpointing=s.activation_checkpointing, epochs=a.ppo_epochs)
    n = a.prompts_per_step * a.group_size
    t = step_seconds(generated_tokens=n * mean_resp, learned_tokens=n * (cl.prompt_tokens // 2 + mean_resp),
                     generation_tokens_s=profile.generation(tp) * tp * engines,
                     learner_tokens_s=profile.learner_tokens_s_per_gpu * s.ranks,
                     max_staleness=StalenessPolicy.from_config(cfg).max_staleness, sync_s=ws["seconds_all"])
    host = (ranks_per_host or s.ranks) * lm["host"]
    return Estimate(lm, s, em, ws, t, profile, lm["total"] <= gpu_bytes, em["sequences"] >= 1, host,
                    host <= cl.host_memory_gib * GiB)


def report(cfg, placement, shape: ModelShape, source: str, cl: Cluster, *, hosts_line: str) -> tuple[str, bool]:
    """The text ``async-vapo plan`` prints (placement, memory, sync, step time, every assumption) and whether the
    learner and the engines fit their GPUs."""
    r, a, tp = cfg.rollout, cfg.algo, cfg.rollout.tensor_parallel_size
    per_host = len(placement.learners[0].ranks) if placement.learners else cfg.async_.learner_devices
    est = estimate(cfg, shape, cl, engines=len(placement.engines), ranks_per_host=per_host)
    lm, s, em, ws, t = est.learner, est.setup, est.engine, est.sync, est.time
    bound = StalenessPolicy.from_config(cfg).max_staleness
    gib = cl.gpu_memory_gib
    fits = "fits" if est.fits_learner else f"DOES NOT FIT {gib:g} GiB"
    n = a.prompts_per_step * a.group_size
    labels = dict(learner_assumptions(shape, s))
    lines = [
        f"model: {shape.params() / 1e9:.2f} B parameters ({shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_kv_heads} KV heads, vocab {shape.vocab_size:,}); shape from {source}",
        f"cluster: {hosts_line}; GPUs of {gib:g} GiB; hosts of {cl.host_memory_gib:,g} GiB "
        f"({cl.host_memory_source}); async.rollout_devices : learner_devices = "
        f"{cfg.async_.rollout_devices} : {cfg.async_.learner_devices}, tensor_parallel_size {tp} -> "
        f"{len(placement.engines)} engine(s)",
        "",
        placement.describe(),
        "",
        f"learner, per rank ({s.ranks} rank(s), {'FSDP2' if s.sharded else 'unsharded'}, {cfg.model.dtype} compute, "
        f"{'policy + critic' if s.models == 2 else 'policy'}; algo.max_tokens_per_micro_batch "
        f"{a.max_tokens_per_micro_batch}, micro_batch_size {a.micro_batch_size}; rows of {cl.prompt_tokens:,} "
        f"prompt + {r.max_response_tokens:,} response tokens):",
        _row(f"state: {labels['state']}", _gib(state_bytes(shape, s)) if s.cpu_offload else _gib(lm["state"])),
        _row(f"gathered: {labels['gathered']}", _gib(lm["gathered"])),
        _row(f"activations: {labels['activations']}", _gib(lm["activations"])),
        _row(f"logits: {labels['logits']}", _gib(lm["logits"])),
        _row("total on the GPU", f"{_gib(lm['total'])}  ({fits})"),
    ]
    if s.cpu_offload:
        host_fits = "fits" if est.fits_host else f"DOES NOT FIT {cl.host_memory_gib:,g} GiB"
        lines.append(_row(f"host memory per learner host ({per_host} rank(s) x offloaded state)",
                          f"{_gib(est.host)}  ({host_fits})"))
    lines += [
        "",
        f"engine, per GPU (tensor parallel {tp}, {cfg.model.dtype}, gpu_memory_utilization "
        f"{r.gpu_memory_utilization:g}):",
        _row("weights", _gib(em["weights"])),
        _row("KV space (utilization x memory - weights; an upper bound)", _gib(em["kv_space"])),
        _row(f"KV cache of one {s.seq_tokens:,}-token sequence", _gib(em["kv_per_sequence"])),
        _row("full-length sequences at once per engine",
             f"{em['sequences']:,}  (a group is {a.group_size}; max_num_seqs {r.max_num_seqs})"
             + ("" if est.fits_engine else "  (DOES NOT FIT one sequence)")),
        "",
        f"weight sync ({cfg.model.dtype}, at {cl.bandwidth_gbytes_s:g} GB/s, one engine after another; vLLM's reload "
        "not included):",
        _row("bytes per engine", f"{ws['bytes_per_engine'] / 1e9:,.1f} GB"),
        _row(f"bytes to all {len(placement.engines)} engine(s)", f"{ws['bytes_total'] / 1e9:,.1f} GB"),
        _row("time per engine", f"{ws['seconds_per_engine']:.2f} s"),
        _row("time to all engines", f"{ws['seconds_all']:.2f} s"),
        "",
        f"step time ({n:,} responses of {cl.mean_response(cfg):,} tokens on average, prompts of "
        f"{cl.prompt_tokens // 2:,}; rates from {est.profile.source}):",
        _row("generation tokens/s per GPU", f"{est.profile.generation(tp):,.0f}"),
        _row("learner tokens/s per rank", f"{est.profile.learner_tokens_s_per_gpu:,.0f}"),
        _row("generate", f"{t['generate_s']:,.0f} s"),
        _row("learn", f"{t['learn_s']:,.0f} s"),
        _row(f"step, async.max_staleness {bound}: "
             + ("generate + learn + sync" if bound == 0 else "max(generate, learn) + sync"),
             f"{t['step_s']:,.0f} s"),
    ]
    if not est.fits:
        lines += ["", "DOES NOT FIT: " + "; ".join(est.misfits(cl)) + " (plan --search lists the placements that "
                  "fit, or says what would make one fit)"]
    return "\n".join(lines), est.fits


@dataclass(frozen=True)
class Candidate:
    learner_hosts: int
    ranks_per_host: int
    rollout_devices: int
    tp: int
    budget: int
    estimate: Estimate
    idle_gpus: int

    @property
    def learner_devices(self) -> int:
        return self.learner_hosts * self.ranks_per_host

    def overrides(self) -> list[str]:
        return [f"async.rollout_devices={self.rollout_devices}", f"async.learner_devices={self.learner_devices}",
                f"rollout.tensor_parallel_size={self.tp}", f"algo.max_tokens_per_micro_batch={self.budget}"]


def search_hostfile(hosts: int, learner_hosts: int) -> list[tuple[str, str]]:
    """The hostfile the search places on: learner agents on the first ``learner_hosts`` hosts, replay and verifier
    on the first, engines on every host (after the learner's GPUs)."""
    names = [f"host{i}" for i in range(hosts)]
    return ([(h, "learner") for h in names[:learner_hosts]] + [(names[0], "replay"), (names[0], "verifier")]
            + [(h, "rollout") for h in names])


def _powers(limit: int) -> list[int]:
    out, k = [], 1
    while k <= limit:
        out.append(k)
        k *= 2
    return sorted({*out, limit})


def search(cfg, shape: ModelShape, cl: Cluster, *, hosts: int, gpus_per_host: int,
           budgets: list[int] | None = None) -> tuple[list[Candidate], int]:
    """Every placement of ``hosts x gpus_per_host`` over learner hosts, ranks per host, tensor-parallel sizes and
    token budgets whose learner and engines fit, fastest first (the step time does not depend on the budget; among
    equal times: fewer idle GPUs, then the most memory left on a learner GPU for what the plan does not count, then
    the config's own budget), and how many were tried. Engines take every GPU the learner leaves."""
    from async_vapo.deploy.placement import PlacementError, place

    seq = cl.prompt_tokens + cfg.rollout.max_response_tokens
    budgets = budgets or sorted({cfg.algo.max_tokens_per_micro_batch or seq, *(seq * k for k in (1, 2, 4))})
    out, tried = [], 0
    for k in range(1, hosts + 1):
        for per in _powers(gpus_per_host):
            for tp in _powers(gpus_per_host):
                free = [gpus_per_host - (per if i < k else 0) for i in range(hosts)]
                rollout = tp * sum(f // tp for f in free)
                if rollout == 0:
                    continue
                try:
                    p = place(rollout, k * per, tensor_parallel_size=tp, gpus_per_host=gpus_per_host,
                              hostfile=search_hostfile(hosts, k))
                except PlacementError:
                    continue
                for b in budgets:
                    tried += 1
                    c = cfg.model_copy(deep=True)
                    c.async_.rollout_devices, c.async_.learner_devices = rollout, k * per
                    c.rollout.tensor_parallel_size, c.algo.max_tokens_per_micro_batch = tp, b
                    e = estimate(c, shape, cl, engines=len(p.engines), ranks_per_host=per)
                    if e.fits:
                        out.append(Candidate(k, per, rollout, tp, b, e, sum(len(g) for g in p.idle.values())))
    own = cfg.algo.max_tokens_per_micro_batch
    out.sort(key=lambda c: (round(c.estimate.time["step_s"], 6), c.idle_gpus, c.estimate.learner["total"],
                            c.budget != own, c.budget))
    return out, tried


def _changed(cfg, **settings):
    """``cfg`` with ``section__field=value`` settings; None when the config refuses them."""
    c = cfg.model_copy(deep=True)
    try:
        for key, value in settings.items():
            section, name = key.split("__")
            setattr(getattr(c, section), name, value)
        return c.model_validate(c.model_dump(by_alias=True))
    except ValueError:
        return None


def nothing_fits(cfg, shape: ModelShape, cl: Cluster, *, hosts: int, gpus_per_host: int) -> list[str]:
    """Why no placement fits (the best tried) and each single change that would make one fit, with the fastest step
    it allows: settings the config does not already have, more hosts, larger GPUs, larger host memory."""
    from dataclasses import replace

    lc, r = cfg.learner, cfg.rollout
    trials: list[tuple[str, object, Cluster, int]] = []
    if not lc.cpu_offload:
        trials.append(("learner.cpu_offload=true", _changed(cfg, learner__cpu_offload=True), cl, hosts))
    if not lc.activation_checkpointing:
        trials.append(("learner.activation_checkpointing=true",
                       _changed(cfg, learner__activation_checkpointing=True), cl, hosts))
    if not lc.logprob_chunk_tokens:
        trials.append(("learner.logprob_chunk_tokens=4096", _changed(cfg, learner__logprob_chunk_tokens=4096), cl,
                       hosts))
    for f in (2, 4):
        n = r.max_response_tokens // f
        trials.append((f"rollout.max_response_tokens={n}", _changed(cfg, rollout__max_response_tokens=n), cl, hosts))
    trials.append((f"--hosts {hosts * 2}", cfg, cl, hosts * 2))
    if cl.gpu_memory_gib < GPUS["h200"].memory_gib:
        trials.append((f"GPUs of {GPUS['h200'].memory_gib:g} GiB (--gpu h200)", cfg,
                       replace(cl, gpu_memory_gib=GPUS["h200"].memory_gib), hosts))
    unbounded = replace(cl, host_memory_gib=float("inf"))
    out = []
    for label, c, cluster, n_hosts in trials:
        found = search(c, shape, cluster, hosts=n_hosts, gpus_per_host=gpus_per_host)[0] if c is not None else []
        if found:
            out.append(f"  {label}: {len(found)} placement(s) fit, the fastest at "
                       f"{found[0].estimate.time['step_s']:,.0f} s per step")
    host_only = search(cfg, shape, unbounded, hosts=hosts, gpus_per_host=gpus_per_host)[0]
    if host_only:
        need = min(c.estimate.host for c in host_only)
        out.append(f"  hosts of at least {-(-need // GiB):,} GiB of memory (--host-memory-gib): "
                   f"{len(host_only)} placement(s) fit, the fastest at "
                   f"{host_only[0].estimate.time['step_s']:,.0f} s per step")
    head = f"NOTHING FITS on {hosts} host(s) x {gpus_per_host} GPU(s) of {cl.gpu_memory_gib:g} GiB"
    if not out:
        return [head + ": no single change tried makes a placement fit (" + ", ".join(t[0] for t in trials)
                + "); combine them, or a smaller model"]
    return [head + "; each of these alone would make one fit:", *out]


def search_report(cfg, shape: ModelShape, source: str, cl: Cluster, *, hosts: int, gpus_per_host: int,
                  top: int = 10) -> tuple[str, bool]:
    """The text of ``plan --search``: the fitting placements, fastest first, and the best one's overrides."""
    found, tried = search(cfg, shape, cl, hosts=hosts, gpus_per_host=gpus_per_host)
    a = cfg.algo
    head = [f"model: {shape.params() / 1e9:.2f} B parameters; shape from {source}",
            f"cluster: {hosts} host(s) x {gpus_per_host} GPU(s) of {cl.gpu_memory_gib:g} GiB, hosts of "
            f"{cl.host_memory_gib:,g} GiB memory ({cl.host_memory_source}); "
            f"{a.prompts_per_step * a.group_size:,} responses per update of {cl.mean_response(cfg):,} tokens on "
            f"average (longest {cfg.rollout.max_response_tokens:,}), prompts up to {cl.prompt_tokens:,}; "
            f"async.max_staleness {StalenessPolicy.from_config(cfg).max_staleness}",
            f"rates: {(cl.profile.source if cl.profile else 'published figures of ' + cl.gpu)}; learner settings "
            f"from the config (activation_checkpointing {cfg.learner.activation_checkpointing}, logprob_chunk_tokens "
            f"{cfg.learner.logprob_chunk_tokens}, cpu_offload {cfg.learner.cpu_offload})",
            (f"{len(found)} of {tried} placements fit (learner hosts x ranks per host, tensor parallel size, token "
             "budget; engines on every GPU the learner leaves)" if tried else "no placement to try"), ""]
    if not tried:
        return "\n".join([*head, f"NOTHING TO TRY: {hosts} host(s) x {gpus_per_host} GPU(s) cannot hold a learner "
                                  "rank and an engine on GPUs of their own (engines and learner do not share GPUs; "
                                  "an engine's GPUs are on one host): give more GPUs"]), False
    if not found:
        return "\n".join([*head, *nothing_fits(cfg, shape, cl, hosts=hosts, gpus_per_host=gpus_per_host)]), False
    rows = [f"{'#':>3} {'learner':>9} {'rollout':>7} {'TP':>3} {'engines':>7} {'budget':>7} {'learner GiB':>11} "
            f"{'seqs/engine':>11} {'generate s':>10} {'learn s':>8} {'sync s':>7} {'step s':>8} {'idle':>4}"]
    for i, c in enumerate(found[:top], 1):
        e = c.estimate
        rows.append(f"{i:>3} {f'{c.learner_hosts}x{c.ranks_per_host}':>9} {c.rollout_devices:>7} {c.tp:>3} "
                    f"{c.rollout_devices // c.tp:>7} {c.budget:>7} {e.learner['total'] / GiB:>11.1f} "
                    f"{int(e.engine['sequences']):>11} {e.time['generate_s']:>10.0f} {e.time['learn_s']:>8.0f} "
                    f"{e.time['sync_s']:>7.1f} {e.time['step_s']:>8.0f} {c.idle_gpus:>4}")
    best = found[0]
    hostfile = search_hostfile(hosts, best.learner_hosts)
    tail = ["", f"best: {' '.join(best.overrides())}",
            "hostfile (host role; name your hosts for host0, host1, ...):",
            *(f"  {h} {r}" for h, r in hostfile)]
    return "\n".join([*head, *rows, *tail]), True
