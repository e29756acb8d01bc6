"""Authentication, encryption and role authorisation on every ZeroMQ socket: CURVE with a ZAP handler.

Keys. Each role (replay, verifier, rollout, learner) has one CURVE key pair, made by :func:`create_keys` (as
``deploy/start_cluster.sh`` does in ``RUN_DIR/keys``, mode 0700, secret files 0600) with ZeroMQ's own
``zmq.auth.create_certificates``. A service holds its own role's secret key and every role's public key;
start_cluster.sh hands remote hosts the secret keys of the roles they run, over the same ssh.

Roles, not just identities. Every socket names the role at its other end (``peer``):

* a socket that binds is a CURVE server with ZAP domain ``role:<peer>``; this process's ZAP handler (one
  ``zmq.auth.thread.ThreadAuthenticator`` per ZeroMQ context) admits on that domain only the public keys of
  that role. So only the learner may request batches or publish weights, only the verifier may push
  verified groups, only rollouts may push unscored groups, acks and weight fetches;
* a socket that connects is a CURVE client that trusts exactly the server role's public key (a man in the
  middle without that secret key gets no handshake).

A peer that fails the handshake never gets a frame through: its connection is closed by libzmq before any
message reaches the service (the handler logs the refusal and counts it, ``auth_failures_total``).

Off switch: ``cluster.security.curve = false`` runs plaintext, which the config refuses unless every service
binds to loopback (or ``cluster.security.allow_plaintext`` says so explicitly).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from async_vapo.transport.messages import TransportError

log = logging.getLogger(__name__)

ROLES = ("replay", "verifier", "rollout", "learner")


class SecurityError(TransportError):
    """Keys missing, unreadable or too open, or a socket that names no peer role under CURVE."""


def create_keys(keys_dir: str | os.PathLike[str], roles: tuple[str, ...] = ROLES) -> Path:
    """One key pair per role in ``keys_dir`` (kept when it exists): ``<role>.key`` (public),
    ``<role>.key_secret`` (0600) and ``public/<role>/<role>.key`` (the directory ZAP reads for that role)."""
    d = Path(keys_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for role in roles:
        public, secret = d / f"{role}.key", d / f"{role}.key_secret"
        if not (public.exists() and secret.exists()):
            old = os.umask(0o077)
            try:
                zmq.auth.create_certificates(str(d), role)
            finally:
                os.umask(old)
        os.chmod(secret, 0o600)
        pub_dir = d / "public" / role
        pub_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(public, pub_dir / public.name)
    return d


@dataclass(frozen=True)
class CurveKeys:
    """This process's CURVE identity (its role's key pair) and the public key of every role."""

    role: str
    public: bytes
    secret: bytes
    peers: dict[str, bytes]
    keys_dir: Path

    @classmethod
    def load(cls, keys_dir: str | os.PathLike[str], role: str) -> CurveKeys:
        d = Path(keys_dir)
        if role not in ROLES:
            raise SecurityError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        secret_file = d / f"{role}.key_secret"
        if not secret_file.exists():
            raise SecurityError(f"no CURVE key for {role} in {d}: deploy/start_cluster.sh creates them, or "
                                f"`python -m async_vapo.transport.security create {d}`")
        mode = stat.S_IMODE(secret_file.stat().st_mode)
        if mode & 0o077:
            raise SecurityError(f"{secret_file} is readable by others (mode {mode:o}): chmod 600 it")
        public, secret = zmq.auth.load_certificate(str(secret_file))
        peers = {}
        for r in ROLES:
            f = d / f"{r}.key"
            if f.exists():
                peers[r] = zmq.auth.load_certificate(str(f))[0]
        return cls(role=role, public=public, secret=secret, peers=peers, keys_dir=d)


class Security:
    """Applies CURVE to this process's sockets and runs its ZAP handler (one per ZeroMQ context)."""

    _authenticators: dict[int, ThreadAuthenticator] = {}
    _lock = threading.Lock()

    def __init__(self, keys: CurveKeys, ctx: zmq.Context, on_refused: Callable[[str], None] | None = None):
        self.keys, self.ctx = keys, ctx
        with self._lock:
            auth = self._authenticators.get(id(ctx))
            if auth is None:
                auth = _CountingAuthenticator(ctx, log=logging.getLogger("async_vapo.zap"))
                auth.start()
                self._authenticators[id(ctx)] = auth
            for role in ROLES:
                location = keys.keys_dir / "public" / role
                if location.is_dir():
                    auth.configure_curve(domain=f"role:{role}", location=str(location))
            if on_refused is not None:
                auth.listeners.append(on_refused)
        self.auth = auth

    def server(self, sock: zmq.Socket, allow: str | None) -> None:
        """Make ``sock`` (before it binds) a CURVE server admitting only keys of role ``allow``."""
        if allow not in ROLES:
            raise SecurityError(f"a bound socket must name the role allowed to connect, got {allow!r}")
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True
        sock.zap_domain = f"role:{allow}".encode()

    def client(self, sock: zmq.Socket, server_role: str | None) -> None:
        """Make ``sock`` (before it connects) a CURVE client trusting only role ``server_role``'s key."""
        if server_role not in self.keys.peers:
            raise SecurityError(f"no public key for the server role {server_role!r} in {self.keys.keys_dir}")
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_serverkey = self.keys.peers[server_role]

    @classmethod
    def stop_all(cls) -> None:
        """Stop every ZAP handler of this process (tests; a service's handler ends with the process)."""
        with cls._lock:
            for auth in cls._authenticators.values():
                try:
                    auth.stop()
                except zmq.ZMQError:  # its context was destroyed first: the handler is gone with it
                    pass
            cls._authenticators.clear()


class _CountingAuthenticator(ThreadAuthenticator):
    """ZeroMQ's ZAP handler, telling listeners about every refused handshake (for a metric)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.listeners: list[Callable[[str], None]] = []
        self.refused = 0

    def _send_zap_reply(self, request_id, status_code, status_text, user_id="anonymous"):  # noqa: ANN001
        if status_code != b"200":
            self.refused += 1
            for listener in list(self.listeners):
                try:
                    listener(status_text.decode(errors="replace") if isinstance(status_text, bytes) else
                             str(status_text))
                except Exception:  # a metric never breaks authentication
                    log.exception("ZAP refusal listener failed")
        return super()._send_zap_reply(request_id, status_code, status_text, user_id)


def main(argv: list[str] | None = None) -> int:
    """``python -m async_vapo.transport.security create KEYS_DIR``: the cluster's keys (idempotent)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or args[0] != "create":
        print("usage: python -m async_vapo.transport.security create KEYS_DIR", file=sys.stderr)
        return 2
    print(create_keys(args[1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
