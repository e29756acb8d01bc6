"""TRL's GRPOTrainer on the embedded task, as a TRL user would run it: the peer side of ``benchmarks/peers/run.py``.

Runs in a virtual environment of its own with TRL installed (``benchmarks/peers/setup_trl.sh``), never in the
project's: TRL is a benchmark extra, not a dependency. It imports from ``async_vapo`` only the pure answer check
(``async_vapo.verify.check``, through ``PYTHONPATH``), so the reward rule is ours, graded in-process (no sandbox:
to TRL's advantage).

Input (``--spec``, written by ``run.py``): the base model directory, the training prompts in the order our
``PromptSampler`` takes them (so TRL sees the same prompts per update as ``async-vapo train``), rendered as ours are
(the chat template filled, for a chat task), and the hyper-parameters. Output (``--out``): ``step_N/`` (policy
weights, tokenizer) every ``save_every`` updates and at the last, and ``timing.json``: per update the training
seconds since the first step started (``train_s``) and the seconds since ``run.py`` launched this process
(``process_s``: imports, model load and TRL's set-up included), saves excluded from both, and the update's seconds
in TRL's ``_generate`` (``generate_s``: the completions, with transformers' ``generate`` or vLLM; the rest of the
update is scoring, the forwards and backwards and the optimiser step). With ``max_seconds`` the
run stops at the first update whose ``process_s`` reaches it.

One update here is what one update is in ``async-vapo train``: prompts x group samples generated, then one optimiser
step per mini-batch, each accumulated over micro-batches (tiny: 16 x 8, two steps of 64 in one micro-batch each,
``steps_per_generation = 2``; smollm2: 8 x 8, one step of 64 in micro-batches of 8, ``gradient_accumulation_steps =
steps_per_generation = 8``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    spec = json.loads(Path(args.spec).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if spec.get("vllm_mode"):  # vLLM's CPU backend reads a fraction of host RAM minus this process's as its KV cache
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; 64 sequences x 200 tokens need ~0.3
    import torch

    torch.set_num_threads(spec["threads"])
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from async_vapo.verify.check import check_answer

    h = spec["hparams"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    for text, ids in zip(spec["prompts"], spec["prompt_ids"], strict=False):
        if tokenizer(text=[text])["input_ids"][0] != ids:  # GRPOTrainer._tokenize_prompts on a text prompt
            raise SystemExit(f"TRL would tokenise this prompt unlike our PromptEncoder: {text!r}")
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    data = Dataset.from_list([{"prompt": p, "answer": a}
                              for p, a in zip(spec["prompts"], spec["answers"], strict=True)])

    def reward(prompts, completions, answer, **_):
        fmt = h.get("answer_format", "boxed")
        return [h["reward_correct"] if check_answer(c, a, answer_format=fmt)[0] else h["reward_incorrect"]
                for c, a in zip(completions, answer, strict=True)]

    steps_per_update = h["prompts_per_step"] * h["group_size"] // h["mini_batch_size"]
    config = GRPOConfig(**trl_settings(h, spec["seed"], steps_per_update, spec["updates"], str(out / "trl"),
                                       spec.get("vllm_mode")))
    launched = spec.get("launched_at", time.time())

    class Clock(TrainerCallback):
        """Training seconds per update (every ``steps_per_update`` optimiser steps) and seconds since launch, saves
        excluded; stops the run at the first update past ``max_seconds``."""

        def __init__(self):
            self.t0 = None
            self.paused = 0.0
            self.rows = []
            self.generate_s = 0.0  # seconds in TRL's _generate (the completions alone) since the last update

        def timed(self, generate):
            def wrapper(*a, **kw):
                t = time.perf_counter()
                try:
                    return generate(*a, **kw)
                finally:
                    self.generate_s += time.perf_counter() - t
            return wrapper

        def on_step_begin(self, a, state, control, **kw):
            if self.t0 is None:
                self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            if state.global_step % steps_per_update:
                return
            update = state.global_step // steps_per_update
            process_s = time.time() - launched - self.paused
            self.rows.append({"update": update, "train_s": time.perf_counter() - self.t0 - self.paused,
                              "process_s": process_s, "cpu_s": time.process_time(), "generate_s": self.generate_s})
            self.generate_s = 0.0
            last = update == spec["updates"] or process_s >= (spec.get("max_seconds") or float("inf"))
            if update % spec["save_every"] == 0 or last:
                t = time.perf_counter()
                kw["model"].save_pretrained(out / f"step_{update}", safe_serialization=True)
                tokenizer.save_pretrained(out / f"step_{update}")
                self.paused += time.perf_counter() - t
            if last:
                control.should_training_stop = True

    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[clock])
    trainer._generate = clock.timed(trainer._generate)  # where an update's time goes: generation and the rest
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    (out / "timing.json").write_text(json.dumps({"updates": clock.rows, "settings": config_summary(config),
                                                 "log_history": logs}, indent=1) + "\n")


def trl_settings(h: dict, seed: int, steps_per_update: int, updates: int, output_dir: str,
                 vllm_mode: str | None = None) -> dict:
    """GRPOConfig arguments matched to our GRPO baseline (README of benchmarks/peers, line by line): an optimiser
    step per mini-batch, accumulated over micro-batches as our learner's is. ``vllm_mode`` (``colocate`` or
    ``server``): TRL's vLLM integration, its importance-sampling correction set to ours (per token, capped at 5)."""
    accumulate = h["mini_batch_size"] // h.get("micro_batch_size", h["mini_batch_size"])
    vllm = {} if vllm_mode is None else dict(
        vllm_mode=vllm_mode, vllm_gpu_memory_utilization=0.05, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=5.0)
    return dict(
        **vllm,
        output_dir=output_dir, use_cpu=True, use_vllm=vllm_mode is not None, seed=seed, data_seed=seed,
        report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        shuffle_dataset=False,  # prompts in our PromptSampler's order
        num_generations=h["group_size"], per_device_train_batch_size=h["mini_batch_size"] // accumulate,
        gradient_accumulation_steps=accumulate, steps_per_generation=accumulate * steps_per_update,
        num_iterations=1,
        max_steps=updates * steps_per_update,
        learning_rate=h["actor_lr"], lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=h["beta1"], adam_beta2=h["beta2"], weight_decay=h["weight_decay"], max_grad_norm=h["grad_clip"],
        beta=0.0, epsilon=h["eps_low"], epsilon_high=h["eps_low"], loss_type="grpo", scale_rewards="group",
        temperature=h["temperature"], top_p=h.get("top_p", 1.0), top_k=0,
        max_completion_length=h["max_response_tokens"],
        mask_truncated_completions=False, dataloader_num_workers=0, bf16=False, fp16=False,
    )


def config_summary(config) -> dict:
    keys = ["num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
            "generation_batch_size", "num_iterations", "max_steps", "learning_rate", "lr_scheduler_type", "beta",
            "epsilon", "epsilon_high", "loss_type", "scale_rewards", "temperature", "top_p", "top_k",
            "max_completion_length", "mask_truncated_completions", "max_grad_norm", "adam_beta1", "adam_beta2",
            "weight_decay", "shuffle_dataset", "use_vllm", "seed"]
    return {k: getattr(config, k, None) for k in keys}


if __name__ == "__main__":
    main()
