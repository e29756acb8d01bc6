"""Our vLLM general plugin (pyproject's ``vllm.general_plugins`` entry point, async_vapo.rollout.vllm_plugin), loaded
the way vLLM loads it in its engine and worker processes: it shortens the shared-memory queue readers' busy-poll
only when asked."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from async_vapo.rollout.engine import EngineSpec
from async_vapo.rollout.vllm_plugin import IDLE_SPIN_ENV

PROBE = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
         "from vllm.distributed.device_communicators import shm_broadcast as m; "
         "print(m.SpinCondition.__init__.__defaults__[0], m.SHM_READER_RECHECK_INTERVAL_MS)")


@pytest.mark.parametrize("value, expected", [("0.002", [0.002, 5]), (None, [1.0, 5000])])
def test_vllm_loads_the_plugin_and_it_sets_the_idle_spin_only_when_asked(value, expected):
    env = {k: v for k, v in os.environ.items() if k != IDLE_SPIN_ENV}
    if value is not None:
        env[IDLE_SPIN_ENV] = value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [float(x) for x in out.stdout.strip().splitlines()[-1].split()] == expected


def test_engine_spec_takes_the_rollout_setting():
    from async_vapo.config import load_config

    cfg = load_config([], ["rollout.idle_spin_s=0.01"])
    assert EngineSpec.from_config(cfg, "m", longest_prompt=10).idle_spin_s == 0.01
    vllm_default = load_config([], ["rollout.idle_spin_s=null"])
    assert EngineSpec.from_config(vllm_default, "m", longest_prompt=10).idle_spin_s is None
