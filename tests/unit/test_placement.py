"""GPU placement by async.rollout_devices : async.learner_devices, tensor parallelism and the hostfile."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from async_vapo.deploy.placement import PlacementError, parse_hostfile, place, shell_assignments

REPO = Path(__file__).resolve().parents[2]


def hosts(learner: str, rollout: list[str]) -> list[tuple[str, str]]:
    return [(learner, "learner"), (learner, "replay"), (learner, "verifier")] + [(h, "rollout") for h in rollout]


def gpus_by_host(p) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for proc in p.processes:
        out.setdefault(proc.host, []).extend(proc.gpus)
    return out


def test_four_hosts_of_eight_at_three_to_one_tp4():
    p = place(24, 8, tensor_parallel_size=4, gpus_per_host=8,
              hostfile=hosts("n1", ["n2", "n3", "n4"]))
    assert p.get("learner").host == "n1" and p.get("learner").gpus == tuple(range(8))
    got = [(e.name, e.host, e.cuda_visible_devices) for e in p.engines]
    assert got == [("rollout-0", "n2", "0,1,2,3"), ("rollout-1", "n3", "0,1,2,3"), ("rollout-2", "n4", "0,1,2,3"),
                   ("rollout-3", "n2", "4,5,6,7"), ("rollout-4", "n3", "4,5,6,7"), ("rollout-5", "n4", "4,5,6,7")]
    assert p.get("replay").gpus == () and p.get("verifier").gpus == ()
    assert p.idle == {}


def test_learner_shares_its_host_with_engines():
    # 1 host x 8 GPUs, 6:2 at TP 2: learner on 0,1, three engines on the rest
    p = place(6, 2, tensor_parallel_size=2, gpus_per_host=8, hostfile=hosts("a", ["a"]))
    assert p.get("learner").gpus == (0, 1)
    assert [e.gpus for e in p.engines] == [(2, 3), (4, 5), (6, 7)]
    # no hostfile: everything on this machine, the same split
    q = place(6, 2, tensor_parallel_size=2, gpus_per_host=8)
    assert [(x.host, x.gpus) for x in q.processes] == [("localhost", x.gpus) for x in p.processes]


def test_several_engines_per_host_and_idle_gpus_are_reported():
    # 2 hosts x 8 at 3:1 with only 12 devices asked: 6 TP-1 engines + 2 learner ranks on n1, the rest idle
    p = place(6, 2, gpus_per_host=8, hostfile=hosts("n1", ["n1", "n2"]))
    assert [(e.host, e.gpus) for e in p.engines] == [("n1", (2,)), ("n2", (0,)), ("n1", (3,)), ("n2", (1,)),
                                                     ("n1", (4,)), ("n2", (2,))]
    assert p.idle == {"n1": (5, 6, 7), "n2": (3, 4, 5, 6, 7)}
    assert "(idle)" in p.describe() and "GPUs 3,4,5,6,7 unused" in p.describe()


def test_tp8_engines_take_whole_hosts():
    p = place(16, 8, tensor_parallel_size=8, gpus_per_host=8, hostfile=hosts("n0", ["n1", "n2"]))
    assert [(e.host, e.cuda_visible_devices) for e in p.engines] == [("n1", "0,1,2,3,4,5,6,7"),
                                                                     ("n2", "0,1,2,3,4,5,6,7")]


def test_no_gpu_is_given_twice_over_many_shapes():
    for n_hosts, gph, tp, learner in itertools.product((1, 2, 4), (1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)):
        for rollout in range(tp, n_hosts * gph + 1, tp):
            hf = hosts("h0", [f"h{i}" for i in range(n_hosts)])
            try:
                p = place(rollout, learner, tensor_parallel_size=tp, gpus_per_host=gph, hostfile=hf)
            except PlacementError:
                assert tp > gph or learner > gph or rollout + learner > n_hosts * gph or gph % tp, \
                    (n_hosts, gph, tp, learner, rollout)
                continue
            for h, g in gpus_by_host(p).items():
                assert len(g) == len(set(g)) and all(0 <= i < gph for i in g), (h, g)
                assert sorted(g + list(p.idle.get(h, ()))) == list(range(gph)) or h not in p.idle
            assert len(p.engines) == rollout // tp and all(len(e.gpus) == tp for e in p.engines)
            assert all(e.gpus == tuple(range(e.gpus[0], e.gpus[0] + tp)) for e in p.engines)  # adjacent


def test_without_gpus_engines_go_round_robin_over_rollout_lines():
    hf = parse_hostfile("# comment\nl learner\n\nr1 rollout\nr2 rollout\nr1 rollout\n")
    p = place(4, 1, hostfile=hf)
    assert [e.host for e in p.engines] == ["r1", "r2", "r1", "r1"]
    assert all(x.gpus == () for x in p.processes) and p.get("learner").host == "l"
    assert p.get("replay").host == "localhost"


@pytest.mark.parametrize("args, match", [
    (dict(rollout_devices=6, learner_devices=2, tensor_parallel_size=4, gpus_per_host=8),
     r"rollout_devices = 6 is not a multiple of rollout.tensor_parallel_size = 4"),
    (dict(rollout_devices=16, learner_devices=2, tensor_parallel_size=16, gpus_per_host=8),
     r"tensor_parallel_size = 16 does not fit a host of 8 GPUs: a tensor-parallel engine runs within one host"),
    (dict(rollout_devices=8, learner_devices=16, gpus_per_host=8),
     r"learner_devices = 16 does not fit one host \(8 GPUs on n1\).*at most 8"),
    (dict(rollout_devices=28, learner_devices=4, tensor_parallel_size=4, gpus_per_host=8),
     r"7 engine\(s\) of 4 GPU\(s\).*n2: 2, n3: 2, n4: 2 \(6 in all.*4 GPU\(s\) left on n1 take engines only with a "
     r"rollout line"),
])
def test_refusals_say_why(args, match):
    hf = hosts("n1", ["n2", "n3", "n4"])
    with pytest.raises(PlacementError, match=match):
        place(hostfile=hf, **args)


def test_bad_hostfile_line_names_file_and_line():
    with pytest.raises(PlacementError, match=r"hosts:2: expected 'host role'.*'n2 gpu'"):
        parse_hostfile("n1 learner\nn2 gpu\n", "hosts")


def test_shell_assignments():
    p = place(4, 2, tensor_parallel_size=2, gpus_per_host=4, hostfile=hosts("a", ["a", "b"]))
    lines = shell_assignments(p)
    assert "HOST_ROLLOUT_0=a" in lines and "GPUS_ROLLOUT_0=2,3" in lines
    assert "HOST_ROLLOUT_1=b" in lines and "GPUS_ROLLOUT_1=0,1" in lines
    assert "GPUS_LEARNER=0,1" in lines and "GPUS_REPLAY=''" in lines


def dry_run(tmp_path, *args, overrides=()):
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    cmd = ["bash", str(REPO / "deploy/start_cluster.sh"), "--config", str(REPO / "configs/tiny_cpu.toml"),
           "--run-dir", str(tmp_path / "run"), "--dry-run", *args, "--", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def test_start_cluster_dry_run_prints_the_plan_and_starts_nothing(tmp_path):
    hf = tmp_path / "hosts"
    hf.write_text("n1 learner\nn1 replay\nn1 verifier\nn2 rollout\nn3 rollout\nn4 rollout\n")
    r = dry_run(tmp_path, "--hostfile", str(hf), "--gpus-per-host", "8",
                overrides=["async.rollout_devices=24", "async.learner_devices=8", "rollout.tensor_parallel_size=4"])
    assert r.returncode == 0, r.stderr
    assert "6 engine(s), 8 learner rank(s), 8 GPU(s) per host" in r.stdout
    cmds = {ln.split("\t")[0]: ln.split("\t") for ln in r.stdout.splitlines() if "\t" in ln}
    assert cmds["rollout-4"][1] == "n3" and cmds["rollout-4"][2].startswith("CUDA_VISIBLE_DEVICES=4,5,6,7 ")
    assert "'--instance' '4'" in cmds["rollout-4"][2]
    assert """cluster.hosts.rollout_hosts=["n2","n3","n4","n2","n3","n4"]""" in cmds["rollout-4"][2]
    assert cmds["learner"][2].startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 ")
    assert "'--nproc-per-node' '8'" in cmds["learner"][2]
    assert not (tmp_path / "run").exists()


def test_start_cluster_refuses_a_shape_that_does_not_fit(tmp_path):
    r = dry_run(tmp_path, "--gpus-per-host", "4",
                overrides=["async.rollout_devices=4", "async.learner_devices=2", "rollout.tensor_parallel_size=2"])
    assert r.returncode == 2
    assert "2 engine(s) of 2 GPU(s)" in r.stderr and "localhost: 1" in r.stderr
    assert not (tmp_path / "run").exists()


def test_config_refuses_devices_that_do_not_divide_into_engines():
    from async_vapo.config import ConfigError, load_config

    cfg = load_config([], ["async.rollout_devices=8", "rollout.tensor_parallel_size=4"])
    assert cfg.rollout_engines() == 2
    with pytest.raises(ConfigError, match=r"async.rollout_devices \(6\) is not a multiple of "
                                          r"rollout.tensor_parallel_size \(4\)"):
        load_config([], ["async.rollout_devices=6", "rollout.tensor_parallel_size=4"])


def test_start_cluster_takes_overrides_anywhere_and_says_what_a_dry_run_would_do(tmp_path):
    """Overrides before an option, without "--", as async-vapo takes them (they were refused: "unknown argument");
    the dry run says what a start would do ("starting a new run" was printed by a run that started nothing)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    cmd = ["bash", str(REPO / "deploy/start_cluster.sh"), "async.rollout_devices=2", "--config",
           str(REPO / "configs/tiny_cpu.toml"), "async.learner_devices=1", "--run-dir", str(tmp_path / "run"),
           "--dry-run", "--gpus-per-host", "0", "--", "algo.eps_high=0.3"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "it would start 2 engine(s), 1 learner rank(s)" in r.stdout and "'algo.eps_high=0.3'" in r.stdout
    assert f"would start a new run in {tmp_path / 'run'}" in r.stderr and "starting" not in r.stderr
    assert not (tmp_path / "run").exists()
    bad = subprocess.run([*cmd[:2], "--config", str(REPO / "configs/tiny_cpu.toml"), "eps_high"], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "an override is key.sub=value" in bad.stderr


def test_start_cluster_help_says_what_every_option_does():
    """Every option the script parses has a line of its own in --help (the help named --wait, --dry-run,
    --prometheus and --hostfile in a usage line without saying what they do)."""
    script = (REPO / "deploy/start_cluster.sh").read_text()
    parsed = {o for case in re.findall(r"^    (-[-\w|]+)\)", script, re.M) for o in case.split("|")}
    assert {"--wait", "--dry-run", "--prometheus", "--hostfile", "--no-check", "--config"} <= parsed
    r = subprocess.run(["bash", str(REPO / "deploy/start_cluster.sh"), "--help"], capture_output=True, text=True,
                       timeout=30)
    described = {m.group(1) for m in re.finditer(r"^  (--?[\w-]+)(?:, (--[\w-]+))?\s+[A-Z|a-z ]*?\s{2,}\S", r.stdout,
                                                  re.M)}
    described |= {m.group(2) for m in re.finditer(r"^  (-h), (--help)\s", r.stdout, re.M)}
    assert parsed - {"--"} <= described, parsed - described


def test_make_cluster_starts_prometheus_when_asked():
    def make(*args):
        return subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO), "cluster", *args],
                              capture_output=True, text=True, timeout=60).stdout.splitlines()[-1]

    assert "--prometheus" in make("PROMETHEUS=1") and "--prometheus" not in make()
    assert make("ARGS=--new-run algo.eps_high=0.3").endswith("--new-run algo.eps_high=0.3")


def test_start_cluster_runs_the_check_first_and_starts_nothing_on_a_problem(tmp_path):
    problems = tmp_path / "p.jsonl"
    problems.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n{"prompt": "x"}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "deploy/start_cluster.sh"), "--config", str(REPO / "configs/tiny_cpu.toml"),
                        "--run-dir", str(tmp_path / "run"), "task.kind=files", f"task.train_path={problems}",
                        f"task.eval_path={problems}"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"{problems}:3: missing field 'answer'" in r.stderr and "nothing was started" in r.stderr
    assert not (tmp_path / "run").exists()


def test_the_evaluator_gets_gpus_no_service_uses_or_the_plan_is_refused():
    """cluster.evaluator.mode = "watch": its engine's GPUs from the ones left idle, learner host first; on a CPU
    host the first learner host; none left: refused with what to change."""
    p = place(4, 2, gpus_per_host=8, hostfile=hosts("n1", ["n1"]), evaluator=True)
    assert p.get("evaluator").host == "n1" and p.get("evaluator").gpus == (6,) and p.idle == {"n1": (7,)}
    assert "evaluator" not in {e.name for e in p.engines} and [a.name for a in p.learners] == ["learner"]
    p = place(4, 8, tensor_parallel_size=2, gpus_per_host=8, hostfile=hosts("n1", ["n2"]), evaluator=True)
    assert (p.get("evaluator").host, p.get("evaluator").gpus) == ("n2", (4, 5))  # the learner's host is full
    assert "GPUS_EVALUATOR=4,5" in shell_assignments(p) and "HOST_EVALUATOR=n2" in shell_assignments(p)
    assert "evaluator" in p.describe() and "CUDA_VISIBLE_DEVICES=4,5" in p.describe()
    counts = [len(proc.gpus) for proc in p.processes]
    assert sum(counts) == 8 + 4 + 2 and len({(q.host, g) for q in p.processes for g in q.gpus}) == sum(counts)
    with pytest.raises(PlacementError, match=r"evaluator.mode = 'watch' needs 2 GPU\(s\).*n1: 0 free, n2: 0 free.*"
                                             r"'after'"):
        place(8, 8, tensor_parallel_size=2, gpus_per_host=8, hostfile=hosts("n1", ["n2"]), evaluator=True)
    cpu = place(1, 1, hostfile=hosts("n1", ["n2"]), evaluator=True)
    assert (cpu.get("evaluator").host, cpu.get("evaluator").gpus) == ("n1", ())
    assert "evaluator" not in {q.name for q in place(1, 1, gpus_per_host=8).processes}


def test_start_cluster_starts_the_evaluator_as_asked_and_refuses_after_without_wait(tmp_path):
    r = dry_run(tmp_path, "--gpus-per-host", "4", overrides=["async.rollout_devices=2", "async.learner_devices=1",
                                                             "cluster.evaluator.mode=watch"])
    assert r.returncode == 0, r.stderr
    cmds = {ln.split("\t")[0]: ln.split("\t") for ln in r.stdout.splitlines() if "\t" in ln}
    assert cmds["evaluator"][2] == (f"CUDA_VISIBLE_DEVICES=3  '{sys.executable}' '-m' 'async_vapo.cli' 'eval' "
                                    f"'{tmp_path / 'run'}' '--watch'")
    assert "evaluator" not in dry_run(tmp_path, "--gpus-per-host", "4").stdout
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHON": sys.executable}
    after = subprocess.run(["bash", str(REPO / "deploy/start_cluster.sh"), "--config",
                            str(REPO / "configs/tiny_cpu.toml"), "--run-dir", str(tmp_path / "run2"), "--no-check",
                            "--", "cluster.evaluator.mode=after"], capture_output=True, text=True, env=env, timeout=60)
    assert after.returncode == 2 and "needs --wait" in after.stderr, after.stderr
    assert not (tmp_path / "run2" / "pids").exists()


@pytest.mark.parametrize("over", [["async.learner_devices=2"], ["learner.fsdp=on"]])
def test_config_refuses_an_evaluator_of_checkpoints_without_hf_weights(over):
    from async_vapo.config import ConfigError, load_config

    assert load_config([], over).cluster.evaluator.mode == "off"
    with pytest.raises(ConfigError, match=r"cluster.evaluator.mode = 'watch' evaluates the checkpoints' HF weights"):
        load_config([], [*over, "cluster.evaluator.mode=watch"])
    # a LoRA policy's checkpoints hold its adapter, which the evaluator merges into the base model
    assert load_config([], ["model.lora.rank=8", "cluster.evaluator.mode=watch"]).cluster.evaluator.mode == "watch"
