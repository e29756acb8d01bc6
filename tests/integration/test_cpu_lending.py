"""Cores follow the work on a CPU host (``cluster.deploy.lend_cpus``, issue 46 item 1): start_cluster.sh lets the
learner run on every core with its own share as ``train.threads``, and the learner's forwards (and the backward
after each) run on every core while every engine in rotation says it has nothing to generate, on its own share
again once one generates.

Real parts: the learner service (``LearnerService``, its weight broadcast and its models), the rollout service's
weight client on the session's vLLM engine (tests/conftest.py), the in-process transport; the dry run of
deploy/start_cluster.sh for the affinity it gives. About 20 s beside the session's engine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TINY_TEST_OVERRIDES

from async_vapo.config import load_config
from async_vapo.services.context import make_context

REPO = Path(__file__).resolve().parents[2]
NCPU = len(os.sched_getaffinity(0))


def _until(what, step, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        step()


@pytest.mark.slow
@pytest.mark.skipif(NCPU < 2, reason="lending needs two cores")
def test_the_learner_takes_the_engines_cores_while_every_engine_waits(tiny_cfg, tiny_base, vllm_engine, tmp_path):
    import torch
    from transformers import AutoTokenizer

    from async_vapo.services.learner import LearnerService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    threads_before = torch.get_num_threads()
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.threads=1",
                           "cluster.deploy.lend_cpus=true",
                           "cluster.weights.transfer=shm", f"cluster.weights.dir={tmp_path / 'w'}",
                           "cluster.wire.heartbeat_s=0.1"])
    ctxs = {s: make_context(s, cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
            for s in ("learner", "rollout")}
    transport = InprocTransport()
    learner = LearnerService(ctxs["learner"], transport)
    sync = learner.sync
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    state = learner.learner.policy_state()
    vllm_engine.load_weights(state, 0)
    train_set, eval_set = load_task(cfg)
    rollout = RolloutService(ctxs["rollout"], transport, vllm_engine, tok, train_set, eval_set, pretrain_batches=1)
    ids = torch.tensor([tok("12+7=")["input_ids"]])

    def forward(backbone_only: bool = False) -> int:
        policy = learner.learner.policy
        with torch.no_grad():  # the chunked log-probs' path calls the backbone without the outer model
            (getattr(policy, policy.base_model_prefix) if backbone_only else policy)(ids)
        return torch.get_num_threads()

    try:
        assert learner.lend == (1, NCPU)
        rollout.weights.start()
        learner.publish(1, state)
        _until(lambda: vllm_engine.version == 1 and rollout.engine_id in sync.rotation.members,
               lambda: (rollout.weights.poll(0.05), sync.poll(0.05)))
        rollout.weights.waiting(False)  # it generates
        sync.poll(0.2)
        assert forward() == 1
        rollout.weights.waiting(True)  # its budget is spent
        _until(sync.engines_idle, lambda: sync.poll(0.05))
        assert forward() == NCPU, "the learner did not take the waiting engine's cores"
        torch.set_num_threads(1)
        assert forward(backbone_only=True) == NCPU, "a forward of the backbone alone did not take them"
        rollout.weights.waiting(False)
        _until(lambda: not sync.engines_idle(), lambda: sync.poll(0.05))
        assert forward() == 1, "the learner kept the cores of an engine that generates"
        assert learner._row_extra()["cluster/lent_forward_frac"] == pytest.approx(2 / 4)
    finally:
        torch.set_num_threads(threads_before)
        rollout.close()
        learner.close()
        transport.close()


def _dry_run(tmp_path, *overrides) -> dict[str, str]:
    """deploy/start_cluster.sh --dry-run on this machine: each process's ``taskset -c`` cores and its command."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config",
                        str(REPO / "configs" / "tiny_cpu.toml"), "--run-dir", str(tmp_path / "run"), "--dry-run",
                        "--", *overrides], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return {line.split("\t")[0]: line.split("\t", 2)[2] for line in r.stdout.splitlines() if "\t" in line}


@pytest.mark.skipif(NCPU < 2 or not shutil.which("taskset") or shutil.which("nvidia-smi") is not None,
                    reason="CPU pinning needs a machine without GPUs, taskset and two cores")
def test_start_cluster_lets_the_learner_run_on_every_core_of_a_cpu_host(tmp_path):
    plan = _dry_run(tmp_path, "cluster.deploy.lend_cpus=true")
    last = NCPU - 1
    r = NCPU * 1 // 2  # tiny_cpu: one engine (continuous generation), one learner rank
    # and back: the one continuous engine on every core, its own share as its threads
    assert plan["rollout-0"].startswith(f"taskset -c 0-{last} ")
    assert plan["rollout-0"].endswith(f"'cluster.rollout.engine_threads={r}'")
    assert plan["learner"].startswith(f"taskset -c 0-{last} ") and f"train.threads={NCPU - r}" in plan["learner"]
    plan = _dry_run(tmp_path, "cluster.deploy.lend_cpus=true", "rollout.generation=lockstep")
    assert plan["rollout-0"].startswith(f"taskset -c 0-{r - 1} ") and "engine_threads" not in plan["rollout-0"]
    assert plan["learner"].startswith(f"taskset -c 0-{last} ")
    plan = _dry_run(tmp_path)  # the default: disjoint cores, as before
    assert plan["learner"].startswith(f"taskset -c {r}-{last} ") and "train.threads=" not in plan["learner"]


@pytest.mark.slow
@pytest.mark.skipif(NCPU < 2, reason="lending needs two cores")
def test_the_engine_takes_the_learners_cores_while_the_learner_waits(tiny_cfg, tiny_base, continuous_engine,
                                                                     tmp_path):
    """The other way: the rollout service hears the learner's heartbeats (the real learner's weight broadcast) and its
    continuous engine's forwards run on every core while the learner waits for a batch, on its own share while it
    works; the forwards run in the thread that sets the count (vLLM's worker loop)."""
    from transformers import AutoTokenizer

    from async_vapo.services.learner import LearnerService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.threads=1",
                           "cluster.deploy.lend_cpus=true", "cluster.rollout.engine_threads=1",
                           "rollout.generation=continuous",
                           "cluster.weights.transfer=shm", f"cluster.weights.dir={tmp_path / 'w'}",
                           "cluster.wire.heartbeat_s=30"])  # only a wait that starts or ends is heard in time
    ctxs = {s: make_context(s, cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
            for s in ("learner", "rollout")}
    transport = InprocTransport()
    learner = LearnerService(ctxs["learner"], transport)
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    continuous_engine.load_weights(learner.learner.policy_state(), 0)
    train_set, eval_set = load_task(cfg)
    threads_before = continuous_engine.set_threads(0).result(30)[0]  # the session's engine's, to restore
    rollout = RolloutService(ctxs["rollout"], transport, continuous_engine, tok, train_set, eval_set,
                             pretrain_batches=1)
    ids = tok("12+7=")["input_ids"]

    def forward_threads() -> tuple[int, int]:
        continuous_engine.generate([ids], n=1, temperature=1.0, top_p=1.0, max_tokens=2, stop_token_ids=[])
        return tuple(continuous_engine._collective_rpc("async_vapo_forward_threads", timeout=30)[0])

    def heard(waiting_s: float) -> None:
        learner.sync.heartbeat(learner.learner.version, waiting_s=waiting_s)
        _until(lambda: rollout._threads_now == (NCPU if waiting_s > 0 else 1),
               lambda: rollout.weights.poll(0.05), timeout_s=10)
        continuous_engine.set_threads(0).result(30)  # the count is applied: the next forward runs with it

    try:
        assert rollout.engine_threads == (1, NCPU)
        continuous_engine._collective_rpc("async_vapo_forward_threads", timeout=30)  # its hook
        rollout.weights.start()
        assert forward_threads() == (1, 1), "the engine did not start on its own share"
        heard(2.0)  # the learner waits for a batch
        assert forward_threads() == (1, NCPU), "the engine did not take the waiting learner's cores"
        assert ctxs["rollout"].metrics.get("engine_threads")._value.get() == NCPU
        heard(0.0)  # it works again
        assert forward_threads() == (1, 1), "the engine kept the cores of a learner that works"
        lent = [ln for ln in (tmp_path / "run" / "stats" / "rollout-0.busy.jsonl").read_text().splitlines()
                if "engine_lent" in ln]
        assert len(lent) == 1, "the engine's time on the learner's cores is not in its busy log"
    finally:
        continuous_engine.set_threads(threads_before).result(30)  # the session's engine as it was
        rollout.close()
        learner.close()
        transport.close()
