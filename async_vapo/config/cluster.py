"""Where each of the cluster's services is, from the config alone: its host, its metrics port, the CURVE keys'
directory. The launcher (``async_vapo.deploy``) and the services (``async_vapo.services.context``) both read them here,
so that starting a cluster never imports a service's runtime."""

from __future__ import annotations

from pathlib import Path

from async_vapo.config.schema import Config

SERVICES = ("replay", "verifier", "rollout", "learner")
"""The cluster's services, in the order they are started."""


def metrics_port(cfg: Config, service: str, instance: int = 0) -> int:
    """The port of ``service`` replica ``instance``'s /metrics and /health (``cluster.ports``)."""
    c = cfg.cluster
    return {"replay": c.ports.replay_metrics_port, "verifier": c.ports.verifier_metrics_port,
            "learner": c.ports.learner_metrics_port + instance,
            "rollout": c.ports.rollout_metrics_port + instance}[service]


def service_host(cfg: Config, service: str, instance: int = 0) -> str:
    """The address other machines (and Prometheus) reach ``service`` replica ``instance`` at."""
    c = cfg.cluster
    if service == "rollout":
        return c.hosts.rollout_hosts[instance % len(c.hosts.rollout_hosts)] if c.hosts.rollout_hosts else "127.0.0.1"
    return {"replay": c.hosts.replay_host, "verifier": c.hosts.verifier_host, "learner": c.hosts.learner_host}[service]


def keys_dir(cfg: Config, run_dir: Path) -> Path:
    """Where the cluster's CURVE keys are: ``cluster.security.keys_dir``, or RUN_DIR/keys."""
    d = cfg.cluster.security.keys_dir
    return Path(d).expanduser() if d else Path(run_dir) / "keys"
