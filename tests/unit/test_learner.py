"""The learner on a tiny real model: mixed precision (float32 masters, bf16 / fp16 compute, weights pushed in the
engines' dtype) and the learning-rate warm-up of each optimiser, across a checkpoint."""

from __future__ import annotations

import pytest
import torch
from conftest import _groups
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.vapo import Learner, make_rollout_batch
from async_vapo.models.base_model import ensure_base_model

FAST = ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
        "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
        "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
        "rollout.max_response_tokens=30", "algo.prompts_per_step=2", "algo.group_size=4",
        "algo.mini_batch_size=8", "algo.micro_batch_size=4", "algo.value_pretrain_steps=0", "train.threads=1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("model-cache")


def make(cache, *overrides: str, behavior: float | None = None) -> tuple[Learner, object]:
    """A learner on the tiny base model and one rollout batch of 2 groups x 4 responses (one mini-batch).
    ``behavior``: the engine's log-prob of every response token (None: not reported)."""
    cfg = load_config([], FAST + [f"model.cache_dir={cache}", *overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    groups = _groups(tok, behavior=None if behavior is None else (lambda rng: behavior))
    torch.manual_seed(0)
    return Learner(cfg, base), make_rollout_batch(groups, tok.pad_token_id)


def weight_delta(cache, dtype: str, steps: int = 3, lr: float = 1e-6) -> tuple[Learner, torch.Tensor]:
    learner, batch = make(cache, f"model.dtype={dtype}", f"optim.actor_lr={lr}", f"optim.critic_lr={lr}")
    before = {k: v.detach().float().clone() for k, v in learner.policy.state_dict().items()}
    for _ in range(steps):
        learner.update(batch)
    after = learner.policy.state_dict()
    return learner, torch.cat([(after[k].float() - before[k]).flatten() for k in before])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_training_moves_every_weight_at_lr_1e6(cache, dtype, tmp_path):
    """lr 1e-6, 3 AdamW steps: every weight moves by ~3e-6 (Adam's first steps are ±lr per weight), as in float32.
    bf16 weights updated in place moved 1.6% of the weights (the rest rounded back: an ulp of 1e-2 is 6e-5) and
    fp16 ones turned NaN; the float32 masters move them all, and the direction is float32's."""
    lr, steps = 1e-6, 3
    _, ref = weight_delta(cache, "float32", steps, lr)
    learner, delta = weight_delta(cache, dtype, steps, lr)
    assert torch.isfinite(delta).all()
    moved = float((delta != 0).float().mean())
    assert moved > 0.99, f"only {moved:.2%} of the weights moved"
    assert 0.8 * steps * lr < float(delta.abs().mean()) < 1.2 * steps * lr
    assert float(torch.nn.functional.cosine_similarity(delta, ref, dim=0)) > 0.99

    # float32 masters and optimiser state; weights leave in the engines' dtype, rounded from the masters
    compute = getattr(torch, dtype)
    assert {p.dtype for p in learner.policy.parameters()} == {torch.float32}
    assert {p.dtype for p in learner.critic.parameters()} == {torch.float32}
    for opt in (learner.actor_opt, learner.critic_opt):
        assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.float32}
    masters = learner.policy.state_dict()
    pushed = learner.policy_state()
    assert pushed.keys() == masters.keys()
    for k, v in pushed.items():
        assert v.dtype == compute, k
        torch.testing.assert_close(v, masters[k].to(compute), rtol=0, atol=0)

    # a checkpoint keeps the float32 masters (and fp16's loss scale): a resumed learner continues from them exactly
    ckpt = learner.save(tmp_path / "ckpt")
    again = Learner(learner.cfg, ckpt / "policy", ckpt / "critic")
    again.load_state(ckpt)
    for k, v in again.policy.state_dict().items():
        torch.testing.assert_close(v, masters[k], rtol=0, atol=0)
    assert again.actor_scaler.is_enabled() == (dtype == "float16")
    if dtype == "float16":
        assert again.actor_scaler.get_scale() == learner.actor_scaler.get_scale()
        assert again.critic_scaler.get_scale() == learner.critic_scaler.get_scale()


def test_float32_learner_pushes_its_own_tensors():
    """No copy of a float32 model's weights for a push: policy_state holds the parameters' own storage."""
    from async_vapo.learner.precision import Precision

    w = torch.randn(3, 3)
    state = Precision("float32").engine_state({"w": w, "step": torch.tensor(3)})
    assert state["w"].data_ptr() == w.data_ptr()
    bf = Precision("bfloat16").engine_state({"w": w, "step": torch.tensor(3)})
    assert bf["w"].dtype == torch.bfloat16 and bf["step"].dtype == torch.int64


def lrs(learner: Learner) -> tuple[float, float]:
    return learner.actor_opt.param_groups[0]["lr"], learner.critic_opt.param_groups[0]["lr"]


def test_each_optimiser_warms_up_over_its_own_steps_across_a_checkpoint(cache, tmp_path):
    """warmup_steps = 4: the critic's lr climbs 1/4, 2/4, 3/4 of critic_lr over value pretraining (it stayed at 1/4
    while only policy steps were counted); the policy's first step is at 1/4 of actor_lr however many critic steps
    came before. The counts survive a checkpoint."""
    actor_lr, critic_lr = 1e-3, 2e-3
    learner, batch = make(cache, "optim.warmup_steps=4", f"optim.actor_lr={actor_lr}", f"optim.critic_lr={critic_lr}")
    for k in (1, 2, 3):
        learner.pretrain_critic(batch)
        assert learner.critic_steps == k and learner.optimizer_steps == 0
        assert lrs(learner) == (actor_lr, pytest.approx(critic_lr * k / 4))  # the actor's untouched
    learner.update(batch)  # one mini-batch: one step of each
    assert (learner.optimizer_steps, learner.critic_steps) == (1, 4)
    assert lrs(learner) == (pytest.approx(actor_lr / 4), pytest.approx(critic_lr))

    ckpt = learner.save(tmp_path / "ckpt")
    again = Learner(learner.cfg, ckpt / "policy", ckpt / "critic")
    again.load_state(ckpt)
    assert (again.optimizer_steps, again.critic_steps) == (1, 4)
    again.update(batch)
    assert lrs(again) == (pytest.approx(actor_lr * 2 / 4), pytest.approx(critic_lr))
    learner.update(batch)  # the uninterrupted run takes the same step
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(again.policy.state_dict()[k], v, rtol=0, atol=0)


def test_a_checkpoint_of_the_format_before_dcp_still_resumes(cache, tmp_path):
    """Runs checkpointed before DCP (HF models + optimiser states in learner_state.pt) resume in one process to the
    same next update."""
    import shutil

    learner, batch = make(cache)
    learner.update(batch)
    ckpt = learner.save(tmp_path / "ckpt")
    shutil.rmtree(ckpt / "dcp")  # rewritten as the earlier format wrote it
    state = torch.load(ckpt / "learner_state.pt", weights_only=False)
    state |= {"actor_opt": learner.actor_opt.state_dict(), "critic_opt": learner.critic_opt.state_dict()}
    torch.save(state, ckpt / "learner_state.pt")
    again = Learner(learner.cfg, ckpt / "policy", ckpt / "critic")
    again.load_state(ckpt)
    assert again.optimizer_steps == learner.optimizer_steps == 1
    again.update(batch)
    learner.update(batch)
    for k, v in learner.policy.state_dict().items():
        torch.testing.assert_close(again.policy.state_dict()[k], v, rtol=0, atol=0)


def policy_forwards(learner: Learner) -> list[int]:
    """Counts the policy's forward passes (one element per call)."""
    calls: list[int] = []
    learner.policy.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("algo", ["grpo", "vapo"])
@pytest.mark.parametrize("mini_batch", [8, 4])
def test_first_minibatch_takes_its_old_logprobs_from_its_own_forward(cache, algo, mini_batch):
    """The separate old-log-prob pass is skipped for the first mini-batch of the first epoch: its old log-probs are
    the log-probs of its own first forward, on the same weights. With one mini-batch (8 samples, 2 micro-batches of 4)
    the update makes 2 policy forwards instead of 4; with two mini-batches 3 instead of 4 (the second mini-batch's
    old log-probs still come from the pass, before the first step). Losses, ratios, behaviour weights (engine
    log-probs of -1.5 per token) and the weights after two updates match the update that makes the separate pass."""
    over = [f"algo.name={algo}", f"algo.mini_batch_size={mini_batch}", "algo.micro_batch_size=4"]
    results = []
    for reuse in (True, False):
        learner, batch = make(cache, *over, behavior=-1.5)
        learner.reuse_first_logprobs = reuse
        calls = policy_forwards(learner)
        m1 = learner.update(batch)
        forwards = len(calls)
        m2 = learner.update(batch)
        results.append((m1, m2, forwards, learner.policy.state_dict()))
    (a1, a2, fa, wa), (b1, b2, fb, wb) = results
    assert fb == 4
    assert fa == (2 if mini_batch == 8 else 3)
    if mini_batch == 8:  # one mini-batch: every ratio of the first step is exactly 1
        assert a1["actor/clipfrac"] == 0.0 and a1["actor/approx_kl"] == 0.0
    assert a1.keys() == b1.keys() and a2.keys() == b2.keys()
    for key in b1:
        torch.testing.assert_close(a1[key], b1[key], rtol=1e-5, atol=1e-6, equal_nan=True, msg=key)
    for key in b2:
        torch.testing.assert_close(a2[key], b2[key], rtol=1e-4, atol=1e-5, equal_nan=True, msg=key)
    assert a1["actor/behavior_weight_mean"] != 1.0  # the behaviour weights were exercised
    for k, v in wb.items():
        torch.testing.assert_close(wa[k], v, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("token_level", [True, False])
def test_entropy_bonus_keeps_every_response_token_under_a_rejection_mask(cache, token_level):
    """The entropy bonus alone (equal rewards: every GRPO advantage 0, so the surrogate has no gradient; no LM loss)
    gives the gradient of −coef·mean H over *every* valid response token (schema: "the entropy bonus keeps every
    token"), normalised as the loss is (token level: one mean; sequence level: mean of per-sequence means), whether
    or not a rejection mask drops tokens from the surrogate. The reference is computed by hand in float64 on the
    same weights. The engine's log-probs are the policy's own except on every third token (log ρ = −2, rejected by
    [0.5, 2]) and on every token of rows 0 and 5 (whole responses rejected)."""
    from async_vapo.algo.utils import entropy_from_logits
    from async_vapo.models.rl import load_policy, response_logits

    coef = 0.5
    over = ["algo.name=grpo", "algo.ppo_epochs=1", "algo.pos_lm_coef=0", f"algo.entropy_coef={coef}",
            f"algo.token_level_loss={str(token_level).lower()}", "algo.mini_batch_size=8", "algo.micro_batch_size=4"]
    learner, batch = make(cache, *over)
    batch.rewards.fill_(1.0)
    mask = batch.tokens.response_mask.bool()
    ref = load_policy(ensure_base_model(load_config([], FAST + [f"model.cache_dir={cache}"]), progress=False)).double()
    h = entropy_from_logits(response_logits(ref, batch.tokens, learner.temperature))
    with torch.no_grad():
        lp = torch.log_softmax(response_logits(ref, batch.tokens, learner.temperature), -1)
        lp = lp.gather(-1, batch.tokens.response_ids[..., None])[..., 0]
    rows, cols = torch.meshgrid(torch.arange(mask.shape[0]), torch.arange(mask.shape[1]), indexing="ij")
    off = ((cols % 3 == 0) | (rows == 0) | (rows == 5)).double() * 2.0
    batch.behavior_logprobs = torch.where(mask, lp + off, torch.nan).float()
    # by hand: token level Σ_valid H / N; sequence level mean_b (Σ_t H_bt / L_b)
    hm = torch.where(mask, h, torch.zeros((), dtype=h.dtype))
    bonus = hm.sum() / mask.sum() if token_level else (hm.sum(-1) / mask.sum(-1)).mean()
    (-coef * bonus).backward()
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()
                                                 if p.grad is not None])).item()
    got = {}
    for behavior_mask in ("off", "token"):
        learner, _ = make(cache, *over, f"algo.behavior_mask={behavior_mask}")
        got[behavior_mask] = learner.update(batch)
    masked = got["token"]
    assert 0.3 < masked["correction/masked_frac"] < 0.7 and masked["correction/masked_seq_frac"] == 0.25
    assert masked["actor/pg_loss"] == 0.0 and want > 0
    for m in got.values():
        assert m["actor/grad_norm"] == pytest.approx(want, rel=2e-5)


@pytest.mark.parametrize("keep_weights", [True, False])
def test_keep_checkpoints_prunes_the_resume_state_of_the_older_ones(cache, tmp_path, keep_weights):
    """``train.keep_checkpoints = 1``: of three checkpoints the newest stays whole and resumable; the two older ones
    keep only their HF weights (the policy loads and equals the one saved), or go whole; ``latest_checkpoint`` and
    the resume read the newest."""
    from transformers import AutoModelForCausalLM

    from async_vapo.learner.rundir import latest_checkpoint, prune_checkpoints

    learner, batch = make(cache)
    saved = {}
    for step in (1, 2, 3):
        learner.update(batch)
        saved[step] = {k: v.detach().clone() for k, v in learner.policy.state_dict().items()}
        learner.save(tmp_path / "checkpoints" / f"step_{step}")
    pruned = prune_checkpoints(tmp_path, 1, keep_weights)
    assert sorted(p.name for p in pruned) == ["step_1", "step_2"]
    assert latest_checkpoint(tmp_path).name == "step_3"
    for step in (1, 2):
        path = tmp_path / "checkpoints" / f"step_{step}"
        if not keep_weights:
            assert not path.exists()
            continue
        assert sorted(c.name for c in path.iterdir()) == ["critic", "hf_meta", "policy"]
        model = AutoModelForCausalLM.from_pretrained(path / "policy")
        for k, v in model.state_dict().items():
            torch.testing.assert_close(v, saved[step][k].to(v.dtype), rtol=0, atol=0)
    assert (tmp_path / "checkpoints/step_3/dcp").is_dir()
    again = Learner(learner.cfg, tmp_path / "checkpoints/step_3/policy", tmp_path / "checkpoints/step_3/critic")
    again.load_state(tmp_path / "checkpoints/step_3")
    assert again.optimizer_steps == learner.optimizer_steps == 3
    assert prune_checkpoints(tmp_path, 1, keep_weights) == []  # nothing more to prune
