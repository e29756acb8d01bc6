"""The tool sandbox's two backends compared: the attacks of issue 51 and the start-up cost per call.

For each backend of ``async_vapo.verify.tool_sandbox`` (``own``, ``bwrap``), and for the own backend without its
mount namespace (``own-no-mountns``, to show what the mount namespace holds), runs each attack once and records
whether it was contained, with the evidence: writes outside the scratch dir (/tmp, /dev/shm, the repository, the
service's $HOME), reading the service's CURVE secret key (0600) and a world-readable copy in the repository's runs/,
a connection to a socket listening on the host's loopback and to an outside address, a fork bomb (the most
children alive at once), a memory bomb (4 GiB), an infinite loop and a sleep (seconds until ended), SIGKILL to the
caller and to a sibling process, state for the next call (a file, an environment variable, a background process),
endless output (bytes kept, seconds until ended) and a segfault. Then the start-up cost: ``--calls`` calls of
``print(1)`` per backend, interleaved so both see the same load, the wall time of ``run_python`` (uid lease
included), beside a bare ``python3 -I -S -c 'print(1)'`` without any sandbox.

    sudo .venv/bin/python benchmarks/tool_sandbox.py [--calls 50]

Needs root and bubblewrap (.ci/install_bubblewrap.sh). Writes ``benchmarks/results/tool_sandbox/results.json`` and
prints the tables (markdown).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from async_vapo.transport.security import create_keys  # noqa: E402
from async_vapo.verify.tool_sandbox import (  # noqa: E402
    PYTHON,
    ToolLimits,
    _uid_pids,
    run_python,
    unavailable_reason,
)

OUT = ROOT / "benchmarks" / "results" / "tool_sandbox"
LIMITS = ToolLimits(wall_s=3.0, cpu_s=2, memory_mb=256, max_processes=8, output_bytes=16 << 10, drain_bytes=4 << 20)
CONFIGS = {"own": {"backend": "own"}, "bwrap": {"backend": "bwrap"},
           "own-no-mountns": {"backend": "own", "_mount_ns": False}}


def _call(config: str, code: str, limits: ToolLimits = LIMITS):
    return run_python(code, limits=limits, **CONFIGS[config])


def _json_out(result) -> dict:
    try:
        return json.loads(result.stdout)
    except ValueError:
        return {"unparsed": result.stdout[-300:], "status": result.status, "stderr": result.stderr[-300:]}


def attack_writes(config: str) -> dict:
    tag = uuid.uuid4().hex[:12]
    paths = [f"/tmp/tool-escape-{tag}", f"/dev/shm/tool-escape-{tag}", str(ROOT / f"tool-escape-{tag}"),
             os.path.join(os.path.expanduser("~"), f"tool-escape-{tag}")]
    code = (f"import json\nout = {{}}\nfor p in {paths!r}:\n    try:\n        open(p, 'w').write('x')\n"
            "        out[p] = 'written'\n    except OSError as e:\n        out[p] = type(e).__name__\n"
            "print(json.dumps(out))\n")
    result = _call(config, code)
    escaped = [p for p in paths if os.path.exists(p)]
    for p in escaped:
        os.unlink(p)
    seen = _json_out(result)
    return {"contained": not escaped, "evidence": {"on the host": escaped, "inside": seen}}


def attack_keys(config: str, keys_root: Path) -> dict:
    secret = create_keys(keys_root / "keys", roles=("learner",)) / "learner.key_secret"
    loose_dir = ROOT / "runs" / f"tool-sandbox-bench-{uuid.uuid4().hex[:12]}"
    loose_dir.mkdir(parents=True)
    try:
        loose = loose_dir / "learner.key_secret"
        shutil.copyfile(secret, loose)
        os.chmod(loose_dir, 0o755)
        os.chmod(loose, 0o644)
        targets = [str(secret), str(loose)]
        code = (f"import json\nout = {{}}\nfor p in {targets!r}:\n    try:\n        out[p] = open(p).read()\n"
                "    except OSError as e:\n        out[p] = type(e).__name__\nprint(json.dumps(out))\n")
        seen = _json_out(_call(config, code))
    finally:
        shutil.rmtree(loose_dir, ignore_errors=True)
    refused = ("FileNotFoundError", "PermissionError")
    names = ("0600 key", "0644 copy in runs/")
    shown = {name: str(seen.get(t, seen))[:60] for name, t in zip(names, targets, strict=True)}
    return {"contained": all(seen.get(t) in refused for t in targets), "evidence": shown}


def attack_network(config: str) -> dict:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        listener.settimeout(0.5)
        port = listener.getsockname()[1]
        code = (f"import json, socket\nout = {{}}\nfor h, p in (('127.0.0.1', {port}), ('1.1.1.1', 53)):\n"
                "    s = socket.socket()\n    s.settimeout(1.0)\n    try:\n        s.connect((h, p))\n"
                "        out[h] = 'connected'\n    except OSError as e:\n        out[h] = type(e).__name__\n"
                "out['interfaces'] = [n for _i, n in socket.if_nameindex()]\nprint(json.dumps(out))\n")
        seen = _json_out(_call(config, code))
        try:
            listener.accept()[0].close()
            reached = True
        except TimeoutError:
            reached = False
    return {"contained": not reached and seen.get("1.1.1.1") != "connected", "evidence": seen}


def attack_fork_bomb(config: str) -> dict:
    counted = _call(config, "import os, time\nn = 0\ntry:\n    for _ in range(500):\n        if os.fork() == 0:\n"
                            "            time.sleep(2)\n            os._exit(0)\n        n += 1\nexcept OSError as e:\n"
                            "    print(n, e.strerror)\n")
    bomb = _call(config, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n")
    left = _uid_pids(bomb.uid) if bomb.uid is not None else []
    forked = int(counted.stdout.split()[0]) if counted.stdout.split() else None
    return {"contained": forked is not None and forked < LIMITS.max_processes and not left,
            "evidence": {"children alive at most": forked, "bomb": f"{bomb.status} after {bomb.seconds:.2f}s",
                         "processes left": left}}


def attack_memory(config: str) -> dict:
    result = _call(config, "block = bytearray(4 << 30)\nprint(len(block))")
    return {"contained": result.status == "error" and "MemoryError" in result.stderr,
            "evidence": f"{result.status}, {result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ''}"}


def attack_loop(config: str) -> dict:
    spin = _call(config, "while True:\n    pass")
    sleep = _call(config, "import time\ntime.sleep(600)")
    bound = LIMITS.wall_s + 1.0
    return {"contained": spin.status == "timeout" and sleep.status == "timeout" and max(spin.seconds,
                                                                                       sleep.seconds) < bound,
            "evidence": {"spin": f"{spin.status} ({spin.detail}) after {spin.seconds:.2f}s",
                         "sleep": f"{sleep.status} ({sleep.detail}) after {sleep.seconds:.2f}s"}}


def attack_signals(config: str) -> dict:
    sibling = subprocess.Popen(["sleep", "60"])
    try:
        code = (f"import os, signal\nout = []\nfor pid in ({os.getpid()}, {sibling.pid}):\n    try:\n"
                "        os.kill(pid, signal.SIGKILL)\n        out.append('sent')\n    except OSError as e:\n"
                "        out.append(type(e).__name__)\nprint(out)\n")
        result = _call(config, code)
        time.sleep(0.2)
        alive = sibling.poll() is None
    finally:
        sibling.kill()
        sibling.wait()
    return {"contained": alive, "evidence": {"caller, sibling": result.stdout.strip(), "sibling alive": alive}}


def attack_state(config: str) -> dict:
    first = _call(config, "import os, time\nopen('state.txt', 'w').write('x')\nos.environ['TOOL_STATE'] = 'x'\n"
                          "if os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n")
    left = _uid_pids(first.uid) if first.uid is not None else []
    second = _call(config, "import os\nothers = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in "
                           "(1, os.getpid())]\nprint(os.path.exists('state.txt'), os.environ.get('TOOL_STATE'), "
                           "len(others))")
    seen = second.stdout.split()
    return {"contained": not left and seen == ["False", "None", "0"],
            "evidence": {"file, env, other processes in call 2": seen, "processes of call 1 left": left}}


def attack_output(config: str) -> dict:
    result = _call(config, "while True:\n    print('y' * 65536)")
    return {"contained": result.status == "output_limit" and len(result.stdout) <= LIMITS.output_bytes,
            "evidence": f"{result.status} after {result.seconds:.2f}s, {result.output_bytes} bytes read, "
                        f"{len(result.stdout)} kept"}


def attack_crash(config: str) -> dict:
    result = _call(config, "import ctypes\nctypes.string_at(0)")
    return {"contained": result.status == "killed", "evidence": f"{result.status} {result.signal}"}


ATTACKS = {"writes outside scratch": attack_writes, "CURVE keys": attack_keys, "network": attack_network,
           "fork bomb": attack_fork_bomb, "memory bomb": attack_memory, "infinite loop / sleep": attack_loop,
           "signal caller / sibling": attack_signals, "state for the next call": attack_state,
           "endless output": attack_output, "segfault": attack_crash}


def startup(calls: int) -> dict:
    samples: dict[str, list[float]] = {"none (bare python3 -I -S)": [], "own": [], "bwrap": []}
    for _ in range(calls):
        t = time.monotonic()
        subprocess.run([PYTHON, "-I", "-S", "-c", "print(1)"], capture_output=True, check=True)
        samples["none (bare python3 -I -S)"].append(time.monotonic() - t)
        for backend in ("own", "bwrap"):
            result = run_python("print(1)", backend=backend)
            assert result.status == "ok" and result.stdout == "1\n", result
            samples[backend].append(result.seconds)
    out = {}
    for name, xs in samples.items():
        xs = sorted(xs)
        out[name] = {"median_ms": 1000 * statistics.median(xs), "p90_ms": 1000 * xs[int(0.9 * (len(xs) - 1))],
                     "min_ms": 1000 * xs[0], "calls": len(xs)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=50, help="start-up calls per backend")
    args = p.parse_args(argv)
    for backend in ("own", "bwrap"):
        reason = unavailable_reason(backend)
        if reason:
            p.error(f"{backend}: {reason}")
    import tempfile

    keys_root = Path(tempfile.mkdtemp(prefix="tool-sandbox-bench-"))
    attacks: dict[str, dict] = {}
    try:
        for name, attack in ATTACKS.items():
            attacks[name] = {}
            for config in CONFIGS:
                t = time.monotonic()
                row = attack(config, keys_root) if attack is attack_keys else attack(config)
                row["seconds"] = time.monotonic() - t
                attacks[name][config] = row
                print(f"{name:28s} {config:15s} contained={row['contained']}", file=sys.stderr)
    finally:
        shutil.rmtree(keys_root, ignore_errors=True)
    cost = startup(args.calls)
    bwrap_version = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
    report = {
        "limits": LIMITS.__dict__, "attacks": attacks, "startup": cost,
        "environment": {"kernel": platform.release(), "bwrap": bwrap_version, "python": PYTHON,
                        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "date": time.strftime("%Y-%m-%d")},
    }  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print("| attack | " + " | ".join(CONFIGS) + " |\n|---|" + "---|" * len(CONFIGS))
    for name, row in attacks.items():
        print(f"| {name} | " + " | ".join("contained" if row[c]["contained"] else "**not contained**"
                                          for c in CONFIGS) + " |")
    print("\n| start-up, print(1) | median ms | p90 ms |\n|---|---|---|")
    for name, s in cost.items():
        print(f"| {name} | {s['median_ms']:.0f} | {s['p90_ms']:.0f} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {OUT / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
