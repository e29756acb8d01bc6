"""Test hosts on separate network stacks: Linux network namespaces joined by a bridge, each with its own address
and its own sshd.

``net_hosts(n, workdir)`` makes ``n`` namespaces ``<prefix>h1..hn``, each with one end of a veth pair (its ``eth0``)
whose other end sits on a bridge in this (the launching) namespace, addresses ``10.213.X.2 ..`` on a /24 no
interface here already uses, the bridge at ``10.213.X.1`` (the launch host as the test hosts see it), loopback up,
no route anywhere else. In each runs a non-daemon sshd on its own address, accepting only a throwaway key for the
current user (no PAM, nothing read from ~/.ssh). A process started over ssh to a host runs in that host's network
namespace (the file system, PIDs and /dev/shm stay shared, as on a cluster with a shared file system).

Traffic goes only to the addresses made here; everything is removed on exit: the processes left in the
namespaces (killed), the namespaces (with their veths) and the bridge. Needs root, iproute2 and the OpenSSH server;
:func:`unavailable` says why not when they are missing."""

from __future__ import annotations

import contextlib
import getpass
import ipaddress
import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class NetHosts:
    addrs: list[str]  # the hosts' addresses, one per namespace
    gateway: str  # this namespace's address on the bridge
    namespaces: list[str]
    ssh_cmd: str  # ASYNC_VAPO_SSH for start_cluster.sh: the throwaway key, no host-key checks
    sshd_logs: list[Path]
    sshd_pids: list[int] = field(default_factory=list)

    def netns_inode(self, i: int) -> int:
        return os.stat(f"/run/netns/{self.namespaces[i]}").st_ino

    def pids(self, i: int) -> list[int]:
        """The processes whose network namespace is host ``i``'s."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", "netns", "exec", ns, "ip", *args] if ns else ["ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def _tools() -> dict[str, str | None]:
    sshd = shutil.which("sshd") or next((p for p in ("/usr/sbin/sshd", "/sbin/sshd") if os.access(p, os.X_OK)), None)
    return {"ip": shutil.which("ip"), "sshd": sshd, "ssh": shutil.which("ssh"),
            "ssh-keygen": shutil.which("ssh-keygen")}


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here (None: they can)."""
    missing = [k for k, v in _tools().items() if v is None]
    if missing:
        return f"missing {', '.join(missing)} (.ci/install_sshd.sh installs Debian's openssh-server and iproute2)"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    probe = f"avprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode:
        return f"ip netns add failed: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    used = [ipaddress.ip_interface(w).network for line in out.splitlines() for w in line.split()[3:4]]
    candidates = [ipaddress.ip_network(f"10.213.{x}.0/24") for x in range(1, 255)]
    random.shuffle(candidates)
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.213.X.0/24 for the test hosts")


@contextlib.contextmanager
def net_hosts(n: int, workdir: Path, port: int = 2222) -> Iterator[NetHosts]:
    tools = _tools()
    tag = f"av{os.getpid() % 10000}{random.randrange(100):02d}"  # interface names: 15 characters at most
    net = _free_subnet()
    hosts = list(net.hosts())
    gateway, addrs = str(hosts[0]), [str(h) for h in hosts[1:n + 1]]
    bridge, namespaces = f"{tag}br", [f"{tag}h{i + 1}" for i in range(n)]
    workdir.mkdir(parents=True, exist_ok=True)
    for key in ("host_key", "client_key"):
        subprocess.run([tools["ssh-keygen"], "-q", "-t", "ed25519", "-N", "", "-C", "async-vapo-test", "-f",
                        str(workdir / key)], check=True)
    (workdir / "authorized_keys").write_text((workdir / "client_key.pub").read_text())
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory (compiled in)
    procs: list[subprocess.Popen] = []
    made_ns: list[str] = []
    made_bridge = False
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_bridge = True
        _ip("addr", "add", f"{gateway}/{net.prefixlen}", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (ns, addr) in enumerate(zip(namespaces, addrs, strict=True)):
            _ip("netns", "add", ns)
            made_ns.append(ns)
            veth = f"{tag}v{i + 1}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge)
            _ip("link", "set", veth, "up")
            _ip("addr", "add", f"{addr}/{net.prefixlen}", "dev", "eth0", ns=ns)
            _ip("link", "set", "eth0", "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
        logs = []
        for ns, addr in zip(namespaces, addrs, strict=True):
            conf = workdir / f"sshd_config.{addr}"
            conf.write_text(
                f"Port {port}\nListenAddress {addr}\nHostKey {workdir / 'host_key'}\n"
                f"PidFile {workdir / f'sshd.{addr}.pid'}\nAuthorizedKeysFile {workdir / 'authorized_keys'}\n"
                f"AllowUsers {getpass.getuser()}\nStrictModes no\nUsePAM no\nPubkeyAuthentication yes\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\n"
                "X11Forwarding no\nAllowTcpForwarding no\nAllowAgentForwarding no\nPrintMotd no\nLogLevel VERBOSE\n")
            log = workdir / f"sshd.{addr}.log"
            logs.append(log)
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, tools["sshd"], "-D", "-e", "-f", str(conf)],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log.open("w"),
                                          start_new_session=True))
        ssh_cmd = (f"{tools['ssh']} -o BatchMode=yes -p {port} -i {workdir / 'client_key'} "
                   "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "
                   "-o ConnectTimeout=10 -o IdentitiesOnly=yes")
        for addr, proc, log in zip(addrs, procs, logs, strict=True):
            deadline = time.monotonic() + 20
            while True:
                probe = subprocess.run([*ssh_cmd.split(), addr, "echo ok"], capture_output=True, text=True,
                                       stdin=subprocess.DEVNULL, timeout=20)
                if probe.returncode == 0 and probe.stdout.strip() == "ok":
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"sshd on {addr}:{port} did not accept the test key (ssh: "
                                       f"{probe.stderr.strip()}); sshd log:\n{log.read_text(errors='replace')}")
                time.sleep(0.2)
        yield NetHosts(addrs=addrs, gateway=gateway, namespaces=namespaces, ssh_cmd=ssh_cmd, sshd_logs=logs,
                       sshd_pids=[p.pid for p in procs])
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        for ns in made_ns:  # whatever still runs on a test host goes with it
            left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in left:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if made_bridge:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)
