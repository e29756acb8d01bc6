"""`async-vapo plan` tells the truth about fitting: one exit status (1) for "does not fit" whatever does not fit, a
learner host's memory compared with a stated or given size, and, when nothing fits, advice that names a change
that would make something fit (never one the config already has), or why there was nothing to try."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAPER = str(REPO / "configs" / "qwen2.5-32b_vapo.toml")  # learner.cpu_offload = true


def plan(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "async_vapo.cli", "plan", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_placement_that_does_not_fit_its_hosts_exits_1_like_memory():
    """It exited 2 (a usage error) while a memory that does not fit exits 1."""
    r = plan(PAPER, "--hosts", "1", "--gpus-per-host", "8")  # 16 learner ranks on one host of 8 GPUs
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.startswith("DOES NOT FIT: async.learner_devices = 16 does not fit one host") and not r.stderr
    r = plan(PAPER, "--hosts", "4", "--gpus-per-host", "8", "learner.cpu_offload=false")  # 90 GiB per rank
    assert r.returncode == 1 and "DOES NOT FIT: a learner rank needs" in r.stdout


def test_host_memory_is_compared_with_the_hosts():
    """8 ranks per learner host x 53.4 GiB of offloaded state = 427.2 GiB: "(fits)" on a DGX's 2 TiB (the stated
    default), not on hosts of 256 GiB. It was "(fits)" whatever the host (never compared)."""
    r = plan(PAPER, "--hosts", "4", "--gpus-per-host", "8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hosts of 2,048 GiB (a DGX's 2 TiB, the default" in r.stdout
    assert "427.2 GiB  (fits)" in r.stdout
    r = plan(PAPER, "--hosts", "4", "--gpus-per-host", "8", "--host-memory-gib", "256")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "427.2 GiB  (DOES NOT FIT 256 GiB)" in r.stdout
    assert "DOES NOT FIT: a learner host needs 427.2 GiB of host memory, more than its 256 GiB" in r.stdout


def test_search_with_nothing_to_try_says_why():
    r = plan(PAPER, "--hosts", "1", "--gpus-per-host", "1", "--search")
    assert r.returncode == 1
    assert "0 of 0" not in r.stdout and "NOTHING TO TRY: 1 host(s) x 1 GPU(s) cannot hold a learner rank and an " \
                                       "engine" in r.stdout


def test_search_advice_names_only_changes_that_make_a_placement_fit(tmp_path):
    """The config sets learner.cpu_offload = true: the advice used to name it all the same."""
    r = plan(PAPER, "--hosts", "1", "--gpus-per-host", "8", "--search", "--host-memory-gib", "256")
    assert r.returncode == 1
    advice = r.stdout.split("NOTHING FITS", 1)[1]
    assert "cpu_offload" not in advice
    assert "hosts of at least 855 GiB of memory (--host-memory-gib)" in advice
    assert plan(PAPER, "--hosts", "1", "--gpus-per-host", "8", "--search", "--host-memory-gib", "855").returncode == 0
    # without offloading, offloading is what makes it fit; the advice holds
    r = plan(PAPER, "--hosts", "1", "--gpus-per-host", "8", "--search", "learner.cpu_offload=false")
    assert r.returncode == 1 and "  learner.cpu_offload=true: 18 placement(s) fit" in r.stdout
    assert plan(PAPER, "--hosts", "1", "--gpus-per-host", "8", "--search", "learner.cpu_offload=true").returncode == 0


def test_this_machines_memory_when_the_hostfile_names_it_alone(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost learner\nlocalhost replay\nlocalhost verifier\nlocalhost rollout\n")
    r = plan(PAPER, "--hostfile", str(hosts), "--gpus-per-host", "8", "async.learner_devices=4",
             "async.rollout_devices=4", "rollout.tensor_parallel_size=4")
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert f"hosts of {gib:,g} GiB (this machine's)" in r.stdout, r.stdout + r.stderr
