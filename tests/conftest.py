"""Shared fixtures. The vLLM engine is started once per test session and shared (it takes ~30 s)."""

from __future__ import annotations

import os
import random

import pytest

from async_vapo.config import load_config
from async_vapo.types import Group, Trajectory

ENGINE_FIXTURES = {"vllm_engine", "continuous_engine", "lora_engine"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the group marks into the node ids
def pytest_collection_modifyitems(config, items):
    """With pytest-xdist (``make test`` runs two workers, ``--dist loadgroup``): every test that starts engines,
    clusters or long runs (``slow``, ``engines``) or uses the session's shared engines runs on one worker, one after
    another, so the session's engines start once and no two engines or clusters compete for the two cores and the
    memory; the rest share the other worker's time. Without xdist the mark does nothing."""
    for item in items:
        if (item.get_closest_marker("slow") or item.get_closest_marker("engines")
                or ENGINE_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.xdist_group("engines"))
            if getattr(config.option, "loadgroup", False) and hasattr(item, "_id"):
                # pytest >= 9.2 derives nodeid from the structured ``_id``; pytest-xdist 3.8 appends the group to the
                # old ``_nodeid``, which no longer reaches the scheduler: append it where the node id is read
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(f"{item.nodeid}@engines")


# A small embedded model that still learns the format: built once per session into a temp cache.
TINY_TEST_OVERRIDES = [
    "base_model.hidden_size=64", "base_model.num_layers=2", "base_model.num_heads=2", "base_model.num_kv_heads=1",
    "base_model.intermediate_size=128", "base_model.sft_steps=60", "base_model.sft_batch_size=32",
    "base_model.sft_lr=1e-2",
    "task.num_train=300", "task.num_eval=24", "task.max_ops=3", "rollout.max_response_tokens=40",
    "algo.prompts_per_step=4", "algo.group_size=4", "algo.mini_batch_size=8", "algo.micro_batch_size=4",
    "algo.value_pretrain_steps=1", "algo.alpha=1.0", "optim.actor_lr=1e-3", "optim.critic_lr=1e-3",
    "rollout.kv_cache_gib=1", "train.total_steps=3", "train.eval_every=2", "train.checkpoint_every=2",
    "train.threads=1", "verifier.num_workers=1",
]


@pytest.fixture(scope="session")
def tiny_cfg(tmp_path_factory):
    cache = tmp_path_factory.mktemp("model-cache")
    run = tmp_path_factory.mktemp("runs")
    return load_config([], TINY_TEST_OVERRIDES + [f"model.cache_dir={cache}", f"train.output_dir={run}/{{name}}"])


@pytest.fixture(scope="session")
def tiny_base(tiny_cfg):
    from async_vapo.models.base_model import ensure_base_model

    return ensure_base_model(tiny_cfg, progress=False)


@pytest.fixture(scope="session")
def vllm_engine(tiny_base):
    """One real vLLM engine for the whole session, serving the tiny base model."""
    from async_vapo.rollout.engine import EngineSpec, VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(EngineSpec(model_path=str(tiny_base), max_model_len=128, kv_cache_gib=1))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def continuous_engine(tiny_base):
    """One ``ContinuousEngine`` (vLLM's async engine) for the session's continuous-generation tests, serving the tiny
    base model; each test sets the ``weight_update`` it needs and loads the weights it starts from."""
    from async_vapo.rollout.continuous import ContinuousEngine
    from async_vapo.rollout.engine import EngineSpec

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = ContinuousEngine(EngineSpec(model_path=str(tiny_base), max_model_len=256, kv_cache_gib=1))
    yield engine
    import gc
    import weakref

    llm = weakref.ref(engine.llm)
    engine.close()
    gc.collect()
    # nothing keeps vLLM's engine after close: else it shuts down again at the interpreter's exit, after the modules
    # it needs are gone ("Exception ignored in AsyncLLM.__del__" in every rollout service's log)
    assert llm() is None, "the closed engine's AsyncLLM is still referenced"


@pytest.fixture(scope="session")
def lora_engine(tiny_base):
    """One LoRA engine for the session (a ``ContinuousEngine``, whose ``generate`` serves the lock-step case too):
    ``max_lora_rank`` 8, up to 4 adapters at once. Tests that load whole weights into it leave them as its base."""
    from async_vapo.rollout.continuous import ContinuousEngine
    from async_vapo.rollout.engine import EngineSpec

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = ContinuousEngine(EngineSpec(model_path=str(tiny_base), max_model_len=256, kv_cache_gib=1,
                                         max_lora_rank=8, max_loras=4))
    yield engine
    engine.close()


def assert_engine_serves(engine, policy, tok, prompt="5+5-3=", temperature=1.0):
    """The engine's log-probs of its own samples (drawn at ``temperature``) equal the given policy's at that
    temperature: it serves exactly those weights. (Parameter checksums inside vLLM are no proof: the CPU backend
    repacks weights after loading.)"""
    import torch

    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import make_token_batch, response_logits

    ids = tok(prompt).input_ids
    samples = engine.generate([ids], n=4, temperature=temperature, top_p=1.0, max_tokens=30,
                              stop_token_ids=[tok.eos_token_id], seed=3)[0]
    for sample in samples:
        batch = make_token_batch([ids], [sample.token_ids], tok.pad_token_id)
        with torch.no_grad():
            lp = logprobs_from_logits(response_logits(policy, batch, temperature), batch.response_ids)[0]
        torch.testing.assert_close(lp, torch.tensor(sample.logprobs), atol=1e-3, rtol=0)


def push_over_group(group, engine, named, version, bucket_bytes):
    """Send ``named`` (name, tensor) as ``version`` over the engine's torch.distributed weight group (the learner's
    side, ``EngineGroup.send``, from a thread) while the engine receives it; returns the number of buckets sent."""
    import threading

    from async_vapo.weights.collective import plan_buckets, update_info, version_meta

    buckets = plan_buckets(version_meta(named), bucket_bytes)
    sent: dict = {}

    def send():
        try:
            sent["s"] = group.send(buckets, named)
        except BaseException as e:  # noqa: BLE001 - reported to the test thread
            sent["error"] = e

    th = threading.Thread(target=send)
    th.start()
    engine.receive_weights_dist(update_info(buckets, version), version)
    th.join()
    assert "error" not in sent, sent
    return len(buckets)


def join_group(engine, group):
    """The engine joins the learner's side's group (``EngineGroup.connect`` from a thread)."""
    import threading

    th = threading.Thread(target=group.connect)
    th.start()
    engine.join_weight_group(group.init_info)
    th.join()
    assert group.group is not None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` right now (the services bind 0.0.0.0 under --hostfile), drawn from
    below the kernel's ephemeral range: a port the kernel hands out (``bind`` to port 0) can be taken by another
    test's outgoing connection before a service binds it (seen: "Address already in use" at a replay's start)."""
    import socket
    from pathlib import Path

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pool = list(range(max(1024, low - 12000), low))
    random.shuffle(pool)
    ports: list[int] = []
    for port in pool:
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    raise RuntimeError(f"fewer than {n} free ports below {low} on {host}")


def torchrun_two_ranks(worker: str, *args: str, timeout: float = 600):
    """Run ``tests/integration/<worker>`` on 2 ranks under torchrun (standalone, one thread each, the repository
    on PYTHONPATH); returns the completed process, its return code asserted 0 (with the tail of stderr)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "tests" / "integration" / worker), *map(str, args)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


# A 1-layer model and two fixed groups for learner tests that need no engine (data-parallel, losses).
FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=2", "algo.group_size=4",
        "algo.mini_batch_size=8", "algo.micro_batch_size=2", "algo.value_pretrain_steps=0", "train.threads=1",
        "optim.actor_lr=1e-2", "optim.critic_lr=1e-2"]


def _groups(tok, rng: random.Random | None = None, behavior=lambda rng: -1.0) -> list[Group]:
    """Two groups of 4 short arithmetic responses, rewards alternating. ``behavior(rng)``: the engine's log-prob of
    each response token, drawn in turn (None: the engine reported none)."""
    rng = random.Random(0) if rng is None else rng
    groups = []
    for g in range(2):
        samples = []
        for k in range(4):
            text = f"{rng.randint(0, 9)}+{rng.randint(0, 9)}=" + "7" * rng.randint(1, 12)
            ids = tok(text).input_ids + [tok.eos_token_id]
            blp = [] if behavior is None else [behavior(rng) for _ in ids]
            samples.append(Trajectory(response_ids=ids, behavior_logprobs=blp, finish_reason="stop",
                                      reward=1.0 if k % 2 else -1.0, correct=bool(k % 2), verdict="x"))
        groups.append(Group(uid=f"g{g}", prompt="p", answer="7", prompt_ids=tok(f"{g}+1")["input_ids"], version=0,
                            samples=samples))
    return groups


class SourceBase:
    """The step loop's ``BatchSource`` for unit tests: a subclass gives ``next_groups``; the rest hold nothing."""

    def row_metrics(self, kept, version):
        return {}

    def state(self):
        return {}

    def restore(self, state):
        pass

    def close(self):
        pass
