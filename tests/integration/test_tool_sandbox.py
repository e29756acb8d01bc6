"""Attacks on the tool sandbox (async_vapo/verify/tool_sandbox.py) with real processes, on both backends: file
writes outside the scratch directory, reading the service's CURVE keys, the network, a fork bomb, a memory bomb, an
infinite loop, signalling the service and a sibling, state left for the next call, huge output, and a crash. Each
must be contained and come back as a result; the caller lives on.

The checks can fail: the same file-write and key checks run against the own backend without its mount namespace
(``_mount_ns=False``) and must fail there (the tool writes the host's /tmp and reads a key copied into the
repository's ``runs/``).

Needs root (each call runs as a uid of its own): skipped, with the reason, where not root; as root a missing
bubblewrap fails the tests (``make test-deps`` installs it, so CI never skips them). Budget: about 40 s.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from async_vapo.verify.sandbox import DEFAULT_UID_BASE
from async_vapo.verify.tool_sandbox import BACKENDS, ToolLimits, _uid_pids, run_python, unavailable_reason

ROOT = Path(__file__).resolve().parents[2]
FAST = ToolLimits(wall_s=3.0, cpu_s=2, max_processes=8)


def _require(backend: str) -> str:
    """Skip where not root (the sandbox needs root); as root (CI) a missing piece fails the test instead."""
    reason = unavailable_reason(backend)
    if reason is not None:
        if os.geteuid() != 0:
            pytest.skip(f"tool sandbox ({backend}) unavailable: {reason}")
        pytest.fail(f"tool sandbox ({backend}) unavailable as root: {reason} (make test-deps installs bubblewrap)")
    return backend


@pytest.fixture(params=BACKENDS)
def backend(request):
    return _require(request.param)


# The tests here lease their uids above the ones services take: another pytest worker's cluster (its verifier and its
# evaluation pool) leases the lowest free uids from DEFAULT_UID_BASE, so a uid a call here has just released could be
# a restarted verifier's worker's a moment later, a process of that uid that no call here left behind (seen in CI).
TEST_UID_BASE = DEFAULT_UID_BASE + 2048


def _run(code: str, backend: str, limits: ToolLimits = FAST, **kw):
    kw.setdefault("uid_base", TEST_UID_BASE)
    result = run_python(code, backend=backend, limits=limits, **kw)
    assert result.status != "sandbox_error", result
    return result


_TRY_WRITES = """
import json, sys
out = {}
for path in sys.argv[1:] if len(sys.argv) > 1 else PATHS:
    try:
        with open(path, "w") as f:
            f.write("escaped")
        out[path] = "written"
    except OSError as e:
        out[path] = type(e).__name__
print(json.dumps(out))
"""


def check_writes_contained(backend: str, **kw) -> None:
    """Writes to /tmp, /dev/shm, the repository and the service's $HOME fail inside and leave no file outside;
    a write to the scratch directory works."""
    tag = uuid.uuid4().hex[:12]
    outside = [f"/tmp/tool-escape-{tag}", f"/dev/shm/tool-escape-{tag}", str(ROOT / f"tool-escape-{tag}"),
               os.path.join(os.path.expanduser("~"), f"tool-escape-{tag}")]
    paths = [*outside, f"scratch-{tag}"]
    try:
        result = _run(f"PATHS = {paths!r}\n{_TRY_WRITES}", backend, **kw)
        assert result.status == "ok", result
        seen = json.loads(result.stdout)
        assert seen[paths[-1]] == "written", seen  # the scratch directory is writable
        for path in outside:
            assert seen[path] != "written", f"the tool wrote {path}: {seen}"
            assert not os.path.exists(path), f"{path} exists on the host"
    finally:
        for path in outside:
            if os.path.exists(path):
                os.unlink(path)


def check_keys_unreadable(backend: str, keys_dir: Path, **kw) -> None:
    """The service's CURVE secret key (0600, the service's user) and a copy left readable by everyone in the
    repository's runs/ cannot be read; nor can the config and the repository's code."""
    from async_vapo.transport.security import create_keys

    secret = create_keys(keys_dir, roles=("learner",)) / "learner.key_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    loose_dir = ROOT / "runs" / f"tool-sandbox-test-{uuid.uuid4().hex[:12]}"
    loose_dir.mkdir(parents=True)
    try:
        loose = loose_dir / "learner.key_secret"
        shutil.copyfile(secret, loose)
        os.chmod(loose_dir, 0o755)
        os.chmod(loose, 0o644)
        targets = [str(secret), str(loose), str(ROOT / "pyproject.toml")]
        code = (f"import json\nout = {{}}\nfor p in {targets!r}:\n    try:\n        out[p] = open(p).read()\n"
                "    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))\n")
        result = _run(code, backend, **kw)
        assert result.status == "ok", result
        seen = json.loads(result.stdout)
        key_text = secret.read_text()
        for target in targets:
            assert seen[target] in ("FileNotFoundError", "PermissionError"), f"the tool read {target}"
        assert "secret-key" not in result.stdout and key_text not in result.stdout
    finally:
        shutil.rmtree(loose_dir, ignore_errors=True)


def test_file_writes_outside_scratch_are_contained(backend):
    check_writes_contained(backend)


def test_curve_keys_are_unreadable(backend, tmp_path):
    check_keys_unreadable(backend, tmp_path / "keys")


def test_checks_fail_without_a_mount_namespace(tmp_path):
    """The same checks against the own backend with its mount namespace left out: the tool sees the host's file
    system as its uid, writes the host's /tmp and reads the world-readable key copy, so both checks fail."""
    _require("own")
    with pytest.raises(AssertionError, match="wrote /tmp/tool-escape"):
        check_writes_contained("own", _mount_ns=False)
    with pytest.raises(AssertionError, match="the tool read .*runs/tool-sandbox-test"):
        check_keys_unreadable("own", tmp_path / "keys", _mount_ns=False)


def test_network_is_unreachable(backend):
    """Neither a socket listening on the host's loopback nor an outside address can be reached; the tool sees a
    loopback device only."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = f"""
import json, socket
out = {{"interfaces": [name for _i, name in socket.if_nameindex()]}}
for host, port in (("127.0.0.1", {port}), ("1.1.1.1", 53), ("8.8.8.8", 443)):
    s = socket.socket()
    s.settimeout(1.0)
    try:
        s.connect((host, port))
        out[host] = "connected"
    except OSError as e:
        out[host] = e.errno
    s.close()
print(json.dumps(out))
"""
        result = _run(code, backend)
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing reached the host's socket
    assert result.status == "ok", result
    seen = json.loads(result.stdout)
    assert seen["interfaces"] == ["lo"], seen
    import errno

    assert seen["127.0.0.1"] in (errno.ECONNREFUSED, errno.ENETUNREACH), seen  # the sandbox's own loopback
    assert seen["1.1.1.1"] == errno.ENETUNREACH and seen["8.8.8.8"] == errno.ENETUNREACH, seen  # no route at all


def test_fork_bomb_is_bounded_and_leaves_nothing(backend):
    """Children that stay alive stop at max_processes (the uid's tasks, the sandbox's own included); a bomb whose
    every child forks too ends at the wall clock, and no process of its uid is left on the host."""
    counted = _run("""
import os, time
n = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(2)
            os._exit(0)
        n += 1
except OSError as e:
    print(n, e.errno)
""", backend)
    forked, err = counted.stdout.split()
    assert int(forked) < FAST.max_processes and int(err) == 11, counted  # EAGAIN
    bomb = _run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", backend)
    assert bomb.status == "timeout" and bomb.seconds < FAST.wall_s + 3, bomb
    assert _uid_pids(bomb.uid) == []


def test_calls_on_one_uid_leave_no_zombies(backend):
    """Ten calls in a row, each leasing the same free uid, all start: none leaves a process (a zombie included) that
    counts against the next call's RLIMIT_NPROC. bubblewrap's own pid 1 did, on a host whose init does not reap."""
    limits = ToolLimits(wall_s=3.0, max_processes=4)
    for i in range(10):
        result = _run("print('ok')", backend, limits)
        assert result.status == "ok" and result.stdout == "ok\n", (i, result)
        assert _uid_pids(result.uid) == [], (i, result.uid)


def test_memory_bomb_is_an_error(backend):
    result = _run("block = bytearray(4 << 30)\nprint(len(block))", backend)
    assert result.status == "error" and result.exit_code == 1 and "MemoryError" in result.stderr, result
    grow = _run("x = []\nwhile True:\n    x.append(bytearray(1 << 20))", backend)
    assert grow.status == "error" and "MemoryError" in grow.stderr, grow


def test_infinite_loop_times_out(backend):
    limits = ToolLimits(wall_s=2.0, cpu_s=1)
    spin = _run("while True:\n    pass", backend, limits)
    # the CPU limit (SIGXCPU at 1 s of CPU) or the wall clock (2 s), whichever the machine's load reaches first
    assert spin.status == "timeout" and spin.seconds < limits.wall_s + 3, spin
    sleeper = _run("import time\ntime.sleep(60)", backend, limits)
    assert sleeper.status == "timeout" and sleeper.detail.startswith("wall clock"), sleeper
    assert _uid_pids(sleeper.uid) == []


def test_cannot_signal_the_service_or_a_sibling(backend):
    """The tool knows the caller's pid and a sibling's and sends SIGKILL to both and to every process it may
    (kill -1); both live on."""
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        code = f"""
import os, signal
out = []
for pid in ({os.getpid()}, {sibling.pid}):
    try:
        os.kill(pid, signal.SIGKILL)
        out.append("sent")
    except OSError as e:
        out.append(type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)
except OSError:
    pass
print(out)
"""
        result = _run(code, backend)
        time.sleep(0.2)
        assert sibling.poll() is None, "the tool killed a sibling process"
        assert result.status in ("ok", "killed"), result  # kill(-1) may reach the tool's own process
    finally:
        sibling.kill()
        sibling.wait()


def test_no_state_for_the_next_call(backend):
    """A file, an environment variable and a background process made in one call are gone in the next."""
    first = _run("""
import os, time
open("state.txt", "w").write("left")
os.environ["TOOL_STATE"] = "left"
if os.fork() == 0:
    os.setsid()
    time.sleep(30)
    os._exit(0)
print(os.getpid())
""", backend)
    assert first.status == "ok", first
    assert _uid_pids(first.uid) == [], "a process of the first call outlived it"
    second = _run("""
import os
others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, os.getpid())]
print(os.path.exists("state.txt"), os.environ.get("TOOL_STATE"), os.listdir("."), others)
""", backend)
    # the sandbox's pid 1 (its reaper) and the tool itself, nothing else
    assert second.status == "ok" and second.stdout.split() == ["False", "None", "[]", "[]"], second


def test_huge_output_is_truncated_and_bounded(backend):
    limits = ToolLimits(wall_s=5.0, output_bytes=4096, drain_bytes=1 << 20)
    some = _run("import sys\nsys.stdout.write('x' * 300_000)\nsys.stderr.write('e' * 300_000)", backend, limits)
    assert some.status == "ok" and some.truncated and some.output_bytes == 600_000, some
    assert len(some.stdout) == 4096 and len(some.stderr) == 4096
    endless = _run("while True:\n    print('y' * 65536)", backend, limits)
    assert endless.status == "output_limit" and len(endless.stdout) == 4096, endless
    assert _uid_pids(endless.uid) == []


def test_crashes_are_results(backend):
    crash = _run("import ctypes\nctypes.string_at(0)", backend)
    assert crash.status == "killed" and crash.signal == "SIGSEGV", crash
    exits = _run("import os\nprint('before', flush=True)\nos._exit(3)", backend)
    assert exits.status == "error" and exits.exit_code == 3 and exits.stdout == "before\n", exits
    too_long = run_python("#" * (FAST.code_bytes + 1), backend=backend, limits=FAST, uid_base=TEST_UID_BASE)
    assert too_long.status == "too_long"
    syntax = _run("def (", backend)
    assert syntax.status == "error" and "SyntaxError" in syntax.stderr, syntax


def test_concurrent_calls_get_their_own_sandboxes(backend):
    """Four calls at once from four threads: each its own uid, each sees only its own scratch file."""
    results = [None] * 4

    def call(i):
        results[i] = _run(f"import os\nopen('mine', 'w').write('{i}')\nprint(os.listdir('.'), open('mine').read())",
                          backend)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [r.stdout.strip() for r in results] == [f"['mine'] {i}" for i in range(4)], results
    assert len({r.uid for r in results}) == 4


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="backend"):
        unavailable_reason("docker")
    with pytest.raises(ValueError, match="max_processes"):
        ToolLimits(max_processes=2)
    with pytest.raises(ValueError, match="drain_bytes"):
        ToolLimits(output_bytes=1 << 20, drain_bytes=1 << 20)
    if unavailable_reason("bwrap") is None:
        with pytest.raises(ValueError, match="mount namespace"):
            run_python("print(1)", backend="bwrap", _mount_ns=False)

