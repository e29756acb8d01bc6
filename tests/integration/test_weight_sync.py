"""Weight pushes into the running engine: the shared-memory buffer, the cluster's slots and fetch socket, and
every path served end to end."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_engine_serves

from async_vapo.transport import PeerTimeout, ProtocolError, ZmqTransport
from async_vapo.weights import (
    HEADER_BYTES,
    SharedWeightBuffer,
    WeightServer,
    WeightSlots,
    WeightsUnavailable,
    fetch_weights,
    read_header,
    slot_holds,
)


def _unflatten(buf, layout, base: int = 0) -> dict[str, torch.Tensor]:
    out = {}
    for name, dtype, shape, offset in layout:
        dt = getattr(torch, dtype)
        n = int(torch.Size(shape).numel()) * dt.itemsize
        out[name] = torch.frombuffer(bytearray(buf[base + offset: base + offset + n]), dtype=dt).view(shape)
    return out


def _read_back(path: str, nbytes: int, layout) -> dict[str, torch.Tensor]:
    """What a worker sees: the mapped file's bytes at the layout's offsets."""
    fd = os.open(path, os.O_RDONLY)
    try:
        buf = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return _unflatten(buf, layout)
    finally:
        buf.close()


def test_shared_buffer_holds_every_tensor_at_an_aligned_offset(tmp_path):
    emb = torch.randn(7, 3)
    state = {"embed.weight": emb, "norm.weight": torch.randn(3).bfloat16(), "scale": torch.tensor(2.5),
             "t.weight": torch.randn(3, 5).t(),  # not contiguous
             "lm_head.weight": emb}  # tied: stored under both names
    buf = SharedWeightBuffer(str(tmp_path))
    path, nbytes, layout = buf.write(state)
    assert [name for name, *_ in layout] == list(state)
    assert all(offset % SharedWeightBuffer.ALIGN == 0 for *_, offset in layout)
    # 84, 6, 4, 60 and 84 bytes at offsets rounded up to multiples of 64
    assert [offset for *_, offset in layout] == [0, 128, 192, 256, 320] and nbytes == 320 + 84
    got = _read_back(path, nbytes, layout)
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name

    state["embed.weight"] = emb + 1  # a second push of the same shapes reuses the file in place
    assert buf.write(state)[0] == path
    assert torch.equal(_read_back(path, nbytes, layout)["embed.weight"], emb + 1)
    buf.close()
    assert not Path(path).exists()


def test_shared_buffer_grows_into_a_new_file_and_leaves_none_behind(tmp_path):
    buf = SharedWeightBuffer(str(tmp_path))
    path, _, _ = buf.write({"w": torch.zeros(4)})
    buf.mapped()  # the workers have it: the name goes, the memory stays with the mappings
    assert not Path(path).exists() and list(tmp_path.iterdir()) == []
    assert buf.write({"w": torch.ones(4)})[0] == path  # still written in place
    new_path, nbytes, layout = buf.write({"w": torch.arange(1000.0)})  # larger than the capacity
    assert new_path != path and Path(new_path).exists()
    assert torch.equal(_read_back(new_path, nbytes, layout)["w"], torch.arange(1000.0))
    with pytest.raises(ValueError):
        buf.write({})
    buf.close()
    assert list(tmp_path.iterdir()) == []


def test_slots_hold_the_newest_versions_round_robin_and_name_the_rest_unavailable(tmp_path):
    slots = WeightSlots(tmp_path / "w", 2)
    states = {v: {"a": torch.full((5, 3), float(v)), "b": torch.arange(7, dtype=torch.int64) * v} for v in (1, 2, 3)}
    writes = {v: slots.write(v, states[v]) for v in (1, 2, 3)}
    assert writes[1].path == writes[3].path != writes[2].path  # slot 0 reused in place by version 3
    assert all(off % SharedWeightBuffer.ALIGN == 0 for *_, off in writes[3].layout) and writes[3].base == HEADER_BYTES
    for v in (2, 3):  # held: a reader of the file (an engine on this host) sees exactly the version
        w = writes[v]
        assert slot_holds(w.path, v, w.token)
        data = Path(w.path).read_bytes()
        assert read_header(data)[:3] == (1, v, w.nbytes)
        got = _unflatten(data, w.layout, w.base)
        assert all(torch.equal(got[k], states[v][k]) for k in states[v])
        assert slots.read(v, 0, w.nbytes) == data[w.base: w.base + w.nbytes]
    assert not slot_holds(writes[1].path, 1, writes[1].token)  # overwritten by version 3
    assert not slot_holds(writes[3].path, 3, "00" * 16)  # another learner's token: not our memory
    with pytest.raises(WeightsUnavailable):
        slots.read(1, 0, 8)
    with pytest.raises(WeightsUnavailable):
        slots.read(3, 0, writes[3].nbytes + 1)
    slots.close()
    assert list((tmp_path / "w").iterdir()) == []


def test_fetch_over_zeromq_returns_the_exact_bytes_and_names_every_failure(tmp_path, caplog):
    import zmq

    from async_vapo.transport import make_envelope
    from async_vapo.transport.messages import TensorHeader
    from async_vapo.transport.zmq_transport import make_socket, send_tensor_blob, shared_context

    slots = WeightSlots(tmp_path / "w", 2)
    served = []
    tp = ZmqTransport()
    server = WeightServer(tp, slots, "tcp://127.0.0.1:*", chunk_bytes=4096, max_bytes=2**20, send_timeout_s=2,
                          on_served=served.append)
    state = {"w": torch.randn(3000), "b": torch.randn(17).bfloat16()}  # 12,064 bytes: 3 chunks of 4 KiB
    try:
        w = slots.write(5, state)
        dst = bytearray(w.nbytes)
        # a malformed request first: counted and dropped, the server keeps serving
        raw = make_socket(shared_context(), zmq.DEALER)
        raw.connect(server.endpoint)
        raw.send(b"\x93not an envelope")
        r = fetch_weights(tp, server.endpoint, 5, w.nbytes, dst, chunk_bytes=4096, timeout_s=5, engine_id="e0",
                          max_bytes=2**20, window=2)
        for _ in range(100):  # the server counts a chunk once its send returned, maybe after the client got it
            if sum(served) == w.nbytes:
                break
            time.sleep(0.02)
        assert r["chunks"] == 3 and sum(served) == w.nbytes and server.decoder.rejects.total == 1
        got = _unflatten(dst, w.layout)
        assert all(torch.equal(got[k], state[k]) for k in state)
        slots.write(6, state)
        slots.write(7, state)  # version 5's slot is rewritten
        with pytest.raises(WeightsUnavailable):
            fetch_weights(tp, server.endpoint, 5, w.nbytes, dst, chunk_bytes=4096, timeout_s=5, engine_id="e0",
                          max_bytes=2**20)
        # a refusal to a requester that has gone (ROUTER_MANDATORY: host unreachable) leaves the server serving.
        # The request is handed to the server's own thread (a ZeroMQ socket is used by one thread only): its next
        # receive returns it, from a route no peer has.
        from async_vapo.transport.messages import WeightsFetch, encode

        gone = encode(make_envelope(WeightsFetch(engine_id="e9", version=5, index=0), sender="e9"))
        blob_server, recv, answered = server.server, server.server._recv_request, threading.Event()

        def recv_once(timeout_s):
            if answered.is_set():
                return recv(timeout_s)
            answered.set()
            return b"\x00gone", gone

        with caplog.at_level("WARNING", logger="async_vapo.transport.interface"):
            blob_server._recv_request = recv_once
            assert answered.wait(5)
            r = fetch_weights(tp, server.endpoint, 7, w.nbytes, dst, chunk_bytes=4096, timeout_s=5, engine_id="e0",
                              max_bytes=2**20)
        assert r["chunks"] == 3 and blob_server._thread.is_alive()
        assert any("could not answer e9" in m for m in caplog.messages)
        raw.close(linger=0)
    finally:
        server.close()
        slots.close()
    # a dead learner is a named timeout, not a hang
    with pytest.raises(PeerTimeout):
        fetch_weights(tp, server.endpoint, 7, 100, bytearray(100), chunk_bytes=4096, timeout_s=0.5, engine_id="e0",
                      max_bytes=2**20)
    # a corrupt chunk (its crc32 does not match) is rejected
    router = make_socket(shared_context(), zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def bad_server():
        parts = router.recv_multipart()
        hdr = TensorHeader(version=1, name="flat", dtype="uint8", shape=[100], nbytes=100, checksum="crc32:00000000")
        send_tensor_blob(router, make_envelope(hdr, sender="x"), b"\x01" * 100, timeout_s=2, route=parts[0])

    t = threading.Thread(target=bad_server)
    t.start()
    with pytest.raises(ProtocolError, match="checksum"):
        fetch_weights(tp, f"tcp://127.0.0.1:{port}", 1, 100, bytearray(100), chunk_bytes=4096, timeout_s=5,
                      engine_id="e0", max_bytes=2**20, window=1)
    t.join(5)
    router.close(linger=0)


@pytest.mark.parametrize("kind", ["inproc", "zmq"])
def test_fetch_through_the_transport_interface_on_either_transport(tmp_path, kind):
    """WeightServer and fetch_weights use only the Transport interface: the in-process transport (no ZeroMQ) serves a
    fetch as ZeroMQ does, with the same named failures."""
    from async_vapo.transport import InprocTransport

    tp = InprocTransport() if kind == "inproc" else ZmqTransport()
    slots = WeightSlots(tmp_path / "w", 2)
    served = []
    server = WeightServer(tp, slots, "tcp://127.0.0.1:*", chunk_bytes=1000, max_bytes=2**20, send_timeout_s=2,
                          on_served=served.append)
    state = {"w": torch.randn(2500), "b": torch.randn(33).bfloat16()}  # 10,066 bytes: 11 chunks of 1000
    try:
        w = slots.write(3, state)
        for window in (1, 4, 20):
            dst = bytearray(w.nbytes)
            r = fetch_weights(tp, server.endpoint, 3, w.nbytes, dst, chunk_bytes=1000, timeout_s=5, engine_id="e0",
                              max_bytes=2**20, window=window)
            got = _unflatten(dst, w.layout)
            assert r["chunks"] == 11 and all(torch.equal(got[k], state[k]) for k in state)
        slots.write(4, state)
        slots.write(5, state)  # version 3's slot is rewritten
        with pytest.raises(WeightsUnavailable):
            fetch_weights(tp, server.endpoint, 3, w.nbytes, bytearray(w.nbytes), chunk_bytes=1000, timeout_s=5,
                          engine_id="e0", max_bytes=2**20)
        with pytest.raises(ProtocolError):  # the learner's chunks are larger than this engine takes
            fetch_weights(tp, server.endpoint, 5, w.nbytes, bytearray(w.nbytes), chunk_bytes=500, timeout_s=5,
                          engine_id="e0", max_bytes=2**20)
        deadline = time.monotonic() + 5  # counted once each send returned, maybe after the client got it
        while sum(served) < 3 * w.nbytes and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sum(served) >= 3 * w.nbytes and server.decoder.rejects.total == 0
    finally:
        server.close()
        slots.close()
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout):  # the learner's server is gone: a named timeout, not a hang
        fetch_weights(tp, server.endpoint, 5, 100, bytearray(100), chunk_bytes=1000, timeout_s=0.5, engine_id="e0",
                      max_bytes=2**20)
    assert time.monotonic() - t0 < 3
    tp.close()


# ---- on the real engine (the session's shared one) ------------------------------------------------------------


@pytest.mark.slow
def test_every_push_path_serves_the_pushed_weights(vllm_engine, tiny_base, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from async_vapo.models.rl import load_policy

    tok = AutoTokenizer.from_pretrained(str(tiny_base))
    policy = load_policy(tiny_base)
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    torch.manual_seed(11)

    def perturb() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for p in policy.parameters():  # tied embeddings stay tied
                p.add_(0.05 * torch.randn_like(p))
        return policy.state_dict()

    slots = WeightSlots(tmp_path / "slots", 2)
    tp = ZmqTransport()
    server = WeightServer(tp, slots, "tcp://127.0.0.1:*", chunk_bytes=2**20, max_bytes=2**20, send_timeout_s=5)

    def from_slot(state, v):
        w = slots.write(v, state)
        vllm_engine.load_weights_from_shared(w.path, w.base + w.nbytes,
                                             [(n, d, sh, off + w.base) for n, d, sh, off in w.layout], v)
        assert slot_holds(w.path, v, w.token)

    def fetched(state, v):
        w = slots.write(v, state)
        dst = vllm_engine.receive_buffer(w.nbytes)
        fetch_weights(tp, server.endpoint, v, w.nbytes, dst, chunk_bytes=2**20, timeout_s=10, engine_id="e0",
                      max_bytes=2**20)
        del dst
        vllm_engine.load_received(w.layout, v)

    try:
        for version, push in enumerate([
            lambda s, v: vllm_engine.load_weights(s, v),  # shared buffer, first push maps it
            lambda s, v: vllm_engine.load_weights(s, v),  # the same buffer, rewritten in place
            lambda s, v: vllm_engine.load_weights(s, v, via="safetensors"),
            lambda s, v: (vllm_engine.release_weight_buffer(), vllm_engine.load_weights(s, v)),  # a new buffer
            lambda s, v: (save_file({k: t.clone() for k, t in s.items()}, tmp_path / f"v{v}.safetensors"),
                          vllm_engine.load_weights_from_file(str(tmp_path / f"v{v}.safetensors"), v)),
            lambda s, v: from_slot(s, v),  # the cluster learner's slot, mapped by the workers
            lambda s, v: from_slot(s, v),  # the other slot
            lambda s, v: from_slot(s, v),  # the first slot again, rewritten in place
            lambda s, v: fetched(s, v),  # fetched over ZeroMQ into the engine's own buffer
        ], start=1):
            push(perturb(), version)
            assert vllm_engine.version == version
            assert set(vllm_engine.last_load_stages) == {"write_s", "rpc_s", "read_s", "reload_s"}
            assert_engine_serves(vllm_engine, policy, tok)
    finally:
        server.close()
        slots.close()
        vllm_engine.load_weights(base, version=0)  # other tests share this engine
