"""`async-vapo check` and the same check at the start of `train`: every problem a run would meet, one line each,
found before anything starts (a broken record in the middle of a file, an answer the verifier cannot read in its own
format, a busy port, a model directory without what the run needs, a disk too small for the checkpoints)."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest
from safetensors.torch import load_file

from async_vapo.cli import main
from async_vapo.cli.check import check, checkpoint_bytes, checkpoints_disk, service_ports
from async_vapo.config import load_config
from async_vapo.deploy.placement import place

REPO = Path(__file__).resolve().parents[2]
# the embedded default's shipped base model (in the package, so a fresh clone has it): a Qwen2 config and a tokenizer
# without a chat template
MODEL = next((REPO / "async_vapo" / "models" / "shipped").glob("tiny-base-*"))


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _problems_file(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "problems.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _files(path, *more) -> list[str]:
    return ["task.kind=files", f"task.train_path={path}", f"task.eval_path={path}", *more]


BROKEN = ['{"question": "1+1=", "extra_info": {"final": "2"}}',
          '{"question": "2+2=", "extra_info": {"final": "4"}}',
          '{"question": "3+3=", "extra_info": {"finl": "6"}}',
          'not json',
          '{"question": "", "extra_info": {"final": "8"}}',
          '{"question": "5+5=", "extra_info": {"final": "10"}}']
KEYS = ["task.prompt_key=question", "task.answer_key=extra_info.final"]


def test_check_reports_every_broken_record_with_its_line_and_exits_1(tmp_path, capsys):
    path = _problems_file(tmp_path, BROKEN)
    code, out, _ = run_cli(capsys, "check", *_files(path, *KEYS), "--for", "train", f"train.output_dir={tmp_path}/r")
    assert code == 1
    problems = [ln for ln in out.splitlines() if ln.startswith(str(path))]
    assert problems == [
        f"{path}:3: missing field 'extra_info.final' (task.answer_key); the fields of 'extra_info' found: ['finl']; "
        "did you mean 'extra_info.finl'?",
        f"{path}:4: invalid JSON: Expecting value (column 1)",
        f"{path}:5: field 'question' is empty"]
    assert out.splitlines()[-1] == "3 problem(s) found; nothing was started"
    assert not (tmp_path / "r").exists()


def test_train_reports_them_all_before_it_starts(tmp_path, capsys):
    """`train` read the first record of each file only: the third record's problem came after a model was built."""
    path = _problems_file(tmp_path, BROKEN)
    code, _, err = run_cli(capsys, "train", *_files(path, *KEYS), f"train.output_dir={tmp_path}/out")
    assert code == 2
    assert f"{path}:3: missing field" in err and f"{path}:4: invalid JSON" in err and f"{path}:5:" in err
    assert "3 problem(s) found" in err and "--no-check" in err
    assert not (tmp_path / "out").exists()


def test_a_clean_file_passes_and_the_ok_lines_say_what_was_checked(tmp_path, capsys):
    path = _problems_file(tmp_path, [ln for i, ln in enumerate(BROKEN) if i not in (2, 3, 4)])
    code, out, _ = run_cli(capsys, "check", *_files(path, *KEYS), "--for", "train", f"train.output_dir={tmp_path}/r")
    assert code == 0, out
    assert f"ok  data: {path}: 3 records read" in out
    assert "grades 3 reference answer(s) stated as '\\\\boxed{A}' correct" in out
    assert out.splitlines()[-1] == "no problem found"


@pytest.mark.parametrize("fmt, answer", [("boxed", "x{"), ("answer_line", "3\\n4")])
def test_an_answer_the_verifier_cannot_read_in_its_own_format_is_reported(tmp_path, fmt, answer):
    path = _problems_file(tmp_path, ['{"prompt": "a", "answer": "1"}', f'{{"prompt": "b", "answer": "{answer}"}}'])
    report = check(load_config([], [*_files(path), f"verifier.answer_format={fmt}"]), app="train")
    assert len(report.problems) == 1 and report.problems[0].startswith(f"{path}:2: verifier.answer_format = ")


PORT_KEYS = ("verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
             "learner_rdzv_port", "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port",
             "rollout_metrics_port")


def _ports(*overrides: str) -> list[str]:
    """Every cluster port on a free one (other clusters may run on this machine), then ``overrides``."""
    from tests.conftest import free_ports

    ports = free_ports(len(PORT_KEYS))
    return [f"cluster.ports.{k}={p}" for k, p in zip(PORT_KEYS, ports, strict=True)] + list(overrides)


def test_busy_and_shared_ports_are_reported_for_the_cluster_only(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        cfg = load_config([], _ports(f"cluster.ports.replay_port={port}", f"train.output_dir={tmp_path}/r"))
        problems = check(cfg).problems
        assert len(problems) == 1 and problems[0].startswith(f"port {port} (replay: cluster.ports.replay_port) on "
                                                             "127.0.0.1:"), problems
        assert check(cfg, app="train").problems == []
    cfg = load_config([], _ports(f"train.output_dir={tmp_path}/r"))
    cfg.cluster.ports.verifier_port = cfg.cluster.ports.learner_metrics_port
    assert [p for p in check(cfg).problems if "both bind it" in p] == [
        f"port {cfg.cluster.ports.verifier_port}: learner (learner_metrics_port) and verifier (verifier_port) both "
        "bind it on this host"]


def test_only_the_services_of_this_host_are_checked(tmp_path):
    """A hostfile that runs one engine here: a busy replay port (on node1) is not this host's problem."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1 replay\nnode1 verifier\nlocalhost rollout\nnode1 rollout\nnode1 learner\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        cfg = load_config([], _ports("async.rollout_devices=2", f"cluster.ports.replay_port={s.getsockname()[1]}",
                                     f"train.output_dir={tmp_path}/r"))
        report = check(cfg, hostfile=str(hostfile))
    assert report.problems == [] and "ok  ports: 1 free on 127.0.0.1 for rollout-0 (this host's services)" in \
        report.text().splitlines()
    assert [n for n, _, _ in service_ports(cfg, place(2, 1))] == ["replay"] * 3 + ["verifier"] * 2 + [
        "rollout-0", "rollout-1"] + ["learner"] * 4


def test_model_directory_problems(tmp_path):
    cfg = load_config([], ["model.path=" + str(tmp_path / "nowhere"), "task.kind=wordprob", "task.max_ops=4"])
    assert check(cfg, app="train").problems == [f"model.path = '{tmp_path / 'nowhere'}': no such directory"]
    # a tokenizer without a chat template, asked for one
    d = tmp_path / "model"
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(MODEL / f, d / f)
    (d / "model.safetensors").write_bytes(b"")  # never loaded: only its presence is checked
    cfg = load_config([], [f"model.path={d}", "task.kind=wordprob", "task.max_ops=4", "task.prompt_format=chat"])
    report = check(cfg, app="train", run_dir=str(tmp_path / "r"))
    assert len(report.problems) == 1 and "no chat template" in report.problems[0], report.text()
    params = sum(t.numel() for t in load_file(MODEL / "model.safetensors").values())
    assert any(line.startswith("model: model.path") and f"{params / 1e9:.2f} B parameters" in line
               for line in report.ok), report.text()


def test_checkpoints_by_hand(tmp_path):
    cfg = load_config([], ["train.total_steps=120", "train.checkpoint_every=50"])
    # policy + critic, one unsharded rank: 2 models x (12 B masters and moments + 4 B HF copy) per parameter;
    # steps 50, 100 and the end (120)
    assert checkpoint_bytes(cfg, 1000) == (32_000, 3)
    cfg = load_config([], ["train.total_steps=100", "train.checkpoint_every=50", "algo.name=grpo",
                           "async.learner_devices=2"])
    assert checkpoint_bytes(cfg, 1000) == (12_000, 2)  # one model, sharded: no HF copies
    assert checkpoint_bytes(load_config([], ["train.checkpoint_every=0"]), 10) == (320, 1)


def test_pruned_checkpoints_by_hand():
    # 200 updates, one every 5: 40 checkpoints; GRPO (one model), unsharded: 16 B whole, 4 B as HF weights
    over = ["algo.name=grpo", "train.total_steps=200", "train.checkpoint_every=5"]
    assert checkpoints_disk(load_config([], over), 1000)[0] == 40 * 16_000
    total, text = checkpoints_disk(load_config([], [*over, "train.keep_checkpoints=2"]), 1000)
    assert total == 2 * 16_000 + 38 * 4_000 and "38 pruned" in text, text
    assert checkpoints_disk(load_config([], [*over, "train.keep_checkpoints=2", "train.keep_weights=false"]),
                            1000)[0] == 2 * 16_000
    # sharded: no HF weights to keep; keep_checkpoints above the count prunes nothing
    assert checkpoints_disk(load_config([], [*over, "train.keep_checkpoints=2", "async.learner_devices=2"]),
                            1000)[0] == 2 * 12_000
    assert checkpoints_disk(load_config([], [*over, "train.keep_checkpoints=50"]), 1000)[0] == 40 * 16_000


def test_a_disk_too_small_for_the_checkpoints_is_reported(tmp_path):
    big = tmp_path / "big"
    big.mkdir()
    cfg = json.loads((MODEL / "config.json").read_text())
    cfg.update(hidden_size=9 * 2048, intermediate_size=65536, num_hidden_layers=400,  # ~2 T parameters
               layer_types=["full_attention"] * 400, num_attention_heads=144, num_key_value_heads=8)
    (big / "config.json").write_text(json.dumps(cfg))
    (big / "model.safetensors").write_bytes(b"")
    report = check(load_config([], [f"model.path={big}", "task.kind=wordprob", "task.max_ops=4"]), app="train",
                   run_dir=str(tmp_path / "run"))
    assert any(p.startswith("disk: ") and "do not fit" in p for p in report.problems), report.text()
