"""Which host and which GPUs each process of the cluster gets: ``async.rollout_devices : async.learner_devices``,
``rollout.tensor_parallel_size`` and the hostfile in, one ``CUDA_VISIBLE_DEVICES`` per process per host out.

The rules (``deploy/start_cluster.sh --dry-run`` prints the result, ``async-vapo plan`` the memory it implies):

* ``rollout_devices`` GPUs go to engines of ``tensor_parallel_size`` GPUs each, so there are
  ``rollout_devices / tensor_parallel_size`` engines; the division must be exact.
* An engine's GPUs are on one host and adjacent (``0,1,2,3``): vLLM's tensor parallelism across hosts needs
  Ray, which this cluster does not run.
* The learner is one torchrun agent per ``learner`` host of the hostfile (each host once, in the hostfile's
  order; none: this machine): ``learner_devices`` ranks split evenly over them, so the number must divide by the
  number of learner hosts. Agent i (service ``learner`` for i = 0, else ``learner-i``) runs global ranks
  ``i * k .. i * k + k - 1`` (k ranks per host) on that host's lowest GPUs (local rank j on local GPU j); rank 0,
  which does all of the learner's I/O, is on the first learner host. More ranks per host than a host's GPUs are
  refused.
* Engines go round-robin over the ``rollout`` hosts (in the hostfile's order), each host offering
  ``free GPUs // tensor_parallel_size`` engine slots after the learner's GPUs there; a host may run several
  engines and may share a host with a learner agent.
* Replay and verifier use no GPU.
* The evaluator (``cluster.evaluator.mode = "watch"``) runs on the first learner host; with GPUs it takes
  ``tensor_parallel_size`` adjacent GPUs that no service uses, on the first learner host that has them, else on
  the first rollout host that does; a plan that leaves none is refused.
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
    ranks: tuple[int, ...] = ()
    """A learner agent's global ranks (its node rank × ranks per host + local rank); empty for the other services."""
    node: int = 0
    """A learner agent's node rank: its learner host's place among the learner hosts."""

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

    @property
    def learners(self) -> list[Process]:
        """The learner's torchrun agents, one per learner host, by node rank (``learner``, ``learner-1``, ...)."""
        return [p for p in self.processes if p.ranks]

    def _ranks(self, p: Process) -> str:
        n = len(self.learners)
        ranks = f"rank {p.ranks[0]}" if len(p.ranks) == 1 else f"ranks {p.ranks[0]}-{p.ranks[-1]}"
        if n == 1:
            return f"{len(p.ranks)} rank{'s' if len(p.ranks) > 1 else ''}"
        return f"node {p.node} of {n}: {ranks}"

    def describe(self) -> str:
        """The plan as a table, one process a line."""
        w = max(len(p.host) for p in self.processes)
        lines = []
        for p in self.processes:
            if p.gpus:
                what = f"CUDA_VISIBLE_DEVICES={p.cuda_visible_devices}"
                if p.ranks:
                    what += f"  ({self._ranks(p)})"
                elif self.tensor_parallel_size > 1:
                    what += f"  (tensor parallel {self.tensor_parallel_size})"
            else:
                what = "no GPU" if self.gpus_per_host else "CPU"
                if p.ranks and len(self.learners) > 1:
                    what += f"  ({self._ranks(p)})"
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
          hostfile: Sequence[tuple[str, str]] = (), evaluator: bool = False) -> Placement:
    """The placement of every process (module docstring), with an ``evaluator`` process when asked; raises
    PlacementError when the shape does not fit."""
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
    learner_hosts = list(dict.fromkeys(by_role["learner"])) or ["localhost"]  # each host once, in order
    n_nodes = len(learner_hosts)
    if learner_devices % n_nodes:
        raise PlacementError(
            f"async.learner_devices = {learner_devices} does not divide evenly over the {n_nodes} learner hosts "
            f"({', '.join(learner_hosts)}): each runs the same number of ranks; use a multiple of {n_nodes}, or "
            "a number of learner hosts that divides it")
    per_node = learner_devices // n_nodes

    def learners(gpus: tuple[int, ...]) -> list[Process]:
        return [Process(learner_name(i), h, gpus, tuple(range(i * per_node, (i + 1) * per_node)), i)
                for i, h in enumerate(learner_hosts)]

    procs = [Process("replay", first["replay"]), Process("verifier", first["verifier"])]
    if gpus_per_host == 0:
        procs += [Process(f"rollout-{i}", rollout_lines[i % len(rollout_lines)]) for i in range(n_engines)]
        procs += learners(())
        if evaluator:
            procs.append(Process("evaluator", learner_hosts[0]))
        return Placement(procs, 0, tp)

    if tp > gpus_per_host:
        raise PlacementError(f"rollout.tensor_parallel_size = {tp} does not fit a host of {gpus_per_host} GPUs: a "
                             "tensor-parallel engine runs within one host")
    learner_host = learner_hosts[0]
    if per_node > gpus_per_host:
        if n_nodes == 1:
            raise PlacementError(
                f"async.learner_devices = {learner_devices} does not fit one host ({gpus_per_host} GPUs on "
                f"{learner_host}): lower async.learner_devices to at most {gpus_per_host}, or give the learner "
                "several hosts (one 'HOST learner' line each: the ranks split evenly over them)")
        raise PlacementError(
            f"async.learner_devices = {learner_devices} over {n_nodes} learner hosts is {per_node} ranks per host, "
            f"more than a host's {gpus_per_host} GPUs: lower async.learner_devices to at most "
            f"{n_nodes * gpus_per_host}, or add learner hosts")
    used: dict[str, int] = dict.fromkeys(learner_hosts, per_node)
    agents = learners(tuple(range(per_node)))
    hosts = list(dict.fromkeys(rollout_lines))  # each host once, in the hostfile's order
    slots = {h: (gpus_per_host - used.get(h, 0)) // tp for h in hosts}
    if sum(slots.values()) < n_engines:
        have = ", ".join(f"{h}: {s}" for h, s in slots.items())
        on = learner_host if n_nodes == 1 else f"each of {', '.join(learner_hosts)}"
        idle_learner_hosts = [h for h in learner_hosts if h not in slots]
        raise PlacementError(
            f"{n_engines} engine(s) of {tp} GPU(s) (async.rollout_devices = {rollout_devices}) do not fit the "
            f"rollout hosts: engine slots per host after the learner's {per_node} GPU(s) on {on} "
            f"are {have} ({sum(slots.values())} in all, {gpus_per_host} GPUs per host); add rollout hosts or lower "
            "async.rollout_devices" + (f" (the {gpus_per_host - per_node} GPU(s) left on "
                                       f"{', '.join(idle_learner_hosts)} take engines only with a rollout line for "
                                       f"{'it' if len(idle_learner_hosts) == 1 else 'each'})"
                                       if idle_learner_hosts and per_node < gpus_per_host else ""))
    engines: list[Process] = []
    while len(engines) < n_engines:
        for h in hosts:
            if slots[h] and len(engines) < n_engines:
                lo = used.get(h, 0)
                engines.append(Process(f"rollout-{len(engines)}", h, tuple(range(lo, lo + tp))))
                used[h] = lo + tp
                slots[h] -= 1
    procs += engines + agents
    all_hosts = list(dict.fromkeys([*learner_hosts, *hosts]))
    if evaluator:
        free = {h: gpus_per_host - used.get(h, 0) for h in all_hosts}
        host = next((h for h in all_hosts if free[h] >= tp), None)
        if host is None:
            raise PlacementError(
                f"cluster.evaluator.mode = 'watch' needs {tp} GPU(s) of its own on one host (rollout."
                f"tensor_parallel_size) and every GPU is taken ({', '.join(f'{h}: {free[h]} free' for h in all_hosts)})"
                ": lower async.rollout_devices by one engine, add a host, or set cluster.evaluator.mode = 'after' "
                "(it evaluates once the run is done)")
        lo = used.get(host, 0)
        procs.append(Process("evaluator", host, tuple(range(lo, lo + tp))))
        used[host] = lo + tp
    idle = {h: tuple(range(used.get(h, 0), gpus_per_host)) for h in all_hosts if used.get(h, 0) < gpus_per_host}
    return Placement(procs, gpus_per_host, tp, idle)


def learner_name(node: int) -> str:
    """The service name of the learner's agent on learner host ``node``: ``learner`` (rank 0's), ``learner-1``, ..."""
    return "learner" if node == 0 else f"learner-{node}"


def shell_assignments(p: Placement) -> list[str]:
    """``HOST_<NAME>`` and ``GPUS_<NAME>`` (NAME upper-cased, ``-`` as ``_``) per process, for start_cluster.sh;
    ``LEARNER_AGENTS`` (the learner agents' names, by node rank) and ``LEARNER_RANKS_PER_HOST``."""
    out = []
    for proc in p.processes:
        key = proc.name.upper().replace("-", "_")
        out.append(f"HOST_{key}={shlex.quote(proc.host)}")
        out.append(f"GPUS_{key}={shlex.quote(proc.cuda_visible_devices)}")
    agents = p.learners
    out.append(f"LEARNER_AGENTS={shlex.quote(' '.join(a.name for a in agents))}")
    out.append(f"LEARNER_RANKS_PER_HOST={len(agents[0].ranks)}")
    return out
