"""The asynchronous cluster: services that survive bad frames (real ZeroMQ sockets, in process), learner
checkpoints and resume, and the whole cluster end to end with start_cluster.sh / stop_cluster.sh and a
real Prometheus server scraping every service."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import zmq
from conftest import free_ports, group_alive

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import (
    PROTOCOL_VERSION,
    BatchMsg,
    BatchRequest,
    GroupsMsg,
    ZmqTransport,
    connect_with_handshake,
    encode,
    make_envelope,
)
from async_vapo.transport.messages import Decoder
from async_vapo.types import Group, Trajectory

REPO = Path(__file__).resolve().parents[2]


# -- a running service keeps serving through bad frames ------------------------------------------------------------

def _group(uid: str, version: int, g: int) -> Group:
    return Group(uid=uid, prompt="1+1", answer="2", prompt_ids=[1, 2], version=version,
                 samples=[Trajectory(response_ids=[3, 4], behavior_logprobs=[-0.1, -0.2], finish_reason="stop",
                                     reward=1.0, correct=True, verdict="correct") for _ in range(g)])


def _reject_count(ctx, reason: str) -> float:
    v = ctx.metrics.registry.get_sample_value("async_vapo_replay_wire_rejects_total", {"reason": reason})
    return v or 0.0


def test_replay_service_counts_bad_frames_and_keeps_serving(tmp_path):
    from async_vapo.services.replay import ReplayService

    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=2", "algo.mini_batch_size=4",
                           "algo.micro_batch_size=4", "cluster.replay.fsync=never"])
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    own = ZmqTransport()
    svc = ReplayService(ctx, own, in_endpoint="tcp://127.0.0.1:*", batch_endpoint="tcp://127.0.0.1:*")
    loop = threading.Thread(target=svc.run, daemon=True)
    loop.start()
    zctx = zmq.Context()
    push = zctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(svc.pull.endpoint)
    dealer = zctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(svc.router.endpoint)
    transport = ZmqTransport(zctx)
    try:
        good = make_envelope(GroupsMsg(groups=[_group("a", 0, 2)]), sender="test")
        this_version = b"\xa8protocol" + bytes([PROTOCOL_VERSION])
        wrong_version = encode(good).replace(this_version, b"\xa8protocol" + bytes([PROTOCOL_VERSION + 1]))
        assert wrong_version != encode(good)
        for frame in (b"\x00garbage", wrong_version, b"\x81" + this_version, b"a", b"b"):
            push.send(frame)
        push.send_multipart([b"two", b"frames"])
        dealer.send(b"not msgpack at all")
        # valid traffic after the garbage: a bad group (wrong size) is refused, the good ones are stored and served
        sender = transport.sender(svc.pull.endpoint)
        sender.send(make_envelope(GroupsMsg(groups=[_group("bad", 0, 3), _group("b", 0, 2)]), sender="test"), 5.0)
        sender.send(good, 5.0)
        req = connect_with_handshake(transport, svc.router.endpoint, decoder=Decoder((BatchMsg,)), name="test",
                                     timeout_s=10.0)
        deadline = time.monotonic() + 20
        while len(svc.buffer) < 2:  # both good groups stored
            assert time.monotonic() < deadline
            time.sleep(0.05)
        # a forged request for a far-future version would durably drop every stored group as stale: refused
        forged = make_envelope(BatchRequest(n_groups=2, for_version=10**9, min_version=10**9 - 1), sender="x")
        assert req.request(forged, 5.0).body.groups == []
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_rejected_requests_total",
                                                     {"reason": "future_version"}) == 1
        assert len(svc.buffer) == 2
        batch = None
        while time.monotonic() < deadline:
            env = make_envelope(BatchRequest(n_groups=2, for_version=0, min_version=0), sender="test")
            batch = req.request(env, 5.0).body
            if batch.groups:
                break
            time.sleep(0.05)
        assert batch is not None and sorted(g.uid for g in batch.groups) == ["a", "b"]
        assert _reject_count(ctx, "malformed") == 6  # 4 undecodable frames, a 2-frame message, the router's one
        assert _reject_count(ctx, "wrong_version") == 1
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_rejected_groups_total",
                                                     {"reason": "group_size_mismatch"}) == 1
        assert ctx.metrics.registry.get_sample_value("async_vapo_replay_batches_total") == 1
        assert loop.is_alive()
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        own.close()
        transport.close()
        push.close()
        dealer.close()
        zctx.term()
    assert 0 < PROTOCOL_VERSION < 0x7F  # one msgpack byte: the wrong_version frame above patched exactly this value


# -- the cluster, end to end ---------------------------------------------------------------------------------------



def _prom_query(port: int, query: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=5) as r:
        doc = json.loads(r.read())
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def _prom_value(port: int, query: str) -> float | None:
    try:
        res = _prom_query(port, query)
    except OSError:
        return None
    return float(res[0]["value"][1]) if res else None




@pytest.mark.slow
def test_cluster_end_to_end_with_prometheus(tiny_cfg, tiny_base, tmp_path):
    """Four updates with a held-out evaluation and a checkpoint every two: enough for a served version to advance
    twice, a mid-run evaluation and checkpoint, and the run's statistics. Budget: a cluster start and four updates
    (with six it took 334 s on this 2-core machine at a load average of 20; not yet timed on a quiet one)."""
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the prometheus binary is not installed (.ci/install_prometheus.sh installs Debian's package)")
    names = ["verifier_port", "replay_port", "replay_batch_port", "weights_port", "acks_port", "weights_fetch_port",
             "replay_metrics_port", "verifier_metrics_port", "learner_metrics_port", "rollout_metrics_port"]
    ports = free_ports(len(names) + 1)
    prom_port = ports.pop()
    total_steps = 4
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster]\n" + "".join(f"{k} = {p}\n" for k, p in zip(names, ports, strict=True))
                      + "heartbeat_s = 0.5\nhealth_timeout_s = 240\nstop_grace_s = 15\nfsync = \"never\"\n")
    from conftest import TINY_TEST_OVERRIDES

    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                 f"train.total_steps={total_steps}", "train.eval_every=2", "train.checkpoint_every=2"]
    run_dir = tmp_path / "run"
    py = str(REPO / ".venv" / "bin" / "python") if (REPO / ".venv" / "bin" / "python").exists() else "python"
    env = {**os.environ, "PYTHON": py}
    # The scrape config as start_cluster.sh writes it (same plan helper), so Prometheus is up before the services.
    subprocess.run([py, "-m", "async_vapo.deploy.launch", "plan", "--config", str(config), "--run-dir", str(run_dir),
                    "--scrape-interval", "1s", "--", *overrides], check=True, cwd=REPO, env=env,
                   stdout=subprocess.DEVNULL)
    prom = subprocess.Popen([prometheus, f"--config.file={run_dir / 'prometheus' / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'prom-data'}",
                             f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"),
                            start_new_session=True)
    t0 = time.monotonic()
    try:
        start = subprocess.run(["bash", str(REPO / "deploy" / "start_cluster.sh"), "--config", str(config),
                                "--run-dir", str(run_dir), "--scrape-interval", "1s", "--", *overrides],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        assert start.returncode == 0, start.stderr[-4000:]
        for _ in range(60):
            if prom.poll() is None and _prom_value(prom_port, "vector(1)") == 1:
                break
            time.sleep(0.5)
        else:
            pytest.fail("prometheus did not come up: " + (tmp_path / "prometheus.log").read_text()[-2000:])
        t_up = time.monotonic() - t0
        pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
        assert set(pids) == {"replay", "verifier", "rollout-0", "learner"}
        assert json.loads((run_dir / "prometheus" / "targets.json").read_text())

        # Prometheus scrapes all four; the learner's version and the engine's served version advance.
        served_seen: list[float] = []
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            served = _prom_value(prom_port, 'async_vapo_rollout_served_version{service="rollout"}')
            if served is not None and (not served_seen or served != served_seen[-1]):
                served_seen.append(served)
            if (_prom_value(prom_port, "async_vapo_learner_version") or 0) >= total_steps and served == total_steps:
                break
            time.sleep(0.5)
        assert (run_dir / "DONE").exists(), (run_dir / "logs" / "learner.log").read_text()[-3000:]
        ups = {r["metric"]["service"]: float(r["value"][1]) for r in _prom_query(prom_port, 'up{job="async-vapo"}')}
        assert ups == {"replay": 1.0, "verifier": 1.0, "rollout": 1.0, "learner": 1.0}
        for svc in ("replay", "verifier", "rollout", "learner"):  # each service's own health gauge
            assert _prom_value(prom_port, f"async_vapo_{svc}_up") == 1.0, svc
        assert _prom_value(prom_port, "async_vapo_learner_version") == total_steps
        assert len(served_seen) >= 2 and served_seen == sorted(served_seen) and served_seen[-1] == total_steps
        assert (_prom_value(prom_port, "async_vapo_rollout_generated_samples_total") or 0) > 0
        assert (_prom_value(prom_port, "sum(async_vapo_verifier_checks_total)") or 0) > 0
        assert _prom_value(prom_port, "async_vapo_learner_engines_in_rotation") == 1
        # the engine shares the learner's host: every version came by mapping its shared-memory slot
        loads = {r["metric"]["via"]: float(r["value"][1])
                 for r in _prom_query(prom_port, "async_vapo_rollout_weight_transfers_total")}
        assert loads == {"shm": total_steps}, loads
        for svc, stage in (("rollout", "generate"), ("verifier", "verify"), ("learner", "learn")):
            busy = _prom_value(prom_port, f'async_vapo_{svc}_busy_seconds_total{{stage="{stage}"}}')
            assert busy is not None and busy > 0, (svc, stage)
        assert _prom_value(prom_port, 'async_vapo_learner_critic_value_error_abs_by_age{age="0"}') is not None
        # max_staleness = 0: every group served was generated by the learner's current weights (age 0). The replay
        # is scraped on its own schedule: its last scrape may predate the last batch by an interval, so wait for it.
        expected = (total_steps + tiny_cfg.algo.value_pretrain_steps) * tiny_cfg.algo.prompts_per_step
        deadline = time.monotonic() + 20
        while ((n_served := _prom_value(prom_port, "async_vapo_replay_sample_age_versions_count")) != expected
               and time.monotonic() < deadline):
            time.sleep(0.5)
        assert n_served == expected
        assert _prom_value(prom_port, 'async_vapo_replay_sample_age_versions_bucket{le="0.0"}') == n_served

        def read_rows() -> list[dict]:
            return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

        deadline = time.monotonic() + 60  # rollout 0 evaluates the last version after loading it
        while time.monotonic() < deadline and not any(r["kind"] == "eval" and r["version"] == total_steps
                                                      for r in read_rows()):
            time.sleep(0.5)
        rows = read_rows()
        train = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, total_steps + 1))
        assert all(r["version"] == r["step"] and r["replay/max_age"] == 0 for r in train)
        assert [r["kind"] for r in rows if r["kind"] == "pretrain"] == ["pretrain"]
        assert {r["version"] for r in rows if r["kind"] == "eval"} >= {0, 2, 4}
        assert (run_dir / "checkpoints" / f"step_{total_steps}" / "learner_state.pt").exists()
        print(f"cluster healthy after {t_up:.0f} s, trained {total_steps} steps by {time.monotonic() - t0:.0f} s")
    finally:  # also after a failed or timed-out start: stop_cluster.sh stops whatever was recorded
        stop = subprocess.run(["bash", str(REPO / "deploy" / "stop_cluster.sh"), str(run_dir)], capture_output=True,
                              text=True, timeout=120)
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(20)
        except subprocess.TimeoutExpired:
            prom.kill()
    assert stop.returncode == 0, stop.stderr
    pids = {p.stem: int(p.read_text()) for p in (run_dir / "pids").glob("*.pid")}
    assert pids and not [name for name, pgid in pids.items() if group_alive(pgid)]
    children = [int(x) for f in (run_dir / "pids").glob("*.children") for x in f.read_text().split()]
    assert children  # the verifier's sandbox workers were recorded, and are gone too
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()]
    # Each service left its statistics: busy intervals per stage, peak memory (the engine core counted in rollout's)
    from async_vapo.experiments.report import analyse_cluster_run

    stats = {p.stem: json.loads(p.read_text()) for p in (run_dir / "stats").glob("*.json")}
    assert set(stats) == {"replay-0", "verifier-0", "rollout-0", "learner-0"}
    assert all(s["peak_rss_mib"] > 10 for s in stats.values())  # the replay service needs ~45 MiB
    assert stats["rollout-0"]["peak_rss_with_children_mib"] > stats["rollout-0"]["peak_rss_mib"]
    fig = analyse_cluster_run(run_dir)
    assert fig["updates"] == total_steps - 1 and fig["max_age"] == 0
    for stage in ("generate", "verify", "learn"):
        assert 0 < fig["busy_fraction"][stage] <= 1, fig["busy_fraction"]
    assert list(fig["critic_by_age"]) == [0]  # synchronous: every sample on-policy


# -- learner + replay services in process: checkpoints and --resume ----------------------------------------------

def _learner_cfg(tiny_cfg, total_steps: int):
    from conftest import TINY_TEST_OVERRIDES

    ports = free_ports(6)
    names = ["replay_port", "replay_batch_port", "weights_port", "acks_port", "verifier_port", "weights_fetch_port"]
    return load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                            f"train.total_steps={total_steps}", "train.checkpoint_every=1",
                            "cluster.replay.fsync=never",
                            "cluster.wire.batch_poll_s=0.05",
                            *(f"cluster.{k}={p}" for k, p in zip(names, ports, strict=True))])


def _run_learner_until_done(cfg, run_dir: Path, tok, resume: str | None = None):
    """Replay and learner services on real sockets; the test feeds the replay groups of the learner's version."""
    from async_vapo.services.learner import LearnerService
    from async_vapo.services.replay import ReplayService

    rctx = make_context("replay", cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    replay = ReplayService(rctx, transport)
    lctx = make_context("learner", cfg=cfg, run_dir=run_dir, serve_metrics=False, install_signals=False)
    learner = LearnerService(lctx, transport, resume=resume)
    resumed_at = (learner.learner.version, learner.loop.start_step, learner.replay.cursor)
    threads = [threading.Thread(target=replay.run, daemon=True), threading.Thread(target=learner.run, daemon=True)]
    for t in threads:
        t.start()
    prompt = tok("1+2=").input_ids
    response = tok("1+2=3\\boxed{3}").input_ids[len(prompt):]
    n = 0
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "DONE").exists():
            assert time.monotonic() < deadline, "learner did not finish"
            assert all(t.is_alive() for t in threads)
            v = learner.learner.version
            if replay.buffer.num_admissible(v) < cfg.algo.prompts_per_step:
                rewards = [1.0 if i % 2 else -1.0 for i in range(cfg.algo.group_size)]
                samples = [Trajectory(response_ids=response, behavior_logprobs=[-1.0] * len(response),
                                      finish_reason="stop", reward=r, correct=r > 0,
                                      verdict="correct" if r > 0 else "incorrect") for r in rewards]
                replay.buffer.add(Group(uid=f"p{n}", prompt="1+2=", answer="3", prompt_ids=prompt, version=v,
                                        samples=samples))
                n += 1
            time.sleep(0.02)
    finally:
        lctx.stop.set()
        rctx.stop.set()
        for t in threads:
            t.join(30)
        learner.close()
        replay.close()
        transport.close()
    return resumed_at


@pytest.mark.slow
def test_learner_service_checkpoints_and_resumes(tiny_cfg, tiny_base, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    run_dir = tmp_path / "run"
    assert _run_learner_until_done(_learner_cfg(tiny_cfg, 2), run_dir, tok) == (0, 0, 0)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_1", "step_2"]
    (run_dir / "DONE").unlink()
    version, step, cursor = _run_learner_until_done(_learner_cfg(tiny_cfg, 3), run_dir, tok, resume="auto")
    pps = tiny_cfg.algo.prompts_per_step
    assert (version, step, cursor) == (2, 2, (2 + tiny_cfg.algo.value_pretrain_steps) * pps)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["pretrain", "train", "train", "train"]  # no second value pretraining
    assert [(r["step"], r["version"]) for r in rows[1:]] == [(1, 1), (2, 2), (3, 3)]
    assert rows[-1]["replay/cursor"] == cursor + pps
    assert json.loads((run_dir / "summary.json").read_text())["version"] == 3


def test_verifier_service_counts_bad_frames_and_keeps_verifying(tmp_path):
    from async_vapo.services.verifier import VerifierService

    cfg = load_config([], ["verifier.num_workers=1", "cluster.wire.max_message_bytes=4096"])
    ctx = make_context("verifier", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    out = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), bind=True)
    svc = VerifierService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", out_endpoint=out.endpoint)
    loop = threading.Thread(target=svc.run, args=(lambda ids: "".join(map(chr, ids)),), daemon=True)  # ids = chars
    loop.start()
    try:
        sender = transport.sender(svc.pull.endpoint)
        for frame in (b"\xc1", b"x" * 5000):  # 0xc1 is never valid msgpack; 5000 bytes > max_message_bytes
            sender.send_frame(frame, 5.0)
        ok = [ord(c) for c in "1+1=2\\boxed{2}"]
        bad = [ord(c) for c in "\\boxed{3}"]
        group = Group(uid="u", prompt="1+1", answer="2", prompt_ids=[1], version=0,
                      samples=[Trajectory(response_ids=ids, behavior_logprobs=[0.0] * len(ids), finish_reason="stop")
                               for ids in (ok, bad)])
        sender.send(make_envelope(GroupsMsg(groups=[group]), sender="test"), 5.0)
        env = out.recv(60.0)
        assert env is not None, "no verified groups came out"
        assert [(s.correct, s.reward, s.verdict) for s in env.body.groups[0].samples] == [
            (True, 1.0, "correct"), (False, -1.0, "incorrect")]
        reg = ctx.metrics.registry
        assert reg.get_sample_value("async_vapo_verifier_wire_rejects_total", {"reason": "malformed"}) == 1
        assert reg.get_sample_value("async_vapo_verifier_wire_rejects_total", {"reason": "oversized"}) == 1
        assert reg.get_sample_value("async_vapo_verifier_checks_total", {"reason": "correct"}) == 1
        assert loop.is_alive()
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()


def test_verifier_service_holds_each_message_to_its_budget(tmp_path):
    from async_vapo.services.verifier import VerifierService
    from async_vapo.verify import VerifierPool

    cfg = load_config([], ["verifier.num_workers=1", "verifier.timeout_s=0.5", "verifier.message_budget_s=1.0"])
    ctx = make_context("verifier", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    out = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), bind=True)
    # A per-check deadline far past the budget: only the service's per-message budget can end these hangs.
    pool = VerifierPool(num_workers=1, timeout_s=30.0, _test_hooks=True)
    svc = VerifierService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", out_endpoint=out.endpoint, pool=pool)
    loop = threading.Thread(target=svc.run, args=(lambda ids: "".join(map(chr, ids)),), daemon=True)
    loop.start()
    try:
        texts = ["1+1=2\\boxed{2}"] + ["__hang_hard__"] * 4
        group = Group(uid="u", prompt="1+1", answer="2", prompt_ids=[1], version=0,
                      samples=[Trajectory(response_ids=[ord(c) for c in t], behavior_logprobs=[0.0] * len(t),
                                          finish_reason="stop") for t in texts])
        sender = transport.sender(svc.pull.endpoint)
        t0 = time.monotonic()
        sender.send(make_envelope(GroupsMsg(groups=[group]), sender="test"), 5.0)
        env = out.recv(20.0)
        elapsed = time.monotonic() - t0
        assert env is not None, "no verified groups came out"
        print(f"message with 4 hanging responses verified in {elapsed:.2f}s")
        assert elapsed < 3.0
        assert [s.verdict for s in env.body.groups[0].samples] == ["correct"] + ["over_budget"] * 4
        assert [s.reward for s in env.body.groups[0].samples] == [1.0] + [-1.0] * 4
        reg = ctx.metrics.registry
        assert reg.get_sample_value("async_vapo_verifier_checks_total", {"reason": "over_budget"}) == 4
        assert ctx.metrics.health()["sandbox"] == pool.isolation
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()
