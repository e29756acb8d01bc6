"""Which host and which GPUs each process of the cluster gets: ``async.rollout_devices : async.learner_devices``,
``rollout.tensor_parallel_size`` and the hostfile in, one ``CUDA_VISIBLE_DEVICES`` per process per host out.

The rules (``deploy/start_cluster.sh --dry-run`` prints the result, ``async-vapo plan`` the memory it implies):

* ``rollout_devices`` GPUs go to engines of ``tensor_parallel_size`` GPUs each, so there are
  ``rollout_devices / tensor_parallel_size`` engines; the division must be exact.
* An engine's GPUs are on one host and adjacent (``0,1,2,3``): vLLM's tensor parallelism across hosts needs
  Ray, which this cluster does not run.
* The learner is one torchrun on the first ``learner`` host of the hostfile: its ``learner_devices`` ranks take
  that host's lowest GPUs (rank i on local GPU i). A learner larger than one host is refused.
* Engines go round-robin over the ``rollout`` hosts (in the hostfile's order), each host offering
  ``free GPUs // tensor_parallel_size`` engine slots after the learner's GPUs there; a host may run several
  engines and may share a host with the learner.
* Replay and verifier use no GPU.
* GPUs left over are reported idle, never silently given to anyone.

Without GPUs (``gpus_per_host = 0``) only hosts are decided: engine i on the i-th ``rollout`` line, round-robin,
as the hostfile has always meant; ``start_cluster.sh`` pins CPU cores itself on a single machine.
Colocated placement (engines and learner time-sharing GPUs) is out of scope.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field

ROLES = ("replay", "verifier", "rollout", "learner")


class PlacementError(ValueError):
    """The requested shape does not fit the hosts; the message says why and what would."""


@dataclass(frozen=True)
class Process:
    name: str
    """Service name as start_cluster.sh uses it: replay, verifier, rollout-I, learner."""
    host: str
    gpus: tuple[int, ...] = ()
    """Physical GPU indices on ``host`` (its CUDA_VISIBLE_DEVICES); empty: no GPU."""

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(map(str, self.gpus))


@dataclass
class Placement:
    processes: list[Process]
    gpus_per_host: int
    tensor_parallel_size: int
    idle: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """GPUs no process got, by host."""

    def get(self, name: str) -> Process:
        for p in self.processes:
            if p.name == name:
                return p
        raise KeyError(name)

    @property
    def engines(self) -> list[Process]:
        return [p for p in self.processes if p.name.startswith("rollout-")]

    def describe(self) -> str:
        """The plan as a table, one process a line."""
        w = max(len(p.host) for p in self.processes)
        lines = []
        for p in self.processes:
            if p.gpus:
                what = f"CUDA_VISIBLE_DEVICES={p.cuda_visible_devices}"
                if p.name == "learner":
                    what += f"  ({len(p.gpus)} rank{'s' if len(p.gpus) > 1 else ''})"
                elif self.tensor_parallel_size > 1:
                    what += f"  (tensor parallel {self.tensor_parallel_size})"
            else:
                what = "no GPU" if self.gpus_per_host else "CPU"
            lines.append(f"{p.name:<11} {p.host:<{w}}  {what}")
        for host, gpus in self.idle.items():
            lines.append(f"{'(idle)':<11} {host:<{w}}  GPUs {','.join(map(str, gpus))} unused")
        return "\n".join(lines)


def parse_hostfile(text: str, source: str = "hostfile") -> list[tuple[str, str]]:
    """(host, role) per line of ``host role`` text; blank lines and ``#`` comments skipped."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) < 2 or words[1] not in ROLES:
            raise PlacementError(f"{source}:{n}: expected 'host role' with role one of {', '.join(ROLES)}, "
                                 f"got {line.strip()!r}")
        out.append((words[0], words[1]))
    return out


def place(rollout_devices: int, learner_devices: int, *, tensor_parallel_size: int = 1, gpus_per_host: int = 0,
          hostfile: Sequence[tuple[str, str]] = ()) -> Placement:
    """The placement of every process (module docstring); raises PlacementError when the shape does not fit."""
    tp = tensor_parallel_size
    if rollout_devices < 1 or learner_devices < 1 or tp < 1 or gpus_per_host < 0:
        raise PlacementError("async.rollout_devices, async.learner_devices and rollout.tensor_parallel_size must be "
                             f">= 1 and --gpus-per-host >= 0 (got {rollout_devices}, {learner_devices}, {tp}, "
                             f"{gpus_per_host})")
    if rollout_devices % tp:
        raise PlacementError(f"async.rollout_devices = {rollout_devices} is not a multiple of "
                             f"rollout.tensor_parallel_size = {tp}: every engine takes {tp} GPUs")
    n_engines = rollout_devices // tp
    by_role: dict[str, list[str]] = {r: [] for r in ROLES}
    for host, role in hostfile:
        by_role[role].append(host)
    first = {r: (hosts[0] if hosts else "localhost") for r, hosts in by_role.items()}
    rollout_lines = by_role["rollout"] or ["localhost"]
    procs = [Process("replay", first["replay"]), Process("verifier", first["verifier"])]
    if gpus_per_host == 0:
        procs += [Process(f"rollout-{i}", rollout_lines[i % len(rollout_lines)]) for i in range(n_engines)]
        procs.append(Process("learner", first["learner"]))
        return Placement(procs, 0, tp)

    if tp > gpus_per_host:
        raise PlacementError(f"rollout.tensor_parallel_size = {tp} does not fit a host of {gpus_per_host} GPUs: a "
                             "tensor-parallel engine runs within one host")
    learner_host = first["learner"]
    if learner_devices > gpus_per_host:
        raise PlacementError(
            f"async.learner_devices = {learner_devices} does not fit one host ({gpus_per_host} GPUs on "
            f"{learner_host}): the learner runs as one torchrun on one host; lower async.learner_devices to at most "
            f"{gpus_per_host}")
    used: dict[str, int] = {learner_host: learner_devices}
    learner = Process("learner", learner_host, tuple(range(learner_devices)))
    hosts = list(dict.fromkeys(rollout_lines))  # each host once, in the hostfile's order
    slots = {h: (gpus_per_host - used.get(h, 0)) // tp for h in hosts}
    if sum(slots.values()) < n_engines:
        have = ", ".join(f"{h}: {s}" for h, s in slots.items())
        raise PlacementError(
            f"{n_engines} engine(s) of {tp} GPU(s) (async.rollout_devices = {rollout_devices}) do not fit the "
            f"rollout hosts: engine slots per host after the learner's {learner_devices} GPU(s) on {learner_host} "
            f"are {have} ({sum(slots.values())} in all, {gpus_per_host} GPUs per host); add rollout hosts or lower "
            "async.rollout_devices" + (f" (the {gpus_per_host - learner_devices} GPU(s) left on {learner_host} take "
                                       "engines only with a rollout line for it)"
                                       if learner_host not in slots and learner_devices < gpus_per_host else ""))
    engines: list[Process] = []
    while len(engines) < n_engines:
        for h in hosts:
            if slots[h] and len(engines) < n_engines:
                lo = used.get(h, 0)
                engines.append(Process(f"rollout-{len(engines)}", h, tuple(range(lo, lo + tp))))
                used[h] = lo + tp
                slots[h] -= 1
    procs += engines + [learner]
    all_hosts = list(dict.fromkeys([learner_host, *hosts]))
    idle = {h: tuple(range(used.get(h, 0), gpus_per_host)) for h in all_hosts if used.get(h, 0) < gpus_per_host}
    return Placement(procs, gpus_per_host, tp, idle)


def shell_assignments(p: Placement) -> list[str]:
    """``HOST_<NAME>`` and ``GPUS_<NAME>`` (NAME upper-cased, ``-`` as ``_``) per process, for start_cluster.sh."""
    out = []
    for proc in p.processes:
        key = proc.name.upper().replace("-", "_")
        out.append(f"HOST_{key}={shlex.quote(proc.host)}")
        out.append(f"GPUS_{key}={shlex.quote(proc.cuda_visible_devices)}")
    return out
