"""Tests for async_vapo.verify: extraction, grading, and the sandboxed worker pool.

Every pool here starts real worker processes; the misbehaving answers (hangs, segfaults, memory
blow-ups, fork bombs, network connections, escaping children) are real too, enabled by the pool's
test-only ``_test_hooks`` switch. The isolation tests check what holds from outside the worker where
they can (psutil, a listening socket, the file system) rather than trusting its own report.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

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

HOOK_TIMEOUT_S = 1.5
HOOK_SOFT_TIMEOUT_S = 0.5  # a second of margin: the worker's own timer fires first even on a busy machine
ROOT = os.geteuid() == 0
REPO = Path(__file__).resolve().parents[2]
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
            num_workers=2, timeout_s=HOOK_TIMEOUT_S, soft_timeout_s=HOOK_SOFT_TIMEOUT_S, max_response_chars=2_000_000,
            _test_hooks=True
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
    # a guard against a pathological path (a process per item, a math-verify timeout per item), not a speed target:
    # about 0.1-0.3 s here idle; speed is measured by benchmarks, not asserted on a shared machine
    assert elapsed < 10.0, f"256 typical responses took {elapsed:.3f}s"


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
    with pytest.raises(ValueError, match="max_processes"):
        VerifierPool(max_processes=0)
    with pytest.raises(ValueError, match="sandbox_uid_base"):
        VerifierPool(sandbox_uid_base=0)  # root's uid


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
    # an unkilled hang never returns; the margin above the timeout is for a loaded machine (CI ran 2.8 s)
    assert time.monotonic() - t0 < HOOK_TIMEOUT_S + 6.0
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
        assert probe["rlimit_nproc"] == hook_pool.max_processes


def test_megabyte_response_with_raised_limit(hook_pool):
    hook_pool.wait_ready()
    t0 = time.monotonic()
    results = hook_pool.verify(
        [("x" * 1_000_000 + "\\boxed{42}", "42"), ("\\boxed{" * 150_000, "1"), ("z" * 1_500_000, "1")]
    )
    assert time.monotonic() - t0 < HOOK_TIMEOUT_S + 6.0  # not timed out: bounded by the timeout, with margin
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
        num_workers=1, timeout_s=30.0, cpu_limit_s=1.0, reason_rewards={"timeout": -2.0}, _test_hooks=True
    ) as p:
        [result] = p.verify([("__spin_hard__", "1")])
        assert result.reason == "timeout" and result.detail == "cpu time limit"
        assert result.reward == -2.0
        # RLIMIT_CPU (1 s of CPU: a few seconds of wall-clock on a loaded machine), not the 30 s wall-clock deadline
        assert result.seconds < 20.0
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
        "correct", "incorrect", "no_answer", "parse_error", "timeout", "crash", "too_long", "bad_input", "over_budget",
        "reward_error",
    }  # fmt: skip


# ------------------------------------------------------------------------------------ isolation


def _probes(pool: VerifierPool) -> list[dict]:
    """One probe per worker, in worker order (a batch of n items over n idle workers is one item each)."""
    pool.wait_ready()
    results = pool.verify([("__probe__", "1")] * pool.num_workers)
    probes = [json.loads(r.detail) for r in results]
    assert [p["pid"] for p in probes] == pool.worker_pids
    return probes


def _platform_makes_netns(**user) -> bool | None:
    """Whether this machine lets the given user (default: this process's) make a network namespace, asked of
    the unshare(1) command rather than of the code under test; None when the command is missing."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    flags = ["--net"] if os.geteuid() == 0 and not user else ["--user", "--net"]
    return subprocess.run([unshare, *flags, "true"], capture_output=True, **user).returncode == 0


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_workers_run_as_their_own_unprivileged_uid(hook_pool):
    probes = _probes(hook_pool)
    iso = hook_pool.isolation
    real_uids = [psutil.Process(pid).uids() for pid in hook_pool.worker_pids]  # seen from outside
    real_gids = [psutil.Process(pid).gids() for pid in hook_pool.worker_pids]
    print("worker uids", real_uids, "isolation", iso)
    if ROOT:
        assert iso["uid_drop"] and iso["uids"] == sorted(u.real for u in real_uids)
        for uids, gids, probe in zip(real_uids, real_gids, probes, strict=True):
            assert uids.real == uids.effective == uids.saved != 0
            assert gids.real == gids.effective == gids.saved == uids.real  # one gid per worker, same number
            assert probe["groups"] == []
        assert len({u.real for u in real_uids}) == len(real_uids)  # each worker its own uid
    else:  # no drop is possible: the pool's own uid, and the pool says so
        assert not iso["uid_drop"] and all(u.real == os.getuid() for u in real_uids)
    for probe in probes:
        assert probe["cap_eff"] == probe["cap_prm"] == 0 and probe["no_new_privs"]
    assert not iso["capabilities"] and iso["no_new_privs"]


def test_worker_cannot_reach_the_network(hook_pool):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.3)
        port = listener.getsockname()[1]
        [result] = hook_pool.verify([(f"__net__:{port}", "1")])
        report = json.loads(result.detail)
        print("worker's connect to 127.0.0.1:", port, report)
        try:
            conn, _ = listener.accept()
            conn.close()
            reached = True
        except TimeoutError:
            reached = False
    possible = _platform_makes_netns()
    if possible is not None:
        assert hook_pool.isolation["netns"] == possible
    if not hook_pool.isolation["netns"]:  # the report must be honest: without a namespace the connect works
        assert report["connect"] == "ok" and reached
        pytest.skip("no network namespace can be made here (the pool reports netns=False, and it is so)")
    assert report["connect"] != "ok" and not reached
    assert report["interfaces"] == ["lo"]


def test_fork_bomb_stops_at_max_processes_per_worker():
    # Two workers bomb at once: with a uid (or user namespace) per worker each gets max_processes - 1
    # children; a limit shared by both (one uid for all workers) would give fewer in total.
    with VerifierPool(num_workers=2, timeout_s=5.0, max_processes=4, _test_hooks=True) as p:
        p.wait_ready()
        t0 = time.monotonic()
        results = p.verify([("__forkbomb__", "1")] * 2)
        elapsed = time.monotonic() - t0
        bombs = [json.loads(r.detail) for r in results]
        print("fork bombs", bombs, f"{elapsed:.2f}s", p.isolation)
        if p.isolation["nproc_scope"] == "worker":
            assert [b["forked"] for b in bombs] == [3, 3]
        else:  # RLIMIT_NPROC counts every task of the user: a bound, not a per-worker one
            assert all(b["forked"] <= 3 for b in bombs)
        assert all("Resource temporarily unavailable" in b["error"] for b in bombs)
        assert reasons(p.verify([("\\boxed{4}", "4")])) == ["correct"]


def test_worker_temp_dirs_are_private_and_removed():
    with VerifierPool(num_workers=2, _test_hooks=True) as p:
        probes = _probes(p)
        dirs = [probe["cwd"] for probe in probes]
        for probe in probes:
            assert probe["cwd_mode"] == 0o700 and probe["cwd_uid"] == probe["uid"][0]
            assert stat.S_IMODE(os.stat(probe["cwd"]).st_mode) == 0o700
        # each worker tries to list the other's temp dir
        peeks = p.verify([(f"__peek__:{dirs[1]}", "1"), (f"__peek__:{dirs[0]}", "1")])
        print("temp dirs", dirs, "cross listing:", [r.detail for r in peeks])
        if ROOT:
            assert all(r.detail.startswith("PermissionError") for r in peeks)
        victim = p.worker_pids[0]
        os.kill(victim, signal.SIGKILL)
        _wait_until(lambda: _gone(victim))
        assert reasons(p.verify([("\\boxed{1}", "1")] * 4)) == ["correct"] * 4  # replaces the dead worker
        assert not os.path.exists(dirs[0]) and os.path.exists(dirs[1])
    assert not os.path.exists(dirs[1])


def test_a_child_that_leaves_the_process_group_dies_with_its_worker():
    p = VerifierPool(num_workers=1, _test_hooks=True)
    orphan = None
    try:
        [result] = p.verify([("__orphan__", "1")])
        orphan = int(result.detail)
        assert psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE
        assert os.getpgid(orphan) != p.worker_pids[0]  # out of the group the pool kills
        if not ROOT:
            pytest.skip("no uid of its own to kill by: a child that called setsid outlives its worker")
        p.close()
        _wait_until(lambda: _gone(orphan), timeout_s=2.0)  # SIGKILL is sent; dying takes a moment
    finally:
        p.close()
        if orphan is not None and not _gone(orphan):
            os.kill(orphan, signal.SIGKILL)


def test_concurrent_pools_lease_distinct_uids():
    from async_vapo.verify import sandbox

    if not ROOT:
        pytest.skip("uids are leased only when the pool runs as root")
    # a range of uids of the test's own: the pools of other tests and services running meanwhile lease and release
    # uids of the default range (which uid is the first free one there depends on them)
    base = sandbox.DEFAULT_UID_BASE + sandbox.UID_SLOTS
    if not sandbox._uid_range_mapped(base):
        pytest.skip(f"uids [{base}, {base + sandbox.UID_SLOTS}) are not mapped here")
    with VerifierPool(num_workers=1, sandbox_uid_base=base) as a, \
            VerifierPool(num_workers=2, sandbox_uid_base=base) as b:
        ua, ub = a.isolation["uids"], b.isolation["uids"]
        assert len(ua) == 1 and len(ub) == 2 and not set(ua) & set(ub)
    with VerifierPool(num_workers=1, sandbox_uid_base=base) as c:  # released on close: the first free uid again
        assert c.isolation["uids"] == [min(ua + ub)]


def test_lazy_imports_work_after_the_drop(hook_pool):
    # Nothing in the worker imports these before the drop (mailbox needs email.generator, a submodule of a
    # package that is imported). Where the interpreter lives under a directory the worker's uid cannot
    # search (here: /root/.pyenv), only the descriptors held across the drop reach them.
    modules = ["wave", "tabnanny", "mailbox"]
    results = hook_pool.verify([(f"__import__:{m}", "1") for m in modules])
    print("imports after the drop:", dict(zip(modules, [r.detail for r in results], strict=True)))
    assert [r.detail for r in results] == ["ok"] * len(modules)


UNPRIVILEGED_SCRIPT = """
import json, sys
from async_vapo.verify import sandbox as sb
netns, userns = sb._enter_namespaces()
iso = sb._drop_privileges(None, None, 4)
print(json.dumps({"netns": netns, "userns": userns, **iso, "bomb": sb._fork_bomb(50, 0.3),
                  "connect": sb._outcome(lambda: sb._connect(int(sys.argv[1])))}))
"""


def test_unprivileged_worker_isolates_itself_in_a_user_namespace():
    """The worker's isolation step run as an unprivileged user (nobody), as in a pool not started as root,
    while nobody already has 6 other processes: a per-user RLIMIT_NPROC of 4 would allow no fork at all."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if not ROOT or system_python is None:
        pytest.skip("needs root (to become nobody) and a system python3 that nobody may run")
    sleepers = [subprocess.Popen(["sleep", "5"], user=65534, group=65534, extra_groups=[]) for _ in range(6)]
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            out = subprocess.run([system_python, "-I", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
                                  + UNPRIVILEGED_SCRIPT, str(listener.getsockname()[1])],
                                 user=65534, group=65534, extra_groups=[], capture_output=True, text=True,
                                 cwd="/", env={"PATH": "/usr/bin:/bin"}, timeout=30)
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        print("unprivileged worker:", report)
        assert report["uid"] == 65534 and not report["capabilities"] and report["no_new_privs"]
        possible = _platform_makes_netns(user=65534, group=65534, extra_groups=[])
        if possible is not None:
            assert report["netns"] == possible
        if report["userns"]:
            assert report["bomb"]["forked"] == 3  # counted in its own user namespace
        else:
            assert report["bomb"]["forked"] == 0  # counted over all of nobody's processes
        if report["netns"]:
            assert report["connect"] != "ok"
        else:
            assert report["connect"] == "ok"
    finally:
        for s in sleepers:
            s.kill()
            s.wait()


# ----------------------------------------------------------------------------------- time budget


def test_budget_cuts_a_batch_of_hangs_short(hook_pool):
    hook_pool.wait_ready()
    before = hook_pool.stats
    # Without a budget: 6 hard hangs over 2 workers, each killed at its 1 s deadline: over 3 s.
    items = [("\\boxed{1}", "1")] + [("__hang_hard__", "1")] * 6
    t0 = time.monotonic()
    results = hook_pool.verify(items, budget_s=0.5)
    elapsed = time.monotonic() - t0
    print("batch with a 0.5 s budget:", f"{elapsed:.2f}s", reasons(results))
    # without the budget the batch takes 3 s or more; 2.5 s leaves room for a loaded machine (1.16 s seen at load
    # average ~6) and still fails if the budget does not cut the batch short
    assert elapsed < 2.5
    assert reasons(results) == ["correct"] + ["over_budget"] * 6
    assert all(r.reward == -1.0 and not r.correct and "budget" in r.detail for r in results[1:])
    assert hook_pool.stats["over_budget"] - before["over_budget"] == 6
    assert hook_pool.stats["timeout"] == before["timeout"]
    # the busy workers were replaced; the pool grades the next batch
    assert reasons(hook_pool.verify([("\\boxed{2}", "2")] * 4, budget_s=30)) == ["correct"] * 4


def test_budget_default_comes_from_the_pool_and_is_validated():
    from async_vapo.config import load_config

    overrides = ["verifier.num_workers=1", "verifier.message_budget_s=2.5", "verifier.max_processes=3"]
    v = load_config([], overrides).verifier
    with VerifierPool.from_config(v) as p:
        assert p.message_budget_s == 2.5 and p.max_processes == 3
        with pytest.raises(ValueError, match="budget"):
            p.verify([("\\boxed{1}", "1")], budget_s=0)
        assert reasons(p.verify([("\\boxed{1}", "1")], budget_s=math.inf)) == ["correct"]
    with pytest.raises(ValueError, match="budget"):
        VerifierPool(message_budget_s=-1.0)


# ---------------------------------------------------------------------- a user's reward function

# A user's module of reward functions for answers that are not maths (labels). ``dispatch`` lets one pool exercise
# every outcome: the response picks the behaviour, so a single worker start covers them all.
USER_REWARDS = """
import os
import signal
import time

def label_match(response, answer):
    return 1.0 if response.strip().lower() == answer.strip().lower() else -1.0

def dispatch(response, answer):
    kind, _, arg = response.partition(":")
    if kind == "label":
        return label_match(arg, answer)
    if kind == "partial":
        return float(arg)
    if kind == "bool":
        return arg == answer
    if kind == "where":  # the worker's pid and uid, as a number
        return os.getpid() * 10.0 + (os.getuid() == 0)
    if kind == "raise":
        raise ValueError("unknown label " + arg)
    if kind == "text":
        return "yes"
    if kind == "none":
        return None
    if kind == "nan":
        return float("nan")
    if kind == "hang":
        while True:
            pass
    if kind == "hang_hard":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(3600)
    if kind == "memory":
        return len(bytearray(8 << 30))
    if kind == "exit":
        raise SystemExit(3)
    return -1.0

class Scorers:
    @staticmethod
    def exact(response, answer):
        return response == answer

NOT_CALLABLE = 3
"""


@pytest.fixture(scope="module")
def user_rewards_path(tmp_path_factory):
    """A directory holding the user's module, on PYTHONPATH while this module's tests run (replacement workers read
    it when they start too)."""
    where = tmp_path_factory.mktemp("user-rewards")
    (where / "vapo_user_rewards.py").write_text(USER_REWARDS)
    (where / "vapo_broken_rewards.py").write_text("raise RuntimeError('broken at import')\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(where))
        mp.syspath_prepend(str(where))
        yield where


@pytest.fixture(scope="module")
def reward_pool(user_rewards_path):
    with VerifierPool(num_workers=1, timeout_s=1.5, soft_timeout_s=HOOK_SOFT_TIMEOUT_S, memory_limit_mb=512,
                      reward_fn="vapo_user_rewards:dispatch") as p:
        yield p


def test_reward_fn_scores_inside_the_sandbox(reward_pool):
    results = reward_pool.verify([("label:Cat", "cat"), ("label:dog", "cat"), ("partial:0.25", "x"),
                                  ("partial:1.5", "x"), ("bool:b", "b"), ("bool:a", "b"), ("where:", "x")])
    assert [r.reward for r in results[:6]] == [1.0, -1.0, 0.25, 1.5, 1.0, -1.0]
    # correct means at least reward_correct (1.0): a full match, a bonus above it, True
    assert [r.correct for r in results[:6]] == [True, False, False, True, True, False]
    assert reasons(results[:6]) == ["correct", "incorrect", "incorrect", "correct", "correct", "incorrect"]
    where = results[6].reward
    assert int(where // 10) == reward_pool.worker_pids[0]  # computed in the worker, not in this process
    assert where % 10 == 0  # and not as root: the worker had dropped to its own uid (or never had root)


def test_reward_fn_errors_are_verdicts_and_the_worker_lives_on(reward_pool):
    pids, replaced = reward_pool.worker_pids, reward_pool.stats["workers_replaced"]
    results = reward_pool.verify([("raise:zebra", "cat"), ("text:", "cat"), ("none:", "cat"), ("nan:", "cat"),
                                  ("exit:", "cat"), ("label:cat", "cat")])
    assert reasons(results) == ["reward_error"] * 5 + ["correct"]
    assert [r.reward for r in results] == [-1.0] * 5 + [1.0]
    assert results[0].detail == "reward_fn raised ValueError: unknown label zebra"
    assert results[1].detail == "reward_fn returned str, not a float"
    assert results[2].detail == "reward_fn returned NoneType, not a float"
    assert results[3].detail == "reward_fn returned nan, not a finite float"
    assert results[4].detail == "reward_fn raised SystemExit: 3"
    assert reward_pool.worker_pids == pids and reward_pool.stats["workers_replaced"] == replaced


def test_reward_fn_runs_under_the_sandbox_limits(reward_pool):
    replaced = reward_pool.stats["workers_replaced"]
    results = reward_pool.verify([("hang:", "x"), ("hang_hard:", "x"), ("memory:", "x"), ("label:cat", "cat")],
                                 budget_s=math.inf)
    print("hang, hard hang, 8 GiB:", reasons(results), [r.detail for r in results])
    assert reasons(results) == ["timeout", "timeout", "crash", "correct"]
    assert results[0].detail.startswith("soft limit")  # the worker's timer: the worker was kept
    assert results[1].detail == "no result within 1.5s"  # the pool's kill
    assert results[2].detail == "worker died: MemoryError"  # RLIMIT_AS of 512 MiB
    assert reward_pool.stats["workers_replaced"] - replaced == 2


def test_reward_fn_paths_resolve_or_say_why(user_rewards_path):
    from async_vapo.verify.reward_fn import RewardFnError, load_reward_fn

    assert load_reward_fn("vapo_user_rewards:Scorers.exact")("a", "a") is True
    for path, why in [("vapo_user_rewards", "expected 'module:function'"),
                      ("vapo_user_rewards:", "expected 'module:function'"),
                      ("no_such_module_here:f", "cannot import 'no_such_module_here' (ModuleNotFoundError"),
                      ("vapo_broken_rewards:f", "cannot import 'vapo_broken_rewards' (RuntimeError: broken at import)"),
                      ("vapo_user_rewards:missing", "'vapo_user_rewards' has no attribute 'missing'"),
                      ("vapo_user_rewards:NOT_CALLABLE", "int is not callable")]:
        with pytest.raises(RewardFnError) as e:
            load_reward_fn(path)
        assert why in str(e.value), str(e.value)


def test_a_bad_reward_fn_stops_the_pool_from_starting_with_its_reason(user_rewards_path):
    from async_vapo.config import load_config

    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(WorkerStartError, match="^verifier.reward_fn = 'vapo_user_rewards:missing': "
                                               "'vapo_user_rewards' has no attribute 'missing'$"):
        VerifierPool(num_workers=1, reward_fn="vapo_user_rewards:missing")
    _wait_until(lambda: {c.pid for c in psutil.Process().children(recursive=True)} <= before)
    with pytest.raises(ValueError, match="module:function"):
        VerifierPool(num_workers=1, reward_fn="not a path")
    with pytest.raises(ValueError, match="expected 'module:function'"):  # the loader's error or pydantic's
        load_config([], ["verifier.reward_fn=rewards.py"])
    v = load_config([], ["verifier.reward_fn=vapo_user_rewards:Scorers.exact", "verifier.num_workers=1"]).verifier
    with VerifierPool.from_config(v) as p:
        assert reasons(p.verify([("yes", "yes"), ("yes", "no")])) == ["correct", "incorrect"]
