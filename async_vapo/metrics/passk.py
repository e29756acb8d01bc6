"""Evaluation metrics from per-problem verdicts: accuracy, avg@k, pass@k, and each by difficulty.

Pure functions of booleans (no engine, no I/O): ``rollout.generate.evaluate`` (in-training evaluation and
``async-vapo eval``) computes every evaluation figure here.

* ``avg@n``: the mean over problems of the fraction of a problem's n samples that are correct (the paper's
  AIME24 avg@32). Its expectation is the same for every k ≤ n, so it is reported once, at the n sampled.
  With the same n for every problem it equals ``accuracy`` (the mean over all samples).
* ``pass@k``: the probability that at least one of k samples is correct, estimated without bias from n ≥ k
  samples of which c are correct (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1):
  ``1 - C(n - c, k) / C(n, k)``, averaged over problems. Computed with exact integers, not the running
  product, so it holds for any n.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per problem, got n={n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... below ``n``, and ``n``."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def difficulty(meta: Mapping) -> str | None:
    """A problem's difficulty label, where its task has one: ``ops<n>`` for chain arithmetic (``n_ops``),
    else a problem file's ``difficulty`` / ``level`` field."""
    if "n_ops" in meta:
        return f"ops{int(meta['n_ops'])}"
    if meta.get("difficulty") is not None:
        return str(meta["difficulty"])
    return None


def summarize(correct: Sequence[Sequence[bool]], ks: Sequence[int], *, labels: Sequence[str | None] = (),
              prefix: str = "eval") -> dict[str, float]:
    """Accuracy, ``avg@n`` and ``pass@k`` of problems with the given per-sample verdicts (``correct[i]``: problem
    i's samples), overall and per difficulty label (``labels[i]``; keys ``<prefix>/accuracy_<label>``,
    ``<prefix>/pass@<k>_<label>``). Every problem needs at least ``max(ks)`` samples."""
    if not correct:
        raise ValueError("no problems to summarize")
    n_min = min(len(c) for c in correct)
    if ks and max(ks) > n_min:
        raise ValueError(f"pass@{max(ks)} needs at least {max(ks)} samples of every problem; one has {n_min}")
    out = _block(correct, ks, prefix, "")
    if any(x is not None for x in labels):
        by: dict[str, list[Sequence[bool]]] = defaultdict(list)
        for c, label in zip(correct, labels, strict=True):
            if label is not None:
                by[label].append(c)
        for label in sorted(by, key=_natural):
            out.update(_block(by[label], ks, prefix, f"_{label}", avg=False))
    return out


def _block(correct: Sequence[Sequence[bool]], ks: Sequence[int], prefix: str, suffix: str, *,
           avg: bool = True) -> dict[str, float]:
    samples = sum(len(c) for c in correct)
    out = {f"{prefix}/accuracy{suffix}": sum(sum(c) for c in correct) / samples}
    ns = {len(c) for c in correct}
    if avg and len(ns) == 1:
        out[f"{prefix}/avg@{ns.pop()}{suffix}"] = sum(sum(c) / len(c) for c in correct) / len(correct)
    for k in ks:
        out[f"{prefix}/pass@{k}{suffix}"] = sum(pass_at_k(len(c), sum(c), k) for c in correct) / len(correct)
    return out


def _natural(label: str) -> tuple:
    digits = "".join(ch for ch in label if ch.isdigit())
    return (label.rstrip("0123456789"), int(digits) if digits else -1, label)
