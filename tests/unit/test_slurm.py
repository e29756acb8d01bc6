"""deploy/slurm/async_vapo.sbatch inside a Slurm-like environment: the job's variables set, and `scontrol` / `srun`
stand-ins on PATH that record their calls. It runs the real start_cluster.sh with --dry-run; srun_remote.sh (the remote
calls as job steps) against an `srun` that runs the step here; the time-limit trap against stand-in start/stop
scripts. Not covered here: a real slurmctld, real srun steps on other nodes (see docs/guides/gpu-cluster.md)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "deploy/slurm/async_vapo.sbatch"


def stand_ins(tmp_path: Path, hosts: list[str], gpus: list[int], python_ok: bool = True) -> Path:
    """`scontrol show hostnames` prints ``hosts``; `srun` prints one preflight line per node; both log argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "scontrol").write_text(
        f"#!/bin/sh\necho \"scontrol $*\" >> {shlex.quote(str(log))}\n"
        f"[ \"$1 $2\" = 'show hostnames' ] || exit 1\nprintf '%s\\n' {' '.join(hosts)}\n")
    py = "python-ok" if python_ok else "python-missing"
    lines = "".join(f"{h} {g} {py}\\n" for h, g in zip(hosts, gpus, strict=True))
    (bin_dir / "srun").write_text(
        f"#!/bin/sh\necho \"srun $*\" >> {shlex.quote(str(log))}\nprintf '{lines}'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


def run_sbatch(tmp_path, bin_dir, *args, **env_extra):
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "PYTHON": sys.executable, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-04]",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_SUBMIT_DIR": str(REPO), "SLURM_GPUS_ON_NODE": "8",
           "ASYNC_VAPO_HOSTFILE": str(tmp_path / "hosts"), **env_extra}
    env.pop("ASYNC_VAPO_REPO", None)
    return subprocess.run(["bash", str(SBATCH), "--config", str(REPO / "configs/tiny_cpu.toml"), "--run-dir",
                           str(tmp_path / "run"), *args], capture_output=True, text=True, env=env, timeout=60)


SHAPE = ["--", "async.rollout_devices=24", "async.learner_devices=8", "rollout.tensor_parallel_size=4"]
HOSTS = ["gpu01", "gpu02", "gpu03", "gpu04"]


def test_sbatch_builds_the_hostfile_and_plans_over_the_allocation(tmp_path):
    bin_dir = stand_ins(tmp_path, HOSTS, [8] * 4)
    r = run_sbatch(tmp_path, bin_dir, "--dry-run", *SHAPE)
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert calls[0] == "scontrol show hostnames gpu[01-04]"
    assert calls[1].startswith("srun --nodes=4 --ntasks=4 --ntasks-per-node=1 --overlap bash -c ")
    assert [c.split()[0] for c in calls if c.startswith(("srun ", "scontrol "))] == ["scontrol", "srun"]
    body = [ln for ln in (tmp_path / "hosts").read_text().splitlines() if not ln.startswith("#")]
    assert body == ["gpu01 learner", "gpu01 replay", "gpu01 verifier"] + [f"{h} rollout" for h in HOSTS]
    # the learner fills gpu01; six TP-4 engines over gpu02..gpu04
    assert "learner     gpu01  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in r.stdout
    engines = [ln.split("\t")[:2] for ln in r.stdout.splitlines() if ln.startswith("rollout-") and "\t" in ln]
    assert engines == [["rollout-0", "gpu02"], ["rollout-1", "gpu03"], ["rollout-2", "gpu04"],
                       ["rollout-3", "gpu02"], ["rollout-4", "gpu03"], ["rollout-5", "gpu04"]]
    assert not (tmp_path / "run").exists()


def test_sbatch_puts_engines_beside_a_small_learner(tmp_path):
    bin_dir = stand_ins(tmp_path, HOSTS[:2], [8, 8])
    r = run_sbatch(tmp_path, bin_dir, "--dry-run", "--", "async.rollout_devices=12", "async.learner_devices=4",
                   "rollout.tensor_parallel_size=4", SLURM_JOB_NODELIST="gpu[01-02]")
    assert r.returncode == 0, r.stderr
    assert "rollout-0   gpu01  CUDA_VISIBLE_DEVICES=4,5,6,7" in r.stdout
    assert "rollout-1   gpu02  CUDA_VISIBLE_DEVICES=0,1,2,3" in r.stdout


def test_sbatch_refuses_what_it_cannot_run(tmp_path):
    bin_dir = stand_ins(tmp_path, HOSTS, [8, 8, 4, 8])
    r = run_sbatch(tmp_path, bin_dir, "--dry-run", *SHAPE)
    assert r.returncode == 2 and "nodes differ in GPUs (gpu03: 4, another: 8)" in r.stderr

    (tmp_path / "b").mkdir()
    r = run_sbatch(tmp_path / "b", stand_ins(tmp_path / "b", HOSTS, [8] * 4), "--dry-run", *SHAPE,
                   SLURM_GPUS_ON_NODE="4")
    assert r.returncode == 2 and "Slurm gives 4 GPU(s) per node but nvidia-smi counts 8" in r.stderr

    (tmp_path / "c").mkdir()
    r = run_sbatch(tmp_path / "c", stand_ins(tmp_path / "c", HOSTS, [8] * 4, python_ok=False), "--dry-run", *SHAPE)
    assert r.returncode == 2 and "gpu01: " in r.stderr and "not found" in r.stderr

    (tmp_path / "d").mkdir()
    r = run_sbatch(tmp_path / "d", stand_ins(tmp_path / "d", HOSTS, [8] * 4), "--dry-run", "--",
                   "async.rollout_devices=32", "async.learner_devices=8")
    assert r.returncode == 2 and "32 engine(s) of 1 GPU(s)" in r.stderr  # 8 + 32 > 4 x 8

    r = run_sbatch(tmp_path, bin_dir, "--dry-run", *SHAPE, SLURM_JOB_ID="")
    assert r.returncode == 2 and "not inside a Slurm job" in r.stderr


def test_sbatch_places_the_learner_over_several_nodes_when_asked(tmp_path):
    bin_dir = stand_ins(tmp_path, HOSTS, [8] * 4)
    r = run_sbatch(tmp_path, bin_dir, "--dry-run", "--", "async.rollout_devices=16", "async.learner_devices=16",
                   "rollout.tensor_parallel_size=8", ASYNC_VAPO_LEARNER_NODES="2")
    assert r.returncode == 0, r.stderr
    body = [ln for ln in (tmp_path / "hosts").read_text().splitlines() if not ln.startswith("#")]
    assert body[:4] == ["gpu01 learner", "gpu02 learner", "gpu01 replay", "gpu01 verifier"]
    assert "learner-1   gpu02  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7  (node 1 of 2: ranks 8-15)" in r.stdout
    assert "rollout-0   gpu03  CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in r.stdout
    r = run_sbatch(tmp_path, bin_dir, "--dry-run", *SHAPE, ASYNC_VAPO_LEARNER_NODES="5")
    assert r.returncode == 2 and "ASYNC_VAPO_LEARNER_NODES must be 1..4" in r.stderr


def test_sbatch_traps_the_time_limit_and_stops_the_cluster_with_a_checkpoint(tmp_path):
    """SIGTERM (--signal=B:TERM@300, or scancel) to the batch script: it runs deploy/stop_cluster.sh on the run
    directory start_cluster.sh announced (whose SIGTERM makes the learner checkpoint) and exits 143. start_cluster.sh
    and stop_cluster.sh are stand-ins in a copy of the script's repository layout: a real cluster is not started."""
    assert "#SBATCH --signal=B:TERM@" in SBATCH.read_text()
    repo = tmp_path / "repo"
    (repo / "deploy/slurm").mkdir(parents=True)
    (repo / ".venv/bin").mkdir(parents=True)
    (repo / ".venv/bin/python").symlink_to(sys.executable)
    (repo / "deploy/start_cluster.sh").write_text(
        "#!/bin/bash\necho \"[start_cluster] run dir /runs/r1: 2 rollout engine(s), 8 learner rank(s)\" >&2\n"
        "echo started > \"$(dirname \"$0\")/started\"\nexec sleep 60\n")
    (repo / "deploy/stop_cluster.sh").write_text(
        f"#!/bin/bash\necho \"stop $*\" >> {shlex.quote(str(tmp_path / 'stop.log'))}\n")
    for f in ("start_cluster.sh", "stop_cluster.sh"):
        (repo / "deploy" / f).chmod(0o755)
    bin_dir = stand_ins(tmp_path, HOSTS, [8] * 4)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_JOB_NODELIST": "gpu[01-04]", "SLURM_GPUS_ON_NODE": "8", "ASYNC_VAPO_REPO": str(repo),
           "ASYNC_VAPO_HOSTFILE": str(tmp_path / "hosts")}
    env.pop("PYTHON", None)
    p = subprocess.Popen(["bash", str(SBATCH), "--config", "x.toml"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for _ in range(200):
            if (repo / "deploy/started").exists():
                break
            time.sleep(0.05)
        assert (repo / "deploy/started").exists()
        time.sleep(0.3)  # tee has written the announcement
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 143, err
    assert (tmp_path / "stop.log").read_text().splitlines() == ["stop /runs/r1"]
    assert "SIGTERM (time limit or scancel): stopping the cluster" in err


def srun_local(tmp_path: Path) -> dict:
    """A stand-in `srun` that runs the step's command here (SLURM_STEP_ID set) and logs its argv, and an
    `scontrol listpids` that lists the PIDs written to tmp_path/step.pids that still run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        f"#!/bin/bash\necho \"srun $*\" | head -n 1 >> {shlex.quote(str(tmp_path / 'calls.log'))}\n"
        "while [ \"$1\" != bash ]; do shift; done\nexport SLURM_STEP_ID=7\nexec \"$@\"\n")
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n[ \"$1\" = listpids ] || exit 1\necho 'PID JOBID STEPID LOCALID GLOBALID'\n"
        f"f={shlex.quote(str(tmp_path / 'step.pids'))}\n"
        "[ -f \"$f\" ] && while read -r p; do kill -0 \"$p\" 2>/dev/null && echo \"$p 1 7 0 0\"; done < \"$f\"\n"
        "exit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}


REMOTE = REPO / "deploy/slurm/srun_remote.sh"


def test_remote_calls_are_job_steps_with_the_commands_status_output_and_input(tmp_path):
    env = srun_local(tmp_path)
    r = subprocess.run([str(REMOTE), "gpu02", "bash -c 'cat; echo err >&2; exit 3'"], input="keys\n",
                       capture_output=True, text=True, env=env, timeout=30)
    assert (r.returncode, r.stdout, r.stderr) == (3, "keys\n", "err\n")
    assert (tmp_path / "calls.log").read_text().startswith(
        "srun --jobid=4242 --overlap --nodes=1 --ntasks=1 --nodelist=gpu02 --job-name=async-vapo@gpu02 --quiet bash -c")
    r = subprocess.run([str(REMOTE), "gpu02", "bash -c 'printf 1234'"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert (r.returncode, r.stdout.strip()) == (0, "1234")
    r = subprocess.run([str(REMOTE), "gpu02", "true"], capture_output=True, text=True,
                       env={**env, "SLURM_JOB_ID": ""}, timeout=30)
    assert r.returncode == 2 and "not inside a Slurm job" in r.stderr


def test_a_step_that_leaves_processes_holds_until_they_are_gone(tmp_path):
    """supervisord daemonizes: the call returns at once, the step stays while the daemon runs (Slurm would kill
    what is left of an ended step), then ends by itself."""
    env = srun_local(tmp_path)
    pids = tmp_path / "step.pids"
    t0 = time.monotonic()
    r = subprocess.run([str(REMOTE), "gpu02", f"bash -c 'setsid sleep 4 > /dev/null 2>&1 < /dev/null & "
                                              f"echo $! > {pids}; echo started'"],
                       capture_output=True, text=True, env=env, timeout=30)
    assert (r.returncode, r.stdout) == (0, "started\n") and time.monotonic() - t0 < 3.5
    holding = ["pgrep", "-f", "left=0"]
    assert subprocess.run(holding, capture_output=True).returncode == 0  # the step holds
    for _ in range(200):
        if subprocess.run(holding, capture_output=True).returncode != 0:
            break
        time.sleep(0.1)
    assert subprocess.run(holding, capture_output=True).returncode != 0  # and ends after the daemon
