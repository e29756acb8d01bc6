"""deploy/start_cluster.sh with a learner on two hosts: a hostfile with two ``learner`` lines, 127.0.0.2 (reached
over real ssh, as in test_hostfile.py, whose sshd fixture this borrows) first and this machine second, and
``async.learner_devices=2``: one torchrun agent per line, one gloo rank each, meeting in torchrun's c10d rendezvous
served by the first. The rendezvous numbers this machine's agent first (its address sorts first); the ranks take
their global rank by node rank, so rank 0 (the learner's I/O) runs on 127.0.0.2, the hostfile's first learner host.

Under ``--wait``, after the first update's checkpoint, the second agent is SIGKILLed: its rank dies with it, its
supervisord restarts it, the group re-forms and continues from the newest checkpoint, and the run reaches DONE;
``--wait`` then stops everything. Needs the OpenSSH server (.ci/install_sshd.sh)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import free_ports, group_alive
from test_hostfile import REMOTE, _tail, sshd  # noqa: F401  (sshd: the fixture)

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 170


@pytest.mark.slow
def test_learner_on_two_hosts_trains_to_done_through_a_lost_agent(sshd, tiny_cfg, tiny_base, tmp_path):  # noqa: F811
    from conftest import TINY_TEST_OVERRIDES

    from async_vapo.config.schema import PortsConfig

    ports = dict(zip(PortsConfig.model_fields, free_ports(len(PortsConfig.model_fields), "0.0.0.0"), strict=True))
    total_steps = 3
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster.ports]\n" + "".join(f"{k} = {p}\n" for k, p in ports.items())
                      + "[cluster.wire]\nheartbeat_s = 0.5\n[cluster.deploy]\nhealth_timeout_s = 150\n"
                      + "stop_grace_s = 15\n[cluster.replay]\nfsync = \"never\"\n")
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                 f"train.total_steps={total_steps}", "train.eval_every=100", "train.checkpoint_every=1",
                 "async.learner_devices=2", "cluster.weights.transfer=zmq"]
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{REMOTE} learner\nlocalhost learner\nlocalhost replay\nlocalhost verifier\n"
                        "localhost rollout\n")
    run_dir = tmp_path / "run"
    logs, pids = run_dir / "logs", run_dir / "pids"
    py = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else "python"
    env = {**{k: v for k, v in os.environ.items() if k != "ASYNC_VAPO_SSH"}, "PYTHON": py,
           "ASYNC_VAPO_SSH": sshd.ssh_cmd}
    t0 = time.monotonic()
    start = subprocess.Popen(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config),
                              "--run-dir", str(run_dir), "--hostfile", str(hostfile), "--wait", "--", *overrides],
                             cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             stdin=subprocess.DEVNULL)
    stderr = ""

    def diagnostics() -> str:
        parts = [f"--- start_cluster.sh --wait exit {start.returncode}, stderr:\n{stderr[-4000:]}"]
        parts += [f"--- {log.name}:\n{_tail(log)}" for log in sorted(logs.glob("*.log"))]
        return "\n".join(parts)

    try:
        # the first update's checkpoint (both ranks' shards, rank 0's learner_state.pt): then lose the second agent
        deadline = t0 + TIMEOUT_S
        while not (run_dir / "checkpoints" / "step_1" / "learner_state.pt").exists():
            assert start.poll() is None and time.monotonic() < deadline, "no first checkpoint\n" + diagnostics()
            time.sleep(0.3)
        agent = int((pids / "learner-1.pid").read_text())
        ranks = psutil.Process(agent).children()
        assert len(ranks) == 1 and "services/learner.py" in " ".join(ranks[0].cmdline()), ranks
        os.kill(agent, signal.SIGKILL)
        psutil.wait_procs(ranks, timeout=10)
        assert not ranks[0].is_running(), "the killed agent's rank runs on"  # PR_SET_PDEATHSIG
        try:
            _, stderr = start.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            start.kill()
            _, stderr = start.communicate()
            pytest.fail(f"start_cluster.sh --wait did not finish within {TIMEOUT_S} s\n{diagnostics()}")
        assert start.returncode == 0, diagnostics()

        # the two agents: rank 0's on 127.0.0.2 (over ssh), rank 1's here; both in one group of two
        assert (pids / "learner.host").read_text().strip() == REMOTE and not (pids / "learner-1.host").exists()
        assert "learner-1 runs in the learner's group" in stderr
        learner, learner_1 = (logs / "learner.log").read_text(), (logs / "learner-1.log").read_text()
        assert "learner: rank 0 of 2" in learner and "learner: rank 1 of 2" in learner_1, diagnostics()
        # c10d gave this machine's agent (127.0.0.1 sorts before 127.0.0.2) rendezvous rank 0: the ranks were
        # renumbered by node rank, or rank 0 would not be on the first learner host
        assert "rank 0 of 2 (local rank 0 of the agent of rendezvous rank 1)" in learner
        assert "rank 1 of 2 (local rank 0 of the agent of rendezvous rank 0)" in learner_1

        # the lost agent was restarted by its supervisord, and the group went on from a checkpoint of this run
        assert len((run_dir / "supervisor" / "learner-1.starts").read_text().split()) >= 2
        resumed = re.findall(r"learner: resumed from (\S+) at version (\d+)", learner)
        assert resumed and all(Path(p).parent == run_dir / "checkpoints" for p, _ in resumed), resumed
        assert learner_1.count("learner: rank 1 of 2") >= 2

        # rank 0 alone wrote the run's records: every update (those after the checkpoint resumed from made again),
        # the summary of a learner of two ranks, DONE
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in rows if r["kind"] == "train"]
        assert set(steps) == set(range(1, total_steps + 1)) and steps[-1] == total_steps, steps
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["learner_ranks"] == 2 and summary["steps"] == total_steps
        assert (run_dir / "DONE").read_text().strip() == str(total_steps)
        assert json.loads((run_dir / "config.resolved.json").read_text())["cluster"]["hosts"]["learner_host"] == REMOTE
        print(f"learner on two hosts: {total_steps} updates through a lost agent (resumed from "
              f"{[Path(p).name for p, _ in resumed]}), stopped after {time.monotonic() - t0:.0f} s")
    finally:  # never leave a cluster behind, whatever --wait did
        if start.poll() is None:
            start.kill()
            start.communicate()
        if start.returncode != 0:
            subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], env=env,
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
        for f in pids.glob("*.pid"):
            pgid = int(f.read_text())
            if group_alive(pgid):
                os.killpg(pgid, signal.SIGKILL)
