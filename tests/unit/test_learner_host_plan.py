"""A learner on several hosts: its placement (ranks split evenly over the learner lines of the hostfile, an uneven
split refused), start_cluster.sh --dry-run's torchrun agents (c10d rendezvous on the first learner host), the ranks
taken by node (async_vapo.services.learner --node-rank) and the checkpoint a restarted learner resumes from. No
process is started."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from async_vapo.deploy.placement import PlacementError, parse_hostfile, place, shell_assignments

REPO = Path(__file__).resolve().parents[2]
HOSTS = "n1 learner\nn1 replay\nn1 verifier\nn2 learner\nn2 rollout\nn3 rollout\n"


def test_two_learner_hosts_split_the_ranks_evenly():
    p = place(4, 8, gpus_per_host=8, hostfile=parse_hostfile(HOSTS))
    agents = [(a.name, a.host, a.node, a.ranks, a.cuda_visible_devices) for a in p.learners]
    assert agents == [("learner", "n1", 0, (0, 1, 2, 3), "0,1,2,3"), ("learner-1", "n2", 1, (4, 5, 6, 7), "0,1,2,3")]
    # engines take what the learner left: n2 has a learner agent and a rollout line, n3 only the rollout line
    assert [(e.host, e.cuda_visible_devices) for e in p.engines] == [("n2", "4"), ("n3", "0"), ("n2", "5"),
                                                                     ("n3", "1")]
    assert p.idle == {"n1": (4, 5, 6, 7), "n2": (6, 7), "n3": (2, 3, 4, 5, 6, 7)}
    table = p.describe()
    assert "learner     n1  CUDA_VISIBLE_DEVICES=0,1,2,3  (node 0 of 2: ranks 0-3)" in table
    assert "learner-1   n2  CUDA_VISIBLE_DEVICES=0,1,2,3  (node 1 of 2: ranks 4-7)" in table
    lines = shell_assignments(p)
    assert {"LEARNER_AGENTS='learner learner-1'", "LEARNER_RANKS_PER_HOST=4", "HOST_LEARNER_1=n2",
            "GPUS_LEARNER_1=0,1,2,3"} <= set(lines)
    # without GPUs: the same agents, one rank each, on the CPU
    q = place(2, 2, hostfile=parse_hostfile(HOSTS))
    assert [(a.name, a.host, a.ranks, a.gpus) for a in q.learners] == [("learner", "n1", (0,), ()),
                                                                       ("learner-1", "n2", (1,), ())]
    assert "learner-1   n2  CPU  (node 1 of 2: rank 1)" in q.describe()
    # one learner line (or none): one agent with every rank, as before
    one = place(2, 2, gpus_per_host=4)
    assert [(a.name, a.host, a.ranks, a.gpus) for a in one.learners] == [("learner", "localhost", (0, 1), (0, 1))]
    assert "LEARNER_AGENTS=learner" in shell_assignments(one)


@pytest.mark.parametrize("learner_devices, gpus, match", [
    (3, 0, r"learner_devices = 3 does not divide evenly over the 2 learner hosts \(n1, n2\).*multiple of 2"),
    (5, 8, r"learner_devices = 5 does not divide evenly over the 2 learner hosts"),
    (10, 4, r"learner_devices = 10 over 2 learner hosts is 5 ranks per host, more than a host's 4 GPUs: lower "
            r"async.learner_devices to at most 8, or add learner hosts"),
])
def test_a_learner_that_does_not_split_over_its_hosts_is_refused(learner_devices, gpus, match):
    with pytest.raises(PlacementError, match=match):
        place(2, learner_devices, gpus_per_host=gpus, hostfile=parse_hostfile(HOSTS))


def dry_run(tmp_path, hostfile: str, *args, overrides=(), env=None):
    hf = tmp_path / "hosts"
    hf.write_text(hostfile)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable, **(env or {})}
    cmd = ["bash", str(REPO / "deploy/start_cluster.sh"), "--config", str(REPO / "configs/tiny_cpu.toml"),
           "--run-dir", str(tmp_path / "run"), "--hostfile", str(hf), "--dry-run", *args, "--", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def words(cmd: str) -> list[str]:
    return shlex.split(cmd)


def test_dry_run_prints_one_torchrun_agent_per_learner_host(tmp_path):
    r = dry_run(tmp_path, HOSTS, "--gpus-per-host", "8", overrides=[
        "async.rollout_devices=4", "async.learner_devices=8", "cluster.ports.learner_rdzv_port=6123"])
    assert r.returncode == 0, r.stderr
    assert "8 learner rank(s)" in r.stdout
    assert "learner     n1  CUDA_VISIBLE_DEVICES=0,1,2,3  (node 0 of 2: ranks 0-3)" in r.stdout
    assert "learner-1   n2  CUDA_VISIBLE_DEVICES=0,1,2,3  (node 1 of 2: ranks 4-7)" in r.stdout
    cmds = {ln.split("\t")[0]: ln.split("\t") for ln in r.stdout.splitlines() if "\t" in ln}
    assert set(cmds) == {"replay", "verifier", "rollout-0", "rollout-1", "rollout-2", "rollout-3", "learner",
                         "learner-1"}
    rdzv_ids = set()
    for node, name, host in ((0, "learner", "n1"), (1, "learner-1", "n2")):
        _, where, cmd = cmds[name]
        assert where == host and cmd.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3 ")
        w = words(cmd.split(" ", 1)[1])
        i = w.index("async_vapo.services.learner")
        assert w[i - 1] == "-m"  # torchrun's --module: the service runs as python -m async_vapo.services.learner
        torchrun, script = w[:i - 1], w[i + 1:]
        assert torchrun[1:3] == ["-m", "torch.distributed.run"]
        opt = {torchrun[i]: torchrun[i + 1] for i in range(3, len(torchrun) - 1, 2)}
        assert opt["--nnodes"] == "2" and opt["--node-rank"] == str(node) and opt["--nproc-per-node"] == "4"
        assert opt["--rdzv-backend"] == "c10d" and opt["--rdzv-endpoint"] == "n1:6123"  # the hostfile's name
        assert opt["--local-addr"] == host and opt["--max-restarts"] == "0"
        assert opt["--rdzv-conf"] == f"is_host={1 - node}"  # the first learner host serves the rendezvous
        rdzv_ids.add(opt["--rdzv-id"])
        assert script[script.index("--node-rank") + 1] == str(node)
        assert script[script.index("--host-addr") + 1] == host  # what gloo's interface is chosen by
        assert script[script.index("--resume-since") + 1] == str(tmp_path / "run" / "supervisor" / f"{host}.conf")
        assert "cluster.hosts.learner_host=n1" in script
    assert len(rdzv_ids) == 1
    assert not (tmp_path / "run").exists()


def test_dry_run_refuses_an_uneven_split_and_names_this_machine_by_its_address(tmp_path):
    r = dry_run(tmp_path, HOSTS, overrides=["async.rollout_devices=2", "async.learner_devices=3"])
    assert r.returncode == 2
    assert "does not divide evenly over the 2 learner hosts (n1, n2)" in r.stderr
    assert not (tmp_path / "run").exists()
    # the first learner host is this machine: the other hosts reach its rendezvous (and it announces itself) at
    # the address this machine is announced to them at
    r = dry_run(tmp_path, "localhost learner\nlocalhost replay\nlocalhost verifier\nlocalhost rollout\nn2 learner\n",
                overrides=["async.rollout_devices=1", "async.learner_devices=2"],
                env={"ASYNC_VAPO_ADVERTISE_HOST": "10.1.2.3"})
    assert r.returncode == 0, r.stderr
    cmds = {ln.split("\t")[0]: ln.split("\t") for ln in r.stdout.splitlines() if "\t" in ln}
    for name, host, addr in (("learner", "localhost", "10.1.2.3"), ("learner-1", "n2", "n2")):
        w = words(cmds[name][2])
        assert cmds[name][1] == host
        assert w[w.index("--rdzv-endpoint") + 1] == "10.1.2.3:5707" and w[w.index("--local-addr") + 1] == addr


def test_ranks_are_taken_by_node_rank_whatever_the_rendezvous_order():
    from async_vapo.learner.process_group import rank_by_node

    # c10d made the agent on the second learner host rendezvous rank 0: its ranks become 2 and 3
    for local in (0, 1):
        env = {"RANK": str(local), "GROUP_RANK": "0", "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": "2",
               "WORLD_SIZE": "4"}
        assert rank_by_node(1, env) == 2 + local
        assert (env["RANK"], env["GROUP_RANK"]) == (str(2 + local), "0")
    with pytest.raises(RuntimeError, match=r"node rank 2 does not fit torchrun's world: 4 ranks of 2 per agent"):
        rank_by_node(2, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"})


def test_gloo_connects_over_the_interface_of_the_agents_address():
    from async_vapo.learner.process_group import gloo_interface_for

    env: dict = {}
    assert gloo_interface_for("127.0.0.1", env) == "lo" and env == {"GLOO_SOCKET_IFNAME": "lo"}
    env = {"GLOO_SOCKET_IFNAME": "eth7"}  # the user's choice stands
    assert gloo_interface_for("127.0.0.1", env) == "eth7" and env == {"GLOO_SOCKET_IFNAME": "eth7"}
    env = {}
    assert gloo_interface_for("localhost", env) == "lo"  # a hostfile's host name, resolved
    env = {}
    assert gloo_interface_for("192.0.2.77", env) is None and env == {}  # no interface here holds it: gloo's default
    assert gloo_interface_for("no-such-host.invalid", env) is None and env == {}


def test_a_restarted_learner_resumes_from_the_newest_checkpoint_since_the_start(tmp_path):
    from async_vapo.services.learner import newest_checkpoint_since

    def checkpoint(step: int) -> None:
        d = tmp_path / "checkpoints" / f"step_{step}"
        d.mkdir(parents=True)
        (d / "learner_state.pt").write_bytes(b"x")

    checkpoint(10)  # an older start's, with a higher step
    marker = tmp_path / "supervisor.conf"
    time.sleep(0.02)
    marker.write_text("")
    assert newest_checkpoint_since(tmp_path, marker) is None
    time.sleep(0.02)
    checkpoint(4)
    checkpoint(6)
    (tmp_path / "checkpoints" / "step_8").mkdir()  # incomplete: no learner_state.pt
    assert newest_checkpoint_since(tmp_path, marker) == tmp_path / "checkpoints" / "step_6"
