"""GRPO group advantages, token broadcast, DAPO dynamic sampling and soft overlong punishment."""

import statistics

import pytest
import torch
from torch.testing import assert_close

from async_vapo.algo.advantages import broadcast_to_tokens, group_normalized_advantages
from async_vapo.algo.dapo import dynamic_sampling_keep, soft_overlong_punishment

F64 = torch.float64
TOL = {"atol": 1e-12, "rtol": 0.0}


def reference_grpo(rewards, group_ids, eps):
    """One group at a time with the statistics module (sample std, n − 1)."""
    out = []
    for i, gid in enumerate(group_ids.tolist()):
        members = [float(r) for r, g in zip(rewards, group_ids.tolist(), strict=True) if g == gid]
        if len(members) < 2 or len(set(members)) == 1:
            out.append(0.0)
            continue
        mean, std = statistics.fmean(members), statistics.stdev(members)
        out.append((float(rewards[i]) - mean) / (std + eps))
    return torch.tensor(out, dtype=F64)


def test_group_advantages_hand_value():
    # Group [1, 0, 0, 0]: mean 0.25, squared deviations 0.5625 + 3·0.0625 = 0.75,
    # unbiased variance 0.75/3 = 0.25, std 0.5 → A = [1.5, −0.5, −0.5, −0.5].
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=F64)
    adv = group_normalized_advantages(rewards, torch.zeros(4, dtype=torch.long), eps=0.0)
    assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5], dtype=F64), **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_match_loop_reference(seed):
    gen = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, 6, (40,), generator=gen) * 1_000_003 + 7  # unsorted, sparse ids
    rewards = torch.randn(40, generator=gen, dtype=F64)
    rewards[group_ids == group_ids[0]] = 0.1  # one constant group
    adv = group_normalized_advantages(rewards, group_ids, eps=1e-6)
    assert_close(adv, reference_grpo(rewards, group_ids, 1e-6), atol=1e-10, rtol=0.0)


def test_group_advantages_unsorted_degenerate_groups():
    # ids 7: [1, 0] → ±1/√2 (eps = 0); ids 3: [0.1, 0.1, 0.1] → 0 exactly; id 100: singleton → 0.
    rewards = torch.tensor([1.0, 0.1, 0.0, 0.1, 5.0, 0.1], dtype=F64)
    group_ids = torch.tensor([7, 3, 7, 3, 100, 3])
    adv = group_normalized_advantages(rewards, group_ids, eps=0.0)
    h = 0.5**0.5
    assert_close(adv, torch.tensor([h, 0.0, -h, 0.0, 0.0, 0.0], dtype=F64), **TOL)
    assert (adv[[1, 3, 4, 5]] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_advantages_dtypes(dtype):
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=dtype)
    adv = group_normalized_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    assert adv.dtype == dtype
    # [1, 0]: deviations ±0.5, unbiased std √0.5 → ±√0.5 (up to eps); [1, 1] → 0.
    h = 0.5**0.5
    assert_close(adv.double(), torch.tensor([h, -h, 0.0, 0.0], dtype=F64), atol=1e-5, rtol=0.0)


def test_broadcast_to_tokens():
    seq_adv = torch.tensor([2.0, -1.0], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = broadcast_to_tokens(seq_adv, mask)
    assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]], dtype=F64), **TOL)


def test_dynamic_sampling_keep():
    # group 5: [1, 1] all equal → drop; group 2: [1, 0] → keep; group 9: singleton → drop;
    # group 4: [0, 0, 1] → keep. Ids interleaved.
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    group_ids = torch.tensor([2, 5, 4, 5, 2, 4, 9, 4])
    keep = dynamic_sampling_keep(rewards, group_ids)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [True, False, True, False, True, True, False, True]


def test_soft_overlong_punishment_boundaries():
    # L_max = 20, L_cache = 4 → free up to 16; ramp (16 − l)/4 on 17..20; −1 beyond 20.
    lengths = torch.tensor([0, 15, 16, 17, 18, 19, 20, 21, 100])
    pen = soft_overlong_punishment(lengths, max_len=20, cache_len=4)
    expect = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0])
    assert_close(pen, expect, **TOL)
    pen64 = soft_overlong_punishment(lengths.to(F64), max_len=20, cache_len=4)
    assert pen64.dtype == F64
    assert_close(pen64, expect.to(F64), **TOL)


def test_soft_overlong_punishment_without_cache():
    pen = soft_overlong_punishment(torch.tensor([19, 20, 21]), max_len=20, cache_len=0)
    assert_close(pen, torch.tensor([0.0, 0.0, -1.0]), **TOL)
    with pytest.raises(ValueError):
        soft_overlong_punishment(torch.tensor([1]), max_len=20, cache_len=-1)
