"""The rollout engine: the real vLLM engine behind a small interface.

``VLLMEngine`` generates G samples per prompt with the sampled tokens' log-probabilities, loads new
weights in place (no restart) and reports the weight version it serves. Prompts go in as token ids and
responses come back as token ids (``skip_tokenizer_init``): tokenisation stays on our side, so the
same code serves a character tokenizer and Qwen2.5's BPE.

vLLM spawns its engine process: code that constructs an engine must run under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Sample:
    """One generated response."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS) or "length"


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


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _unshared(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copy aliased tensors (tied embeddings) so safetensors can store them. Both names are sent: the CPU
    backend keeps a separately packed lm_head even when the checkpoint ties it to the embeddings."""
    seen: set[int] = set()
    out = {}
    for k, v in state.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.detach().cpu().clone() if ptr in seen else v.detach().contiguous().cpu()
        seen.add(ptr)
    return out


class VLLMEngine:
    def __init__(self, spec: EngineSpec, version: int = 0):
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(spec.kv_cache_gib))))
        from vllm import LLM

        t0 = time.perf_counter()
        self.spec = spec
        self.llm = LLM(
            model=spec.model_path,
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            seed=spec.seed,
            enforce_eager=spec.enforce_eager,
            skip_tokenizer_init=True,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            max_num_seqs=spec.max_num_seqs,
            worker_extension_cls="async_vapo.rollout.worker_ext.WeightSyncExtension",
        )
        self.start_seconds = time.perf_counter() - t0
        self.version = version
        self.last_load_seconds: float | None = None

    def generate(self, prompts: Sequence[Sequence[int]], *, n: int, temperature: float, top_p: float,
                 max_tokens: int, stop_token_ids: Sequence[int], seed: int | None = None) -> list[list[Sample]]:
        """``n`` samples for each prompt (token ids), in prompt order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # A seed makes each prompt's samples reproducible; prompt i gets seed + i, so that prompts do not share
        # one random stream (one shared seed would correlate every prompt's sampling errors).
        params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, logprobs=0,
                                 stop_token_ids=list(stop_token_ids), detokenize=False,
                                 seed=None if seed is None else seed + i) for i in range(len(prompts))]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        result = []
        for out in outs:
            group = []
            for o in out.outputs:
                ids = list(o.token_ids)
                lps = [lp[t].logprob for t, lp in zip(ids, o.logprobs or [], strict=False)]
                group.append(Sample(token_ids=ids, logprobs=lps, finish_reason=o.finish_reason or "length"))
            result.append(group)
        return result

    def load_weights(self, state: Mapping[str, torch.Tensor], version: int) -> float:
        """Load a full state dict (HF names) into the running engine; returns seconds taken."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        fd, path = tempfile.mkstemp(prefix="async-vapo-weights-", suffix=".safetensors", dir=_shm_dir())
        os.close(fd)
        try:
            save_file(_unshared(state), path)
            self.load_weights_from_file(path, version)
        finally:
            Path(path).unlink(missing_ok=True)
        self.last_load_seconds = time.perf_counter() - t0
        return self.last_load_seconds

    def load_weights_from_file(self, path: str, version: int) -> None:
        self.llm.collective_rpc("async_vapo_load_weights", args=(path,))
        self.version = version

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            shutdown = getattr(engine, "shutdown", None)
            if callable(shutdown):
                shutdown()
            self.llm = None
