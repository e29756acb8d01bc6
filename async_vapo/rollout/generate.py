"""Groups from the engine: prompts in, version-stamped groups of G samples out; scoring and evaluation.

One implementation serves the one-process trainer (generate, then score in the same process), the
rollout service (generate; the verifier service scores) and evaluation (both, on the held-out split).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from async_vapo.config import Config
from async_vapo.metrics.passk import default_ks, difficulty, summarize
from async_vapo.metrics.rows import group_stats  # noqa: F401  (re-exported: the rollout's own row metrics)
from async_vapo.rollout.env import TRUNCATED_NOTE, Environment, EnvRunner
from async_vapo.tasks.task import Problem
from async_vapo.types import Group, Trajectory

logger = logging.getLogger(__name__)

ENV_VERDICT = "env"
"""The verdict of a sample whose environment gave its reward (the verifier does not grade it)."""

TRUNCATED_WARN_FRAC = 0.10
"""Share of held-out responses cut at ``rollout.max_response_tokens`` above which the first evaluation warns."""


class PromptEncoder:
    """Problem -> prompt token ids, cached by uid; and response ids -> text for the verifier.

    ``raw``: ``template`` filled with the problem's prompt, tokenised. ``chat``: the tokenizer's chat template
    over the problem's own messages (or one user message made from ``template``), a system message first when
    ``system_prompt`` is given and the problem has none, the assistant's turn opened; the rendered text is
    tokenised without adding special tokens again (the template writes them)."""

    def __init__(self, tokenizer, template: str = "{prompt}", *, prompt_format: str = "raw",
                 system_prompt: str | None = None, tools: list[dict] | None = None):
        if prompt_format not in ("raw", "chat"):
            raise ValueError(f"prompt_format must be 'raw' or 'chat', got {prompt_format!r}")
        if prompt_format == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("task.prompt_format = 'chat', but the tokenizer has no chat template: use 'raw' "
                             "(with task.prompt_template) or a model directory whose tokenizer_config.json has one")
        self.tokenizer, self.template = tokenizer, template
        self.prompt_format, self.system_prompt = prompt_format, system_prompt
        self.tools = tools
        """``tools=`` of every chat prompt (the python tool's description where the template calls tools its own way:
        ``rollout.env.prompt_tools``); None: none."""
        self.cache: dict[str, list[int]] = {}
        self._delta: _ChatDelta | None = None
        self._markers: dict[int, str] | None = None  # decode_turn's kept special tokens, id -> text
        self._stop_texts: list[str] | None = None  # observation_ids' end-of-turn tokens, as text

    @classmethod
    def from_config(cls, cfg: Config, tokenizer) -> PromptEncoder:
        from async_vapo.rollout.env import prompt_tools

        t = cfg.task
        return cls(tokenizer, t.prompt_template, prompt_format=t.prompt_format, system_prompt=t.system_prompt,
                   tools=prompt_tools(cfg, tokenizer))

    def messages(self, p: Problem) -> list[dict[str, str]]:
        """The chat ``p`` is rendered from (``chat`` format)."""
        msgs = [{"role": r, "content": c} for r, c in p.messages] if p.messages else [
            {"role": "user", "content": self.template.format(prompt=p.prompt)}]
        if self.system_prompt is not None and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def render(self, p: Problem) -> str:
        """The prompt text the model sees."""
        if self.prompt_format == "raw":
            return self.template.format(prompt=p.prompt)
        return self.tokenizer.apply_chat_template(self.messages(p), add_generation_prompt=True, tokenize=False,
                                                  **self._tools())

    def __call__(self, p: Problem) -> list[int]:
        ids = self.cache.get(p.uid)
        if ids is None:
            if self.prompt_format == "raw":
                ids = self.tokenizer(self.render(p)).input_ids
            else:
                ids = self.tokenizer(self.render(p), add_special_tokens=False).input_ids
            self.cache[p.uid] = ids
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def decode_turn(self, ids: Sequence[int]) -> str:
        """A model turn's text as an environment reads it: :meth:`decode`, but the tool-call markers of the chat
        templates' formats (``rollout.env.TOOL_MARKERS``: Llama's ``<|python_tag|>``, Mistral's ``[TOOL_CALLS]``)
        kept where the tokenizer has them as special tokens, which :meth:`decode` drops."""
        if self._markers is None:
            from async_vapo.rollout.env import TOOL_MARKERS

            special = set(self.tokenizer.all_special_tokens) | {
                t.content for t in getattr(self.tokenizer, "added_tokens_decoder", {}).values() if t.special}
            self._markers = {self.tokenizer.convert_tokens_to_ids(m): m for m in TOOL_MARKERS if m in special}
        if not self._markers:
            return self.decode(ids)
        parts, start = [], 0
        for i, t in enumerate(ids):
            if t in self._markers:
                parts += [self.decode(ids[start:i]), self._markers[t]]
                start = i + 1
        return "".join(parts) + self.decode(ids[start:])

    def encode_messages(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of an environment's first messages (``chat`` format only), the assistant's turn opened."""
        if self.prompt_format != "chat":
            raise ValueError("an environment's reset returned messages, which need task.prompt_format = 'chat' "
                             "(a raw prompt is the task's own: return None)")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False,
                                                  **self._tools())
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _tools(self) -> dict:
        return {"tools": self.tools} if self.tools else {}

    def observation_ids(self, text: str, ended_with: int | None) -> list[int]:
        """The tokens of one environment turn holding ``text``, to append after a model turn whose last token is
        ``ended_with`` (a stop token; None: none), the model's next turn opened: ``raw``, a fenced ``output`` block
        (:data:`RAW_OBSERVATION`); ``chat``, the chat template's delta for that turn alone (its ``tool`` role where
        the template renders one, else ``user``), less the end-of-turn token the model already wrote: the template's
        own, or another stop token in its place (Llama's ``<|eom_id|>`` after a tool call, where the template
        closes a turn with ``<|eot_id|>``). Only these new tokens are tokenised; nothing before them is."""
        if self.prompt_format == "raw":
            return self.tokenizer(RAW_OBSERVATION.format(observation=text), add_special_tokens=False).input_ids
        if self._delta is None:
            self._delta = _ChatDelta.of(self.tokenizer)
        closing = self._delta.closing
        if ended_with is not None:
            if self._stop_texts is None:  # once: stop_ids reads the generation config from disk
                self._stop_texts = [t for t in (self.tokenizer.decode([i]) for i in self.stop_ids) if t]
            stops = [self.tokenizer.decode([ended_with]), *self._stop_texts]
            closing = next((closing[len(s):] for s in stops if s and closing.startswith(s)), closing)
        return self.tokenizer(closing + self._delta.turn(text), add_special_tokens=False).input_ids

    def longest(self, problems: Sequence[Problem]) -> int:
        """Tokens of the longest prompt (sizes the engine's ``max_model_len``)."""
        return max(len(self(p)) for p in problems)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def stop_ids(self) -> list[int]:
        """Where a response ends, stated explicitly to the engine (it runs without a tokenizer): the tokenizer's
        EOS and every ``eos_token_id`` of the model's ``generation_config.json`` (instruct models end a turn
        with a token other than their tokenizer's EOS, e.g. ``<|im_end|>``)."""
        ids = stop_token_ids(self.tokenizer)
        if not ids:
            raise ValueError("the tokenizer and generation config name no EOS token: responses would never stop")
        return ids


RAW_OBSERVATION = "\n```output\n{observation}\n```\n"
"""An environment turn after a raw prompt's model turn."""
_SLOT = "xOBSERVATIONx"  # survives a template's escaping (tojson) of the turn's content
_TOOL_CALL_ID = "call00000"
"""The ``tool_call_id`` of the observation turn: templates that render it (Mistral's: nine alphanumerics) refuse a
tool turn without one; the others ignore it."""
_TWO_TURNS = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\x00A\x00"}]


@dataclass(frozen=True)
class _ChatDelta:
    """How the chat template appends an observation turn to a conversation, found once per tokenizer as the
    difference of two renderings of a two-message conversation, so that the template alone decides the markers:
    ``closing``, the text it writes after an assistant message's content (its end-of-turn marker); ``turn(text)``,
    the text of one observation turn holding ``text`` with the next assistant turn opened (rendered with ``text``
    itself, so a template that escapes the content escapes it). The ``tool`` role where the template renders it with
    its content, else ``user``."""

    tokenizer: object
    head: str
    closing: str
    message: dict

    @classmethod
    def of(cls, tokenizer) -> _ChatDelta:
        head = tokenizer.apply_chat_template(_TWO_TURNS, tokenize=False)
        for role in ("tool", "user"):
            message = {"role": role} | ({"tool_call_id": _TOOL_CALL_ID} if role == "tool" else {})
            delta = cls(tokenizer, head, head[head.index("\x00A\x00") + 3:], message)
            try:
                if _SLOT in delta.turn(_SLOT):
                    return delta
            except Exception:  # noqa: BLE001 - a template that refuses the role: try the next
                continue
        raise ValueError("the tokenizer's chat template renders neither a tool nor a user turn after an assistant "
                         "turn as a suffix of the conversation: rollout.env cannot append a turn without "
                         "re-tokenising")

    def turn(self, text: str) -> str:
        full = self.tokenizer.apply_chat_template(_TWO_TURNS + [self.message | {"content": text}],
                                                  add_generation_prompt=True, tokenize=False)
        if not full.startswith(self.head):
            raise ValueError("the chat template rendered an earlier turn differently once a turn was appended")
        return full[len(self.head):]


def stop_token_ids(tokenizer, model_dir: str | None = None) -> list[int]:
    """The tokenizer's EOS id and the ``eos_token_id`` (an int or a list) of ``generation_config.json`` in
    ``model_dir`` (default: the directory the tokenizer was loaded from), without duplicates."""
    import json
    from pathlib import Path

    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    path = Path(model_dir or getattr(tokenizer, "name_or_path", "") or ".") / "generation_config.json"
    if path.is_file():
        eos = json.loads(path.read_text()).get("eos_token_id")
        ids += [eos] if isinstance(eos, int) else [i for i in (eos or []) if isinstance(i, int)]
    return list(dict.fromkeys(ids))


def generate_groups(engine, encode: Callable[[Problem], list[int]], problems: Sequence[Problem], *, version: int,
                    n: int, temperature: float, top_p: float, max_tokens: int, stop_token_ids: Sequence[int],
                    seed: int | None = None, env: EnvRunner | None = None) -> list[Group]:
    """The unscored groups of ``problems`` (G = ``n`` samples each), stamped with ``version``: the weights
    the engine served when the call started. ``env`` (``rollout.env``; ``encode`` then a :class:`PromptEncoder`):
    each sample is a multi-turn conversation with its own environment (:func:`generate_env_groups`)."""
    if env is not None:
        return generate_env_groups(engine, encode, problems, env, version=version, n=n, temperature=temperature,
                                   top_p=top_p, max_tokens=max_tokens, stop_token_ids=stop_token_ids, seed=seed)
    prompts = [encode(p) for p in problems]
    outs = engine.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                           stop_token_ids=list(stop_token_ids), seed=seed)
    return [make_group(p, ids, samples, version) for p, ids, samples in zip(problems, prompts, outs, strict=True)]


@dataclass
class _Turns:
    """A finished conversation as ``make_group`` reads an engine's sample, with what the environment added."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    version_spans: list[tuple[int, int]]
    env_spans: list[tuple[int, int]]
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    reward: float | None = None
    """The environment's reward (None: the verifier grades the final model turn)."""


@dataclass
class _Conversation:
    """One sample of a multi-turn rollout as it grows: the tokens the engine saw after the prompt, in order."""

    env: Environment
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # (version, first index): Trajectory.version_spans
    env_spans: list[tuple[int, int]] = field(default_factory=list)
    finish: str = "length"
    turns: int = 0
    done: bool = False
    reward: float | None = None

    def add_model_turn(self, sample, version: int, budget: int) -> list[int]:
        """Append the engine's ``sample`` (at most ``budget`` tokens of it: a call's token cap is the largest
        budget of its prompts); its ids."""
        ids, offset = list(sample.token_ids)[:budget], len(self.ids)
        for v, first in [tuple(x) for x in getattr(sample, "version_spans", None) or ()] or [(version, 0)]:
            if first < len(ids) and (not self.spans or self.spans[-1][0] != v):
                self.spans.append((v, offset + first))
        self.ids += ids
        self.logprobs += list(sample.logprobs)[: len(ids)]
        self.finish = "length" if len(ids) < len(sample.token_ids) else sample.finish_reason
        self.turns += 1
        self.done = not ids
        return ids

    def add_env_turn(self, ids: list[int]) -> None:
        self.env_spans.append((len(self.ids), len(ids)))
        self.ids += ids
        self.logprobs += [0.0] * len(ids)  # not the policy's: never read (Trajectory.env_spans)

    def result(self) -> _Turns:
        env = self.env
        return _Turns(self.ids, self.logprobs, self.finish, self.spans, self.env_spans,
                      int(getattr(env, "tool_calls", 0)), int(getattr(env, "tool_errors", 0)),
                      float(getattr(env, "tool_seconds", 0.0)), self.reward)


def _step_env(c: _Conversation, turn: list[int], encoder: PromptEncoder, limits, max_tokens: int,
              stop_ids: Sequence[int], prefix: str = "") -> None:
    """The environment's answer to the model's latest ``turn`` (the first one after ``prefix``, the prompt's
    end): end ``c``, or append the observation's tokens."""
    obs, c.reward, done = c.env.step((prefix if c.turns == 1 else "") + encoder.decode_turn(turn))
    if done or obs is None or c.finish != "stop" or c.turns >= limits.max_turns:
        c.done = True  # a turn cut by the token budget, or the last turn allowed, is graded as it is
        return
    tok = encoder.tokenizer
    obs_ids = tok(obs, add_special_tokens=False).input_ids
    if len(obs_ids) > limits.tool_output_tokens:
        obs = tok.decode(obs_ids[: limits.tool_output_tokens]) + TRUNCATED_NOTE
    ids = encoder.observation_ids(obs, turn[-1] if turn[-1] in stop_ids else None)
    if len(c.ids) + len(ids) >= max_tokens:  # no room left for a model token after it
        c.done, c.finish = True, "length"
        return
    c.add_env_turn(ids)


def generate_env_groups(engine, encoder: PromptEncoder, problems: Sequence[Problem], env: EnvRunner, *,
                        version: int, n: int, temperature: float, top_p: float, max_tokens: int,
                        stop_token_ids: Sequence[int], seed: int | None = None) -> list[Group]:
    """Multi-turn groups (``rollout.env``, ``async_vapo.rollout.env``): one environment per sample; the engine
    generates every open conversation's next turn in one call (prompt plus the sample's tokens so far, exactly as
    they were: token in, token out), the environment answers each, until every sample is done. ``max_tokens``
    bounds a sample's tokens after the prompt, the environment's included. Each sample keeps the version of every
    model token (a version loaded between two turns starts a new span)."""
    prompts, convs = [], []
    for p in problems:
        ids, row = _env_prompt(encoder, env, p, n)
        prompts.append(ids)
        convs.append(row)
    todo = [(i, c) for i, row in enumerate(convs) for c in row]
    outs = engine.generate(prompts, n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                           stop_token_ids=list(stop_token_ids), seed=seed)
    samples = [s for out in outs for s in out]
    turn = 0
    while todo:
        for (_, c), sample in zip(todo, samples, strict=True):
            ids = c.add_model_turn(sample, version, max_tokens - len(c.ids))
            if not c.done:
                _step_env(c, ids, encoder, env.limits, max_tokens, stop_token_ids, env.first_turn_prefix)
        todo = [(i, c) for i, c in todo if not c.done]
        if not todo:
            break
        turn += 1
        version = engine.version
        budget = max(max_tokens - len(c.ids) for _, c in todo)
        outs = engine.generate([list(prompts[i]) + c.ids for i, c in todo], n=1, temperature=temperature,
                               top_p=top_p, max_tokens=budget, stop_token_ids=list(stop_token_ids),
                               seed=None if seed is None else seed + 7919 * turn)
        samples = [out[0] for out in outs]
    return [make_group(p, ids, [c.result() for c in row], version)
            for p, ids, row in zip(problems, prompts, convs, strict=True)]


def _env_prompt(encoder: PromptEncoder, env: EnvRunner, problem: Problem, n: int
                ) -> tuple[list[int], list[_Conversation]]:
    """The prompt ids of ``problem``'s group (its environments' first messages, or the problem's own prompt, then
    ``rollout.env_first_turn_prefix``) and its ``n`` conversations, each with its environment reset."""
    row = [_Conversation(env.make()) for _ in range(n)]
    first = [c.env.reset(problem) for c in row]
    if any(m != first[0] for m in first):
        raise ValueError(f"the environments of problem {problem.uid!r} started with different messages: a group's "
                         "samples share one prompt")
    prefix = encoder.tokenizer(env.first_turn_prefix, add_special_tokens=False).input_ids  # ends every prompt
    return (encoder(problem) if first[0] is None else encoder.encode_messages(first[0])) + prefix, row


class EnvConversation:
    """One sample of a multi-turn rollout on the continuous engine (``ContinuousEngine.submit``'s
    ``conversations``): the engine generates a turn, :meth:`add` appends it and runs the environment's step (in the
    caller's thread: a tool call blocks), :meth:`next` says what the next request is (the prompt plus every token so
    far, exactly as they were: token in, token out) or that the sample is done, and :meth:`result` is the finished
    sample as ``make_group`` reads it. The same conversation and limits as :func:`generate_env_groups`'s, one
    sample at a time instead of one engine call per turn for all."""

    def __init__(self, conversation: _Conversation, prompt_ids: Sequence[int], encoder: PromptEncoder,
                 env: EnvRunner, max_tokens: int, stop_ids: Sequence[int]):
        self.c, self.prompt_ids, self.encoder, self.env = conversation, list(prompt_ids), encoder, env
        self.max_tokens, self.stop_ids = max_tokens, list(stop_ids)

    @classmethod
    def group(cls, encoder: PromptEncoder, env: EnvRunner, problem: Problem, n: int, max_tokens: int,
              stop_ids: Sequence[int]) -> tuple[list[int], list[EnvConversation]]:
        """The prompt ids of ``problem``'s group and its ``n`` conversations."""
        ids, row = _env_prompt(encoder, env, problem, n)
        return ids, [cls(c, ids, encoder, env, max_tokens, stop_ids) for c in row]

    def add(self, sample, version: int) -> None:
        """Append the engine's ``sample`` of the next turn (generated from :meth:`next`'s request) and answer it."""
        ids = self.c.add_model_turn(sample, version, self.max_tokens - len(self.c.ids))
        if not self.c.done:
            _step_env(self.c, ids, self.encoder, self.env.limits, self.max_tokens, self.stop_ids,
                      self.env.first_turn_prefix)

    def next(self) -> tuple[list[int], int] | None:
        """The next turn's request, ``(prompt ids, max tokens)``; None once the sample is done."""
        return None if self.c.done else (self.prompt_ids + self.c.ids, self.max_tokens - len(self.c.ids))

    def result(self) -> _Turns:
        return self.c.result()


def final_turn(sample: Trajectory) -> Sequence[int]:
    """The model's last turn of ``sample`` (the whole response when it has one turn): what the verifier grades."""
    end = sample.env_spans[-1][0] + sample.env_spans[-1][1] if sample.env_spans else 0
    return sample.response_ids[end:]


def make_group(problem: Problem, prompt_ids: Sequence[int], samples: Sequence, version: int) -> Group:
    """The unscored group of ``problem`` from the engine's samples (``rollout.engine.Sample``, or a multi-turn
    conversation's result with its environment's spans, tool counts and reward). A sample that records the versions
    of its tokens (``version_spans``, an engine that updates weights in flight) keeps them when they are more than
    ``version`` alone; the group's version is its oldest token's (``async_vapo.types``)."""
    spans = [[tuple(x) for x in getattr(s, "version_spans", None) or ()] or [(version, 0)] for s in samples]
    oldest = min(sp[0][0] for sp in spans) if spans else version
    extra = json.dumps(problem.extra, separators=(",", ":"), ensure_ascii=False) if problem.extra else ""
    group = Group(uid=problem.uid, prompt=problem.prompt, answer=problem.answer, prompt_ids=prompt_ids, version=oldest,
                  extra=extra,
                  samples=[Trajectory(response_ids=s.token_ids, behavior_logprobs=s.logprobs,
                                      finish_reason=s.finish_reason,
                                      version_spans=[] if sp == [(oldest, 0)] else sp)
                           for s, sp in zip(samples, spans, strict=True)])
    for t, s in zip(group.samples, samples, strict=True):
        if isinstance(s, _Turns):  # a multi-turn sample: what its environment added
            t.env_spans, t.tool_calls, t.tool_errors, t.tool_seconds = (s.env_spans, s.tool_calls, s.tool_errors,
                                                                        s.tool_seconds)
            if s.reward is not None:  # the environment's reward stands; the verifier grades the others
                t.reward, t.correct, t.verdict = float(s.reward), s.reward > 0, ENV_VERDICT
    return group


def score_groups(groups: Sequence[Group], verifier, decode: Callable[[Sequence[int]], str], *,
                 budget_s: float | None = None) -> list:
    """Grade every sample with ``verifier`` (a VerifierPool), filling reward, correct and verdict in place;
    returns the pool's results in sample order. ``budget_s``: wall-clock budget of the whole call (None: the
    pool's default). Each response goes with its group's prompt and record fields, for a reward function that takes
    them (``async_vapo.verify.reward_fn``; the pool sends them to its workers only then). A multi-turn sample's last
    model turn is graded (:func:`final_turn`); one its environment rewarded (verdict ``env``) is left as it is."""
    items = [(decode(final_turn(s)), g.answer, {"prompt": g.prompt, "extra": g.extra})
             for g in groups for s in g.samples if s.verdict != ENV_VERDICT]
    results = verifier.verify(items, budget_s=budget_s) if items else []
    it = iter(results)
    for g in groups:
        for s in g.samples:
            if s.verdict == ENV_VERDICT:
                continue
            r = next(it)
            s.reward, s.correct, s.verdict = r.reward, r.correct, r.reason
    return results


@dataclass
class Rollout:
    """Generation + verification of groups with one engine and one verifier pool, in this process."""

    cfg: Config
    engine: object
    verifier: object
    encoder: PromptEncoder
    env: EnvRunner | None = field(default=None, init=False)
    """``rollout.env``'s runner (None: single-turn), made once here."""

    def __post_init__(self) -> None:
        self.env = EnvRunner.from_config(self.cfg)

    def groups(self, problems: Sequence[Problem], *, n: int, temperature: float, top_p: float,
               seed: int | None = None) -> tuple[list[Group], dict[str, float]]:
        t0 = time.perf_counter()
        groups = generate_groups(self.engine, self.encoder, problems, version=self.engine.version, n=n,
                                 temperature=temperature, top_p=top_p, max_tokens=self.cfg.rollout.max_response_tokens,
                                 stop_token_ids=self.encoder.stop_ids, seed=seed, env=self.env)
        t1 = time.perf_counter()
        score_groups(groups, self.verifier, self.encoder.decode)
        t2 = time.perf_counter()
        tokens = sum(len(s.response_ids) for g in groups for s in g.samples)
        return groups, {"time/generate_s": t1 - t0, "time/verify_s": t2 - t1, "rollout/tokens": tokens,
                        "rollout/tokens_per_s": tokens / max(t1 - t0, 1e-9)}


@dataclass
class Evaluation:
    """What :func:`run_evaluation` found: metrics, and the scored groups in problem order."""

    metrics: dict[str, float]
    problems: Sequence[Problem]
    groups: list[Group]

    def examples(self, decode: Callable[[Sequence[int]], str], count: int = 8) -> list[dict]:
        """The first sample of the first ``count`` problems, decoded (``samples.jsonl`` of a run)."""
        return [{"prompt": g.prompt, "answer": g.answer, "response": decode(g.samples[0].response_ids),
                 "verdict": g.samples[0].verdict} for g in self.groups[:count]]

    def records(self, decode: Callable[[Sequence[int]], str]) -> Iterator[dict]:
        """One record per sample: the problem, its difficulty, the response and the verifier's verdict."""
        for p, g in zip(self.problems, self.groups, strict=True):
            for j, s in enumerate(g.samples):
                yield {"uid": p.uid, "sample": j, "difficulty": difficulty(p.meta), "prompt": p.prompt,
                       "answer": p.answer, "response": decode(s.response_ids), "verdict": s.verdict,
                       "correct": bool(s.correct), "reward": s.reward, "finish_reason": s.finish_reason,
                       "response_tokens": len(s.response_ids)}


def run_evaluation(rollout: Rollout, problems: Sequence[Problem], cfg: Config, *, n: int | None = None,
                   ks: Sequence[int] | None = None) -> Evaluation:
    """Sample ``n`` responses per problem (default ``rollout.eval_samples``) at the evaluation temperature and
    top-p, grade them with the rollout's verifier; ``eval/*`` metrics: the samples' statistics
    (:func:`group_stats`), accuracy, avg@n and pass@k for ``ks`` (default 1, 2, 4, ... and n), each by
    difficulty where the task has one (``metrics.evaluation``)."""
    r = cfg.rollout
    n = n or r.eval_samples
    groups, timing = rollout.groups(problems, n=n, temperature=r.eval_temperature, top_p=r.eval_top_p, seed=r.seed)
    out = group_stats(groups, "eval") | {"time/eval_s": timing["time/generate_s"] + timing["time/verify_s"]}
    out |= summarize([[bool(s.correct) for s in g.samples] for g in groups], default_ks(n) if ks is None else ks,
                     labels=[difficulty(p.meta) for p in problems])
    return Evaluation(out, problems, groups)


def critic_heldout_groups(rollout: Rollout, ev: Evaluation, cfg: Config) -> tuple[list[Group], dict[str, float]]:
    """The held-out responses a critic is scored on after the evaluation ``ev``: its own groups, or with
    ``rollout.critic_eval_problems`` fresh ones to the first that many of its problems, ``critic_eval_samples`` each,
    at the training temperature and top-p (the policy the critic values; their seconds in ``time/critic_eval_s``)."""
    r = cfg.rollout
    if not r.critic_eval_problems:
        return [g for g in ev.groups if g.samples], {}
    t0 = time.perf_counter()
    groups, _ = rollout.groups(ev.problems[:r.critic_eval_problems], n=r.critic_eval_samples,
                               temperature=r.temperature, top_p=r.top_p, seed=r.seed)
    return [g for g in groups if g.samples], {"time/critic_eval_s": time.perf_counter() - t0}


def evaluate(rollout: Rollout, problems: Sequence[Problem], cfg: Config) -> tuple[dict[str, float], list[dict]]:
    """In-training held-out evaluation: :func:`run_evaluation`'s metrics and a few decoded examples."""
    ev = run_evaluation(rollout, problems, cfg)
    return ev.metrics, ev.examples(rollout.encoder.decode)


def warn_if_truncated(metrics: Mapping[str, float], cfg: Config, log: logging.Logger | None = None) -> str | None:
    """Warn (on ``log``, default this module's logger) when more than :data:`TRUNCATED_WARN_FRAC` of an evaluation's
    responses hit the cap (``eval/truncated_frac``, ``finish_reason == "length"``), naming the settings that help;
    the warning, or None at or below the threshold. Called on the first evaluation by the one-process trainer and the
    rollout service: a response cut before its answer scores nothing, and RL learns slowly from such groups."""
    frac = metrics.get("eval/truncated_frac", 0.0)
    if not frac > TRUNCATED_WARN_FRAC:
        return None
    t = cfg.task
    shots = ("task.few_shot with task.few_shot_path or task.few_shot_solution_key (worked examples of a short "
             "answer before each question)" if t.kind == "files" else
             "task.few_shot (worked examples of a short answer before each question)")
    text = (f"{frac:.0%} of the held-out responses hit the {cfg.rollout.max_response_tokens}-token cap (finish_reason "
            f"'length', eval/truncated_frac {frac:.3f} > {TRUNCATED_WARN_FRAC}): a response cut before its answer "
            f"scores nothing. What helps: a larger rollout.max_response_tokens; {shots}, now {t.shots}; "
            f"task.system_prompt asking for a short answer (prompt_format 'chat'), now "
            f"{'set' if t.system_prompt else 'unset'}; stop tokens: the end-of-turn id among eos_token_id in the "
            "model's generation_config.json (the engine stops at those and the tokenizer's EOS)")
    (log or logger).warning("%s", text)
    return text
