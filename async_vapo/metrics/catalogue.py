"""Every Prometheus metric of the services, declared in one place.

A :class:`MetricSpec` names one metric of one service (``service`` = "rollout", "verifier", "replay", "learner",
or "all" for those every service has), its kind, help text, labels and, for histograms, buckets. A service's
:class:`~async_vapo.metrics.prom.ServiceMetrics` creates every spec of its service (and of "all") when it is
made, so ``/metrics`` shows each series from the first scrape and nothing is created on first use; code asks
for a metric by name (``ServiceMetrics.get``) and a name missing here is an error. The docs' metric reference and
the Grafana dashboard's coverage check read this catalogue.

Names follow ``async_vapo_<service>_<quantity>_<unit>`` (``prom.validate_metric_name`` checks each at creation).
Label values listed in ``series`` are created at start (an absent series would read as "never happened").
Metrics that are not in this catalogue: the process collector's (``process_cpu_seconds_total``,
``process_resident_memory_bytes``, ...) and, where a GPU is visible, the NVML gauges (``gpu_*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]

# Buckets (seconds) for the latency histograms: 1 ms up to 10 minutes.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
                   600.0)
# Buckets (seconds) for weight loads and broadcasts: tens of ms (tiny model) to minutes (7B over NCCL/disk).
TRANSFER_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)
# Policy versions between generation and consumption; max_staleness is small, 16 catches anything pathological.
SAMPLE_AGE_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
LOSS_KINDS = ("policy", "value", "pos_lm")
CLIP_SIDES = ("low", "high")
WEIGHT_WAYS = ("dist", "shm", "zmq", "file", "adapter", "adapter_zmq")  # weights.choose.WAYS
HTTP_REJECT_REASONS = ("capacity", "timeout", "malformed", "unauthorized", "tls")
SERVICES = ("rollout", "verifier", "replay", "learner")
# Version lags of the mismatch gauges: every measured token, then 0, 1, 2 or more versions (algo.mismatch).
MISMATCH_LAGS = ("all", "0", "1", "2+")
MISMATCH_STATS = ("mean", "max")
MASKED_UNITS = ("token", "sequence")
# The value functions scored on held-out responses: the critic and its reference levels (learner.critic_quality).
CRITIC_VALUE_FUNCTIONS = ("critic", "length_only", "slip_aware", "slip_aware_by_step", "prompt_mean", "answer_aware",
                          "critic_before_decisive", "critic_after_decisive")


@dataclass(frozen=True)
class MetricSpec:
    service: str
    """"rollout", "verifier", "replay", "learner", or "all"."""
    name: str
    """Without the ``async_vapo_<service>_`` prefix."""
    kind: MetricKind
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    series: tuple[tuple[str, ...], ...] = ()
    """Label values created at start, one tuple per series (in ``labels`` order)."""

    def full_name(self, service: str | None = None) -> str:
        """``async_vapo_<service>_<name>``; ``service`` is needed for the specs of "all"."""
        s = service or self.service
        if s == "all":
            raise ValueError(f"{self.name} is on every service: name the service")
        return f"async_vapo_{s}_{self.name}"


def _one(label_values: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple((v,) for v in label_values)


C, G, H = "counter", "gauge", "histogram"

CATALOGUE: tuple[MetricSpec, ...] = (
    # -- every service ----------------------------------------------------------------------------------------
    MetricSpec("all", "process_cpu_ratio", G, "Process CPU time over wall time since the last scrape, per core (0-1)."),
    MetricSpec("all", "up", G, "1 while the service reports itself healthy (status ok), else 0."),
    MetricSpec("all", "info", G, "Always 1; labels identify the build.", ("package_version", "python_version")),
    MetricSpec("all", "wire_rejects_total", C, "Messages refused by a decoder (size, version, schema).", ("reason",)),
    MetricSpec("all", "processing_errors_total", C, "Messages that decoded but failed while being processed.",
               ("stage",)),
    MetricSpec("all", "backpressure_total", C, "Sends that found the downstream pipe full for a whole timeout."),
    MetricSpec("all", "busy_seconds_total", C, "Wall-clock seconds spent working, by stage.", ("stage",)),
    MetricSpec("all", "auth_failures_total", C, "Connections refused by CURVE/ZAP: an unknown key, or a key of a role "
               "that socket does not admit."),
    MetricSpec("all", "http_rejects_total", C, "Connections to /metrics and /health closed without an answer or "
               "answered 4xx, by reason.", ("reason",), series=_one(HTTP_REJECT_REASONS)),
    MetricSpec("all", "http_connections", G, "Connections to /metrics and /health open now."),
    # -- rollout ----------------------------------------------------------------------------------------------
    MetricSpec("rollout", "generated_tokens_total", C, "Response tokens generated."),
    MetricSpec("rollout", "generated_samples_total", C, "Responses (samples) generated."),
    MetricSpec("rollout", "model_turns_total", C, "Model turns of the samples generated (one per sample without "
               "rollout.env; more with an environment)."),
    MetricSpec("rollout", "env_tokens_total", C, "Environment tokens (tool output and turn markers) in the samples "
               "generated (rollout.env)."),
    MetricSpec("rollout", "tool_calls_total", C, "Tool calls the environments ran for the samples generated."),
    MetricSpec("rollout", "tool_errors_total", C, "Of those, the calls that did not end with status ok (an "
               "exception, a timeout, a limit, a kill)."),
    MetricSpec("rollout", "tool_seconds_total", C, "Wall seconds of those tool calls."),
    MetricSpec("rollout", "inflight_groups", G, "Prompt groups admitted and not yet finished."),
    MetricSpec("rollout", "served_version", G, "Policy version whose weights the engine is serving."),
    MetricSpec("rollout", "weight_load_seconds", H, "Time to load one policy version into the engine.",
               buckets=TRANSFER_BUCKETS),
    MetricSpec("rollout", "weight_transfers_total", C, "Policy versions loaded, by the way the weights came (dist, "
               "shm, zmq, file; a LoRA version: adapter, adapter_zmq).", ("via",)),
    MetricSpec("rollout", "weight_way", G, "1 for the way the last version came (dist, shm, zmq, file; a LoRA "
               "version: adapter, adapter_zmq), 0 for the others.", ("way",), series=_one(WEIGHT_WAYS)),
    MetricSpec("rollout", "admission_rejects_total", C, "Generation refused at admission, by reason (no_learner, "
               "stale_weights, version_budget).", ("reason",)),
    MetricSpec("rollout", "admission_refills_total", C, "Budgets topped up: the learner reported a wait of "
               "cluster.rollout.admission_starved_s, or no new version came for cluster.rollout.admission_refill_s."),
    MetricSpec("rollout", "admission_given_back_total", C, "Groups of this engine the replay dropped as stale (the "
               "learner's count, in its heartbeats) given back to the engine's admission budget, by kind: late "
               "(arrived stale; at once) or waited (went stale waiting; when the learner is short of groups). Those "
               "matched by a refilled share are not.", ("kind",)),
    # continuous generation (rollout.generation = "continuous")
    MetricSpec("rollout", "sequences_in_flight", G, "Sequences in the engine now (submitted, not finished)."),
    MetricSpec("rollout", "engine_occupancy_ratio", G, "Sequences in flight over rollout.max_in_flight, averaged over "
               "the last second (0-1): how busy the engine is kept."),
    MetricSpec("rollout", "groups_shipped_total", C, "Groups sent to the verifier."),
    MetricSpec("rollout", "engine_threads", G, "The engine's OpenMP threads now: with cluster.deploy.lend_cpus and "
               "cluster.rollout.engine_threads, every core while the learner waits for a batch, its own share while "
               "it works (busy_seconds_total{stage=\"engine_lent\"}: the seconds on every core); 0: not set."),
    MetricSpec("rollout", "group_ship_seconds", H, "From a group's submission to the engine to its shipping.",
               buckets=LATENCY_BUCKETS),
    MetricSpec("rollout", "weight_pause_seconds", H, "Generation paused for one weight update (pause to resume; "
               "with rollout.weight_update = \"wait\" the drain of the requests in flight included).",
               buckets=TRANSFER_BUCKETS),
    MetricSpec("rollout", "multi_version_groups_total", C, "Groups with tokens of more than one weight version "
               "(updated in flight)."),
    MetricSpec("rollout", "tokens_after_switch_total", C, "Tokens generated under a newer version than their "
               "sample's first token (updated in flight)."),
    MetricSpec("rollout", "aborted_groups_total", C, "Groups aborted in the engine and never shipped, by reason "
               "(stale: their oldest token would exceed the staleness bound; error: the engine failed them; "
               "rolled_back: made by weights of a learner that restarted from an older checkpoint).", ("reason",),
               series=(("stale",), ("error",), ("rolled_back",))),
    MetricSpec("rollout", "reprefill_tokens_total", C, "Prompt and response tokens prefilled again after a weight "
               "update (rollout.recompute_kv_after_update)."),
    MetricSpec("rollout", "eval_accuracy", G, "Held-out accuracy of the last evaluation (0-1). Only rollout 0 "
               "evaluates (every train.eval_every versions); 0 before its first evaluation."),
    MetricSpec("rollout", "eval_response_length_tokens", G, "Mean response length (tokens) of the last held-out "
               "evaluation (rollout 0)."),
    MetricSpec("rollout", "eval_policy_version", G, "Policy version of the last held-out evaluation (rollout 0)."),
    # -- verifier ---------------------------------------------------------------------------------------------
    MetricSpec("verifier", "checks_total", C, "Responses checked, by verdict.", ("reason",)),
    MetricSpec("verifier", "timeouts_total", C, "Checks killed at the per-check time limit."),
    MetricSpec("verifier", "rejects_total", C, "Check requests refused before checking.", ("reason",)),
    MetricSpec("verifier", "queue_depth", G, "Check requests waiting for a worker."),
    MetricSpec("verifier", "check_seconds", H, "Wall time of one check.", buckets=LATENCY_BUCKETS),
    # -- replay -----------------------------------------------------------------------------------------------
    MetricSpec("replay", "stored_groups", G, "Prompt groups held in the buffer."),
    MetricSpec("replay", "stale_drops_total", C, "Groups dropped for exceeding max_staleness."),
    MetricSpec("replay", "batch_assembly_seconds", H, "Time to assemble one learner batch.", buckets=LATENCY_BUCKETS),
    MetricSpec("replay", "sample_age_versions", H, "Learner version minus behaviour version of each sample in a "
               "batch.", buckets=SAMPLE_AGE_BUCKETS),
    MetricSpec("replay", "batches_total", C, "Batches handed to the learner."),
    MetricSpec("replay", "rejected_groups_total", C, "Groups refused by validation, by reason.", ("reason",)),
    MetricSpec("replay", "store_errors_total", C, "Groups the store refused (disk full, I/O error): held and retried, "
               "never dropped.", ("errno",)),
    MetricSpec("replay", "held_groups", G, "Groups received but not yet stored (waiting for the disk)."),
    MetricSpec("replay", "rejected_requests_total", C, "Batch requests refused (never acted on), by reason.",
               ("reason",)),
    MetricSpec("replay", "requeued_groups_total", C, "Groups served to a learner that did not keep them (restarted "
               "from a checkpoint, or a lost reply), stored again."),
    MetricSpec("replay", "requeue_lost_groups_total", C, "Groups to store again that compaction had removed from the "
               "log (lost)."),
    # -- learner ----------------------------------------------------------------------------------------------
    MetricSpec("learner", "step_seconds", H, "Wall time of one learner update step.", buckets=LATENCY_BUCKETS),
    MetricSpec("learner", "loss", G, "Last update's loss, by term.", ("kind",), series=_one(LOSS_KINDS)),
    MetricSpec("learner", "reward", G, "Mean reward of the last batch."),
    MetricSpec("learner", "accuracy", G, "Fraction of correct responses in the last batch (0-1)."),
    MetricSpec("learner", "entropy", G, "Mean token entropy of the policy on the last batch (nats)."),
    MetricSpec("learner", "clipfrac", G, "Fraction of tokens whose ratio was clipped, by side (0-1).", ("side",),
               series=_one(CLIP_SIDES)),
    MetricSpec("learner", "explained_variance", G, "Critic explained variance of the returns (NaN when they do not "
               "vary)."),
    MetricSpec("learner", "version", G, "Policy version after the last update."),
    MetricSpec("learner", "broadcast_seconds", H, "Time from the start of a version's publish to the last ack of the "
               "engines in rotation.", buckets=TRANSFER_BUCKETS),
    MetricSpec("learner", "weight_fetch_bytes_total", C, "Weight bytes sent to engines fetching over ZeroMQ (other "
               "hosts)."),
    MetricSpec("learner", "value_pretrain_steps_total", C, "Critic-only pretraining steps."),
    MetricSpec("learner", "invalid_groups_total", C, "Groups refused before learning (a token outside the vocabulary, "
               "a non-finite log-prob or reward, ...)."),
    MetricSpec("learner", "critic_explained_variance_by_age", G, "Critic explained variance before the update, by "
               "sample age in versions (NaN: undefined).", ("age",)),
    MetricSpec("learner", "critic_heldout_explained_variance", G, "Explained variance of the Monte-Carlo returns of "
               "held-out responses by the critic and, on the same responses, by reference value functions that know "
               "only the problem's length or also the first slip, with one slip rate or one per step position; where "
               "the verifier extracts an answer, that know the prompt's leave-one-out success rate (prompt_mean) or "
               "also the outcome once the decisive token is written (answer_aware), and the critic's own before and "
               "after that token (learner.critic_quality; NaN: undefined).",
               ("value_function",), series=_one(CRITIC_VALUE_FUNCTIONS)),
    MetricSpec("learner", "critic_fresh_explained_variance", G, "Critic explained variance of the returns of the last "
               "batch, taken before the critic trained on it (fresh responses to problems it has not seen; NaN: "
               "undefined)."),
    MetricSpec("learner", "critic_value_error_abs_by_age", G, "Critic mean absolute value error before the update, "
               "by sample age in versions (NaN: undefined).", ("age",)),
    MetricSpec("learner", "mismatch_kl_nats", G, "k3 estimate of KL(behaviour || proximal) per token over the last "
               "update's tokens with an engine log-prob, by version lag (NaN: no token of that lag).", ("lag",),
               series=_one(MISMATCH_LAGS)),
    MetricSpec("learner", "mismatch_abs_log_ratio", G, "|log pi_proximal - log pi_behaviour| per token over the last "
               "update, mean or max, by version lag (NaN: no token of that lag).", ("stat", "lag"),
               series=tuple((s, lag) for s in MISMATCH_STATS for lag in MISMATCH_LAGS)),
    MetricSpec("learner", "mismatch_seq_abs_log_ratio", G, "|sum over a response of log pi_proximal - log "
               "pi_behaviour| (its log sequence ratio) over the last update's responses, mean or max.", ("stat",),
               series=_one(MISMATCH_STATS)),
    MetricSpec("learner", "mismatch_seq_kl_nats", G, "Sum over a response of the per-token k3 estimates, mean over "
               "the last update's responses (a sequence-level KL estimate)."),
    MetricSpec("learner", "correction_truncated_ratio", G, "Share of the last update's tokens whose behaviour weight "
               "the cap lowered (algo.behavior_weight_cap, 0-1)."),
    MetricSpec("learner", "correction_weight", G, "Behaviour importance weight on the last update's tokens, mean or "
               "max (1 = none).", ("stat",), series=_one(MISMATCH_STATS)),
    MetricSpec("learner", "correction_masked_ratio", G, "Share of the last update's tokens, or of its responses "
               "(every token), that the behaviour mask removed from the policy loss (algo.behavior_mask, 0-1).",
               ("unit",), series=_one(MASKED_UNITS)),
    MetricSpec("learner", "replay_timeouts_total", C, "Batch requests the replay did not answer."),
    MetricSpec("learner", "stale_groups_rejected_total", C, "Groups in a batch beyond the staleness bound (never "
               "used)."),
    MetricSpec("learner", "batch_wait_seconds_total", C, "Time spent waiting for batches."),
    MetricSpec("learner", "trained_tokens_by_lag_total", C, "Response tokens trained on, by the version lag of the "
               "weights that sampled them (the learner's version minus the token's: 0, 1, 2, 3+).", ("lag",),
               series=(("0",), ("1",), ("2",), ("3+",))),
    MetricSpec("learner", "engines_in_rotation", G, "Rollout engines whose acks a new version waits for."),
    MetricSpec("learner", "engines_dropped_total", C, "Engines taken out of rotation for missing an ack."),
    MetricSpec("learner", "engines_dead_total", C, "Engines taken out of rotation for silence "
               "(cluster.wire.peer_dead_s)."),
    MetricSpec("learner", "engines_rejoined_total", C, "Engines back in rotation after acking the latest."),
    MetricSpec("learner", "weight_load_failures_total", C, "Acks reporting a failed weight load."),
    MetricSpec("learner", "engines_by_weight_way", G, "Engines by the way they take their weights now (dist, shm, "
               "zmq, file; \"auto\" chooses per engine; a LoRA version: adapter, adapter_zmq).", ("way",),
               series=_one(WEIGHT_WAYS)),
    MetricSpec("learner", "weight_dist_failures_total", C, "Versions an engine did not receive over its "
               "torch.distributed group (its group torn down)."),
    MetricSpec("learner", "weight_dist_send_seconds", H, "Seconds to stream one version to one engine over its group.",
               buckets=TRANSFER_BUCKETS),
)


def specs_for(service: str) -> tuple[MetricSpec, ...]:
    """The specs a service of this name creates: its own and those of "all"."""
    return tuple(s for s in CATALOGUE if s.service in (service, "all"))


def check_catalogue() -> None:
    """Raise on a duplicate (service, name) or a spec whose series do not match its labels."""
    seen: set[tuple[str, str]] = set()
    for s in CATALOGUE:
        if s.service not in (*SERVICES, "all"):
            raise ValueError(f"{s.name}: unknown service {s.service!r}")
        clash = [(x, s.name) for x in ((s.service,) if s.service != "all" else (*SERVICES, "all"))
                 if (x, s.name) in seen or ("all", s.name) in seen]
        if clash:
            raise ValueError(f"{s.name} is declared twice")
        seen.add((s.service, s.name))
        if (s.kind == "histogram") != (s.buckets is not None):
            raise ValueError(f"{s.name}: buckets go with histograms, and only with them")
        if any(len(v) != len(s.labels) for v in s.series):
            raise ValueError(f"{s.name}: each series needs one value per label {s.labels}")
        if not s.help:
            raise ValueError(f"{s.name}: give a help text")


check_catalogue()
