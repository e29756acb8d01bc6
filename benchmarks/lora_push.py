"""A LoRA version against full weights: bytes and seconds per push, and the engine's tokens/s with an adapter.

    .venv/bin/python benchmarks/lora_push.py                                   # the embedded tiny model
    .venv/bin/python benchmarks/lora_push.py --model models/smollm2-135m-instruct --tokens 16 --prompts 4
    .venv/bin/python benchmarks/lora_push.py --size 300m --pushes 3 --prompts 4 --n 2 --tokens 32

``--size`` (30m, 300m: benchmarks/weight_sync.py's random Qwen2-architecture models with the character tokenizer)
measures a model built in a temporary directory; its result file is named by the size (``random-300m-r16.json``).

One engine at a time (the machine is shared), each with one OpenMP thread:

1. an engine without LoRA (``enforce_eager`` as ``--eager`` says): ``--pushes`` full pushes of the merged weights
   through the one-process trainer's path (``load_weights``: the shared-memory buffer, then vLLM's
   ``reload_weights``), then tokens/s generating ``--prompts`` x ``--n`` sequences of ``--tokens`` tokens each
   (``ignore_eos``), three times;
2. an engine with LoRA (``max_lora_rank``; vLLM turns compilation off with LoRA on the CPU): ``--pushes`` adapter
   pushes through the cluster's adapter path (``AdapterPublisher.publish``: a PEFT directory on /dev/shm with its
   crc32, then ``receive.load_announced``: the check and vLLM's ``LoRARequest`` load), then the same generation
   under the adapter;
3. on each engine, ``--pushes`` versions as an engine on another host takes them (``cluster.weights.transfer =
   "zmq"``): the learner's publish (a shared-memory slot / the adapter's PEFT directory and blob), the engine's fetch
   over ZeroMQ on loopback (``fetch.WeightServer``, 16 MiB chunks) and its load (``receive.load_announced``).

The policy is the model with a rank ``--rank`` adapter on every linear layer of its decoder, B random (a trained
adapter's size and cost; its values do not matter here). Writes ``benchmarks/results/lora/<model>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def policy_states(model_path: str, rank: int):
    """(merged full state dict, adapter tensors, peft config) of the model with a random rank-``rank`` adapter."""
    import torch

    from async_vapo.models import lora
    from async_vapo.models.rl import load_policy

    config = lora.peft_config(rank, 2.0 * rank, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"))
    model = lora.add_lora(load_policy(model_path), config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    state = {k: v.detach() for k, v in model.state_dict().items()}
    return lora.merged_state(state, lora.scaling(config)), lora.adapter_tensors(state), config


def nbytes(state) -> int:
    return sum(v.numel() * v.element_size() for v in state.values())


def tokens_per_s(engine, *, prompts: int, n: int, tokens: int, lora_request=None, repeats: int = 3) -> list[float]:
    """Generated tokens per second of ``repeats`` timed generations (after a warm-up one)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, detokenize=False, seed=0,
                            logprobs=0)
    batch = [TokensPrompt(prompt_token_ids=[5 + i % 7, 6, 7, 8]) for i in range(prompts)]
    engine.llm.generate(batch[:1], params, use_tqdm=False, lora_request=lora_request)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        outs = engine.llm.generate(batch, params, use_tqdm=False, lora_request=lora_request)
        wall = time.perf_counter() - t0
        rates.append(sum(len(o.token_ids) for out in outs for o in out.outputs) / wall)
    return rates


CHUNK = 16 << 20  # cluster.weights.chunk_bytes' default


def zmq_pushes(engine, make_publisher, tensors, pushes: int) -> list[float]:
    """Seconds of each push over the fetch (publish, fetch, load; ``make_publisher(transport, endpoint, directory)``),
    the first (a warm-up) left out."""
    from async_vapo.transport.zmq_transport import ZmqTransport
    from async_vapo.weights.layout import shm_dir
    from async_vapo.weights.receive import load_announced

    transport = ZmqTransport()
    scratch = tempfile.TemporaryDirectory(dir=shm_dir())
    publisher = make_publisher(transport, "tcp://127.0.0.1:*", Path(scratch.name))
    out = []
    try:
        for v in range(101, 102 + pushes):
            t0 = time.perf_counter()
            a = publisher.publish(v, tensors)
            load_announced(engine, a, transport=transport, mode="zmq", fetch_endpoint=publisher.server.endpoint,
                           chunk_bytes=CHUNK, timeout_s=60.0, engine_id="bench", max_bytes=2**20)
            out.append(time.perf_counter() - t0)
    finally:
        publisher.close()
        transport.close()
        scratch.cleanup()
    return out[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF directory (default: the embedded tiny base model)")
    ap.add_argument("--size", default=None, help="a random model of this size (30m, 300m) in place of --model")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--pushes", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                    help="the engine without LoRA runs eagerly (--no-eager: compiled)")
    ap.add_argument("--out", default="benchmarks/results/lora")
    args = ap.parse_args()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import torch

    torch.set_num_threads(1)
    from async_vapo.models.lora import vllm_max_lora_rank
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine
    from async_vapo.weights.adapter import AdapterPublisher
    from async_vapo.weights.publish import SlotPublisher
    from async_vapo.weights.receive import load_announced

    model = args.model
    built = None
    if args.size:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from weight_sync import build_model

        built = tempfile.TemporaryDirectory(prefix=f"random-{args.size}-")
        model = str(Path(built.name) / f"random-{args.size}")
        build_model(args.size, Path(model))  # written to the directory; the model itself is dropped
    elif model is None:
        from async_vapo.config import load_config
        from async_vapo.models.base_model import ensure_base_model

        model = str(ensure_base_model(load_config([], []), progress=False))
    merged, adapter, config = policy_states(model, args.rank)
    result: dict = {"model": Path(model).name, "rank": args.rank, "threads": 1,
                    "full_bytes": nbytes(merged), "adapter_bytes": nbytes(adapter),
                    "params": sum(v.numel() for v in merged.values()),
                    "adapter_params": sum(v.numel() for v in adapter.values()),
                    "generation": {"prompts": args.prompts, "n": args.n, "tokens": args.tokens}}

    spec = EngineSpec(model_path=model, max_model_len=args.tokens + 16, kv_cache_gib=1, enforce_eager=args.eager,
                      max_num_seqs=max(16, args.prompts * args.n))
    engine = VLLMEngine(spec)
    try:
        result["full_engine_start_s"] = engine.start_seconds
        pushes = []
        for v in range(1, args.pushes + 2):
            pushes.append(engine.load_weights(merged, v))
        result["full_push_s"] = pushes[1:]  # the first allocates the shared buffer
        result["full_stages_last"] = dict(engine.last_load_stages)
        result["tokens_s_without_lora"] = tokens_per_s(engine, prompts=args.prompts, n=args.n, tokens=args.tokens)
        result["full_zmq_push_s"] = zmq_pushes(engine, lambda tp, ep, d: SlotPublisher(
            d, 2, transport=tp, fetch_endpoint=ep, chunk_bytes=CHUNK, max_bytes=2**20), merged, args.pushes)
    finally:
        engine.close()

    lspec = EngineSpec(model_path=model, max_model_len=args.tokens + 16, kv_cache_gib=1, enforce_eager=True,
                       max_num_seqs=max(16, args.prompts * args.n), max_lora_rank=vllm_max_lora_rank(args.rank))
    engine = VLLMEngine(lspec)
    publisher = AdapterPublisher(None, config, keep=2)
    try:
        result["lora_engine_start_s"] = engine.start_seconds
        pushes, writes = [], []
        for v in range(1, args.pushes + 2):
            t0 = time.perf_counter()
            a = publisher.publish(v, adapter)
            t1 = time.perf_counter()
            load_announced(engine, a, transport=None, mode="auto", fetch_endpoint="", chunk_bytes=0, timeout_s=60.0,
                           engine_id="bench", max_bytes=0)
            pushes.append(time.perf_counter() - t0)
            writes.append(t1 - t0)
        result["adapter_push_s"] = pushes[1:]
        result["adapter_write_s"] = writes[1:]
        result["adapter_file_bytes"] = a.nbytes
        result["tokens_s_with_adapter"] = tokens_per_s(engine, prompts=args.prompts, n=args.n, tokens=args.tokens,
                                                       lora_request=engine._lora)
        result["adapter_zmq_push_s"] = zmq_pushes(engine, lambda tp, ep, d: AdapterPublisher(
            d, config, keep=2, transport=tp, fetch_endpoint=ep, chunk_bytes=CHUNK, max_bytes=2**20), adapter,
            args.pushes)
    finally:
        publisher.close()
        engine.close()

    full, ad = statistics.median(result["full_push_s"]), statistics.median(result["adapter_push_s"])
    result["summary"] = {
        "bytes_ratio_full_over_adapter": result["full_bytes"] / result["adapter_bytes"],
        "push_s_median_full": full, "push_s_median_adapter": ad,
        "zmq_push_s_median_full": statistics.median(result["full_zmq_push_s"]),
        "zmq_push_s_median_adapter": statistics.median(result["adapter_zmq_push_s"]),
        "tokens_s_median_without_lora": statistics.median(result["tokens_s_without_lora"]),
        "tokens_s_median_with_adapter": statistics.median(result["tokens_s_with_adapter"]),
        "tokens_s_ratio_adapter_over_without": statistics.median(result["tokens_s_with_adapter"])
        / statistics.median(result["tokens_s_without_lora"]),
        "load_average_1m_at_end": os.getloadavg()[0]}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result["eager_without_lora"] = args.eager
    path = out / f"{result['model']}-r{args.rank}{'' if args.eager else '-compiled'}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    if built is not None:
        built.cleanup()
    print(json.dumps(result["summary"], indent=2))
    print(path)


if __name__ == "__main__":
    main()
