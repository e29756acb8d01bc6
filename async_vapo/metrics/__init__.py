"""Observability: Prometheus metrics and health endpoints (:mod:`.prom`), metric rows (:mod:`.jsonl`), evaluation
figures (:mod:`.passk`). Plots are ``async_vapo.experiments.plots`` (matplotlib stays out of the services)."""

from async_vapo.metrics.prom import (
    HEALTH_STATUSES,
    LearnerMetrics,
    MetricsServer,
    ReplayMetrics,
    RolloutMetrics,
    ServiceMetrics,
    VerifierMetrics,
    render_prometheus_config,
    validate_label_names,
    validate_metric_name,
    write_file_sd_targets,
)

__all__ = [
    "HEALTH_STATUSES",
    "LearnerMetrics",
    "MetricsServer",
    "ReplayMetrics",
    "RolloutMetrics",
    "ServiceMetrics",
    "VerifierMetrics",
    "render_prometheus_config",
    "validate_label_names",
    "validate_metric_name",
    "write_file_sd_targets",
]
