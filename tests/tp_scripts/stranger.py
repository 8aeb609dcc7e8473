"""A process on the same machine that is no rank of the engine: it talks to the engine's ports as anyone
could, and prints (as JSON) how many frames it managed to receive.

usage: stranger.py back|sub TCP_ENDPOINT SECONDS
  back: random bytes, then forged err/bye/hello/hb messages over plain ZMQ and over CURVE with made-up keys
  sub:  subscribe to the plan stream without keys, with made-up keys, and with the server's public key
The server's public key (as if it had leaked) may be given in STRANGER_SERVER_KEY.
"""
import json
import os
import socket
import sys
import time

import msgpack
import zmq

mode, endpoint, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
leaked = os.environ.get("STRANGER_SERVER_KEY", "").encode() or None
ctx = zmq.Context()


def sockets(kind):
    """A plain socket, one with made-up CURVE keys, and (with a leaked server key) one with that key."""
    out = [ctx.socket(kind)]
    for server_key in [zmq.curve_keypair()[0]] + ([leaked] if leaked else []):
        sock = ctx.socket(kind)
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = server_key
        out.append(sock)
    for sock in out:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
    return out


forged = [{"t": "err", "rank": 1, "text": "stranger says stop"}, {"t": "bye", "rank": 1},
          {"t": "hello", "rank": 1, "pid": 1, "start": 1, "host": "x"}, {"t": "hb", "rank": 1},
          {"t": "err", "rank": 2, "text": "stranger says stop"}]
received = 0
host, port = endpoint[len("tcp://"):].rsplit(":", 1)
for _ in range(3):                                  # raw random bytes
    with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as raw:
        raw.sendall(os.urandom(4096))
        time.sleep(0.05)
if mode == "back":
    socks = sockets(zmq.PUSH)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock in socks:
            for msg in forged:
                try:
                    sock.send(msgpack.packb(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass
            try:
                sock.send(os.urandom(64), zmq.NOBLOCK)
            except zmq.Again:
                pass
        time.sleep(0.05)
else:
    socks = sockets(zmq.SUB)
    for sock in socks:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for sock, _ in poller.poll(50):
            sock.recv_multipart()
            received += 1
for sock in socks:
    sock.close()
ctx.term()
print(json.dumps({"received": received}))
