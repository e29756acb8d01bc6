"""A vLLM general plugin (entry point ``vllm.general_plugins`` in pyproject.toml), which vLLM loads in every process it
starts (the engine core and each worker) before it creates their message queues.

What it does, only when :data:`IDLE_SPIN_ENV` is set: shortens how long vLLM's shared-memory queue readers keep
busy-polling after their last message (``shm_broadcast.SpinCondition``, 1 s in vLLM 0.32) before they wait on a
socket. After a ``generate`` call the worker and the engine core each keep a core busy for that second. In the
one-process trainer the learner runs right after generation on the same cores, and those spinning readers took CPU
from it: a learner update measured 0.54 s inside the trainer against 0.32 s with no engine
(``benchmarks/peers/profile_trainer.py``). The trainer sets it (``rollout.engine_idle_spin_s``); the services leave
vLLM's default, since an engine there has its own cores and generates again at once.
"""

from __future__ import annotations

import os

IDLE_SPIN_ENV = "ASYNC_VAPO_VLLM_IDLE_SPIN_S"


def register() -> None:
    value = os.environ.get(IDLE_SPIN_ENV)
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__
    if init.__defaults__ is None or len(init.__defaults__) != 1:  # a vLLM whose SpinCondition we do not know
        return
    init.__defaults__ = (float(value),)
