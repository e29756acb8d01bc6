"""Data-parallel learner ranks (torch.distributed, gloo on CPU): two ranks that each take half of every
mini-batch's micro-batches and all-reduce their gradients make exactly the single-process update, and every
rank runs the one step loop on the groups rank 0's source returns."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import FAST, _groups

from async_vapo.config import load_config
from async_vapo.models.base import ensure_base_model
from async_vapo.models.rl import load_policy


def _update(cfg, base) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    from transformers import AutoTokenizer

    from async_vapo.learner.vapo import Learner, make_rollout_batch

    tok = AutoTokenizer.from_pretrained(str(base))
    learner = Learner(cfg, base)
    metrics = [learner.update(make_rollout_batch(_groups(tok), tok.pad_token_id)) for _ in range(2)]
    state = {f"policy.{k}": v.clone() for k, v in learner.policy.state_dict().items()}
    state |= {f"critic.{k}": v.clone() for k, v in learner.critic.state_dict().items()}
    return state, metrics


def _rank(rank: int, world: int, init: str, cfg, base, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_update(cfg, base), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_make_the_single_process_update(tmp_path):
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}"])
    base = ensure_base_model(cfg, progress=False)
    single, single_metrics = _update(cfg, base)
    mp.spawn(_rank, args=(2, f"file://{tmp_path}/store", cfg, base, str(tmp_path / "state")), nprocs=2, join=True)
    (r0, m0), (r1, m1) = torch.load(tmp_path / "state.0"), torch.load(tmp_path / "state.1")
    # Gradient norms before clipping (one mini-batch per update): the summed gradient is the whole batch's, not
    # half of it or twice it (Adam would hide a scale error in the parameters, the norm does not).
    for a, b, c in zip(single_metrics, m0, m1, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert b[key] == c[key]
            assert abs(b[key] - a[key]) <= 1e-5 * a[key], (key, a[key], b[key])
    moved = 0
    initial = {f"policy.{k}": v for k, v in load_policy(base).state_dict().items()}
    for k, v in single.items():
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0)  # the ranks stay identical replicas
        torch.testing.assert_close(r0[k], v, rtol=1e-4, atol=1e-5)  # and equal to one process doing it all
        if k in initial and not torch.equal(initial[k], v):
            moved += 1
    assert moved > 0  # the update changed the policy, so the comparison above is not vacuous


class _ListSource:
    """Rank 0's source for the loop test: one informative and one all-equal group per call, so that dynamic
    sampling asks twice per update."""

    def __init__(self, tok):
        self.groups = _groups(tok)
        self.calls = 0

    def next_groups(self, n):
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


def _loop(cfg, base, run_dir: str, world: int) -> tuple[dict[str, torch.Tensor], int, int]:
    from transformers import AutoTokenizer

    from async_vapo.learner.loop import BroadcastSource, StepLoop
    from async_vapo.learner.vapo import Learner
    from async_vapo.metrics.jsonl import JsonlWriter

    tok = AutoTokenizer.from_pretrained(str(base))
    rank = dist.get_rank() if world > 1 else 0
    learner = Learner(cfg, base)
    source = BroadcastSource(_ListSource(tok) if rank == 0 else None, world)
    writer = JsonlWriter(Path(run_dir) / "metrics.jsonl") if rank == 0 else None
    loop = StepLoop(cfg, learner, source, pad_id=tok.pad_token_id, run_dir=Path(run_dir), log_writer=writer,
                    leader=rank == 0)
    loop.run()
    state = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    return state, learner.version, loop.step


def _loop_rank(rank: int, world: int, init: str, cfg, base, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.save(_loop(cfg, base, str(Path(out).parent / "run"), world), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_every_rank_runs_the_step_loop_on_rank_0s_groups(tmp_path):
    """One loop on every rank: rank 0's source is broadcast (dynamic sampling asks it twice per update), rank 1
    follows until rank 0 decides the run is done, and both end where one process running the loop ends."""
    cfg = load_config([], FAST + [f"model.cache_dir={tmp_path}", "algo.dynamic_sampling=true", "train.total_steps=3",
                                  "train.checkpoint_every=0"])
    base = ensure_base_model(cfg, progress=False)
    single, version, steps = _loop(cfg, base, str(tmp_path / "single"), 1)
    assert (version, steps) == (3, 3)
    rows = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_kept"] for r in rows] == [2, 2, 2] and all(r["time/source_s"] == 0.0 for r in rows)
    mp.spawn(_loop_rank, args=(2, f"file://{tmp_path}/store", cfg, base, str(tmp_path / "loop" / "state")),
             nprocs=2, join=True)
    (s0, v0, n0), (s1, v1, n1) = (torch.load(tmp_path / "loop" / f"state.{r}") for r in (0, 1))
    assert (v0, n0) == (v1, n1) == (3, 3)
    for k, v in single.items():
        torch.testing.assert_close(s0[k], s1[k], rtol=0, atol=0)
        torch.testing.assert_close(s0[k], v, rtol=1e-4, atol=1e-5)
    assert len((tmp_path / "loop" / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # rank 0 writes rows
