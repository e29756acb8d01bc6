"""The run-directory rule (async_vapo.learner.rundir): a second start resumes the same run or takes a new
directory, never mixing two runs in one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from async_vapo.config import load_config, save_resolved
from async_vapo.learner.rundir import CPU_FEATURES, RunDirError, claim, config_differences, latest_checkpoint, plan_run


def _cfg(tmp_path, *overrides):
    return load_config([], [f"train.output_dir={tmp_path}/runs/{{name}}", "train.total_steps=100", *overrides])


def _fake_run(cfg, app="train", steps=(), rows=1, run_dir=None):
    """A run directory as a run leaves it: resolved config, run.json, metrics rows, complete checkpoints."""
    d = run_dir or cfg.run_dir()
    save_resolved(cfg, d)
    (d / "run.json").write_text(json.dumps({"app": app, "starts": []}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"kind": "train", "step": i}) + "\n" for i in range(rows)))
    for s in steps:
        (d / "checkpoints" / f"step_{s}").mkdir(parents=True)
        (d / "checkpoints" / f"step_{s}" / "learner_state.pt").write_bytes(b"x")
    return d


def test_an_empty_place_starts_there(tmp_path):
    cfg = _cfg(tmp_path)
    plan = plan_run(cfg, "train")
    assert plan.run_dir == cfg.run_dir() and plan.resume is None
    cfg.run_dir().mkdir(parents=True)  # a directory with only logs of a start that failed holds no run
    (cfg.run_dir() / "logs").mkdir()
    assert plan_run(cfg, "train").run_dir == cfg.run_dir()


def test_an_interrupted_run_with_the_same_config_resumes_from_its_newest_checkpoint(tmp_path):
    cfg = _cfg(tmp_path)
    d = _fake_run(cfg, steps=(10, 50))
    (d / "checkpoints" / "step_60.tmp").mkdir()  # a checkpoint being written is not one
    (d / "checkpoints" / "step_70").mkdir()  # nor one without its learner state
    plan = plan_run(cfg, "train")
    assert plan.run_dir == d and plan.resume == d / "checkpoints" / "step_50" == latest_checkpoint(d)
    assert "resuming" in plan.message and "50 of 100" in plan.message
    # what only says where and how long to run may change: a longer run continues a finished one
    longer = _cfg(tmp_path, "train.total_steps=200", "train.eval_every=5", "train.max_minutes=3",
                  "cluster.ports.replay_port=6001")
    assert plan_run(longer, "train").resume == d / "checkpoints" / "step_50"


@pytest.mark.parametrize("case", ["finished", "other_config", "no_checkpoint", "other_app"])
def test_a_run_that_cannot_continue_is_kept_and_the_new_run_goes_next_to_it(tmp_path, case):
    cfg = _cfg(tmp_path)
    d = _fake_run(cfg, app="cluster" if case == "other_app" else "train",
                  steps={"finished": (50, 100), "no_checkpoint": ()}.get(case, (50,)))
    if case == "other_config":
        cfg = _cfg(tmp_path, "algo.eps_high=0.3")
    before = {p: p.read_bytes() for p in d.rglob("*") if p.is_file()}
    plan = plan_run(cfg, "train")
    assert plan.run_dir == d.with_name(d.name + "-2") and plan.resume is None
    why = {"finished": "finished (100 of train.total_steps = 100", "other_config": "algo.eps_high: 0.28 -> 0.3",
           "no_checkpoint": "before its first checkpoint", "other_app": "start_cluster"}[case]
    assert why in plan.message and str(plan.run_dir) in plan.message
    new_cfg = claim(plan, cfg, "train")
    assert new_cfg.run_dir() == plan.run_dir and cfg.run_dir() == d  # the caller's config is not changed
    assert {p: p.read_bytes() for p in d.rglob("*") if p.is_file()} == before  # the old run is untouched
    meta = json.loads((plan.run_dir / "run.json").read_text())
    assert meta["app"] == "train"
    host = meta["starts"][-1]["host"]  # what the machine was: timings of two runs compare only on the same one
    assert host["cpus"] >= 1 and set(host["cpu_features"]) <= set(CPU_FEATURES)  # Linux: read from /proc
    assert host["booted_utc"] < meta["starts"][-1]["utc"] and host["mem_gib"] > 0


def test_the_rule_follows_the_newest_of_the_numbered_directories(tmp_path):
    cfg = _cfg(tmp_path)
    _fake_run(cfg, steps=(100,))
    second = _fake_run(cfg, steps=(50,), run_dir=cfg.run_dir().with_name("tiny_cpu-2"))
    assert plan_run(cfg, "train").resume == second / "checkpoints" / "step_50"  # the interrupted second run
    _fake_run(cfg, steps=(100,), run_dir=second)
    assert plan_run(cfg, "train").run_dir == cfg.run_dir().with_name("tiny_cpu-3")


def test_new_and_resume_modes(tmp_path):
    cfg = _cfg(tmp_path)
    with pytest.raises(RunDirError, match="holds no run"):
        plan_run(cfg, "train", "resume")
    assert plan_run(cfg, "train", "new").run_dir == cfg.run_dir()
    d = _fake_run(cfg, steps=(50,))
    assert plan_run(cfg, "train", "new").run_dir == d.with_name(d.name + "-2")
    assert plan_run(cfg, "train", "resume").resume == d / "checkpoints" / "step_50"
    with pytest.raises(RunDirError, match="another config"):
        plan_run(_cfg(tmp_path, "optim.actor_lr=1e-3"), "train", "resume")


def test_config_differences_name_each_key():
    a = {"algo": {"eps_high": 0.28, "alpha": 1.0}, "train": {"total_steps": 10}, "cluster": {"ports": {"p": 1}}}
    b = {"algo": {"eps_high": 0.3, "alpha": 1.0}, "train": {"total_steps": 99}, "cluster": {"ports": {"p": 2}}}
    assert config_differences(a, b) == ["algo.eps_high: 0.28 -> 0.3"]


def test_train_cli_says_which_and_refuses_a_resume_it_cannot_do(tmp_path):
    """``async-vapo train --resume auto`` where nothing can be resumed: a clear error before any model is built."""
    run = subprocess.run([sys.executable, "-m", "async_vapo.cli", "train", "--resume", "auto",
                          f"train.output_dir={tmp_path}/{{name}}"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "nothing to resume" in run.stderr
    assert not (tmp_path / "tiny_cpu").exists()


def test_a_run_is_named_after_its_config_file_unless_it_sets_a_name(tmp_path):
    """configs/foo.toml -> runs/foo: a config without train.name used to write to runs/tiny_cpu (the default's name),
    next to, or on top of, the quick start's runs. A name a file on the command line or an override sets is kept; a
    parent's name
    (``extends``) is not inherited; without a file the embedded defaults' name stays."""
    parent = tmp_path / "parent.toml"
    parent.write_text('[train]\nname = "the_parent"\n')
    (tmp_path / "my_exp.toml").write_text("[algo]\neps_high = 0.3\n")
    (tmp_path / "child.toml").write_text('extends = "parent.toml"\n[algo]\neps_high = 0.3\n')
    (tmp_path / "named.toml").write_text('[train]\nname = "kept"\n')
    name = {f: load_config([tmp_path / f]).train.name for f in ("my_exp.toml", "child.toml", "named.toml",
                                                                 "parent.toml")}
    assert name == {"my_exp.toml": "my_exp", "child.toml": "child", "named.toml": "kept",
                    "parent.toml": "the_parent"}
    assert load_config([tmp_path / "my_exp.toml"]).run_dir().as_posix() == "runs/my_exp"
    assert load_config([tmp_path / "named.toml", tmp_path / "my_exp.toml"]).train.name == "kept"  # layered files
    assert load_config([tmp_path / "my_exp.toml"], ["train.name=given"]).train.name == "given"
    assert load_config([]).train.name == "tiny_cpu"
