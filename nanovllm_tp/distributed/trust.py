"""Where the plan channel's key material comes from, and the CURVE keys derived from it.

One shared secret per engine; every rank derives the same keys from it with HMAC-SHA256:
rank 0's server key pair (its PUB and back-channel PULL sockets) and one client key pair per
rank (SUB and PUSH). Rank 0 admits only the client keys of its own ranks (see ``zmq_link.ZapHandler``).
The secret never crosses a socket: spawned workers get a fresh one in their environment (readable
only by the same user), torchrun ranks on one node through a 0600 file in a private directory,
and multi-node engines read the one the operator set on every node.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat

from dataclasses import dataclass

from nanovllm_tp import envs

log = logging.getLogger("nanovllm_tp")

SECRET_ENV = "NANOVLLM_TP_SECRET"
SECRET_FILE_ENV = "NANOVLLM_TP_SECRET_FILE"
INSECURE_ENV = "NANOVLLM_TP_INSECURE"     # "1": no authentication or encryption (benchmarks only)
MIN_SECRET_CHARS = 32
HOW_TO = (f"make one with `python -c 'import secrets; print(secrets.token_hex(32))' > secret && chmod 600 secret`, "
          f"copy it to every node, and set {SECRET_FILE_ENV}=/path/to/secret (or {SECRET_ENV}=<its contents>) "
          "in the environment of every rank")


class SecretError(ValueError):
    """No usable shared secret where one is required."""


@dataclass(slots=True, frozen=True)
class ChannelKeys:
    """CURVE keys (Z85) derived from one secret."""
    secret: bytes

    def _pair(self, label: str) -> tuple[bytes, bytes]:
        import zmq
        from zmq.utils import z85
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq/libzmq build has no CURVE support, which the plan channel needs: "
                               "install the pyzmq wheel (it bundles libsodium)")
        private = z85.encode(hmac.new(self.secret, f"nanovllm_tp curve {label}".encode(), hashlib.sha256).digest())
        return zmq.curve_public(private), private

    def server(self) -> tuple[bytes, bytes]:
        """(public, secret) of rank 0's listening sockets."""
        return self._pair("server")

    def client(self, rank: int) -> tuple[bytes, bytes]:
        """(public, secret) of one reader rank."""
        return self._pair(f"client {int(rank)}")

    def replica(self, index: int) -> tuple[bytes, bytes]:
        """(public, secret) of a data-parallel replica's engine-loop sockets (serving/replica_link.py)."""
        return self._pair(f"replica {int(index)}")

    def front(self) -> tuple[bytes, bytes]:
        """(public, secret) of the HTTP process, the one client a replica's engine loop admits."""
        return self._pair("front")


def new_secret() -> bytes:
    return secrets.token_hex(32).encode()


def insecure() -> bool:
    return envs.get(INSECURE_ENV, "") == "1"


def _check_secret(value: bytes, where: str) -> bytes:
    value = value.strip()
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(f"the secret in {where} has {len(value)} characters; at least {MIN_SECRET_CHARS} are "
                          f"needed: {HOW_TO}")
    return value


def read_secret_file(path: str) -> bytes:
    """A secret file must belong to this user and be readable by nobody else (like an ssh key)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise SecretError(f"cannot read the secret file {path!r} ({exc.strerror}): {HOW_TO}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"the secret file {path!r} must belong to this user and have mode 0600 "
                              f"(it has {stat.S_IMODE(st.st_mode):o})")
        return _check_secret(f.read(4096), path)


def secret_from_env() -> bytes | None:
    """The operator's secret (NANOVLLM_TP_SECRET_FILE first, then NANOVLLM_TP_SECRET), or None."""
    path = envs.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path)
    value = envs.get(SECRET_ENV)
    return _check_secret(value.encode(), SECRET_ENV) if value else None


def require_secret_for(multi_node: bool) -> None:
    """Before joining anything: a multi-node engine refuses to start without a shared secret."""
    if multi_node and not insecure() and secret_from_env() is None:
        raise SecretError("a multi-node engine needs a shared secret to authenticate and encrypt its plan "
                          f"channel, and none is set: {HOW_TO}")


def write_private_file(directory: str, name: str, data: bytes) -> str:
    """Write ``data`` to a new 0600 file in ``directory`` (which should be 0700) and return its path."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path
