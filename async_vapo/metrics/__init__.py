"""Observability: Prometheus metrics and health endpoints (:mod:`.prom`), run plots (:mod:`.plots`).

``plots`` is not imported here so that services do not pay for matplotlib."""

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
