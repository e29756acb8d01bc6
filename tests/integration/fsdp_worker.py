"""The ranks of tests/integration/test_data_parallel.py, launched once by torchrun (gloo, 2 CPU ranks). Each
scenario saves what rank r ended with to ``OUT/<scenario>.<r>``; the test compares it with one process.

    torchrun --nproc_per_node 2 tests/integration/fsdp_worker.py CACHE_DIR OUT_DIR [SCENARIO]

With SCENARIO (one of ``SCENARIOS``) only that update is run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from conftest import FAST  # noqa: E402

from async_vapo.config import load_config  # noqa: E402

# two decoder layers, so that per-layer sharding has more than one unit
SHARD = FAST + ["base_model.num_layers=2"]
SCENARIOS = {
    "vapo": [],
    "grpo": ["algo.name=grpo"],
    "offload": ["learner.cpu_offload=true", "learner.activation_checkpointing=true"],
    "budget": ["algo.max_tokens_per_micro_batch=64", "learner.logprob_chunk_tokens=5", "learner.packing=true"],
    # the critic on a schedule of its own (mini-batches of 4, 2 passes) with its head in a param group of its own
    "critic": ["algo.critic_mini_batch_size=4", "algo.critic_epochs=2", "optim.critic_head_lr=1e-2"],
    # LoRA adapters on the policy and on the critic's trunk, sharded with their frozen bases
    "lora": ["model.lora.rank=4", "model.critic_lora.rank=4", "optim.actor_lr=1e-2", "optim.critic_lr=1e-2"],
}


def cfg_for(cache: str, extra: list[str]):
    return load_config([], SHARD + [f"model.cache_dir={cache}", *extra])


def launch_two_ranks(tmp_path_factory, worker: str, *args, name: str = "ranks", timeout: float = 600):
    """A test module's one torchrun launch of ``worker`` on two ranks, ``CACHE_DIR OUT_DIR *args``: the model cache
    built once before the ranks start (they would race to build it), a fresh output folder; returns both."""
    from conftest import torchrun_two_ranks

    from async_vapo.models.base_model import ensure_base_model

    cache, out = tmp_path_factory.mktemp("cache"), tmp_path_factory.mktemp(name)
    ensure_base_model(cfg_for(str(cache), []), progress=False)
    torchrun_two_ranks(worker, cache, out, *args, timeout=timeout)
    return cache, out


def learner_state(learner) -> dict[str, torch.Tensor]:
    """Full float32 weights of policy (and critic), on every rank (a collective when sharded)."""
    from async_vapo.learner.sharding import full_state_dict

    out = {f"policy.{k}": v.clone() for k, v in full_state_dict(learner.policy).items()}
    if learner.critic is not None:
        out |= {f"critic.{k}": v.clone() for k, v in full_state_dict(learner.critic).items()}
    return out


def updates(cfg, n: int = 2, resume: str | None = None, save_after: str | None = None):
    """``n`` updates on the test groups (from a checkpoint with ``resume``; saving one after the first update
    with ``save_after``): (final weights, per-update metrics)."""
    from conftest import _groups
    from transformers import AutoTokenizer

    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.base_model import ensure_base_model

    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    learner = Learner(cfg, base)
    if resume:
        learner.load_state(resume)
    metrics = []
    for k in range(n):
        metrics.append(learner.update(make_rollout_batch(_groups(tok), tok.pad_token_id)))
        if save_after and k == 0:
            learner.save(save_after, extra={"cursor": 7})
    return learner_state(learner), metrics, learner


class ListSource:
    """Rank 0's source for the loop scenario: one informative and one all-equal group per call, so that dynamic
    sampling asks twice per update."""

    def __init__(self, tok):
        from conftest import _groups

        self.groups = _groups(tok)
        self.calls = 0

    def next_groups(self, n):
        import msgspec

        self.calls += 1
        flat = [msgspec.structs.replace(self.groups[1], uid=f"flat{self.calls}",
                                        samples=[msgspec.structs.replace(s, reward=1.0)
                                                 for s in self.groups[1].samples])]
        return [msgspec.structs.replace(self.groups[0], uid=f"g{self.calls}")] + flat, {"time/source_s": 0.0}

    def row_metrics(self, kept, version):
        return {}

    def state(self):
        return {"calls": self.calls}

    def restore(self, state):
        self.calls = state.get("calls", 0)

    def close(self):
        pass


LOOP = ["algo.dynamic_sampling=true", "train.total_steps=3", "train.checkpoint_every=2"]


def run_loop(cfg, run_dir: Path, world: int) -> tuple[dict[str, torch.Tensor], int, int]:
    """The step loop over ``ListSource`` (rank 0's, broadcast): (final weights, version, steps)."""
    from transformers import AutoTokenizer

    from async_vapo.learner.loop import BroadcastSource, StepLoop
    from async_vapo.learner.vapo import Learner
    from async_vapo.metrics.jsonl import JsonlWriter
    from async_vapo.models.base_model import ensure_base_model

    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    rank = dist.get_rank() if world > 1 else 0
    learner = Learner(cfg, base)
    source = BroadcastSource(ListSource(tok) if rank == 0 else None, world)
    writer = JsonlWriter(run_dir / "metrics.jsonl") if rank == 0 else None
    loop = StepLoop(cfg, learner, source, pad_id=tok.pad_token_id, run_dir=run_dir, log_writer=writer,
                    leader=rank == 0)
    loop.run()
    return learner_state(learner), learner.version, loop.step


def assert_sharded(learner) -> None:
    """Every parameter is a DTensor of which this rank holds about half."""
    from torch.distributed.tensor import DTensor

    for model in filter(None, (learner.policy, learner.critic)):
        params = list(model.parameters())
        assert all(isinstance(p, DTensor) for p in params)
        local, full = sum(p.to_local().numel() for p in params), sum(p.numel() for p in params)
        assert local <= 0.55 * full, (local, full)


def main() -> None:
    cache, out = sys.argv[1], Path(sys.argv[2])
    only = sys.argv[3] if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for name, extra in SCENARIOS.items():
            if only not in (None, name):
                continue
            state, metrics, learner = updates(cfg_for(cache, extra))
            assert_sharded(learner)
            # a LoRA version: its adapter alone, gathered on every rank (a collective)
            adapter = learner.publish_state() if learner.lora is not None else None
            torch.save((state, metrics) + ((adapter,) if adapter is not None else ()), out / f"{name}.{rank}")
        if only:
            # no rank leaves while another still needs the group: under torchrun agents on two "nodes", the first
            # agent to exit closes the rendezvous store, and a worker still talking to it aborts (SIGABRT)
            dist.barrier()
            return
        # DCP: save after one update on 2 ranks, then the next update from it on 2 ranks
        cfg = cfg_for(cache, [])
        state, metrics, _ = updates(cfg, save_after=str(out / "ckpt"))
        torch.save((state, metrics), out / f"through_ckpt.{rank}")
        state, metrics, learner = updates(cfg, n=1, resume=str(out / "ckpt"))
        torch.save((state, metrics, learner.version), out / f"resumed2.{rank}")
        torch.save(run_loop(cfg_for(cache, LOOP), out / "run", 2), out / f"loop.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Every result is on disk and the group is destroyed: leave without the interpreter's teardown, in which gloo's
    # worker threads can still release tensors that need the GIL and abort the rank (SIGABRT, "terminate called
    # without an active exception"), about one run in a few dozen here; an exception above still exits non-zero.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
