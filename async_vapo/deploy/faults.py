"""Fault injection into a running cluster, and the audit of what the run kept.

tests/integration/test_faults.py runs one fixed schedule on the test model; benchmarks/faults.py runs schedules drawn
from a seed on the embedded default and compares them with an undisturbed run. Both go through :func:`run_cluster`:
deploy/start_cluster.sh, an :class:`Injector` polling every 50 ms until the learner's DONE (and rollout 0's last
evaluation), deploy/stop_cluster.sh, then :func:`audit_run`.

Faults (:class:`Fault`), each fired once, in plan order, when its trigger holds:

* ``kill``: SIGKILL the service's process, the PID in RUN_DIR/pids/NAME.pid (a crash as the kernel's OOM killer makes
  one: what the process leaves behind is the supervisor's to clean up), once the learner has published
  ``at_version``. For the learner, ``when`` adds ``"mid_update"`` (its /health says ``busy: learn``, i.e. it holds a
  batch the replay has already marked served) or ``"after_checkpoint"`` (right after ``checkpoints/step_N`` appeared,
  N >= ``at_version``); for any service ``"busy"`` waits until its /health says it is working (a verifier holding
  groups it has not passed on yet).
* ``stop``: SIGSTOP the service's process group for ``duration_s`` (it stops generating, acking and heartbeating:
  the learner takes it out of rotation after ``cluster.wire.peer_dead_s``), then SIGCONT.

What each fault's record says (seconds from the fault): ``healthy_s``, the service's /health answering 200 from a
new process (for ``stop``: after SIGCONT, its rejoining the rotation, ``rejoined_s``); ``progress_s``, the learner
publishing a version above the highest it had published when the fault fired (for the learner that includes
redoing the updates since its checkpoint); and the supervisor's own view (``restart_delay_s`` from its
events file: death to restart).

The audit (:func:`audit_run`) reads RUN_DIR/metrics.jsonl, the replay's log (every group it acknowledged, every
batch it served, every drop with its reason) and the services' logs:

* the lineage: for each update 1..total_steps the last train row written (an update redone after a learner restart
  replaces the one that was lost); each row's ``replay/cursor`` names the batch it trained on;
* every acknowledged group's fate: trained on by a lineage update (or by value pretraining), dropped with a reason,
  still stored at the end, or served to an update that was lost, and then stored again (its copy's fate counts) or
  *lost*;
* groups served twice: the same group (uid, version and samples) in two lineage batches;
* staleness violations: train rows with ``replay/max_age`` outside [0, max_staleness], and lineage groups whose age
  (batch version minus group version) is;
* versions served by each engine (its log's ``serving version`` lines, across restarts): never decreasing, except
  after a learner resumed from an older checkpoint, and then not below the version it resumed at (the engines
  follow it down, into its new lineage);
* admission refills: how often an engine topped up its spent budget after ``cluster.rollout.admission_refill_s``
  without a new version (groups lost in flight, never acknowledged, made up);
* final held-out accuracy: rollout 0's evaluation of version total_steps.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from async_vapo.config import Config
from async_vapo.config.cluster import metrics_port, service_host
from async_vapo.replay.store import AppendRecord, ConsumeRecord, DropRecord, SnapshotRecord, read_log
from async_vapo.staleness import StalenessPolicy

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fault:
    kind: str
    """"kill" (SIGKILL the process) or "stop" (SIGSTOP its group for ``duration_s``, then SIGCONT)."""
    service: str
    """replay, verifier, learner, rollout-<i>."""
    at_version: int
    """Fire once the learner has published this version (after_checkpoint: once checkpoints/step_N, N >= it)."""
    when: str = ""
    """"busy": once the service's /health says it is working (the verifier verifying, the rollout generating);
    learner only: "mid_update" (busy learning) or "after_checkpoint"; "": as soon as ``at_version`` is reached."""
    duration_s: float = 0.0


@dataclass
class FaultRecord:
    fault: Fault
    fired_at: float | None = None
    """Unix time."""
    version_at_fire: int | None = None
    highest_version_at_fire: int | None = None
    pid: int | None = None
    new_pid: int | None = None
    healthy_s: float | None = None
    progress_s: float | None = None
    resumed_s: float | None = None
    rejoined_s: float | None = None
    left_rotation: bool | None = None
    restart_delay_s: float | None = None
    stall_s: float | None = None
    """Longest time without a new learner version from the fault until the learner is 3 versions beyond the highest
    it had reached (a pipeline with staleness 1 drained and refilled), or the next fault: how long this fault
    stopped training (one normal update's time included). See :func:`stall_after`."""
    detail: dict = field(default_factory=dict)


def _get(url: str, timeout_s: float = 1.0) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError:
        return None


def _health(url: str) -> dict | None:
    got = _get(url)
    if got is None:
        return None
    try:
        doc = json.loads(got[1])
    except ValueError:
        return None
    doc["_http"] = got[0]
    return doc


def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {name or name{labels}: value}."""
    got = _get(url)
    out: dict[str, float] = {}
    if got is None:
        return out
    for line in got[1].splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$", line)
        if m:
            try:
                out[m.group(1)] = float(m.group(2))
            except ValueError:
                pass
    return out


class Injector:
    """Fires a plan of faults into the cluster in ``run_dir`` as their triggers come true (see the module
    docstring); :meth:`poll` does one round and is called every ~50 ms."""

    def __init__(self, cfg: Config, run_dir: Path, plan: list[Fault]):
        self.cfg, self.run_dir = cfg, run_dir
        self.records = [FaultRecord(f) for f in plan]
        self.next = 0
        self.versions: list[tuple[float, int]] = []
        """(Unix time, version) each time the learner's published version changed (from its /health)."""
        self.highest = -1
        self._stopped: list[tuple[FaultRecord, float]] = []

    def url(self, name: str, path: str) -> str:
        service, _, idx = name.partition("-")
        i = int(idx or 0)
        return f"http://{service_host(self.cfg, service, i)}:{metrics_port(self.cfg, service, i)}{path}"

    def pid(self, name: str) -> int:
        return int((self.run_dir / "pids" / f"{name}.pid").read_text())

    def aiming(self) -> bool:
        """Whether the next fault waits for a short moment (an update in progress): poll fast then."""
        if self.next >= len(self.records):
            return False
        f = self.records[self.next].fault
        return f.when in ("mid_update", "busy") and bool(self.versions) and self.versions[-1][1] >= f.at_version

    def poll(self, fire: bool = True) -> None:
        """Read the learner's version, fire the next fault when it is due (``fire``), follow the fired ones."""
        now = time.time()
        learner = _health(self.url("learner", "/health"))
        if learner is not None and "policy_version" in learner:
            v = int(learner["policy_version"])
            if not self.versions or self.versions[-1][1] != v:
                self.versions.append((now, v))
            self.highest = max(self.highest, v)
        if fire:
            self._fire(now, learner)
        self._follow(now)

    def settled(self) -> bool:
        """Whether every fired fault has its outcome (recovered, and the learner published a newer version)."""
        return all(_settled(r) for r in self.records if r.fired_at is not None)

    def _fire(self, now: float, learner: dict | None) -> None:
        if self.next >= len(self.records):
            return
        rec = self.records[self.next]
        f = rec.fault
        if any(r.fired_at is not None and r.healthy_s is None and r.rejoined_s is None for r in self.records):
            return  # one fault at a time: the previous one has recovered first
        v = self.versions[-1][1] if self.versions else -1
        if f.when == "after_checkpoint":  # a checkpoint that appeared since this fault came next, at >= at_version
            ckpts = (self.run_dir / "checkpoints").glob("step_*/learner_state.pt")
            steps = {int(p.parent.name[5:]) for p in ckpts if p.parent.name[5:].isdigit()}
            seen = rec.detail.setdefault("checkpoints_before", sorted(steps))
            if not [s for s in steps - set(seen) if s >= f.at_version]:
                return
            rec.detail["checkpoint"] = max(steps - set(seen))
        elif v < f.at_version or learner is None:
            return
        elif f.when == "mid_update" and learner.get("busy") != "learn":
            return
        elif f.when == "busy" and not (_health(self.url(f.service, "/health")) or {}).get("busy"):
            return
        rec.pid = self.pid(f.service)
        rec.fired_at, rec.version_at_fire, rec.highest_version_at_fire = now, v, self.highest
        if f.kind == "kill":
            os.kill(rec.pid, signal.SIGKILL)
        elif f.kind == "stop":
            m = scrape(self.url("learner", "/metrics"))
            rec.detail["dead_before"] = m.get("async_vapo_learner_engines_dead_total", 0.0)
            rec.detail["rejoined_before"] = m.get("async_vapo_learner_engines_rejoined_total", 0.0)
            os.killpg(rec.pid, signal.SIGSTOP)
            self._stopped.append((rec, now + f.duration_s))
        else:
            raise ValueError(f"unknown fault kind {f.kind!r}")
        self.next += 1

    def _follow(self, now: float) -> None:
        for rec, until in list(self._stopped):
            if now >= until:
                os.killpg(rec.pid, signal.SIGCONT)
                rec.detail["resumed_at"] = now
                self._stopped.remove((rec, until))
        for rec in self.records:
            if rec.fired_at is None or _settled(rec):
                continue
            f, dt = rec.fault, now - rec.fired_at
            if rec.progress_s is None and self.highest > rec.highest_version_at_fire:
                rec.progress_s = dt
            if f.kind == "kill" and rec.healthy_s is None:
                doc = _health(self.url(f.service, "/health"))
                if doc is not None and doc["_http"] == 200 and doc.get("pid") not in (None, rec.pid):
                    rec.healthy_s, rec.new_pid = dt, doc["pid"]
            if f.kind == "kill" and f.service == "learner" and rec.resumed_s is None and rec.healthy_s is not None:
                # the restarted learner's first update: a version change after it came back
                if any(t > rec.fired_at + rec.healthy_s for t, _ in self.versions[1:]):
                    rec.resumed_s = dt
            if f.kind == "stop" and rec.rejoined_s is None and "resumed_at" in rec.detail:
                m = scrape(self.url("learner", "/metrics"))
                if m.get("async_vapo_learner_engines_rejoined_total", 0.0) > rec.detail["rejoined_before"]:
                    rec.rejoined_s = dt
                    rec.left_rotation = m.get("async_vapo_learner_engines_dead_total", 0.0) > rec.detail["dead_before"]

    def release(self) -> None:
        """SIGCONT whatever is still stopped (the run ended first)."""
        for rec, _ in self._stopped:
            try:
                os.killpg(rec.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self._stopped.clear()


def stall_after(versions: list, fired_at: float, highest: int, until: float | None = None,
                beyond: int = 3) -> float | None:
    """The longest time without a new learner version after ``fired_at``, until the learner first publishes
    ``highest + beyond`` or ``until`` (the next fault); ``versions``: [(time, version)] at each change."""
    end = next((t for t, v in versions if t > fired_at and v >= highest + beyond), None)
    stops = [t for t in (end, until) if t is not None]
    stop = min(stops) if stops else None
    changes = [t for t, _ in versions if t > fired_at and (stop is None or t <= stop)]
    if stop is not None and (not changes or changes[-1] < stop):
        changes.append(stop)  # the next fault came first: training had not moved on since the last change
    points = [fired_at, *changes]
    return round(max(b - a for a, b in zip(points, points[1:], strict=False)), 2) if len(points) > 1 else None


def _settled(rec: FaultRecord) -> bool:
    if rec.progress_s is None:
        return False
    if rec.fault.kind == "stop":
        return rec.rejoined_s is not None
    return rec.healthy_s is not None and (rec.fault.service != "learner" or rec.resumed_s is not None)


def supervisor_restarts(run_dir: Path) -> list[dict]:
    """Deaths and restarts from every local supervisor's events file: [{name, pid, exited_t, restarted_t}]."""
    out = []
    for path in sorted((run_dir / "supervisor").glob("events-*.jsonl")):
        events = [json.loads(x) for x in path.read_text().splitlines()]
        for i, e in enumerate(events):
            if e["event"] == "exited":
                nxt = next((x for x in events[i + 1:] if x["name"] == e["name"] and x["event"] == "restarted"), None)
                out.append({"name": e["name"], "pid": e.get("pid"), "exited_t": e["t"],
                            "restarted_t": nxt["t"] if nxt else None, "killed": e.get("killed", [])})
    return out


def run_cluster(config_files: list[str], overrides: list[str], run_dir: Path, plan: list[Fault], *,
                timeout_s: float, wait_eval: bool = True, env: dict | None = None, log=print,
                start_args: list[str] = (), settled=None, settle_s: float = 30.0) -> dict:
    """Start the cluster (``start_args``: more start_cluster.sh options), inject ``plan``, wait for DONE (and rollout
    0's last evaluation), then (up to ``settle_s``) for every fired fault's outcome and ``settled()`` to be true (e.g.
    until a scraper has seen the final state), stop it, audit it. The learner keeps serving /health after DONE, so a
    version published in the last moments is read then, if the run's polls missed it."""
    from async_vapo.config import load_config

    cfg = load_config(config_files, overrides)
    cfg.train.output_dir = str(run_dir.resolve())
    env = dict(os.environ if env is None else env)
    cmd = ["bash", str(REPO / "deploy" / "start_cluster.sh")]
    for c in config_files:
        cmd += ["--config", str(c)]
    t0 = time.time()
    start = subprocess.run([*cmd, "--run-dir", str(run_dir), *start_args, "--", *overrides], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=900)
    if start.returncode != 0:
        stop = subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], capture_output=True,
                              text=True, timeout=300)
        raise RuntimeError(f"start_cluster.sh failed:\n{start.stderr[-4000:]}\n{stop.stderr}")
    t_up = time.time() - t0
    log(f"[faults] cluster up in {t_up:.0f} s; plan: {[asdict(f) for f in plan]}")
    injector = Injector(cfg, run_dir, plan)
    total = cfg.train.total_steps
    deadline, done_at = time.monotonic() + timeout_s, None
    fired = 0
    try:
        while time.monotonic() < deadline:
            injector.poll()
            if injector.next > fired:
                rec = injector.records[fired]
                log(f"[faults] {time.time() - t0:6.1f} s: {rec.fault.kind} {rec.fault.service} "
                    f"{rec.fault.when or ''} at version {rec.version_at_fire} (pid {rec.pid})")
                fired = injector.next
            if done_at is None and (run_dir / "DONE").exists():
                done_at = time.time()
                log(f"[faults] {done_at - t0:6.1f} s: DONE")
            if done_at is not None and (not wait_eval or _evaluated(run_dir, total) or time.time() - done_at > 180):
                break
            time.sleep(0.002 if injector.aiming() else 0.05)
        if done_at is not None:
            until = time.monotonic() + settle_s
            while time.monotonic() < until:
                injector.poll(fire=False)  # no fault after the end
                if injector.settled() and (settled is None or settled()):
                    break
                time.sleep(0.5)
    finally:
        injector.release()
        stop = subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], capture_output=True,
                              text=True, timeout=300)
    restarts = supervisor_restarts(run_dir)
    fired = [r.fired_at for r in injector.records if r.fired_at is not None]
    for rec in injector.records:
        if rec.fired_at is None:
            continue
        until = min([t for t in fired if t > rec.fired_at], default=None)
        rec.stall_s = stall_after(injector.versions, rec.fired_at, rec.highest_version_at_fire, until)
        r = next((x for x in restarts if x["pid"] == rec.pid and x["restarted_t"]), None)
        if rec.fault.kind == "kill" and r is not None:
            rec.restart_delay_s = round(r["restarted_t"] - r["exited_t"], 3)
    return {
        "plan": [asdict(f) for f in plan],
        "faults": [{**asdict(r), "fault": asdict(r.fault)} for r in injector.records],
        "cluster_up_s": round(t_up, 1),
        "done_s": None if done_at is None else round(done_at - t0, 1),
        "stop_returncode": stop.returncode,
        "stop_stderr": stop.stderr[-2000:],
        "versions": injector.versions,
        "supervisor_restarts": restarts,
        "audit": audit_run(run_dir, total_steps=total, max_staleness=StalenessPolicy.from_config(cfg).max_staleness),
    }


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _evaluated(run_dir: Path, step: int) -> bool:
    return any(r["kind"] == "eval" and r["step"] == step for r in _rows(run_dir))


def group_key(g) -> tuple:
    """A group's identity across copies: uid, version and its samples' tokens and log-probs."""
    h = hashlib.sha1()
    for s in g.samples:
        h.update(s.response_ids.tobytes())
        h.update(s.behavior_logprobs.tobytes())
    return g.uid, g.version, h.hexdigest()


_ASCTIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def _log_time(line: str) -> float | None:
    m = _ASCTIME.match(line)
    if not m:
        return None
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000


def served_versions(run_dir: Path) -> dict:
    """Each engine's served versions from its log, checked against the learner's resumes (module docstring)."""
    resumes = []
    learner_log = run_dir / "logs" / "learner.log"
    if learner_log.exists():
        for line in learner_log.read_text(errors="replace").splitlines():
            m = re.search(r"learner: resumed from \S+ at version (\d+)", line)
            if m and _log_time(line) is not None:
                resumes.append((_log_time(line), int(m.group(1))))
    out = {}
    for log in sorted((run_dir / "logs").glob("rollout-*.log")):
        seq: list[tuple[float, int, int]] = []  # (time, version, incarnation)
        incarnation = 0
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("[supervise] "):
                incarnation += 1
                continue
            m = re.search(r": serving version (\d+) \(load", line)
            t = _log_time(line)
            if m and t is not None:
                seq.append((t, int(m.group(1)), incarnation))
        violations = []
        for (t0, v0, _), (t1, v1, i1) in zip(seq, seq[1:], strict=False):
            if v1 >= v0:
                continue
            # followed a learner that resumed from an older checkpoint down: into its new lineage, not below it
            if not any(t0 - 5 <= tr <= t1 and vr <= v1 for tr, vr in resumes):
                violations.append({"from": v0, "to": v1, "at": t1, "incarnation": i1})
        first_after = [next((v for _, v, i in seq if i == k), None) for k in range(2, incarnation + 1)]
        out[log.stem] = {"loads": len(seq), "incarnations": incarnation, "violations": violations,
                         "first_version_after_restart": first_after}
    return out


def audit_run(run_dir: Path, *, total_steps: int, max_staleness: int) -> dict:
    """What the run kept (module docstring)."""
    rows = _rows(run_dir)
    train = [r for r in rows if r["kind"] == "train"]
    lineage: dict[int, dict] = {}
    for r in train:  # rows in the order written: a redone update replaces the lost one
        lineage[r["step"]] = r
    reached = sorted(lineage) == list(range(1, total_steps + 1))
    bad_age = [r["step"] for r in train if not 0 <= r["replay/max_age"] <= max_staleness]

    keys: dict[int, tuple] = {}
    versions: dict[int, int] = {}
    batches: list[dict] = []
    dropped: dict[int, str] = {}
    total, compacted = 0, False
    log_path = run_dir / "replay" / "groups.log"
    for rec in read_log(log_path) if log_path.exists() else []:
        if isinstance(rec, AppendRecord):
            keys[rec.seq], versions[rec.seq] = group_key(rec.group), rec.group.version
        elif isinstance(rec, ConsumeRecord):
            total += len(rec.seqs)
            batches.append({"learner_version": rec.learner_version, "seqs": rec.seqs, "end": total})
        elif isinstance(rec, DropRecord):
            for s in rec.seqs:
                dropped[s] = rec.reason
        elif isinstance(rec, SnapshotRecord):
            compacted, total = True, rec.consumed_total
    by_end = {b["end"]: i for i, b in enumerate(batches)}
    lineage_batches = [by_end.get(r["replay/cursor"]) for _, r in sorted(lineage.items())]
    unmatched = sum(i is None for i in lineage_batches)
    trained = [i for i in lineage_batches if i is not None]
    first = min(trained) if trained else len(batches)
    pretrain = [i for i in range(first) if batches[i]["learner_version"] == 0]
    in_lineage = set(trained) | set(pretrain)
    fate: dict[int, str] = {}
    for i, b in enumerate(batches):
        for s in b["seqs"]:
            fate[s] = ("trained" if i in trained else "pretrain") if i in in_lineage else "rolled_back"
    for s, reason in dropped.items():
        fate.setdefault(s, f"dropped:{reason}")
    seqs_by_key: dict[tuple, list[int]] = {}
    for s, k in keys.items():
        seqs_by_key.setdefault(k, []).append(s)
    lost = []
    for s in keys:
        f = fate.setdefault(s, "stored_at_end")
        if f == "rolled_back":
            later = [x for x in seqs_by_key[keys[s]] if x > s]
            fate[s] = "requeued" if later else "lost"
            if not later:
                lost.append(s)
    served_in_lineage = Counter(keys[s] for i in in_lineage for s in batches[i]["seqs"] if s in keys)
    twice = sum(1 for n in served_in_lineage.values() if n > 1)
    log_bad_age = sum(1 for i in trained for s in batches[i]["seqs"]
                      if s in versions and not 0 <= batches[i]["learner_version"] - versions[s] <= max_staleness)
    evals = [r for r in rows if r["kind"] == "eval"]
    final = [r for r in evals if r["step"] == total_steps]
    engines = served_versions(run_dir)
    refills = sum(log.read_text(errors="replace").count("one more share")
                  for log in (run_dir / "logs").glob("rollout-*.log"))
    return {
        "reached_total_steps": reached,
        "lineage_steps": len(lineage),
        "train_rows": len(train),
        "updates_redone": len(train) - len(lineage),
        "staleness_violations_rows": bad_age,
        "staleness_violations_groups": log_bad_age,
        "acknowledged_groups": len(keys),
        "batches_served": len(batches),
        "lineage_batches_unmatched": unmatched,
        "fates": dict(Counter(fate.values())),
        "acknowledged_groups_lost": len(lost),
        "groups_served_twice": twice,
        "replay_log_compacted": compacted,
        "engines": engines,
        "engine_version_violations": sum(len(e["violations"]) for e in engines.values()),
        "admission_refills": refills,
        "final_eval_accuracy": final[-1]["eval/accuracy"] if final else None,
        "eval_curve": [(r["step"], r["eval/accuracy"]) for r in evals],
        "wall_s_last_train_row": train[-1]["wall_s"] if train else None,
    }
