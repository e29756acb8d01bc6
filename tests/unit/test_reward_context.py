"""Reward functions that take the prompt and the record's extra fields (issue 48, item 5): the loader reads the
fields, the wire carries them (``Group.extra``), the sandboxed worker calls ours, the keyword, verl's and TRL's forms.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from async_vapo.tasks import ProblemFileError, load_problems
from async_vapo.tasks.files import MAX_EXTRA_BYTES, check_problems
from async_vapo.verify.reward_fn import RewardFnError, reward_call, score

VERL_RECORD = {"data_source": "gauge", "prompt": [{"role": "user", "content": "Read the gauge."}],
               "reward_model": {"ground_truth": "3.0", "style": "rule"}, "extra_info": {"index": 7, "tolerance": 0.5}}


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------- the loader


def test_extra_fields_are_every_field_but_the_prompt_when_asked(tmp_path):
    path = _jsonl(tmp_path / "verl.jsonl", [VERL_RECORD])
    (p,) = load_problems(path, extra_keys=None)
    # the prompt (a message list) stays out; the answer's field and extra_info arrive whole, as verl keeps them
    assert dict(p.extra) == {"data_source": "gauge", "reward_model": {"ground_truth": "3.0", "style": "rule"},
                             "extra_info": {"index": 7, "tolerance": 0.5}}
    (p,) = load_problems(path, extra_keys=["data_source", "extra_info.tolerance"])
    assert dict(p.extra) == {"data_source": "gauge", "extra_info.tolerance": 0.5}
    (p,) = load_problems(path)  # the default: none (the maths check takes none)
    assert dict(p.extra) == {}


def test_extra_fields_missing_or_too_large_are_named_errors(tmp_path):
    path = _jsonl(tmp_path / "verl.jsonl", [VERL_RECORD, VERL_RECORD,
                                             {**VERL_RECORD, "notes": "x" * MAX_EXTRA_BYTES}])
    with pytest.raises(ProblemFileError, match=r"verl.jsonl:1: missing field 'extra_info.tolerence' "
                                               r"\(task.extra_keys\).*did you mean 'extra_info.tolerance'"):
        load_problems(path, extra_keys=["extra_info.tolerence"])
    problems, errors = check_problems(path, extra_keys=None)  # `async-vapo check` lists the third record
    assert len(problems) == 2 and len(errors) == 1
    assert errors[0].startswith(f"{path}:3: the record's extra fields take ")
    assert f"above the {MAX_EXTRA_BYTES} a problem carries to the verifier (largest: 'notes' " in errors[0]
    assert errors[0].endswith("name the fields the reward function takes in task.extra_keys")
    assert len(load_problems(path, extra_keys=["data_source"])) == 3  # selecting fields keeps the wire small


# ---------------------------------------------------------------------- the call forms, in this process


def ours(response, answer):
    return response == answer


def keywords(response, answer, *, prompt, tolerance=0.0):
    return 1.0 if "gauge" in prompt and abs(float(response) - float(answer)) <= tolerance else -1.0


def needs_field(response, answer, tolerance):
    return abs(float(response) - float(answer)) <= tolerance


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, as verl's custom reward functions have it."""
    if data_source == "gauge":
        return 1.0 if abs(float(solution_str) - float(ground_truth)) <= extra_info["tolerance"] else 0.0
    return 1.0 if solution_str == ground_truth else 0.0


def trl_reward(completions, prompts, **kwargs):
    """TRL's batched form: one float per completion, dataset columns as lists."""
    return [float(len(c) + len(kwargs["data_source"][0])) for c in completions]


def spread(response, answer, **fields):
    return float(len(fields))


def test_each_form_is_recognised_from_its_signature():
    assert [reward_call(f).form for f in (ours, keywords, needs_field, compute_score, trl_reward, spread)] == [
        "pair", "keywords", "keywords", "verl", "batched", "keywords"]
    with pytest.raises(RewardFnError, match=r"signature \(x\) fits no accepted form"):
        reward_call(lambda x: x)


def test_each_form_gets_the_prompt_and_the_record_fields():
    ctx = {"prompt": "Read the gauge.", "extra": json.dumps({"data_source": "gauge", "tolerance": 0.5,
                                                             "extra_info": {"tolerance": 0.25}})}
    assert score(ours, "3", "3", ctx) == ("scored", True, "")
    assert score(keywords, "3.4", "3", ctx) == ("scored", 1.0, "")  # the record's tolerance 0.5
    assert score(keywords, "3.4", "3", {"prompt": "Read the gauge."}) == ("scored", -1.0, "")  # its default 0
    assert score(compute_score, "3.2", "3", ctx) == ("scored", 1.0, "")  # extra_info's own tolerance 0.25
    assert score(compute_score, "3.4", "3", ctx) == ("scored", 0.0, "")
    assert score(trl_reward, "abc", "3", ctx) == ("scored", 8.0, "")  # 3 characters + len("gauge")
    assert score(spread, "a", "b", ctx) == ("scored", 4.0, "")  # the prompt and the three fields
    # a record without extra_info: verl's extra_info is the dict of its extra fields
    assert score(compute_score, "3.4", "3", {"extra": json.dumps({"data_source": "gauge", "tolerance": 0.5})}) == (
        "scored", 1.0, "")
    reason, _, detail = score(needs_field, "3", "3", {"extra": json.dumps({"data_source": "gauge"})})
    assert (reason, detail) == ("reward_error", "reward_fn needs 'tolerance', which this record does not hold "
                                                "(its extra fields: ['data_source']; task.extra_keys selects them)")
    reason, _, detail = score(lambda completions, **kw: 1.0, "a", "b")
    assert (reason, detail) == ("reward_error", "reward_fn (TRL form) returned float, not a one-float list")


# ---------------------------------------------------------------------- the wire


def test_a_group_without_extra_fields_encodes_as_before_and_old_logs_open(tmp_path):
    from async_vapo.replay.store import GroupStore
    from async_vapo.transport.messages import group_wire_bytes
    from async_vapo.types import Group, Trajectory, enc_hook

    g = Group(uid="u", prompt="p", answer="a", prompt_ids=[1], version=0,
              samples=[Trajectory(response_ids=[1], behavior_logprobs=[0.0], finish_reason="stop")])
    assert b"extra" not in msgspec.msgpack.encode(g, enc_hook=enc_hook)  # a protocol-9 group's bytes
    path = tmp_path / "replay.log"  # a log of such groups (what protocol 9 wrote) opens with them whole
    store = GroupStore(path, fsync="never")
    store.append(g)
    store.close()
    (back,) = (group for _seq, group in GroupStore(path, fsync="never").live())
    assert back.extra == "" and back.uid == "u"
    g.extra = json.dumps({"notes": "é" * 4000})  # multi-byte text counts by its bytes
    frame = msgspec.msgpack.encode(g, enc_hook=enc_hook)
    assert msgspec.msgpack.decode(frame, type=Group).extra == g.extra
    assert group_wire_bytes(g) >= len(frame)


# ---------------------------------------------------------------------- through the sandbox

USER_REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature, unchanged: a data_source switch and a tolerance only the record holds."""
    if data_source == "gauge":
        return 1.0 if abs(float(solution_str) - float(ground_truth)) <= extra_info["tolerance"] else 0.0
    return 1.0 if solution_str.strip() == ground_truth else 0.0

def reward_len(completions, prompts, **kwargs):
    """TRL's form: a list in, a list out; the columns as lists."""
    return [1.0 if len(c) <= kwargs["max_chars"][0] and p.startswith("Say") else 0.0
            for c, p in zip(completions, prompts)]

def graded(response, answer, *, prompt, tolerance=0.0, **fields):
    if "where" in fields:
        import os
        return float(os.getpid())
    return 1.0 if abs(float(response) - float(answer)) <= tolerance and prompt.startswith("Read") else 0.0
'''

GAUGE = {"data_source": "gauge", "prompt": [{"role": "user", "content": "Read the gauge."}],
         "reward_model": {"ground_truth": "3.0"}, "extra_info": {"tolerance": 0.5}}
LABEL = {"data_source": "label", "prompt": [{"role": "user", "content": "Name the animal."}],
         "reward_model": {"ground_truth": "cat"}, "extra_info": {"tolerance": 0.5}}
RESPONSES = {"gauge": ["3.4", "3.6", "cat"], "label": ["cat", "3.4"]}
EXPECTED = {"gauge": [1.0, 0.0, "reward_error"], "label": [1.0, 0.0]}  # float("cat") raises in compute_score


@pytest.fixture(scope="module")
def user_rewards(tmp_path_factory):
    where = tmp_path_factory.mktemp("ctx-rewards")
    (where / "vapo_ctx_rewards.py").write_text(USER_REWARDS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(where))  # the workers read it when they start
        mp.syspath_prepend(str(where))
        yield where


def _chars(ids) -> str:
    return "".join(map(chr, ids))


def _verl_run(tmp_path, extra_overrides=()):
    """The config and the groups of a verl-layout file, made as the one-process trainer and the rollout service
    make them (load_task, then make_group around the engine's samples; token ids are characters here)."""
    from async_vapo.config import load_config
    from async_vapo.rollout.engine import Sample
    from async_vapo.rollout.generate import make_group
    from async_vapo.tasks import load_task

    path = _jsonl(tmp_path / "verl.jsonl", [GAUGE, LABEL])
    cfg = load_config([], ["task.kind=files", f"task.train_path={path}", f"task.eval_path={path}",
                           "verifier.reward_fn=vapo_ctx_rewards:compute_score", "verifier.num_workers=1",
                           *extra_overrides])
    train, _ = load_task(cfg)
    groups = [make_group(p, [1, 2], [Sample(token_ids=[ord(c) for c in text], logprobs=[0.0] * len(text),
                                            finish_reason="stop") for text in RESPONSES[p.extra["data_source"]]],
                         version=0) for p in train]
    return cfg, groups


def _outcome(group) -> list:
    return [s.reward if s.verdict != "reward_error" else s.verdict for s in group.samples]


def test_verl_compute_score_grades_on_the_record_in_the_one_process_path(tmp_path, user_rewards):
    from async_vapo.rollout.generate import score_groups
    from async_vapo.verify import VerifierPool

    cfg, groups = _verl_run(tmp_path)
    assert json.loads(groups[0].extra) == {"data_source": "gauge", "reward_model": {"ground_truth": "3.0"},
                                           "extra_info": {"tolerance": 0.5}}
    with VerifierPool.from_config(cfg.verifier) as pool:
        results = score_groups(groups, pool, _chars)
    # 3.4 is within the gauge record's tolerance of 0.5, 3.6 is not; the label record compares strings
    assert [_outcome(g) for g in groups] == [EXPECTED["gauge"], EXPECTED["label"]]
    assert [s.correct for s in groups[0].samples] == [True, False, False]
    assert "reward_fn raised ValueError: could not convert string to float: 'cat'" in results[2].detail


def test_verl_compute_score_grades_on_the_record_through_the_verifier_service(tmp_path, user_rewards):
    import threading

    from async_vapo.services.context import make_context
    from async_vapo.services.verifier import VerifierService
    from async_vapo.transport import GroupsMsg, ZmqTransport, make_envelope
    from async_vapo.transport.messages import Decoder

    cfg, groups = _verl_run(tmp_path)
    ctx = make_context("verifier", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    out = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), bind=True)
    svc = VerifierService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", out_endpoint=out.endpoint)
    loop = threading.Thread(target=svc.run, args=(_chars,), daemon=True)
    loop.start()
    try:
        transport.sender(svc.pull.endpoint).send(make_envelope(GroupsMsg(groups=groups), sender="rollout-0"), 5.0)
        env = out.recv(60.0)
        assert env is not None, "no verified groups came out"
        assert [_outcome(g) for g in env.body.groups] == [EXPECTED["gauge"], EXPECTED["label"]]
        assert [g.extra for g in env.body.groups] == [g.extra for g in groups]  # on to the replay as they came
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()


def test_keyword_and_trl_forms_run_in_the_sandbox(user_rewards):
    from async_vapo.verify import VerifierPool

    gauge = {"prompt": "Read the gauge.", "extra": json.dumps({"tolerance": 0.5})}
    with VerifierPool(num_workers=1, reward_fn="vapo_ctx_rewards:graded") as pool:
        results = pool.verify([("3.4", "3", gauge), ("3.4", "3", {"prompt": "Read the gauge."}),  # default 0
                               ("3.4", "3"), ("0", "0", {"prompt": "x", "extra": json.dumps({"where": 1})})])
        assert [r.reward for r in results[:3]] == [1.0, 0.0, 0.0]  # 0.0 is below reward_correct: incorrect
        assert [r.reason for r in results[:3]] == ["correct", "incorrect", "incorrect"]
        assert results[3].reward == float(pool.worker_pids[0])  # computed in the worker, not here
    say = {"prompt": "Say hi.", "extra": json.dumps({"max_chars": 5})}
    with VerifierPool(num_workers=1, reward_fn="vapo_ctx_rewards:reward_len") as pool:
        results = pool.verify([("hi", "", say), ("hello there", "", say), ("hi", "")])
    assert [r.reason for r in results] == ["correct", "incorrect", "reward_error"]
    assert results[2].detail == "reward_fn raised KeyError: 'max_chars'"


def test_without_a_reward_fn_no_field_is_read_and_the_maths_check_ignores_the_context(tmp_path):
    from async_vapo.config import load_config
    from async_vapo.tasks import load_task
    from async_vapo.verify import VerifierPool

    path = _jsonl(tmp_path / "verl.jsonl", [{**GAUGE, "notes": "x" * MAX_EXTRA_BYTES}])  # too large to carry
    cfg = load_config([], ["task.kind=files", f"task.train_path={path}", f"task.eval_path={path}"])
    assert dict(load_task(cfg)[0][0].extra) == {}
    with VerifierPool(num_workers=1) as pool:
        results = pool.verify([("\\boxed{3}", "3", {"prompt": "Read the gauge.", "extra": "{}"}), ("3", "3", 42),
                               ("3", "3", None, None)])
    assert [r.reason for r in results] == ["correct", "bad_input", "bad_input"]
    assert [r.detail for r in results[1:]] == ["context must be a mapping or None",
                                               "item is not a (response, answer[, context]) tuple"]


def test_check_reads_the_fields_the_reward_fn_takes_and_names_its_form(tmp_path, user_rewards):
    from async_vapo.cli.check import check
    from async_vapo.config import load_config

    path = _jsonl(tmp_path / "verl.jsonl", [GAUGE, LABEL, {**GAUGE, "notes": "x" * MAX_EXTRA_BYTES}])
    cfg = load_config([], ["task.kind=files", f"task.train_path={path}", f"task.eval_path={path}",
                           "verifier.reward_fn=vapo_ctx_rewards:compute_score", f"train.output_dir={tmp_path}/r"])
    report = check(cfg, app="train")
    (line,) = [p for p in report.problems if p.startswith(str(path))]  # the third record's, as the loader says it
    assert line == check_problems(path, extra_keys=None)[1][0] and line.startswith(f"{path}:3: the record's extra")
    assert ("answers: verifier.reward_fn = 'vapo_ctx_rewards:compute_score' imports, called in its 'verl' form "
            "(it grades, not answer_format)") in report.ok
