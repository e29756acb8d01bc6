"""Mixed precision of the learner: float32 master weights, low-precision compute.

``model.dtype`` names the dtype the engines run in and the learner computes in. Whatever it is, the learner
holds its parameters, gradients and AdamW moments in float32 and runs every forward (and so every backward)
under ``torch.autocast`` to that dtype: matmuls in bf16 / fp16, reductions and the loss in float32 (the
scheme of PyTorch AMP, and of FSDP's ``MixedPrecision(param_dtype=bf16)`` in verl and NeMo-RL). An AdamW update
of a bf16 weight is rounded to its 8-bit mantissa: at lr 1e-6 a weight of magnitude 1e-2 (ulp ~6e-5) never
moves, so bf16 weights cannot be the ones the optimiser updates.

* float32: autocast off, nothing changes.
* bfloat16: autocast to bf16; same exponent range as float32, no loss scaling.
* float16: autocast to fp16 with dynamic loss scaling (``torch.amp.GradScaler``, one per optimiser): the loss
  is scaled before backward, the gradients unscaled before clipping, and a step whose gradients overflowed is
  skipped and the scale halved.

Weights leave the learner (:meth:`Precision.engine_state`) in ``model.dtype``, the dtype the engines load; the
checkpoints keep the float32 masters, so that a resumed run continues from the exact weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Precision:
    """Autocast and loss scaling for models whose parameters are float32 on ``device_type``."""

    def __init__(self, dtype: str, device_type: str = "cpu", autocast: bool = True):
        """``autocast`` False: the models cast their own parameters for compute (FSDP2's
        ``MixedPrecisionPolicy``, ``learner.sharding``), so forwards run without autocast."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        self.compute_dtype = DTYPES[dtype]
        self.device_type = device_type
        self.use_autocast = autocast

    @property
    def mixed(self) -> bool:
        return self.compute_dtype != torch.float32

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context every forward of the learner runs in."""
        if not self.mixed or not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.compute_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A loss scaler for one optimiser: enabled for float16 only (a no-op pass-through otherwise)."""
        return torch.amp.GradScaler(self.device_type, enabled=self.compute_dtype == torch.float16)

    def engine_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (float32 masters) cast to the engines' dtype; no copy when that is float32."""
        return {k: v.detach().to(self.compute_dtype) if v.is_floating_point() else v.detach()
                for k, v in state.items()}
