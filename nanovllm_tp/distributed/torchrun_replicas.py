"""Data-parallel replicas under torchrun: `serve --data-parallel-size D --tensor-parallel-size T` launched as D x T
ranks over one node or several. Which replica a rank belongs to, the process group of its replica only, and what
the replicas agree on through torchrun's own store: the engine loops' endpoints, a fresh secret on one node, and
the word to stop.

Replica r is global ranks r*T .. r*T+T-1. torchrun numbers a node's ranks consecutively, so when --nproc-per-node
is a multiple of T a replica's ranks share a node: its all-reduces stay inside it (shared memory), and only
requests and outputs cross the network (serving/replica_link.py). Every rank joins the process group of its own
replica, made on a prefix of torchrun's store: to the engine it is an ordinary T-rank launch, with its own rank 0
(the replica's engine loop) and a rendezvous on its node's loopback. Global rank 0 also runs the HTTP process.

The store lives in torchrun's agent on the first node: a replica whose store calls fail has lost the server (that
agent ended) and stops too. Keys carry torchrun's restart count, so a restarted job never reads its predecessor's.
"""
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from nanovllm_tp import envs
from nanovllm_tp.distributed import trust

STORE_TIMEOUT = timedelta(seconds=120)
REGISTER_TIMEOUT = timedelta(minutes=30)   # how long rank 0 waits for every replica to load its model and say where


@dataclass(slots=True, frozen=True)
class Placement:
    replica: int          # this rank's replica
    replicas: int         # D
    rank: int             # its rank inside the replica (0: the replica's engine loop)
    size: int             # T, the replica's ranks


_placement: Placement | None = None
_store = None


def place(replicas: int, tp: int) -> Placement:
    """This torchrun rank's replica, from torchrun's environment; ValueError when the launch does not fit."""
    global _placement
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    per_node = envs.local_ranks(world)
    if world != replicas * tp:
        raise ValueError(f"--data-parallel-size {replicas} x --tensor-parallel-size {tp} needs {replicas * tp} "
                         f"ranks, and torchrun started {world}: give --nnodes x --nproc-per-node = {replicas * tp}")
    if per_node % tp:
        raise ValueError(f"a replica's {tp} ranks must share a node: --nproc-per-node ({per_node}) must be a "
                         f"multiple of --tensor-parallel-size ({tp})")
    _placement = Placement(rank // tp, replicas, rank % tp, tp)
    return _placement


def current() -> Placement | None:
    """This process's placement once place() ran (None: not a data-parallel torchrun rank)."""
    return _placement


def _key(name: str) -> str:
    return f"nvtp_dp/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{name}"


def torchrun_store():
    """A client of torchrun's store (its agent's, or rank 0's where torchrun lets the ranks make it)."""
    global _store
    if _store is None:
        owner = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and int(os.environ["RANK"]) == 0
        _store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=owner,
                               timeout=STORE_TIMEOUT, wait_for_workers=False)
    return _store


def group_store():
    """The store the process group of this rank's replica is made on: its own prefix of torchrun's."""
    return dist.PrefixStore(_key(f"group{_placement.replica}"), torchrun_store())


def front_secret() -> bytes | None:
    """The secret the HTTP process and every replica's engine loop derive their keys from: the operator's
    (NANOVLLM_TP_SECRET_FILE / NANOVLLM_TP_SECRET, required across nodes); on one node without one, a fresh
    secret rank 0 hands the other replicas' engine loops through a 0600 file in a private directory, removed
    once each has read it (only its path goes through the store). None under NANOVLLM_TP_INSECURE=1."""
    if trust.insecure():
        return None
    secret = trust.secret_from_env()
    if secret is not None:
        return secret
    world = int(os.environ["WORLD_SIZE"])
    trust.require_secret_for(world > envs.local_ranks(world))
    store, me = torchrun_store(), _placement.replica
    if me != 0:
        secret = trust.read_secret_file(store.get(_key("secret_path")).decode())
        store.set(_key(f"secret_read/{me}"), b"1")
        return secret
    secret, directory = trust.new_secret(), tempfile.mkdtemp(prefix="nvtp_secret_")
    try:
        store.set(_key("secret_path"), trust.write_private_file(directory, "secret", secret))
        store.wait([_key(f"secret_read/{r}") for r in range(1, _placement.replicas)], STORE_TIMEOUT)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return secret


def register(endpoints: list[str]) -> None:
    """A replica's engine loop is up: where the HTTP process reaches it."""
    torchrun_store().set(_key(f"endpoints/{_placement.replica}"), json.dumps(endpoints))


def report_failure(why: str) -> None:
    """A replica could not start: rank 0 stops waiting for it and says why (best effort)."""
    try:
        torchrun_store().set(_key(f"failed/{_placement.replica}"), why.encode()[:4000])
    except Exception:
        pass


def others_endpoints() -> list[list[str]]:
    """Rank 0: replicas 1..D-1's endpoints, waiting until each has registered (at most REGISTER_TIMEOUT);
    RuntimeError as soon as one reports that it could not start."""
    store = torchrun_store()
    deadline = time.monotonic() + REGISTER_TIMEOUT.total_seconds()
    for r in range(1, _placement.replicas):
        while not store.check([_key(f"endpoints/{r}")]):
            if store.check([_key(f"failed/{r}")]):
                raise RuntimeError(f"replica {r} could not start: {store.get(_key(f'failed/{r}')).decode()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {r} did not register within {REGISTER_TIMEOUT}")
            time.sleep(0.2)
    return [json.loads(store.get(_key(f"endpoints/{r}"))) for r in range(1, _placement.replicas)]


def stop_all(why: str) -> None:
    """Rank 0 is stopping: every other replica stops too (best effort: the store may be gone already)."""
    try:
        torchrun_store().set(_key("stop"), why.encode())
    except Exception:
        pass


def told_to_stop() -> bool:
    """Whether rank 0 said stop, or the store is gone (its agent ended: no server is left to serve)."""
    try:
        return torchrun_store().check([_key("stop")])
    except Exception:
        return True


def close() -> None:
    global _store
    _store = None
