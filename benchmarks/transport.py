"""Throughput of rollout groups over our ZeroMQ path against raw ZeroMQ frames of the same size.

    .venv/bin/python benchmarks/transport.py --label after

One run measures, side by side and interleaved round by round (so a busy machine hurts both alike):

* ``ours``: the sender process builds an Envelope around a realistic :class:`GroupsMsg` (16 groups x 8
  samples, prompts of 16-24 tokens, responses of 40-96 tokens with per-token log-probs, a version and
  a reward each), encodes it and sends it with ``ZmqTransport.sender`` (PUSH, connects); the receiver
  process receives and decodes it with ``ZmqTransport.receiver`` (PULL, binds) and the socket's
  :class:`Decoder`, as the verifier does (``async_vapo/transport/zmq_transport.py``).
* ``transport only``: our sender and receiver with a ready-made frame and no codec (what the
  transport layer alone costs).
* ``raw``: the same two processes send and receive a ready-made frame of exactly the byte size of
  our encoded message over a PUSH/PULL pair made with the same socket options, with no codec.
* ``curve``: ``ours`` with CURVE on both sockets (the receiver admits only the rollout role's key, the
  sender trusts only the verifier's: ``async_vapo.transport.security``), as the services run by default.

Throughput is taken at the receiver over ``--messages`` messages after ``--warmup``; the ratio is
ours / raw messages per second (median over rounds). Encode-only and decode-only cost per message
are timed in one process, and so is building the groups from plain lists the way the rollout service
does (that cost is outside the transport but moves there if a codec change shifts work into the
constructors). ``--label before|after`` stores the run under that key of the JSON file and keeps
the other key, so one file holds the figures from before and after a codec change.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "transport" / "result.json"
RECV_TIMEOUT_S = 30.0


def raw_spec(seed: int, n_groups: int, n_samples: int) -> list[dict]:
    """Plain lists, as vLLM hands them to the rollout service (token ids ints, log-probs Python floats)."""
    rng = random.Random(seed)
    spec = []
    for i in range(n_groups):
        samples = []
        for j in range(n_samples):
            n = rng.randint(40, 96)
            samples.append(dict(
                response_ids=[rng.randrange(3, 60) for _ in range(n)],
                behavior_logprobs=[-rng.expovariate(4.0) for _ in range(n)],
                finish_reason="stop" if j % 4 else "length", reward=1.0 if j % 3 == 0 else -1.0,
                correct=j % 3 == 0, verdict="correct" if j % 3 == 0 else "wrong",
            ))
        spec.append(dict(uid=f"step12-p{i}", prompt=f"{i} + 7 * 3 - 2 = ?", answer=str(i + 19),
                         prompt_ids=[rng.randrange(3, 60) for _ in range(rng.randint(16, 24))], version=12,
                         samples=samples))
    return spec


def build_groups(spec: list[dict]):
    from async_vapo.types import Group, Trajectory

    return [Group(uid=g["uid"], prompt=g["prompt"], answer=g["answer"], prompt_ids=g["prompt_ids"],
                  version=g["version"], samples=[Trajectory(**s) for s in g["samples"]]) for g in spec]


def make_env(groups):
    from async_vapo.transport import GroupsMsg, make_envelope

    return make_envelope(GroupsMsg(groups=groups), sender="rollout-0", policy_version=12)


# ---- receiver process ----------------------------------------------------------------------------


def _curve_transport(ctx, keys_dir: str, role: str):
    from async_vapo.transport import ZmqTransport
    from async_vapo.transport.security import CurveKeys, Security

    return ZmqTransport(ctx, security=Security(CurveKeys.load(keys_dir, role), ctx))


def receiver_main(conn, n_groups: int, keys_dir: str = "") -> None:
    """Serves trials from the parent: ("ours" | "raw", warmup, n) -> binds, reports endpoint, receives."""
    import zmq

    from async_vapo.transport import Decoder, GroupsMsg, ZmqTransport
    from async_vapo.transport.interface import DEFAULT_HWM
    from async_vapo.transport.zmq_transport import bind_to_random_port, make_socket, shared_context

    ctx = shared_context()
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        kind, warmup, n = cmd
        if kind in ("ours", "frames", "curve"):
            transport = _curve_transport(ctx, keys_dir, "verifier") if kind == "curve" else ZmqTransport(ctx)
            rx = transport.receiver("tcp://127.0.0.1:*", decoder=Decoder((GroupsMsg,)), peer="rollout")
            conn.send(rx.endpoint)
            get = rx.recv if kind in ("ours", "curve") else rx.recv_frame

            def recv_one(get=get):
                got = get(RECV_TIMEOUT_S)
                if got is None:
                    raise TimeoutError("no message within the receive timeout")
                return got

            close = transport.close
        else:
            sock = make_socket(ctx, zmq.PULL, hwm=DEFAULT_HWM, zmtp_heartbeats=False)  # as the services' streams
            sock.setsockopt(zmq.RCVTIMEO, int(RECV_TIMEOUT_S * 1000))
            conn.send(bind_to_random_port(sock))

            def recv_one(sock=sock):
                return sock.recv(copy=False)

            def close(sock=sock):
                sock.close(linger=0)

        for _ in range(warmup):
            recv_one()
        t0 = time.perf_counter()
        for _ in range(n - 1):
            recv_one()
        last = recv_one()
        dt = time.perf_counter() - t0
        check = None
        if kind in ("ours", "curve"):  # the last message really is the groups that were sent
            groups = last.body.groups
            check = [len(groups), sum(len(s.response_ids) for g in groups for s in g.samples),
                     float(sum(sum(s.behavior_logprobs) for g in groups for s in g.samples))]
        close()
        conn.send((dt, check))


# ---- sender side (this process) ------------------------------------------------------------------


def run_trial(conn, kind: str, warmup: int, n: int, groups, frame_size: int, keys_dir: str = ""
              ) -> tuple[float, list | None]:
    import zmq

    from async_vapo.transport import ZmqTransport
    from async_vapo.transport.interface import DEFAULT_HWM
    from async_vapo.transport.zmq_transport import make_socket, shared_context

    conn.send((kind, warmup, n))
    endpoint = conn.recv()
    ctx = shared_context()
    if kind in ("ours", "frames", "curve"):
        transport = _curve_transport(ctx, keys_dir, "rollout") if kind == "curve" else ZmqTransport(ctx)
        tx = transport.sender(endpoint, peer="verifier")
        if kind in ("ours", "curve"):
            for _ in range(warmup + n):
                tx.send(make_env(groups), RECV_TIMEOUT_S)
        else:
            frame = os.urandom(frame_size)
            for _ in range(warmup + n):
                tx.send_frame(frame, RECV_TIMEOUT_S)
        result = conn.recv()
        transport.close()
    else:
        frame = os.urandom(frame_size)
        sock = make_socket(ctx, zmq.PUSH, hwm=DEFAULT_HWM, zmtp_heartbeats=False)
        sock.setsockopt(zmq.SNDTIMEO, int(RECV_TIMEOUT_S * 1000))
        sock.connect(endpoint)
        for _ in range(warmup + n):
            sock.send(frame, copy=False)
        result = conn.recv()
        sock.close(linger=0)
    return result


def per_call_us(fn, repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` calls, in microseconds."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(times)


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "async_vapo/transport/messages.py",
                                "async_vapo/types.py"], cwd=ROOT, capture_output=True, text=True).stdout
        return rev + (" + uncommitted changes to the codec" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="after", help="key of the JSON file this run is stored under")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--messages", type=int, default=1000, help="timed messages per trial")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5, help="ours/raw trial pairs, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--code", default=None,
                    help="what code is measured, for the JSON (default: git HEAD of this checkout)")
    args = ap.parse_args()

    from async_vapo.transport import PROTOCOL_VERSION, Decoder, GroupsMsg, encode

    spec = raw_spec(args.seed, args.groups, args.samples)
    groups = build_groups(spec)
    frame = encode(make_env(groups))
    decoder = Decoder((GroupsMsg,))
    assert decoder.decode(frame).body.groups == groups
    n_tokens = sum(len(s["response_ids"]) for g in spec for s in g["samples"])
    n_numbers = sum(len(g["prompt_ids"]) + sum(2 * len(s["response_ids"]) for s in g["samples"]) for g in spec)

    build_us = per_call_us(lambda: build_groups(spec), repeats=7, inner=20)
    encode_us = per_call_us(lambda: encode(make_env(groups)), repeats=7, inner=200)
    decode_us = per_call_us(lambda: decoder.decode(frame), repeats=7, inner=200)

    import tempfile

    from async_vapo.transport.security import create_keys

    keys_dir = str(create_keys(Path(tempfile.mkdtemp(prefix="transport-bench-")) / "keys"))
    mpctx = mp.get_context("spawn")
    parent, child = mpctx.Pipe()
    proc = mpctx.Process(target=receiver_main, args=(child, args.groups, keys_dir), daemon=True)
    proc.start()
    kinds = ("ours", "frames", "raw", "curve")
    rounds = []
    try:
        for r in range(args.rounds):
            row = {}
            for kind in kinds[r % 4:] + kinds[:r % 4]:  # rotate the order so none always runs first
                dt, check = run_trial(parent, kind, args.warmup, args.messages, groups, len(frame), keys_dir)
                row[kind] = args.messages / dt
                if check is not None:
                    want = [len(groups), n_tokens,
                            float(sum(sum(s.behavior_logprobs) for g in groups for s in g.samples))]
                    assert check[:2] == want[:2] and abs(check[2] - want[2]) <= 1e-6 * abs(want[2]), (check, want)
            row["ratio"] = row["ours"] / row["raw"]
            row["frames_ratio"] = row["frames"] / row["raw"]
            row["curve_ratio"] = row["curve"] / row["ours"]
            rounds.append(row)
            print(f"round {r}: ours {row['ours']:7.0f}  transport only {row['frames']:7.0f}  raw {row['raw']:7.0f} "
                  f"curve {row['curve']:7.0f} msg/s  ratio {row['ratio']:.3f}  curve/ours {row['curve_ratio']:.3f}",
                  flush=True)
    finally:
        parent.send(None)
        proc.join(10)

    med = {k: statistics.median(r[k] for r in rounds) for k in kinds}
    mb = len(frame) / 1e6
    result = {
        "command": f"cd {ROOT} && " + " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "code": args.code or git_rev(),
        "protocol_version": PROTOCOL_VERSION,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_end": list(os.getloadavg())},
        "message": {"groups": args.groups, "samples_per_group": args.samples, "response_tokens": n_tokens,
                    "numbers": n_numbers, "frame_bytes": len(frame)},
        "trials": {"messages": args.messages, "warmup": args.warmup, "rounds": args.rounds},
        "ours_msgs_per_s": med["ours"], "ours_mb_per_s": med["ours"] * mb,
        "transport_only_msgs_per_s": med["frames"], "transport_only_mb_per_s": med["frames"] * mb,
        "raw_msgs_per_s": med["raw"], "raw_mb_per_s": med["raw"] * mb,
        "ratio": med["ours"] / med["raw"],
        "curve_msgs_per_s": med["curve"], "curve_mb_per_s": med["curve"] * mb,
        "curve_over_ours": med["curve"] / med["ours"],
        "transport_only_ratio": med["frames"] / med["raw"],
        "ratio_per_round": [r["ratio"] for r in rounds],
        "encode_us": encode_us, "decode_us": decode_us, "build_groups_us": build_us,
        "rounds": rounds,
    }
    print()
    print(f"GroupsMsg: {args.groups} groups x {args.samples} samples, {n_tokens} response tokens, "
          f"{n_numbers} numbers, frame {len(frame)} bytes (protocol {PROTOCOL_VERSION}); median of {args.rounds} "
          f"rounds of {args.messages} messages")
    print(f"{'path':<44} {'msg/s':>8} {'MB/s':>8} {'/ raw':>6}")
    for kind, what in (("ours", "ours: encode -> ZmqSender -> ZmqReceiver -> decode"),
                       ("frames", "our transport, pre-encoded frame, no codec"),
                       ("raw", "raw PUSH/PULL frames of the same size"),
                       ("curve", "ours with CURVE (authenticated, encrypted)")):
        print(f"{what:<44} {med[kind]:>8.0f} {med[kind] * mb:>8.1f} {med[kind] / med['raw']:>6.3f}")
    per_round = ", ".join(f"{r['ratio']:.2f}" for r in rounds)
    print(f"ratio ours/raw per round: {per_round}")
    print(f"CURVE costs: curve/ours = {med['curve'] / med['ours']:.3f}")
    print(f"encode {encode_us:.1f} us/msg   decode {decode_us:.1f} us/msg   "
          f"(building the groups from lists: {build_us:.1f} us/msg)")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(args.out.read_text()) if args.out.exists() else {}
    doc["benchmark"] = ("GroupsMsg over ZmqTransport (encode -> PUSH/PULL -> decode) vs raw ZeroMQ frames "
                        "of the same size")
    doc["goal"] = "ratio >= 0.9"
    doc[args.label] = result
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out} [{args.label}]")


if __name__ == "__main__":
    main()
