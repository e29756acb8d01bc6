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
* tokens/s of an update and peak GPU memory, beside the planned state memory (16 bytes per parameter per model:
  float32 weight, gradient and two AdamW moments);
* the weight transfer's NCCL step (``nccl_weight_transfer``, before the rest): a bare NCCL broadcast of 1 GiB
  (about Qwen2.5-0.5B's bf16 weights) in 16 MiB buckets (``cluster.weights.dist_bucket_bytes``) between two fresh
  processes, against a device memcpy of the same bytes; issue 15's goal is the broadcast within 2x the memcpy. Two
  GPUs when there are two (a learner's and an engine's), else both processes on one GPU, which NCCL before 2.30
  refuses ("Duplicate GPU"; 2.30 has NCCL_MULTI_RANK_GPU_ENABLE, set here): then the row is skipped with NCCL's
  error. On the CPU (``--tiny``) the same step runs over gloo as a smoke test and is recorded as skipped.

vLLM is not on the device machine: the engine steps, and the weight transfer through vLLM's NCCL weight-transfer
engine (``async_vapo.weights.collective``), are recorded as skipped with that reason.

    python deploy/device_check.py OUT_DIR [--tiny]      (--tiny: a 2-layer model, any device, for a smoke test)
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
TINY = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


def build(directory: Path, shape: dict, vocab: int, max_len: int) -> None:
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
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(str(directory), safe_serialization=True)
    tok.save_pretrained(str(directory))


def groups(n_groups: int, group_size: int, prompt_tokens: int, response_tokens: int, vocab: int, eos: int):
    import random

    from async_vapo.types import Group, Trajectory

    rng = random.Random(0)
    out = []
    for g in range(n_groups):
        samples = []
        for k in range(group_size):
            n = response_tokens - rng.randint(0, response_tokens // 10)
            ids = [rng.randrange(3, vocab) for _ in range(n - 1)] + [eos]
            samples.append(Trajectory(response_ids=ids, behavior_logprobs=[], finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2)))
        out.append(Group(uid=f"g{g}", prompt="p", answer="a", version=0, samples=samples,
                         prompt_ids=[rng.randrange(3, vocab) for _ in range(prompt_tokens)]))
    return out


class Checks:
    def __init__(self, out: Path):
        self.out, self.rows = out, {}

    def record(self, name: str, ok: bool, **values) -> None:
        self.rows[name] = {"ok": bool(ok), **values}
        print(f"[device_check] {name}: {'ok' if ok else 'FAILED'} {values}", flush=True)

    def write(self, extra: dict) -> bool:
        ok = all(r["ok"] for r in self.rows.values() if not r.get("skipped"))
        (self.out / "device_check.json").write_text(json.dumps({"ok": ok, "checks": self.rows, **extra}, indent=2,
                                                               default=str) + "\n")
        return ok


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--response-tokens", type=int, default=20_000)
    p.add_argument("--vocab", type=int, default=151_936)
    args = p.parse_args()
    import torch

    from async_vapo.config import load_config
    from async_vapo.learner.export import export
    from async_vapo.learner.process_group import data_parallel_world, init_process_group
    from async_vapo.learner.sharding import full_state_dict
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.rl import response_logits

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = TINY if args.tiny else QWEN25_05B
    resp = 200 if args.tiny else args.response_tokens
    vocab = 512 if args.tiny else args.vocab
    init_process_group(300)
    rank, world = data_parallel_world()
    cuda = torch.cuda.is_available()
    checks = Checks(out)
    env = {"torch": torch.__version__, "python": platform.python_version(), "world": world, "shape": shape,
           "vocab": vocab, "response_tokens": resp, "device": torch.cuda.get_device_name() if cuda else "cpu"}
    import transformers

    env["transformers"] = transformers.__version__
    checks.record("vllm_engine_steps", True, skipped=True,
                  reason="vLLM is not installed on the device machine (torch and transformers only)")
    if rank == 0:
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
                "optim.actor_lr=1e-5", "optim.critic_lr=1e-5"])
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
            # one update: the old-log-prob and value forward, then policy and critic forward + backward
            checks.record("throughput", True, tokens=tokens, value_pretrain_s=t1 - t0, update_s=t2 - t1,
                          update_tokens_per_s=tokens / (t2 - t1), peak_gpu_memory_gib=peak and peak / 2**30,
                          planned_state_gib=2 * 16 * params / world / 2**30)

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
    ok = checks.write({"environment": env}) if rank == 0 else True
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
