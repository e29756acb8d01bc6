"""The metric catalogue is the one place metrics are declared: every service creates exactly its specs at start,
and no library module creates a metric of its own."""

import re
from pathlib import Path

import pytest

from async_vapo.metrics.catalogue import CATALOGUE, SERVICES, MetricSpec, check_catalogue, specs_for
from async_vapo.metrics.prom import ServiceMetrics

PACKAGE = Path(__file__).resolve().parents[2] / "async_vapo"


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_creates_every_spec_of_its_own_and_of_all_at_start(service):
    m = ServiceMetrics(service, gpu=False)
    want = sorted(s.full_name(service) for s in specs_for(service))
    assert m.names() == want
    for s in specs_for(service):
        metric = m.get(s.name)
        assert metric._type == ("gauge" if s.kind == "gauge" else s.kind)
        assert tuple(metric._labelnames) == s.labels
        assert metric._documentation == s.help


def test_a_metric_the_catalogue_does_not_declare_for_the_service_is_an_error():
    m = ServiceMetrics("replay", gpu=False)
    with pytest.raises(KeyError, match="not declared in async_vapo.metrics.catalogue for the replay service"):
        m.get("served_version")  # a rollout metric


def test_pre_created_series_are_exposed_from_the_first_scrape():
    text = ServiceMetrics("learner", gpu=False).exposition().decode()
    for kind in ("policy", "value", "pos_lm"):
        assert f'async_vapo_learner_loss{{kind="{kind}"}}' in text
    assert 'async_vapo_learner_engines_by_weight_way{way="dist"} 0.0' in text


def test_no_library_module_creates_a_metric_outside_the_catalogue():
    factory = re.compile(r"\.(counter|gauge|histogram)\(\s*f?\"")
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if p.name not in ("prom.py", "catalogue.py") and factory.search(p.read_text())]
    assert offenders == []


def test_the_catalogue_check_refuses_duplicates_and_series_that_do_not_match_labels(monkeypatch):
    import async_vapo.metrics.catalogue as cat

    dup = (*CATALOGUE, MetricSpec("rollout", "up", "gauge", "again"))
    monkeypatch.setattr(cat, "CATALOGUE", dup)
    with pytest.raises(ValueError, match="declared twice"):
        check_catalogue()
    bad = (MetricSpec("learner", "x_total", "counter", "x", ("a", "b"), series=(("only-one",),)),)
    monkeypatch.setattr(cat, "CATALOGUE", bad)
    with pytest.raises(ValueError, match="one value per label"):
        check_catalogue()
