"""ContinuousEngine (``rollout/continuous.py``) on the real vLLM engine and the tiny model: weight updates that land
while requests are running, from this thread, in each of the three modes.

Every test submits a long group (240 tokens, EOS ignored) and then a short one (6 tokens); the short group is shipped
first, and the switch is made the moment it is, a few tokens into the long group (each request's own step count: they
are scheduled one step apart or in the same step). Each token's log-prob is checked against the
learner's forward (``async_vapo.models.rl``) of the version its span names. The versions are the base model and
perturbed copies of it (Gaussian noise of 0.3 std per tensor), whose log-probs differ from each other by far more than
the 1e-3 tolerance (asserted, so a check cannot pass against the wrong version).

One engine for the module (its own, the session's ``vllm_engine`` is lock-step); it starts in ~30 s."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

LONG = 240  # the prompt (7 tokens) and the response fit the model's 256 positions
PROMPT = "5+5-3="


@pytest.fixture(scope="module")
def setup(continuous_engine, tiny_base):
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy

    tok = AutoTokenizer.from_pretrained(tiny_base)
    base = load_policy(tiny_base)
    continuous_engine.load_weights(base.state_dict(), 0)
    versions = {0: base}
    yield continuous_engine, tok, versions, base


def _policy(versions, base, v: int):
    """Version ``v``: the base model (v = 0) or a perturbed copy of it, made once."""
    if v not in versions:
        import copy

        g = torch.Generator().manual_seed(v)
        p = copy.deepcopy(base)
        with torch.no_grad():
            for t in p.state_dict().values():
                if t.is_floating_point() and t.numel() > 1:
                    t.add_(torch.randn(t.shape, generator=g) * 0.3 * t.std())
        versions[v] = p
    return versions[v]


def _learner_logprobs(policy, prompt_ids, response_ids, temperature=1.0) -> torch.Tensor:
    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import make_token_batch, response_logits

    batch = make_token_batch([prompt_ids], [response_ids], 0)
    with torch.no_grad():
        return logprobs_from_logits(response_logits(policy, batch, temperature), batch.response_ids)[0]


def _switch(engine, tok, versions, base, version: int, *, long_n=4, seed=11, load=None):
    """Submit a long and a short group, wait for the short one, switch to ``version`` from this thread (``load(state)``
    loads it; by default ``engine.load_weights``); returns the prompt ids, the long group (its samples) and the short
    one."""
    ids = tok(PROMPT).input_ids
    key = f"long-v{version}"
    engine.submit(key, ids, n=long_n, temperature=1.0, top_p=1.0, max_tokens=LONG, stop_token_ids=[], seed=seed,
                  ignore_eos=True)
    engine.submit(f"short-v{version}", ids, n=2, temperature=1.0, top_p=1.0, max_tokens=6, stop_token_ids=[],
                  seed=seed + 100, ignore_eos=True)
    first = engine.finished(60.0)
    assert [g.key for g in first] == [f"short-v{version}"], "the short group ships alone, before the long one"
    assert engine.in_flight() == long_n
    state = {k: v.clone() for k, v in _policy(versions, base, version).state_dict().items()}
    engine.apply_weights(version, (lambda: load(state)) if load else (lambda: engine.load_weights(state, version)))
    assert engine.version == version
    done = []
    while not done:
        got = engine.finished(120.0)
        assert got, "the long group did not finish"
        done += got
    assert [g.key for g in done] == [key] and done[0].error is None
    assert engine.in_flight() == 0
    return ids, done[0], first[0]


def _assert_close(lp, ref, what):
    torch.testing.assert_close(lp, ref, atol=1e-3, rtol=0, msg=lambda m: f"{what}: {m}")


def test_keep_with_recompute_each_token_has_its_versions_logprobs(setup):
    """``keep`` + ``recompute_kv_after_update``: every long sample is split in two spans at the same token; the
    tokens before the switch carry version 0's log-probs, those after it version 1's (a full forward of version 1:
    the KV was recomputed), and the versions' log-probs differ there (the check can tell them apart)."""
    engine, tok, versions, base = setup
    engine.weight_update, engine.recompute_kv_after_update = "keep", True
    old = engine.version
    reprefill0, updates0 = engine.reprefill_tokens_total, engine.updates_total
    ids, long, short = _switch(engine, tok, versions, base, 1)
    assert all(s.version_spans == [(old, 0)] for s in short.samples)
    switches = []
    for s in long.samples:
        assert [v for v, _ in s.version_spans] == [old, 1] and s.version_spans[0] == (old, 0), s.version_spans
        k = s.version_spans[1][1]
        assert 0 < k < LONG
        switches.append(k)
        assert len(s.token_ids) == len(s.logprobs) == LONG and s.finish_reason == "length"
        lp_old = _learner_logprobs(_policy(versions, base, old), ids, s.token_ids)
        lp_new = _learner_logprobs(_policy(versions, base, 1), ids, s.token_ids)
        got = torch.tensor(s.logprobs)
        _assert_close(got[:k], lp_old[:k], "before the switch: version 0")
        _assert_close(got[k:], lp_new[k:], "after the switch: version 1")
        assert (lp_old[k:] - lp_new[k:]).abs().max() > 0.05
    assert engine.updates_total == updates0 + 1 and engine.update_stats[-1].in_flight == 4
    # the 4 requests were preempted and re-prefilled: prompt + the tokens before the switch, each
    assert engine.reprefill_tokens_total - reprefill0 == sum(len(ids) + k for k in switches)
    print(f"\nkeep+recompute: switch at tokens {switches}, "
          f"pause-to-resume {engine.update_stats[-1].total_s * 1e3:.0f} ms")


def test_keep_without_recompute_measures_the_gap(setup):
    """``keep`` without recompute: the tokens before the switch are version 1's exactly; after it the engine samples
    from the new weights over the old weights' KV, so its log-probs differ from a full forward of version 2 — the gap
    is measured and printed, and must be there (else the old KV was not kept)."""
    engine, tok, versions, base = setup
    engine.weight_update, engine.recompute_kv_after_update = "keep", False
    old = engine.version
    reprefill0 = engine.reprefill_tokens_total
    try:
        ids, long, _ = _switch(engine, tok, versions, base, 2)
    finally:
        engine.recompute_kv_after_update = True
    gaps, switches = [], []
    for s in long.samples:
        assert [v for v, _ in s.version_spans] == [old, 2] and s.version_spans[0] == (old, 0), s.version_spans
        k = s.version_spans[1][1]
        switches.append(k)
        got = torch.tensor(s.logprobs)
        _assert_close(got[:k], _learner_logprobs(_policy(versions, base, old), ids, s.token_ids)[:k], "before")
        gaps.append((got[k:] - _learner_logprobs(_policy(versions, base, 2), ids, s.token_ids)[k:]).abs())
    gap = torch.cat(gaps)
    print(f"\nkeep without recompute: switch at tokens {switches}; |engine - learner(v2)| after it: "
          f"mean {gap.mean():.4f}, max {gap.max():.4f} over {gap.numel()} tokens")
    assert gap.max() > 1e-2
    assert engine.reprefill_tokens_total == reprefill0


def test_wait_lets_requests_finish_under_the_old_weights(setup):
    """``wait``: the update returns only after the running group finished, every sample of it under the old version
    alone (the lock-step engine's semantics); ``generate`` afterwards serves the new version alone."""
    engine, tok, versions, base = setup
    engine.weight_update = "wait"
    old = engine.version
    try:
        ids, long, _ = _switch(engine, tok, versions, base, 3)
    finally:
        engine.weight_update = "keep"
    for s in long.samples:
        assert s.version_spans == [(old, 0)] and len(s.token_ids) == LONG
        _assert_close(torch.tensor(s.logprobs), _learner_logprobs(_policy(versions, base, old), ids, s.token_ids),
                      "wait: old version throughout")
    out = engine.generate([ids, tok("9-4=").input_ids], n=2, temperature=1.0, top_p=1.0, max_tokens=20,
                          stop_token_ids=[tok.eos_token_id], seed=5)
    assert len(out) == 2 and all(len(g) == 2 for g in out)
    for prompt, group in zip([ids, tok("9-4=").input_ids], out, strict=True):
        for s in group:
            assert s.version_spans == [(3, 0)]
            _assert_close(torch.tensor(s.logprobs), _learner_logprobs(_policy(versions, base, 3), prompt,
                                                                      s.token_ids), "generate after wait")


def test_abort_resubmits_from_scratch_under_the_new_version(setup):
    """``abort``: the running samples are aborted at the update and generated again from their first token by the
    new version, counted."""
    engine, tok, versions, base = setup
    engine.weight_update = "abort"
    resub0 = engine.resubmitted_total
    try:
        ids, long, _ = _switch(engine, tok, versions, base, 4)
    finally:
        engine.weight_update = "keep"
    assert long.resubmitted == 4 and engine.resubmitted_total == resub0 + 4
    for s in long.samples:
        assert s.version_spans == [(4, 0)] and len(s.token_ids) == LONG
        _assert_close(torch.tensor(s.logprobs), _learner_logprobs(_policy(versions, base, 4), ids, s.token_ids),
                      "abort: new version throughout")


def test_a_torn_load_serves_nothing_until_a_whole_version_loads(setup):
    """A load that raises leaves version -1 and the engine paused: a group submitted then does not run; the next
    update that loads a whole version resumes it, and the group is that version's alone."""
    engine, tok, versions, base = setup
    ids = tok(PROMPT).input_ids

    def torn():
        raise OSError("connection lost mid-load")

    with pytest.raises(OSError):
        engine.apply_weights(5, torn)
    assert engine.version == -1
    engine.submit("while-torn", ids, n=2, temperature=1.0, top_p=1.0, max_tokens=8, stop_token_ids=[], seed=1)
    assert engine.finished(1.5) == [] and engine.in_flight_keys() == ["while-torn"]
    state = {k: v.clone() for k, v in _policy(versions, base, 5).state_dict().items()}
    engine.apply_weights(5, lambda: engine.load_weights(state, 5))
    (g,) = engine.finished(60.0)
    assert g.key == "while-torn"
    for s in g.samples:
        assert s.version_spans == [(5, 0)]
        _assert_close(torch.tensor(s.logprobs), _learner_logprobs(_policy(versions, base, 5), ids, s.token_ids),
                      "after the torn load")


def test_keep_over_a_weight_group_mid_generation(setup):
    """``keep`` with the version received over a torch.distributed (gloo) group while the learner's side sends it, as
    an engine on another host than the learner takes its weights (``cluster.weights.transfer = "dist"``, what the
    multi-host GPU configs use): the receive runs as an RPC of vLLM's async engine between pause and resume, and the
    tokens after the switch carry the received version's log-probs."""
    from conftest import join_group, push_over_group

    from async_vapo.weights.collective import EngineGroup

    engine, tok, versions, base = setup
    engine.weight_update, engine.recompute_kv_after_update = "keep", True
    group = EngineGroup("rollout-continuous", timeout_s=30)
    join_group(engine, group)
    sent: dict = {}

    def receive(state):
        sent["buckets"] = push_over_group(group, engine, list(state.items()), 6, bucket_bytes=32 << 10)

    old = engine.version
    try:
        ids, long, _ = _switch(engine, tok, versions, base, 6, load=receive)
    finally:
        group.close()
    assert sent["buckets"] > 3, sent  # several bounded buckets, not one
    for s in long.samples:
        assert [v for v, _ in s.version_spans] == [old, 6], s.version_spans
        k = s.version_spans[1][1]
        got = torch.tensor(s.logprobs)
        lp_old = _learner_logprobs(_policy(versions, base, old), ids, s.token_ids)
        lp_new = _learner_logprobs(_policy(versions, base, 6), ids, s.token_ids)
        _assert_close(got[:k], lp_old[:k], "before the switch")
        _assert_close(got[k:], lp_new[k:], "after the switch: the version received over the group")
        assert (lp_old[k:] - lp_new[k:]).abs().max() > 0.05


def test_generate_keeps_within_its_share_of_the_engine_and_an_abort_ends_it(setup, monkeypatch):
    """``generate(max_in_flight=k)`` (the held-out evaluation beside training groups): at most ``k`` of its
    sequences in the engine at any submission, every prompt answered in order, each with its seed's samples; and
    aborting one of its groups from another thread (a service closing) ends the call at once with the error."""
    import threading
    import time

    engine, tok, versions, base = setup
    engine.load_weights(base.state_dict(), 0)
    prompts = [tok(f"{a}+{a}-1=").input_ids for a in range(1, 9)]
    seen: list[int] = []
    real_submit = engine.submit

    def submit(key, *args, **kwargs):
        real_submit(key, *args, **kwargs)
        if key.startswith("generate-"):
            seen.append(engine.in_flight())

    monkeypatch.setattr(engine, "submit", submit)
    kw = dict(n=2, temperature=1.0, top_p=1.0, max_tokens=12, stop_token_ids=[], seed=3, ignore_eos=True)
    out = engine.generate(prompts, max_in_flight=4, **kw)
    assert len(seen) == len(prompts) and max(seen) <= 4, seen
    assert [len(g) for g in out] == [2] * len(prompts) and all(len(s.token_ids) == 12 for g in out for s in g)
    monkeypatch.setattr(engine, "submit", real_submit)
    assert engine.in_flight() == 0
    # prompt i keeps seed + i whatever the window: its samples are those of the call without one (a batch of
    # another size may round a logit differently: most, not all, must match)
    whole = engine.generate(prompts, **kw)
    same = sum(a.token_ids == b.token_ids
               for ga, gb in zip(out, whole, strict=True) for a, b in zip(ga, gb, strict=True))
    assert same >= 0.75 * 2 * len(prompts), same

    err: dict = {}

    def call():
        t0 = time.monotonic()
        try:
            engine.generate(prompts[:2], **(kw | {"max_tokens": LONG}), max_in_flight=2)
        except RuntimeError as exc:
            err["e"], err["s"] = str(exc), time.monotonic() - t0

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not [k for k in engine.in_flight_keys() if k.startswith("generate-")]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    for k in engine.in_flight_keys():
        engine.abort(k)
    thread.join(30)
    assert not thread.is_alive() and "aborted" in err.get("e", ""), err
    assert engine.in_flight() == 0
