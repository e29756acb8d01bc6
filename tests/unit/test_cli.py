"""`async-vapo` in-process: every command given bad paths or files says what is wrong in one line on stderr and
exits non-zero, never with a traceback; export's --force; overrides anywhere on the line; --config everywhere;
--version; the whole parser for the docs (build_parser). No engine is started and nothing is trained."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from async_vapo.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]
TINY = str(REPO / "configs" / "tiny_cpu.toml")
PAPER = str(REPO / "configs" / "qwen2.5-32b_vapo.toml")
PAPER_SHAPE = ["async.rollout_devices=24", "async.learner_devices=8", "rollout.tensor_parallel_size=4"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def bad(tmp_path):
    """Bad inputs, by name: a directory, a missing file, a malformed TOML, a file that is no replay log or
    metrics file, an empty directory given as a checkpoint or a run, problems without the field a key names;
    "out" is where a command would write (a run directory, an export, a plot): it must not appear."""
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "malformed.toml").write_text("[algo\neps_high = 0.3\n")
    (tmp_path / "garbage.log").write_bytes(b"this is not a replay log\n")
    (tmp_path / "problems.jsonl").write_text('{"question": "1+1=", "answer": "2"}\n')
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "eval"}\nnot json\n{"kind": "eval"}\n')
    return {"dir": tmp_path / "a_dir", "missing": tmp_path / "missing.toml", "toml": tmp_path / "malformed.toml",
            "log": tmp_path / "garbage.log", "problems": tmp_path / "problems.jsonl", "run": tmp_path / "run",
            "out": tmp_path / "out"}


CASES = {
    # command line (bad inputs by name from the fixture) -> a fragment of the one line on stderr
    "config dir": (["config", "--config", "{dir}"], "a directory, not a config file"),
    "config missing": (["config", "--config", "{missing}"], "config file not found"),
    "config malformed": (["config", "--config", "{toml}"], "not valid TOML"),
    "train dir": (["train", "--config", "{dir}"], "a directory, not a config file"),
    "train malformed": (["train", "--config", "{toml}"], "not valid TOML"),
    "train resume missing": (["train", "--resume", "{missing}"], "--resume"),
    "train problem file missing": (["train", "task.kind=files", "task.train_path={missing}.jsonl",
                                    "task.eval_path={missing}.jsonl", "train.output_dir={out}"],
                                   "missing.toml.jsonl: no such file or directory"),
    "train problem field missing": (["train", "task.kind=files", "task.train_path={problems}",
                                     "task.eval_path={problems}", "task.prompt_key=questoin",
                                     "train.output_dir={out}"], "missing field 'questoin' (task.prompt_key)"),
    "make-base missing": (["make-base", "--config", "{missing}"], "config file not found"),
    "eval missing model": (["eval", "{missing}"], "neither an HF model directory"),
    "eval malformed": (["eval", "--config", "{toml}"], "not valid TOML"),
    "plan dir": (["plan", "--config", "{dir}", "--hosts", "1", "--gpus-per-host", "8"], "a directory"),
    "plan positional missing": (["plan", "{missing}", "--hosts", "1", "--gpus-per-host", "8"], "not found"),
    "plan model-config missing": (["plan", "--config", TINY, "--hosts", "1", "--gpus-per-host", "8",
                                   "--model-config", "{missing}"], "No such file"),
    "plan model-config malformed": (["plan", "--config", TINY, "--hosts", "1", "--gpus-per-host", "8",
                                     "--model-config", "{toml}"], "Expecting value"),
    "export missing checkpoint": (["export", "{missing}", "{out}"], "no such directory"),
    "export not a checkpoint": (["export", "{dir}", "{out}"], "not a learner checkpoint with a policy"),
    "fsck missing": (["replay", "fsck", "{missing}"], "no such file"),
    "fsck dir": (["replay", "fsck", "{dir}"], "a directory; give the log file"),
    "fsck garbage": (["replay", "fsck", "{log}"], "not a replay log"),
    "plot missing run": (["plot", "{missing}", "--out", "{out}.png"], "no metrics file"),
    "plot empty run": (["plot", "{dir}", "--out", "{out}.png"], "no metrics file"),
    "plot malformed metrics": (["plot", "{run}", "--out", "{out}.png"], "not a JSON object"),
    "import-gguf missing": (["import-gguf", "{missing}", "{out}"], "no such file"),
    "import-gguf dir": (["import-gguf", "{dir}", "{out}"], "not a file"),
    "report missing": (["report", "{missing}"], "not a folder"),
    "experiment report missing": (["experiment", "report", "--out", "{missing}"], "No such file or directory"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_path_or_file_is_one_line_and_a_non_zero_exit(case, bad, capsys):
    argv, fragment = CASES[case]
    code, out, err = run_cli(capsys, *(a.format(**bad) for a in argv))
    assert code != 0, (out, err)
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"async-vapo {argv[0]}") and fragment in err, err
    assert "Traceback" not in err
    assert not bad["out"].exists()


def test_export_refuses_an_existing_out_without_force(tmp_path, capsys):
    ckpt = tmp_path / "step_1"
    (ckpt / "dcp").mkdir(parents=True)
    (ckpt / "hf_meta" / "policy").mkdir(parents=True)
    (ckpt / "hf_meta" / "policy" / "config.json").write_text("{}")  # a checkpoint, as far as the refusals look
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "export", ckpt, out)
    assert code == 2 and err == f"async-vapo export: OUT {out} exists; --force replaces it\n"
    (tmp_path / "file").write_text("x")
    code, _, err = run_cli(capsys, "export", ckpt, tmp_path / "file", "--force")
    assert code == 2 and "a file; export writes a directory" in err
    # with --force that refusal is gone; this checkpoint has no critic, so export stops before replacing OUT
    code, _, err = run_cli(capsys, "export", ckpt, out, "--force", "--model", "critic")
    assert code == 2 and err == (f"async-vapo export: checkpoint {ckpt}: not a learner checkpoint with a critic "
                                 "(needs dcp/ and hf_meta/critic/config.json)\n")
    assert (out / "keep.txt").read_text() == "mine"
    assert (tmp_path / "file").read_text() == "x"


def config_json(capsys, *argv: str) -> dict:
    code, out, err = run_cli(capsys, "config", *argv)
    assert code == 0, err
    return json.loads(out)


def test_overrides_anywhere_on_the_line(tmp_path, capsys):
    layer = tmp_path / "layer.toml"
    layer.write_text("[algo]\nalpha = 0.5\n")
    cfg = config_json(capsys, "train.name=before", "--config", TINY, "algo.eps_high=0.25", "--config", layer,
                      "algo.alpha=0.7", "rollout.temperature=0.9")
    assert (cfg["train"]["name"], cfg["algo"]["eps_high"], cfg["algo"]["alpha"], cfg["rollout"]["temperature"]) == (
        "before", 0.25, 0.7, 0.9)  # overrides after the files whatever their place; alpha=0.7 beats the layer
    assert config_json(capsys, "algo.alpha=0.6", "--config", TINY, "algo.alpha=0.8")["algo"]["alpha"] == 0.8
    code, _, err = run_cli(capsys, "config", "--config", TINY, "stray")  # a word that is no override: an error
    assert code == 2 and err == "async-vapo config: command line: override 'stray' is not of the form key.sub=value\n"
    with pytest.raises(SystemExit) as e:
        main(["config", "algo.alpha=0.6", "--config", TINY, "stray"])
    assert e.value.code == 2 and "unrecognized arguments: stray" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a command that takes no overrides
        main(["replay", "fsck", str(tmp_path / "x.log"), "algo.alpha=1"])
    assert e.value.code == 2 and "unrecognized arguments: algo.alpha=1" in capsys.readouterr().err


def test_override_errors_name_the_command_line_and_suggest_a_key(tmp_path, capsys):
    code, _, err = run_cli(capsys, "config", "--config", TINY, "--config", tmp_path / "nope.toml")
    assert code == 2 and "config file not found" in err
    code, _, err = run_cli(capsys, "config", "--config", TINY, "algo.eps_hihg=0.3")
    assert code == 2 and err == ("async-vapo config: invalid config: command line: algo.eps_hihg: unknown key; "
                                 "did you mean algo.eps_high?\n")
    code, _, err = run_cli(capsys, "config", "--config", TINY, "rollout.max_response_tokens=20")
    assert code == 2 and err.startswith(f"async-vapo config: invalid config: {TINY}, command line: <root>: ")
    assert "task.max_ops=6" in err  # the file set task.max_ops, the command line the response budget
    code, _, err = run_cli(capsys, "eval", "--config", TINY, "--samples", "2", "rollout.top_p=0.5")
    assert code == 2 and "command line: rollout: " in err and len(err.splitlines()) == 1


def test_plan_takes_config_like_every_command_and_keeps_its_positional_form(capsys):
    shape = ["--hosts", "4", "--gpus-per-host", "8"]
    code, positional, err = run_cli(capsys, "plan", PAPER, *PAPER_SHAPE, *shape)
    assert code == 0, err
    assert "32.76 B parameters" in positional and "6 engine(s)" in positional
    code, flagged, err = run_cli(capsys, "plan", "--config", PAPER, *PAPER_SHAPE, *shape)
    assert code == 0 and flagged == positional, err
    code, mixed, err = run_cli(capsys, "plan", *shape, PAPER_SHAPE[0], "--config", PAPER, *PAPER_SHAPE[1:])
    assert code == 0 and mixed == positional, err
    code, out, err = run_cli(capsys, "plan", "--hosts", "2", "--config", PAPER, "--gpus-per-host", "8",
                             "async.rollout_devices=32", "async.learner_devices=8",
                             "rollout.tensor_parallel_size=1")  # a shape that does not fit: one line, exit 1
    assert code == 1 and out.startswith("DOES NOT FIT: 32 engine(s)") and len(out.splitlines()) == 1 and not err


def test_version_and_help_exit_0(capsys):
    from async_vapo import __version__

    for argv in (["--version"], ["--help"], ["export", "--help"], ["plan", "--help"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
    out = capsys.readouterr().out
    assert f"async-vapo {__version__}" in out and "--force" in out and "--config FILE" in out


def test_build_parser_has_every_command_and_option():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    assert list(sub.choices) == ["train", "check", "make-base", "eval", "import-gguf", "config", "plot", "replay",
                                 "export", "plan", "report", "experiment"]
    options = {name: {s for a in p._actions for s in a.option_strings} for name, p in sub.choices.items()}
    for name in ("train", "check", "make-base", "eval", "config", "plan"):
        assert "--config" in options[name], name
    assert {"--force", "--model", "--dtype"} <= options["export"]
    assert {"--resume", "--new-run", "--no-check"} <= options["train"]
    assert {"--hosts", "--model-config"} <= options["plan"]
    # experiment and report carry their own modules' arguments
    experiment = next(a for a in sub.choices["experiment"]._actions if a.dest == "cmd").choices
    assert {"--plan", "--seeds", "--parallel"} <= {s for a in experiment["run"]._actions for s in a.option_strings}
    assert [a.dest for a in sub.choices["report"]._actions if not a.option_strings] == ["dirs"]
    for p in sub.choices.values():
        assert p.format_help()  # the docs' reference renders each


def test_start_cluster_help_exits_0():
    r = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--help"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0 and "deploy/start_cluster.sh --config FILE" in r.stdout and not r.stderr
    r = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--bogus"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "unknown argument --bogus" in r.stderr
