"""The monitoring files against the metric catalogue (``async_vapo.metrics.catalogue``): every metric is on a panel of
``deploy/grafana/async-vapo-dashboard.json`` or listed on its "not on this dashboard" panel with a reason; every query
is filtered by the run variable; and the alert rules of ``deploy/prometheus/alerts.yml`` pass ``promtool check
rules`` and fire, alert by alert, on synthetic series of the failure they name (``promtool test rules``), and not on
a healthy cluster."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from async_vapo.metrics.catalogue import CATALOGUE, SERVICES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/async-vapo-dashboard.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yml"
NAME = re.compile(r"\basync_vapo_[a-z0-9_]*[a-z0-9]\b")
QUOTED = re.compile(r'"[^"]*"')


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def _left_off(dash: dict) -> dict[str, str]:
    """The "not on this dashboard" panel's table: {catalogue name: reason}."""
    [panel] = [p for p in dash["panels"] if p["type"] == "text" and p["title"] == "Metrics not on this dashboard"]
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (.*) \|$", panel["options"]["content"], flags=re.M)
    return dict(rows)


def _on_a_panel(full_name: str, exprs: list[str]) -> bool:
    text = " ".join(exprs)
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for n in NAME.findall(QUOTED.sub("", text))}
    patterns = re.findall(r'__name__=~"([^"]+)"', text)
    return full_name in names or any(re.fullmatch(p, full_name) for p in patterns)


def test_every_catalogue_metric_is_on_a_panel_or_left_off_with_a_reason():
    dash = _dashboard()
    exprs, left_off = _exprs(dash), _left_off(dash)
    missing, listed_but_shown = [], []
    for spec in CATALOGUE:
        services = SERVICES if spec.service == "all" else (spec.service,)
        shown = [_on_a_panel(spec.full_name(s), exprs) for s in services]
        if spec.name in left_off:
            if any(shown):
                listed_but_shown.append(spec.name)
        elif not all(shown):
            missing.append(", ".join(spec.full_name(s) for s, ok in zip(services, shown, strict=True) if not ok))
    assert not missing, f"on no panel and not listed as left off: {missing}"
    assert not listed_but_shown, f"listed as left off but on a panel: {listed_but_shown}"
    declared = {s.name for s in CATALOGUE}
    assert set(left_off) <= declared, sorted(set(left_off) - declared)
    assert all(len(why) > 20 for why in left_off.values()), left_off


def test_the_coverage_check_sees_a_metric_on_no_panel():
    exprs = ['sum(rate(async_vapo_learner_step_seconds_count{run=~"$run"}[5m]))',
             '{__name__=~"async_vapo_.+_up", run=~"$run"}']
    assert _on_a_panel("async_vapo_learner_step_seconds", exprs)
    assert _on_a_panel("async_vapo_replay_up", exprs)
    assert not _on_a_panel("async_vapo_learner_batch_wait_seconds_total", exprs)
    assert not _on_a_panel("async_vapo_learner_step", exprs)


def test_every_query_is_filtered_by_the_run_variable():
    dash = _dashboard()
    [run] = [v for v in dash["templating"]["list"] if v["name"] == "run"]
    assert run["type"] == "query" and run["query"]["query"] == 'label_values(up{job="async-vapo"}, run)'
    assert run["includeAll"] and run["allValue"] == ".*"
    for expr in _exprs(dash):
        outside_quotes = QUOTED.sub('""', expr)
        selectors = len(NAME.findall(outside_quotes)) + expr.count("__name__=~")
        assert selectors and expr.count('run=~"$run"') == selectors, expr
    tmpl = (ROOT / "deploy/prometheus/prometheus.yml.tmpl").read_text()
    assert "relabel_configs:\n      - target_label: run\n        replacement: ${run_name}" in tmpl


def test_learner_samples_and_the_weight_ways_are_on_panels():
    panels = {p["title"]: p for p in _dashboard()["panels"]}
    samples = panels["Learner samples/s"]["targets"][0]["expr"]
    assert samples.startswith("sum(rate(async_vapo_replay_sample_age_versions_count")
    [by_way] = [p for t, p in panels.items() if t.startswith("Weight versions loaded/s by way")]
    assert "dist" in by_way["title"] and "sum by (via)" in by_way["targets"][0]["expr"]


def test_panels_have_unique_ids_and_do_not_overlap():
    panels = _dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
    for p in panels:
        if p["type"] not in ("row", "text"):
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


# ------------------------------------------------------------------------------------------------- alert rules


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool (Debian's prometheus package: .ci/install_prometheus.sh)")
    return promtool


def test_alert_rules_pass_promtool_and_use_catalogue_names():
    yaml = pytest.importorskip("yaml")
    out = subprocess.run([_promtool(), "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert {"AsyncVapoServiceDown", "AsyncVapoEngineDropped", "AsyncVapoLearnerStarving",
            "AsyncVapoStalenessViolation", "AsyncVapoReplayDiskHold"} <= names
    declared = {s.full_name(x) for s in CATALOGUE for x in (SERVICES if s.service == "all" else (s.service,))}
    for r in rules:
        used = set(NAME.findall(QUOTED.sub("", r["expr"])))
        assert used <= declared, (r["alert"], sorted(used - declared))
        assert r["labels"]["severity"] in ("warning", "critical")
        assert r["annotations"]["summary"] and r["annotations"]["description"]


# One timeline (15 s samples; in promtool's notation "a x n" is n + 1 samples) with every failure in it, and healthy
# series beside them that must never alert. The verifier's scrape fails from 30 s (down alert from 1m30s) and it
# reports itself unhealthy throughout (from 5m); no engine is in rotation from 1m (from 3m) after one was dropped at
# 1m (while the 10m increase sees it: 1m to about 11m); the learner waits 97% of the time from the start (its 5m rate,
# divided by the whole 5 minutes, passes 0.8 near 4m10s: from about 14m10s); 2 stale groups reach it at 2m15s (to
# about 12m15s); the replay holds 3 groups for the disk from 1m15s (from 3m15s). Each evaluation time is at least
# 30 s from any of these edges.
L = 'service="learner",replica="0",run="r",job="async-vapo",instance="127.0.0.1:9203"'
V = 'service="verifier",replica="0",run="r",job="async-vapo",instance="127.0.0.1:9202"'
P = 'service="replay",replica="0",run="r",job="async-vapo",instance="127.0.0.1:9201"'
SERIES = {
    f"up{{{V}}}": "1 1 0x120",
    f"up{{{P}}}": "1x122",
    f"async_vapo_verifier_up{{{V}}}": "0x122",
    f"async_vapo_replay_up{{{P}}}": "1x122",
    f"async_vapo_learner_version{{{L}}}": "0+1x122",
    f"async_vapo_learner_engines_in_rotation{{{L}}}": "2 2 2 2 0x118",
    f"async_vapo_learner_engines_dropped_total{{{L}}}": "0 0 0 0 1x118",
    f"async_vapo_learner_engines_dead_total{{{L}}}": "0x122",
    f"async_vapo_learner_batch_wait_seconds_total{{{L}}}": "0+14.5x122",
    f"async_vapo_learner_stale_groups_rejected_total{{{L}}}": "0x8 2x113",
    f"async_vapo_replay_held_groups{{{P}}}": "0x4 3x117",
    f"async_vapo_replay_stored_groups{{{P}}}": "10x122",
}
LABELS = {s: dict(kv.split("=") for kv in s.replace('"', "").split(",")) for s in (L, V, P)}
SERVICE = {"AsyncVapoServiceDown": V, "AsyncVapoServiceUnhealthy": V, "AsyncVapoNoEngineInRotation": L,
           "AsyncVapoEngineDropped": L, "AsyncVapoLearnerStarving": L, "AsyncVapoStalenessViolation": L,
           "AsyncVapoReplayDiskHold": P}
SEVERITY = {"AsyncVapoServiceUnhealthy": "warning", "AsyncVapoEngineDropped": "warning",
            "AsyncVapoLearnerStarving": "warning"}
_4M = {"AsyncVapoServiceDown", "AsyncVapoEngineDropped", "AsyncVapoNoEngineInRotation",
       "AsyncVapoStalenessViolation", "AsyncVapoReplayDiskHold"}
FIRING = {  # evaluation time -> the alerts firing then (every other alert must not be)
    "45s": set(),  # the verifier down for 15 s: pending (for: 1m), not firing
    "2m": {"AsyncVapoServiceDown", "AsyncVapoEngineDropped"},
    "4m": _4M,
    "6m": _4M | {"AsyncVapoServiceUnhealthy"},
    "16m": {"AsyncVapoServiceDown", "AsyncVapoServiceUnhealthy", "AsyncVapoNoEngineInRotation",
            "AsyncVapoReplayDiskHold", "AsyncVapoLearnerStarving"},  # the drop and the stale groups are 10m old
}


def _expected(time: str, alert: str) -> list[dict]:
    if alert not in FIRING[time]:
        return []
    return [{"exp_labels": {**LABELS[SERVICE[alert]], "severity": SEVERITY.get(alert, "critical")}}]


def test_each_alert_fires_on_its_failure_and_not_on_a_healthy_cluster(tmp_path):
    yaml = pytest.importorskip("yaml")
    promtool = _promtool()
    # promtool compares annotations too; the rules are tested here without theirs (check rules parses the templates)
    rules = yaml.safe_load(ALERTS.read_text())
    for r in rules["groups"][0]["rules"]:
        r.pop("annotations")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))
    alerts = [r["alert"] for r in rules["groups"][0]["rules"]]
    assert set(alerts) == set(SERVICE) | set(PROGRESS_FIRING["40m"])  # the learner's progress: tested below
    cases = [{"eval_time": t, "alertname": a, "exp_alerts": _expected(t, a)} for t in FIRING for a in alerts]
    test = {"rule_files": ["alerts.yml"], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in SERIES.items()],
                       "alert_rule_test": cases}]}
    (tmp_path / "alerts_test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "alerts_test.yml"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    # every rule fires somewhere in the timeline and is silent somewhere, so none passes by always or never matching
    assert set().union(*FIRING.values()) == set(SERVICE) and not FIRING["45s"]


# The learner's progress, on a timeline of its own (40 minutes, 15 s samples): a healthy run (version and losses
# moving), a run whose learner stops updating after 1m (no change within 5m from about 5m45s; held 30m: firing from
# about 35m45s), one whose policy loss turns NaN at 2m and one whose value loss is +Inf from 3m (at once).
R = 'service="learner",replica="0",job="async-vapo",instance="127.0.0.1:9203",run="{}"'
PROGRESS_SERIES = {
    f"async_vapo_learner_version{{{R.format('ok')}}}": "0+1x160",
    f"async_vapo_learner_value_pretrain_steps_total{{{R.format('ok')}}}": "0x160",
    f'async_vapo_learner_loss{{{R.format("ok")},kind="policy"}}': "0.5+0.01x160",
    f"async_vapo_learner_version{{{R.format('stuck')}}}": "0 1 2 3 4x156",
    f"async_vapo_learner_value_pretrain_steps_total{{{R.format('stuck')}}}": "0x160",
    f"async_vapo_learner_version{{{R.format('nan')}}}": "0+1x160",
    f"async_vapo_learner_value_pretrain_steps_total{{{R.format('nan')}}}": "0x160",
    f'async_vapo_learner_loss{{{R.format("nan")},kind="policy"}}': "0.5x7 " + " ".join(["NaN"] * 153),
    f'async_vapo_learner_loss{{{R.format("nan")},kind="value"}}': "0.1x11 " + " ".join(["Inf"] * 149),
}
PROGRESS_FIRING = {  # evaluation time -> {alert: the runs (and loss kinds) it fires for}
    "1m30s": {"AsyncVapoLearnerNoUpdate": [], "AsyncVapoLearnerLossNotFinite": []},
    "2m30s": {"AsyncVapoLearnerNoUpdate": [], "AsyncVapoLearnerLossNotFinite": [("nan", "policy")]},
    "20m": {"AsyncVapoLearnerNoUpdate": [], "AsyncVapoLearnerLossNotFinite": [("nan", "policy"), ("nan", "value")]},
    "40m": {"AsyncVapoLearnerNoUpdate": [("stuck", None)],
            "AsyncVapoLearnerLossNotFinite": [("nan", "policy"), ("nan", "value")]},
}


def test_the_learner_progress_alerts_fire_on_a_stuck_learner_and_a_non_finite_loss(tmp_path):
    yaml = pytest.importorskip("yaml")
    promtool = _promtool()
    rules = yaml.safe_load(ALERTS.read_text())
    for r in rules["groups"][0]["rules"]:
        r.pop("annotations")
    (tmp_path / "alerts.yml").write_text(yaml.safe_dump(rules))

    def expected(run: str, kind: str | None) -> dict:
        labels = dict(kv.split("=") for kv in R.format(run).replace('"', "").split(","))
        return {"exp_labels": {**labels, **({"kind": kind} if kind else {}), "severity": "critical"}}

    cases = [{"eval_time": t, "alertname": a, "exp_alerts": [expected(*x) for x in fired]}
             for t, by_alert in PROGRESS_FIRING.items() for a, fired in by_alert.items()]
    test = {"rule_files": ["alerts.yml"], "evaluation_interval": "15s",
            "tests": [{"interval": "15s",
                       "input_series": [{"series": s, "values": v} for s, v in PROGRESS_SERIES.items()],
                       "alert_rule_test": cases}]}
    (tmp_path / "progress_test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "progress_test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
