"""Tests for async_vapo.verify: extraction, grading, and the sandboxed worker pool.

Every pool here starts real worker processes; the misbehaving answers (hangs, segfaults, memory
blow-ups) are real too, enabled by the pool's test-only ``_test_hooks`` switch.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_vapo.verify import (
    REASONS,
    VerifierPool,
    VerifyResult,
    WorkerStartError,
    check_answer,
    extract_boxed,
)

HOOK_TIMEOUT_S = 1.0
SECRETS = {"FAKE_API_TOKEN": "tok-123", "AWS_SECRET_ACCESS_KEY": "aws-456", "HF_TOKEN": "hf-789"}
ALLOWED_WORKER_ENV = {
    "PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "HOME", "TMPDIR", "PYTHONDONTWRITEBYTECODE",
}  # fmt: skip
TYPICAL = "Let me compute step by step. 8 + 9 = 17, and checking again gives 17; so \\boxed{{{}}}"


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(num_workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def hook_pool():
    # Secrets are in the parent's environment while the workers start; the probe hook must not see them.
    with pytest.MonkeyPatch.context() as mp:
        for key, value in SECRETS.items():
            mp.setenv(key, value)
        p = VerifierPool(
            num_workers=2, timeout_s=HOOK_TIMEOUT_S, max_response_chars=2_000_000, _test_hooks=True
        )
    with p:
        yield p


def reasons(results: list[VerifyResult]) -> list[str]:
    return [r.reason for r in results]


# ------------------------------------------------------------------------------------ extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the answer is \\boxed{17}.", "17"),
        ("\\boxed{5} wait, no: \\boxed{6}", "6"),  # last box wins
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{\\boxed{1}}", "1"),  # the box that opens last
        ("\\fbox{3}", "3"),
        ("\\boxed {4}", "4"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces are not groups
        ("\\boxed{a} then \\boxed{b", "a"),  # an unclosed box does not hide a complete one
        ("}} \\boxed{x} }", "x"),  # stray closing braces are ignored
        ("no box here", None),
        ("\\boxed{unclosed", None),
        ("\\boxed{}", ""),
    ],
)
def test_extract_boxed_cases(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_scans_only_the_tail_window():
    text = "\\boxed{1}" + "x" * 100
    assert extract_boxed(text, max_chars=200) == "1"
    assert extract_boxed(text, max_chars=100) is None  # the box lies before the window
    assert extract_boxed(text, max_chars=0) is None


def _naive_last_boxed(s: str) -> str | None:
    """Reference: try each box opening from the last one back, scanning forward for its close."""
    openers = ("\\boxed{", "\\fbox{")
    starts = [(i, len(o)) for i in range(len(s)) for o in openers if s.startswith(o, i)]
    for start, width in reversed(starts):
        depth, j = 1, start + width
        while j < len(s):
            if s[j] == "{":
                depth += 1
            elif s[j] == "}":
                depth -= 1
                if depth == 0:
                    return s[start + width : j]
            j += 1
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(["\\boxed{", "\\fbox{", "{", "}", "a", "1", " ", "x^2"]), max_size=40))
def test_extract_boxed_matches_naive_reference(pieces):
    text = "".join(pieces)
    assert extract_boxed(text) == _naive_last_boxed(text)


def test_extract_boxed_is_linear_on_adversarial_nesting():
    t0 = time.perf_counter()
    assert extract_boxed("\\boxed{" * 100_000, max_chars=10**7) is None
    assert extract_boxed("\\boxed{" * 100_000 + "7}", max_chars=10**7) == "7"
    assert extract_boxed("{" * 300_000 + "}" * 300_000, max_chars=10**7) is None
    # A quadratic rescan (one forward scan per opening) would take minutes here.
    assert time.perf_counter() - t0 < 5.0


# ------------------------------------------------------------------------------------- grading

EQUIVALENT = [
    ("\\boxed{1/2}", "0.5"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "1/2"),
    ("\\boxed{\\dfrac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac12}", "1/2"),
    ("\\boxed{2.0}", "2"),
    ("\\boxed{2}", "2.0"),
    ("\\boxed{0.50}", "0.5"),
    ("\\boxed{3.14159265}", "3.14159266"),  # math-verify rounds to 6 decimals; kept on purpose
    ("\\boxed{-7}", "-7"),
    ("\\boxed{- 7}", "-7"),
    ("\\boxed{-\\frac{1}{2}}", "-0.5"),
    ("\\boxed{\\sin x}", "\\sin(x)"),  # parsed from the unnormalized text, not "\sinx"
    ("\\boxed{x^2+1}", "$1+x^2$"),
    ("\\boxed{17}", "\\boxed{17}"),
    ("\\boxed{5} no wait \\boxed{6}", "6"),
]
NOT_EQUIVALENT = [
    ("\\boxed{3}", "4"),
    ("\\boxed{-7}", "7"),
    ("\\boxed{0.5}", "\\frac{1}{3}"),
    ("\\boxed{6} no wait \\boxed{5}", "6"),  # only the last box counts
    ("\\boxed{9**9**9}", "1"),
]


@pytest.mark.parametrize(("response", "answer"), EQUIVALENT)
def test_check_answer_equivalent(response, answer):
    assert check_answer(response, answer) == (True, "correct")


@pytest.mark.parametrize(("response", "answer"), NOT_EQUIVALENT)
def test_check_answer_not_equivalent(response, answer):
    assert check_answer(response, answer) == (False, "incorrect")


@pytest.mark.parametrize(
    ("response", "answer", "reason"),
    [
        ("the answer is 17", "17", "no_answer"),
        ("\\boxed{}", "17", "no_answer"),
        ("\\boxed{ }", "17", "no_answer"),
        ("\\boxed{17}", "$$", "parse_error"),  # unusable reference answer
    ],
)
def test_check_answer_failure_reasons(response, answer, reason):
    assert check_answer(response, answer) == (False, reason)


# ---------------------------------------------------------------------------------- pool basics


def test_pool_grades_like_check_answer(pool):
    items = EQUIVALENT + NOT_EQUIVALENT + [("17", "17")]
    results = pool.verify(items)
    expected = ["correct"] * len(EQUIVALENT) + ["incorrect"] * len(NOT_EQUIVALENT) + ["no_answer"]
    assert reasons(results) == expected
    assert [r.reward for r in results] == [1.0 if e == "correct" else -1.0 for e in expected]
    assert all(r.correct == (r.reason == "correct") for r in results)


def test_pool_rejects_bad_input_and_too_long_without_a_worker(pool):
    before = pool.stats
    results = pool.verify(
        [(None, "1"), ("\\boxed{1}", 1), "ab", ("x" * 1_000_000, "1"), ("\\boxed{1}", "1")]  # type: ignore[list-item]
    )
    assert reasons(results) == ["bad_input", "bad_input", "bad_input", "too_long", "correct"]
    assert all(r.reward == -1.0 and r.seconds == 0.0 for r in results[:4])
    after = pool.stats
    assert after["bad_input"] - before["bad_input"] == 3
    assert after["too_long"] - before["too_long"] == 1
    assert pool.verify([]) == []


def test_hooks_are_off_by_default(pool):
    replaced = pool.stats["workers_replaced"]
    results = pool.verify([(hook, "1") for hook in ("__crash__", "__oom__", "__probe__", "__hang_hard__")])
    assert reasons(results) == ["no_answer"] * 4
    assert pool.stats["workers_replaced"] == replaced


@pytest.mark.parametrize(
    "response",
    [
        "\\boxed{9**9**9}",
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{10^{10^{10^{10}}}} \\boxed{9^{9^{9^{9}}}}",
        "\\boxed{" * 100_000,  # 700 KB: too long for the default limit
        "\\boxed{" + "{" * 2_000 + "1" + "}" * 2_000 + "}",  # deep nesting inside the box
        "\\boxed{\ud800\x00\u202e}",  # lone surrogate, NUL and bidi control must survive the pipe
    ],
)
def test_adversarial_answers_are_bounded_and_pool_survives(pool, response):
    pool.wait_ready()
    t0 = time.monotonic()
    [result] = pool.verify([(response, "1")])
    elapsed = time.monotonic() - t0
    assert elapsed < pool.timeout_s + 1.0
    assert result.reason in {"incorrect", "parse_error", "timeout", "too_long", "no_answer"}
    assert result.reward == -1.0 and not result.correct
    assert reasons(pool.verify([("\\boxed{17}", "17"), ("\\boxed{1/2}", "0.5")])) == ["correct", "correct"]


def test_throughput_typical_batch(pool):
    pool.wait_ready()
    items = [(TYPICAL.format(17 + k % 4), "17") for k in range(256)]
    pool.verify(items)  # first contact with these strings
    t0 = time.monotonic()
    results = pool.verify(items)
    elapsed = time.monotonic() - t0
    assert reasons(results) == ["correct" if k % 4 == 0 else "incorrect" for k in range(256)]
    assert elapsed < 1.0, f"256 typical responses took {elapsed:.3f}s"


def test_verify_from_a_worker_thread(pool):
    # math-verify's own signal-based timeouts fail off the main thread; the pool has none there.
    out: list[list[VerifyResult]] = []
    thread = threading.Thread(target=lambda: out.append(pool.verify([("\\boxed{0.5}", "1/2")])))
    thread.start()
    thread.join(timeout=30)
    assert reasons(out[0]) == ["correct"]


def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match="unknown reasons"):
        VerifierPool(reason_rewards={"nope": 0.0})
    with pytest.raises(ValueError, match="num_workers"):
        VerifierPool(num_workers=0)
    with pytest.raises(ValueError, match="soft_timeout_s"):
        VerifierPool(timeout_s=1.0, soft_timeout_s=2.0)


# ------------------------------------------------------------------------------ failure policy


def test_soft_timeout_keeps_the_worker(hook_pool):
    hook_pool.wait_ready()
    replaced = hook_pool.stats["workers_replaced"]
    [result] = hook_pool.verify([("__hang__", "1")])
    assert result.reason == "timeout" and result.reward == -1.0
    assert "soft" in result.detail
    assert result.seconds < HOOK_TIMEOUT_S  # the worker's own timer fired before the pool's deadline
    assert hook_pool.stats["workers_replaced"] == replaced


def test_hard_hang_is_killed_and_replaced(hook_pool):
    hook_pool.wait_ready()
    replaced = hook_pool.stats["workers_replaced"]
    pids = set(hook_pool.worker_pids)
    t0 = time.monotonic()
    [result] = hook_pool.verify([("__hang_hard__", "1")])
    assert time.monotonic() - t0 < HOOK_TIMEOUT_S + 1.0
    assert result.reason == "timeout" and result.reward == -1.0
    assert result.seconds >= HOOK_TIMEOUT_S
    assert hook_pool.stats["workers_replaced"] == replaced + 1
    killed = pids - set(hook_pool.worker_pids)
    assert len(killed) == 1 and not psutil.pid_exists(killed.pop())
    assert reasons(hook_pool.verify([("\\boxed{2}", "2")])) == ["correct"]


@pytest.mark.parametrize(("hook", "detail"), [("__crash__", "SIGSEGV"), ("__oom__", "MemoryError")])
def test_dead_worker_gives_crash_and_is_replaced(hook_pool, hook, detail):
    hook_pool.wait_ready()
    replaced = hook_pool.stats["workers_replaced"]
    [result] = hook_pool.verify([(hook, "1")])
    # __oom__ asks for twice RLIMIT_AS; without the limit it would succeed and say "incorrect".
    assert result.reason == "crash" and result.reward == -1.0, result
    assert detail in result.detail
    assert hook_pool.stats["workers_replaced"] == replaced + 1
    assert reasons(hook_pool.verify([("\\boxed{3}", "3"), ("\\boxed{3}", "4")])) == ["correct", "incorrect"]


def test_timeout_only_penalises_the_hung_item(hook_pool):
    hook_pool.wait_ready()
    redispatched = hook_pool.stats["items_redispatched"]
    # 9 items over 2 idle workers: the first worker's chunk starts with the hang, so its other
    # items must be re-sent to a fresh worker and still graded.
    items = [("__hang_hard__", "1")] + [(f"\\boxed{{{k}}}", str(k)) for k in range(8)]
    results = hook_pool.verify(items)
    assert reasons(results) == ["timeout"] + ["correct"] * 8
    assert hook_pool.stats["items_redispatched"] > redispatched


def test_chain_of_hangs_does_not_blame_the_item_behind_them():
    # One worker, one chunk: each hang kills the worker and requeues the rest, so the last item is
    # re-sent three times; it never ran, so it must still be graded, not settled as a failure.
    with VerifierPool(num_workers=1, timeout_s=0.5, _test_hooks=True) as p:
        results = p.verify([("__hang_hard__", "1")] * 3 + [("\\boxed{5}", "5")])
        assert reasons(results) == ["timeout"] * 3 + ["correct"]
        assert p.stats["workers_replaced"] == 3
        assert p.stats["items_redispatched"] == 3 + 2 + 1  # what was behind each hang


def test_mixed_batch_of_200_keeps_input_order(hook_pool):
    hook_pool.wait_ready()
    items: list = []
    expected: list[str] = []
    for k in range(200):
        kind = k % 10
        if kind in (0, 1, 2):
            items.append((f"\\boxed{{{k}}}", str(k)))
            expected.append("correct")
        elif kind in (3, 4):
            items.append((f"\\boxed{{{k}}}", str(k + 1)))
            expected.append("incorrect")
        elif kind == 5:
            items.append((f"\\boxed{{\\frac{{{k}}}{{2}}}}", str(k / 2)))
            expected.append("correct")
        elif kind == 6:
            items.append((f"I think it is {k}", str(k)))
            expected.append("no_answer")
        elif kind == 7:
            items.append(("y" * 2_000_001, str(k)))
            expected.append("too_long")
        elif kind == 8:
            items.append((k, str(k)))
            expected.append("bad_input")
        else:
            items.append((f"\\boxed{{-{k}}}", f"-{k}.0"))
            expected.append("correct")
    items[41] = ("__crash__", "1")
    expected[41] = "crash"
    items[123] = ("__hang__", "1")
    expected[123] = "timeout"
    results = hook_pool.verify(items)
    assert reasons(results) == expected


def test_worker_environment_is_scrubbed_and_limited(hook_pool):
    assert not any(k in os.environ for k in SECRETS)  # the fixture set them only while spawning
    hook_pool.wait_ready()
    results = hook_pool.verify([("__probe__", "1")] * 2)
    probes = [json.loads(r.detail) for r in results]
    for probe in probes:
        assert not set(probe["env"]) & set(SECRETS)
        assert set(probe["env"]) <= ALLOWED_WORKER_ENV
        assert probe["pgid"] == probe["pid"]  # own process group, killable as a whole
        assert probe["cwd"] != os.getcwd()
        assert probe["rlimit_as"] == hook_pool.memory_limit_mb << 20
        assert probe["rlimit_core"] == 0
        assert probe["rlimit_nofile"] <= 64


def test_megabyte_response_with_raised_limit(hook_pool):
    hook_pool.wait_ready()
    t0 = time.monotonic()
    results = hook_pool.verify(
        [("x" * 1_000_000 + "\\boxed{42}", "42"), ("\\boxed{" * 150_000, "1"), ("z" * 1_500_000, "1")]
    )
    assert time.monotonic() - t0 < HOOK_TIMEOUT_S + 1.0
    assert reasons(results) == ["correct", "no_answer", "no_answer"]


def test_worker_killed_while_idle_is_replaced(hook_pool):
    hook_pool.wait_ready()
    replaced = hook_pool.stats["workers_replaced"]
    victim = hook_pool.worker_pids[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.1)
    results = hook_pool.verify([(f"\\boxed{{{k}}}", str(k)) for k in range(6)])
    assert reasons(results) == ["correct"] * 6
    assert victim not in hook_pool.worker_pids
    assert hook_pool.stats["workers_replaced"] == replaced + 1


def test_cpu_limit_ends_a_spinning_check_and_rewards_are_overridable():
    with VerifierPool(
        num_workers=1, timeout_s=6.0, cpu_limit_s=1.0, reason_rewards={"timeout": -2.0}, _test_hooks=True
    ) as p:
        [result] = p.verify([("__spin_hard__", "1")])
        assert result.reason == "timeout" and result.detail == "cpu time limit"
        assert result.reward == -2.0
        assert result.seconds < 4.0  # RLIMIT_CPU, not the 6 s wall-clock deadline
        assert p.stats["workers_replaced"] == 1


# ---------------------------------------------------------------------------------- lifecycle


def test_close_leaves_no_child_process():
    p = VerifierPool(num_workers=2)
    pids = p.worker_pids
    assert all(psutil.pid_exists(pid) for pid in pids)
    assert reasons(p.verify([("\\boxed{1}", "1")])) == ["correct"]
    p.close()
    p.close()  # idempotent
    children = {c.pid for c in psutil.Process().children(recursive=True)}
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert not children & set(pids)
    assert p.stats["workers"] == 0
    with pytest.raises(RuntimeError, match="closed"):
        p.verify([("\\boxed{1}", "1")])


def test_worker_that_misses_ready_is_a_named_error():
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerStartError, match="READY"):
        VerifierPool(num_workers=2, start_timeout_s=0.05)
    after = {c.pid for c in psutil.Process().children(recursive=True)}
    assert after <= before  # the half-started workers were killed


def test_reasons_are_the_documented_set():
    assert set(REASONS) == {
        "correct", "incorrect", "no_answer", "parse_error", "timeout", "crash", "too_long", "bad_input",
    }  # fmt: skip
