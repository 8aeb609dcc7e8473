"""The sockets between the HTTP process and a replica on another node (serving/replica_link.py), over real ZMQ on
127.0.0.1: only the HTTP process's key gets a message through, and it reaches only the replica whose key it holds."""
import time

import zmq

from nanovllm_tp.distributed.trust import ChannelKeys
from nanovllm_tp.serving.replica_link import ReplicaGate, client_keys

SECRET = b"replica-link-test-secret-0123456789abcdef"


def _replica(ctx, keys, index):
    gate = ReplicaGate(ctx, keys, index)
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    gate.secure(sock)
    sock.bind("tcp://127.0.0.1:*")
    return gate, sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _send(ctx, endpoint, curve) -> None:
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    if curve is not None:
        push.curve_publickey, push.curve_secretkey, push.curve_serverkey = curve
    push.connect(endpoint)
    try:
        push.send(b"hello")           # queued until a peer takes it: an unauthenticated one never does
    finally:
        time.sleep(0.5)
        push.close()


def _received(sock, wait_s: float) -> list[bytes]:
    got, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            got.append(sock.recv())
    return got


def test_only_the_http_process_key_gets_through():
    ctx = zmq.Context()
    keys = ChannelKeys(SECRET)
    gate, sock, endpoint = _replica(ctx, keys, 1)
    try:
        strangers = [None,                                                   # no CURVE at all
                     (*ChannelKeys(b"another-secret-" + b"x" * 32).front(), keys.replica(1)[0]),  # knows the server key
                     (*keys.client(0), keys.replica(1)[0]),                  # a plan-channel rank's key
                     (*keys.front(), keys.replica(2)[0])]                    # the wrong replica's server key
        for curve in strangers:
            _send(ctx, endpoint, curve)
        assert _received(sock, 1.0) == []
        _send(ctx, endpoint, client_keys(keys, 1))
        assert _received(sock, 2.0) == [b"hello"]
    finally:
        sock.close()
        gate.close()
        ctx.destroy(linger=0)
