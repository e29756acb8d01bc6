"""One row source, several sinks: every metric row of a run goes to ``metrics.jsonl`` and to each tracker turned on.

A row is the dict the learner loop writes per update (``kind`` "train"), per value-pretraining step ("pretrain"),
and the dict an evaluation writes ("eval": rollout 0 in the cluster, the trainer in one process). The writer of a
row is made in one place, :func:`open_row_writer`, from the config: the JSONL file always, then TensorBoard
(``metrics.tensorboard``), Weights & Biases (``metrics.wandb``) and, in a service, its Prometheus gauges.

Invariants
- ``metrics.jsonl`` is the record: it is written first, so a tracker that fails to log a row never loses it there.
- Trackers receive the row's numbers only (ints, floats, bools as 0/1); a non-finite float is "no value at this step"
  (``null`` in the JSONL) and is left out, as are strings and nested values.
- Names (tags) are the row's keys, namespaced by kind: a train row's keys are already namespaced (``actor/``,
  ``critic/``, ``rollout/``, ``time/``) and stay as they are; a pretrain or eval row's key gets ``pretrain/`` or
  ``eval/`` in front unless it has it already (``critic/value_loss`` of pretraining is ``pretrain/critic/value_loss``,
  ``eval/accuracy`` stays). The x-axis is the row's ``step`` (the policy version for eval rows).
- The trackers' packages are imported only when turned on; a turned-on tracker whose package is missing is an error
  at construction that names the extra to install, never a silent no-op.
"""

from __future__ import annotations

import math
import os
import socket
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from async_vapo.metrics.jsonl import JsonlWriter

if TYPE_CHECKING:
    from async_vapo.config.schema import Config
    from async_vapo.metrics.prom import ServiceMetrics
    from async_vapo.types import Group

__all__ = ["PrometheusCriticSink", "PrometheusEvalSink", "RowSink", "RowWriter", "TensorBoardSink", "WandbSink",
           "group_stats", "open_row_writer", "scalars", "tag"]

EVAL_GAUGES = {"eval/accuracy": "eval_accuracy", "eval/response_length": "eval_response_length_tokens"}
"""Eval row key -> rollout gauge (``async_vapo_rollout_<name>``) set by :class:`PrometheusEvalSink`."""


class RowSink(Protocol):
    """Where rows go. ``write`` takes one row; ``close`` flushes and releases (idempotent)."""

    def write(self, row: dict) -> None: ...

    def close(self) -> None: ...


def tag(kind: str, key: str) -> str:
    """The tracker name of ``key`` in a row of ``kind`` (see the module docstring)."""
    if kind == "train" or key.startswith(f"{kind}/"):
        return key
    return f"{kind}/{key}"


def scalars(row: dict) -> tuple[str, int, dict[str, float]]:
    """``(kind, step, {tag: value})`` of ``row``: its finite numbers, ``kind`` and ``step`` left out."""
    kind = str(row.get("kind", "train"))
    step = int(row.get("step", 0))
    out: dict[str, float] = {}
    for key, value in row.items():
        if key in ("kind", "step") or not isinstance(value, int | float):
            continue
        value = float(value)
        if math.isfinite(value):
            out[tag(kind, key)] = value
    return kind, step, out


class RowWriter:
    """Fans each row out to its sinks, in order (the JSONL file first). ``path`` is the JSONL file's."""

    def __init__(self, sinks: Sequence[RowSink], path: Path | None = None):
        self.sinks = list(sinks)
        self.path = path

    def write(self, row: dict) -> None:
        for sink in self.sinks:
            sink.write(row)

    def close(self) -> None:
        errors = []
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:  # close every sink; report the first failure after
                errors.append(e)
        if errors:
            raise errors[0]


def _missing(what: str, package: str) -> RuntimeError:
    return RuntimeError(f"metrics.{what} = true needs the {package} package: pip install -e '.[trackers]' "
                        f"(or pip install {package}), or set metrics.{what} = false")


class TensorBoardSink:
    """Scalars in ``log_dir`` (an event file of this process's own, as TensorBoard names them: several processes
    may write the same directory)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise _missing("tensorboard", "tensorboard") from e
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=30)

    def write(self, row: dict) -> None:
        _kind, step, values = scalars(row)
        for name, value in values.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbSink:
    """One W&B run of this process, under ``directory/wandb/``; runs of one training share the group ``group``.

    Each row is logged with its ``step`` as a value and every other name plotted against it (``define_metric``): W&B's
    own step must only grow, which pretraining (steps from 0) followed by training (steps from 0 again) would break."""

    def __init__(self, directory: Path, *, project: str, group: str, name: str, job_type: str, mode: str,
                 entity: str | None, config: dict | None = None):
        try:
            import wandb
        except ImportError as e:
            raise _missing("wandb", "wandb") from e
        directory.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=project, entity=entity, group=group, name=name, job_type=job_type,
                               mode=mode, dir=str(directory), config=config, reinit="create_new",
                               settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    @property
    def run_dir(self) -> Path:
        return Path(self._run.dir).parent

    def write(self, row: dict) -> None:
        _kind, step, values = scalars(row)
        self._run.log({"step": step, **values})

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class PrometheusEvalSink:
    """Sets the service's held-out gauges (:data:`EVAL_GAUGES`, and ``eval_policy_version``: the version they are of)
    from each eval row; other rows pass by. The gauges are declared in ``async_vapo.metrics.catalogue``."""

    def __init__(self, metrics: ServiceMetrics):
        self._gauges = {key: metrics.get(name) for key, name in EVAL_GAUGES.items()}
        self._version = metrics.get("eval_policy_version")

    def write(self, row: dict) -> None:
        if row.get("kind") != "eval":
            return
        for key, gauge in self._gauges.items():
            value = row.get(key)
            if isinstance(value, int | float) and math.isfinite(value):
                gauge.set(value)
        if isinstance(row.get("version"), int):
            self._version.set(row["version"])

    def close(self) -> None:
        pass


CRITIC_GAUGES = {"critic/heldout_ev": ("critic_heldout_explained_variance", "critic"),
                 "critic/heldout_ev_length_only": ("critic_heldout_explained_variance", "length_only"),
                 "critic/heldout_ev_slip_aware": ("critic_heldout_explained_variance", "slip_aware"),
                 "critic/heldout_ev_slip_aware_by_step": ("critic_heldout_explained_variance", "slip_aware_by_step"),
                 "critic/heldout_ev_prompt_mean": ("critic_heldout_explained_variance", "prompt_mean"),
                 "critic/heldout_ev_answer_aware": ("critic_heldout_explained_variance", "answer_aware"),
                 "critic/heldout_ev_before_decisive": ("critic_heldout_explained_variance", "critic_before_decisive"),
                 "critic/heldout_ev_after_decisive": ("critic_heldout_explained_variance", "critic_after_decisive"),
                 "critic/fresh_ev": ("critic_fresh_explained_variance", None)}
"""Row key -> learner gauge (and its ``value_function`` label) set by :class:`PrometheusCriticSink`."""


class PrometheusCriticSink:
    """Sets the learner's critic-quality gauges (:data:`CRITIC_GAUGES`) from every row that holds them (pretrain and
    train rows); NaN (undefined) is set as NaN, so a stale value does not pass for a current one."""

    def __init__(self, metrics: ServiceMetrics):
        self._gauges = {key: metrics.get(name) if label is None else metrics.get(name).labels(value_function=label)
                        for key, (name, label) in CRITIC_GAUGES.items()}

    def write(self, row: dict) -> None:
        for key, gauge in self._gauges.items():
            value = row.get(key)
            if isinstance(value, int | float):
                gauge.set(value)

    def close(self) -> None:
        pass


def open_row_writer(cfg: Config, path: Path, service_metrics: ServiceMetrics | None = None, *,
                    truncate: bool = False) -> RowWriter:
    """The row writer of a process: ``path`` (``RUN_DIR/metrics.jsonl``), then the trackers of ``cfg.metrics`` in
    ``path``'s directory, then, with a rollout's ``service_metrics``, its held-out gauges set from eval rows.
    ``service_metrics`` also names the process in W&B (its service; "trainer" without one)."""
    run_dir = path.parent
    m = cfg.metrics
    role = service_metrics.service if service_metrics is not None else "trainer"
    sinks: list[RowSink] = [JsonlWriter(path, truncate=truncate)]
    try:
        if m.tensorboard:
            sinks.append(TensorBoardSink(run_dir / "tensorboard"))
        if m.wandb:
            name = f"{role}-{socket.gethostname()}-{os.getpid()}"
            sinks.append(WandbSink(run_dir, project=m.wandb_project, entity=m.wandb_entity, group=cfg.train.name,
                                   name=name, job_type=role, mode=m.wandb_mode,
                                   config=cfg.model_dump(mode="json", by_alias=True)))
        if service_metrics is not None and service_metrics.service == "rollout":  # eval rows come from rollout 0
            sinks.append(PrometheusEvalSink(service_metrics))
        if service_metrics is not None and service_metrics.service == "learner":
            sinks.append(PrometheusCriticSink(service_metrics))
    except BaseException:
        RowWriter(sinks).close()
        raise
    return RowWriter(sinks, path)


def group_stats(groups: Sequence[Group], prefix: str) -> dict[str, float]:
    """Mean reward, accuracy, response length, truncated fraction and each non-plain verdict's fraction; with
    multi-turn samples also turns, tool calls, tool errors, tool seconds and environment tokens per sample."""
    samples = [s for g in groups for s in g.samples]
    n = max(len(samples), 1)
    out = {f"{prefix}/reward": sum(s.reward for s in samples) / n,
           f"{prefix}/accuracy": sum(s.correct for s in samples) / n,
           f"{prefix}/response_length": sum(len(s.response_ids) for s in samples) / n,
           f"{prefix}/truncated_frac": sum(s.finish_reason == "length" for s in samples) / n}
    verdicts: dict[str, int] = defaultdict(int)
    for s in samples:
        verdicts[s.verdict] += 1
    out.update({f"{prefix}/verdict_{k}": v / n for k, v in verdicts.items() if k not in ("correct", "incorrect")})
    if any(s.env_spans or s.tool_calls for s in samples):  # multi-turn rollouts (rollout.env): per sample
        out |= {f"{prefix}/turns": sum(len(s.env_spans) + 1 for s in samples) / n,
                f"{prefix}/tool_calls": sum(s.tool_calls for s in samples) / n,
                f"{prefix}/tool_errors": sum(s.tool_errors for s in samples) / n,
                f"{prefix}/tool_seconds": sum(s.tool_seconds for s in samples) / n,
                f"{prefix}/env_tokens": sum(c for s in samples for _, c in s.env_spans) / n}
    return out
