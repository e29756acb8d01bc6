"""Problems from local files: ``.jsonl``, ``.json`` (a list of objects), ``.parquet``, and a directory holding an
HF dataset written by ``datasets``' ``save_to_disk`` (read with ``load_from_disk`` when ``datasets`` is installed;
a ``DatasetDict`` is refused with its splits named, so that the path can name one of them).

Layouts recognised when no keys are given (decided from the first record, then required of all):

* flat: ``{"prompt": str, "answer": str}``;
* DAPO-Math-17k / verl: ``prompt`` is a list of chat messages (the last ``user`` message's content
  is the prompt, and the whole list is kept in ``Problem.messages`` for the chat template) and the answer
  is ``reward_model.ground_truth``;
* AIME: ``{"Problem" | "problem": str, "Answer" | "answer": str | int}``.

Explicit ``prompt_key`` / ``answer_key`` / ``messages_key`` (``task.prompt_key`` ... in the config) may be
dotted paths into nested objects (``"reward_model.ground_truth"``); a record without one of them is an error
that names the file, the record, the key and the fields the record has. ``messages_key`` names a chat message
list, kept in ``Problem.messages``; its last user message is the prompt unless ``prompt_key`` is given too. A
record's ``id``, ``ID`` or ``extra_info.index`` becomes its ``uid``; otherwise the uid is the prompt's hash
(:func:`~async_vapo.tasks.task.prompt_uid`), so duplicated prompts share a uid.

A record's extra fields (``Problem.extra``, what a reward function may take besides the response and the answer:
``async_vapo.verify.reward_fn``) are read when ``extra_keys`` asks for them: ``None`` every top-level field but the
prompt's and the messages' (a dotted key's field stays whole: verl's ``extra_info`` arrives as it is), a list of
keys (dotted paths allowed, each stored under the key as written) exactly those, ``()`` (the default) none. They
must encode as JSON in at most :data:`MAX_EXTRA_BYTES`: each group carries them to the verifier once, and each
response's check once more, so a record over that is an error naming its largest fields.

No record is ever skipped: a missing field, a wrong type, an empty prompt or answer, an invalid
JSON line or an empty file raises :class:`ProblemFileError` naming the file and the 1-based line
(JSONL: the physical line, blank lines counted), record (JSON) or row (Parquet). Blank JSONL lines
are not records. ``pyarrow`` is imported only for Parquet files.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from async_vapo.tasks.task import Problem, prompt_uid

PROMPT_KEYS = ("prompt", "problem", "Problem")
"""Prompt fields tried in order when ``prompt_key`` is not given."""
ANSWER_KEYS = ("answer", "Answer", "reward_model.ground_truth")
"""Answer fields tried in order when ``answer_key`` is not given."""
ID_KEYS = ("id", "ID", "extra_info.index")
"""Fields that, when present, become the problem's uid (first match wins)."""
DIFFICULTY_KEYS = ("difficulty", "level")
"""Record fields read as the problem's difficulty (``meta["difficulty"]``), first found wins."""

MAX_EXTRA_BYTES = 16 * 1024
"""The most a record's extra fields may take as JSON (UTF-8 bytes)."""

_PARQUET_BATCH_ROWS = 4096


class ProblemFileError(ValueError):
    """A problem file that cannot be read as problems; the message names the file and the record."""


_MISSING = object()


def _get(record: Mapping[str, Any], key: str) -> Any:
    """``record[key]``, else follow ``key`` as a dotted path; :data:`_MISSING` when absent."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _detect(record: Mapping[str, Any], candidates: tuple[str, ...], what: str, where: str) -> str:
    for key in candidates:
        if _get(record, key) is not _MISSING:
            return key
    raise ProblemFileError(
        f"{where}: no {what} field found (looked for {', '.join(map(repr, candidates))}; "
        f"the record's fields: {sorted(record)}); set task.{what}_key to name it"
    )


def _field(record: Mapping[str, Any], key: str, setting: str, where: str) -> Any:
    """``record``'s value at ``key``; a missing one names the key, the setting it came from and the fields found
    (those of the deepest object the dotted path reached), with the nearest one."""
    value = _get(record, key)
    if value is not _MISSING:
        return value
    found, reached = record, []
    for part in key.split(".")[:-1]:
        if not isinstance(found.get(part), Mapping):
            break
        found, reached = found[part], [*reached, part]
    fields = sorted(map(str, found))
    prefix = "".join(f"{r}." for r in reached)
    near = difflib.get_close_matches(key[len(prefix):], fields, n=1, cutoff=0.6)
    hint = f"; did you mean {prefix + near[0]!r}?" if near else ""
    of = f" of {'.'.join(reached)!r}" if reached else ""
    raise ProblemFileError(f"{where}: missing field {key!r} ({setting}); the fields{of} found: {fields}{hint}")


CHAT_ROLES = ("system", "user", "assistant", "tool")  # tool: a worked example's tool turn (rollout.env)


def _messages(value: Any, key: str, where: str) -> tuple[tuple[str, str], ...] | None:
    """A message list as ``(role, content)`` pairs (None for a plain prompt); every message checked."""
    if not isinstance(value, list):
        return None
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise ProblemFileError(f"{where}: field {key!r}: message {i} must be {{'role': one of {CHAT_ROLES}, "
                                   f"'content': str}}, got {m!r}"[:300])
        out.append((m["role"], m["content"]))
    return tuple(out)


def _prompt_text(value: Any, key: str, where: str) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        users = [m for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        if not users:
            raise ProblemFileError(f"{where}: field {key!r} is a message list without a 'user' message")
        text = users[-1].get("content")
        if not isinstance(text, str):
            raise ProblemFileError(
                f"{where}: field {key!r}: last user message content must be str, got {type(text).__name__}"
            )
    else:
        raise ProblemFileError(
            f"{where}: field {key!r} must be str or a list of chat messages, got {type(value).__name__}"
        )
    if not text.strip():
        raise ProblemFileError(f"{where}: field {key!r} is empty")
    return text


def _answer_text(value: Any, key: str, where: str) -> str:
    # bool is an int subclass but never a meaningful answer; floats would print as "3.0".
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ProblemFileError(f"{where}: field {key!r} must be str or int, got {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise ProblemFileError(f"{where}: field {key!r} is empty")
    return text


def _saved_dataset(path: Path) -> Iterator[tuple[int, str, Any]]:
    """The rows of an HF dataset directory written by ``save_to_disk``."""
    if not (path / "state.json").is_file() and not (path / "dataset_dict.json").is_file():
        raise ProblemFileError(f"{path}: a directory, but not a dataset written by datasets' save_to_disk (no "
                               "state.json or dataset_dict.json); give a .jsonl, .json or .parquet file")
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError:
        raise ProblemFileError(f"{path}: an HF dataset saved to disk; reading it needs the datasets package "
                               "(pip install datasets)") from None
    data = load_from_disk(str(path))
    if isinstance(data, DatasetDict):
        raise ProblemFileError(f"{path}: a dataset with splits {sorted(data)}; name one of them as the path "
                               f"(e.g. {path / sorted(data)[0]})")
    for row, record in enumerate(data, start=1):
        yield row, f"{path}: row {row}", record


def _records(path: Path, errors: list[str] | None = None) -> Iterator[tuple[int, str, Any]]:
    """``(number, location, record)`` in file order; records are not yet checked to be objects. ``errors``: an
    invalid JSONL line is appended there and skipped instead of raised."""
    suffix = path.suffix.lower()
    if not path.exists():
        raise ProblemFileError(f"{path}: no such file or directory")
    if path.is_dir():
        yield from _saved_dataset(path)
    elif suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    if errors is None:
                        raise ProblemFileError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from e
                    errors.append(f"{where}: invalid JSON: {e.msg} (column {e.colno})")
                    continue
                yield line_no, where, record
    elif suffix == ".json":
        text = path.read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            hint = " (one object per line? name the file .jsonl)" if e.msg == "Extra data" else ""
            raise ProblemFileError(f"{path}:{e.lineno}: invalid JSON: {e.msg}{hint}") from e
        if not isinstance(data, list):
            raise ProblemFileError(f"{path}: expected a JSON list of objects, got {type(data).__name__}")
        for i, record in enumerate(data, start=1):
            yield i, f"{path}: record {i}", record
    elif suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"reading {path} needs pyarrow (pip install pyarrow)") from e
        row = 0
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for record in batch.to_pylist():
                row += 1
                yield row, f"{path}: row {row}", record
    else:
        raise ProblemFileError(
            f"{path}: unknown extension {path.suffix!r}; expected .jsonl, .json, .parquet or a directory written "
            "by datasets' save_to_disk"
        )


def load_problems(
    path: str | Path,
    *,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    messages_key: str | None = None,
    limit: int | None = None,
    extra_keys: Sequence[str] | None = (),
) -> list[Problem]:
    """Every problem in ``path`` in file order (the first ``limit`` when given; reading stops there).

    ``meta`` holds ``path`` and ``row`` (the 1-based line, record or row number), and ``difficulty`` when the
    record has a ``difficulty`` or ``level`` field (a string or an integer): evaluation reports by it.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    problems: list[Problem] = []
    for problem in _problems(path, prompt_key, answer_key, messages_key, None, extra_keys):
        problems.append(problem)
        if limit is not None and len(problems) >= limit:
            break
    if not problems:
        raise ProblemFileError(f"{path}: no problems (empty file)")
    return problems


def check_problems(
    path: str | Path,
    *,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    messages_key: str | None = None,
    extra_keys: Sequence[str] | None = (),
) -> tuple[list[Problem], list[str]]:
    """Every record of ``path`` read as :func:`load_problems` reads it, but each bad record (or invalid JSONL line)
    is one message and the reading goes on: the problems read and the messages, in file order (``async-vapo
    check``). A file that cannot be read at all (missing, unknown extension, not a JSON list) is one message."""
    path = Path(path)
    errors: list[str] = []
    try:
        problems = list(_problems(path, prompt_key, answer_key, messages_key, errors, extra_keys))
    except (ProblemFileError, ImportError) as e:
        return [], [*errors, str(e)]
    if not problems and not errors:
        errors.append(f"{path}: no problems (empty file)")
    return problems, errors


def _problems(path: Path, prompt_key: str | None, answer_key: str | None, messages_key: str | None,
              errors: list[str] | None, extra_keys: Sequence[str] | None = ()) -> Iterator[Problem]:
    """The problems of ``path`` in file order; a bad record raises, or with ``errors`` is appended there and
    skipped. Keys not given are detected from the first record that has one of the candidates."""
    detected = "detected from the first record"
    prompt_setting = "task.prompt_key" if prompt_key is not None else detected
    answer_setting = "task.answer_key" if answer_key is not None else detected
    for row, where, record in _records(path, errors):
        try:
            if not isinstance(record, Mapping):
                raise ProblemFileError(f"{where}: expected a JSON object, got {type(record).__name__}")
            messages = None
            if messages_key is not None:
                messages = _messages(_field(record, messages_key, "task.messages_key", where), messages_key, where)
                if messages is None:
                    raise ProblemFileError(f"{where}: field {messages_key!r} (task.messages_key) must be a list of "
                                           f"chat messages, got {type(_get(record, messages_key)).__name__}")
            if prompt_key is None and messages_key is None:
                prompt_key = _detect(record, PROMPT_KEYS, "prompt", where)
            if answer_key is None:
                answer_key = _detect(record, ANSWER_KEYS, "answer", where)
            source = prompt_key or messages_key
            value = (_get(record, messages_key) if prompt_key is None
                     else _field(record, prompt_key, prompt_setting, where))
            prompt = _prompt_text(value, source, where)
            answer = _answer_text(_field(record, answer_key, answer_setting, where), answer_key, where)
            if messages is None:
                messages = _messages(value, source, where)
            extra = _extra(record, extra_keys, (prompt_key, messages_key), where)
        except ProblemFileError as e:
            if errors is None:
                raise
            errors.append(str(e))
            continue
        uid = next(
            (str(v) for v in (_get(record, k) for k in ID_KEYS) if v is not _MISSING and v is not None),
            prompt_uid(prompt),
        )
        meta = {"path": str(path), "row": row}
        level = next((v for v in (record.get(k) for k in DIFFICULTY_KEYS) if isinstance(v, str | int)), None)
        if level is not None and not isinstance(level, bool):
            meta["difficulty"] = level
        yield Problem(uid=uid, prompt=prompt, answer=answer, meta=meta, messages=messages, extra=extra)


def _extra(record: Mapping[str, Any], keys: Sequence[str] | None, used: tuple[str | None, ...],
           where: str) -> dict[str, Any]:
    """The record's extra fields as ``keys`` selects them (see the module docstring), checked to encode as JSON
    within :data:`MAX_EXTRA_BYTES`."""
    if keys is None:
        out = {k: v for k, v in record.items() if k not in used}
    else:
        out = {k: _field(record, k, "task.extra_keys", where) for k in keys}
    if not out:
        return {}
    sizes = {}
    for k, v in out.items():
        try:
            sizes[k] = len(json.dumps(v, ensure_ascii=False).encode())
        except (TypeError, ValueError) as e:
            raise ProblemFileError(f"{where}: extra field {k!r} does not encode as JSON ({e}); name the fields the "
                                   "reward function takes in task.extra_keys") from None
    total = len(json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode())
    if total > MAX_EXTRA_BYTES:
        largest = ", ".join(f"{k!r} {n} B" for k, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
        raise ProblemFileError(f"{where}: the record's extra fields take {total} bytes as JSON, above the "
                               f"{MAX_EXTRA_BYTES} a problem carries to the verifier (largest: {largest}); name the "
                               "fields the reward function takes in task.extra_keys")
    return out
