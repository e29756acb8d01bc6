"""``rollout.env_first_turn_prefix`` (issue 51 item 4): text that opens the model's first turn of a multi-turn sample,
e.g. a code fence. Its tokens end the prompt the engine is given (not the model's, not trained on), the
environment's first step reads it before the turn's text, later turns are the model's alone; unset, nothing
changes. On the session's real engine."""

from __future__ import annotations

import pytest

from async_vapo.config import load_config
from async_vapo.rollout.env import EnvLimits, EnvRunner
from async_vapo.rollout.generate import PromptEncoder, generate_groups

PREFIX = "```python\nprint("


class Texts:
    """Records the text of each turn it is given; answers the first two, the third ends the sample."""

    seen: list[list[str]] = []

    def __init__(self) -> None:
        self.texts: list[str] = []
        Texts.seen.append(self.texts)

    def reset(self, problem):
        return None

    def step(self, text: str):
        self.texts.append(text)
        return (None, None, True) if len(self.texts) >= 3 else ("ok", None, False)


class Recording:
    """The engine, with every generate call's prompts kept (the engine itself runs)."""

    def __init__(self, engine) -> None:
        self.engine, self.prompts = engine, []

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts, **kw):
        self.prompts.append([list(p) for p in prompts])
        return self.engine.generate(prompts, **kw)


def _run(engine, encoder, problems, prefix):
    Texts.seen = []
    rec = Recording(engine)
    groups = generate_groups(rec, encoder, problems, version=engine.version, n=2, temperature=1.0, top_p=1.0,
                             max_tokens=80, stop_token_ids=encoder.stop_ids, seed=5,
                             env=EnvRunner(Texts, EnvLimits(max_turns=3, tool_output_tokens=16), prefix))
    return rec, groups


def test_the_prefix_ends_the_prompt_and_opens_the_first_turn(vllm_engine, tiny_cfg, tiny_base):
    from transformers import AutoTokenizer

    from async_vapo.tasks.sampler import load_task

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    encoder = PromptEncoder.from_config(tiny_cfg, tok)
    problems = load_task(tiny_cfg)[0][:3]
    prefix_ids = tok(PREFIX, add_special_tokens=False).input_ids
    rec, groups = _run(vllm_engine, encoder, problems, PREFIX)
    # the first call's prompts, and the groups' prompts the learner reads: the task's prompt, then the prefix
    assert rec.prompts[0] == [encoder(p) + prefix_ids for p in problems]
    assert [list(g.prompt_ids) for g in groups] == [encoder(p) + prefix_ids for p in problems]
    # later calls continue that sequence: prompt + prefix + the sample's tokens so far
    for prompts in rec.prompts[1:]:
        assert all(any(p[: len(q)] == q for q in rec.prompts[0]) for p in prompts)
    # the environment reads the prefix before the first turn's text only; the response holds the model's tokens
    turns = 0
    for texts, s in zip(Texts.seen, [s for g in groups for s in g.samples], strict=True):
        first_end = s.env_spans[0][0] if s.env_spans else len(s.response_ids)
        assert texts[0] == PREFIX + encoder.decode(s.response_ids[:first_end])
        for j, text in enumerate(texts[1:]):
            start = s.env_spans[j][0] + s.env_spans[j][1]
            end = s.env_spans[j + 1][0] if j + 1 < len(s.env_spans) else len(s.response_ids)
            assert text == encoder.decode(s.response_ids[start:end])
            turns += 1
    assert turns >= 2, "too few samples reached a second turn to check it"
    # unset (the default): the prompts are the task's own, the first turn's text the model's alone
    rec, groups = _run(vllm_engine, encoder, problems, "")
    assert rec.prompts[0] == [encoder(p) for p in problems]
    s = groups[0].samples[0]
    assert Texts.seen[0][0] == encoder.decode(s.response_ids[: s.env_spans[0][0] if s.env_spans else None])


def test_the_setting_needs_an_environment_and_reaches_the_runner():
    with pytest.raises(ValueError, match="env_first_turn_prefix"):
        load_config([], ["rollout.env_first_turn_prefix=```python"])
    cfg = load_config([], [f"rollout.env={__name__}:Texts", "rollout.env_first_turn_prefix=```python"])
    assert EnvRunner.from_config(cfg).first_turn_prefix == "```python"
    plain = load_config([], [f"rollout.env={__name__}:Texts"])
    assert EnvRunner.from_config(plain).first_turn_prefix == ""
    # the engine's context fits the prefix too (its tokens end every prompt): at most one per byte, and one more
    from async_vapo.rollout.engine import EngineSpec

    with_prefix = EngineSpec.from_config(cfg, "m", longest_prompt=50).max_model_len
    assert with_prefix - EngineSpec.from_config(plain, "m", longest_prompt=50).max_model_len == len("```python") + 1
