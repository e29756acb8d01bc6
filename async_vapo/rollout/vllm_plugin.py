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
RECHECK_MS = 5
"""With a short spin, how often a sleeping reader re-checks its queue (vLLM: 5000 ms)."""


def register() -> None:
    value = os.environ.get(IDLE_SPIN_ENV)
    if not value:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__
    if init.__defaults__ is None or len(init.__defaults__) != 1 or not hasattr(
            shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS"):  # a vLLM whose queues we do not know
        return
    init.__defaults__ = (float(value),)
    # An idle reader sleeps on a notification socket, and vLLM re-checks the buffer every 5 s in case a notification
    # was lost. With vLLM's 1 s of spinning that path is rare; with a short spin a reader takes it at every pause,
    # and a lost notification stalled a generate call for 5 s about once in ten updates. Re-check every 5 ms instead
    # (a sleeping reader wakes 200 times a second: no measurable CPU).
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = RECHECK_MS
