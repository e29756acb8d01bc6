"""A version as its LoRA adapter, on the real engine: the learner publishes the adapter alone (a PEFT directory on
tmpfs, ``weights.adapter``), the engine loads it through ``receive.load_announced`` and vLLM's LoRA support, and
serves exactly the learner's policy; in continuous generation a group keeps the adapter it started with while newer
ones load. The session's LoRA engine (tests/conftest.py's ``lora_engine``)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import assert_engine_serves
from transformers import AutoTokenizer

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def learner(tiny_cfg, tiny_base):
    from async_vapo.learner.vapo import Learner

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.model.lora.rank, cfg.model.lora.alpha = 4, 8.0
    return Learner(cfg, tiny_base)


def set_adapter(learner, seed: int) -> dict[str, torch.Tensor]:
    """Random non-zero B matrices (a fresh adapter is the base model); returns the policy's state to restore it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return {k: v.clone() for k, v in learner.policy.state_dict().items()}


def push(engine, publisher, learner, version: int) -> str:
    from async_vapo.weights.receive import load_announced

    a = publisher.publish(version, learner.adapter_state())
    return engine.apply_weights(version, lambda: load_announced(
        engine, a, transport=None, mode="auto", fetch_endpoint="", chunk_bytes=0, timeout_s=60.0, engine_id="e0",
        max_bytes=0))


def assert_logprobs(policy, tok, prompt_ids, samples, atol=1e-3):
    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import make_token_batch, response_logits

    for s in samples:
        batch = make_token_batch([prompt_ids], [s.token_ids], tok.pad_token_id)
        with torch.no_grad():
            lp = logprobs_from_logits(response_logits(policy, batch), batch.response_ids)[0]
        torch.testing.assert_close(lp, torch.tensor(s.logprobs), atol=atol, rtol=0)


def test_after_a_push_the_engine_serves_the_new_adapter(lora_engine, learner, tiny_base, tmp_path):
    from async_vapo.models.lora import ADAPTER_WEIGHTS
    from async_vapo.models.rl import load_policy
    from async_vapo.weights.adapter import AdapterPublisher

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    publisher = AdapterPublisher(tmp_path / "adapters", learner.lora, keep=2)
    set_adapter(learner, seed=1)
    assert push(lora_engine, publisher, learner, 1) == "adapter"
    assert lora_engine.version == 1
    assert_engine_serves(lora_engine, learner.policy, tok)
    with pytest.raises(AssertionError):  # not trivially: the adapter moved the policy off the base
        assert_engine_serves(lora_engine, load_policy(tiny_base), tok)
    nbytes = (publisher.dirs[-1] / ADAPTER_WEIGHTS).stat().st_size
    full = sum(v.numel() * v.element_size() for v in learner.policy_state().values())
    assert nbytes < full / 5  # the adapter, not the weights
    # the next version replaces it; an adapter whose bytes do not match its announce is refused
    set_adapter(learner, seed=2)
    push(lora_engine, publisher, learner, 2)
    assert_engine_serves(lora_engine, learner.policy, tok)
    a = publisher.publish(3, learner.adapter_state())
    with open(os.path.join(a.location, ADAPTER_WEIGHTS), "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    from async_vapo.weights.receive import load_announced

    with pytest.raises(ValueError, match="does not match its announce"):
        load_announced(lora_engine, a, transport=None, mode="auto", fetch_endpoint="", chunk_bytes=0, timeout_s=60.0,
                       engine_id="e0", max_bytes=0)
    assert lora_engine.version == 2
    publisher.close()


def test_a_group_keeps_the_adapter_it_started_with(lora_engine, learner, tiny_base, tmp_path):
    """Group a starts under version 11; version 12 loads while a runs (no pause); group b starts under 12. Each
    finishes with its own version's log-probs and spans, and version 11's adapter is retired once a is done."""
    from async_vapo.weights.adapter import AdapterPublisher

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    publisher = AdapterPublisher(tmp_path / "adapters", learner.lora, keep=2)
    v11 = set_adapter(learner, seed=11)
    push(lora_engine, publisher, learner, 11)
    prompt = tok("7+8-2=").input_ids
    args = dict(n=8, temperature=1.0, top_p=1.0, max_tokens=200, stop_token_ids=[], seed=5,
                ignore_eos=True)
    lora_engine.submit("a", prompt, **args)
    v12 = set_adapter(learner, seed=12)
    push(lora_engine, publisher, learner, 12)
    assert lora_engine.update_stats[-1].in_flight > 0, "group a finished before version 12 loaded: nothing tested"
    assert lora_engine.update_stats[-1].pause_s == 0.0
    lora_engine.submit("b", prompt, **args)
    got = {}
    while len(got) < 2:
        for fg in lora_engine.finished(timeout_s=120.0):
            assert fg.error is None, fg.error
            got[fg.key] = fg
    assert {s.version_spans[0][0] for s in got["a"].samples} == {11}
    assert {s.version_spans[0][0] for s in got["b"].samples} == {12}
    shapes = [(len(s.version_spans), len(s.token_ids), s.finish_reason) for fg in got.values() for s in fg.samples]
    assert set(shapes) == {(1, 200, "length")}, shapes
    learner.policy.load_state_dict(v12)
    assert_logprobs(learner.policy, tok, prompt, got["b"].samples)
    with pytest.raises(AssertionError):  # a's tokens are not version 12's
        assert_logprobs(learner.policy, tok, prompt, got["a"].samples)
    learner.policy.load_state_dict(v11)
    assert_logprobs(learner.policy, tok, prompt, got["a"].samples)
    import time

    deadline = time.monotonic() + 10
    while set(lora_engine._adapters.values()) != {12} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(lora_engine._adapters.values()) == {12}  # 11 retired once no group used it
    publisher.close()


def test_a_lora_training_run_pushes_adapters_and_its_checkpoint_loads_in_peft(lora_engine, tiny_cfg, tiny_base,
                                                                             tmp_path):
    """The one-process trainer with model.lora on a LoRA engine: each version reaches the engine as its adapter, and
    the final checkpoint's PEFT directory, loaded by peft over the base model outside our code, is exactly the policy
    the engine serves; vLLM loads that directory, and the export of the checkpoint, through a LoRARequest each."""
    import json

    from peft import PeftModel

    from async_vapo.models.rl import load_policy
    from async_vapo.trainer import train

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.model.lora.rank, cfg.model.lora.alpha = 4, 8.0
    cfg.train.name = "lora-run"
    summary = train(cfg, progress=False, engine=lora_engine)
    assert lora_engine.version == 3 == summary["steps"]
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    ckpt = cfg.run_dir() / "checkpoints" / "step_3"
    assert not (ckpt / "policy").exists()
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = PeftModel.from_pretrained(load_policy(tiny_base), str(ckpt / "policy_adapter")).eval()
    assert_engine_serves(lora_engine, policy, tok)
    with pytest.raises(AssertionError):  # the adapter learned something: the engine no longer serves the base
        assert_engine_serves(lora_engine, load_policy(tiny_base), tok)
    # vLLM loads the checkpoint's own directory and async-vapo export's output as they are (a LoRARequest of each)
    from async_vapo.learner.export import export

    for version, directory in ((100, ckpt / "policy_adapter"), (101, export(ckpt, tmp_path / "exported"))):
        lora_engine.apply_weights(version, lambda d=directory, v=version: lora_engine.load_adapter(str(d), v))
        assert_engine_serves(lora_engine, policy, tok)


def test_whole_weights_on_a_lora_engine_replace_the_adapter(lora_engine, learner, tiny_base):
    """A LoRA engine also loads whole (merged) weights, as the cluster's learner service publishes them: requests
    then run on those weights with no adapter over them."""
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    set_adapter(learner, seed=21)
    lora_engine.apply_weights(21, lambda: lora_engine.load_weights(learner.policy_state(), 21))
    assert lora_engine.version == 21 and lora_engine._lora is None
    assert lora_engine.update_stats[-1].mode == lora_engine.weight_update  # a whole load pauses, an adapter's not
    assert_engine_serves(lora_engine, learner.policy, tok)


def test_a_lora_run_served_merged_loads_whole_weights_into_an_engine_without_lora(vllm_engine, tiny_cfg, tiny_base,
                                                                                 tmp_path):
    """``model.lora.serve = "merged"``: the one-process trainer trains the adapter alone, and each version reaches an
    engine started without LoRA (the session's plain engine) as the merged weights; after the run that engine serves
    exactly the policy of the final checkpoint's adapter over the base, loaded by peft outside our code."""
    import json

    from peft import PeftModel

    from async_vapo.models.rl import load_policy
    from async_vapo.trainer import train

    cfg = tiny_cfg.model_copy(deep=True)
    cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.serve = 4, 8.0, "merged"
    cfg.train.name = "lora-merged-run"
    assert vllm_engine.spec.max_lora_rank == 0
    summary = train(cfg, progress=False, engine=vllm_engine)
    assert vllm_engine.version == 3 == summary["steps"]
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    assert [r["version"] for r in rows if r["kind"] == "train"] == [1, 2, 3]
    ckpt = cfg.run_dir() / "checkpoints" / "step_3"
    assert (ckpt / "policy_adapter").is_dir() and not (ckpt / "policy").exists()  # the adapter is what is kept
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = PeftModel.from_pretrained(load_policy(tiny_base), str(ckpt / "policy_adapter")).eval()
    assert_engine_serves(vllm_engine, policy, tok)
    base = load_policy(tiny_base)
    with pytest.raises(AssertionError):  # the adapter learned something: the engine no longer serves the base
        assert_engine_serves(vllm_engine, base, tok)
    # async-vapo eval of the checkpoint (and of the run's, which lists it): its adapter merged into the base, loaded
    # into the plain engine
    from async_vapo.evaluation import resolve_target, run_checkpoints, run_eval

    assert run_checkpoints(cfg.run_dir())[-1] == (3, ckpt / "policy_adapter")
    run_cfg, target, _ = resolve_target(str(ckpt), [], [])
    assert target == ckpt / "policy_adapter"
    vllm_engine.apply_weights(0, lambda: vllm_engine.load_weights(base.state_dict(), version=0))
    result = run_eval(run_cfg, target, out_dir=tmp_path / "eval", limit=8, engine=vllm_engine, progress=False)
    assert result["problems"] == 8 and 0 <= result["metrics"]["eval/accuracy"] <= 1
    assert_engine_serves(vllm_engine, policy, tok)  # what it evaluated: step 3's adapter, merged
    vllm_engine.apply_weights(0, lambda: vllm_engine.load_weights(base.state_dict(), version=0))  # other tests share it
