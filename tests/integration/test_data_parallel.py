"""Data-parallel learner ranks on torch's own machinery: one torchrun launch of two gloo CPU ranks
(``fsdp_worker.py``), each model sharded per decoder layer with FSDP2 and its weights loaded once by rank 0,
every rank computing its share of each mini-batch (the old-log-prob and value forwards included). The two
ranks make the one-process update (gradient norms and weights), for VAPO with its critic and for GRPO, with
token-budget micro-batches, packing and chunked log-probs too; a checkpoint the two ranks write with
torch.distributed.checkpoint resumes on two ranks and on one to the same next step; and every rank runs the
one step loop on the groups rank 0's source returns.

Tolerances: gradient norms 1e-5 relative (measured ~1e-7: the same sums in another order), weights after
two AdamW steps at lr 1e-2 atol 2e-5 (measured ~5e-6)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fsdp_worker import LOOP, SCENARIOS, cfg_for, launch_two_ranks, run_loop, updates  # noqa: E402

from async_vapo.models.base_model import ensure_base_model  # noqa: E402
from async_vapo.models.rl import load_policy  # noqa: E402

GRAD_RTOL, W_ATOL = 1e-5, 2e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The two ranks' results (one torchrun launch for the module) and the model cache they used."""
    cache, out = launch_two_ranks(tmp_path_factory, "fsdp_worker.py", timeout=900)
    return str(cache), out


def _load(out: Path, name: str) -> tuple:
    return tuple(torch.load(out / f"{name}.{r}", weights_only=False) for r in (0, 1))


def _assert_same_update(single, single_metrics, r0, m0, m1, base) -> None:
    # Gradient norms before clipping (one mini-batch per update): the summed gradient is the whole batch's, not
    # half of it or twice it (Adam would hide a scale error in the parameters, the norm does not).
    checked = 0
    for a, b, c in zip(single_metrics, m0, m1, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            if key in a:
                assert b[key] == c[key]  # every rank reports the whole model's norm
                assert abs(b[key] - a[key]) <= GRAD_RTOL * a[key], (key, a[key], b[key])
                checked += 1
    assert checked >= 2
    initial = {f"policy.{k}": v for k, v in load_policy(base).state_dict().items()}
    assert r0.keys() == single.keys()
    moved = 0
    for k, v in single.items():
        torch.testing.assert_close(r0[k], v, rtol=0, atol=W_ATOL)
        moved += k in initial and not torch.equal(initial[k], v)
    assert moved > 0  # the update changed the policy, so the comparison is not vacuous


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "lora"])
def test_two_fsdp2_ranks_make_the_single_process_update(ranks, scenario):
    """vapo: policy and critic; grpo: policy alone; offload: sharded state in host memory (CPUOffloadPolicy) and
    activation checkpointing; critic: the critic's own mini-batches, epochs and head lr; budget: token-budget
    micro-batches balanced across the ranks
    (``algo.max_tokens_per_micro_batch``), packed without padding, log-probs from hidden states in chunks,
    against one process with padded micro-batches of 2 sequences and full logits."""
    cache, out = ranks
    cfg = cfg_for(cache, SCENARIOS[scenario])
    single, single_metrics, _ = updates(cfg_for(cache, SCENARIOS[scenario] if scenario in ("grpo", "critic") else []))
    (r0, m0), (_, m1) = _load(out, scenario)
    _assert_same_update(single, single_metrics, r0, m0, m1, ensure_base_model(cfg, progress=False))


def test_two_fsdp2_lora_ranks_make_the_single_process_update_and_publish_its_adapter(ranks):
    """LoRA on the policy and the critic's trunk, sharded over two ranks with their frozen bases: the same update as
    one process (grad norms and every tensor), the bases untouched, and the version each rank gathers for a publish
    is the adapter alone, the one-process learner's."""
    cache, out = ranks
    single, single_metrics, learner = updates(cfg_for(cache, SCENARIOS["lora"]))
    (r0, m0, adapter0), (_, m1, adapter1) = _load(out, "lora")
    for a, b, c in zip(single_metrics, m0, m1, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert b[key] == c[key] and abs(b[key] - a[key]) <= GRAD_RTOL * a[key], (key, a[key], b[key])
    assert r0.keys() == single.keys()
    for k, v in single.items():
        torch.testing.assert_close(r0[k], v, rtol=0, atol=W_ATOL)
    base = {f"policy.{k}": v for k, v in load_policy(ensure_base_model(cfg_for(cache, []), progress=False))
            .state_dict().items()}
    for k, v in base.items():  # the frozen base, under peft's names where a layer has an adapter
        mod, leaf = k.rsplit(".", 1)
        torch.testing.assert_close(r0[k] if k in r0 else r0[f"{mod}.base_layer.{leaf}"], v, rtol=0, atol=0)
    want = learner.adapter_state()
    assert adapter0.keys() == adapter1.keys() == want.keys()
    assert all(k.startswith("base_model.model.") and (".lora_A." in k or ".lora_B." in k) for k in want)
    for k, v in want.items():
        torch.testing.assert_close(adapter0[k], v, rtol=0, atol=W_ATOL)
        torch.testing.assert_close(adapter1[k], adapter0[k], rtol=0, atol=0)
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter0.items())  # the updates moved the adapter


def test_a_checkpoint_of_two_ranks_resumes_on_two_and_on_one(ranks):
    """DCP checkpoint after update 1 on two ranks; update 2 from it on two ranks and in one process equals update 2
    without the checkpoint."""
    cache, out = ranks
    (through, m_through), _ = _load(out, "through_ckpt")
    (resumed2, m2, version2), _ = _load(out, "resumed2")
    resumed1, m1, learner = updates(cfg_for(cache, []), n=1, resume=str(out / "ckpt"))
    assert version2 == learner.version == 2
    for k, v in through.items():
        torch.testing.assert_close(resumed2[k], v, rtol=0, atol=0)  # same ranks, same shards: bit for bit
        torch.testing.assert_close(resumed1[k], v, rtol=0, atol=W_ATOL)
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert m2[0][key] == m_through[1][key]
        assert abs(m1[0][key] - m_through[1][key]) <= GRAD_RTOL * m_through[1][key]


def test_every_rank_runs_the_step_loop_on_rank_0s_groups(ranks, tmp_path):
    """One loop on every rank: rank 0's source is broadcast (dynamic sampling asks it twice per update), rank 1
    follows until rank 0 decides the run is done, the sharded checkpoints are written by both, and both end where
    one process running the loop ends."""
    cache, out = ranks
    single, version, steps = run_loop(cfg_for(cache, LOOP), tmp_path / "single", 1)
    assert (version, steps) == (3, 3)
    rows = [json.loads(x) for x in (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()]
    assert [r["groups_kept"] for r in rows] == [2, 2, 2] and all(r["time/source_s"] == 0.0 for r in rows)
    (s0, v0, n0), (_, v1, n1) = _load(out, "loop")
    assert (v0, n0) == (v1, n1) == (3, 3)
    for k, v in single.items():
        torch.testing.assert_close(s0[k], v, rtol=0, atol=W_ATOL)
    assert len((out / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # rank 0 writes rows
    assert sorted(p.name for p in (out / "run" / "checkpoints").iterdir()) == ["step_2", "step_3"]


def test_export_of_a_two_rank_checkpoint_loads_in_transformers(ranks, tmp_path):
    """``async-vapo export`` of the checkpoint the two ranks wrote: transformers loads the policy and the critic, with
    the tokenizer, and they give the logits and values of a learner resumed from that checkpoint."""
    from conftest import _groups
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from async_vapo.cli import main as cli
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.rl import response_logits, response_values

    cache, out = ranks
    cfg = cfg_for(cache, [])
    base = ensure_base_model(cfg, progress=False)
    learner = Learner(cfg, base)
    learner.load_state(out / "ckpt")
    assert cli(["export", str(out / "ckpt"), str(tmp_path / "policy")]) == 0
    assert cli(["export", str(out / "ckpt"), str(tmp_path / "critic"), "--model", "critic"]) == 0
    policy = AutoModelForCausalLM.from_pretrained(str(tmp_path / "policy")).eval()
    critic = AutoModelForTokenClassification.from_pretrained(str(tmp_path / "critic")).eval()
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "policy"))
    batch = make_rollout_batch(_groups(tok), tok.pad_token_id).tokens
    mask = batch.response_mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(response_logits(policy, batch)[mask], response_logits(learner.policy, batch)[mask],
                                   rtol=0, atol=1e-6)
        values = response_values(critic, batch)[mask]
        torch.testing.assert_close(values, response_values(learner.critic, batch)[mask], rtol=0, atol=1e-6)
    assert values.abs().max() > 0  # the critic's head was trained away from zero: the check is not vacuous
    initial = load_policy(base).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in policy.state_dict().items())
