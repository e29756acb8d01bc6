"""Long-sequence machinery of the learner on a tiny real model: log-probs from hidden states in chunks equal the
full logits' (values and gradients); padding-free packing with our block-diagonal mask equals the padded forward,
while packing by position ids alone holds only in forwards without a KV cache (SDPA and eager); packing with a
FlexAttention BlockMask of the sequences equals the padded forward (gradients where FlexAttention has a backward:
not on the CPU); token-budget micro-batches make the same update as one micro-batch of the whole mini-batch."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, _groups
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_vapo.algo.utils import entropy_from_logits, logprobs_from_logits
from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model
from async_vapo.models.rl import (
    attn_implementation,
    build_critic,
    build_policy,
    chunked_response_logprobs,
    document_block_mask,
    load_critic,
    load_policy,
    make_token_batch,
    model_inputs,
    resolve_packing,
    response_logits,
    response_values,
)

OVERRIDES = FAST + ["base_model.num_layers=2"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    cfg = load_config([], OVERRIDES + [f"model.cache_dir={tmp_path_factory.mktemp('cache')}"])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    return cfg, base, make_rollout_batch(_groups(tok), tok.pad_token_id)


def _policy(base, impl="sdpa"):
    return AutoModelForCausalLM.from_pretrained(str(base), attn_implementation=impl).eval()


@pytest.mark.parametrize("chunk", [1, 5, 1000])
def test_chunked_logprobs_and_entropy_equal_the_full_logits(setup, chunk):
    _, base, batch = setup
    tb, mask = batch.tokens, batch.tokens.response_mask.bool()
    model = _policy(base)
    logits = response_logits(model, tb, 0.7)
    lp, ent = logprobs_from_logits(logits, tb.response_ids), entropy_from_logits(logits)
    (lp[mask].sum() + ent[mask].sum()).backward()
    full_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    clp, cent = chunked_response_logprobs(model, tb, 0.7, chunk)
    (clp[mask].sum() + cent[mask].sum()).backward()
    torch.testing.assert_close(clp[mask], lp[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(cent[mask], ent[mask], rtol=0, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, full_grads[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packing_by_position_ids_alone_holds_only_without_a_cache_and_the_block_mask_always(setup, impl):
    """The packed row with positions restarting per sequence and no mask, on SDPA and eager attention, in this
    transformers (5.x): ``create_causal_mask`` infers the sequences from the position ids only when no KV cache is in
    play, so with ``use_cache=False`` the forward equals the padded one (through an [L, L] mask it builds itself),
    while a plain ``model(input_ids, position_ids)`` (``use_cache`` from the config: a DynamicCache) attends across
    sequences. Our packed forwards give the mask explicitly (4-D, used as given), cache or not."""
    _, base, batch = setup
    tb, mask = batch.tokens, batch.tokens.response_mask.bool()
    model = _policy(base, impl)
    assert model.config.use_cache  # what a forward without use_cache gets
    with torch.no_grad():
        padded = response_logits(model, tb)
        packed = response_logits(model, tb, packed=True)
        inputs = model_inputs(tb, packed=True)
        explicit_with_cache = inputs.select(model(**inputs.kwargs, use_cache=True).logits)
        bare = {k: inputs.kwargs[k] for k in ("input_ids", "position_ids")}  # the pitfall: no mask
        inferred = inputs.select(model(**bare, use_cache=False).logits)
        naive = inputs.select(model(**bare).logits)
    assert inputs.kwargs["input_ids"].shape[1] == int(tb.attention_mask.sum())  # no padding token left
    torch.testing.assert_close(packed[mask], padded[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(explicit_with_cache[mask], padded[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(inferred[mask], padded[mask], rtol=0, atol=1e-5)
    leak = float((naive[mask] - padded[mask]).abs().max())
    assert leak > 1e-2, leak  # the second sequence onwards attended to the ones before it
    critic = load_critic(base).eval()
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight)  # a zero head would hide any difference
        torch.testing.assert_close(response_values(critic, tb, packed=True)[mask], response_values(critic, tb)[mask],
                                   rtol=0, atol=1e-5)


@pytest.mark.parametrize("lengths,block", [([5, 40, 12, 33, 8, 21, 17, 29, 3, 11], 8), ([130, 1, 300], 128),
                                           ([7], 16), ([16, 16, 16, 3], 16), ([64, 64], 16)])
def test_document_block_mask_is_the_one_create_block_mask_builds(lengths, block):
    """Our BlockMask from the sequences' block ranges (no [L, L] tensor) = torch's create_block_mask of the
    same-sequence causal mask function (which evaluates every pair): the same partial and full blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    n = len(doc)
    ours = document_block_mask(doc, block)
    ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (kv <= q), 1, 1, n, n, device="cpu",
                            BLOCK_SIZE=block)
    assert ours.shape == (1, 1, n, n) and ours.seq_lengths == (n, n)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    for num, idx in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices")):
        assert torch.equal(getattr(ours, num), getattr(ref, num)), num
        for q, k in enumerate(getattr(ours, num)[0, 0].tolist()):  # the listed blocks (the rest is unused)
            assert sorted(getattr(ours, idx)[0, 0, q, :k].tolist()) == sorted(getattr(ref, idx)[0, 0, q, :k].tolist())


def test_packed_attention_selection():
    """learner.packed_attention: auto = flex on CUDA, the explicit mask elsewhere; flex off CUDA is refused (no
    FlexAttention backward on the CPU); the models load with the matching attention implementation."""
    assert resolve_packing(False, "flex", "cuda") is None
    assert resolve_packing(True, "auto", "cuda") == "flex"
    assert resolve_packing(True, "auto", "cpu") == "mask"
    assert resolve_packing(True, "mask", "cuda") == "mask"
    assert resolve_packing(True, "flex", "cuda") == "flex"
    with pytest.raises(ValueError, match="needs CUDA"):
        resolve_packing(True, "flex", "cpu")
    assert [attn_implementation(p) for p in (False, True, "mask", "flex")] == [None, None, None, "flex_attention"]
    with pytest.raises(ValueError):
        model_inputs(make_token_batch([[1]], [[2]], 0), packed="varlen")


def test_the_learner_loads_its_models_for_its_packing(setup):
    """On this CPU learner.packing with auto packs with the explicit mask over SDPA; the loaders (the meta-device
    builders of the FSDP path too) take the FlexAttention implementation when packing is flex."""
    cfg, base, _ = setup
    learner = Learner(load_config([], OVERRIDES + [f"model.cache_dir={cfg.model.cache_dir}", "learner.packing=true"]),
                      base)
    assert learner.packing == "mask"
    assert learner.policy.config._attn_implementation == learner.critic.config._attn_implementation == "sdpa"
    with pytest.raises(ValueError, match="needs CUDA"):
        Learner(load_config([], OVERRIDES + [f"model.cache_dir={cfg.model.cache_dir}", "learner.packing=true",
                                             "learner.packed_attention=flex"]), base)
    flex = "flex_attention"
    for model in (load_policy(base, attn_implementation=flex), load_critic(base, attn_implementation=flex),
                  build_policy(base, attn_implementation=flex), build_critic(base, attn_implementation=flex)):
        assert model.config._attn_implementation == flex


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def static_shapes():
    """One compiled FlexAttention per packed length: on the CPU, inductor's dynamic-shape FlexAttention kernel (the
    recompile after a second length) does not compile in torch 2.13 (``CppCompileError: 'cur_qSplitSize8' was not
    declared``); on CUDA this fixture only costs a recompile per length."""
    import torch._dynamo

    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        yield


def test_packed_flex_forward_equals_padded(setup, static_shapes):
    """FlexAttention packing (BlockMask of the sequences) = the padded SDPA forward: logits, chunked log-probs and
    critic values to 1e-5, the whole batch packed into one row. Forward only on the CPU (each packed length is a
    compilation of its own: one, ~20 s here)."""
    _, base, batch = setup
    dev = _device()
    padded_model, flex_model = _policy(base).to(dev), _policy(base, "flex_attention").to(dev)
    critic, flex_critic = load_critic(base).to(dev), load_critic(base, attn_implementation="flex_attention").to(dev)
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight, generator=torch.Generator().manual_seed(0))
        flex_critic.score.weight.copy_(critic.score.weight)
        for rows in (list(range(8)),):
            tb = batch.tokens.select(rows).to(dev)
            mask = tb.response_mask.bool()
            padded = response_logits(padded_model, tb, 0.7)
            flex = response_logits(flex_model, tb, 0.7, packed="flex")
            torch.testing.assert_close(flex[mask], padded[mask], rtol=0, atol=1e-5)
            lp, _ = chunked_response_logprobs(flex_model, tb, 0.7, 7, packed="flex")
            torch.testing.assert_close(lp[mask], logprobs_from_logits(padded, tb.response_ids)[mask], rtol=0,
                                       atol=1e-5)
            torch.testing.assert_close(response_values(flex_critic, tb, packed="flex")[mask],
                                       response_values(critic, tb)[mask], rtol=0, atol=1e-5)


def test_packed_flex_gradients_equal_padded(setup, static_shapes):
    """The gradients of packed-flex log-probs = the padded ones (relative 1e-4) on CUDA. On the CPU, torch 2.13's
    FlexAttention has no backward: the test asserts that torch refuses (so that the config's refusal of
    ``packed_attention = "flex"`` off CUDA stays justified, and this test notices when torch gains it);
    deploy/device_check.sh checks the gradients on a GPU (``flex_packed_equals_padded``)."""
    _, base, batch = setup
    dev = _device()
    padded_model, flex_model = _policy(base).to(dev), _policy(base, "flex_attention").to(dev)
    tb = batch.tokens.to(dev)
    mask = tb.response_mask.bool()
    lp, _ = chunked_response_logprobs(padded_model, tb, 0.7, 7)
    lp[mask].sum().backward()
    if dev == "cpu":  # torch refuses already in the forward, for inputs that require a gradient
        with pytest.raises(NotImplementedError, match="backward on CPU"):
            flex_lp, _ = chunked_response_logprobs(flex_model, tb, 0.7, 7, packed="flex")
            flex_lp[mask].sum().backward()
        return
    flex_lp, _ = chunked_response_logprobs(flex_model, tb, 0.7, 7, packed="flex")
    flex_lp[mask].sum().backward()
    for (n, p), q in zip(padded_model.named_parameters(), flex_model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def _update(cfg, base, batch, *overrides):
    torch.manual_seed(0)
    learner = Learner(load_config([], OVERRIDES + [f"model.cache_dir={cfg.model.cache_dir}", *overrides]), base)
    metrics = learner.update(batch)
    return learner, metrics


def test_token_budget_micro_batches_make_the_one_big_batch_update(setup):
    """The mini-batch (8 responses) as one micro-batch, against micro-batches of at most 48 padded tokens (packed,
    with chunked log-probs): the token-level loss divides by the whole mini-batch's tokens either way."""
    cfg, base, batch = setup
    big, m_big = _update(cfg, base, batch, "algo.micro_batch_size=8")
    budget = 48
    small, m_small = _update(cfg, base, batch, f"algo.max_tokens_per_micro_batch={budget}", "learner.packing=true",
                             "learner.logprob_chunk_tokens=7")
    seq_tokens = batch.tokens.attention_mask.sum(-1).tolist()
    plan = small._plan(list(range(8)), seq_tokens)[0]
    assert len(plan) > 2  # the budget really split the mini-batch
    for micro in plan:
        assert len(micro) == 1 or len(micro) * max(seq_tokens[i] for i in micro) <= budget
    assert sorted(i for micro in plan for i in micro) == list(range(8))
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert abs(m_small[key] - m_big[key]) <= 1e-5 * m_big[key], (key, m_small[key], m_big[key])
    for k, v in big.policy.state_dict().items():
        torch.testing.assert_close(small.policy.state_dict()[k], v, rtol=0, atol=1e-5)


def test_token_budget_balances_the_ranks(setup):
    """Across 2 ranks each rank's tokens differ by at most the longest sequence (longest first, to the lighter)."""
    cfg, base, batch = setup
    learner, _ = _update(cfg, base, batch, "algo.max_tokens_per_micro_batch=48")
    learner.world = 2
    seq_tokens = [5, 40, 12, 33, 8, 21, 17, 29, 3, 11]
    plans = learner._plan(list(range(10)), seq_tokens)
    loads = [sum(seq_tokens[i] for micro in p for i in micro) for p in plans]
    assert abs(loads[0] - loads[1]) <= max(seq_tokens)
    assert sorted(i for p in plans for micro in p for i in micro) == list(range(10))


@pytest.mark.parametrize("extra", [[], ["algo.max_tokens_per_micro_batch=48", "learner.packing=true"]])
def test_the_grpo_update_follows_the_policy_gradient_of_a_plain_reference(setup, extra):
    """The learner's first-step GRPO gradient (sequence-level loss, ratio 1, token-budget micro-batches and packing
    or not) equals the gradient of −Σ_i A_i · mean_t log π(y_it) / n computed one response at a time with a plain
    forward: the update is the policy gradient, whatever the batching. (Behaviour correction off: the fixture's engine
    log-probs are placeholders.)"""
    cfg, base, batch = setup
    overrides = OVERRIDES + [f"model.cache_dir={cfg.model.cache_dir}", "algo.name=grpo", "algo.token_level_loss=false",
                             "algo.clip_higher=false", "algo.pos_lm_coef=0", "algo.behavior_correction=false",
                             "rollout.temperature=0.7", *extra]
    learner = Learner(load_config([], overrides), base)
    got = {}

    def keep(model, opt, scaler, lr, steps_done):
        got.update({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.zero_grad(set_to_none=True)
        return 0.0

    learner._step = keep
    learner.update(batch)
    ref = _policy(base)
    tb, mask = batch.tokens, batch.tokens.response_mask.bool()
    rewards, groups = batch.rewards, batch.group_ids
    loss = 0.0
    for i in range(len(rewards)):
        same = rewards[groups == groups[i]]
        adv = (rewards[i] - same.mean()) / (same.std() + 1e-6)
        prompt = tb.input_ids[i, : tb.prompt_len][tb.attention_mask[i, : tb.prompt_len].bool()]
        resp = tb.response_ids[i][mask[i]]
        logits = ref(torch.cat([prompt, resp])[None]).logits[0, len(prompt) - 1: -1] / 0.7
        loss = loss - adv * torch.log_softmax(logits, -1).gather(-1, resp[:, None]).mean() / len(rewards)
    loss.backward()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-7)


def test_shared_prompts_equal_the_padded_forward_in_fewer_tokens(setup):
    """``learner.share_prompts``: the rows in an interleaved order (two prompts of 4 responses each), each distinct
    prompt once in the packed row: log-probs (full and chunked), values and every gradient equal the padded forward's,
    and the row holds the distinct prompts' tokens plus the responses', not every row's prompt."""
    _, base, batch = setup
    tb = batch.tokens.select([0, 4, 1, 5, 2, 6, 3, 7])
    mask = tb.response_mask.bool()
    inputs = model_inputs(tb, packed="shared")
    prompts = {tuple(tb.input_ids[i, : tb.prompt_len][tb.attention_mask[i, : tb.prompt_len].bool()].tolist())
               for i in range(len(tb))}
    assert len(prompts) == 2
    assert inputs.kwargs["input_ids"].shape[1] == sum(map(len, prompts)) + int(tb.response_mask.sum())
    assert inputs.kwargs["input_ids"].shape[1] < int(tb.attention_mask.sum())
    model = _policy(base)
    ref = {}
    for packed in (False, "shared"):
        model.zero_grad()
        logits = response_logits(model, tb, 0.7, packed=packed)
        lp = logprobs_from_logits(logits, tb.response_ids)
        clp, cent = chunked_response_logprobs(model, tb, 0.7, 5, packed=packed)
        (lp[mask].sum() + clp[mask].sum() + cent[mask].sum()).backward()
        got = (lp[mask].detach(), clp[mask].detach(), cent[mask].detach(),
               {n: q.grad.clone() for n, q in model.named_parameters()})
        if not ref:
            ref = got
            continue
        for a, b in zip(got[:3], ref[:3], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        for n, g in got[3].items():
            torch.testing.assert_close(g, ref[3][n], rtol=1e-4, atol=1e-6, msg=n)
    critic = load_critic(base).eval()
    with torch.no_grad():
        torch.nn.init.normal_(critic.score.weight)
        torch.testing.assert_close(response_values(critic, tb, packed="shared")[mask],
                                   response_values(critic, tb)[mask], rtol=0, atol=1e-5)


def test_shared_prompts_config_and_the_update(setup):
    """share_prompts is refused without packing, with flex attention and with a critic that reads log-probs; with it
    the learner cuts micro-batches of whole groups and makes the update of the unshared packed learner."""
    cfg, base, batch = setup
    assert resolve_packing(True, "auto", "cuda", share_prompts=True) == "shared"
    assert resolve_packing(True, "mask", "cpu", share_prompts=True) == "shared"
    with pytest.raises(ValueError, match="needs learner.packing"):
        resolve_packing(False, "auto", "cpu", share_prompts=True)
    with pytest.raises(ValueError, match="mask or auto"):
        resolve_packing(True, "flex", "cuda", share_prompts=True)
    with pytest.raises(ValueError, match="reads log-probs"):
        _update(cfg, base, batch, "learner.packing=true", "learner.share_prompts=true", "model.critic_logprobs=true")
    plain, m_plain = _update(cfg, base, batch, "learner.packing=true", "algo.micro_batch_size=4")
    shared, m_shared = _update(cfg, base, batch, "learner.packing=true", "learner.share_prompts=true",
                               "algo.micro_batch_size=4")
    groups = batch.group_ids.tolist()
    plan = shared._plan([0, 4, 1, 5, 2, 6, 3, 7], [1] * 8, groups)[0]
    assert [{groups[i] for i in micro} for micro in plan] == [{0}, {1}]  # whole groups, in order of appearance
    for key in ("actor/grad_norm", "critic/grad_norm"):
        assert abs(m_shared[key] - m_plain[key]) <= 1e-4 * m_plain[key], (key, m_shared[key], m_plain[key])
    for k, v in plain.policy.state_dict().items():
        torch.testing.assert_close(shared.policy.state_dict()[k], v, rtol=0, atol=1e-5)
