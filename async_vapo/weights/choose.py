"""Which way each engine takes its weights under ``cluster.weights.transfer = "auto"``, chosen per engine.

Where the engine is decides the candidates:

* on the learner's host (its workers read the learner's slot: the slot file exists there and its header carries
  the announce's token): the shared-memory slot, and nothing else is tried. It was the fastest way at every size
  measured on this machine (``RECORDED``), and an NCCL group cannot join two processes on one GPU anyway.
* on another host: the ZeroMQ fetch, and the torch.distributed group (``async_vapo.weights.collective``) when the engine
  can join one. The engine finds out that it is remote at its first load (the slot is not readable: it fetched) and
  then asks for a group; a learner that cannot match the engine's backend gives it none.

Between the fetch and the group, the first loads decide, at run time (:class:`WayChooser`, kept by the learner's
``WeightBroadcast`` from the engines' acks, which say the way each version came and its load seconds): the fetch
first (the engine has no group yet), ``trials`` timed loads after one warm-up load that is not counted (the
first fetch allocates the engine's buffer, the first receive the group's), then as many over the group; the way
with the lower median cost is kept for the rest of the run. The cost of one load:

* "zmq": the engine's load seconds (the fetch and vLLM's load). The learner spends nothing on it beyond the slot it
  writes for every way (its fetch server is a thread);
* "dist": the longer of the engine's load seconds and the learner's send seconds. The learner streams right after
  its announce and waits while the engine finishes its generate call, so a busy engine's dist costs the learner
  that wait, and it is counted against dist.

Why at run time rather than from the figures alone: ``RECORDED`` is one 2-core CPU over loopback, where the group
beat the fetch (0.118 against 0.172 s at 30 M parameters) but tied it at 1 M. A real network between hosts, NCCL on
GPUs, and engines that are busy generating when a version comes all change that order, and the trial costs a few
versions' loads at most. ``trials = 0`` skips the timing and follows ``RECORDED``: the group when the engine has
one, else the fetch.

A group that fails ``MAX_DIST_FAILURES`` times (the engine died or missed the deadline; it loads the fetch each time)
makes the fetch final for that engine. With any other ``transfer`` the chooser only reports the ways engines use.

With ``model.lora`` a version is its adapter (``weights.adapter``) and there is nothing to choose: an engine reads the
learner's PEFT directory where it lies ("adapter") or fetches its blob over ZeroMQ ("adapter_zmq"), whatever
``transfer`` is; the chooser reports those ways like the others (``ADAPTER_WAYS``).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

RECORDED = {
    "source": "benchmarks/results/weight_sync_dist/weight_sync.md (result.json beside it): medians of 3 pushes "
              "into the running engine, idle 2-core CPU, ZeroMQ and gloo on loopback",
    "1m": {"shm": 0.013, "zmq": 0.018, "dist": 0.018},
    "30m": {"shm": 0.062, "zmq": 0.172, "dist": 0.118},
}
"""Seconds per push by way, as measured here; the order when ``trials = 0``: shm, then dist, then zmq."""
ADAPTER_WAYS = ("adapter", "adapter_zmq")
"""A LoRA version's ways (``receive.load_announced``): the learner's directory read where it lies, or fetched."""
WAYS = ("shm", "dist", "zmq", "file", *ADAPTER_WAYS)
"""Every way a version reaches an engine: what ``WeightsAck.via`` says and the ``way`` label of the gauges
``weight_way`` and ``engines_by_weight_way``."""
MAX_DIST_FAILURES = 3


@dataclass
class EngineWay:
    """What the learner knows of one engine's ways."""

    way: str = ""
    """The way its last load came."""
    remote: bool | None = None
    """On another host than the learner's (it fetched); None before its first load."""
    can_join: bool = False
    """It asked for a torch.distributed group."""
    chosen: str = ""
    """The way kept for the run ("" while trying)."""
    reason: str = ""
    loads: dict[str, int] = field(default_factory=dict)
    """Loads by way, warm-ups included."""
    costs: dict[str, list[float]] = field(default_factory=dict)
    """Timed loads' costs by way (module docstring)."""
    sent: dict[int, float] = field(default_factory=dict)
    """version -> the learner's send seconds, until the engine's ack of it."""
    failures: int = 0


class WayChooser:
    """Per-engine choice of the way (module docstring); pure bookkeeping, no I/O. ``auto``: choose; otherwise
    only record the ways engines use."""

    def __init__(self, auto: bool, trials: int = 2):
        self.auto, self.trials = auto, trials
        self.engines: dict[str, EngineWay] = {}

    def _e(self, engine: str) -> EngineWay:
        return self.engines.setdefault(engine, EngineWay())

    def way(self, engine: str) -> str:
        """The way the engine uses now: the one kept, else that of its last load ("" before any)."""
        e = self.engines.get(engine)
        return "" if e is None else (e.chosen or e.way)

    def counts(self) -> dict[str, int]:
        """Engines by the way they use now."""
        out = dict.fromkeys(WAYS, 0)
        for name in self.engines:
            w = self.way(name)
            if w in out:
                out[w] += 1
        return out

    def group_asked(self, engine: str) -> bool:
        """The engine asked for a group; returns whether the learner should offer one ("auto": not to an engine
        on this host, nor once the fetch is final for it)."""
        e = self._e(engine)
        e.can_join = True
        return not self.auto or (e.remote is not False and e.chosen != "zmq")

    def stream(self, engine: str) -> bool:
        """Whether the next version goes to this engine over its group (when it has one formed)."""
        if not self.auto:
            return True
        e = self.engines.get(engine)
        if e is None or not e.remote:
            return False
        if e.chosen:
            return e.chosen == "dist"
        return self.trials == 0 or len(e.costs.get("zmq", [])) >= self.trials

    def sent(self, engine: str, version: int, seconds: float) -> None:
        """The learner streamed ``version`` to the engine in ``seconds`` (its wait for the engine included)."""
        e = self._e(engine)
        e.sent[version] = seconds
        for v in [v for v in e.sent if v < version - 8]:  # acks that never came
            del e.sent[v]

    def failed(self, engine: str) -> str | None:
        """The engine's group failed a version; returns a line to log when that makes the fetch final."""
        e = self._e(engine)
        e.failures += 1
        if self.auto and e.failures >= MAX_DIST_FAILURES and e.chosen != "zmq":
            e.chosen, e.reason = "zmq", f"its group failed {e.failures} times"
            return f"takes its weights by zmq from now on: {e.reason}"
        return None

    def loaded(self, engine: str, via: str, version: int, seconds: float) -> str | None:
        """The engine acked ``version`` loaded ``via`` in ``seconds``; returns a line to log when its way is first
        known, changes ("dist", "shm", ...: the configured way) or is decided ("auto")."""
        if via not in WAYS:
            return None
        e = self._e(engine)
        before = self.way(engine)
        e.way = via
        n = e.loads[via] = e.loads.get(via, 0) + 1
        cost = max(seconds, e.sent.pop(version, 0.0)) if via == "dist" else seconds
        if n > 1:  # the first load of each way is its warm-up
            e.costs.setdefault(via, []).append(cost)
        if via in ADAPTER_WAYS:  # model.lora: nothing to choose, whatever transfer is
            return None if via == before else f"takes its weights by {via} (model.lora: each version its adapter)"
        if via == "shm":
            e.remote = False
        elif via == "dist" or (via == "zmq" and e.remote is None):
            e.remote = True
        if not self.auto:
            return None if via == before else f"takes its weights by {via} (cluster.weights.transfer)"
        if via == "shm":
            if e.chosen == "shm":
                return None
            e.chosen, e.reason = "shm", "on the learner's host: it maps the slot"
            return f"takes its weights by shm ({e.reason})"
        if e.chosen or not e.remote:
            return None
        if via == "dist" and self.trials == 0:
            e.chosen, e.reason = "dist", "its group: faster than the fetch in benchmarks/results/weight_sync_dist/"
            return f"takes its weights by dist from now on ({e.reason})"
        z, d = e.costs.get("zmq", []), e.costs.get("dist", [])
        if self.trials and len(z) >= self.trials and len(d) >= self.trials:
            mz, md = statistics.median(z[: self.trials]), statistics.median(d[: self.trials])
            e.chosen = "dist" if md < mz else "zmq"
            e.reason = (f"median of {self.trials} timed loads each: dist {md:.3f} s (the learner's wait included), "
                        f"zmq {mz:.3f} s")
            return f"takes its weights by {e.chosen} from now on ({e.reason})"
        if not before:
            plan = (f"trying the fetch, then its group, {self.trials} timed loads each" if self.trials
                    else "its group once it has one")
            return f"takes its weights by zmq (on another host; {plan})"
        return None

    def no_group(self, engine: str, why: str) -> str | None:
        """The learner cannot give the engine a group (backends do not match): the fetch is final."""
        e = self._e(engine)
        if self.auto and not e.chosen:
            e.chosen, e.reason = "zmq", f"no group: {why}"
            return f"takes its weights by zmq ({e.reason})"
        return None
