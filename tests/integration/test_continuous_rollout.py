"""The rollout service in continuous mode (``rollout.generation = "continuous"``): the whole pipeline in one pytest
process over the in-process transport with vLLM's async engine, a request per group, new weights loaded in flight.

Budget: four short runs of under a minute each (5, 5, 5 and 3 updates), on the session's continuous engine
(tests/conftest.py)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import TINY_TEST_OVERRIDES

from async_vapo.config import load_config
from async_vapo.services.context import SERVICES, make_context


def _run(cfg, engine, tiny_base, run_dir, total: int, setup=None) -> tuple[list[dict], dict]:
    """Run the four services in threads until the learner's DONE; ``setup(rollout, learner)`` runs before they
    start."""
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService
    from async_vapo.services.rollout import RolloutService
    from async_vapo.services.verifier import VerifierService
    from async_vapo.tasks import load_task
    from async_vapo.transport import InprocTransport

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    engine.load_weights(load_policy(tiny_base).state_dict(), 0)
    ctxs = {s: make_context(s, cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
            for s in SERVICES}
    train_set, eval_set = load_task(cfg)
    transport = InprocTransport()
    replay, verifier = ReplayService(ctxs["replay"], transport), VerifierService(ctxs["verifier"], transport)
    learner = LearnerService(ctxs["learner"], transport)
    rollout = RolloutService(ctxs["rollout"], transport, engine, tok, train_set, eval_set,
                             pretrain_batches=cfg.algo.value_pretrain_steps)
    assert rollout.continuous is not None
    if setup is not None:
        setup(rollout, learner)
    decode = lambda ids: tok.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    threads = [threading.Thread(target=replay.run, daemon=True),
               threading.Thread(target=verifier.run, args=(decode,), daemon=True),
               threading.Thread(target=learner.run, daemon=True), threading.Thread(target=rollout.run, daemon=True)]
    path = run_dir / "metrics.jsonl"
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 300
        while not (run_dir / "DONE").exists():
            assert time.monotonic() < deadline, "the continuous pipeline did not train in time"
            assert all(t.is_alive() for t in threads), "a service loop died"
            time.sleep(0.2)
        m = ctxs["rollout"].metrics
        figures = {name: m.get(name)._value.get() for name in
                   ("groups_shipped_total", "multi_version_groups_total", "tokens_after_switch_total")}
        figures["aborted"] = {r: m.get("aborted_groups_total").labels(reason=r)._value.get()
                              for r in ("stale", "error", "rolled_back")}
        figures["pauses"] = m.get("weight_pause_seconds")._sum.get()
    finally:
        for ctx in ctxs.values():
            ctx.stop.set()
        for t in threads:
            t.join(60)
        for svc in (rollout, learner, verifier, replay):
            svc.close()
        transport.close()
    return [json.loads(x) for x in path.read_text().splitlines()], figures


def _cfg(tiny_cfg, tmp_path, *extra):
    return load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "train.total_steps=3",
                            "train.eval_every=3", "train.checkpoint_every=0", "cluster.weights.transfer=shm",
                            "cluster.replay.fsync=never", "cluster.wire.batch_poll_s=0.05",
                            "cluster.wire.heartbeat_s=0.2", "cluster.rollout.eval=false",
                            "rollout.generation=continuous", "rollout.max_response_tokens=120",
                            f"cluster.weights.dir={tmp_path / 'w'}", *extra])


def _record_submits(engine, events: list, monkeypatch) -> None:
    """Append ("submit", the served version) to ``events`` at each training group the engine is given (not the
    evaluation's own requests)."""
    real_submit = engine.submit

    def submit(key, *args, **kwargs):
        if not key.startswith("generate-"):
            events.append(("submit", engine.version))
        return real_submit(key, *args, **kwargs)

    monkeypatch.setattr(engine, "submit", submit)


def _check_keep_run(cfg, rows: list[dict], figures: dict, run_dir) -> list[dict]:
    """A five-update ``keep`` run at max_staleness 1: every step trained, no token more than one version behind,
    groups shipped one by one, no engine error, each version a pause; the engine's time with requests in flight
    recorded as the generate stage's busy time. Returns the train rows."""
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5]
    assert all(0 <= r["replay/max_age"] <= 1 and 0 <= r["replay/token_lag_max"] <= 1 for r in train), train
    assert figures["groups_shipped_total"] >= 5 * cfg.algo.prompts_per_step
    assert figures["aborted"]["error"] == 0
    assert figures["pauses"] > 0  # each version paused the engine
    # the engine's time with requests in flight is the generate stage's busy time, as a lock-step call's is
    busy = [json.loads(x) for x in (run_dir / "stats" / "rollout-0.busy.jsonl").read_text().splitlines()]
    generate = [(a, b) for stage, a, b in busy if stage == "generate"]
    assert generate and all(b >= a for a, b in generate)
    # recorded, and no longer than the run (its last row, plus 10 s for the engine's tail while the run stops); how
    # long depends on the machine's speed (0.75 s on a fast one), so no lower bound above zero
    assert 0 < sum(b - a for a, b in generate) <= max(r["wall_s"] for r in rows) + 10
    return train


@pytest.mark.slow
def test_keep_trains_within_the_bound_of_every_token(continuous_engine, tiny_cfg, tiny_base, tmp_path, monkeypatch):
    """max_staleness 1, weights updated in flight ("keep"): every step trains, and no token of a trained group is
    more than one version behind the learner (the bound is the oldest token's); groups are shipped one by one.

    With the held-out evaluation of version 2 on, beside training (``cluster.rollout.eval_share`` 0.5): the engine
    goes on submitting and shipping training groups meanwhile, while the learner moves on; it loads nothing until the
    evaluation ends (every evaluated token is version 2's), then takes the learner's latest version at once, before
    it starts groups again (groups started at the evaluated version then would be more of it than the learner can
    still use). The case is set up by construction, whatever the machine's load: the learner's update from version 2
    waits until the evaluation has begun, and the evaluation is held (its requests not yet submitted) until the
    learner has announced a later version and the engine has shipped a training group during it. Five updates, so
    that the learner cannot finish on what the engine made before it took version 3."""
    import async_vapo.services.rollout as rollout_module

    continuous_engine.weight_update = "keep"
    cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=keep", "train.total_steps=5",
               "train.eval_every=2", "cluster.rollout.eval=true", "cluster.rollout.eval_share=0.5")
    # ("submit", served version), ("ship",), ("load", version), ("eval_start", version),
    # ("evaluated", version, the learner's announced version, the served version at its end)
    events: list[tuple] = []
    held: dict[str, float] = {}

    def setup(rollout, learner):
        real_evaluate, driver = rollout_module.run_evaluation, rollout.continuous
        real_update, real_ship, real_loaded = learner.learner.update, driver._ship, rollout.weights.on_loaded
        evaluating = threading.Event()

        def update(*args, **kwargs):
            if learner.learner.version == 2:
                evaluating.wait(150)
            return real_update(*args, **kwargs)

        def evaluate(*args, **kwargs):
            v = continuous_engine.version
            if v == 2:
                events.append(("eval_start", v))
                evaluating.set()
                t0, deadline = time.monotonic(), time.monotonic() + 150
                while time.monotonic() < deadline and not (
                        learner.sync.rotation.latest > v and ("ship",) in events[events.index(("eval_start", v)):]):
                    time.sleep(0.05)
                held["s"] = time.monotonic() - t0
            out = real_evaluate(*args, **kwargs)
            events.append(("evaluated", v, learner.sync.rotation.latest, continuous_engine.version))
            return out

        def ship(fg):
            events.append(("ship",))
            return real_ship(fg)

        def loaded(version, way):
            events.append(("load", version))
            return real_loaded(version, way)

        monkeypatch.setattr(learner.learner, "update", update)
        monkeypatch.setattr(rollout_module, "run_evaluation", evaluate)
        _record_submits(continuous_engine, events, monkeypatch)
        monkeypatch.setattr(driver, "_ship", ship)
        monkeypatch.setattr(rollout.weights, "on_loaded", loaded)

    rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 5, setup)
    train = _check_keep_run(cfg, rows, figures, tmp_path / "run")
    # the evaluation of version 2: the learner moved on during it, the engine still served version 2 at its end, and
    # training groups were shipped and none of its loads happened while it ran
    assert 2 in [r["step"] for r in rows if r["kind"] == "eval"], rows
    i = events.index(("eval_start", 2))
    j = next(k for k, e in enumerate(events) if e[0] == "evaluated" and e[1] == 2)
    _, _, learner_then, served_then = events[j]
    assert learner_then > 2, f"the learner did not move on in {held.get('s', 0):.0f} s of generation at version 2"
    assert served_then == 2, f"the engine served version {served_then} at the end of version 2's evaluation"
    assert ("ship",) in events[i:j], "no training group was shipped during the evaluation"
    assert not [e for e in events[i:j] if e[0] == "load"], events[i:j]
    # after it: the first load is the learner's latest (or later), and every group started after that load is of it
    k = next(k for k in range(j, len(events)) if events[k][0] == "load")
    assert events[k][1] >= learner_then, events[j:k + 1]
    after = [e[1] for e in events[k:] if e[0] == "submit"]
    assert after and min(after) >= learner_then, events[j:]
    print("continuous keep:", figures, [(r["replay/token_lag_mean"], r["replay/multi_version_samples"])
                                        for r in train], f"evaluation of version 2 held {held.get('s', 0):.1f} s",
          f"groups shipped during it: {events[i:j].count(('ship',))}")


@pytest.mark.slow
def test_keep_with_the_evaluation_alone_takes_the_new_version_before_new_groups(continuous_engine, tiny_cfg, tiny_base,
                                                                                 tmp_path, monkeypatch):
    """As above, with the held-out evaluation alone (``cluster.rollout.eval_share`` 0, the default): the learner
    moves on while the engine evaluates, and the engine
    takes the new version before it starts groups again. Groups started at the evaluated version would be more of it
    than the learner can still use (they went stale waiting, 8 per evaluation on the embedded default, and the
    engine's lead was lost for the rest of the run). The case is set up by construction, whatever the machine's
    load: until that evaluation has run, the engine leaves one group of version 2's budget unmade (so that it could
    still start a group of version 2 after it); the learner's update from version 2 waits until the evaluation has
    begun (so that the engine cannot skip it as a version the learner has already left); and the evaluation is held
    while the engine goes on generating and shipping (its own fill and ship, no new weights taken) until the learner
    has trained and published version 3. Five updates, so that the learner cannot finish on what the engine made
    before it took version 3 (the bound lets groups of version 2 train up to update 4): the engine starts groups
    after the evaluation."""
    import async_vapo.services.rollout as rollout_module

    continuous_engine.weight_update = "keep"
    cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=keep", "train.total_steps=5",
               "train.eval_every=2", "cluster.rollout.eval=true", "cluster.rollout.eval_share=0")
    events: list[tuple] = []  # ("submit", served version), ("evaluated", version, the learner's announced version)
    held: dict[str, float] = {}

    def setup(rollout, learner):
        real_evaluate, driver = rollout_module.run_evaluation, rollout.continuous
        real_update, real_admit = learner.learner.update, rollout.admit
        evaluating, evaluated = threading.Event(), threading.Event()

        def admit():
            a = rollout.admission
            v = continuous_engine.version
            if v == 2 and not evaluated.is_set() and a.base is not None and a.made >= a.budget(v) - 1:
                return "held"  # one group of version 2's budget left unmade until its evaluation has run
            return real_admit()

        def update(*args, **kwargs):
            if learner.learner.version == 2:
                evaluating.wait(150)
            return real_update(*args, **kwargs)

        def evaluate(*args, **kwargs):
            v = continuous_engine.version
            if v == 2:
                evaluating.set()
                t0, deadline = time.monotonic(), time.monotonic() + 150
                # until the learner has announced a later version (its update done is not enough: the announce comes
                # after, and a loaded machine can finish the evaluation below before it)
                while learner.sync.rotation.latest <= v and time.monotonic() < deadline:
                    # the driver's step() without its poll for weights (it polls when idle): version 2 stays served
                    driver._drop_unusable()
                    driver._fill()
                    for fg in continuous_engine.finished(0.05):
                        driver._ship(fg)
                held["s"] = time.monotonic() - t0
            out = real_evaluate(*args, **kwargs)
            events.append(("evaluated", v, learner.sync.rotation.latest))
            if v == 2:
                evaluated.set()
            return out

        monkeypatch.setattr(learner.learner, "update", update)
        monkeypatch.setattr(rollout, "admit", admit)
        monkeypatch.setattr(rollout_module, "run_evaluation", evaluate)
        _record_submits(continuous_engine, events, monkeypatch)

    rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 5, setup)
    train = _check_keep_run(cfg, rows, figures, tmp_path / "run")
    # the evaluation of version 2, with the learner past it, and the first group the engine started after it
    assert 2 in [r["step"] for r in rows if r["kind"] == "eval"], rows
    i = next(i for i, e in enumerate(events) if e[0] == "evaluated" and e[1] == 2)
    learner_then = events[i][2]
    assert learner_then > 2, f"the learner did not move on in {held.get('s', 0):.0f} s of generation at version 2"
    after = [e[1] for e in events[i + 1:] if e[0] == "submit"]
    assert after, events
    assert after[0] >= learner_then, f"groups started at version {after[0]} after the learner reached {learner_then}"
    print("continuous keep:", figures, [(r["replay/token_lag_mean"], r["replay/multi_version_samples"])
                                        for r in train], f"evaluation of version 2 held {held.get('s', 0):.1f} s")


@pytest.mark.slow
def test_keep_with_the_evaluation_when_idle_generates_with_the_due_version_first(continuous_engine, tiny_cfg, tiny_base,
                                                                                  tmp_path, monkeypatch):
    """``cluster.rollout.eval_when = "idle"``: when version 2 is due, the engine goes on starting training groups with
    it (the evaluation alone at once would start none), takes no newer version meanwhile, and evaluates version 2
    when it has nothing left to make: no group in flight and admission refusing the next. Then it takes the
    learner's latest before it starts groups again. The learner's update from version 2 waits until version 2 is due,
    so that the engine cannot skip it as a version the learner has already left."""
    import async_vapo.services.rollout as rollout_module

    continuous_engine.weight_update = "keep"
    cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=keep", "train.total_steps=5",
               "train.eval_every=2", "cluster.rollout.eval=true", "cluster.rollout.eval_when=idle")
    events: list[tuple] = []  # ("submit", served version), ("evaluated", version, in flight, refusal, learner's)

    def setup(rollout, learner):
        real_evaluate, driver = rollout_module.run_evaluation, rollout.continuous
        real_update = learner.learner.update

        def update(*args, **kwargs):
            # the learner leaves version 2 only once it is due on the engine: a loaded machine could otherwise let the
            # engine serve it after the learner had moved on, and the engine skips such a version
            if learner.learner.version == 2:
                deadline = time.monotonic() + 150
                while rollout._eval_due != 2 and 2 not in rollout.evaluated and time.monotonic() < deadline:
                    time.sleep(0.01)
            return real_update(*args, **kwargs)

        def evaluate(*args, **kwargs):
            v = continuous_engine.version
            state = (len(driver.pending), rollout.admission.check(v, rollout.weights.learner_version))
            out = real_evaluate(*args, **kwargs)
            events.append(("evaluated", v, *state, learner.sync.rotation.latest))
            return out

        monkeypatch.setattr(learner.learner, "update", update)
        monkeypatch.setattr(rollout_module, "run_evaluation", evaluate)
        _record_submits(continuous_engine, events, monkeypatch)

    rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 5, setup)
    _check_keep_run(cfg, rows, figures, tmp_path / "run")
    assert 2 in {r["step"] for r in rows if r["kind"] == "eval"}, rows
    i = next(i for i, e in enumerate(events) if e[0] == "evaluated" and e[1] == 2)
    _, _, in_flight, refusal, learner_then = events[i]
    before = [e[1] for e in events[:i] if e[0] == "submit"]
    first = before.index(2)  # the first group of version 2: it was due from then on
    assert before[first:] == [2] * (len(before) - first), f"a newer version was taken before its evaluation: {before}"
    assert in_flight == 0 and refusal is not None, events[i]
    after = [e[1] for e in events[i + 1:] if e[0] == "submit"]
    assert after and after[0] >= learner_then, (after, learner_then)
    print("evaluation when idle:", f"{len(before) - first} groups of version 2 started before its evaluation,",
          f"admission then: {refusal}, the learner at {learner_then}")


@pytest.mark.slow
def test_wait_gives_every_sample_one_version(continuous_engine, tiny_cfg, tiny_base, tmp_path):
    """"wait" lets the requests in flight finish under the old weights before a new version loads: the lock-step
    semantics, one version per sample, on the continuous engine."""
    continuous_engine.weight_update = "wait"
    try:
        cfg = _cfg(tiny_cfg, tmp_path, "async.max_staleness=1", "rollout.weight_update=wait")
        rows, figures = _run(cfg, continuous_engine, tiny_base, tmp_path / "run", 3)
    finally:
        continuous_engine.weight_update = "keep"
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert figures["multi_version_groups_total"] == 0 and figures["tokens_after_switch_total"] == 0
    assert all(r["replay/multi_version_samples"] == 0 for r in train)
    assert all(0 <= r["replay/max_age"] <= 1 for r in train)
