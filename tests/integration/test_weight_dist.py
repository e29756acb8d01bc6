"""Versions over torch.distributed (gloo) into the real vLLM engine through vLLM's weight-transfer API
(``async_vapo.weights.collective``): the engine joins its group and serves each version exactly; an engine that never
answers, or dies mid-broadcast, costs the learner its deadline at most, and a rejoining engine gets a new group.
``test_a_second_real_engine_killed_mid_broadcast_is_dropped_and_rejoins`` does the last with two real engines (the
session's and a rollout service started in a subprocess) behind the learner's WeightBroadcast."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_engine_serves, join_group, push_over_group

from async_vapo.weights.collective import (
    EngineGroup,
    EngineSyncFailed,
    EngineSyncTimeout,
    plan_buckets,
    version_meta,
)

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.engines  # rollout services with engines of their own, in subprocesses


def test_buckets_are_bounded_and_keep_order():
    meta = [("a", torch.float32, (10,)), ("b", torch.bfloat16, (3, 4)), ("big", torch.float32, (100,)),
            ("c", torch.float32, (2,))]
    bs = plan_buckets(meta, 64)
    # a 40 B + b 24 B = 64 B fill one bucket; big (400 B) alone; c 8 B
    assert [b.names for b in bs] == [["a", "b"], ["big"], ["c"]]
    assert [b.nbytes for b in bs] == [64, 400, 8]
    assert bs[0].dtype_names == ["float32", "bfloat16"] and bs[0].shapes == [[10], [3, 4]]


def test_engine_serves_each_version_received_over_its_group(vllm_engine, tiny_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_base)
    policy = AutoModelForCausalLM.from_pretrained(tiny_base, dtype=torch.float32)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    group = EngineGroup("rollout-0", timeout_s=30)
    join_group(vllm_engine, group)
    try:
        torch.manual_seed(0)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            n = push_over_group(group, vllm_engine, list(policy.state_dict().items()), version, bucket_bytes=32 << 10)
            assert n > 3  # several bounded buckets, not one
            assert vllm_engine.version == version
            assert_engine_serves(vllm_engine, policy, tok)
        # the engine leaves (its group torn down) and rejoins: a new group, a new store, and the next version
        group.close()
        group = EngineGroup("rollout-0", timeout_s=30)
        join_group(vllm_engine, group)
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        push_over_group(group, vllm_engine, list(policy.state_dict().items()), 4, bucket_bytes=1 << 20)
        assert_engine_serves(vllm_engine, policy, tok)
    finally:
        # the session's engine goes back to the base weights for the tests after this one
        policy.load_state_dict(base)
        push_over_group(group, vllm_engine, list(policy.state_dict().items()), 0, bucket_bytes=1 << 20)
        group.close()
        assert_engine_serves(vllm_engine, policy, tok)


def test_sync_to_an_engine_that_never_answers_times_out():
    group = EngineGroup("ghost", timeout_s=2)  # the engine never joins
    named = [("w", torch.ones(1000))]
    t0 = time.monotonic()
    with pytest.raises(EngineSyncTimeout, match="ghost did not join its group within 2 s"):
        group.send(plan_buckets(version_meta(named), 1 << 20), named)
    assert time.monotonic() - t0 < 10
    assert group.closed and group.store is None
    with pytest.raises(RuntimeError, match="torn down"):
        group.connect()


FAKE_ENGINE = textwrap.dedent("""
    import os, sys, datetime, torch, torch.distributed as dist
    addr, prefix = sys.argv[1], sys.argv[3]
    port, die_after, nbytes = int(sys.argv[2]), int(sys.argv[4]), int(sys.argv[5])
    t = datetime.timedelta(seconds=20)
    print("ready", flush=True)  # imports done: joins at once
    store = dist.TCPStore(addr, port, 2, is_master=False, timeout=t)
    g = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, 2, t)
    got = []
    for i in range(10**6):
        if i == die_after:
            os._exit(9)  # dies mid-broadcast, without a word
        buf = torch.empty(nbytes, dtype=torch.uint8)
        g.broadcast(buf, 0).wait()
        got.append(buf)
        if sum(b.numel() for b in got) >= int(sys.argv[6]):
            break
    print(torch.cat(got).view(torch.float32).sum().item(), flush=True)
""")


def _fake_engine(group: EngineGroup, die_after: int, bucket_bytes: int, total: int) -> subprocess.Popen:
    i = group.init_info
    proc = subprocess.Popen([sys.executable, "-c", FAKE_ENGINE, i["master_addr"], str(i["master_port"]), i["prefix"],
                             str(die_after), str(bucket_bytes), str(total)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    return proc


def test_engine_dead_mid_broadcast_is_dropped_and_rejoins_with_a_new_group():
    """EngineGroup alone against a bare gloo peer that dies after its third bucket: the send fails within its
    deadline and closes the group; a new group (another prefix) delivers a whole version. The same with real vLLM
    engines behind the learner's WeightBroadcast: ``test_a_second_real_engine_killed_mid_broadcast_...``."""
    named = [(f"w{i}", torch.full((256,), float(i))) for i in range(8)]  # 8 buckets of 1 KiB
    buckets = plan_buckets(version_meta(named), 1024)
    total = sum(b.nbytes for b in buckets)
    group = EngineGroup("rollout-1", timeout_s=5)
    proc = _fake_engine(group, die_after=3, bucket_bytes=1024, total=total)
    try:
        t0 = time.monotonic()
        with pytest.raises((EngineSyncFailed, EngineSyncTimeout), match="rollout-1"):
            group.send(buckets, named, deadline=time.monotonic() + 5)
        assert time.monotonic() - t0 < 15  # within the group's timeout (plus the join), never a hang
        assert proc.wait(timeout=10) == 9 and group.closed
    finally:
        proc.kill()

    again = EngineGroup("rollout-1", timeout_s=5)
    assert again.init_info["prefix"] != group.init_info["prefix"]
    proc = _fake_engine(again, die_after=-1, bucket_bytes=1024, total=total)
    try:
        again.send(buckets, named, deadline=time.monotonic() + 10)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert float(out) == sum(float(i) * 256 for i in range(8))
    again.close()


class _KillAfterFirstBucket:
    """The learner's end of an engine's gloo group that SIGKILLs the engine's process group (the rollout service
    and its vLLM engine core) once the first bucket of a send has gone: gloo sends a bucket only once the receiver
    posted its receive, so the engine dies inside vLLM's ``update_weights``, mid-broadcast."""

    def __init__(self, group, proc: subprocess.Popen):
        self._group, self._proc = group, proc
        self.buckets = 0
        self.killed_at = self.aborted_at = None

    def broadcast(self, tensor, root):
        work = self._group.broadcast(tensor, root)
        self.buckets += 1
        if self.buckets == 1:
            work.wait()
            self.killed_at = time.monotonic()
            _kill_group(self._proc.pid)
            self._proc.wait(10)
        return work

    def abort(self):  # EngineGroup.close: the group torn down
        self.aborted_at = time.monotonic()
        self._group.abort()

    def __getattr__(self, name):
        return getattr(self._group, name)


def _start_rollout_service(overrides: list[str], run_dir: Path, metrics_port: int, log: Path) -> subprocess.Popen:
    """``python -m async_vapo.services.rollout`` as rollout-0, in a session of its own (its process group: it and
    vLLM's engine core)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "async_vapo.services.rollout", "--run-dir", str(run_dir),
                                 "--instance", "0", "--metrics-port", str(metrics_port), *overrides], cwd=REPO,
                                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _stop_service(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the service (it closes its engine), then SIGKILL to whatever of its process group is left."""
    if grace_s and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    _kill_group(proc.pid)
    proc.wait(10)


def _kill_group(pgid: int) -> None:
    """SIGKILL process group ``pgid`` (a rollout service, its vLLM engine core and worker) without leaking shared
    memory: the SharedMemory files its processes map (vLLM's message queues: sparse files of 160 and 240 MB) are
    unlinked here, and its multiprocessing resource tracker is killed last, once it has unlinked what the others left
    registered with it (their named semaphores) on seeing them die."""
    members, shm = {}, set()
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or os.getpgid(int(d.name)) != pgid:
                continue
            members[int(d.name)] = (d / "cmdline").read_bytes()
            maps = (d / "maps").read_text()
        except OSError:  # gone meanwhile
            continue
        for line in maps.splitlines():
            path = line.split(maxsplit=5)[5:]
            if path and path[0].startswith("/dev/shm/psm_") and not path[0].endswith(" (deleted)"):
                shm.add(Path(path[0]))  # SharedMemory's names (the learner's slots are never psm_)
    trackers = [pid for pid, cmd in members.items() if b"multiprocessing.resource_tracker" in cmd]
    for pid in members.keys() - set(trackers):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while any(map(_running, trackers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)  # whatever is left, a tracker that did not finish included
    except ProcessLookupError:
        pass
    for f in shm:
        f.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


def _assert_groups_served(groups, policy, pad_id: int, temperature: float) -> None:
    """Each sample's behaviour log-probs (the engine's, as it sampled) equal the policy's forward at that
    temperature: the engine that generated the groups served exactly these weights."""
    from async_vapo.algo.utils import logprobs_from_logits
    from async_vapo.models.rl import make_token_batch, response_logits

    samples = [(list(g.prompt_ids), s) for g in groups for s in g.samples]
    assert samples
    for prompt, s in samples:
        batch = make_token_batch([prompt], [list(s.response_ids)], pad_id)
        with torch.no_grad():
            lp = logprobs_from_logits(response_logits(policy, batch, temperature), batch.response_ids)[0]
        torch.testing.assert_close(lp, torch.tensor(list(s.behavior_logprobs)), atol=1e-3, rtol=0)


@pytest.mark.slow
def test_a_second_real_engine_killed_mid_broadcast_is_dropped_and_rejoins(vllm_engine, tiny_cfg, tiny_base, tmp_path,
                                                                         caplog):
    """The learner's WeightBroadcast ("dist", ZeroMQ on loopback) and two real vLLM engines, each in its own gloo
    group: rollout-0, the real rollout service (``async_vapo.services.rollout``) in a subprocess, and rollout-1, the
    session's engine behind an EngineWeightClient in this process (streamed after rollout-0). Version 1 reaches both
    over their groups and both serve it exactly (rollout-0's generated groups: log-probs = the learner's forward).
    Version 2: rollout-0's process group is SIGKILLed once its first bucket (of 4 KiB buckets) has gone; the
    learner's send to it fails well within ``dist_timeout_s``, its group is torn down, and rollout-1 still receives
    version 2 and serves it. A new rollout-0 process starts; the dead one leaves rotation at the ack deadline, the new
    one loads the latest (version 2) from the slot, rejoins rotation and gets a new group (another prefix), and
    version 3 reaches both over their groups, both serving it exactly.

    Budget: two engine starts in a subprocess and three versions. Measured here (2 CPU cores, shared): 76-88 s (the
    engine starts 18-30 s each), 133 s with the cores heavily loaded by other runs (load average 13, the engine
    starts 30-70 s)."""
    from conftest import TINY_TEST_OVERRIDES, free_ports
    from transformers import AutoTokenizer

    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.services.context import make_context
    from async_vapo.transport import GroupsMsg, Heartbeat, ZmqTransport
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights import WeightBroadcast
    from async_vapo.weights.client import EngineWeightClient

    t_start = time.monotonic()
    ports = free_ports(5)
    dist_timeout_s, ack_timeout_s = 20, 10
    overrides = [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}", "async.rollout_devices=2",
                 "cluster.weights.transfer=dist", "cluster.weights.dist_bucket_bytes=4096",
                 f"cluster.weights.dist_timeout_s={dist_timeout_s}", "cluster.weights.dist_join_timeout_s=30",
                 f"cluster.weights.ack_timeout_s={ack_timeout_s}", "cluster.security.curve=false",
                 "cluster.rollout.eval=false", f"cluster.ports.weights_port={ports[0]}",
                 f"cluster.ports.acks_port={ports[1]}", f"cluster.ports.weights_fetch_port={ports[2]}",
                 f"cluster.ports.verifier_port={ports[3]}"]
    cfg = load_config([], [*overrides, f"cluster.weights.dir={tmp_path / 'w'}"])
    run_dir, log = tmp_path / "run", tmp_path / "rollout-0.log"
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    caplog.set_level(logging.INFO)
    transport = ZmqTransport()
    ctxs = [make_context(s, cfg=cfg, run_dir=run_dir, instance=i, serve_metrics=False, install_signals=False)
            for s, i in (("learner", 0), ("rollout", 1))]
    wb = WeightBroadcast(ctxs[0], transport, device="cpu")
    verifier = transport.receiver(f"tcp://127.0.0.1:{ports[3]}", decoder=Decoder((GroupsMsg, Heartbeat)), bind=True)
    procs: list[subprocess.Popen] = []
    publishing: list[threading.Thread] = []
    here = None
    torch.manual_seed(7)

    def mark(what: str) -> None:  # the timeline, shown by pytest -s and on a failure
        print(f"[{time.monotonic() - t_start:6.1f} s] {what}", flush=True)

    def start() -> subprocess.Popen:
        mark("rollout-0 starting")
        procs.append(_start_rollout_service(overrides, run_dir, ports[4], log))
        return procs[-1]

    def step(proc=None) -> None:
        wb.poll(0.05)
        wb.heartbeat(wb.rotation.latest)
        here.poll(0.0)
        here.heartbeat()
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"rollout-0 exited ({proc.returncode}):\n{_tail(log)}")

    def until(cond, what: str, timeout_s: float, proc=None) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{_tail(log)}"
            step(proc)

    def formed(engine: str) -> bool:
        g = wb.groups.get(engine)
        return g is not None and g.group is not None

    def loads(engine: str) -> dict:
        e = wb.chooser.engines.get(engine)
        return dict(e.loads) if e is not None else {}

    def groups_of(version: int, proc) -> list:
        """rollout-0's next generate call at ``version`` (it generates its share of each version it serves)."""
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"no groups of version {version} from rollout-0\n{_tail(log)}"
            env = verifier.recv(0.1)
            if env is not None and isinstance(env.body, GroupsMsg):
                got = [g for g in env.body.groups if g.version == version]
                if got:
                    return got
            step(proc)

    def publish(version: int) -> float:
        """The learner publishes (and streams, in a thread: each send waits for its engine) while rollout-1 loads
        between two "generate calls"; returns the publish's seconds."""
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out: dict = {}

        def run():
            t0 = time.monotonic()
            try:
                wb.publish(version, policy.state_dict(), min_version=version)
            except BaseException as e:  # noqa: BLE001 - reported to the test thread
                out["error"] = e
            out["seconds"] = time.monotonic() - t0

        th = threading.Thread(target=run, daemon=True, name=f"publish-{version}")
        publishing.append(th)
        th.start()
        deadline = time.monotonic() + 2 * dist_timeout_s + 20
        while th.is_alive() or vllm_engine.version != version:
            assert time.monotonic() < deadline, f"version {version}: the publish or rollout-1's load hangs"
            here.poll(0.05)
        assert "error" not in out, out
        step()  # the acks
        return out["seconds"]

    try:
        proc = start()
        here = EngineWeightClient(ctxs[1], transport, vllm_engine)
        here.start()  # acks version 0 and, with "dist", asks for a group
        until(lambda: formed("rollout-0") and formed("rollout-1"), "both engines in their weight groups", 120, proc)
        first = wb.groups["rollout-0"]
        mark("both engines in their groups")

        publish(1)
        assert wb.latest.dist_engines == ["rollout-0", "rollout-1"]
        assert_engine_serves(vllm_engine, policy, tok)
        _assert_groups_served(groups_of(1, proc), policy, tok.pad_token_id, cfg.rollout.temperature)
        until(lambda: loads("rollout-0") == {"dist": 1} and loads("rollout-1") == {"dist": 1}, "acks of version 1",
              10, proc)
        assert wb.dist_failures._value.get() == 0 and wb.rotation.members == {"rollout-0", "rollout-1"}
        mark("version 1 served by both")

        # version 2: rollout-0 dies after its first bucket
        killer = first.group = _KillAfterFirstBucket(first.group, proc)
        seconds = publish(2)
        buckets = len(plan_buckets(version_meta(policy.state_dict().items()), 4096))
        assert buckets > 10 and killer.buckets < buckets and proc.returncode == -signal.SIGKILL
        assert killer.aborted_at is not None and killer.aborted_at - killer.killed_at < dist_timeout_s, (
            "the send to the dead engine outlived its deadline")
        assert seconds < dist_timeout_s + 10, seconds
        assert first.closed and "rollout-0" not in wb.groups and wb.dist_failures._value.get() == 1
        assert wb.latest.dist_engines == ["rollout-0", "rollout-1"]
        assert "learner: version 2 not streamed to rollout-0" in caplog.text
        assert_engine_serves(vllm_engine, policy, tok)  # rollout-1 got version 2 over its group all the same
        until(lambda: loads("rollout-1") == {"dist": 2}, "rollout-1's ack of version 2", 10)
        mark(f"version 2: rollout-0 killed after bucket 1 of {buckets}, its send failed "
             f"{killer.aborted_at - killer.killed_at:.2f} s later (publish {seconds:.2f} s)")

        # rollout-0 again: a new process (it starts in far more than the ack deadline), the latest version from the
        # slot, a new group
        rejoined = wb.rejoined._value.get()
        proc = start()
        until(lambda: wb.rotation.members == {"rollout-1"}, "rollout-0 out of rotation at the ack deadline",
              ack_timeout_s + 10, proc)
        assert wb.dropped._value.get() == 1 and "rollout-0" not in wb.groups
        mark("rollout-0 out of rotation")
        until(lambda: formed("rollout-0") and "rollout-0" in wb.rotation.members
              and wb.rotation.acked["rollout-0"] == 2,
              "the new rollout-0 in a new group and back in rotation at version 2", 120, proc)
        assert wb.groups["rollout-0"].prefix != first.prefix and wb.rejoined._value.get() == rejoined + 1
        assert loads("rollout-0") == {"dist": 1, "shm": 1}
        _assert_groups_served(groups_of(2, proc), policy, tok.pad_token_id, cfg.rollout.temperature)
        mark("the new rollout-0 serves version 2 (the slot), in a new group")

        publish(3)
        assert wb.latest.dist_engines == ["rollout-0", "rollout-1"] and wb.dist_failures._value.get() == 1
        assert_engine_serves(vllm_engine, policy, tok)
        _assert_groups_served(groups_of(3, proc), policy, tok.pad_token_id, cfg.rollout.temperature)
        until(lambda: loads("rollout-0") == {"dist": 2, "shm": 1} and loads("rollout-1") == {"dist": 3},
              "acks of version 3", 10, proc)
        assert wb.rotation.members == {"rollout-0", "rollout-1"}
        text = log.read_text(errors="replace")
        for line in ("rollout-0: serving version 1 via dist", "rollout-0: serving version 2 via shm",
                     "rollout-0: serving version 3 via dist"):
            assert line in text, line
        assert text.count("rollout-0: in its gloo weight group") == 2
        mark("version 3 served by both")
    finally:
        for p in procs:
            _stop_service(p, grace_s=15)
        wb.close()  # its groups aborted: a send still in flight fails now
        for th in publishing:
            th.join(30)
        if here is not None:
            here.close()
        transport.close()
        for ctx in ctxs:
            ctx.close()
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
        mark("stopped")


SILENT_ENGINE = textwrap.dedent("""
    import sys, time, datetime, torch.distributed as dist
    addr, port, world, prefix = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    t = datetime.timedelta(seconds=30)
    store = dist.TCPStore(addr, port, world, is_master=False, timeout=t)
    g = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), 1, world, t)
    print("joined", flush=True)
    time.sleep(120)  # in the group, never receiving: a wedged engine
""")


def test_learner_publish_goes_on_past_an_engine_that_stops_answering(tmp_path):
    """The learner's WeightBroadcast in "dist": an engine asks for a group, joins it, then never receives. The
    publish of the next version returns within cluster.weights.dist_timeout_s, drops that engine's group and counts
    the failure; the version after is announced to no group and costs nothing."""
    from async_vapo.config import load_config
    from async_vapo.services.context import make_context
    from async_vapo.transport import (
        Heartbeat,
        InprocTransport,
        WeightsAnnounce,
        WeightsGroupJoin,
        WeightsGroupOffer,
        make_envelope,
    )
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights import WeightBroadcast

    cfg = load_config([], ["cluster.weights.transfer=dist", "cluster.weights.dist_timeout_s=3",
                           "cluster.weights.dist_join_timeout_s=60",
                           f"cluster.weights.dir={tmp_path / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
    transport = InprocTransport()
    wb = WeightBroadcast(ctx, transport, pub_endpoint="weights", acks_endpoint="acks")
    acks = transport.sender("acks")
    sub = transport.subscriber("weights", decoder=Decoder((WeightsAnnounce, WeightsGroupOffer, Heartbeat)))
    proc = None
    try:
        acks.send(make_envelope(WeightsGroupJoin(engine_id="rollout-0"), sender="rollout-0"), 5)
        wb.poll(1.0)
        env = sub.recv(5)
        assert isinstance(env.body, WeightsGroupOffer) and env.body.engine_id == "rollout-0"
        o = env.body
        proc = subprocess.Popen([sys.executable, "-c", SILENT_ENGINE, o.master_addr, str(o.master_port),
                                 str(o.world_size), o.prefix], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline() == "joined\n"
        deadline = time.monotonic() + 10
        while wb.groups["rollout-0"].group is None:
            assert time.monotonic() < deadline, "the learner's side of the group did not form"
            time.sleep(0.05)

        state = {"w": torch.randn(16 << 20 // 4 * 2)}  # 32 MB: more than socket buffers hold
        t0 = time.monotonic()
        wb.publish(1, state)
        took = time.monotonic() - t0
        assert wb.latest.dist_engines == ["rollout-0"]
        assert took < 3 + 5, took  # the deadline, plus the slot write
        assert "rollout-0" not in wb.groups and wb.dist_failures._value.get() == 1

        t0 = time.monotonic()
        wb.publish(2, state)
        assert wb.latest.dist_engines == [] and time.monotonic() - t0 < 3
    finally:
        if proc is not None:
            proc.kill()
        wb.close()
        transport.close()
        ctx.close()


def test_auto_times_an_engine_on_another_host_over_its_group_and_drops_a_slower_group(tmp_path, caplog):
    """The learner's WeightBroadcast in "auto", engines played by acks: one on the learner's host (its slot) is
    offered no group; one on another host fetches, asks for a group, gets it, is streamed versions over it only
    once its fetch is timed, and, its group slower here (the acks say so), keeps the fetch: its group is torn
    down and it is streamed nothing more. The gauge and the log say which way each engine takes."""
    import logging
    import queue

    import torch.distributed as dist

    from async_vapo.config import load_config
    from async_vapo.services.context import make_context
    from async_vapo.transport import (
        Heartbeat,
        InprocTransport,
        WeightsAck,
        WeightsAnnounce,
        WeightsGroupJoin,
        WeightsGroupOffer,
        make_envelope,
    )
    from async_vapo.transport.messages import Decoder
    from async_vapo.weights import WeightBroadcast

    cfg = load_config([], ["cluster.weights.transfer=auto", "cluster.weights.auto_trials=1",
                           "cluster.weights.dist_timeout_s=20", f"cluster.weights.dir={tmp_path / 'w'}"])
    ctx = make_context("learner", cfg=cfg, run_dir=tmp_path / "run", serve_metrics=False, install_signals=False)
    transport = InprocTransport()
    wb = WeightBroadcast(ctx, transport, pub_endpoint="weights", acks_endpoint="acks", device="cpu")
    acks = transport.sender("acks")
    sub = transport.subscriber("weights", decoder=Decoder((WeightsAnnounce, WeightsGroupOffer, Heartbeat)))
    state = {"w": torch.arange(1000.0)}
    got: queue.Queue = queue.Queue()

    def send(body, sender):
        acks.send(make_envelope(body, sender=sender), 5)

    def ack(engine, version, via, seconds):
        send(WeightsAck(engine_id=engine, version=version, ok=True, load_seconds=seconds, via=via), engine)
        wb.poll(0.5)

    def offers():
        out = []
        while (env := sub.recv(0.2)) is not None:
            if isinstance(env.body, WeightsGroupOffer):
                out.append(env.body)
        return out

    def engine(o, versions):  # rollout-1's end of its gloo group: joins, then receives `versions` versions
        t = __import__("datetime").timedelta(seconds=20)
        store = dist.TCPStore(o.master_addr, o.master_port, o.world_size, is_master=False, timeout=t)
        g = dist.ProcessGroupGloo(dist.PrefixStore(o.prefix, store), 1, o.world_size, t)
        for _ in range(versions):
            buf = torch.empty(4000, dtype=torch.uint8)
            g.broadcast(buf, 0).wait()
            got.put(buf.view(torch.float32).sum().item())

    caplog.set_level(logging.INFO)
    th = None
    try:
        wb.publish(1, state)
        ack("rollout-0", 1, "shm", 0.01)
        send(WeightsGroupJoin(engine_id="rollout-0"), "rollout-0")  # asks, although on the learner's host
        wb.poll(0.5)
        assert offers() == [] and "rollout-0" not in wb.groups
        ack("rollout-1", 1, "zmq", 0.5)  # another host: fetched (the warm-up), then asks for a group
        send(WeightsGroupJoin(engine_id="rollout-1"), "rollout-1")
        wb.poll(0.5)
        [o] = offers()
        assert (o.engine_id, o.backend) == ("rollout-1", "gloo")
        th = threading.Thread(target=engine, args=(o, 2), daemon=True)
        th.start()
        deadline = time.monotonic() + 10
        while wb.groups["rollout-1"].group is None:
            assert time.monotonic() < deadline, "the learner's side of the group did not form"
            time.sleep(0.05)
        wb.publish(2, state)
        assert wb.latest.dist_engines == []  # its fetch is timed first
        ack("rollout-1", 2, "zmq", 0.05)
        for v, seconds in ((3, 0.01), (4, 0.5)):  # the group's warm-up, then a timed load slower than the fetch
            wb.publish(v, state)
            assert wb.latest.dist_engines == ["rollout-1"] and got.get(timeout=10) == sum(range(1000))
            ack("rollout-1", v, "dist", seconds)
        assert wb.chooser.way("rollout-1") == "zmq" and "rollout-1" not in wb.groups  # torn down
        wb.publish(5, state)
        assert wb.latest.dist_engines == []
        ways = {w: wb.by_way.labels(way=w)._value.get() for w in ("shm", "zmq", "dist", "file")}
        assert ways == {"shm": 1, "zmq": 1, "dist": 0, "file": 0}
        text = caplog.text
        assert "rollout-0 takes its weights by shm (on the learner's host" in text
        assert "rollout-1 takes its weights by zmq (on another host; trying the fetch, then its group" in text
        assert "rollout-1 takes its weights by zmq from now on (median of 1 timed loads each: dist 0.500 s" in text
    finally:
        if th is not None:
            th.join(10)
        wb.close()
        transport.close()
        ctx.close()


def test_auto_on_the_real_engine_maps_the_slot_here_and_times_fetch_against_group_elsewhere(
        vllm_engine, tiny_cfg, tiny_base, tmp_path, monkeypatch, caplog):
    """The engine's weight client and the learner's "auto" around the session's real engine, no service: as rollout-0 on
    the learner's host it maps the slot and never asks for a group; as rollout-1 "on another host" (the slot made
    unreadable) it fetches, asks for a gloo group, joins it through vLLM, is timed over it, and then takes every version
    by the way measured faster. It serves each version exactly; the metrics and logs say the ways."""
    import logging

    from conftest import TINY_TEST_OVERRIDES, free_ports
    from transformers import AutoTokenizer

    import async_vapo.weights.client as client
    import async_vapo.weights.receive as receive
    from async_vapo.config import load_config
    from async_vapo.models.rl import load_policy
    from async_vapo.services.context import make_context
    from async_vapo.transport import InprocTransport
    from async_vapo.weights import WeightBroadcast
    from async_vapo.weights.client import EngineWeightClient

    ports = free_ports(3)
    cfg = load_config([], [*TINY_TEST_OVERRIDES, f"model.cache_dir={tiny_cfg.model.cache_dir}",
                           "cluster.weights.transfer=auto", "cluster.weights.auto_trials=1",
                           "cluster.weights.dist_timeout_s=60", f"cluster.weights.dir={tmp_path / 'w'}",
                           f"cluster.ports.weights_port={ports[0]}", f"cluster.ports.acks_port={ports[1]}",
                           f"cluster.ports.weights_fetch_port={ports[2]}"])
    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    transport = InprocTransport()
    ctxs = [make_context(s, cfg=cfg, run_dir=tmp_path / "run", instance=i, serve_metrics=False,
                         install_signals=False) for s, i in (("learner", 0), ("rollout", 0), ("rollout", 1))]
    wb = WeightBroadcast(ctxs[0], transport, device="cpu")
    caplog.set_level(logging.INFO)
    torch.manual_seed(5)
    version = 0

    def push(rollout) -> str:
        """One version: the learner publishes (and streams, in a thread: it waits for the engine), the rollout
        loads it between two "generate calls"; returns the way it came."""
        nonlocal version
        version += 1
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        th = threading.Thread(target=wb.publish, args=(version, policy.state_dict()))
        th.start()
        deadline = time.monotonic() + 60
        while vllm_engine.version != version or th.is_alive():
            assert time.monotonic() < deadline, f"version {version} did not reach {rollout.engine_id}"
            rollout.poll(0.05)
        wb.poll(0.2)
        rollout.poll(0.2)  # a group offer, if one came
        wb.poll(0.2)
        assert_engine_serves(vllm_engine, policy, tok)
        return max(("dist", "shm", "zmq"), key=lambda w: rollout.m_way.labels(way=w)._value.get())

    here = elsewhere = None
    try:
        here = EngineWeightClient(ctxs[1], transport, vllm_engine)
        assert [push(here), push(here)] == ["shm", "shm"]
        assert not here.remote and not here.in_group and "rollout-0" not in wb.groups
        assert wb.chooser.way("rollout-0") == "shm"

        monkeypatch.setattr(client, "slot_readable", lambda *a: False)  # rollout-1 is "on another host"
        monkeypatch.setattr(receive, "slot_holds", lambda *a: False)
        elsewhere = EngineWeightClient(ctxs[2], transport, vllm_engine)
        ways = [push(elsewhere) for _ in range(4)]
        # fetch (warm-up), fetch (timed; its group joined meanwhile), group (warm-up), group (timed)
        assert ways == ["zmq", "zmq", "dist", "dist"], ways
        assert elsewhere.remote and elsewhere.in_group
        chosen = wb.chooser.way("rollout-1")
        e = wb.chooser.engines["rollout-1"]
        assert chosen == ("dist" if e.costs["dist"][0] < e.costs["zmq"][0] else "zmq"), e
        assert [push(elsewhere), push(elsewhere)] == [chosen, chosen]  # kept
        assert ("rollout-1" in wb.groups) == (chosen == "dist")
        assert {w: wb.by_way.labels(way=w)._value.get() for w in ("shm", chosen)} == {"shm": 1, chosen: 1}
        text = caplog.text
        assert "rollout-0: serving version 1 via shm" in text and "rollout-1: serving version 6 via dist" in text
        assert "rollout-1: in its gloo weight group" in text
        assert f"learner: rollout-1 takes its weights by {chosen} from now on (median of 1 timed loads each" in text
    finally:
        wb.close()
        for svc in (here, elsewhere):
            if svc is not None:
                svc.close()
        transport.close()
        for ctx in ctxs:
            ctx.close()
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
