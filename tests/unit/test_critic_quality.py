"""Held-out critic quality (async_vapo.learner.critic_quality): the explained variance of Monte-Carlo returns on
held-out responses, its reference levels, and the rule that stops value pretraining on that evidence."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from conftest import SourceBase

from async_vapo.config import load_config
from async_vapo.learner.critic_quality import PlateauStop, arith_reference_values, first_error, heldout_metrics
from async_vapo.learner.loop import StepLoop
from async_vapo.types import Group, Trajectory


def test_heldout_ev_of_a_hand_computed_case():
    # two responses, rewards +1 and -1, two tokens each (a third, padded column holds garbage).
    # returns G = [1, 1 | -1, -1]: mean 0, Var(G) = 1.
    # critic V = [0.5, 0.5 | 0, -1]: G - V = [0.5, 0.5 | -1, 0], mean 0, Var = (0.25 + 0.25 + 1 + 0) / 4 = 0.375
    # -> EV = 1 - 0.375 = 0.625. A constant reference (0.3 everywhere) explains nothing: EV 0.
    values = torch.tensor([[0.5, 0.5, 99.0], [0.0, -1.0, -99.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = heldout_metrics(values, mask, torch.tensor([1.0, -1.0]), {"constant": [[0.3, 0.3], [0.3, 0.3]]})
    assert out["critic/heldout_ev"] == pytest.approx(0.625, abs=1e-12)
    assert out["critic/heldout_ev_constant"] == pytest.approx(0.0, abs=1e-12)
    # returns that do not vary: undefined
    assert math.isnan(heldout_metrics(values, mask, torch.tensor([1.0, 1.0]))["critic/heldout_ev"])


def test_reference_values_of_a_hand_computed_case():
    # correct solution "a;b;X": two steps and the box, 3 units. Responses (character tokens, then EOS):
    # "a;b;X" right; "a;c;X" slips at character 2. Slip rate q = slips / units at risk = 1 / (3 + 2) = 0.2.
    truth = "a;b;X"
    texts = ["a;b;X", "a;c;X"]
    assert first_error(texts[0], truth) is None and first_error(texts[1], truth) == 2 and first_error("a;", truth) == 2
    chars = [list(range(6)), list(range(6))]  # prefix lengths before each of 5 characters and EOS
    length_only, slip = arith_reference_values(chars, texts, [truth, truth], 1.0, -1.0)
    # length only: -1 + 2 * 0.8^3 = 0.024 at every token of both
    assert length_only == [pytest.approx([0.024] * 6)] * 2
    # slip-aware, right response: units left 3, 3, 2, 2, 1, 1 -> 0.024, 0.024, 0.28, 0.28, 0.6, 0.6;
    # the slipped one: 0.024, 0.024, 0.28 (its slip is not yet in the prefix), then -1 once it is (prefix > 2)
    assert slip[0] == pytest.approx([0.024, 0.024, 0.28, 0.28, 0.6, 0.6])
    assert slip[1] == pytest.approx([0.024, 0.024, 0.28, -1.0, -1.0, -1.0])
    # their EV on the returns [+1 x6 | -1 x6]: G - V = [0.976, 0.976, 0.72, 0.72, 0.4, 0.4 | -1.024, -1.024, -1.28,
    # 0, 0, 0]: mean 0.072, E[(G-V)^2] = 6.997504 / 12, Var = 0.5831253 - 0.005184 = 0.5779413 -> EV 0.4220587;
    # the length-only value is a constant: EV 0
    mask = torch.ones(2, 6)
    out = heldout_metrics(torch.tensor(slip), mask, torch.tensor([1.0, -1.0]), {"length_only": length_only})
    assert out["critic/heldout_ev"] == pytest.approx(0.4220587, abs=1e-6)
    assert out["critic/heldout_ev_length_only"] == pytest.approx(0.0, abs=1e-9)


def test_the_stopping_rule():
    # patience 2, min_delta 0.01, at least 3 steps: 0.10 best, 0.105 (no real gain, 1), 0.12 (gain, reset),
    # 0.125 (1), 0.12 (2) -> stops at step 5
    stop = PlateauStop(100, min_steps=3, patience=2, min_delta=0.01)
    assert [stop.update(ev) for ev in (0.10, 0.105, 0.12, 0.125, 0.12)] == [False, False, False, False, True]
    assert stop.steps == 5 and "plateau" in stop.reason
    # a plateau before min_steps does not stop; NaN is no evidence either way
    stop = PlateauStop(100, min_steps=4, patience=1)
    assert [stop.update(ev) for ev in (0.2, 0.1, float("nan"), 0.1)] == [False, False, False, True]
    # the target stops at once (after min_steps); max_steps always; patience 0 never stops on a plateau
    stop = PlateauStop(100, min_steps=2, target=0.15)
    assert [stop.update(ev) for ev in (0.2, 0.16)] == [False, True] and "target" in stop.reason
    stop = PlateauStop(3)
    assert [stop.update(0.0) for _ in range(3)] == [False, False, True] and "max steps" in stop.reason
    # a restart (the measure changed: held-out responses arrived) judges the plateau afresh, the steps counted on
    stop = PlateauStop(100, patience=2)
    assert [stop.update(ev) for ev in (0.5, 0.4)] == [False, False]
    stop.restart()
    assert [stop.update(ev) for ev in (0.1, 0.2, 0.1, 0.1)] == [False, False, False, True] and stop.steps == 6


SMALL = ["algo.group_size=2", "algo.mini_batch_size=2", "algo.micro_batch_size=2"]


class _Source(SourceBase):
    def __init__(self):
        self.calls = 0

    def next_groups(self, n):
        self.calls += 1
        s = [Trajectory(response_ids=[5, 6], behavior_logprobs=[-0.1, -0.2], finish_reason="stop", reward=r,
                        correct=r > 0, verdict="correct" if r > 0 else "incorrect") for r in (1.0, -1.0)]
        return [Group(uid=f"g{self.calls}", prompt="1+2=", answer="3", prompt_ids=[1, 2], version=0, samples=s)], {}


class _Learner:
    """Pretraining whose held-out EV is scripted."""

    version = 0

    def __init__(self, evs):
        self.evs, self.steps = list(evs), 0

    def pretrain_critic(self, batch):
        self.steps += 1
        return {"critic/value_loss": 1.0, "critic/fresh_ev": -5.0}


def test_value_pretraining_stops_on_the_heldout_ev_and_warns_below_length_only(tmp_path, caplog):
    cfg = load_config([], SMALL + ["algo.value_pretrain_steps=50", "algo.value_pretrain_patience=3",
                           "algo.value_pretrain_min_delta=0.01"])
    learner = _Learner([0.01, 0.03, 0.05, 0.055, 0.05, 0.04, 0.5])
    heldout = lambda: {"critic/heldout_ev": learner.evs[learner.steps - 1],  # noqa: E731
                       "critic/heldout_ev_length_only": 0.06}
    rows = []
    loop = StepLoop(cfg, learner, _Source(), pad_id=0, run_dir=tmp_path, on_row=rows.append, heldout_critic=heldout)
    with caplog.at_level(logging.INFO):
        assert loop.pretrain()
    # best 0.05 at step 3; 0.055, 0.05, 0.04 are no gain above 0.01: stopped after step 6, never reaching 0.5
    assert learner.steps == 6 and [r["critic/heldout_ev"] for r in rows] == [0.01, 0.03, 0.05, 0.055, 0.05, 0.04]
    assert "plateaued" in caplog.text and "no better than length-only" in caplog.text
    # without a stopping rule every step runs (the behaviour before it), judged by the fresh batches' EV
    cfg = load_config([], SMALL + ["algo.value_pretrain_steps=4"])
    learner = _Learner([])
    StepLoop(cfg, learner, _Source(), pad_id=0, run_dir=tmp_path).pretrain()
    assert learner.steps == 4


def test_the_learners_critic_scored_on_heldout_responses(tmp_path):
    """The real path: a Learner's critic on held-out arith responses. A fresh critic has a zero head (V = 0
    everywhere): it explains none of the returns (EV exactly 0), and so does its first pretraining batch before the
    update; the reference levels come with it. Value pretraining's epochs and the critic's own lr warm-up apply."""
    from transformers import AutoTokenizer

    from async_vapo.learner.critic_quality import HeldoutCritic
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.base_model import ensure_base_model
    from async_vapo.tasks import arith, load_task

    cfg = load_config([], ["base_model.hidden_size=32", "base_model.num_layers=1", "base_model.num_heads=2",
                           "base_model.num_kv_heads=1", "base_model.intermediate_size=64", "base_model.sft_steps=3",
                           "base_model.sft_batch_size=8", "task.num_train=100", "task.num_eval=12", "task.max_ops=2",
                           "train.threads=1", "algo.group_size=2", "algo.prompts_per_step=6",
                           "algo.mini_batch_size=12", "algo.micro_batch_size=12", f"model.cache_dir={tmp_path}",
                           "algo.value_pretrain_epochs=2", "optim.critic_warmup_steps=4", "optim.warmup_steps=0"])
    base = ensure_base_model(cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))
    rng = __import__("random").Random(0)
    groups = []
    for p in load_task(cfg)[1][:6]:
        texts = [arith.solution(p), arith.demonstration(p, rng, 1.0)]  # one right, one with every step wrong
        samples = [Trajectory(response_ids=tok(t).input_ids + [tok.eos_token_id], finish_reason="stop",
                              behavior_logprobs=[-1.0] * (len(t) + 1), reward=1.0 if t == texts[0] else -1.0,
                              correct=t == texts[0]) for t in texts]
        groups.append(Group(uid=p.uid, prompt=p.prompt, answer=p.answer, version=0, samples=samples,
                            prompt_ids=tok(p.prompt).input_ids))
    learner = Learner(cfg, base, None)
    m = HeldoutCritic.from_config(cfg, groups, tok.pad_token_id, tok.decode)(learner)
    assert m["critic/heldout_ev"] == 0.0 and m["critic/heldout_responses"] == 12
    # every wrong response slips at once (its first step is wrong), so the slip-aware value explains much
    assert m["critic/heldout_ev_slip_aware"] > 0.3 and abs(m["critic/heldout_ev_length_only"]) < 0.3
    # the verifier reads a box: the answer levels too; a zero critic explains nothing on either side of the decisive
    # token, and the answer-aware level (the true reward once the answer is written) explains more than the prompt mean
    assert m["critic/heldout_ev_before_decisive"] == 0.0 and m["critic/heldout_ev_after_decisive"] == 0.0
    assert m["critic/heldout_ev_answer_aware"] > max(0.3, m["critic/heldout_ev_prompt_mean"])
    assert 0 < m["critic/heldout_after_decisive_fraction"] < 1
    assert learner.pretrain_critic(make_rollout_batch(groups, tok.pad_token_id))["critic/fresh_ev"] == 0.0
    # two passes over the one mini-batch; the critic's own warm-up: its 2nd step at 2/4 of critic_lr
    assert learner.critic_steps == 2
    assert learner.critic_opt.param_groups[0]["lr"] == pytest.approx(cfg.optim.critic_lr * 2 / 4)
    assert HeldoutCritic.from_config(cfg, groups, tok.pad_token_id, tok.decode)(learner)["critic/heldout_ev"] != 0.0


def test_the_run_plot_gains_the_critic_row_when_rows_have_it(tmp_path):
    from PIL import Image

    from async_vapo.experiments.plots import plot_runs

    rows = [{"kind": "eval", "step": s, "wall_s": 60.0 * s, "eval/accuracy": 0.1, "eval/response_length": 20.0,
             "critic/heldout_ev": 0.01 * s, "critic/heldout_ev_length_only": 0.05,
             "critic/heldout_ev_slip_aware": 0.4} for s in range(0, 6, 2)]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "metrics.jsonl").write_text("".join(
        __import__("json").dumps({k: v for k, v in r.items() if not k.startswith("critic")}) + "\n" for r in rows))
    assert Image.open(plot_runs([tmp_path / "a"], tmp_path / "a.png")).size[1] == 1200
    assert Image.open(plot_runs([tmp_path / "b"], tmp_path / "b.png")).size[1] == 800


def test_by_step_reference_of_a_hand_computed_case():
    # correct solution "a;b;X" (3 units). Four responses: two right, one slips at step 1 ("a;c;X"), one at the box
    # ("a;b;Y"). At risk: step 0 all 4 (no slip), step 1 all 4 (1 slip), the box 3 (1 slip):
    # q = [0, 1/4, 1/3]. The overall rate would be 2 / (3 + 3 + 2 + 3) = 2/11 for every step.
    from async_vapo.learner.critic_quality import by_step_reference_values, slip_rate, slip_rates_by_step

    truth = "a;b;X"
    texts = ["a;b;X", "a;b;X", "a;c;X", "a;b;Y"]
    truths = [truth] * 4
    assert slip_rates_by_step(texts, truths) == {3: pytest.approx([0.0, 0.25, 1 / 3])}
    assert slip_rate(texts, truths) == pytest.approx(2 / 11)
    chars = [list(range(6))] * 4
    values = by_step_reference_values(chars, texts, truths, 1.0, -1.0)
    # survive: 3 units left (1)(3/4)(2/3) = 0.5 -> V 0; 2 left (3/4)(2/3) = 0.5 -> 0; 1 left 2/3 -> 1/3
    assert values[0] == pytest.approx([0.0, 0.0, 0.0, 0.0, 1 / 3, 1 / 3])
    assert values[2] == pytest.approx([0.0, 0.0, 0.0, -1.0, -1.0, -1.0])  # its slip (character 2) once in the prefix
    assert values[3] == pytest.approx([0.0, 0.0, 0.0, 0.0, 1 / 3, -1.0])  # the box's slip at character 4
    # rates are per chain length: a 2-unit chain's box is not the 3-unit chain's second step; a position no response
    # reached takes the overall rate
    assert slip_rates_by_step(texts + ["c;Y", "c;Z"], truths + ["c;X", "c;X"]) == {
        3: pytest.approx([0.0, 0.25, 1 / 3]), 2: pytest.approx([0.0, 1.0])}
    assert slip_rates_by_step(["a;c"], ["a;b;X"]) == {3: pytest.approx([0.0, 1.0, 0.5])}


# A word-level "tokenizer" for the answer levels: token id -> its text; decoding joins the pieces (the decode is input
# to the functions, as a real tokenizer's would be).
_PIECES = ["Max", " has", " 5", " +", " 4", " =", " 9", " cookies", ".", "\nAnswer", ":", " -", " 1", ",", " no", " 19",
           "4", "9"]


def _decode(ids):
    return "".join(_PIECES[i] for i in ids)


def _ids(*pieces):
    return [_PIECES.index(p) for p in pieces]


def test_the_decisive_token():
    from async_vapo.learner.critic_quality import decisive_char, extracted_answer, prefix_chars

    def decisive_token(ids, answer_format="answer_line"):
        text = _decode(ids)
        d = decisive_char(text, extracted_answer(text, answer_format))
        # the decisive token: the last one whose text starts at or before the decisive character
        return None if d is None else max(t for t, c in enumerate(prefix_chars(ids, _decode)) if c <= d)

    # "Max has 5 + 4 = 9 cookies.\nAnswer: 9": the 9 after "=" (token 6), not the answer line's (token 11)
    ids = _ids("Max", " has", " 5", " +", " 4", " =", " 9", " cookies", ".", "\nAnswer", ":", " 9")
    assert prefix_chars(ids, _decode)[:4] == [0, 3, 7, 9]
    assert decisive_token(ids) == 6
    # no "=": the last token of the extracted answer
    assert decisive_token(_ids("Max", " has", " 9", " cookies", ".", "\nAnswer", ":", " 9")) == 7
    # "= 1" (wrong), then "= 9": the first number after an "=" that equals the answer is the second; "= 19" is not 9
    assert decisive_token(_ids("Max", " has", " 5", " -", " 4", " =", " 1", ",", " no", " =", " 19", ",", " no",
                               " 5", " +", " 4", " =", " 9", "\nAnswer", ":", " 9")) == 17
    # no extracted answer (no "Answer:" line): no decisive token, whatever the "=" says
    assert decisive_token(_ids("Max", " has", " 5", " +", " 4", " =", " 9", " cookies", ".")) is None
    # a number written in two tokens (" 1", "4"): its last one decides
    assert decisive_token(_ids("Max", " has", " 9", " +", " 5", " =", " 1", "4", "\nAnswer", ":", " 1", "4")) == 7
    # the answer the verifier extracted is wrong: its own number decides ("= 1", answer 1), the "= 9" does not
    assert decisive_token(_ids("Max", " has", " 5", " -", " 4", " =", " 1", ",", " no", " =", " 9", "\nAnswer", ":",
                               " 1")) == 6


def test_prompt_mean_and_answer_aware_levels_of_a_hand_computed_case():
    from async_vapo.learner.critic_quality import answer_reference_values

    # prompt A sampled 3 times (rewards +1, +1, -1), prompt B once (-1); 3 tokens each, starting at characters 0, 2, 4.
    # Decisive characters: 1 (states after tokens 0 have seen it: tokens 1, 2), none (no answer), 3 (token 2), 5
    # (none). Global mean 0; leave-one-out means A: (1 - 1) / 2 = 0, 0, (1 + 1) / 2 = 1; B alone: the global mean 0.
    prefix = [[0, 2, 4]] * 4
    refs, seen = answer_reference_values(prefix, [1, None, 3, 5], [1.0, 1.0, -1.0, -1.0], ["A", "A", "A", "B"])
    assert seen == [[False, True, True], [False] * 3, [False, False, True], [False] * 3]
    assert refs["prompt_mean"] == [[0.0] * 3, [0.0] * 3, [1.0] * 3, [0.0] * 3]
    # answer-aware before the decisive token: global 0 gives EV 37/144 (G - V = [1,0,0 | 1,1,1 | -1,-1,0 | -1,-1,-1],
    # mean -1/12, E[(G-V)^2] = 9/12, Var(G) = 1); the prompt means give -0.1875: the global mean is kept
    assert refs["answer_aware"] == [[0.0, 1.0, 1.0], [0.0] * 3, [0.0, 0.0, -1.0], [0.0] * 3]
    mask = torch.ones(4, 3)
    rewards = torch.tensor([1.0, 1.0, -1.0, -1.0])
    out = heldout_metrics(torch.tensor(refs["answer_aware"]), mask, rewards, refs, seen=torch.tensor(seen),
                          split=("prompt_mean",))
    assert out["critic/heldout_ev_answer_aware"] == pytest.approx(37 / 144, abs=1e-12)
    # prompt mean: G - V = [1 x3 | 1 x3 | -2 x3 | -1 x3], mean -0.25, E[(G-V)^2] = 21/12 -> EV 1 - 1.6875 = -0.6875
    assert out["critic/heldout_ev_prompt_mean"] == pytest.approx(-0.6875, abs=1e-12)
    # split: after the decisive token the answer-aware value is the return (EV 1); before it, 0 everywhere (EV 0);
    # the prompt mean before it: G - V = [1 | 1,1,1 | -2,-2 | -1,-1,-1], Var 14/9, Var(G) = 80/81 -> EV -0.575
    assert out["critic/heldout_ev_after_decisive"] == pytest.approx(1.0, abs=1e-12)
    assert out["critic/heldout_ev_before_decisive"] == pytest.approx(0.0, abs=1e-12)
    assert out["critic/heldout_ev_prompt_mean_before_decisive"] == pytest.approx(-0.575, abs=1e-12)
    assert "critic/heldout_ev_answer_aware_before_decisive" not in out
    # prompts whose samples agree: the prompt mean is exact (EV 1) and the answer-aware level takes it before the
    # decisive token
    refs, _ = answer_reference_values([[0, 1]] * 4, [None, 0, None, None], [1.0, 1.0, -1.0, -1.0], [0, 0, 1, 1])
    assert refs["prompt_mean"] == [[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [-1.0, -1.0]]
    assert refs["answer_aware"] == refs["prompt_mean"]


def test_the_states_that_have_seen_the_decisive_token():
    from async_vapo.learner.critic_quality import answer_references

    # "Max has 5 + 4 =9\nAnswer: 9": the decisive token "9" (token 5) starts at character 15; the state before it
    # (its value at token 5) has not seen it, the states before tokens 6, 7, 8 have
    ids = _ids("Max", " has", " 5", " +", " 4", " =", "9", "\nAnswer", ":", " 9")
    samples = [Trajectory(response_ids=ids, finish_reason="stop", behavior_logprobs=[-1.0] * len(ids), reward=r)
               for r in (1.0, -1.0)]
    group = Group(uid="u", prompt="p", answer="9", version=0, samples=samples, prompt_ids=[0])
    refs, seen = answer_references([group], _decode, "answer_line")
    assert _decode(ids) == "Max has 5 + 4 =9\nAnswer: 9"
    assert seen[0] == [False] * 7 + [True] * 3
    # one prompt sampled twice: leave-one-out means -1 and +1 (EV far below the global mean 0's), so the answer-aware
    # level is 0 before the decisive token, the reward after it
    assert refs["prompt_mean"] == [[-1.0] * 10, [1.0] * 10]
    assert refs["answer_aware"] == [[0.0] * 7 + [1.0] * 3, [0.0] * 7 + [-1.0] * 3]
    assert answer_references([group], _decode, "solution") is None
