"""The verifier service: the sandboxed :class:`~async_vapo.verify.sandbox.VerifierPool` between rollout and replay.

Sockets
  * ``in``: PULL, binds ``cluster.ports.verifier_port``; GroupsMsg (unscored) and Heartbeat from every rollout
    (fan-in). HWM ``DEFAULT_HWM`` messages.
  * ``out``: PUSH, connects to the replay's ``cluster.ports.replay_port``; GroupsMsg with rewards/verdicts.

Backpressure, not unbounded queues: one message is taken from ``in`` only after the previous one was
verified and pushed to ``out``. When the replay is slow, the push holds (``ServiceContext.send``), ``in``
fills up to its HWM, and then the rollouts' pushes hold, which holds their generation. The only queue
is the ZeroMQ pipes' HWM. ``queue_depth`` reports the responses of the message being checked.

A group whose verification fails (the pool raises, e.g. workers cannot start) is counted in
``processing_errors_total{stage="verify"}`` and dropped; the pool replaces crashed workers itself.

Each received message is verified within ``verifier.message_budget_s`` of wall-clock time: responses not
graded by then get the verdict "over_budget" (``checks_total{reason="over_budget"}``) and the message goes
on, so a message full of hanging responses holds the pipeline for at most its budget. ``/health`` carries
``sandbox``: the isolation the pool's workers have (``VerifierPool.isolation``).

Each response goes to the pool with its group's prompt and record fields (``Group.extra``), which a
``verifier.reward_fn`` may take (``async_vapo.verify.reward_fn``): the verifier grades as the one-process trainer does.
"""

from __future__ import annotations

import math
import time

from async_vapo.rollout.generate import score_groups
from async_vapo.services.context import ServiceContext, make_transport
from async_vapo.transport import GroupsMsg, Heartbeat, Transport, make_envelope, split_groups
from async_vapo.types import Group


class VerifierService:
    def __init__(self, ctx: ServiceContext, transport: Transport, *, in_endpoint: str | None = None,
                 out_endpoint: str | None = None, pool=None):
        from async_vapo.verify.sandbox import VerifierPool

        self.ctx = ctx
        c, v = ctx.cfg.cluster, ctx.cfg.verifier
        self.pool = pool or VerifierPool.from_config(v)
        self.transport = transport
        self.pull = self.transport.receiver(in_endpoint or ctx.endpoint(c.hosts.bind_host, c.ports.verifier_port),
                                            decoder=ctx.decoder((GroupsMsg, Heartbeat), "in"), bind=True,
                                            peer="rollout")
        self.push = self.transport.sender(out_endpoint or ctx.endpoint(c.hosts.replay_host, c.ports.replay_port),
                                          peer="replay")
        self.m = ctx.metrics.verifier
        budget = v.message_budget_s
        self.budget_s = math.inf if budget is None else budget  # the config's, also for a pool passed in
        self._write_worker_pids()

    def _write_worker_pids(self) -> None:
        """stop_cluster.sh also checks these: the workers run in their own sessions (sandbox.py)."""
        pids = self.ctx.run_dir / "pids"
        if pids.is_dir():
            (pids / "verifier.children").write_text("\n".join(map(str, self.pool.worker_pids)) + "\n")

    def verify(self, groups: list[Group], decode) -> list[Group]:
        self.m.queue_depth.set(sum(len(g.samples) for g in groups))
        try:
            with self.ctx.busy("verify"):
                results = score_groups(groups, self.pool, decode, budget_s=self.budget_s)
        finally:
            self.m.queue_depth.set(0)
        for r in results:
            self.m.checks_total.labels(reason=r.reason).inc()
            self.m.check_seconds.observe(r.seconds)
            if r.reason == "timeout":
                self.m.timeouts_total.inc()
        return groups

    def run(self, decode) -> None:
        self.ctx.ready(sandbox=self.pool.isolation)
        last_beat = time.monotonic()
        while not self.ctx.stop.is_set():
            env = self.pull.recv(0.2)
            if env is not None and isinstance(env.body, GroupsMsg) and env.body.groups:
                try:
                    groups = self.verify(env.body.groups, decode)
                except Exception:
                    self.ctx.processing_error("verify", f"{len(env.body.groups)} groups from {env.sender}")
                    continue
                for part in split_groups(groups, self.ctx.cfg.cluster.wire.max_message_bytes // 2):
                    self.ctx.send(self.push, make_envelope(GroupsMsg(groups=part), sender=self.ctx.name,
                                                           policy_version=env.policy_version), "verified groups")
                self._write_worker_pids()
            if time.monotonic() - last_beat > self.ctx.cfg.cluster.wire.heartbeat_s:
                last_beat = time.monotonic()
                self.ctx.metrics.set_health(worker_pids=self.pool.worker_pids, sandbox=self.pool.isolation)

    def close(self) -> None:
        self.ctx.write_stats()  # while the sandbox workers are still up
        self.pull.close()
        self.push.close()
        self.pool.close()


def make_decoder(ctx: ServiceContext):
    """Token ids -> text with the policy's tokenizer (the verifier grades text)."""
    from transformers import AutoTokenizer

    from async_vapo.models.base_model import ensure_base_model

    path = ctx.cfg.model.path or ensure_base_model(ctx.cfg, progress=False)
    tok = AutoTokenizer.from_pretrained(str(path))
    return lambda ids: tok.decode(list(ids), skip_special_tokens=True)


def run_verifier(ctx: ServiceContext) -> None:
    decode = make_decoder(ctx)
    with make_transport(ctx) as transport:
        svc = VerifierService(ctx, transport)
        try:
            svc.run(decode)
        finally:
            svc.close()


def main(argv: list[str] | None = None) -> int:
    """Verifier service: sandboxed answer checking between rollout and replay:

        python -m async_vapo.services.verifier --config FILE [--run-dir DIR] [key.sub=value ...]
    """
    from async_vapo.services.context import run_service

    return run_service("verifier", argv, lambda ctx, args: run_verifier(ctx))


if __name__ == "__main__":
    import sys

    sys.exit(main())
