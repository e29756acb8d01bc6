"""How good the critic is, on responses it never trained on, beside value functions that know less or more.

The critic's targets are Monte-Carlo returns (λ_critic = 1, γ = 1: every token of a response has its final reward
as target), so its quality is the explained variance of those returns by the value of the state before each response
token, 1 − Var(G − V) / Var(G) over valid tokens (``algo.explained_variance``; 0 for the mean, 1 for a perfect
value). Measured on **held-out** responses (the evaluation's samples of held-out problems, or a pretraining batch
before the critic trains on it), not on the batch it is fitted to: a critic can memorise its batches, its training
EV rising while its held-out EV falls.

Reference levels on the same responses, where the task can tell (the embedded chain arithmetic, whose correct
solution is known from the prompt; ``benchmarks/critic_ceiling.py`` computes the same):

- **length only** knows the problem's number of steps n, not what has been written:
  V = r⁻ + (r⁺ − r⁻)(1 − q)^(n + 1), with q the per-step slip rate fitted on the same responses (n steps and the box);
- **slip-aware** also knows whether the prefix has already gone wrong (the first character that differs from the
  correct solution): V = r⁻ once that character is in the prefix, before it r⁻ + (r⁺ − r⁻)(1 − q)^m with m the steps
  (and box) not yet finished;
- **slip-aware by step** is the same with a slip rate for each chain length n and step position j (q_nj: slips at
  step j of n-step chains over the responses still right when they reach it, fitted on the same responses), before
  the slip V = r⁻ + (r⁺ − r⁻) Π (1 − q_nj) over the steps not yet finished: fair where slips are likelier late in a
  chain, as on the long task's base, where one rate for every step predicts high values until the slip and scores far
  below 0. (Rates by position alone, pooled over lengths, are no better there: the end of a short chain is riskier
  than the same position in a long one.)

A critic no better than *length only* has learned nothing a response's text tells; *slip-aware* is what a critic that
reads the prefix could reach (0.375 on the long task's base-model samples, length only 0.047).

Where the verifier extracts an answer (``verifier.answer_format`` boxed, answer_line or auto; the word problems, the
file tasks, the arith task's boxed numbers), two more levels, from the responses' rewards and where their answer is
decided (:func:`answer_references`):

- **prompt mean** values every state of a response at its prompt's leave-one-out success rate, the mean reward of
  the other samples of the same prompt (the global mean of the responses for a prompt sampled once): the best a
  prompt-only baseline (GRPO's group mean) can do, known before any token is written;
- **answer-aware** knows the outcome once it is written: the true reward at every state after the **decisive token**,
  before it the better (by EV on the same responses) of the global mean and the prompt-mean level. The decisive token
  is the last token of the first number after an "=" that equals the answer the verifier extracted ("Max has
  5 + 4 = 9 cookies.\nAnswer: 9": the 9 after "="); without such a number, the last token of the extracted answer; a
  response without an extracted answer has none and keeps its before-value throughout.

The critic's EV is also split at the decisive token (``_before_decisive``: states that have not seen it, where the
prompt-mean level is the bar; ``_after_decisive``: states that have, where reading the answer is everything).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from fractions import Fraction

import torch

from async_vapo.algo import explained_variance

__all__ = ["PlateauStop", "answer_reference_values", "answer_references", "arith_reference_values", "arith_references",
           "by_step_reference_values", "decisive_char", "extracted_answer", "first_error", "heldout_metrics",
           "prefix_chars", "slip_rate", "slip_rates_by_step"]


def first_error(text: str, truth: str) -> int | None:
    """Index of the first character where ``text`` departs from the correct solution ``truth``; None when equal.
    A response that stops early (a prefix of ``truth``) departs at its end."""
    if text == truth:
        return None
    return next((j for j in range(min(len(text), len(truth))) if text[j] != truth[j]), min(len(text), len(truth)))


def slip_rate(texts: Sequence[str], truths: Sequence[str]) -> float:
    """Per-step slip rate q: slips over the steps (and boxes) at risk, each response at risk up to its first slip."""
    slips = at_risk = 0
    for text, truth in zip(texts, truths, strict=True):
        k = first_error(text, truth)
        slips += k is not None
        at_risk += truth.count(";") + 1 if k is None else truth[:k].count(";") + 1
    return slips / max(at_risk, 1)


def slip_rates_by_step(texts: Sequence[str], truths: Sequence[str]) -> dict[int, list[float]]:
    """q_nj for each chain of n units (steps and the box) and position j (the box is the last): slips at step j over
    the responses still right when they reach it. A position no response reached gets the overall rate
    (:func:`slip_rate`)."""
    slips: dict[int, list[int]] = {}
    at_risk: dict[int, list[int]] = {}
    for text, truth in zip(texts, truths, strict=True):
        k = first_error(text, truth)
        units = truth.count(";") + 1
        reached = units if k is None else truth[:k].count(";") + 1  # steps at risk, the slipped one included
        s, n = slips.setdefault(units, [0] * units), at_risk.setdefault(units, [0] * units)
        for j in range(reached):
            n[j] += 1
        if k is not None:
            s[reached - 1] += 1
    overall = slip_rate(texts, truths)
    return {units: [s / n if n else overall for s, n in zip(slips[units], at_risk[units], strict=True)]
            for units in slips}


def by_step_reference_values(prefix_chars: Sequence[Sequence[int]], texts: Sequence[str], truths: Sequence[str],
                             reward_correct: float, reward_incorrect: float,
                             rates: dict[int, Sequence[float]] | None = None) -> list[list[float]]:
    """The slip-aware-by-step value of the state before each response token (the module docstring); ``rates``: q_nj
    by chain units n, None = fitted on these responses (:func:`slip_rates_by_step`); a length without rates takes
    the overall rate."""
    rates = slip_rates_by_step(texts, truths) if rates is None else rates
    overall = slip_rate(texts, truths)
    lo, span = reward_incorrect, reward_correct - reward_incorrect
    out = []
    for chars, text, truth in zip(prefix_chars, texts, truths, strict=True):
        k, units = first_error(text, truth), truth.count(";") + 1
        # survive[d]: the chance of finishing right with steps d .. units-1 still to come
        survive = [1.0] * (units + 1)
        qs = rates.get(units) or [overall] * units
        for j in range(units - 1, -1, -1):
            survive[j] = survive[j + 1] * (1 - qs[j])
        out.append([lo if k is not None and c > k else lo + span * survive[min(truth[:c].count(";"), units)]
                    for c in chars])
    return out


def arith_reference_values(prefix_chars: Sequence[Sequence[int]], texts: Sequence[str], truths: Sequence[str],
                           reward_correct: float, reward_incorrect: float, q: float | None = None
                           ) -> tuple[list[list[float]], list[list[float]]]:
    """(length-only, slip-aware) value of the state before each response token (see the module docstring).
    ``prefix_chars[i][t]``: characters of response i's text before its token t (t for a character tokenizer).
    ``q``: the slip rate; None = fitted on these responses (:func:`slip_rate`)."""
    q = slip_rate(texts, truths) if q is None else q
    lo, span = reward_incorrect, reward_correct - reward_incorrect
    length_only, slip_aware = [], []
    for chars, text, truth in zip(prefix_chars, texts, truths, strict=True):
        k, units = first_error(text, truth), truth.count(";") + 1
        length_only.append([lo + span * (1 - q) ** units] * len(chars))
        slip_aware.append([lo if k is not None and c > k else lo + span * (1 - q) ** (units - truth[:c].count(";"))
                           for c in chars])
    return length_only, slip_aware


ANSWER_FORMATS_EXTRACTED = ("boxed", "answer_line", "auto")
"""The verifier's answer formats that extract an answer from the response (:func:`answer_references` applies)."""
_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
_AFTER_EQUALS = re.compile(r"=\s*(-?[0-9]+(?:\.[0-9]+)?)")


def extracted_answer(text: str, answer_format: str) -> tuple[str, int] | None:
    """The answer the verifier reads in ``text`` (``verify.check.extract_prediction``; with ``auto`` and no box or
    ``Answer:`` line, math-verify's reading of the whole response) and the index of its last character in ``text``
    (its last occurrence; the text's last character when math-verify's reading is not written verbatim); None when
    the verifier finds no answer."""
    from async_vapo.verify.check import extract_prediction, normalize_answer

    pred = extract_prediction(text, answer_format)  # type: ignore[arg-type]
    if pred is None and answer_format == "auto":
        from math_verify import parse

        parsed = parse(text)
        pred = str(parsed[-1]) if parsed else None
    if pred is None or not normalize_answer(pred):
        return None
    pred = pred.strip()
    at = text.rfind(pred)
    return pred, (at + len(pred) - 1 if at >= 0 else len(text) - 1)


def decisive_char(text: str, extracted: tuple[str, int] | None) -> int | None:
    """Index in ``text`` of the last character of its decisive token's text (module docstring): the end of the first
    number right after an "=" equal to the extracted answer's number (its last number), else the end of the extracted
    answer; None without an extracted answer (:func:`extracted_answer`)."""
    if extracted is None:
        return None
    pred, end = extracted
    numbers = _NUMBER.findall(pred)
    if numbers:
        value = Fraction(numbers[-1])
        for m in _AFTER_EQUALS.finditer(text):
            if Fraction(m.group(1)) == value:
                return m.end(1) - 1
    return end


def prefix_chars(ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
    """Characters of the response's text before each of its tokens: ``len(decode(ids[:t]))`` (a token's text may
    depend on its neighbours in a BPE tokenizer, so prefixes are decoded whole)."""
    return [len(decode(list(ids[:t]))) if t else 0 for t in range(len(ids))]


def _flat_ev(values: Sequence[Sequence[float]], rewards: Sequence[float]) -> float:
    v = torch.tensor([x for row in values for x in row], dtype=torch.float64)[None]
    g = torch.tensor([r for row, r in zip(values, rewards, strict=True) for _ in row], dtype=torch.float64)[None]
    return float(explained_variance(v, g, torch.ones_like(v)))


def answer_reference_values(prefix: Sequence[Sequence[int]], decisive: Sequence[int | None], rewards: Sequence[float],
                            prompts: Sequence[Hashable]) -> tuple[dict[str, list[list[float]]], list[list[bool]]]:
    """The prompt-mean and answer-aware values of the state before each response token (module docstring), and
    which of those states have seen the decisive token. ``prefix[i][t]``: characters of response i before its token t
    (:func:`prefix_chars`); ``decisive[i]``: its decisive character (:func:`decisive_char`); ``prompts[i]``: what
    groups response i with the other samples of its prompt. The answer-aware level's before-value is the better of the
    global mean and the prompt mean by EV on these responses (the global mean on a tie, or when rewards do not
    vary)."""
    n = len(rewards)
    total = sum(rewards)
    glob = total / n if n else 0.0
    sums: dict[Hashable, list[float]] = {}
    for p, r in zip(prompts, rewards, strict=True):
        acc = sums.setdefault(p, [0.0, 0])
        acc[0] += r
        acc[1] += 1
    loo = [(sums[p][0] - r) / (sums[p][1] - 1) if sums[p][1] > 1 else glob for p, r in zip(prompts, rewards,
                                                                                              strict=True)]
    seen = [[d is not None and c > d for c in chars] for chars, d in zip(prefix, decisive, strict=True)]
    prompt_mean = [[m] * len(chars) for chars, m in zip(prefix, loo, strict=True)]

    def aware(before: Sequence[float]) -> list[list[float]]:
        return [[r if s else b for s in row] for row, r, b in zip(seen, rewards, before, strict=True)]

    with_global, with_prompt = aware([glob] * n), aware(loo)
    ev_global, ev_prompt = _flat_ev(with_global, rewards), _flat_ev(with_prompt, rewards)
    better = with_prompt if ev_prompt == ev_prompt and not ev_prompt <= ev_global else with_global
    return {"prompt_mean": prompt_mean, "answer_aware": better}, seen


def answer_references(groups, decode: Callable[[Sequence[int]], str], answer_format: str
                      ) -> tuple[dict[str, list[list[float]]], list[list[bool]]] | None:
    """The prompt-mean and answer-aware values of ``groups``' responses (one row per sample, groups in order) and the
    states after each one's decisive token (:func:`answer_reference_values`), its text read with ``decode`` as the
    verifier reads it; None when the verifier extracts no answer (``answer_format`` "solution")."""
    if answer_format not in ANSWER_FORMATS_EXTRACTED:
        return None
    prefix, decisive, rewards, prompts = [], [], [], []
    for k, g in enumerate(groups):
        for s in g.samples:
            ids = list(s.response_ids)
            text = decode(ids)
            prefix.append(prefix_chars(ids, decode))
            decisive.append(decisive_char(text, extracted_answer(text, answer_format)))
            rewards.append(float(s.reward))
            prompts.append(k)
    return answer_reference_values(prefix, decisive, rewards, prompts)


def _pad(rows: Sequence[Sequence[float]], shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float64)[: shape[1]]
    return out


def heldout_metrics(values: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor,
                    references: dict[str, Sequence[Sequence[float]]] | None = None,
                    prefix: str = "critic/heldout_ev", seen: torch.Tensor | None = None,
                    split: Sequence[str] = ()) -> dict[str, float]:
    """Explained variance of the Monte-Carlo returns (each response's reward on each of its tokens) by the critic's
    ``values`` ``[B, T]`` over ``mask``'s tokens: ``<prefix>``; and by each reference value function (name -> one list
    of per-token values per response): ``<prefix>_<name>``. NaN when the returns do not vary. With ``seen`` ``[B, T]``
    (the states after the decisive token), the critic's EV over the tokens before and after it as well,
    ``<prefix>_before_decisive`` / ``<prefix>_after_decisive``, and so for the references named in ``split``."""
    returns = rewards.to(torch.float64)[:, None].expand(values.shape)
    scored = {"": values.to(torch.float64)}
    scored |= {f"_{name}": _pad(ref, tuple(values.shape)) for name, ref in (references or {}).items()}
    out = {}
    for name, v in scored.items():
        out[f"{prefix}{name}"] = float(explained_variance(v, returns, mask))
        if seen is not None and (not name or name[1:] in split):
            for side, m in (("before", mask * ~seen), ("after", mask * seen)):
                out[f"{prefix}{name}_{side}_decisive"] = float(explained_variance(v, returns, m))
    return out


def arith_references(groups, decode: Callable[[Sequence[int]], str], reward_correct: float,
                     reward_incorrect: float) -> dict[str, list[list[float]]] | None:
    """The reference values of ``groups``' responses (one row per sample, groups in order) on the embedded chain
    arithmetic; None when a prompt is not one of its chains (the task cannot tell)."""
    from async_vapo.tasks import arith
    from async_vapo.tasks.task import Problem

    texts, truths, chars = [], [], []
    for g in groups:
        try:
            truth = arith.solution(Problem(uid=g.uid, prompt=g.prompt, answer=g.answer))
        except ValueError:
            return None
        for s in g.samples:
            ids = list(s.response_ids)
            lens = [len(decode([i])) for i in ids]
            chars.append([sum(lens[:t]) for t in range(len(ids))])
            texts.append(decode(ids))
            truths.append(truth)
    length_only, slip_aware = arith_reference_values(chars, texts, truths, reward_correct, reward_incorrect)
    by_step = by_step_reference_values(chars, texts, truths, reward_correct, reward_incorrect)
    return {"length_only": length_only, "slip_aware": slip_aware, "slip_aware_by_step": by_step}


class PlateauStop:
    """When value pretraining stops on evidence: after each step's held-out EV, stop once ``max_steps`` are done; or,
    from ``min_steps`` on, once the EV reaches ``target`` (None: no target), or once ``patience`` steps in a row have
    not raised the best EV so far by more than ``min_delta`` (patience 0: never on a plateau). A NaN EV (returns that
    do not vary) is no evidence: it neither improves nor counts against patience."""

    def __init__(self, max_steps: int, *, min_steps: int = 0, patience: int = 0, min_delta: float = 0.0,
                 target: float | None = None):
        self.max_steps, self.min_steps, self.patience = max_steps, min_steps, patience
        self.min_delta, self.target = min_delta, target
        self.best, self.since_best, self.steps = float("-inf"), 0, 0
        self.reason = ""

    def restart(self) -> None:
        """Judge the plateau afresh from the next step (the EV measured changed: the held-out responses arrived);
        the step count and its bounds stay."""
        self.best, self.since_best = float("-inf"), 0

    def update(self, ev: float) -> bool:
        """Record one step's held-out EV; True when pretraining is to stop now (``reason`` says why)."""
        self.steps += 1
        if ev == ev:  # not NaN
            if ev > self.best + self.min_delta:
                self.best, self.since_best = ev, 0
            else:
                self.since_best += 1
                self.best = max(self.best, ev)
        if self.steps >= self.max_steps:
            self.reason = f"max steps ({self.max_steps})"
        elif self.steps < self.min_steps:
            return False
        elif self.target is not None and ev == ev and ev >= self.target:
            self.reason = f"held-out EV {ev:.3f} reached the target {self.target}"
        elif self.patience and self.since_best >= self.patience:
            self.reason = (f"held-out EV plateaued: no gain above {self.min_delta} in {self.patience} steps "
                           f"(best {self.best:.3f})")
        else:
            return False
        return True


class HeldoutCritic:
    """The critic's quality on a fixed set of held-out responses (``groups``, e.g. an evaluation's samples): the
    batch and the reference levels are made once, each call scores the learner's current critic.

    ``decode``: response ids -> text as the verifier reads it (for the references' per-token prefixes and the
    extracted answers); ``references``: compute the chain-arithmetic levels (the embedded chain arithmetic only);
    ``answer_format``: the verifier's, for the prompt-mean and answer-aware levels and the split at the decisive token
    (None, or a format that extracts no answer: without them). Without any, the metrics hold the critic's EV alone."""

    def __init__(self, groups, pad_id: int, decode: Callable[[Sequence[int]], str], *, reward_correct: float,
                 reward_incorrect: float, references: bool = True, answer_format: str | None = None):
        from async_vapo.learner.vapo import make_rollout_batch

        self.groups = [g for g in groups if g.samples]
        self.batch = make_rollout_batch(self.groups, pad_id)
        self.references = (arith_references(self.groups, decode, reward_correct, reward_incorrect)
                           if references else None)
        answers = answer_references(self.groups, decode, answer_format) if answer_format else None
        self.seen: torch.Tensor | None = None
        if answers is not None:
            self.references = (self.references or {}) | answers[0]
            shape = tuple(self.batch.tokens.response_mask.shape)
            self.seen = _pad([[float(x) for x in row] for row in answers[1]], shape).bool()  # type: ignore[arg-type]
        self._fixed: dict[str, float] | None = None

    @classmethod
    def from_config(cls, cfg, groups, pad_id: int, decode: Callable[[Sequence[int]], str]) -> HeldoutCritic:
        v = cfg.verifier
        return cls(groups, pad_id, decode, reward_correct=v.reward_correct, reward_incorrect=v.reward_incorrect,
                   references=cfg.task.kind == "arith",
                   answer_format=None if v.reward_fn else v.answer_format)

    def __call__(self, learner) -> dict[str, float]:
        values = learner.critic_values(self.batch).cpu()
        mask, rewards = self.batch.tokens.response_mask, self.batch.rewards
        if self._fixed is None:  # the references do not change with the critic
            critic = heldout_metrics(values, mask, rewards, seen=self.seen)
            self._fixed = {k: x for k, x in heldout_metrics(values, mask, rewards, self.references, seen=self.seen,
                                                            split=("prompt_mean",)).items() if k not in critic}
            self._fixed["critic/heldout_responses"] = float(len(rewards))
            if self.seen is not None:
                m = mask.bool()
                self._fixed["critic/heldout_after_decisive_fraction"] = float(self.seen[m].float().mean())
        return heldout_metrics(values, mask, rewards, seen=self.seen) | self._fixed
