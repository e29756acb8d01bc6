"""Models for RL: the policy (a causal LM) and the critic (the same backbone with a scalar head).

Both are plain transformers classes, so they save and load in HF format: the policy is
``AutoModelForCausalLM``; the critic is ``AutoModelForTokenClassification`` with one label, whose
``score`` head gives a value per position (as verl's critic does). A critic initialised from a causal-LM
checkpoint gets a zero head (V = 0 everywhere before value pretraining); one loaded from a critic or
reward checkpoint keeps its head, and with it whatever bias that head has, as in the paper.

Critic designs (:class:`CriticDesign`, ``model.critic_head_layers`` and ``model.critic_logprobs``): the value head
may be more than one linear layer over the trunk's last hidden state. ``score`` is then a :class:`ValueHead`, an
``nn.Linear`` (its ``weight`` and ``bias`` are the plain head's, so a plain critic or reward checkpoint loads into
any design) with extra modules: residual MLP layers between the trunk and the linear head, and/or a small MLP that
also reads features of the response's behaviour log-probs *before* each token (:func:`logprob_features`; the value
of the state before token t reads log-probs of tokens < t only). Each extra output layer starts at zero, so a design
starts as the critic it was loaded from. The design is recorded in the critic's HF config
(``async_vapo_critic_design``): a saved critic loads again with its design.

Sequences are laid out as a left-padded prompt followed by a right-padded response, so that every
response starts at the same column and per-token tensors are ``[B, T]`` over response tokens only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _attn(attn_implementation: str | None) -> dict:
    """``attn_implementation`` for ``from_pretrained`` / ``from_config`` (None: transformers' default, SDPA)."""
    return {} if attn_implementation is None else {"attn_implementation": attn_implementation}


def load_policy(path: str | Path, dtype: str = "float32", attn_implementation: str | None = None) -> torch.nn.Module:
    # eval(): RL fine-tuning runs without dropout, so that recomputed log-probs and values are exact
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=_DTYPES[dtype], **_attn(attn_implementation)).eval()


def build_policy(path: str | Path, dtype: str = "float32", attn_implementation: str | None = None) -> torch.nn.Module:
    """The policy's modules from its config alone (no weights read): for meta-device initialisation."""
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(path)), dtype=_DTYPES[dtype],
                                            **_attn(attn_implementation))


DESIGN_KEY = "async_vapo_critic_design"
"""The critic's HF config attribute that records its :class:`CriticDesign` (absent: the plain linear head)."""


@dataclass(frozen=True)
class CriticDesign:
    """What the critic's value head is (``model.critic_head_layers``, ``model.critic_logprobs``).

    ``head_layers``: residual MLP layers (pre-norm, GELU, width ``head_width``) between the trunk's last hidden
    state and the linear value head: per-token depth the trunk does not have. ``logprobs``: the value also reads
    :func:`logprob_features` of the behaviour log-probs of the response tokens before it, through a small MLP over
    [hidden state, features] (width ``logprob_width``) whose output is added to the linear head's."""

    head_layers: int = 0
    logprobs: bool = False
    head_width: int = 0
    """Hidden width of each head layer; 0 = twice the trunk's hidden size."""
    logprob_width: int = 64

    @property
    def plain(self) -> bool:
        return self.head_layers == 0 and not self.logprobs

    @property
    def name(self) -> str:
        parts = ([f"layers{self.head_layers}"] if self.head_layers else []) + (["logprobs"] if self.logprobs else [])
        return "+".join(parts) or "linear"

    def as_dict(self) -> dict:
        return {"head_layers": self.head_layers, "logprobs": self.logprobs, "head_width": self.head_width,
                "logprob_width": self.logprob_width}

    @classmethod
    def from_dict(cls, d: dict | None) -> CriticDesign:
        return cls(**(d or {}))

    @classmethod
    def from_config(cls, cfg) -> CriticDesign:
        """The design of a run's ``Config`` (``model.critic_head_layers``, ``model.critic_logprobs``)."""
        return cls(head_layers=cfg.model.critic_head_layers, logprobs=cfg.model.critic_logprobs)

    @classmethod
    def of(cls, model: torch.nn.Module) -> CriticDesign:
        """The design a critic model was built with."""
        return cls.from_dict(getattr(model.config, DESIGN_KEY, None))


LOGPROB_FEATURES = 7
"""Features per position of :func:`logprob_features`."""
_LP_FLOOR = -10.0  # log-probs below this count as this (a token the policy all but excluded)


def logprob_features(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[B, T, LOGPROB_FEATURES]`` float32 features of the behaviour log-probs ``[B, T]`` of the response tokens for
    the value of the state *before* each token t: every feature at t reads log-probs of tokens < t only (t = 0: none
    read yet). Log-probs outside ``mask`` or NaN (not reported by the engine) count as 0 (a certain token); each is
    floored at -10. Features: the previous token's log-prob / 10 and its probability; the lowest log-prob so far / 10
    and its probability (a slip: a token the policy found unlikely); the mean log-prob so far / 10; the sum so far
    / 100 (the prefix's log-probability); log(1 + the number of tokens so far with probability below 1/2)."""
    lp = torch.nan_to_num(logprobs.float(), nan=0.0).masked_fill(~mask.bool(), 0.0).clamp(min=_LP_FLOOR, max=0.0)
    b, t = lp.shape
    prev = torch.cat([lp.new_zeros(b, 1), lp[:, :-1]], dim=1)  # log-prob of token t - 1 at position t
    run_min = torch.cummin(prev, dim=1).values
    run_sum = torch.cumsum(prev, dim=1)
    seen = torch.arange(t, device=lp.device, dtype=lp.dtype)[None].clamp(min=1)
    run_mean = run_sum / seen
    unlikely = torch.cumsum((prev < math.log(0.5)).to(lp.dtype), dim=1)
    return torch.stack([prev / 10, prev.exp(), run_min / 10, run_min.exp(), run_mean / 10, run_sum / 100,
                        torch.log1p(unlikely)], dim=-1)


class _HeadLayer(torch.nn.Module):
    """x + W2 GELU(W1 LayerNorm(x)), W2 zero at initialisation (the layer starts as the identity)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.up = torch.nn.Linear(hidden, width)
        self.down = torch.nn.Linear(width, hidden)
        torch.nn.init.zeros_(self.down.weight)
        torch.nn.init.zeros_(self.down.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ValueHead(torch.nn.Linear):
    """The value head of a critic design (see the module docstring): ``weight``/``bias`` are the plain linear head's,
    ``layers`` the residual MLP layers before it, ``lp_in``/``lp_out`` the MLP that reads the log-prob features.

    The features reach it beside the hidden states through :meth:`reading` (the HF forward passes the head hidden
    states only): ``[rows, L, LOGPROB_FEATURES]`` in the forward's layout (:meth:`ModelInputs.scatter`)."""

    def __init__(self, linear: torch.nn.Linear, design: CriticDesign):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            self.weight.copy_(linear.weight)
            if self.bias is not None:
                self.bias.copy_(linear.bias)
        hidden, kw = linear.in_features, {"device": linear.weight.device, "dtype": linear.weight.dtype}
        self.design = design
        width = design.head_width or 2 * hidden
        self.layers = torch.nn.ModuleList(_HeadLayer(hidden, width) for _ in range(design.head_layers)).to(**kw)
        if design.logprobs:
            self.lp_in = torch.nn.Linear(hidden + LOGPROB_FEATURES, design.logprob_width, **kw)
            self.lp_out = torch.nn.Linear(design.logprob_width, linear.out_features, **kw)
            torch.nn.init.zeros_(self.lp_out.weight)
            torch.nn.init.zeros_(self.lp_out.bias)
        self._features: torch.Tensor | None = None

    def reading(self, features: torch.Tensor | None):
        """Context in which the head's forwards read ``features`` (the log-prob design needs them)."""
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self._features = features
            try:
                yield self
            finally:
                self._features = None

        return ctx()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        out = super().forward(x)
        if self.design.logprobs:
            f = self._features
            if f is None:
                raise ValueError("this critic reads the behaviour log-probs of the response tokens "
                                 "(model.critic_logprobs): pass them (response_values(..., logprobs=...))")
            h = torch.cat([x, f.to(x.dtype)], dim=-1)
            out = out + self.lp_out(torch.nn.functional.gelu(self.lp_in(h)))
        return out


def apply_critic_design(model: torch.nn.Module, design: CriticDesign) -> torch.nn.Module:
    """Give a plain critic (linear ``score``) the head of ``design`` (its linear head kept, every extra output layer
    zero) and record the design in its config; a plain design leaves it as it is."""
    if isinstance(model.score, ValueHead):
        if CriticDesign.of(model) != design:
            raise ValueError(f"the critic already has design {CriticDesign.of(model)}, not {design}")
        return model
    if design.plain:
        return model
    model.score = ValueHead(model.score, design)
    setattr(model.config, DESIGN_KEY, design.as_dict())
    return model


def _critic_config(path: str | Path):
    config = AutoConfig.from_pretrained(str(path), num_labels=1)
    # no dropout before the value head: a noisy V would leak straight into every GAE advantage
    config.classifier_dropout = 0.0
    return config


def _resolve_design(config, design: CriticDesign | None, path) -> CriticDesign:
    """The design to build: the requested one, or the checkpoint's own (``design`` None). A checkpoint of another
    (not plain) design is refused: its head would not load."""
    saved = CriticDesign.from_dict(getattr(config, DESIGN_KEY, None))
    if design is None:
        return saved
    if not saved.plain and saved != design:
        raise ValueError(f"{path} holds a critic of design {saved.name} ({saved.as_dict()}), not the requested "
                         f"{design.name} ({design.as_dict()})")
    return design


def build_critic(path: str | Path, dtype: str = "float32", attn_implementation: str | None = None,
                 design: CriticDesign | None = None) -> torch.nn.Module:
    """The critic's modules from its config alone (no weights read): for meta-device initialisation. ``design``:
    None = the one ``path``'s config records (plain when none)."""
    config = _critic_config(path)
    design = _resolve_design(config, design, path)
    if hasattr(config, DESIGN_KEY):
        delattr(config, DESIGN_KEY)
    model = AutoModelForTokenClassification.from_config(config, dtype=_DTYPES[dtype], **_attn(attn_implementation))
    return apply_critic_design(model, design)


def _saved_head_state(path: Path) -> dict[str, torch.Tensor]:
    """The ``score.*`` tensors of the critic checkpoint at ``path`` (every safetensors file, the head's keys only)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({k[len("score."):]: st.get_tensor(k) for k in st.keys() if k.startswith("score.")})
    return out


def load_critic(path: str | Path, dtype: str = "float32", attn_implementation: str | None = None,
                design: CriticDesign | None = None) -> torch.nn.Module:
    """A critic from an HF directory: a critic or reward checkpoint keeps its head (a saved design its extra layers
    too), a causal LM gets a zero head. ``design``: None = the checkpoint's own; a plain checkpoint (critic, reward
    or LM) takes any design, with fresh extra layers whose outputs start at zero."""
    config = _critic_config(path)
    design = _resolve_design(config, design, path)
    saved_design = CriticDesign.from_dict(getattr(config, DESIGN_KEY, None))
    if hasattr(config, DESIGN_KEY):
        delattr(config, DESIGN_KEY)
    is_critic = any(a.endswith("ForTokenClassification") for a in (config.architectures or []))
    import transformers

    level = transformers.logging.get_verbosity()
    if not saved_design.plain:  # the design's extra head tensors are loaded below, not by from_pretrained
        transformers.logging.set_verbosity_error()
    try:
        model = AutoModelForTokenClassification.from_pretrained(str(path), config=config, dtype=_DTYPES[dtype],
                                                                **_attn(attn_implementation)).eval()
    finally:
        transformers.logging.set_verbosity(level)
    if not is_critic:
        torch.nn.init.zeros_(model.score.weight)
        if model.score.bias is not None:
            torch.nn.init.zeros_(model.score.bias)
    apply_critic_design(model, design)
    if not saved_design.plain:
        state = _saved_head_state(Path(path))
        model.score.load_state_dict({k: v.to(_DTYPES[dtype]) for k, v in state.items()}, strict=True)
    return model


@dataclass
class TokenBatch:
    """Prompt and response token ids laid out for one forward pass.

    ``input_ids`` is ``[B, P + T]``: prompts left-padded to P, responses right-padded to T.
    ``response_mask`` is ``[B, T]``: 1 on generated tokens (EOS included); 0 on padding and on a multi-turn
    response's environment tokens (``Trajectory.env_spans``), which are in ``input_ids`` and ``attention_mask``.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    prompt_len: int

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def to(self, device: torch.device | str) -> TokenBatch:
        return TokenBatch(self.input_ids.to(device), self.attention_mask.to(device), self.position_ids.to(device),
                          self.response_ids.to(device), self.response_mask.to(device), self.prompt_len)

    def select(self, idx: torch.Tensor | Sequence[int]) -> TokenBatch:
        """Rows ``idx``, trimmed to their longest prompt and response."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        am = self.attention_mask[idx]
        rm = self.response_mask[idx]
        p_used = int(am[:, : self.prompt_len].sum(1).max())
        t_used = max(1, int(am[:, self.prompt_len:].sum(1).max()))  # environment tokens are not in rm
        cut = slice(self.prompt_len - p_used, self.prompt_len + t_used)
        return TokenBatch(
            input_ids=self.input_ids[idx][:, cut],
            attention_mask=am[:, cut],
            position_ids=self.position_ids[idx][:, cut],
            response_ids=self.response_ids[idx][:, :t_used],
            response_mask=rm[:, :t_used],
            prompt_len=p_used,
        )


def make_token_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     pad_id: int) -> TokenBatch:
    b = len(prompts)
    if b != len(responses) or b == 0:
        raise ValueError(f"need as many prompts as responses, got {b} and {len(responses)}")
    p = max(len(x) for x in prompts)
    t = max(1, max(len(x) for x in responses))
    input_ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + t), dtype=torch.long)
    for i, (pr, rs) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, p - len(pr): p] = torch.as_tensor(pr, dtype=torch.long)
        input_ids[i, p: p + len(rs)] = torch.as_tensor(rs, dtype=torch.long)
        attention_mask[i, p - len(pr): p + len(rs)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, p:].clone()
    return TokenBatch(input_ids, attention_mask, position_ids, input_ids[:, p:].clone(), response_mask, p)


PACKED_ATTENTION = ("mask", "flex")
"""How a packed forward keeps sequences apart: ``mask`` = an explicit block-diagonal causal mask ``[1, 1, L, L]``
(any attention implementation: SDPA, eager; O(L²) memory), ``flex`` = a FlexAttention ``BlockMask`` of the
documents (the model must run ``attn_implementation="flex_attention"``; O((L / 128)²) block metadata, the
attention kernel skips the blocks across sequences)."""


def attn_implementation(packed: bool | str) -> str | None:
    """The ``attn_implementation`` a model needs for forwards packed this way (None: transformers' default)."""
    return "flex_attention" if _packing(packed) == "flex" else None


def resolve_packing(packing: bool, packed_attention: str, device_type: str, share_prompts: bool = False
                    ) -> str | None:
    """How the learner packs on a ``device_type`` device: None (``packing`` off), ``"mask"``, ``"flex"`` or, with
    ``share_prompts``, ``"shared"`` (an explicit mask; see :func:`model_inputs`); ``packed_attention = "auto"`` is
    ``"flex"`` on CUDA and ``"mask"`` elsewhere. ``"flex"`` off CUDA is refused: torch's FlexAttention has no
    backward on the CPU (torch 2.13: ``NotImplementedError: FlexAttention does not support backward on CPU``), and
    a learner needs one."""
    if share_prompts:
        if not packing:
            raise ValueError("learner.share_prompts needs learner.packing = true (a prompt is shared inside a packed "
                             "forward)")
        if packed_attention == "flex":
            raise ValueError("learner.share_prompts needs learner.packed_attention = mask or auto (its tree mask is "
                             "an explicit one; flex's BlockMask holds documents only)")
        return SHARED
    if not packing:
        return None
    if packed_attention == "auto":
        return "flex" if device_type == "cuda" else "mask"
    if packed_attention not in PACKED_ATTENTION:
        raise ValueError(f"packed_attention must be auto or one of {PACKED_ATTENTION}, got {packed_attention!r}")
    if packed_attention == "flex" and device_type != "cuda":
        raise ValueError(f"learner.packed_attention = flex needs CUDA (FlexAttention has no backward on {device_type}"
                         f"); use mask or auto")
    return packed_attention


SHARED = "shared"
"""The packed mode of ``learner.share_prompts``: an explicit mask, each distinct prompt of a forward once."""


def _packing(packed: bool | str) -> str | None:
    """``packed`` of :func:`model_inputs` as None (padded), ``"mask"``, ``"flex"`` or ``"shared"``; True means
    ``"mask"``."""
    if packed is False or packed is None:
        return None
    if packed is True:
        return "mask"
    if packed not in (*PACKED_ATTENTION, SHARED):
        raise ValueError(f"packed must be a bool or one of {(*PACKED_ATTENTION, SHARED)}, got {packed!r}")
    return packed


def document_block_mask(doc: torch.Tensor, block_size: int = 128):
    """FlexAttention ``BlockMask`` of a packed row: token q attends to token kv iff both are in the same document and
    kv <= q. ``doc`` ``[L]``: each token's document id, non-decreasing along the row (sequences one after another).

    Built from the documents' block ranges, never from an ``[L, L]`` mask (``create_block_mask`` evaluates the
    mask function on every pair unless compiled): with ``lo``/``hi`` the first/last document of each block of
    ``block_size`` tokens, kv block k (k <= q block) holds some allowed pair iff ``hi[k] >= lo[q]``, and is full
    (no mask needed inside) iff k < q and both blocks lie in one and the same document (the same blocks as
    ``create_block_mask`` finds). Tokens past ``L`` in a ragged last block are outside ``seq_lengths``."""
    from torch.nn.attention.flex_attention import BlockMask

    if doc.dim() != 1 or doc.numel() == 0:
        raise ValueError(f"doc must be a non-empty [L] tensor, got shape {tuple(doc.shape)}")
    length, dev = doc.numel(), doc.device
    n = -(-length // block_size)
    first = torch.arange(n, device=dev) * block_size
    lo, hi = doc[first], doc[(first + block_size).clamp(max=length) - 1]
    blocks = torch.arange(n, device=dev)
    causal = blocks[None, :] <= blocks[:, None]  # [q block, kv block]
    touches = causal & (hi[None, :] >= lo[:, None])
    one_doc = lo == hi
    if length % block_size:
        one_doc[-1] = False  # a ragged last block is never full (as create_block_mask has it)
    full = (blocks[None, :] < blocks[:, None]) & one_doc[:, None] & one_doc[None, :] & (lo[:, None] == lo[None, :])
    partial = touches & ~full

    def as_indices(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = m.sum(-1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # the listed blocks first
        return num[None, None], idx[None, None]

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

    return BlockMask.from_kv_blocks(*as_indices(partial), *as_indices(full), BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(length, length))


@dataclass
class ModelInputs:
    """What one forward pass is given, and where in its output each response token's score is.

    Padded (:func:`model_inputs` with ``packed=False``): the batch's ``[B, P + T]`` rows; response token t of
    row i is scored at ``[i, P - 1 + t]``. Packed: every row's valid tokens one after the other in a single row of
    ``L`` = all valid tokens (no padding), positions restarting at 0 per sequence, and an attention mask that keeps
    every token inside its own sequence: with ``packed="mask"`` (or True) a block-diagonal causal mask
    ``[1, 1, L, L]`` (additive: 0 or the dtype's minimum, which SDPA and eager attention both take); with
    ``packed="flex"`` a FlexAttention ``BlockMask`` of the sequences (:func:`document_block_mask`; the model must
    run ``attn_implementation="flex_attention"``). Either is 4-D, so transformers uses it as given (it does not
    depend on transformers inferring sequences from the restarting position ids, which it does only for forwards
    without a KV cache). ``index`` holds the flat output position scoring each response token (0 at padding
    positions, whose scores are masked by ``response_mask`` downstream).
    """

    kwargs: dict
    prompt_len: int
    response_len: int
    index: torch.Tensor | None = None

    def select(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` of the model's ``[rows, L, ...]`` output."""
        if self.index is None:
            return out[:, self.prompt_len - 1: self.prompt_len - 1 + self.response_len]
        return out.flatten(0, 1)[self.index]

    def scatter(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`select` for a per-response-token input ``x`` ``[B, T, F]``: ``[rows, L, F]`` in the
        forward's layout, ``x`` where ``select`` would read it (``mask``'s tokens), 0 elsewhere."""
        ids = self.kwargs["input_ids"]
        out = x.new_zeros(*ids.shape, x.shape[-1])
        if self.index is None:
            out[:, self.prompt_len - 1: self.prompt_len - 1 + self.response_len] = x * mask[..., None].to(x.dtype)
            return out
        flat = out.view(-1, x.shape[-1])
        m = mask.bool()
        flat[self.index[m]] = x[m]
        return out


def model_inputs(batch: TokenBatch, packed: bool | str = False, mask_dtype: torch.dtype = torch.float32
                 ) -> ModelInputs:
    """The forward's inputs for ``batch``, padded (``packed`` False) or packed (True or ``"mask"``: explicit
    mask; ``"flex"``: BlockMask; see :class:`ModelInputs`)."""
    t = batch.response_ids.shape[1]
    mode = _packing(packed)
    if mode is None:
        kwargs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                  "position_ids": batch.position_ids}
        return ModelInputs(kwargs, batch.prompt_len, t)
    if mode == SHARED:
        return _shared_inputs(batch, mask_dtype)
    valid = batch.attention_mask.bool()
    lengths = valid.sum(-1)
    starts = lengths.cumsum(0) - lengths
    prompt_lens = valid[:, : batch.prompt_len].sum(-1)
    seg = torch.repeat_interleave(torch.arange(len(lengths), device=valid.device), lengths)
    total = int(lengths.sum())
    if mode == "flex":
        mask = document_block_mask(seg)
    else:
        allowed = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool,
                                                              device=valid.device).tril()
        mask = torch.zeros(total, total, dtype=mask_dtype, device=valid.device)
        mask.masked_fill_(~allowed, torch.finfo(mask_dtype).min)
        mask = mask[None, None]
    cols = torch.arange(t, device=valid.device)
    index = (starts + prompt_lens - 1)[:, None] + cols[None, :]
    index = torch.where(batch.response_mask.bool(), index, torch.zeros_like(index))
    kwargs = {"input_ids": batch.input_ids[valid][None], "position_ids": batch.position_ids[valid][None],
              "attention_mask": mask}
    return ModelInputs(kwargs, batch.prompt_len, t, index)


def _shared_inputs(batch: TokenBatch, mask_dtype: torch.dtype) -> ModelInputs:
    """Packed inputs with each distinct prompt once (``learner.share_prompts``): the row holds, per distinct prompt in
    order of first appearance, its tokens and then the response of every row with that prompt, each response at the
    positions it has in its own sequence (prompt length onwards). A token attends to the earlier tokens of its own
    prompt or response and, if in a response, to its prompt's tokens: every response sees exactly the context it
    has alone, so log-probs, values and gradients equal the unshared forward's up to float rounding, while a group
    of G responses of T tokens to a P-token prompt costs P + G·T tokens instead of G·(P + T). A response's first
    token is scored at its prompt's last token, shared by the group (:meth:`ModelInputs.scatter` cannot place a
    different input per row there: a critic that reads log-probs is refused with sharing)."""
    valid = batch.attention_mask.bool()
    p = batch.prompt_len
    ids, pos = batch.input_ids, batch.position_ids
    dev = ids.device
    first: dict[tuple[int, ...], int] = {}
    members: list[list[int]] = []
    for i in range(len(ids)):
        key = tuple(ids[i, :p][valid[i, :p]].tolist())
        if key not in first:
            first[key] = len(members)
            members.append([])
        members[first[key]].append(i)
    tokens, positions, owner, is_prompt = [], [], [], []  # owner: the row (response) or -1 - prompt index
    t = batch.response_ids.shape[1]
    index = torch.zeros(len(ids), t, dtype=torch.long, device=dev)
    cols = torch.arange(t, device=dev)
    at = 0
    for k, rows in enumerate(members):
        r0 = rows[0]
        pv = valid[r0, :p]
        n_p = int(pv.sum())
        tokens.append(ids[r0, :p][pv])
        positions.append(pos[r0, :p][pv])
        owner += [-1 - k] * n_p
        is_prompt += [True] * n_p
        last_prompt = at + n_p - 1
        at += n_p
        for r in rows:
            rv = valid[r, p:]
            n_r = int(rv.sum())
            tokens.append(ids[r, p:][rv])
            positions.append(pos[r, p:][rv])
            owner += [r] * n_r
            is_prompt += [False] * n_r
            scored = torch.where(cols == 0, torch.full_like(cols, last_prompt), at + cols - 1)
            index[r] = torch.where(batch.response_mask[r].bool(), scored, torch.zeros_like(cols))
            at += n_r
    owner_t = torch.tensor(owner, device=dev)
    prompt_t = torch.tensor(is_prompt, device=dev)
    group = torch.tensor(_groups_of(owner, members), device=dev)
    total = len(owner)
    causal = torch.ones(total, total, dtype=torch.bool, device=dev).tril()
    same_prompt = prompt_t[None, :] & (group[:, None] == group[None, :])
    allowed = causal & ((owner_t[:, None] == owner_t[None, :]) | same_prompt)
    mask = torch.zeros(total, total, dtype=mask_dtype, device=dev)
    mask.masked_fill_(~allowed, torch.finfo(mask_dtype).min)
    kwargs = {"input_ids": torch.cat(tokens)[None], "position_ids": torch.cat(positions)[None],
              "attention_mask": mask[None, None]}
    return ModelInputs(kwargs, p, t, index)


def _groups_of(owner: list[int], members: list[list[int]]) -> list[int]:
    """Each packed token's prompt index, from its owner (a row, or -1 - prompt index)."""
    row_group = {r: k for k, rows in enumerate(members) for r in rows}
    return [-1 - o if o < 0 else row_group[o] for o in owner]


def response_logits(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0, packed: bool | str = False,
                    mask_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Float32 logits of the sampling distribution for each response token: ``[B, T, V]``, the model's logits
    divided by the sampling ``temperature``, so that their log-softmax is log π(y_t) of the distribution the engine
    sampled from (vLLM divides its float32 logits by the temperature before sampling, as verl's actor does here).
    ``packed``: one padding-free forward (True / ``"mask"`` or ``"flex"``, see :class:`ModelInputs`; ``mask_dtype`` =
    the attention's compute dtype, for the explicit mask).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no log-probs to learn from), got {temperature}")
    inputs = model_inputs(batch, packed, mask_dtype)
    out = model(**inputs.kwargs, use_cache=False)
    logits = inputs.select(out.logits).float()
    # in place: no second [B, T, V] tensor (the lm head's backward does not need its output)
    return logits if temperature == 1.0 else logits.div_(temperature)


def reads_logprobs(critic: torch.nn.Module) -> bool:
    """Whether ``critic``'s values read the behaviour log-probs of the response tokens (a log-prob design)."""
    return isinstance(critic.score, ValueHead) and critic.score.design.logprobs


def response_values(critic: torch.nn.Module, batch: TokenBatch, packed: bool | str = False,
                    mask_dtype: torch.dtype = torch.float32, logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Critic value of the state before each response token: ``[B, T]``. ``logprobs`` ``[B, T]``: the behaviour
    log-probs of the response tokens, which a log-prob design reads (those of tokens before each one; others ignore
    them)."""
    inputs = model_inputs(batch, packed, mask_dtype)
    if not reads_logprobs(critic):
        out = critic(**inputs.kwargs)
        return inputs.select(out.logits)[..., 0].float()
    if logprobs is None:
        raise ValueError("this critic reads the behaviour log-probs of the response tokens (model.critic_logprobs): "
                         "pass logprobs")
    t = batch.response_ids.shape[1]
    feats = logprob_features(logprobs[:, :t].to(batch.response_mask.device), batch.response_mask)
    with critic.score.reading(inputs.scatter(feats, batch.response_mask)):
        out = critic(**inputs.kwargs)
    return inputs.select(out.logits)[..., 0].float()


def trunk_states(critic: torch.nn.Module, batch: TokenBatch, packed: bool | str = False,
                 mask_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The critic trunk's last hidden state at the position scoring each response token: ``[B, T, H]`` (what its
    value head reads; :func:`response_values` is ``head_values`` of these)."""
    inputs = model_inputs(batch, packed, mask_dtype)
    trunk = getattr(critic, critic.base_model_prefix)
    return inputs.select(trunk(**inputs.kwargs, use_cache=False).last_hidden_state)


def head_values(critic: torch.nn.Module, states: torch.Tensor, response_mask: torch.Tensor,
                logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """The critic's values ``[B, T]`` from its trunk's states ``[B, T, H]`` (:func:`trunk_states`): its value head
    alone. ``logprobs`` as in :func:`response_values`."""
    states = critic.dropout(states) if hasattr(critic, "dropout") else states  # the HF forward's (eval: identity)
    if not reads_logprobs(critic):
        return critic.score(states)[..., 0].float()
    if logprobs is None:
        raise ValueError("this critic reads the behaviour log-probs of the response tokens (model.critic_logprobs): "
                         "pass logprobs")
    t = states.shape[1]
    feats = logprob_features(logprobs[:, :t].to(states.device), response_mask[:, :t])
    with critic.score.reading(feats):
        return critic.score(states)[..., 0].float()


class TrunkStateCache:
    """A frozen critic trunk's states of each response (``model.critic_trunk = "frozen"``), kept so that a response
    runs through the trunk once however many head steps and passes train on it. A response is known by its prompt and
    response tokens (the states depend on nothing else); it keeps the states of its own response tokens only, as
    float32, and the least recently used are dropped beyond ``max_bytes``."""

    def __init__(self, max_bytes: int):
        from collections import OrderedDict

        self.max_bytes = max_bytes
        self._rows: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    @staticmethod
    def keys(batch: TokenBatch) -> tuple[list[bytes], list[int]]:
        """Each row's key (its prompt and response tokens, padding dropped, and where the response starts) and its
        response positions in the forward (generated and environment tokens, not padding); one copy to the host."""
        ids, mask = batch.input_ids.to("cpu", torch.int64), batch.attention_mask.to("cpu").bool()
        lengths = mask[:, batch.prompt_len:].sum(-1).tolist()
        return [ids[i][mask[i]].numpy().tobytes() + int(n).to_bytes(4, "little")
                for i, n in enumerate(lengths)], [int(n) for n in lengths]

    def states(self, batch: TokenBatch, compute) -> torch.Tensor:
        """``[B, T, H]`` float32 states of ``batch`` (0 at padding): the kept rows' from the cache, the others' from
        ``compute(rows)`` (one call on a :meth:`TokenBatch.select` of the rows not kept), which are then kept."""
        keys, lengths = self.keys(batch)
        kept = {i: self._rows[k] for i, k in enumerate(keys) if k in self._rows}
        missing = [i for i in range(len(keys)) if i not in kept]
        self.hits, self.misses = self.hits + len(kept), self.misses + len(missing)
        for i in kept:
            self._rows.move_to_end(keys[i])
        fresh = compute(batch.select(missing)).detach().float() if missing else None
        t = batch.response_ids.shape[1]
        hidden = fresh.shape[-1] if fresh is not None else next(iter(kept.values())).shape[-1]
        out = torch.zeros(len(keys), t, hidden, device=batch.response_ids.device)
        for i, row in kept.items():
            out[i, : row.shape[0]] = row.to(out.device)
        for j, i in enumerate(missing):
            n = lengths[i]
            out[i, :n] = fresh[j, :n]
            self._put(keys[i], fresh[j, :n].clone())
        return out

    def _put(self, key: bytes, row: torch.Tensor) -> None:
        size = row.numel() * row.element_size()
        if size > self.max_bytes:
            return
        self._rows[key] = row
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self._rows.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()

    def __len__(self) -> int:
        return len(self._rows)


def _head_logprobs(head: torch.nn.Module, h: torch.Tensor, labels: torch.Tensor, temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float()
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    lp = logits.gather(-1, labels[:, None])[:, 0] - lse
    ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return lp, ent


def chunked_response_logprobs(model: torch.nn.Module, batch: TokenBatch, temperature: float = 1.0,
                              chunk_tokens: int = 4096, packed: bool | str = False,
                              mask_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(log π(y_t), entropy H_t) of the sampling distribution, each ``[B, T]`` float32, from the backbone's hidden
    states: the LM head runs on ``chunk_tokens`` response positions at a time under activation checkpointing, so
    that the float32 ``[tokens, vocab]`` logits exist one chunk at a time, in forward and in backward. Equal to
    ``logprobs_from_logits`` / ``entropy_from_logits`` of :func:`response_logits` up to float rounding."""
    from torch.utils.checkpoint import checkpoint

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (greedy decoding has no log-probs to learn from), got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    backbone = getattr(model, model.base_model_prefix)
    inputs = model_inputs(batch, packed, mask_dtype)
    hidden = backbone(**inputs.kwargs, use_cache=False).last_hidden_state
    h = inputs.select(hidden).reshape(-1, hidden.shape[-1])
    labels = batch.response_ids.reshape(-1)
    head = model.get_output_embeddings()
    lps, ents = [], []
    for s in range(0, h.shape[0], chunk_tokens):
        lp, ent = checkpoint(_head_logprobs, head, h[s: s + chunk_tokens], labels[s: s + chunk_tokens], temperature,
                             use_reentrant=False)
        lps.append(lp)
        ents.append(ent)
    shape = batch.response_ids.shape
    # copies ([B, T], small beside one chunk's logits), not views of the flat results: a sharded learner calls this
    # as an FSDP2 forward method, and FSDP2 hooks its backward on the outputs, a hook that an in-place op on a view
    # would drop (its "returned a view tensor" warning)
    return torch.cat(lps).view(shape).clone(), torch.cat(ents).view(shape).clone()
