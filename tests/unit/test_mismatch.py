"""Rollout–learner mismatch measures and the behaviour corrections (``async_vapo.algo.mismatch``), their config
switches, and the learner's use of them."""

import math

import pytest
import torch
from torch.testing import assert_close

from async_vapo.algo.losses import loss_normalizer, microbatch_weight, policy_loss
from async_vapo.algo.mismatch import behavior_log_ratio, is_weights, mismatch_metrics, rejection_mask

F64 = torch.float64
NAN = math.nan
TOL = {"atol": 1e-12, "rtol": 0.0}
e = math.exp

# The worked case of most tests. Row 0: three valid tokens, the third without an engine log-prob (NaN), one pad.
# Row 1: four valid tokens.
#   log ρ row 0 = [-1 - (-1.5), -2 - (-1), (NaN: 0), pad 0] = [0.5, -1.0, 0, 0]
#   log ρ row 1 = [0, -0.2 - (-0.1), -0.2 - (-0.4), 0]     = [0, -0.1, 0.2, 0]
PROX = [[-1.0, -2.0, -0.5, -3.0], [-0.2, -0.2, -0.2, -0.2]]
BEHAV = [[-1.5, -1.0, NAN, 0.0], [-0.2, -0.1, -0.4, -0.2]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
LOG_RATIO = [[0.5, -1.0, 0.0, 0.0], [0.0, -0.1, 0.2, 0.0]]


def t(x, dtype=F64):
    return torch.tensor(x, dtype=dtype)


def mask():
    return torch.tensor(MASK, dtype=torch.bool)


def log_ratio():
    return behavior_log_ratio(t(PROX), t(BEHAV), mask())


def floats(metrics):
    return {k: float(v) for k, v in metrics.items()}


# ---------------------------------------------------------------- log ratio and the measures


def test_log_ratio_is_proximal_minus_behaviour_and_zero_off_the_measured_tokens():
    assert_close(log_ratio(), t(LOG_RATIO), **TOL)


def test_mismatch_metrics_hand_computed():
    # k3 = (ρ − 1) − log ρ per measured token (the NaN one is not measured: 6 of 7 valid tokens):
    #   row 0: e^0.5 − 1.5 = 0.1487212707001282,  e^−1 − 1 + 1 = 0.36787944117144233
    #   row 1: 0, e^−0.1 − 0.9 = 0.004837418035959523, e^0.2 − 1.2 = 0.021402758160169844, 0
    #   token mean = 0.5428408880676998 / 6 = 0.09047348134461664
    # |log ρ|: mean (0.5 + 1 + 0 + 0.1 + 0.2 + 0) / 6 = 0.3, max 1.0
    # per sequence: Σ k3 = 0.5166007118715705 and 0.026240176196129367, mean 0.27142044403384996;
    #   |Σ log ρ| = |0.5 − 1| = 0.5 and |−0.1 + 0.2| = 0.1: mean 0.3, max 0.5
    # lags [0, 2]: lag0 = row 0's 2 measured tokens (k3 0.25830035593578526, |log ρ| mean 0.75, max 1, share 2/6);
    #   lag1 empty (0, share 0); lag2plus = row 1 (k3 0.026240176196129367 / 4, |log ρ| 0.3 / 4, max 0.2, share 4/6)
    got = floats(mismatch_metrics(t(PROX), t(BEHAV), mask(), torch.tensor([0, 2])))
    want = {
        "k3": 0.09047348134461664, "abs_log_ratio_mean": 0.3, "abs_log_ratio_max": 1.0,
        "seq_k3": 0.27142044403384996, "seq_abs_log_ratio_mean": 0.3, "seq_abs_log_ratio_max": 0.5,
        "measured_frac": 6 / 7,
        "lag0/k3": 0.25830035593578526, "lag0/abs_log_ratio_mean": 0.75, "lag0/abs_log_ratio_max": 1.0,
        "lag0/token_frac": 2 / 6,
        "lag1/k3": 0.0, "lag1/abs_log_ratio_mean": 0.0, "lag1/abs_log_ratio_max": 0.0, "lag1/token_frac": 0.0,
        "lag2plus/k3": 0.026240176196129367 / 4, "lag2plus/abs_log_ratio_mean": 0.075,
        "lag2plus/abs_log_ratio_max": 0.2, "lag2plus/token_frac": 4 / 6,
    }
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k


def test_mismatch_metrics_accept_per_token_lags():
    per_seq = floats(mismatch_metrics(t(PROX), t(BEHAV), mask(), torch.tensor([0, 2])))
    per_token = floats(mismatch_metrics(t(PROX), t(BEHAV), mask(), torch.tensor([[0, 0, 0, 0], [2, 2, 2, 2]])))
    assert per_token == per_seq
    # Row 1's last two tokens one version old instead: lag1 = {0.2, 0} (k3 0.021402758160169844 / 2),
    # lag2plus = {0, −0.1} (k3 0.004837418035959523 / 2)
    split = floats(mismatch_metrics(t(PROX), t(BEHAV), mask(), torch.tensor([[0, 0, 0, 0], [2, 2, 1, 1]])))
    assert split["lag1/k3"] == pytest.approx(0.021402758160169844 / 2, abs=1e-12)
    assert split["lag2plus/k3"] == pytest.approx(0.004837418035959523 / 2, abs=1e-12)
    assert split["lag1/token_frac"] == split["lag2plus/token_frac"] == pytest.approx(2 / 6)
    # negative lags fall in no bucket
    assert floats(mismatch_metrics(t(PROX), t(BEHAV), mask(), torch.tensor([-1, -1])))["lag0/token_frac"] == 0.0


def test_mismatch_of_identical_policies_is_zero_and_k3_matches_a_loop():
    torch.manual_seed(0)
    lp = -torch.rand(3, 6, dtype=F64) * 3
    m = torch.rand(3, 6) > 0.3
    same = floats(mismatch_metrics(lp, lp.clone(), m))
    assert all(v == 0.0 for k, v in same.items() if k != "measured_frac")
    behav = lp + torch.randn(3, 6, dtype=F64) * 0.5
    k3s = [e(p - b) - 1 - (p - b) for p, b, v in zip(lp.flatten().tolist(), behav.flatten().tolist(),
                                                     m.flatten().tolist(), strict=True) if v]
    got = mismatch_metrics(lp, behav, m)
    assert float(got["k3"]) == pytest.approx(sum(k3s) / len(k3s), abs=1e-12)
    assert float(got["k3"]) > 0


# ---------------------------------------------------------------- truncated importance weights


def test_token_weights_hand_computed():
    # cap 1.5: row 0 [min(e^0.5 = 1.6487, 1.5) = 1.5, e^−1, 1 (NaN behaviour), pad 1];
    #          row 1 [1, e^−0.1, e^0.2 = 1.2214, 1]. One of 7 valid tokens truncated.
    #   mean = (1.5 + 0.36787944 + 1 + 1 + 0.90483742 + 1.22140276 + 1) / 7 = 0.9991599453382245
    w, m = is_weights(log_ratio(), mask(), "token", 1.5)
    assert_close(w, t([[1.5, e(-1), 1.0, 1.0], [1.0, e(-0.1), e(0.2), 1.0]]), **TOL)
    assert floats(m) == pytest.approx({"weight_mean": 0.9991599453382245, "weight_max": 1.5,
                                       "truncated_frac": 1 / 7}, abs=1e-12)


def test_sequence_and_geometric_weights_hand_computed():
    # sequence: Π ρ = e^(0.5 − 1) = e^−0.5 = 0.6065 on row 0's valid tokens, e^(−0.1 + 0.2) = e^0.1 on row 1's
    w, m = is_weights(log_ratio(), mask(), "sequence", 5.0)
    assert_close(w, t([[e(-0.5)] * 3 + [1.0], [e(0.1)] * 4]), **TOL)
    assert float(m["truncated_frac"]) == 0.0
    # geometric: exp(−0.5 / 3) = 0.8465 (3 valid tokens, the NaN one counts as log ρ = 0), exp(0.1 / 4) = 1.0253;
    # cap 1.02 truncates row 1: 4 of 7 tokens
    w, m = is_weights(log_ratio(), mask(), "geometric", 1.02)
    assert_close(w, t([[e(-0.5 / 3)] * 3 + [1.0], [1.02] * 4]), **TOL)
    assert float(m["truncated_frac"]) == pytest.approx(4 / 7, abs=1e-12)
    assert float(m["weight_mean"]) == pytest.approx((3 * e(-0.5 / 3) + 4 * 1.02) / 7, abs=1e-12)


# ---------------------------------------------------------------- rejection (masked IS, IcePop)


def test_token_rejection_hand_computed():
    # [0.5, 2]: ρ = e^0.5 = 1.65 kept, e^−1 = 0.37 rejected, the rest kept: 1 of 7 tokens, no whole sequence
    keep, m = rejection_mask(log_ratio(), mask(), "token", 0.5, 2.0)
    assert keep.tolist() == [[True, False, True, False], [True, True, True, True]]
    assert floats(m) == pytest.approx({"masked_frac": 1 / 7, "masked_seq_frac": 0.0}, abs=1e-12)
    # IcePop's two-sided band [α, β] = [0.5, 1.5] also rejects ρ = 1.65
    keep, _ = rejection_mask(log_ratio(), mask(), "token", 0.5, 1.5)
    assert keep.tolist() == [[False, False, True, False], [True, True, True, True]]


def test_sequence_and_geometric_rejection_hand_computed():
    # sequence [0.9, 1.2]: Π ρ = e^−0.5 = 0.61 drops row 0 (3 tokens), e^0.1 = 1.105 keeps row 1
    keep, m = rejection_mask(log_ratio(), mask(), "sequence", 0.9, 1.2)
    assert keep.tolist() == [[False, False, False, False], [True, True, True, True]]
    assert floats(m) == pytest.approx({"masked_frac": 3 / 7, "masked_seq_frac": 0.5}, abs=1e-12)
    # geometric [0.9, 1.02]: 0.846 and 1.025 both outside: everything masked
    keep, m = rejection_mask(log_ratio(), mask(), "geometric", 0.9, 1.02)
    assert not keep.any()
    assert floats(m) == {"masked_frac": 1.0, "masked_seq_frac": 1.0}


def test_rejection_bounds_are_inclusive():
    lr = t([[math.log(2.0), math.log(0.5), math.log(2.0) + 1e-9]])
    keep, _ = rejection_mask(lr, torch.ones(1, 3), "token", 0.5, 2.0)
    assert keep.tolist() == [[True, True, False]]


# ---------------------------------------------------------------- edge cases: empty, all masked, extreme


def test_empty_masks_give_zeros_not_nan():
    empty = torch.zeros(2, 4, dtype=torch.bool)
    lr = behavior_log_ratio(t(PROX), t(BEHAV), empty)
    assert torch.equal(lr, torch.zeros(2, 4, dtype=F64))
    for v in mismatch_metrics(t(PROX), t(BEHAV), empty, torch.tensor([0, 1])).values():
        assert float(v) == 0.0
    for level in ("token", "sequence", "geometric"):
        w, wm = is_weights(lr, empty, level, 2.0)
        assert torch.equal(w, torch.ones(2, 4, dtype=F64)) and all(float(v) == 0.0 for v in wm.values())
        keep, km = rejection_mask(lr, empty, level, 0.5, 2.0)
        assert not keep.any() and all(float(v) == 0.0 for v in km.values())
    # a batch of no rows at all
    none = torch.zeros(0, 4, dtype=F64)
    assert all(float(v) == 0.0 for v in mismatch_metrics(none, none, none.bool(), torch.zeros(0)).values())


def test_extreme_ratios_stay_finite():
    # behaviour gave the token probability 0 (−inf) or the learner did (−1e30): log ρ clamps to ±20
    prox = t([[0.0, -1e30, -1.0, 0.0] + [0.0] * 996])
    behav = t([[-math.inf, 0.0, NAN, -1e30] + [-1e30] * 996])
    m = torch.ones(1, 1000, dtype=torch.bool)
    lr = behavior_log_ratio(prox, behav, m)
    assert lr[0, :4].tolist() == [20.0, -20.0, 0.0, 20.0]
    metrics = mismatch_metrics(prox, behav, m, torch.tensor([3]))
    assert all(math.isfinite(float(v)) for v in metrics.values())
    assert float(metrics["abs_log_ratio_max"]) == 20.0
    for level in ("token", "sequence", "geometric"):
        w, wm = is_weights(lr, m, level, 5.0)  # Σ log ρ ≈ 19960: the weight is the cap, not inf
        assert torch.isfinite(w).all() and float(w.max()) <= 5.0 and all(math.isfinite(float(v)) for v in wm.values())
        keep, km = rejection_mask(lr, m, level, 0.5, 2.0)
        assert all(math.isfinite(float(v)) for v in km.values())
    assert float(is_weights(lr, m, "sequence", 5.0)[0][0, 0]) == 5.0
    assert float(is_weights(-lr.abs(), m, "sequence", 5.0)[0][0, 0]) == 0.0  # e^−20000 underflows to 0, not NaN


# ---------------------------------------------------------------- the loss with a rejection mask


def _batch(seed=0, b=4, n=7):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(b, n, generator=g, dtype=F64) * 2).requires_grad_()
    old = lp.detach() + torch.randn(b, n, generator=g, dtype=F64) * 0.2
    adv = torch.randn(b, n, generator=g, dtype=F64)
    m = torch.ones(b, n, dtype=torch.bool)
    m[1, 5:] = False
    m[3, 2:] = False
    behav = old + torch.randn(b, n, generator=g, dtype=F64) * 0.8
    return lp, old, adv, m, behav


def test_masked_token_gets_exactly_zero_gradient_even_at_an_extreme_ratio():
    lp, old, adv, m, behav = _batch()
    behav = behav.clone()
    behav[0, 2] = old[0, 2] + 30.0  # ρ = e^−30: clamps to e^−20, rejected
    lp_ex = lp.detach().clone()
    lp_ex[0, 3] = old[0, 3] + 50.0  # the current policy's own ratio is extreme too at a rejected position
    lp_ex.requires_grad_()
    behav[0, 3] = old[0, 3] - 30.0
    lr = behavior_log_ratio(old, behav, m)
    keep, _ = rejection_mask(lr, m, "token", 0.5, 2.0)
    w, _ = is_weights(lr, m, "token", 2.0)
    assert not keep[0, 2] and not keep[0, 3] and keep.any()
    loss, _ = policy_loss(lp_ex, old, adv, keep, 0.2, 0.28, behavior_weights=w)
    (grad,) = torch.autograd.grad(loss, lp_ex)
    assert torch.isfinite(grad).all() and torch.isfinite(loss)
    assert torch.equal(grad[~keep], torch.zeros_like(grad[~keep]))
    assert (grad[keep] != 0).any()


def _compact(x, keep, fill=0.0):
    """Rows of ``x`` with only their kept tokens, left-aligned; rows that keep none are dropped."""
    rows = [x[i][keep[i]] for i in range(len(x)) if keep[i].any()]
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=x.dtype)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
        valid[i, : len(r)] = True
    return out, valid


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_loss_equals_the_loss_of_the_batch_without_those_tokens(token_level, level):
    lp, old, adv, m, behav = _batch(seed=1)
    lr = behavior_log_ratio(old, behav, m)
    keep, km = rejection_mask(lr, m, level, 0.7, 1.4)
    assert 0 < float(km["masked_frac"]) < 1  # the case masks some tokens, not all
    w, _ = is_weights(lr, m, "token", 5.0)
    masked, _ = policy_loss(lp, old, adv, keep, 0.2, 0.28, token_level=token_level, behavior_weights=w)
    (g_masked,) = torch.autograd.grad(masked, lp)

    leaf = lp.detach().clone().requires_grad_()
    rows = keep.any(-1)
    lp_c, valid_c = _compact(leaf, keep)
    removed, _ = policy_loss(lp_c, _compact(old, keep)[0], _compact(adv, keep)[0], valid_c, 0.2, 0.28,
                             token_level=token_level, behavior_weights=_compact(w, keep, 1.0)[0])
    (g_removed,) = torch.autograd.grad(removed, leaf)
    assert_close(masked, removed, atol=1e-12, rtol=0)
    assert_close(g_masked, g_removed, atol=1e-12, rtol=0)
    assert rows.any() and not rows.all()  # some sequence lost every token: it leaves the sequence count as well

    # rejection is not a zero weight: zero-weighting the same tokens keeps them in the denominator
    zeroed, _ = policy_loss(lp, old, adv, m, 0.2, 0.28, token_level=token_level,
                            behavior_weights=torch.where(keep, w, torch.zeros_like(w)))
    assert abs(float(zeroed.detach()) - float(masked.detach())) > 1e-6


def test_masked_loss_split_into_micro_batches_equals_one_pass():
    lp, old, adv, m, behav = _batch(seed=2)
    keep, _ = rejection_mask(behavior_log_ratio(old, behav, m), m, "token", 0.7, 1.4)
    whole, _ = policy_loss(lp, old, adv, keep, 0.2, 0.28)
    total = loss_normalizer(keep)
    parts = sum(microbatch_weight(keep[s], total, dtype=F64) * policy_loss(lp[s], old[s], adv[s], keep[s], 0.2,
                                                                            0.28)[0]
                for s in (slice(0, 1), slice(1, 3), slice(3, 4)))
    assert_close(whole, parts, atol=1e-12, rtol=0)


def test_everything_masked_gives_a_zero_finite_loss_and_gradient():
    lp, old, adv, m, _ = _batch()
    keep = torch.zeros_like(m)
    loss, metrics = policy_loss(lp, old, adv, keep, 0.2, 0.28)
    (grad,) = torch.autograd.grad(loss * microbatch_weight(keep, loss_normalizer(keep), dtype=F64), lp)
    assert float(loss.detach()) == 0.0 and torch.equal(grad, torch.zeros_like(grad))
    assert all(math.isfinite(float(v)) for v in metrics.values())


# ---------------------------------------------------------------- config switches


def test_config_switches_defaults_and_validation():
    from async_vapo.config import load_config

    algo = load_config([], []).algo
    assert (algo.behavior_correction, algo.behavior_weight, algo.behavior_weight_cap, algo.behavior_mask) == \
        (True, "token", 5.0, "off")
    old = load_config([], ["algo.behavior_correction=false"]).algo  # configs of before the switches still load
    assert not old.behavior_correction
    icepop = load_config([], ["algo.behavior_mask=token", "algo.behavior_mask_low=0.5",
                              "algo.behavior_mask_high=5"]).algo
    assert icepop.behavior_mask == "token" and icepop.behavior_mask_high == 5.0
    with pytest.raises(ValueError, match="corrects nothing"):
        load_config([], ["algo.behavior_weight=off"])
    with pytest.raises(ValueError, match="no effect"):
        load_config([], ["algo.behavior_correction=false", "algo.behavior_mask=sequence"])
    with pytest.raises(ValueError):
        load_config([], ["algo.behavior_mask_low=1.5"])
    with pytest.raises(ValueError):
        load_config([], ["algo.behavior_weight=product"])


# ---------------------------------------------------------------- the learner


def test_learner_measures_the_mismatch_and_the_switches_reach_the_loss(tmp_path):
    """Behaviour log-probs shifted by −0.3 on every token (ρ = e^0.3 everywhere), and by +0.3 on the even rows'
    tokens instead: the metrics see it, a mask that rejects every token freezes the policy, one that rejects the
    even rows changes the update, and sequence weights change it too."""
    from conftest import FAST, _groups
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.learner.vapo import Learner, make_rollout_batch
    from async_vapo.models.base_model import ensure_base_model

    common = FAST + [f"model.cache_dir={tmp_path}", "algo.pos_lm_coef=0"]
    base = ensure_base_model(load_config([], common), progress=False)
    tok = AutoTokenizer.from_pretrained(str(base))

    def run(*overrides, mixed=False):
        cfg = load_config([], common + list(overrides))
        torch.manual_seed(0)
        learner = Learner(cfg, base)
        before = {k: v.clone() for k, v in learner.policy.state_dict().items()}
        batch = make_rollout_batch(_groups(tok), tok.pad_token_id)
        with torch.no_grad():
            own, _ = learner._forward_old(batch)
        shift = torch.full((len(own), 1), -0.3)
        if mixed:
            shift[::2] = 0.3
        valid = batch.tokens.response_mask.bool()
        batch.behavior_logprobs = torch.where(valid, own + shift, batch.behavior_logprobs)
        metrics = learner.update(batch)
        after = learner.policy.state_dict()
        return metrics, {k: after[k] - before[k] for k in before}

    def moved(delta):
        return max(float(d.abs().max()) for d in delta.values())

    m_tok, d_tok = run()
    k3 = e(0.3) - 1 - 0.3  # log ρ = 0.3 on every token
    assert m_tok["mismatch/k3"] == pytest.approx(k3, abs=1e-5)
    assert m_tok["mismatch/abs_log_ratio_max"] == pytest.approx(0.3, abs=1e-5)
    assert m_tok["mismatch/lag0/k3"] == pytest.approx(k3, abs=1e-5) and "mismatch/lag1/k3" not in m_tok
    assert m_tok["correction/weight_mean"] == pytest.approx(e(0.3), abs=1e-4)
    assert m_tok["correction/truncated_frac"] == 0.0 and "correction/masked_frac" not in m_tok

    m_wide, d_wide = run("algo.behavior_mask=token", "algo.behavior_mask_low=1e-3", "algo.behavior_mask_high=1e4")
    assert m_wide["correction/masked_frac"] == 0.0  # a mask that rejects nothing leaves the update as it was
    for k in d_tok:
        assert_close(d_wide[k], d_tok[k], atol=1e-6, rtol=0)

    m_all, d_all = run("algo.behavior_mask=token", "algo.behavior_mask_high=1.2")
    assert m_all["correction/masked_frac"] == 1.0 and m_all["correction/masked_seq_frac"] == 1.0
    assert moved(d_all) == 0.0 and moved(d_tok) > 0  # every token rejected: no policy gradient at all

    m_half, d_half = run("algo.behavior_mask=sequence", "algo.behavior_mask_low=0.9", "algo.behavior_mask_high=1e4",
                        mixed=True)
    assert m_half["correction/masked_seq_frac"] == pytest.approx(0.5)  # the even rows' ρ_b = e^(−0.3 L) < 0.9
    _, d_none = run(mixed=True)
    assert moved({k: d_half[k] - d_none[k] for k in d_half}) > 1e-6

    m_seq, d_seq = run("algo.behavior_weight=sequence", "algo.behavior_weight_cap=100")
    assert m_seq["correction/weight_mean"] > e(0.3)  # e^(0.3 L) per sequence
    assert moved({k: d_seq[k] - d_tok[k] for k in d_seq}) > 1e-6

    # the same row as the learner service exports it to Prometheus
    from prometheus_client.parser import text_string_to_metric_families

    from async_vapo.metrics.prom import ServiceMetrics
    from async_vapo.services.learner import export_row

    prom = ServiceMetrics("learner", gpu=False)
    export_row(prom, {"kind": "train", "step": 1, **m_half}, version=1)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(prom.exposition().decode()) for s in f.samples}
    assert samples[("async_vapo_learner_mismatch_kl_nats", (("lag", "all"),))] == pytest.approx(
        m_half["mismatch/k3"])
    assert samples[("async_vapo_learner_mismatch_kl_nats", (("lag", "0"),))] == pytest.approx(m_half["mismatch/k3"])
    assert math.isnan(samples[("async_vapo_learner_mismatch_kl_nats", (("lag", "1"),))])  # no token one version old
    assert samples[("async_vapo_learner_mismatch_abs_log_ratio", (("lag", "all"), ("stat", "max")))] == \
        pytest.approx(0.3, abs=1e-5)
    assert samples[("async_vapo_learner_correction_masked_ratio", (("unit", "sequence"),))] == pytest.approx(0.5)
    assert samples[("async_vapo_learner_correction_weight", (("stat", "mean"),))] == pytest.approx(
        m_half["correction/weight_mean"])


def test_equal_infinite_logprobs_give_log_ratio_zero_not_nan():
    # Both policies give the token probability 0 (−inf − (−inf) is NaN before the clamp): they agree, log ρ = 0,
    # ρ = 1. One side −inf alone still clamps to ±20; a NaN behaviour log-prob stays unmeasured (0).
    prox = t([[-math.inf, -math.inf, -1.0, -math.inf, -0.5]])
    behav = t([[-math.inf, -1.0, -math.inf, NAN, -0.5]])
    m = torch.ones(1, 5, dtype=torch.bool)
    lr = behavior_log_ratio(prox, behav, m)
    assert lr.tolist() == [[0.0, -20.0, 20.0, 0.0, 0.0]]
    # the agreeing token alone: weight 1 and kept at every level, every measure 0 and finite
    one = torch.tensor([[True, False, False, False, True]])
    lr1 = behavior_log_ratio(prox, behav, one)
    for level in ("token", "sequence", "geometric"):
        w, wm = is_weights(lr1, one, level, 2.0)
        assert w.tolist() == [[1.0] * 5] and all(math.isfinite(float(v)) for v in wm.values())
        keep, _ = rejection_mask(lr1, one, level, 0.5, 2.0)
        assert torch.equal(keep, one)
    metrics = floats(mismatch_metrics(prox, behav, one, torch.tensor([1])))
    assert metrics["k3"] == metrics["abs_log_ratio_max"] == metrics["seq_abs_log_ratio_max"] == 0.0
    assert metrics["measured_frac"] == 1.0 and all(math.isfinite(v) for v in metrics.values())


def test_a_token_without_a_behaviour_logprob_weighs_in_as_log_ratio_zero_and_shares_its_sequences_fate():
    # Row 0: log ρ = [0.5, −1.0, NaN behaviour → 0]; row 1: no behaviour log-prob at all; row 2: [0.3, NaN → 0].
    # token level: the NaN token has weight 1 and is never rejected.
    # sequence level: a correction of the whole sample (schema: "on the whole response"; "the whole sequence kept or
    #   dropped"), so the NaN token takes its sequence's weight and rejection: row 0 Π ρ = e^−0.5 on all 3 tokens and,
    #   outside [0.9, 1.2], all 3 dropped; row 2 Π ρ = e^0.3 = 1.35 on both tokens, dropped with [0.9, 1.2].
    # geometric: row 0 exp(−0.5 / 3) (the NaN token counts in L_b with log ρ = 0), row 2 exp(0.3 / 2).
    # A sequence without any behaviour log-prob is on-policy as a whole: weight 1, kept at every level.
    prox = t([[-1.0, -2.0, -0.5], [-0.3, -0.3, -0.3], [-0.7, -0.1, -0.2]])
    behav = t([[-1.5, -1.0, NAN], [NAN, NAN, NAN], [-1.0, NAN, -9.0]])
    m = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    lr = behavior_log_ratio(prox, behav, m)
    assert_close(lr, t([[0.5, -1.0, 0.0], [0.0, 0.0, 0.0], [0.3, 0.0, 0.0]]), **TOL)
    w, _ = is_weights(lr, m, "token", 5.0)
    assert_close(w, t([[e(0.5), e(-1.0), 1.0], [1.0] * 3, [e(0.3), 1.0, 1.0]]), **TOL)
    keep, _ = rejection_mask(lr, m, "token", 0.5, 2.0)
    assert keep.tolist() == [[True, False, True], [True, True, True], [True, True, False]]
    w, _ = is_weights(lr, m, "sequence", 5.0)
    assert_close(w, t([[e(-0.5)] * 3, [1.0] * 3, [e(0.3), e(0.3), 1.0]]), **TOL)
    keep, _ = rejection_mask(lr, m, "sequence", 0.9, 1.2)
    assert keep.tolist() == [[False] * 3, [True] * 3, [False] * 3]
    w, _ = is_weights(lr, m, "geometric", 5.0)
    assert_close(w, t([[e(-0.5 / 3)] * 3, [1.0] * 3, [e(0.15), e(0.15), 1.0]]), **TOL)
    keep, _ = rejection_mask(lr, m, "geometric", 0.9, 1.1)
    assert keep.tolist() == [[False] * 3, [True] * 3, [False] * 3]
