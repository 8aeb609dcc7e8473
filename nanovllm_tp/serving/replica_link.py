"""The sockets between the HTTP process and a data-parallel replica on another node (`serve -dp D` under
torchrun): requests and outputs cross the network there, so both ends run CURVE with keys derived from the
engine secret (distributed/trust.py). A replica's engine loop is the CURVE server with its own key pair, and its
ZAP handler admits one client key only, the HTTP process's: a stranger who reaches the port gets no handshake,
and the HTTP process, knowing the replica's public key, cannot be answered by an impostor either. Replicas on
the HTTP process's own node talk over ipc:// sockets in a private directory instead, as one engine does.
"""
import socket

import zmq
import zmq.auth.thread

from nanovllm_tp.distributed.trust import ChannelKeys


class _OnlyFront:
    """pyzmq's credentials provider: the HTTP process's public key (Z85) and nothing else."""

    def __init__(self, front_public: bytes):
        self.front_public = front_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.front_public


class ReplicaGate:
    """An engine loop's side: `secure(sock)` makes a socket a CURVE server admitting only the HTTP process.
    Owns a ZAP thread on the loop's context until close()."""

    def __init__(self, ctx: zmq.Context, keys: ChannelKeys, replica: int):
        self._public, self._secret = keys.replica(replica)
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", _OnlyFront(keys.front()[0]))

    def secure(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = self._public, self._secret

    def close(self) -> None:
        self._auth.stop()


def client_keys(keys: ChannelKeys, replica: int) -> tuple[bytes, bytes, bytes]:
    """The HTTP process's (public, secret) and the replica's public key: EngineClient's `curve`."""
    return (*keys.front(), keys.replica(replica)[0])


def reachable_address(peer: str) -> str:
    """This node's address on the route to `peer` (the HTTP process's node): where a replica binds so that the
    HTTP process can connect. No packet is sent (a UDP socket's connect only picks the route)."""
    with socket.socket(socket.AF_INET6 if ":" in peer else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((peer, 9))
        return probe.getsockname()[0]


def is_remote(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")



