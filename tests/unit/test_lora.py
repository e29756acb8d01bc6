"""LoRA on the policy (``model.lora``, ``models.lora``): the learner trains the adapter alone; its log-probs equal the
merged model's (padded, packed, chunked); a checkpoint resumes to the same next update; ``async-vapo export`` writes a
PEFT adapter directory that ``peft`` loads outside our code, and with ``--merge`` an ordinary HF model."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, SourceBase, _groups
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models import lora
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.rl import chunked_response_logprobs, response_logits

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "algo.name=grpo", "optim.actor_lr=1e-2"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


def make(cache, *overrides: str) -> tuple[Learner, object, str]:
    cfg = load_config([], FAST + [f"model.cache_dir={cache}", *LORA, *overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(0)
    return Learner(cfg, base), make_rollout_batch(_groups(tok), tok.pad_token_id), base


def randomise_b(learner: Learner, seed: int = 1) -> None:
    """Non-zero B matrices (a fresh adapter is the base model exactly, which would make every comparison trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in learner.policy.named_parameters():
            if ".lora_B." in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))


def logprobs(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        logits = response_logits(model, batch.tokens)
    return torch.log_softmax(logits, -1).gather(-1, batch.tokens.response_ids[..., None])[..., 0]


def test_only_the_adapter_trains(cache):
    learner, batch, base = make(cache)
    trainable = {n for n, p in learner.policy.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_opt = {id(p) for g in learner.actor_opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for n, p in learner.policy.named_parameters() if n in trainable}
    # every target linear layer of the decoder has an adapter
    assert len(trainable) == 2 * 7 * learner.policy.config.num_hidden_layers
    before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
    learner.update(batch)
    moved = {k for k, v in learner.policy.state_dict().items() if not torch.equal(before[k], v)}
    # B starts at zero, so A's first gradient is zero (dL/dA = B^T dL/dh x^T): only the B matrices move at first
    assert moved and all(".lora_B." in k for k in moved)
    learner.update(batch)
    moved = {k for k, v in learner.policy.state_dict().items() if not torch.equal(before[k], v)}
    assert all(".lora_" in k for k in moved) and any(".lora_A." in k for k in moved)


def test_logprobs_with_the_adapter_equal_the_merged_models(cache):
    learner, batch, base = make(cache)
    randomise_b(learner)
    ours = logprobs(learner.policy, batch)
    plain = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    base_lp = logprobs(plain, batch)
    assert (ours - base_lp).abs().max() > 1e-2  # the adapter changes the policy
    # our merge (what policy_state pushes to an engine without LoRA) ...
    merged = learner.policy_state()
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    torch.testing.assert_close(logprobs(plain, batch), ours, rtol=0, atol=2e-5)
    # ... and peft's own merge agree
    from peft import PeftModel

    d = lora.save_adapter(cache / "adapter-merge", learner.adapter_state(), learner.lora)
    fresh = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    peft_merged = PeftModel.from_pretrained(fresh, str(d)).merge_and_unload()
    torch.testing.assert_close(logprobs(peft_merged, batch), ours, rtol=0, atol=2e-5)


def test_packing_and_chunked_logprobs_work_with_the_adapter(cache):
    learner, batch, _ = make(cache)
    randomise_b(learner)
    tb = batch.tokens
    with torch.no_grad():
        padded = torch.log_softmax(response_logits(learner.policy, tb), -1)
        padded = padded.gather(-1, tb.response_ids[..., None])[..., 0]
        packed = torch.log_softmax(response_logits(learner.policy, tb, packed="mask"), -1)
        packed = packed.gather(-1, tb.response_ids[..., None])[..., 0]
        chunked, _ = chunked_response_logprobs(learner.policy, tb, chunk_tokens=7)
    m = tb.response_mask.bool()
    torch.testing.assert_close(packed[m], padded[m], rtol=0, atol=2e-5)
    torch.testing.assert_close(chunked[m], padded[m], rtol=0, atol=2e-5)
    # and a learner with packing and chunks trains: only the adapter moves
    packed_learner, batch, _ = make(cache, "learner.packing=true", "learner.logprob_chunk_tokens=16")
    before = {k: v.clone() for k, v in packed_learner.policy.state_dict().items()}
    packed_learner.update(batch)
    moved = {k for k, v in packed_learner.policy.state_dict().items() if not torch.equal(before[k], v)}
    assert moved and all(".lora_" in k for k in moved)


def test_a_lora_checkpoint_resumes_to_the_same_next_update(cache, tmp_path):
    learner, batch, base = make(cache)
    learner.update(batch)
    ckpt = learner.save(tmp_path / "ckpt")
    assert not (ckpt / "policy").exists() and (ckpt / "policy_adapter" / lora.ADAPTER_WEIGHTS).is_file()
    again = Learner(learner.cfg, base)  # the base model's directory, as a resumed service passes it
    again.load_state(ckpt)
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(again.policy.state_dict()[k], v, rtol=0, atol=0)
    assert again.actor_opt.state_dict()["state"].keys() == learner.actor_opt.state_dict()["state"].keys()
    first = {k: v.clone() for k, v in learner.adapter_state().items()}
    learner.update(batch)
    again.update(batch)
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(again.policy.state_dict()[k], v, rtol=0, atol=0)
    assert any(not torch.equal(first[k], v) for k, v in learner.adapter_state().items())  # the step did move it


def test_export_writes_a_peft_adapter_and_with_merge_an_hf_model(cache, tmp_path):
    from peft import PeftModel

    from async_vapo.cli import main

    learner, batch, base = make(cache)
    randomise_b(learner)
    learner.update(batch)
    want = logprobs(learner.policy, batch)
    ckpt = learner.save(tmp_path / "ckpt")
    assert main(["export", str(ckpt), str(tmp_path / "adapter")]) == 0
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [lora.ADAPTER_CONFIG, lora.ADAPTER_WEIGHTS]
    # peft, outside our code: the base model plus the exported adapter is the trained policy
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)).eval(),
                                           str(tmp_path / "adapter")).eval()
    torch.testing.assert_close(logprobs(peft_model, batch), want, rtol=0, atol=2e-5)
    assert main(["export", str(ckpt), str(tmp_path / "merged"), "--merge"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    assert not any("lora" in k for k in merged.state_dict())
    torch.testing.assert_close(logprobs(merged, batch), want, rtol=0, atol=2e-5)
    # what async-vapo eval loads into its engine for this checkpoint: the adapter merged over the base by peft
    from async_vapo.evaluation import adapter_merged_weights, checkpoint_policy

    assert checkpoint_policy(ckpt) == ckpt / "policy_adapter"
    evaluated = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    evaluated.load_state_dict(adapter_merged_weights(ckpt / "policy_adapter", base))
    torch.testing.assert_close(logprobs(evaluated, batch), want, rtol=0, atol=2e-5)


def test_the_adapter_starts_from_a_directory_and_a_mismatch_is_named(cache, tmp_path):
    """``model.lora.init_from`` (verl's ``lora_adapter_path``): a learner started from another's adapter directory
    has its policy exactly; an adapter of another rank, or a directory that is none, is refused saying why."""
    learner, batch, base = make(cache)
    randomise_b(learner)
    learner.update(batch)
    saved = lora.save_adapter(tmp_path / "adapter", learner.adapter_state(), learner.lora, str(base))
    again, _, _ = make(cache, f"model.lora.init_from={saved}")
    torch.testing.assert_close(logprobs(again.policy, batch), logprobs(learner.policy, batch), rtol=0, atol=1e-6)
    assert not any(p.requires_grad for n, p in again.policy.named_parameters() if ".lora_" not in n)
    with pytest.raises(ValueError, match=r"rank: 4 there, 8 here"):
        make(cache, f"model.lora.init_from={saved}", "model.lora.rank=8")
    with pytest.raises(ValueError, match="is not a PEFT adapter directory"):
        make(cache, f"model.lora.init_from={tmp_path}")
    with pytest.raises(ValueError, match="LoRA is off"):
        load_config([], FAST + [f"model.lora.init_from={saved}"])


class _Groups(SourceBase):
    """The step loop's source: the same two groups each step."""

    def __init__(self, tok):
        self.tok = tok

    def next_groups(self, n):
        return _groups(self.tok)[:n], {}


def test_the_step_loop_publishes_a_lora_version_without_building_the_merged_weights(cache, tmp_path, monkeypatch):
    """A LoRA version goes to the engines as its adapter (services.learner, trainer._EnginePublisher), so the loop
    hands the hook no merged state: the merge is a full copy of the model per version that nothing would read."""
    from async_vapo.learner.loop import StepLoop

    learner, _, base = make(cache, "train.total_steps=2", "train.eval_every=100", "train.checkpoint_every=0")
    merges = []
    policy_state = learner.policy_state
    monkeypatch.setattr(learner, "policy_state", lambda: merges.append(1) or policy_state())
    got = []

    def publish(version, state):
        got.append((version, state, {k: v.clone() for k, v in learner.adapter_state().items()}))
        return 0.0

    tok = AutoTokenizer.from_pretrained(str(base))
    assert StepLoop(learner.cfg, learner, _Groups(tok), pad_id=tok.pad_token_id, run_dir=tmp_path,
                    publish=publish).run()
    assert [(v, s) for v, s, _ in got] == [(1, None), (2, None)] and merges == []
    assert any(not torch.equal(got[0][2][k], v) for k, v in got[1][2].items())  # each version its own adapter


def test_served_merged_a_version_is_the_merged_weights_and_the_engine_has_no_lora(cache, tmp_path):
    """``model.lora.serve = "merged"``: the learner still trains the adapter alone, but what a version sends
    (``publish_state``, the step loop's hook) is the merged weights under the plain model's names, equal to peft's own
    merge; the engine is started without LoRA and "dist" is accepted. The critic is never served."""
    from peft.tuners.lora import LoraLayer

    from async_vapo.learner.loop import StepLoop
    from async_vapo.rollout.engine import EngineSpec

    learner, _, base = make(cache, "model.lora.serve=merged", "train.total_steps=1", "train.eval_every=100",
                            "train.checkpoint_every=0")
    randomise_b(learner)
    assert not learner.publishes_adapter and learner.lora is not None
    sent = learner.publish_state()
    plain = AutoModelForCausalLM.from_pretrained(str(base))
    assert set(sent) == set(plain.state_dict()) and not any("lora" in k or "base_layer" in k for k in sent)
    want = {}
    for name, m in learner.policy.named_modules():
        if isinstance(m, LoraLayer):
            w = m.get_base_layer().weight.detach().clone()
            w += m.get_delta_weight(lora.ADAPTER)
            want[f"{name}.weight"] = w
    assert want and all(torch.allclose(sent[k], w, atol=1e-6) for k, w in want.items())
    assert not torch.equal(sent[next(iter(want))], plain.state_dict()[next(iter(want))])  # the adapter is in it
    tok = AutoTokenizer.from_pretrained(str(base))
    got = []
    assert StepLoop(learner.cfg, learner, _Groups(tok), pad_id=tok.pad_token_id, run_dir=tmp_path,
                    publish=lambda v, state: got.append(learner.publish_state()) or 0.0).run()
    assert set(got[0]) == set(sent)
    assert EngineSpec.from_config(learner.cfg, base, longest_prompt=8).max_lora_rank == 0
    adapter_cfg = load_config([], FAST + LORA)
    assert EngineSpec.from_config(adapter_cfg, base, longest_prompt=8).max_lora_rank == 8
    load_config([], FAST + LORA + ["model.lora.serve=merged", "cluster.weights.transfer=dist"])
    with pytest.raises(ValueError, match='serve = "merged"'):
        load_config([], FAST + LORA + ["cluster.weights.transfer=dist"])
    with pytest.raises(ValueError, match="critic is never served"):
        load_config([], FAST + ["algo.name=vapo", "model.critic_lora.rank=4", "model.critic_lora.serve=merged"])


def test_lora_refuses_what_it_does_not_support(cache):
    with pytest.raises(ValueError, match="less than or equal to 0"):
        load_config([], FAST + ["model.lora.rank=4", "model.lora.dropout=0.1"])
    assert lora.vllm_max_lora_rank(4) == 8 and lora.vllm_max_lora_rank(16) == 16
    with pytest.raises(ValueError, match="largest max_lora_rank"):
        lora.vllm_max_lora_rank(513)


def test_a_sharded_lora_learner_makes_the_one_process_update_and_saves_its_adapters(cache, tmp_path):
    """FSDP2 (learner.fsdp = on, one gloo rank: the sharded code path) with adapters on the policy and the critic:
    the same update as one unsharded process, the version's adapter gathered alone (publish_state), and a checkpoint
    with the PEFT adapter and the merged critic, as one process writes them."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from async_vapo.learner.sharding import is_sharded

    both = ["algo.name=vapo", "model.critic_lora.rank=4", "optim.critic_lr=1e-2"]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        sharded, batch, _ = make(cache, *both, "learner.fsdp=on")
        single, _, _ = make(cache, *both)
        assert is_sharded(sharded.policy) and is_sharded(sharded.critic) and not is_sharded(single.policy)
        a = single.update(batch)
        b = sharded.update(batch)
        for key in ("actor/grad_norm", "critic/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5)
        adapter = sharded.publish_state()
        assert adapter.keys() == single.adapter_state().keys()
        for k, v in single.adapter_state().items():
            torch.testing.assert_close(adapter[k], v, rtol=0, atol=2e-6)
        assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapter.items())  # the update moved B
        sharded.save(tmp_path / "sharded")
        single.save(tmp_path / "single")
        for part in ("policy_adapter/adapter_model.safetensors", "critic/model.safetensors"):
            got, want = load_file(str(tmp_path / "sharded" / part)), load_file(str(tmp_path / "single" / part))
            assert got.keys() == want.keys()
            for k, v in want.items():
                torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6)
        assert not (tmp_path / "sharded" / "policy").exists()  # a version of a LoRA policy is its adapter
        from async_vapo.cli import main

        for side in ("sharded", "single"):  # the export of each checkpoint, merged: the same HF model
            assert main(["export", str(tmp_path / side), str(tmp_path / f"{side}_merged"), "--merge"]) == 0
        got = load_file(str(tmp_path / "sharded_merged" / "model.safetensors"))
        want = load_file(str(tmp_path / "single_merged" / "model.safetensors"))
        assert got.keys() == want.keys() and not any("lora" in k for k in got)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=2e-6)
    finally:
        dist.destroy_process_group()
