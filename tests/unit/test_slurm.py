"""deploy/slurm/async_vapo.sbatch inside a Slurm-like environment: the job's variables set, and `scontrol` / `srun`
stand-ins on PATH that record their calls. It runs the real start_cluster.sh with --dry-run. Not covered here: a real
slurmctld, real srun steps, ssh between real nodes (see README, "Slurm")."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
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
