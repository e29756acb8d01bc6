"""The rollout engine: the real vLLM engine behind a small interface.

``VLLMEngine`` generates G samples per prompt with the sampled tokens' log-probabilities, loads new
weights in place (no restart) and reports the weight version it serves. Prompts go in as token ids and
responses come back as token ids (``skip_tokenizer_init``): tokenisation stays on our side, so the
same code serves a character tokenizer and Qwen2.5's BPE.

Log-probs are those of the distribution each token was sampled from: the engine is created with
``logprobs_mode="processed_logprobs"``, so vLLM reports log softmax of the logits after temperature (and after
top-p, renormalised over the nucleus, when a request sets one) rather than its default raw, untempered ones.
The learner's are of softmax(logits / ``rollout.temperature``); training requests have top_p = 1. A greedy request
(temperature 0, evaluation) reports the untempered log-probs. On CUDA this mode keeps vLLM on its PyTorch sampler
(FlashInfer's returns no log-probs), which training requests (no top-p, no top-k) use anyway.

Weights reach the engine's workers (``worker_ext.py``) in one of these ways, all ending in vLLM's own
``reload_weights``:

* ``load_weights(state, version)`` (the one-process trainer): the state dict is copied, one memcpy
  per tensor, into a flat buffer in shared memory (/dev/shm) that the workers mapped on the first
  push; the RPC carries only names, dtypes, shapes and offsets. The buffer is kept between
  pushes (it holds one copy of the weights in host memory until ``close`` or
  ``release_weight_buffer``), so a push faults in no pages.
* ``load_weights_from_shared(path, nbytes, layout, version)`` (the cluster, an engine on the learner's
  host): a flat buffer the learner wrote in its own shared-memory slot (``async_vapo.weights``),
  mapped by the workers.
* ``receive_buffer(nbytes)`` then ``load_received(layout, version)`` (the cluster, an engine on another
  host): the caller fills the engine's own shared buffer (fetched over ZeroMQ) and it is loaded as above.
* ``load_weights_from_file(path, version)``: a safetensors file (``cluster.weights.transfer = "file"``).
* ``load_adapter(path, version)``: a LoRA version (``model.lora``) as its PEFT adapter directory, loaded by vLLM's
  LoRA support (``EngineSpec.max_lora_rank`` > 0: ``enable_lora``; on the CPU, vLLM's ``PunicaWrapperCPU`` and no
  compilation). The base weights stay; each request gets the newest adapter when it is submitted and keeps it.
* ``join_weight_group(init_info)`` then ``receive_weights_dist(update_info, version)`` per version: streamed by the
  learner over a torch.distributed group through vLLM's own weight-transfer API (``async_vapo.weights.collective``;
  ``cluster.weights.transfer = "dist"``, or "auto" on another host), loaded by vLLM's layerwise reload rather than
  ``reload_weights``. The engine is created with one backend, ``weight_backend``: NCCL (vLLM's engine) when its
  workers are on CUDA, gloo (ours) on the CPU, or as ``EngineSpec.dist_backend`` says.

These methods, ``version``, ``weight_backend``, ``invalidate`` and ``apply_weights`` are
``async_vapo.weights.engine.WeightEngine``, the interface the cluster's weight client drives; this engine and the
continuous one (``continuous.py``) implement it, and only they change their ``version``.

``benchmarks/weight_sync.py`` measures them against a plain memcpy of the same bytes; vLLM's
``reload_weights`` (which rebuilds each layer and, on the CPU backend, repacks every linear weight
for oneDNN) is most of a push either way.

vLLM spawns its engine process: code that constructs an engine must run under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import torch

from async_vapo.models.lora import vllm_max_lora_rank
from async_vapo.weights.collective import VLLM_BACKENDS, engine_backend
from async_vapo.weights.layout import Layout, SharedWeightBuffer, shm_dir, tensor_nbytes, unshared_state

T = TypeVar("T")


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length"
    version_spans: list[tuple[int, int]] = field(default_factory=list)
    """``(version, index of the first token generated under it)``, one per version, in order, starting at index 0:
    the weights that sampled each token. A lock-step engine serves one version per call."""


@dataclass
class EngineSpec:
    model_path: str
    dtype: str = "float32"
    max_model_len: int = 256
    seed: int = 0
    kv_cache_gib: float = 1.0
    gpu_memory_utilization: float = 0.85
    enforce_eager: bool = True
    max_num_seqs: int = 256
    tensor_parallel_size: int = 1
    weights_timeout_s: float = 600.0
    """Limit of one weight load in the workers; past it the load raises TimeoutError instead of hanging."""
    idle_spin_s: float | None = 0.002
    """``rollout.idle_spin_s``: vLLM's queue readers' busy-poll after their last message (None: vLLM's 1 s)."""
    dist_backend: str = "auto"
    """``cluster.weights.dist_backend``: the weight-transfer engine the workers get (``weights.dist.engine_backend``:
    "auto" is NCCL on CUDA, gloo on the CPU)."""
    max_lora_rank: int = 0
    """vLLM's ``max_lora_rank`` (1, 8, 16, 32, ...): > 0 starts the engine with LoRA, serving versions as adapters
    (``load_adapter``); 0 = no LoRA."""
    max_loras: int = 4
    """Adapters vLLM holds at once (its ``max_loras`` and ``max_cpu_loras``): the newest plus those of requests still
    running (continuous generation); requests of more adapters than this wait for a slot."""

    @classmethod
    def from_config(cls, cfg, model_path, *, longest_prompt: int, instance: int = 0) -> EngineSpec:
        """The engine of ``cfg.rollout`` serving ``model_path``; replica ``instance`` samples from its own seed.
        ``max_model_len`` fits the longest prompt and a full response (and ``rollout.env_first_turn_prefix``, which
        ends every prompt of a multi-turn rollout: at most one token per byte, and one more)."""
        r = cfg.rollout
        prefix = len(r.env_first_turn_prefix.encode()) + 1 if r.env_first_turn_prefix else 0
        return cls(model_path=str(model_path), dtype=cfg.model.dtype, seed=r.seed + instance,
                   kv_cache_gib=r.kv_cache_gib, max_model_len=longest_prompt + prefix + r.max_response_tokens + 1,
                   gpu_memory_utilization=r.gpu_memory_utilization, enforce_eager=r.enforce_eager,
                   max_num_seqs=r.max_num_seqs, tensor_parallel_size=r.tensor_parallel_size,
                   dist_backend=cfg.cluster.weights.dist_backend, idle_spin_s=r.idle_spin_s,
                   max_lora_rank=vllm_max_lora_rank(cfg.model.lora.rank) if cfg.model.lora.adapter_versions else 0)


def engine_cpu_env(cpus: Sequence[int]) -> dict[str, str]:
    """Environment that binds a CPU engine's OpenMP threads to ``cpus``, all of them, with none reserved.

    vLLM's automatic binding keeps one core per worker free for its scheduler process; on this 2-core machine that
    leaves the worker one thread. The one-process trainer alternates generation and learning, so while the engine
    generates nothing else needs a core (the scheduler mostly waits), and the worker may take every one."""
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cpus), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def prepare_engine_env(spec: EngineSpec) -> bool:
    """Set the environment the engine's processes inherit (KV cache size on the CPU, our plugin's idle spin);
    returns whether the engine runs on the CPU."""
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(spec.kv_cache_gib))))
    from async_vapo.rollout.vllm_plugin import IDLE_SPIN_ENV

    if spec.idle_spin_s is not None:  # read by our vLLM plugin in the engine's processes, which inherit it
        os.environ[IDLE_SPIN_ENV] = repr(spec.idle_spin_s)
    else:
        os.environ.pop(IDLE_SPIN_ENV, None)
    return on_cpu


def engine_kwargs(spec: EngineSpec, weight_backend: str, *, on_cpu: bool) -> dict:
    """The engine arguments of ``spec``, the same for ``vllm.LLM`` and ``AsyncEngineArgs``."""
    return dict(
        model=spec.model_path,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        seed=spec.seed,
        enforce_eager=spec.enforce_eager,
        skip_tokenizer_init=True,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        max_num_seqs=spec.max_num_seqs,
        tensor_parallel_size=spec.tensor_parallel_size,
        logprobs_mode="processed_logprobs",  # of the tempered distribution sampled from (module docstring)
        worker_extension_cls="async_vapo.rollout.worker_ext.WeightSyncExtension",
        # async_vapo.weights.collective's engines, registered by worker_ext
        weight_transfer_config={"backend": VLLM_BACKENDS[weight_backend]},
        # With chunked prefill, vLLM rewinds the generator of a seeded request whose prefill was split
        # (gpu_model_runner: gen.set_offset), which a CPU generator cannot do ("CPU Generator does not use
        # offset"). It killed the engine evaluating the long task's held-out split (138 prompts x 2 seeded
        # samples) and on chat-template prompts of the real model in batches of a few dozen; the same runs
        # with this flag completed. On the CPU every prompt is prefilled whole.
        **({"enable_chunked_prefill": False} if on_cpu else {}),
        **({"enable_lora": True, "max_lora_rank": spec.max_lora_rank, "max_loras": spec.max_loras,
            "max_cpu_loras": spec.max_loras} if spec.max_lora_rank else {}),
    )


def sampling_params(*, n: int, temperature: float, top_p: float, max_tokens: int, stop_token_ids: Sequence[int],
                    seed: int | None, **extra):
    """vLLM's sampling parameters of one prompt's ``n`` samples, with the sampled tokens' log-probs (each child
    request of ``n`` gets ``seed + index`` when a seed is given)."""
    from vllm import SamplingParams

    return SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                          stop_token_ids=list(stop_token_ids), detokenize=False, seed=seed, **extra)


def to_sample(o, **extra) -> Sample:
    """A vLLM ``CompletionOutput`` as a :class:`Sample`."""
    ids = list(o.token_ids)
    lps = [lp[t].logprob for t, lp in zip(ids, o.logprobs or [], strict=False)]
    return Sample(token_ids=ids, logprobs=lps, finish_reason=o.finish_reason or "length", **extra)


class EngineWeights:
    """The weight side shared by the engines, ``weights.engine.WeightEngine`` but for ``apply_weights`` (module
    docstring): each load method ends in one collective RPC into the workers (``worker_ext``) through
    ``_collective_rpc`` and then sets the version it loaded. ``version`` is read-only outside: it changes by
    :meth:`_set_version` alone (a load, :meth:`invalidate`). The concrete engine sets ``spec``, ``_version``,
    ``weight_backend``, ``last_load_seconds``, ``last_load_stages`` and ``_shared``, and implements
    ``_collective_rpc`` and ``apply_weights``."""

    spec: EngineSpec
    _version: int
    weight_backend: str
    """"gloo" or "nccl": the torch.distributed groups this engine can join (``async_vapo.weights.collective``)."""
    last_load_seconds: float | None
    last_load_stages: dict[str, float]
    _shared: SharedWeightBuffer

    def _collective_rpc(self, method: str, *, timeout: float, args: tuple = (), kwargs: dict | None = None) -> list:
        raise NotImplementedError

    def _lora_call(self, method: str, arg):
        """vLLM's ``add_lora(request)`` / ``remove_lora(int_id)`` on the engine (the concrete engine's way)."""
        raise NotImplementedError

    def _adapters_in_use(self) -> set[int]:
        """The adapter ids of requests still running (none between two lock-step calls)."""
        return set()

    def _before_whole_load(self) -> None:
        """Called before every worker call that changes whole weights (not an adapter load): an engine that did not
        quiesce for an adapter update does it here."""

    def _lora_state(self) -> None:
        self._lora = None  # the LoRARequest new requests get; None: the base weights
        self._adapters: dict[int, int] = {}  # adapter id loaded in vLLM -> its version
        self._lora_ids = itertools.count(1)  # unique per engine: vLLM caches an adapter by its id

    @property
    def version(self) -> int:
        """The version served; -1: no whole version is loaded (``weights.engine``)."""
        return self._version

    def _set_version(self, version: int) -> None:
        """The one place the served version changes (an engine that labels its output extends it)."""
        self._version = version

    def invalidate(self) -> None:
        """Serve nothing until a whole version is loaded: the version becomes -1 (``WeightEngine.invalidate``)."""
        self._set_version(-1)

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int, *,
                     via: Literal["shared", "safetensors"] = "shared") -> float:
        """Load a full state dict (HF names) into the running engine; returns seconds taken.

        ``via="shared"`` (default, the faster path measured): the shared-memory buffer. ``"safetensors"``:
        a safetensors file in /dev/shm, as the cluster's learner writes (kept for comparison).
        """
        t0 = time.perf_counter()
        if via == "shared":
            path, nbytes, layout = self._shared.write(state)
            t1 = time.perf_counter()
            self._rpc("async_vapo_load_shared", path, nbytes, layout)
            self._shared.mapped()
        elif via == "safetensors":
            from safetensors.torch import save_file

            fd, path = tempfile.mkstemp(prefix="async-vapo-weights-", suffix=".safetensors", dir=shm_dir())
            os.close(fd)
            try:
                save_file(unshared_state(state), path)
                t1 = time.perf_counter()
                self._rpc("async_vapo_load_weights", path)
            finally:
                Path(path).unlink(missing_ok=True)
        else:
            raise ValueError(f"via must be 'shared' or 'safetensors', got {via!r}")
        self.last_load_stages["write_s"] = t1 - t0
        self._set_version(version)
        self.last_load_seconds = time.perf_counter() - t0
        return self.last_load_seconds

    def load_weights_from_file(self, path: str, version: int) -> None:
        """Load a safetensors file (HF names) into the running engine."""
        self._rpc("async_vapo_load_weights", path)
        self.last_load_stages["write_s"] = 0.0
        self._set_version(version)

    def load_weights_from_shared(self, path: str, nbytes: int, layout: Layout, version: int) -> None:
        """Load a flat buffer that another process wrote in a shared-memory file (the cluster's learner):
        ``layout`` offsets and ``nbytes`` count from the start of the file. The workers keep their mapping
        of the file between loads."""
        self._rpc("async_vapo_load_shared", path, nbytes, layout)
        self.last_load_stages["write_s"] = 0.0
        self._set_version(version)

    def load_adapter(self, path: str, version: int) -> None:
        """Load version ``version``'s LoRA adapter from the PEFT directory ``path`` and give it to every request
        submitted from now on; retire the adapters no running request uses (``WeightEngine.load_adapter``)."""
        from vllm.lora.request import LoRARequest

        if not self.spec.max_lora_rank:
            raise ValueError("this engine was started without LoRA (EngineSpec.max_lora_rank = 0): it cannot load an "
                             "adapter")
        t0 = time.perf_counter()
        request = LoRARequest(lora_name=f"v{version}", lora_int_id=next(self._lora_ids), lora_path=str(path))
        try:
            if not self._lora_call("add_lora", request):
                raise RuntimeError(f"vLLM did not load the adapter of version {version} from {path}")
        except BaseException:
            self.invalidate()
            raise
        self._adapters[request.lora_int_id] = version
        self._lora = request
        self._set_version(version)
        self._retire_adapters()
        self.last_load_seconds = time.perf_counter() - t0
        self.last_load_stages = {"adapter_s": self.last_load_seconds}

    def _retire_adapters(self) -> None:
        keep = self._adapters_in_use() | ({self._lora.lora_int_id} if self._lora is not None else set())
        for i in [i for i in self._adapters if i not in keep]:
            self._lora_call("remove_lora", i)
            del self._adapters[i]

    def adapter_version(self, lora_request) -> int | None:
        """The version of an adapter this engine loaded (None: the base weights)."""
        return None if lora_request is None else self._adapters.get(lora_request.lora_int_id)

    def join_weight_group(self, init_info: dict) -> None:
        """Join the learner's torch.distributed group for this engine (``async_vapo.weights.collective``); blocks
        until the learner is in it too, at most ``init_info["timeout_s"]``. A new group replaces the previous one.

        The same worker call as vLLM's ``LLM.init_weight_transfer_engine``, with a deadline of its own: a worker that
        dies or hangs in the rendezvous raises here (``TimeoutError``) instead of holding the rollout loop forever."""
        deadline = float(init_info.get("timeout_s", 0.0)) + self.spec.weights_timeout_s
        self._collective_rpc("init_weight_transfer_engine", timeout=deadline, kwargs={"init_info": init_info})

    def receive_weights_dist(self, update_info: dict, version: int) -> None:
        """Receive one version over the group through vLLM's weight-transfer API while the learner sends it. A
        failure part-way leaves a mix of two versions loaded (the version is -1): load a whole version another way
        before serving."""
        t0 = time.perf_counter()
        # start_weight_update, update_weights and finish_weight_update in each worker, in one RPC (worker_ext)
        results = self._loading_rpc("async_vapo_receive_dist", args=(update_info,))
        self._set_version(version)
        self.last_load_seconds = time.perf_counter() - t0
        stats = max(results, key=lambda s: s.get("recv_s", 0.0))
        self.last_load_stages = {"recv_s": stats.get("recv_s", 0.0),
                                 "reload_s": sum(stats.get(k, 0.0) for k in ("start_s", "load_s", "finish_s"))}
        self.last_load_stages["rpc_s"] = self.last_load_seconds - sum(self.last_load_stages.values())

    def receive_buffer(self, nbytes: int) -> memoryview:
        """This engine's own shared buffer, grown to ``nbytes``, to be filled by the caller (the bytes of a
        flat layout whose offsets start at 0) and then loaded with :meth:`load_received`."""
        return memoryview(self._shared.reserve(nbytes))[:nbytes]

    def load_received(self, layout: Layout, version: int) -> None:
        """Load what the caller wrote into :meth:`receive_buffer`."""
        assert self._shared.path is not None, "receive_buffer first"
        end = max(off + tensor_nbytes(dtype, shape) for _, dtype, shape, off in layout)
        self._rpc("async_vapo_load_shared", self._shared.path, end, layout)
        self._shared.mapped()
        self.last_load_stages["write_s"] = 0.0
        self._set_version(version)

    def release_weight_buffer(self) -> None:
        """Free this process's shared weight buffer (the next ``load_weights`` makes a new one)."""
        self._shared.close()

    def _loading_rpc(self, method: str, args: tuple) -> list:
        """A worker call that changes the weights. One that raises may have changed some of them (a worker failed
        part-way, or some workers did and others not): the engine is invalidated before the error propagates."""
        try:
            self._before_whole_load()
            results = self._collective_rpc(method, timeout=self.spec.weights_timeout_s, args=args)
        except BaseException:
            self.invalidate()
            raise
        self._lora = None  # whole weights loaded (a LoRA engine too): they are the version, with no adapter over them
        return results

    def _rpc(self, method: str, *args) -> None:
        t0 = time.perf_counter()
        results = self._loading_rpc(method, args)
        wall = time.perf_counter() - t0
        slowest = max(results, key=lambda r: r["read_s"] + r["reload_s"])
        self.last_load_stages = {"read_s": slowest["read_s"], "reload_s": slowest["reload_s"],
                                 "rpc_s": wall - slowest["read_s"] - slowest["reload_s"]}


class VLLMEngine(EngineWeights):
    """The lock-step engine: one ``generate`` call at a time; a ``weights.engine.WeightEngine``."""

    def __init__(self, spec: EngineSpec, version: int = 0):
        on_cpu = prepare_engine_env(spec)
        from vllm import LLM

        t0 = time.perf_counter()
        self.spec = spec
        self.weight_backend = engine_backend(spec.dist_backend, cuda=not on_cpu)
        self.llm = LLM(**engine_kwargs(spec, self.weight_backend, on_cpu=on_cpu))
        self.start_seconds = time.perf_counter() - t0
        self._version = version
        self.last_load_seconds: float | None = None
        self.last_load_stages: dict[str, float] = {}
        """Seconds of the last load by stage: ``write_s`` (serialise / copy into shared memory, this
        process), ``read_s`` and ``reload_s`` (in the slowest worker: tensors out of the file, vLLM's
        ``reload_weights``), ``rpc_s`` (the rest of the RPC's wall time)."""
        self._shared = SharedWeightBuffer()
        self._lora_state()

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, stop_token_ids: Sequence[int], seed: int | None = None) -> list[list[Sample]]:
        """``n`` samples for each prompt (token ids), in prompt order, each token with its log-probability under
        the distribution it was drawn from (see the module docstring)."""
        from vllm.inputs import TokensPrompt

        # A seed makes each prompt's samples reproducible; prompt i gets seed + i, so that prompts do not share
        # one random stream (one shared seed would correlate every prompt's sampling errors).
        params = [sampling_params(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                  stop_token_ids=stop_token_ids, seed=None if seed is None else seed + i)
                  for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False,
                                 lora_request=self._lora)
        return [[to_sample(o, version_spans=[(self.version, 0)]) for o in out.outputs] for out in outs]

    def _collective_rpc(self, method: str, *, timeout: float, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.llm.collective_rpc(method, timeout=timeout, args=args, kwargs=kwargs)

    def _lora_call(self, method: str, arg):
        return getattr(self.llm.llm_engine, method)(arg)

    def apply_weights(self, version: int, load: Callable[[], T]) -> T:
        """The one entry point of a new version from the cluster (``weights.client.EngineWeightClient``): ``load``
        moves version ``version`` in by one of the ways below and returns what the client reports. This engine
        generates in lock-step calls, and the rollout service calls the client between two of them, so nothing is
        in flight and ``load`` runs as is; an engine that generates continuously quiesces its requests around it."""
        return load()

    def close(self) -> None:
        shared = getattr(self, "_shared", None)
        if shared is not None:
            shared.close()
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
