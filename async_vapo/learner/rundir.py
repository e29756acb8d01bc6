"""Which run directory a run writes to, and whether it resumes: one rule for ``async-vapo train`` and
``deploy/start_cluster.sh`` (so for ``make train`` and ``make cluster``).

A run directory holds one run. A second start never appends a new run's rows to an old ``metrics.jsonl`` and
never overwrites its checkpoints. The config names a directory D (``train.output_dir``). The rule looks at
the newest of D, D-2, D-3, ... that exists, call it L:

* L holds no run (no ``metrics.jsonl`` row and no checkpoint): the run starts there.
* L's run can be continued: it was made by the same app (``run.json``), with the same config up to
  :data:`IGNORED` (where to write, how long to run, how often to evaluate and checkpoint, the cluster's
  plumbing), it has a checkpoint, and its newest checkpoint is below ``train.total_steps``. It resumes from
  that newest checkpoint: :func:`latest_checkpoint`, the one a restarted learner resumes from. A finished run
  continues the same way when ``train.total_steps`` is raised.
* Otherwise (finished, another config, another app, or stopped before its first checkpoint), a new directory:
  the first free D-k.

``mode = "new"`` always takes a directory that holds no run. ``mode = "resume"`` resumes L or fails and says why.
Each start and resume is appended to ``run.json``, and :class:`RunPlan.message` says on the terminal which it was.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from async_vapo.config import Config

IGNORED = ("train.output_dir", "train.name", "train.total_steps", "train.max_minutes", "train.eval_every",
           "train.checkpoint_every", "train.threads", "model.cache_dir", "async.rollout_devices",
           "async.learner_devices", "cluster.", "metrics.")
"""Config keys (a trailing dot: a whole section) that may differ between a run and its continuation."""

Mode = Literal["auto", "new", "resume"]
App = Literal["train", "cluster"]
APP_COMMAND = {"train": "async-vapo train (make train)", "cluster": "deploy/start_cluster.sh (make cluster)"}


class RunDirError(ValueError):
    """A run cannot be resumed as asked."""


def checkpoint_dirs(run_dir: Path, resumable: bool = True) -> list[tuple[int, Path]]:
    """(step, directory) of the run's checkpoints (``checkpoints/step_N``; not a ``step_N.tmp`` being written), by step;
    ``resumable``: only those with their ``learner_state.pt`` (not pruned to weights by ``train.keep_checkpoints``)."""
    return sorted((int(p.name.split("_")[1]), p) for p in (Path(run_dir) / "checkpoints").glob("step_*")
                  if p.name.split("_")[1].isdigit() and (not resumable or (p / "learner_state.pt").exists()))


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest complete checkpoint (``checkpoints/step_N`` with its ``learner_state.pt``), or None."""
    steps = checkpoint_dirs(run_dir)
    return steps[-1][1] if steps else None


WEIGHTS = ("policy", "critic", "policy_adapter", "hf_meta")
"""What a pruned checkpoint keeps with ``train.keep_weights``: the HF weights and what ``async-vapo export`` reads."""


def prune_checkpoints(run_dir: Path, keep: int, keep_weights: bool = True) -> list[Path]:
    """``train.keep_checkpoints``: every resumable checkpoint (``checkpoints/step_N`` with its ``learner_state.pt``)
    older than the newest ``keep`` loses its resume state; with ``keep_weights`` and HF weights in it (an unsharded
    learner's ``policy/`` or ``policy_adapter/``) it keeps :data:`WEIGHTS`, otherwise it is deleted whole. The
    resume state goes first, so a prune cut short leaves no checkpoint that looks resumable and is not. Returns the
    checkpoints pruned; ``keep`` 0 prunes nothing."""
    import shutil

    if keep <= 0:
        return []
    pruned = []
    for _, path in checkpoint_dirs(run_dir)[:-keep]:
        (path / "learner_state.pt").unlink()
        weights = keep_weights and any((path / d).is_dir() for d in ("policy", "policy_adapter"))
        if not weights:
            shutil.rmtree(path)
        else:
            for child in path.iterdir():
                if child.name not in WEIGHTS:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
        pruned.append(path)
    return pruned


def holds_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a run's results: a metrics row or a checkpoint."""
    metrics = run_dir / "metrics.jsonl"
    has_rows = metrics.is_file() and metrics.stat().st_size > 0
    return has_rows or any((run_dir / "checkpoints").glob("step_*"))


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_differences(old: dict, new: dict) -> list[str]:
    """``key: old -> new`` for every key (outside :data:`IGNORED`) whose value differs between two resolved
    configs (``config.resolved.json``)."""
    a, b = _flat(old), _flat(new)
    out = []
    for key in sorted(set(a) | set(b)):
        if any(key == i or (i.endswith(".") and key.startswith(i)) for i in IGNORED):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out.append(f"{key}: {a.get(key, '<unset>')!r} -> {b.get(key, '<unset>')!r}")
    return out


def run_dirs(base: Path) -> list[Path]:
    """``base`` and its existing ``base-k`` siblings, in k order."""
    found = [(1, base)] if base.exists() else []
    if base.parent.is_dir():
        pat = re.compile(re.escape(base.name) + r"-(\d+)$")
        found += [(int(m.group(1)), p) for p in base.parent.iterdir() if (m := pat.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)] or [base]


def _next_free(base: Path) -> Path:
    k = max([1] + [int(p.name.rsplit("-", 1)[1]) for p in run_dirs(base) if p != base]) + 1
    while Path(f"{base}-{k}").exists():
        k += 1
    return Path(f"{base}-{k}")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[1])


@dataclass(frozen=True)
class RunPlan:
    run_dir: Path
    resume: Path | None
    """The checkpoint to resume from; None: a new run."""
    message: str
    """What happens, for the terminal."""

    @property
    def would(self) -> str:
        """The message as a dry run says it: what a start would do ("would start a new run in ...")."""
        return self.message.replace("starting a new run", "would start a new run").replace("resuming ", "would resume ")


def why_not_resumable(run_dir: Path, cfg: Config, app: App) -> str | None:
    """None when the run in ``run_dir`` can continue under ``cfg`` with ``app``; else the reason."""
    meta = _read_json(run_dir / "run.json") or {}
    if meta.get("app") and meta["app"] != app:
        return f"it is a run of {APP_COMMAND[meta['app']]}"
    old = _read_json(run_dir / "config.resolved.json")
    if old is None:
        return "it has no readable config.resolved.json"
    diff = config_differences(old, cfg.model_dump(mode="json", by_alias=True))
    if diff:
        more = f", and {len(diff) - 3} more" if len(diff) > 3 else ""
        return "it was run with another config (" + "; ".join(diff[:3]) + more + ")"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return ("it stopped before its first checkpoint (train.checkpoint_every = "
                f"{old.get('train', {}).get('checkpoint_every', '?')})")
    if _step(ckpt) >= cfg.train.total_steps:
        return (f"it is finished ({_step(ckpt)} of train.total_steps = {cfg.train.total_steps} updates; raise "
                "train.total_steps to continue it)")
    return None


def plan_run(cfg: Config, app: App, mode: Mode = "auto", run_dir: Path | None = None) -> RunPlan:
    """Where the run of ``cfg`` goes and whether it resumes (the module docstring's rule). ``run_dir``: the
    directory asked for (default: the config's)."""
    base = Path(run_dir if run_dir is not None else cfg.run_dir())
    last = run_dirs(base)[-1]
    if not holds_run(last):
        if mode == "resume":
            raise RunDirError(f"nothing to resume: {last} holds no run")
        return RunPlan(last, None, f"starting a new run in {last}")
    why = why_not_resumable(last, cfg, app)
    if mode == "resume":
        if why is not None:
            raise RunDirError(f"cannot resume the run in {last}: {why}")
    if mode == "auto" and why is None:
        ckpt = latest_checkpoint(last)
        return RunPlan(last, ckpt, f"resuming the run in {last} from {ckpt.relative_to(last)} "
                                   f"({_step(ckpt)} of {cfg.train.total_steps} updates done; same config)")
    if mode == "resume":
        ckpt = latest_checkpoint(last)
        return RunPlan(last, ckpt, f"resuming the run in {last} from {ckpt.relative_to(last)}")
    new = _next_free(base)
    reason = "a new run was asked for" if mode == "new" else why
    return RunPlan(new, None, f"{last} holds a run that is kept as it is ({reason}): starting a new run in {new}")


def claim(plan: RunPlan, cfg: Config, app: App) -> Config:
    """Create the plan's directory, record this start in its ``run.json`` and return ``cfg`` writing there."""
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    meta = _read_json(plan.run_dir / "run.json") or {"app": app, "starts": []}
    meta.setdefault("app", app)
    meta.setdefault("starts", []).append({"utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "pid": os.getpid(),
                                          "resume": None if plan.resume is None else str(plan.resume),
                                          "host": host_record()})
    tmp = plan.run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.rename(plan.run_dir / "run.json")
    if Path(cfg.run_dir()).resolve() != plan.run_dir.resolve():
        cfg = cfg.model_copy(deep=True)
        cfg.train.output_dir = str(plan.run_dir)
    return cfg


CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_tile")
"""The instruction sets that change which kernels torch and vLLM's CPU backend run."""


def host_record() -> dict:
    """What the machine was, for comparing timings across runs: the CPU's model, its logical CPUs and the instruction
    sets of :data:`CPU_FEATURES` it has, memory, and when it booted (a new boot time can be a new host). Fields that
    cannot be read are left out; this never raises."""
    out: dict = {"cpus": os.cpu_count()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
        flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
        if model:
            out["cpu"] = model.group(1).strip()
        if flags:
            have = set(flags.group(1).split())
            out["cpu_features"] = [f for f in CPU_FEATURES if f in have]
    except OSError:
        pass
    try:
        mem = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if mem:
            out["mem_gib"] = round(int(mem.group(1)) / 2**20, 1)
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
        out["booted_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - uptime_s))
    except (OSError, ValueError, IndexError):
        pass
    return out
