"""The replay on a full disk: a real size-limited file system (tmpfs) under its log. Groups that do not fit
are held and the sender is held back through the pipe (backpressure); once there is room again every group
sent is stored, none twice, none lost.

Budget: about 20 s. Needs permission to mount a tmpfs (root); skipped, saying so, where there is none."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest

from async_vapo.config import load_config
from async_vapo.services.context import make_context
from async_vapo.transport import BackpressureFull, GroupsMsg, ZmqTransport, make_envelope
from async_vapo.types import Group, Trajectory

GROUPS = 400


def _group(i: int) -> Group:
    return Group(uid=f"u{i}", prompt="1+1=", answer="2", prompt_ids=[1, 2, 3], version=0,
                 samples=[Trajectory(response_ids=list(range(1, 4001)), behavior_logprobs=[-0.5] * 4000,
                                     finish_reason="length", reward=-1.0, correct=False, verdict="incorrect")
                          for _ in range(2)])


@pytest.fixture
def small_fs(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root): the disk-full test needs a size-limited file system")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_full_disk_holds_the_sender_and_loses_nothing(small_fs, tmp_path):
    from async_vapo.services.replay import ReplayService

    cfg = load_config([], ["algo.group_size=2", "algo.prompts_per_step=1", "algo.mini_batch_size=2",
                           "algo.micro_batch_size=2", "cluster.replay.fsync=always"])
    ctx = make_context("replay", cfg=cfg, run_dir=tmp_path, serve_metrics=False, install_signals=False)
    transport = ZmqTransport()
    svc = ReplayService(ctx, transport, in_endpoint="tcp://127.0.0.1:*", batch_endpoint="tcp://127.0.0.1:*",
                        store_path=small_fs / "groups.log")
    loop = threading.Thread(target=svc.run, daemon=True)
    loop.start()
    sender_transport = ZmqTransport()
    sender = sender_transport.sender(svc.pull.endpoint, hwm=4)
    held_back = 0
    sent = 0

    def send_all() -> None:  # as the verifier does: hold the group and retry while the pipe is full
        nonlocal held_back, sent
        for i in range(GROUPS):
            env = make_envelope(GroupsMsg(groups=[_group(i)]), sender="verifier-0")
            while True:
                try:
                    sender.send(env, 0.2)
                    sent += 1
                    break
                except BackpressureFull:
                    held_back += 1

    reg = ctx.metrics.registry
    pusher = threading.Thread(target=send_all, daemon=True)
    try:
        pusher.start()
        deadline = time.monotonic() + 60
        while not held_back:  # the disk filled up, the replay stopped reading, the pipe filled, the sender waits
            assert time.monotonic() < deadline, f"no backpressure (stored {len(svc.buffer)}, sent {sent})"
            assert loop.is_alive()
            time.sleep(0.1)
        assert (reg.get_sample_value("async_vapo_replay_store_errors_total", {"errno": "ENOSPC"}) or 0) >= 1
        assert reg.get_sample_value("async_vapo_replay_held_groups") >= 1
        stored_when_full = len(svc.buffer)
        assert 0 < stored_when_full < sent < GROUPS
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)], check=True)  # room again
        pusher.join(60)
        assert not pusher.is_alive() and sent == GROUPS
        deadline = time.monotonic() + 30
        while len(svc.buffer) < GROUPS:
            assert time.monotonic() < deadline, f"only {len(svc.buffer)} of {GROUPS} stored"
            time.sleep(0.1)
        assert sorted(g.uid for _, g in svc.store.live()) == sorted(f"u{i}" for i in range(GROUPS))
        assert svc.buffer.stats().rejected_total == {}
        assert reg.get_sample_value("async_vapo_replay_held_groups") == 0
        print(f"stored {stored_when_full} groups before the disk was full; the sender was held back {held_back} "
              f"times; all {GROUPS} stored once there was room")
    finally:
        ctx.stop.set()
        loop.join(10)
        svc.close()
        transport.close()
        sender_transport.close()
