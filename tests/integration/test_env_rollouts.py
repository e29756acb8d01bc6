"""Multi-turn rollouts (``rollout.env``, issue 51 items 1-2) on the session's real engines and the real tool sandbox:
token in / token out across three turns, on the lock-step engine and on the continuous one (a version loaded while
the conversations wait for their environment), a tool that hangs or crashes is an observation and the run goes on,
the chat template's turn delta, and the one-process trainer's two updates on a tool task."""

from __future__ import annotations

import json
import threading
import time
from array import array
from pathlib import Path

import msgspec
import pytest
from conftest import TINY_TEST_OVERRIDES

from async_vapo.rollout.env import EnvLimits, EnvRunner, PythonToolEnv, code_block
from async_vapo.rollout.generate import RAW_OBSERVATION, EnvConversation, PromptEncoder, generate_groups, make_group
from async_vapo.types import Group, enc_hook
from async_vapo.verify.tool_sandbox import unavailable_reason

SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2-135m-instruct"
needs_sandbox = pytest.mark.skipif(unavailable_reason() is not None, reason=f"tool sandbox: {unavailable_reason()}")


class ThreeTurns:
    """Answers each model turn with a short observation; the third model turn ends the sample."""

    def __init__(self) -> None:
        self.turn = 0

    def reset(self, problem):
        return None

    def step(self, text: str):
        self.turn += 1
        return (None, None, True) if self.turn >= 3 else (f"seen {self.turn}", None, False)


class HangThenCrash(PythonToolEnv):
    """The sandbox runs what the model 'wrote': an endless loop, then code that crashes; the third turn is graded."""

    CODE = ["while True:\n    pass\n", "import ctypes\nctypes.string_at(0)\n"]  # a hang, then a segfault

    def __init__(self) -> None:
        super().__init__(tool_seconds=1.0)

    def code_of(self, text: str) -> str | None:
        return self.CODE[self.tool_calls] if self.tool_calls < len(self.CODE) else None


class ToolOnce(PythonToolEnv):
    """A tool task for the trainer: the first turn's 'code' multiplies its length, then the model answers."""

    def __init__(self, cfg=None) -> None:
        super().__init__(cfg)

    def code_of(self, text: str) -> str | None:
        return f"print({len(text)} * 7)\n" if self.tool_calls == 0 else None


class Recording:
    """The engine, with every generate call's prompts and outputs kept (the engine itself runs)."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    @property
    def version(self) -> int:
        return self.engine.version

    def generate(self, prompts, **kw):
        outs = self.engine.generate(prompts, **kw)
        self.calls.append(([list(p) for p in prompts], [[list(s.token_ids) for s in o] for o in outs]))
        return outs


@pytest.fixture(scope="module")
def setup(tiny_cfg, tiny_base):
    from transformers import AutoTokenizer

    from async_vapo.tasks.sampler import load_task

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    train_set, _ = load_task(tiny_cfg)
    return tok, PromptEncoder.from_config(tiny_cfg, tok), train_set


def _generate(engine, encoder, problems, env_cls, *, n=3, max_tokens=100, max_turns=4) -> list[Group]:
    return generate_groups(engine, encoder, problems, version=engine.version, n=n, temperature=1.0, top_p=1.0,
                           max_tokens=max_tokens, stop_token_ids=encoder.stop_ids, seed=3,
                           env=EnvRunner(env_cls, EnvLimits(max_turns=max_turns, tool_output_tokens=64)))


def test_the_trainers_tokens_are_the_engines_across_three_turns(vllm_engine, setup, tiny_base):
    from async_vapo.learner.vapo import make_rollout_batch
    from async_vapo.models.rl import load_policy

    tok, encoder, problems = setup
    vllm_engine.load_weights(load_policy(tiny_base).state_dict(), 0)  # the base model, whatever a test left loaded
    engine = Recording(vllm_engine)
    groups = _generate(engine, encoder, problems[:4], ThreeTurns)
    assert len(engine.calls) == 3  # one engine call per turn, every open conversation in it
    fed, produced = {}, {}  # what the engine was given after the first turn -> what it produced
    for prompts, outs in engine.calls[1:]:
        for p, o in zip(prompts, outs, strict=True):
            fed[tuple(p)] = o[0]
    three = 0
    for g_i, g in enumerate(groups):
        for s_i, s in enumerate(g.samples):
            ids, cuts = list(s.response_ids), [0] + [a + n for a, n in s.env_spans]
            assert ids[: s.env_spans[0][0] if s.env_spans else len(ids)] == engine.calls[0][1][g_i][s_i][: len(ids)]
            for j, (start, count) in enumerate(s.env_spans):  # each observation: the raw template's delta alone
                assert ids[start: start + count] == tok(RAW_OBSERVATION.format(observation=f"seen {j + 1}"),
                                                        add_special_tokens=False).input_ids
                given = tuple(g.prompt_ids) + tuple(ids[: cuts[j + 1]])  # the whole sequence so far, as it was
                produced = fed[given]
                end = s.env_spans[j + 1][0] if j + 1 < len(s.env_spans) else len(ids)
                assert ids[cuts[j + 1]: end] == produced[: end - cuts[j + 1]]
            assert len(s.behavior_logprobs) == len(ids)
            three += len(s.env_spans) == 2
            if s.finish_reason == "stop":
                assert len(s.env_spans) == 2  # three model turns unless the budget ran out
    assert three >= 6, f"only {three} of 12 samples reached their third turn"
    # the trainer's rows, through the wire: byte for byte the engine's sequence
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(groups, enc_hook=enc_hook), type=list[Group])
    batch = make_rollout_batch(back, tok.pad_token_id)
    row = 0
    for g in groups:
        for s in g.samples:
            seq = batch.tokens.input_ids[row][batch.tokens.attention_mask[row].bool()].tolist()
            assert array("i", seq).tobytes() == (g.prompt_ids + s.response_ids).tobytes()
            mask = batch.tokens.response_mask[row].tolist()
            for start, count in s.env_spans:
                assert mask[start: start + count] == [0] * count
            row += 1


def test_a_weight_update_between_turns_is_in_the_version_spans(vllm_engine, setup, tiny_base):
    """A version loaded between the first and the second turn (a real load into the engine): the second turn's
    tokens carry it, the first turn's and the observation's the old one; the group is as old as its oldest token."""
    from async_vapo.models.rl import load_policy
    from async_vapo.types import spans_error

    tok, encoder, problems = setup
    state = load_policy(tiny_base).state_dict()
    v0 = vllm_engine.version

    class UpdateAfterFirstTurn(Recording):
        def generate(self, prompts, **kw):
            if len(self.calls) == 1:
                self.engine.load_weights(state, v0 + 1)
            return super().generate(prompts, **kw)

    try:
        groups = _generate(UpdateAfterFirstTurn(vllm_engine), encoder, problems[:2], ThreeTurns, n=2, max_turns=2)
    finally:
        vllm_engine.load_weights(state, v0)
    seen = 0
    for g in groups:
        assert g.version == v0
        for i, s in enumerate(g.samples):
            assert spans_error(s, g.version) is None
            if s.env_spans:
                second = s.env_spans[0][0] + s.env_spans[0][1]
                assert [tuple(x) for x in s.version_spans] == [(v0, 0), (v0 + 1, second)]
                assert g.token_versions(i) == [v0] * second + [v0 + 1] * (len(s.response_ids) - second)
                seen += 1
    assert seen >= 2


def test_the_continuous_engine_runs_conversations_and_a_version_lands_between_turns(continuous_engine, setup,
                                                                                     tiny_base):
    """``rollout.generation = "continuous"`` with an environment: each sample's turns are requests of their own and
    its environment steps in a worker thread. While every conversation waits in its first step, a version is loaded
    (``keep``): the second and third turns carry it. Token in, token out: each model token's log-prob is the learner's
    on the whole sequence as the trainer sees it (observations included), and each observation is its delta alone."""
    import torch

    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import load_policy, make_token_batch, response_logits
    from async_vapo.types import env_spans_error, spans_error

    tok, encoder, problems = setup
    engine, policy = continuous_engine, load_policy(tiny_base)
    state = policy.state_dict()
    engine.weight_update = "keep"
    engine.load_weights(state, 100)
    gate, lock, waiting = threading.Event(), threading.Lock(), []

    class Gated(ThreeTurns):
        def step(self, text: str):
            if self.turn == 0:
                with lock:
                    waiting.append(self)
                assert gate.wait(120), "the test never opened the gate"
            return super().step(text)

    for key in engine.in_flight_keys():  # what another test of the session left running, or finished and unread
        engine.abort(key)
    while engine.finished(0.0):
        pass
    runner = EnvRunner(Gated, EnvLimits(max_turns=3, tool_output_tokens=64))
    prompt_ids, convs = EnvConversation.group(encoder, runner, problems[0], 3, 100, encoder.stop_ids)
    engine.submit("conversations", prompt_ids, n=3, temperature=1.0, top_p=1.0, max_tokens=100,
                  stop_token_ids=encoder.stop_ids, seed=5, conversations=convs)
    deadline = time.monotonic() + 120
    while len(waiting) < 3 and time.monotonic() < deadline:
        assert not engine.finished(0.05), "the group shipped before its environments answered"
    assert len(waiting) == 3, "the conversations never reached their environment"
    assert engine.in_flight() == 3  # a sample waiting for its environment is in flight
    engine.apply_weights(101, lambda: engine.load_weights(state, 101))
    gate.set()
    (fg,) = engine.finished(120.0)
    assert fg.error is None and engine.in_flight() == 0
    g = make_group(problems[0], fg.prompt_ids, fg.samples, fg.submitted_version)
    assert g.version == 100 and list(g.prompt_ids) == prompt_ids
    three = 0
    for i, s in enumerate(g.samples):
        assert spans_error(s, g.version) is None and env_spans_error(s) is None
        ids = list(s.response_ids)
        if not s.env_spans:  # its first turn ran out of the budget: graded as it is, one version
            assert s.finish_reason == "length" and g.token_versions(i) == [100] * len(ids)
            continue
        for j, (start, count) in enumerate(s.env_spans):
            assert ids[start: start + count] == tok(RAW_OBSERVATION.format(observation=f"seen {j + 1}"),
                                                    add_special_tokens=False).input_ids
        second = s.env_spans[0][0] + s.env_spans[0][1]
        assert [tuple(x) for x in s.version_spans] == [(100, 0), (101, second)]
        assert g.token_versions(i) == [100] * second + [101] * (len(ids) - second)
        batch = make_token_batch([list(prompt_ids)], [ids], tok.pad_token_id)
        with torch.no_grad():
            ref = logprobs_from_logits(response_logits(policy, batch, 1.0), batch.response_ids)[0]
        model = torch.ones(len(ids), dtype=torch.bool)
        for start, count in s.env_spans:
            model[start: start + count] = False
        torch.testing.assert_close(torch.tensor(s.behavior_logprobs)[model], ref[model], atol=1e-3, rtol=0)
        three += len(s.env_spans) == 2
    assert three >= 1, "no sample reached its third turn"


def test_the_python_tool_runs_a_code_block(tiny_cfg):
    if unavailable_reason() is not None:
        pytest.skip(f"tool sandbox: {unavailable_reason()}")
    env = PythonToolEnv(tiny_cfg)
    assert code_block("I will compute.\n```python\nprint(123 * 45)\n```\n") == "print(123 * 45)\n"
    assert env.step("I will compute.\n```python\nprint(123 * 45)\n```\n") == ("5535", None, False)
    obs, reward, done = env.step("```python\nprint('before')\nraise ValueError('boom')\n```")
    assert obs.startswith("before\nTraceback") and obs.endswith("ValueError: boom\n[status: exit code 1]")
    assert (reward, done) == (None, False)
    assert env.step("The answer is 5535.") == (None, None, True)
    assert (env.tool_calls, env.tool_errors) == (2, 1)


@needs_sandbox
def test_a_tool_that_hangs_or_crashes_is_an_observation_and_the_run_goes_on(vllm_engine, setup):
    tok, encoder, problems = setup
    (g,) = _generate(vllm_engine, encoder, problems[:1], HangThenCrash, n=3, max_tokens=110)

    def turn_ids(text: str) -> list[int]:
        return tok(RAW_OBSERVATION.format(observation=text), add_special_tokens=False).input_ids
    both = 0
    for s in g.samples:
        assert s.tool_calls == 2 and s.tool_errors == 2 and s.tool_seconds >= 1.0
        obs = [list(s.response_ids[a: a + n]) for a, n in s.env_spans]
        assert obs[0] == turn_ids("[status: timeout after 1 s]")  # the hang came back as the next turn ...
        assert len(s.response_ids) > s.env_spans[0][0] + s.env_spans[0][1]  # ... and the model went on
        if len(obs) == 2:  # the crash too, unless it left no room in the 110-token budget (then: length)
            assert obs[1] == turn_ids("[status: killed by SIGSEGV]")
            both += 1
        else:
            assert s.finish_reason == "length"
        assert s.verdict == "unverified"  # graded later, as any response
    assert both >= 1


def test_a_chat_turn_is_the_templates_delta_alone():
    """SmolLM2's chat template: the prompt's tokens, the model's turn (ending with <|im_end|>) and the observation
    turn's delta read as the template's rendering of the whole conversation; nothing before is tokenised again."""
    from transformers import AutoTokenizer

    if not (SMOLLM2 / "tokenizer_config.json").is_file():
        pytest.skip("no SmolLM2 tokenizer in models/")
    tok = AutoTokenizer.from_pretrained(str(SMOLLM2))
    enc = PromptEncoder(tok, prompt_format="chat")
    msgs = [{"role": "user", "content": "What is 123 * 45?"}]
    prompt = enc.encode_messages(msgs)
    turn = tok("```python\nprint(123 * 45)\n```", add_special_tokens=False).input_ids + [tok.convert_tokens_to_ids(
        "<|im_end|>")]
    obs = enc.observation_ids("5535", turn[-1])
    full = msgs + [{"role": "assistant", "content": "```python\nprint(123 * 45)\n```"}]
    role = "tool" if "tool" in tok.decode(obs) else "user"
    want = tok.apply_chat_template(full + [{"role": role, "content": "5535"}], add_generation_prompt=True,
                                   tokenize=False)
    assert tok.decode(prompt + turn + obs) == want
    assert obs == tok(want[len(tok.decode(prompt + turn)):], add_special_tokens=False).input_ids


@needs_sandbox
def test_the_trainer_runs_two_updates_on_a_tool_task(tiny_cfg, vllm_engine, tmp_path):
    from async_vapo.config import load_config
    from async_vapo.trainer import train

    cfg = load_config([], TINY_TEST_OVERRIDES + [
        f"model.cache_dir={tiny_cfg.model.cache_dir}", f"train.output_dir={tmp_path}/{{name}}",
        f"rollout.env={__name__}:ToolOnce", "rollout.env_tool_seconds=3", "train.total_steps=2",
        "train.eval_every=2", "train.checkpoint_every=100", "rollout.max_response_tokens=60"])
    summary = train(cfg, progress=False, engine=vllm_engine)
    rows = [json.loads(x) for x in (cfg.run_dir() / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train_rows] == [1, 2] and summary["steps"] == 2
    for r in train_rows:
        assert r["rollout/tool_calls"] > 0.5 and r["rollout/turns"] > 1.5, r  # most samples called the tool
        assert r["rollout/tool_errors"] == 0.0 and r["rollout/env_tokens"] > 0
    evals = [r for r in rows if r["kind"] == "eval"]
    assert evals and all("eval/tool_calls" in e for e in evals)


@needs_sandbox
@pytest.mark.engines  # its engine is a fixture taken by name: on the engines' worker with the others
@pytest.mark.parametrize("generation", ["lockstep", "continuous"])
def test_the_services_pipeline_trains_on_a_tool_task(tiny_cfg, tiny_base, tmp_path, request, generation):
    """Rollout (rollout.env, lock-step or on the continuous engine) -> verifier -> replay -> learner in one process
    over the in-process transport: two updates on multi-turn tool samples, their environment tokens and tool counters
    through the wire."""
    import threading
    import time

    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.services.context import SERVICES, make_context
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    total = 2
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           f"train.total_steps={total}", f"train.eval_every={total}", "train.checkpoint_every=0",
                           f"rollout.env={__name__}:ToolOnce", "rollout.env_tool_seconds=3",
                           "rollout.max_response_tokens=60", "async.max_staleness=1", "cluster.replay.fsync=never",
                           "cluster.wire.batch_poll_s=0.05", "cluster.wire.heartbeat_s=0.2",
                           f"rollout.generation={generation}"])
    vllm_engine = request.getfixturevalue("continuous_engine" if generation == "continuous" else "vllm_engine")
    if generation == "continuous":
        vllm_engine.weight_update = "keep"
    run_dir = tmp_path / "run"
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    base_state = load_policy(tiny_base).state_dict()
    vllm_engine.load_weights(base_state, 0)
    ctxs = {s: make_context(s, cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
            for s in SERVICES}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    replay, verifier = ReplayService(ctxs["replay"], transport), VerifierService(ctxs["verifier"], transport)
    learner = LearnerService(ctxs["learner"], transport)
    rollout = RolloutService(ctxs["rollout"], transport, vllm_engine, tok, train_set, eval_set,
                             pretrain_batches=cfg.algo.value_pretrain_steps)
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    threads = [threading.Thread(target=replay.run, daemon=True),
               threading.Thread(target=verifier.run, args=(decode,), daemon=True),
               threading.Thread(target=learner.run, daemon=True), threading.Thread(target=rollout.run, daemon=True)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "DONE").exists():
            assert time.monotonic() < deadline, "the pipeline did not train in time"
            assert all(t.is_alive() for t in threads), "a service loop died"
            time.sleep(0.2)
        counters = {}
        for metric in ctxs["rollout"].metrics.registry.collect():
            for sample in metric.samples:
                counters[sample.name] = sample.value
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(60)
        for svc in (rollout, learner, verifier, replay):
            svc.close()
        transport.close()
        vllm_engine.load_weights(base_state, 0)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["version"] for r in train] == [1, 2]
    for r in train:  # the groups the learner trained on carried their environment tokens and tool counters
        assert r["rollout/tool_calls"] > 0.5 and r["rollout/env_tokens"] > 0 and r["rollout/turns"] > 1.5, r
        assert "rollout/verdict_unverified" not in r  # every sample was graded
    assert counters["async_vapo_rollout_tool_calls_total"] >= 16
    assert counters["async_vapo_rollout_model_turns_total"] > counters["async_vapo_rollout_generated_samples_total"]
