"""deploy/start_cluster.sh --hostfile over real ssh: the test runs its own sshd on a loopback port (throwaway host
and client keys, no PAM, nothing read from ~/.ssh), puts the verifier and the rollout on host 127.0.0.2 (which
start_cluster.sh does not treat as local, so both go through ssh, under a supervisord started there) and replay and
learner on localhost, trains a few steps, SIGKILLs the remote verifier (that host's supervisord restarts it), and
stops everything with stop_cluster.sh from an environment without ASYNC_VAPO_SSH (it must use the command recorded
in RUN_DIR/pids/cluster.env). Needs the OpenSSH server (.ci/install_sshd.sh)."""

from __future__ import annotations

import getpass
import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import free_ports, group_alive

REPO = Path(__file__).resolve().parents[2]
REMOTE = "127.0.0.2"  # a loopback address, but not one is_local() in start_cluster.sh accepts




def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"({exc})"




def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode(errors="replace").split("=", 1) for x in raw if b"=" in x)


def _sshd_tools() -> tuple[str, str, str] | None:
    sshd = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)
    ssh, keygen = shutil.which("ssh"), shutil.which("ssh-keygen")
    return (sshd, ssh, keygen) if sshd and ssh and keygen else None


@pytest.fixture
def sshd(tmp_path):
    """A non-daemon sshd on REMOTE:<free port> accepting only a throwaway key for the current user."""
    tools = _sshd_tools()
    if tools is None:
        pytest.skip("the OpenSSH server/client is not installed (.ci/install_sshd.sh installs Debian's openssh-server)")
    sshd_bin, ssh_bin, keygen = tools
    try:
        port = free_ports(1, REMOTE)[0]
    except OSError as exc:
        pytest.skip(f"cannot bind {REMOTE} (not a Linux loopback?): {exc}")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory (compiled in)
    d = tmp_path / "sshd"
    d.mkdir()
    for key in ("host_key", "client_key"):
        subprocess.run([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "async-vapo-test", "-f", str(d / key)],
                       check=True)
    (d / "authorized_keys").write_text((d / "client_key.pub").read_text())
    user = getpass.getuser()
    (d / "sshd_config").write_text(
        f"Port {port}\nListenAddress {REMOTE}\nHostKey {d / 'host_key'}\nPidFile {d / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {d / 'authorized_keys'}\nAllowUsers {user}\nStrictModes no\nUsePAM no\n"
        "PubkeyAuthentication yes\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
        "PermitRootLogin prohibit-password\nX11Forwarding no\nAllowTcpForwarding no\nAllowAgentForwarding no\n"
        "PrintMotd no\nLogLevel VERBOSE\n")
    log = d / "sshd.log"
    proc = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(d / "sshd_config")], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    ssh_cmd = (f"{ssh_bin} -o BatchMode=yes -p {port} -i {d / 'client_key'} -o StrictHostKeyChecking=no "
               "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=10 -o IdentitiesOnly=yes")
    try:
        deadline = time.monotonic() + 20
        while True:
            probe = subprocess.run([*ssh_cmd.split(), REMOTE, "echo ok"], capture_output=True, text=True,
                                   stdin=subprocess.DEVNULL, timeout=20)
            if probe.returncode == 0 and probe.stdout.strip() == "ok":
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"sshd on {REMOTE}:{port} did not accept the test key (ssh: {probe.stderr.strip()});"
                            f" sshd log:\n{_tail(log)}")
            time.sleep(0.2)
        yield SimpleNamespace(port=port, ssh_cmd=ssh_cmd, log=log, proc=proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _sessions(log: Path) -> int:
    """Command sessions sshd started (one per ssh call of start_cluster.sh / stop_cluster.sh)."""
    return len(re.findall(r"Starting session: command for", log.read_text(errors="replace")))


def _metric(host: str, port: int, name: str, labels: str = "") -> float | None:
    """One sample of ``name`` (with exactly the label set ``labels``, e.g. ``via="zmq"``) from a /metrics page."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return None
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(?:\{[^}]*\})?")
    m = re.search(rf"^{pattern} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _served_version(port: int) -> float | None:
    return _metric(REMOTE, port, "async_vapo_rollout_served_version")


@pytest.mark.slow
def test_hostfile_roles_start_and_stop_over_ssh(sshd, tiny_cfg, tiny_base, tmp_path):
    from conftest import TINY_TEST_OVERRIDES

    from async_vapo.config.schema import PortsConfig

    port_names = list(PortsConfig.model_fields)  # every socket: a free port
    ports = dict(zip(port_names, free_ports(len(port_names), "0.0.0.0"), strict=True))
    total_steps = 3
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster.ports]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items())
                      + "[cluster.wire]\nheartbeat_s = 0.5\n[cluster.deploy]\nhealth_timeout_s = 240\n"
                      + "stop_grace_s = 15\n[cluster.replay]\nfsync = \"never\"\n")
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                 f"train.total_steps={total_steps}", "train.eval_every=100", "train.checkpoint_every=0",
                 # 127.0.0.2 shares this machine's /dev/shm, where "auto" would map the learner's slots: force the
                 # way an engine on a real second machine takes, fetching each version over ZeroMQ
                 "cluster.weights.transfer=zmq"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"# host role\nlocalhost replay\n{REMOTE} verifier\n{REMOTE} rollout\nlocalhost learner\n")
    remote_names, local_names = {"verifier", "rollout-0"}, {"replay", "learner"}
    run_dir = tmp_path / "run"
    pids_dir = run_dir / "pids"
    py = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else "python"
    base_env = {k: v for k, v in os.environ.items() if k != "ASYNC_VAPO_SSH"}
    start = None

    def diagnostics() -> str:
        parts = []
        if start is not None:
            parts.append(f"--- start_cluster.sh exit {start.returncode}, stderr:\n{start.stderr[-4000:]}")
        for log in sorted((run_dir / "logs").glob("*.log")):
            parts.append(f"--- {log.name}:\n{_tail(log)}")
        parts.append(f"--- sshd.log:\n{_tail(sshd.log, 12)}")
        return "\n".join(parts)

    t0 = time.monotonic()
    sessions_before = _sessions(sshd.log)
    try:
        start = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config),
                                "--run-dir", str(run_dir), "--hostfile", str(hostfile), "--", *overrides],
                               cwd=REPO, env={**base_env, "PYTHON": py, "ASYNC_VAPO_SSH": sshd.ssh_cmd},
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=360)
        assert start.returncode == 0, "start_cluster.sh failed"
        t_up = time.monotonic() - t0
        pids = {p.stem: int(p.read_text()) for p in pids_dir.glob("*.pid")}
        assert set(pids) == remote_names | local_names
        assert {p.stem: p.read_text().strip() for p in pids_dir.glob("*.host")} == dict.fromkeys(remote_names, REMOTE)
        env_file = (pids_dir / "cluster.env").read_text().splitlines()
        assert f"ASYNC_VAPO_SSH={sshd.ssh_cmd}" in env_file and "STOP_GRACE=15" in env_file
        assert _sessions(sshd.log) - sessions_before >= len(remote_names)  # one start each (plus liveness checks)

        # The recorded PIDs are the services themselves, each leading its own process group, children of its host's
        # supervisord (a daemon: a session of its own, not this test's); the remote ones were started by our sshd
        # (its session variables name 127.0.0.2 and the test's port), the local ones not.
        import psutil

        sshd_tag = f" {REMOTE} {sshd.port}"
        t0_env = {}
        for name, pid in pids.items():
            role = name.split("-")[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            assert str(REPO / "services" / f"{role}.py").encode() in cmdline, (name, cmdline)
            assert os.getpgid(pid) == pid and os.getsid(pid) != os.getsid(0), name
            conf = run_dir / "supervisor" / f"{REMOTE if name in remote_names else 'local'}.conf"
            supervisor = psutil.Process(pid).parent()
            assert "supervisor.supervisord" in supervisor.cmdline() and str(conf) in supervisor.cmdline(), name
            assert os.getsid(supervisor.pid) == supervisor.pid, name
            environ = _environ(pid)
            from_sshd = environ.get("SSH_CONNECTION", "").endswith(sshd_tag)
            assert from_sshd == (name in remote_names), (name, environ.get("SSH_CONNECTION"))
            t0_env[name] = environ.get("ASYNC_VAPO_T0")
            if name in remote_names:
                assert environ["PYTHONPATH"].split(":")[0] == str(REPO)
        assert len(set(t0_env.values())) == 1 and None not in t0_env.values(), t0_env  # one wall-clock origin

        # Every service was told where the others are: the hostfile's hosts, this machine as 127.0.0.1 for 127.0.0.2
        resolved = json.loads((run_dir / "config.resolved.json").read_text())["cluster"]["hosts"]
        assert (resolved["bind_host"], resolved["verifier_host"], resolved["rollout_hosts"]) == (
            "0.0.0.0", REMOTE, [REMOTE])
        assert (resolved["replay_host"], resolved["learner_host"]) == ("127.0.0.1", "127.0.0.1")

        # The learner trains; the rollout on 127.0.0.2 (scraped there) serves each new version, over connections to
        # the hosts of the hostfile: rollout -> verifier at 127.0.0.2 and learner at 127.0.0.1 (weights, acks),
        # verifier -> replay at 127.0.0.1 (looked at while the loop runs, once a first update came back).
        def peers(pid: int) -> set[tuple[str, int]]:
            return {(c.raddr.ip, c.raddr.port) for c in psutil.Process(pid).net_connections(kind="tcp")
                    if c.raddr and c.status == psutil.CONN_ESTABLISHED}

        served_seen: list[float] = []
        rollout_peers = verifier_peers = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            served = _served_version(ports["rollout_metrics_port"])
            if served is not None and (not served_seen or served != served_seen[-1]):
                served_seen.append(served)
            if served is not None and served >= 1 and rollout_peers is None:
                rollout_peers, verifier_peers = peers(pids["rollout-0"]), peers(pids["verifier"])
            if (run_dir / "DONE").exists() and served == total_steps:
                break
            time.sleep(0.5)
        assert (run_dir / "DONE").exists(), "the learner did not finish"
        assert len(served_seen) >= 2 and served_seen == sorted(served_seen) and served_seen[-1] == total_steps, \
            served_seen
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, total_steps + 1))
        assert {(REMOTE, ports["verifier_port"]), ("127.0.0.1", ports["weights_port"]),
                ("127.0.0.1", ports["acks_port"])} <= rollout_peers, rollout_peers
        assert ("127.0.0.1", ports["replay_port"]) in verifier_peers, verifier_peers
        # every version reached the remote engine over the learner's fetch socket
        assert _metric(REMOTE, ports["rollout_metrics_port"], "async_vapo_rollout_weight_transfers_total",
                       'via="zmq"') == total_steps
        assert (_metric("127.0.0.1", ports["learner_metrics_port"], "async_vapo_learner_weight_fetch_bytes_total")
                or 0) > 0

        # The ssh-started services log into RUN_DIR/logs like the local ones.
        for name in remote_names | local_names:
            assert "/metrics and /health on" in (run_dir / "logs" / f"{name}.log").read_text(), name
        # The remote host's supervisord restarts a service that dies there: a new verifier, its PID in the file
        # (the services share this machine's file system here, as they would a shared RUN_DIR), started by it.
        killed = pids["verifier"]
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = int((pids_dir / "verifier.pid").read_text())
            health = _metric(REMOTE, ports["verifier_metrics_port"], "async_vapo_verifier_up")
            if new != killed and health == 1.0:
                break
            time.sleep(0.3)
        else:
            pytest.fail(f"the remote verifier was not restarted: {(pids_dir / 'verifier.pid').read_text()}")
        assert psutil.Process(new).parent().pid == psutil.Process(pids["rollout-0"]).parent().pid  # same supervisord
        assert _environ(new).get("SSH_CONNECTION", "").endswith(sshd_tag)
        events = (run_dir / "supervisor" / f"events-{REMOTE}.jsonl").read_text()
        assert '"name": "verifier", "event": "restarted"' in events, events
        pids["verifier"] = new
        print(f"cluster (2 roles over ssh) healthy after {t_up:.0f} s, trained {total_steps} steps by "
              f"{time.monotonic() - t0:.0f} s")
    except BaseException:
        print(diagnostics())
        raise
    finally:  # also after a failed start: stop_cluster.sh, without ASYNC_VAPO_SSH (it must read cluster.env)
        sessions_before_stop = _sessions(sshd.log)
        try:
            stop = subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], env=base_env,
                                  capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=180)
        except subprocess.TimeoutExpired as exc:
            stop = SimpleNamespace(returncode=None, stderr=f"timed out: {exc.stderr}")
        pids = {p.stem: int(p.read_text()) for p in pids_dir.glob("*.pid")}
        children = [int(x) for f in pids_dir.glob("*.children") for x in f.read_text().split()]
        left = [n for n, pgid in pids.items() if group_alive(pgid)] + [
            c for c in children if Path(f"/proc/{c}/cmdline").exists()
            and b"async_vapo.verify.sandbox" in Path(f"/proc/{c}/cmdline").read_bytes()]
        for pgid in pids.values():  # never leave a cluster behind, whatever stop_cluster.sh did
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for c in children:
            try:
                if b"async_vapo.verify.sandbox" in Path(f"/proc/{c}/cmdline").read_bytes():
                    os.kill(c, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    assert stop.returncode == 0, f"stop_cluster.sh: {stop.stderr}\n{diagnostics()}"
    assert not left, f"left running after stop_cluster.sh: {left}\n{stop.stderr}\n{diagnostics()}"
    assert f"stopped {len(local_names)} local and {len(remote_names)} remote" in stop.stderr, stop.stderr
    assert _sessions(sshd.log) > sessions_before_stop, "stop_cluster.sh made no ssh call"
    assert (pids_dir / "verifier.children").read_text().split()  # the remote verifier's sandbox workers, gone too
