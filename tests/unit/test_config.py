import json
from pathlib import Path

import pytest

from async_vapo.config import Config, ConfigError, load_config, parse_override, save_resolved

ROOT = Path(__file__).resolve().parents[2] / "configs"
CONFIGS = sorted(ROOT.rglob("*.toml"))


def test_configs_folder_is_not_empty():
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.toml", "tiny_long_cpu.toml", "qwen2.5-32b_vapo.toml", "ppo.toml", "grpo.toml",
            "dapo.toml"} <= names
    assert len([p for p in CONFIGS if p.parent.name == "ablations" and p.parents[1].name == "configs"]) == 7
    assert len([p for p in CONFIGS if p.parent.name == "ablations" and p.parents[1].name == "long"]) == 7


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(p.parents[1])))
def test_every_config_file_loads(path):
    cfg = load_config([path])
    assert isinstance(cfg, Config)


def test_paper_settings_in_qwen_config():
    cfg = load_config([p for p in CONFIGS if p.name == "qwen2.5-32b_vapo.toml"])
    a, o = cfg.algo, cfg.optim
    assert (a.prompts_per_step, a.group_size, a.batch_size, a.mini_batch_size) == (512, 16, 8192, 512)
    assert (o.actor_lr, o.critic_lr) == (1e-6, 2e-6)
    assert (a.value_pretrain_steps, a.lam_critic, a.alpha, a.pos_lm_coef, a.gamma) == (50, 1.0, 0.05, 0.1, 1.0)
    assert (a.eps_low, a.eps_high) == (0.2, 0.28)
    assert a.batch_size // a.mini_batch_size == 16  # optimiser steps per rollout step, as in the paper


@pytest.mark.parametrize(("vapo", "arms", "per_step"),
                         [("tiny_cpu.toml", "", 128), ("tiny_long_cpu.toml", "long", 256)])
def test_baselines_and_ablations_flip_exactly_their_switch(vapo, arms, per_step):
    base = load_config([ROOT / vapo]).algo.model_dump()
    flips = {
        "no_value_pretrain": {"value_pretrain_steps": 0},
        "no_decoupled_gae": {"decoupled_gae": False},
        "no_length_adaptive_gae": {"length_adaptive_gae": False},
        "no_clip_higher": {"clip_higher": False},
        "no_token_level_loss": {"token_level_loss": False},
        "no_pos_lm_loss": {"pos_lm_coef": 0.0},
        "no_group_sampling": {"group_size": 1, "prompts_per_step": per_step},
    }
    for name, expected in flips.items():
        algo = load_config([ROOT / arms / "ablations" / f"{name}.toml"]).algo
        changed = {k: v for k, v in algo.model_dump().items() if base[k] != v}
        assert changed == expected, name
        assert algo.batch_size == per_step  # same samples per step
    for name in ("ppo", "grpo", "dapo"):
        assert load_config([ROOT / arms / "baselines" / f"{name}.toml"]).algo.batch_size == per_step, name
    ppo = load_config([ROOT / arms / "baselines" / "ppo.toml"]).algo
    assert (ppo.lam_policy, ppo.effective_eps_high, ppo.token_level_loss, ppo.value_pretrain_steps) == (
        0.95, 0.2, False, 0)
    assert not ppo.decoupled_gae and not ppo.length_adaptive_gae


def test_long_config_rescales_alpha_to_its_lengths():
    """tiny_long_cpu.toml: the paper's alpha * l >= 10 (lambda_policy 0.90-0.96 here) on every correct held-out
    response, which are 150-400 tokens, and DAPO's overlong zone starts past the longest."""
    from async_vapo.tasks import arith

    cfg = load_config([ROOT / "tiny_long_cpu.toml"])
    assert cfg.task.labels
    _, held_out = arith.make_splits(0, cfg.task.num_eval, cfg.task.seed, cfg.task.min_ops, cfg.task.max_ops,
                                    labels=True)
    lengths = [len(arith.solution(p)) + 1 for p in held_out]  # + EOS
    prompts = [len(p.prompt) for p in held_out]
    assert max(prompts) + cfg.rollout.max_response_tokens + 1 <= cfg.base_model.max_position_embeddings
    assert 150 <= min(lengths) and max(lengths) <= 400
    lam = [1 - 1 / (cfg.algo.alpha * n) for n in lengths]
    assert 0.90 <= min(lam) and max(lam) <= 0.96
    assert max(lengths) <= cfg.rollout.max_response_tokens - cfg.algo.overlong_buffer
    dapo = load_config([ROOT / "long" / "baselines" / "dapo.toml"])
    assert max(lengths) <= dapo.rollout.max_response_tokens - dapo.algo.overlong_buffer


def test_model_positions_must_hold_prompt_and_response():
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        load_config(overrides=["task.min_ops=20", "task.max_ops=44", "rollout.max_response_tokens=416"])
    cfg = load_config(overrides=["task.min_ops=20", "task.max_ops=44", "rollout.max_response_tokens=416",
                                 "base_model.max_position_embeddings=507"])  # 90 + 416 + 1
    assert cfg.base_model.max_position_embeddings == 507
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        load_config(overrides=["task.min_ops=20", "task.max_ops=44", "rollout.max_response_tokens=416",
                               "base_model.max_position_embeddings=506"])


def test_labelled_chains_need_room_for_their_labels():
    """A label adds one character per operation to the prompt and one to each written step."""
    base = ["task.labels=true", "task.min_ops=20", "task.max_ops=40"]
    with pytest.raises(ConfigError, match="longest correct arith response"):
        load_config(overrides=[*base, "rollout.max_response_tokens=369", "base_model.max_position_embeddings=1024"])
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        load_config(overrides=[*base, "rollout.max_response_tokens=370", "base_model.max_position_embeddings=492"])
    cfg = load_config(overrides=[*base, "rollout.max_response_tokens=370", "base_model.max_position_embeddings=493"])
    assert cfg.task.labels  # 122 + 370 + 1
    with pytest.raises(ConfigError, match="at most 52"):
        load_config(overrides=["task.labels=true", "task.max_ops=53", "rollout.max_response_tokens=600"])
    with pytest.raises(ConfigError, match="kind='arith' only"):
        load_config(overrides=["task.labels=true", "task.kind=wordprob", "task.max_ops=4"])


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_unknown_key_names_key_and_file(tmp_path):
    p = _write(tmp_path, "bad.toml", "[algo]\neps_hgih = 0.3\n")
    with pytest.raises(ConfigError) as e:
        load_config([p])
    assert "algo.eps_hgih" in str(e.value) and "bad.toml" in str(e.value)


def test_bad_value_names_key_and_file(tmp_path):
    p = _write(tmp_path, "neg.toml", "[optim]\nactor_lr = -1.0\n")
    with pytest.raises(ConfigError) as e:
        load_config([p])
    assert "optim.actor_lr" in str(e.value) and "neg.toml" in str(e.value)


def test_unknown_section_and_wrong_type(tmp_path):
    with pytest.raises(ConfigError, match="learnr"):
        load_config([_write(tmp_path, "a.toml", "[learnr]\nx = 1\n")])
    with pytest.raises(ConfigError, match="algo.group_size"):
        load_config([_write(tmp_path, "b.toml", "[algo]\ngroup_size = 'eight'\n")])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="eps_high"):
        load_config(overrides=["algo.eps_high=0.1", "algo.eps_low=0.2"])
    with pytest.raises(ConfigError, match="mini_batch_size"):
        load_config(overrides=["algo.mini_batch_size=48", "algo.micro_batch_size=32"])
    with pytest.raises(ConfigError, match="group_size"):
        load_config(overrides=["algo.name=grpo", "algo.group_size=1", "algo.prompts_per_step=128"])
    with pytest.raises(ConfigError, match="max_response_tokens"):
        load_config(overrides=["task.max_ops=10", "rollout.max_response_tokens=40"])
    with pytest.raises(ConfigError, match="message_budget_s"):
        load_config(overrides=["verifier.timeout_s=10", "verifier.message_budget_s=5"])
    # symmetric clip is fine once clip-higher is off
    assert load_config(overrides=["algo.clip_higher=false", "algo.eps_high=0.1"]).algo.effective_eps_high == 0.2


def test_training_top_p_below_one_is_rejected_evaluation_is_free():
    with pytest.raises(ConfigError, match=r"rollout.top_p = 0.9: training samples must come from the full tempered"):
        load_config(overrides=["rollout.top_p=0.9"])
    cfg = load_config(overrides=["rollout.eval_top_p=0.5", "rollout.eval_temperature=0", "rollout.temperature=0.7"])
    assert (cfg.rollout.eval_top_p, cfg.rollout.eval_temperature, cfg.rollout.temperature) == (0.5, 0.0, 0.7)
    with pytest.raises(ConfigError, match="temperature"):  # greedy training has no distribution to learn from
        load_config(overrides=["rollout.temperature=0"])


def test_overrides_layer_over_files_and_extends(tmp_path):
    _write(tmp_path, "parent.toml", "[algo]\nalpha = 2.0\ngroup_size = 16\n")
    child = _write(tmp_path, "child.toml", 'extends = "parent.toml"\n[algo]\ngroup_size = 4\n')
    cfg = load_config([child], ["algo.alpha=3.5", "train.name=x y"])
    assert (cfg.algo.alpha, cfg.algo.group_size, cfg.train.name) == (3.5, 4, "x y")
    assert load_config([child]).algo.alpha == 2.0


def test_extends_cycle_and_missing_file(tmp_path):
    a = _write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    _write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(ConfigError, match="cycle"):
        load_config([a])
    with pytest.raises(ConfigError, match="not found"):
        load_config([tmp_path / "nope.toml"])
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config([_write(tmp_path, "c.toml", "[algo\n")])


def test_parse_override():
    assert parse_override("algo.eps_high=0.3") == (["algo", "eps_high"], 0.3)
    assert parse_override("model.path=/x/y") == (["model", "path"], "/x/y")
    assert parse_override("algo.value_clip=none") == (["algo", "value_clip"], None)
    assert parse_override("train.max_minutes=5") == (["train", "max_minutes"], 5)
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("algo.eps_high")
    with pytest.raises(ConfigError):
        parse_override("algo..x=1")


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(overrides=["algo.alpha=0.7", "async.max_staleness=2"])
    out = save_resolved(cfg, tmp_path)
    again = Config.model_validate(json.loads(out.read_text()))
    assert again == cfg and again.async_.max_staleness == 2


def test_every_field_is_documented():
    def walk(model_cls, prefix=""):
        for name, f in model_cls.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, Config.__mro__[1]) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")
            else:
                assert f.description, f"{prefix}{name} has no docstring"

    walk(Config)


def test_cluster_settings_by_concern_accept_the_flat_spellings(tmp_path):
    nested = load_config([], ["cluster.ports.replay_port=6001", "cluster.weights.transfer=file",
                              "cluster.wire.peer_dead_s=7"])
    flat = load_config([], ["cluster.replay_port=6001", "cluster.weight_transfer=file", "cluster.peer_dead_s=7"])
    assert nested.cluster == flat.cluster
    assert flat.cluster.ports.replay_port == 6001 and flat.cluster.weights.transfer == "file"
    toml = tmp_path / "c.toml"
    toml.write_text('[cluster]\nfsync = "never"\n[cluster.deploy]\nstop_grace_s = 3\n')
    cfg = load_config([toml])
    assert cfg.cluster.replay.fsync == "never" and cfg.cluster.deploy.stop_grace_s == 3
    with pytest.raises(ConfigError, match="same setting"):
        load_config([], ["cluster.fsync=never", "cluster.replay.fsync=always"])
    with pytest.raises(ConfigError):
        load_config([], ["cluster.ports.no_such_port=1"])


def test_solution_answers_and_the_solution_format_go_together():
    from async_vapo.tasks import load_task

    with pytest.raises(ValueError, match="go together"):
        load_config([], ["verifier.answer_format=solution"])
    with pytest.raises(ValueError, match="go together"):
        load_config([], ["task.answer=solution"])
    with pytest.raises(ValueError, match="kind='arith' only"):
        load_config([], ["task.kind=wordprob", "task.max_ops=3", "task.answer=solution",
                         "verifier.answer_format=solution"])
    cfg = load_config([], ["task.answer=solution", "verifier.answer_format=solution", "task.num_train=20",
                           "task.num_eval=6"])
    plain = load_task(load_config([], ["task.num_train=20", "task.num_eval=6"]))
    for mine, theirs in zip(load_task(cfg), plain, strict=True):
        assert [p.prompt for p in mine] == [p.prompt for p in theirs]
        assert all(p.answer.endswith(f"\\boxed{{{q.answer}}}") and p.meta["total"] == q.answer
                   for p, q in zip(mine, theirs, strict=True))


def test_a_misspelled_key_gets_did_you_mean(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["algo.eps_hihg=0.3"])
    assert str(e.value) == ("invalid config: command line: algo.eps_hihg: unknown key; did you mean algo.eps_high?")
    with pytest.raises(ConfigError, match=r"algo\.actor_lr: unknown key; did you mean optim\.actor_lr\?"):
        load_config(overrides=["algo.actor_lr=1e-6"])  # the right name in another section
    with pytest.raises(ConfigError, match=r"learnr: unknown key; did you mean learner\?"):
        load_config([_write(tmp_path, "a.toml", "[learnr]\nx = 1\n")])
    with pytest.raises(ConfigError, match=r"asynk: unknown key; did you mean async\?"):  # the section's TOML name
        load_config(overrides=["asynk.max_staleness=2"])
    with pytest.raises(ConfigError) as e:
        load_config(overrides=["algo.zzzzzz=1"])
    assert "did you mean" not in str(e.value)


def test_an_error_names_its_source(tmp_path):
    f = _write(tmp_path, "ten.toml", "[task]\nmax_ops = 10\n")
    with pytest.raises(ConfigError) as e:  # a check across sections; each value from its own place
        load_config([f], ["rollout.max_response_tokens=40"])
    assert str(e.value).startswith(f"invalid config: {f}, command line: <root>: ")
    with pytest.raises(ConfigError) as e:  # both values of a section's check from the command line
        load_config(overrides=["task.min_ops=9", "task.max_ops=2"])
    assert str(e.value).startswith("invalid config: command line: task: ")
    with pytest.raises(ConfigError) as e:  # the file set the section; only the value the message names counts
        load_config([_write(tmp_path, "eps.toml", "[algo]\neps_low = 0.2\nalpha = 1.0\n")], ["algo.eps_high=0.1"])
    assert str(e.value).startswith(f"invalid config: {tmp_path / 'eps.toml'}, command line: algo: ")
    with pytest.raises(ConfigError) as e:
        load_config([f], ["task.max_ops=abc"])
    assert str(e.value).startswith("invalid config: command line: task.max_ops: ")
    with pytest.raises(ConfigError) as e:  # the other value is a default: the one that was set is named
        load_config(overrides=["rollout.max_response_tokens=40"])
    assert str(e.value).startswith("invalid config: command line: <root>: ")


def test_a_config_path_that_is_not_a_file(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path}: a directory, not a config file$"):
        load_config([tmp_path])
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="bin.toml: not a text file"):
        load_config([tmp_path / "bin.toml"])
