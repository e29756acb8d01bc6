"""The critic's own training schedule (issue 45): its mini-batches, epochs, head learning rate and lr schedule
decoupled from the actor's (``algo.critic_mini_batch_size``, ``algo.critic_epochs``, ``optim.critic_head_lr``,
``optim.critic_lr_schedule``), and value pretraining on a pool of batches fetched once
(``algo.value_pretrain_pool``). A tiny real learner (1 layer, 32 wide) on 2 groups x 4 responses."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import _groups
from transformers import AutoTokenizer

from async_vapo.config import load_config
from async_vapo.learner.loop import StepLoop
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


def make(cache, *overrides: str) -> tuple[Learner, object]:
    cfg = load_config([], FAST + [f"model.cache_dir={cache}", *overrides])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    torch.manual_seed(0)
    return Learner(cfg, base), make_rollout_batch(_groups(tok), tok.pad_token_id)


def adam_steps(opt: torch.optim.Optimizer) -> set[int]:
    """The step count of every parameter's AdamW state (each optimiser step advances all of them by one)."""
    return {int(s["step"]) for s in opt.state.values()}


def test_decoupled_schedule_makes_the_configured_critic_steps_and_leaves_the_actor_alone(cache):
    # 8 responses: critic mini-batches of 4 -> 2 steps per pass, 3 passes -> 6 critic steps per update;
    # the actor keeps one step per update (mini_batch_size 8 = the batch, ppo_epochs 1)
    learner, batch = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=3")
    hooked = []
    learner.critic_opt.register_step_post_hook(lambda opt, args, kwargs: hooked.append(1))
    m1 = learner.update(batch)
    m2 = learner.update(batch)
    assert adam_steps(learner.critic_opt) == {12} and len(hooked) == 12
    assert adam_steps(learner.actor_opt) == {2} and learner.optimizer_steps == 2
    assert m1["critic/steps"] == m2["critic/steps"] == 6.0 and learner.critic_steps == 12
    # the default schedule: one critic step beside each actor step
    learner, batch = make(cache)
    m = learner.update(batch)
    assert adam_steps(learner.critic_opt) == adam_steps(learner.actor_opt) == {1} and m["critic/steps"] == 1.0


def test_unset_critic_schedule_is_the_actors_schedule_bit_for_bit(cache):
    """critic_mini_batch_size / critic_epochs / critic_head_lr unset = set to the actor's values (and critic_lr):
    the same critic steps on the same mini-batches, so identical weights after two updates of 2 mini-batches each.
    A schedule that differs (mini-batches of 8) gives another critic: the comparison can tell them apart; its first
    update leaves the actor's path as it was (its mini-batches and advantages: the values are taken before it)."""
    shape = ["algo.mini_batch_size=4", "algo.ppo_epochs=2"]

    def weights(*overrides: str, updates: int = 2) -> dict[str, torch.Tensor]:
        learner, batch = make(cache, *shape, *overrides)
        for _ in range(updates):
            learner.update(batch)
        return {**{f"policy.{k}": v.clone() for k, v in learner.policy.state_dict().items()},
                **{f"critic.{k}": v.clone() for k, v in learner.critic.state_dict().items()}}

    unset = weights()
    explicit = weights("algo.critic_mini_batch_size=4", "algo.critic_epochs=2", "optim.critic_head_lr=2e-6",
                       "optim.critic_lr=2e-6")
    assert unset.keys() == explicit.keys()
    for k, v in unset.items():
        torch.testing.assert_close(explicit[k], v, rtol=0, atol=0, msg=k)
    other = weights("algo.critic_mini_batch_size=8", updates=1)
    once = weights(updates=1)
    assert any(not torch.equal(other[k], v) for k, v in once.items() if k.startswith("critic."))
    for k, v in once.items():
        if k.startswith("policy."):
            torch.testing.assert_close(other[k], v, rtol=0, atol=0, msg=k)


def test_default_critic_steps_on_the_actors_mini_batches(cache):
    """Unset, the critic takes one step on each of the actor's mini-batches, in the actor's order (the schedule
    before the fields existed); a schedule of its own draws other mini-batches from its own RNG."""
    def mini_batches(*overrides: str) -> tuple[list[list[int]], list[list[int]]]:
        learner, batch = make(cache, "algo.mini_batch_size=4", "algo.ppo_epochs=2", *overrides)
        actor, critic = [], []
        draw, step = learner._minibatches, learner._critic_minibatch

        def recorded_draw(n, size=None, rng=None):
            out = draw(n, size, rng)
            if rng is None:  # the actor's (self.rng)
                actor.extend(out)
            return out

        def recorded_step(b, idx, *args):
            critic.append(list(idx))
            return step(b, idx, *args)

        learner._minibatches, learner._critic_minibatch = recorded_draw, recorded_step
        learner.update(batch)
        return actor, critic

    actor, critic = mini_batches()
    assert len(actor) == 4 and critic == actor
    actor2, critic2 = mini_batches("algo.critic_epochs=3")
    assert actor2 == actor and len(critic2) == 6 and critic2[:4] != actor


def test_critic_replay_steps_over_the_kept_batches_with_their_returns_recomputed(cache):
    """algo.critic_replay_batches = 3: each update's critic steps cover its batch and the two before it (2, 1 and 2
    mini-batches of 4 for batches of 8, 4 and 8 responses), a fourth batch drops the first; a kept batch is stepped on
    with the critic's values of it at that update and its λ_critic = 1 returns (the outcome at every token here)."""
    learner, a = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=1", "algo.critic_replay_batches=3")
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(learner.cfg, progress=False)))
    b = make_rollout_batch(_groups(tok, random.Random(1))[:1], tok.pad_token_id)
    c = make_rollout_batch(_groups(tok, random.Random(2)), tok.pad_token_id)
    d = make_rollout_batch(_groups(tok, random.Random(3)), tok.pad_token_id)
    named = {"a": a, "b": b, "c": c, "d": d}
    steps, step = [], learner._critic_minibatch

    def recorded_step(batch, idx, seq_tokens, returns, values):
        name = next(k for k, x in named.items() if torch.equal(x.tokens.input_ids, batch.tokens.input_ids))
        steps.append((name, list(idx)))
        if name != current:  # a kept batch: today's values of it, and its Monte-Carlo returns
            torch.testing.assert_close(values, before[name], rtol=0, atol=0)
            outcome = batch.rewards[:, None].expand_as(returns) * batch.tokens.response_mask
            torch.testing.assert_close(returns, outcome)
        return step(batch, idx, seq_tokens, returns, values)

    learner._critic_minibatch = recorded_step
    seen = []
    for current in "abcd":
        before = {k: learner.critic_values(named[k]) for k in seen}
        steps.clear()
        m = learner.update(named[current])
        kept = ([current] + seen[::-1])[:3]
        assert sorted({n for n, _ in steps}) == sorted(kept), current
        for n in kept:  # one pass over each kept batch: every row once
            assert sorted(i for x, idx in steps if x == n for i in idx) == list(range(len(named[n].rewards)))
        assert m["critic/steps"] == len(steps) and m["critic/replay_batches"] == len(kept)
        seen.append(current)
    assert [len(x.rewards) for x in (a, b)] == [8, 4]
    # the window with one batch is the schedule without one (steps and mini-batches drawn alike)
    one, batch = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=2", "algo.critic_replay_batches=1")
    two, _ = make(cache, "algo.critic_mini_batch_size=4", "algo.critic_epochs=2")
    for learner in (one, two):
        learner.update(batch)
    for (k, v), w in zip(one.critic.state_dict().items(), two.critic.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, rtol=0, atol=0, msg=k)


def test_head_lr_applies_to_the_value_head_only(cache):
    """Adam's first step moves each weight by ±lr (m/√v = sign(g)): the head (zero-initialised, its gradient
    nonzero) moves by 1e-2, the trunk by at most 1e-6."""
    learner, batch = make(cache, "optim.critic_lr=1e-6", "optim.critic_head_lr=1e-2")
    head = {id(p) for p in learner.critic.score.parameters()}
    trunk_group, head_group = learner.critic_opt.param_groups
    assert {id(p) for p in head_group["params"]} == head
    assert not head & {id(p) for p in trunk_group["params"]}
    assert len(trunk_group["params"]) + len(head_group["params"]) == len(list(learner.critic.parameters()))
    before = {n: p.detach().clone() for n, p in learner.critic.named_parameters()}
    m = learner.update(batch)
    assert (m["critic/lr"], m["critic/head_lr"]) == (1e-6, 1e-2)
    for n, p in learner.critic.named_parameters():
        delta = float((p.detach() - before[n]).abs().max())
        if n.startswith("score."):
            assert delta == pytest.approx(1e-2, rel=1e-3), n
        else:
            assert delta <= 1e-6 * 1.001, n


def test_cosine_critic_lr_follows_the_updates(cache):
    # lr 1e-3, r = 0.1, 4 updates: version 0 (value pretraining and the first update) 1e-3; version 2:
    # 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55 -> 5.5e-4; version 4: 0.1 -> 1e-4; the head's rate alike
    learner, _ = make(cache, "optim.critic_lr=1e-3", "optim.critic_head_lr=1e-2", "optim.critic_lr_schedule=cosine",
                      "optim.critic_lr_min_ratio=0.1", "train.total_steps=4")
    for version, want in ((0, 1.0), (2, 0.55), (4, 0.1)):
        learner.version = version
        assert learner._critic_lrs() == pytest.approx([1e-3 * want, 1e-2 * want], rel=1e-12)
    learner, _ = make(cache, "optim.critic_lr=1e-3", "train.total_steps=4")
    learner.version = 3
    assert learner._critic_lrs() == [1e-3]  # constant


@pytest.mark.parametrize(("overrides", "message"), [
    (["algo.critic_mini_batch_size=6"], "critic_mini_batch_size (6) must be a multiple of micro_batch_size (4)"),
    (["algo.critic_mini_batch_size=16"], "critic_mini_batch_size (16) exceeds responses per step"),
    (["algo.value_pretrain_steps=2", "algo.value_pretrain_pool=3"], "value_pretrain_pool (3) exceeds"),
    (["algo.critic_replay_batches=2"], "critic_replay_batches (2) needs the critic's own schedule"),
    (["algo.critic_replay_batches=2", "algo.critic_epochs=2", "algo.name=grpo"], "'grpo' has none"),
    (["algo.critic_replay_batches=2", "algo.critic_epochs=2", "algo.zero_values=true"], "with zero_values has none"),
    (["algo.critic_replay_batches=2", "algo.critic_epochs=2", "algo.kl_coef=0.01"], "would lack it"),
])
def test_critic_schedule_validation(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config([], FAST + overrides)


def test_value_pretrain_batches_is_what_the_rollout_and_the_learner_agree_on():
    a = load_config([], FAST + ["algo.value_pretrain_steps=20", "algo.value_pretrain_pool=3"]).algo
    assert a.value_pretrain_batches == 3
    assert load_config([], FAST + ["algo.value_pretrain_steps=20"]).algo.value_pretrain_batches == 20
    assert load_config([], FAST + ["algo.value_pretrain_steps=20", "algo.value_pretrain_pool=3",
                                   "algo.name=grpo"]).algo.value_pretrain_batches == 0


class CountingSource:
    """Groups from ``_groups`` with fresh random responses per fetch; counts the fetches."""

    def __init__(self, tok):
        self.tok, self.fetches, self.rng = tok, 0, random.Random(1)

    def next_groups(self, n):
        self.fetches += 1
        groups = _groups(self.tok, self.rng)[:n]
        for g in groups:
            g.uid = f"{g.uid}-{self.fetches}"
        return groups, {"time/generate_s": 0.0}

    def row_metrics(self, kept, version):
        return {}

    def state(self):
        return {"fetches": self.fetches}

    def restore(self, state):
        pass

    def close(self):
        pass


def test_value_pretraining_pool_is_fetched_once_and_reused(cache, tmp_path):
    """7 pretraining steps on a pool of 2 batches: 2 fetches, however many steps; the first pass trains on the
    batches as fetched (fresh EV), later passes on the pool reshuffled; the critic takes value_pretrain_epochs x
    (8 / 4) steps per pretraining step. A resumed run fetches nothing (the pool is not regenerated)."""
    learner, _ = make(cache, "algo.value_pretrain_steps=7", "algo.value_pretrain_pool=2",
                      "algo.critic_mini_batch_size=4", "algo.value_pretrain_epochs=2")
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(learner.cfg, progress=False)))
    source, rows = CountingSource(tok), []
    loop = StepLoop(learner.cfg, learner, source, pad_id=tok.pad_token_id, run_dir=tmp_path, on_row=rows.append)
    assert loop.pretrain()
    assert source.fetches == 2 and len(rows) == 7
    assert learner.critic_steps == 7 * 2 * 2 and adam_steps(learner.critic_opt) == {28}
    assert [r["critic/steps"] for r in rows] == [4.0] * 7
    assert [r["value_pretrain/pool_pass"] for r in rows] == [0, 0, 1, 1, 2, 2, 3]
    assert ["critic/fresh_ev" in r for r in rows] == [True, True] + [False] * 5
    assert all("critic/pool_ev" in r for r in rows[2:])
    assert "time/value_pretrain_pool_s" in rows[0] and "time/value_pretrain_pool_s" not in rows[1]

    ckpt = learner.save(tmp_path / "ckpt", extra={"step": 0})
    again = Learner(learner.cfg, ckpt / "policy", ckpt / "critic")
    loop2 = StepLoop(learner.cfg, again, CountingSource(tok), pad_id=tok.pad_token_id, run_dir=tmp_path)
    loop2.resume(again.load_state(ckpt))
    assert loop2.pretrain() and loop2.source.fetches == 0 and again.critic_steps == 28


def test_pool_deals_every_group_once_a_pass_reshuffled_after_the_first(cache):
    from async_vapo.learner.loop import PretrainPool

    cfg = load_config([], FAST + [f"model.cache_dir={cache}"])
    tok = AutoTokenizer.from_pretrained(str(ensure_base_model(cfg, progress=False)))
    source = CountingSource(tok)
    fetched = []
    pool = PretrainPool.fill(lambda timing: fetched.append(source.next_groups(2)[0]) or fetched[-1], 3, 2, seed=0)
    assert source.fetches == 3 and pool.batches_per_pass == 3
    uids = [[g.uid for g in pool.batch(k)] for k in range(12)]
    assert uids[:3] == [[g.uid for g in b] for b in fetched]  # pass 0: as fetched
    everything = sorted(g.uid for g in pool.groups)
    for p in range(4):
        assert sorted(u for b in uids[3 * p: 3 * p + 3] for u in b) == everything
    assert len({tuple(u for b in uids[3 * p: 3 * p + 3] for u in b) for p in range(4)}) > 1  # reshuffled
    # the same seed deals the same batches (every data-parallel rank alike)
    twin = PretrainPool(pool.groups, 2, seed=0)
    assert [[g.uid for g in twin.batch(k)] for k in range(12)] == uids
