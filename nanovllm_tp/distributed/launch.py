"""How this process joined the engine (alone, under torchrun, or spawned by rank 0), and the setup
every rank shares: process group, TP state, and the key-value store the plan channel bootstraps from."""
import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm_tp import envs
from nanovllm_tp.distributed import torchrun_replicas, trust
from nanovllm_tp.distributed.channel_common import proc_start_time
from nanovllm_tp.distributed.parallel_state import set_tp

log = logging.getLogger("nanovllm_tp")
SPAWN_ENV = "NANOVLLM_TP_SPAWNED"          # set in the environment of workers that rank 0 started
SPAWN_STORE_ENV = "NANOVLLM_TP_STORE_DIR"  # spawned workers: the private directory holding the FileStore
SPAWN_SECRET_ENV = "NANOVLLM_TP_SPAWN_SECRET"  # spawned workers: this engine's fresh secret
SPAWN_OWNER_ENV = "NANOVLLM_TP_SPAWN_OWNER"    # spawned workers: rank 0's pid and start time, "pid:ticks"
ORPHAN_GRACE_S = 10.0     # how long a spawned worker whose rank 0 died may take to leave on its own
STORE_TIMEOUT = timedelta(seconds=120)
_READY_KEY = "spawned_rank_{}_ready"      # set by a spawned worker once it runs (rank 0 watches for it)
_cpu_group = None


@dataclass(slots=True)
class DistInfo:
    rank: int
    world_size: int
    mode: str                 # "single" | "torchrun" | "spawn"
    node_rank: int = 0
    store: object = None      # torch store shared by all ranks (plan channel bootstrap)
    host: str = "127.0.0.1"   # address rank 0's services bind to / are reached at
    secret: bytes | None = None   # the plan channel's key material (None: unauthenticated, benchmarks only)


@dataclass(slots=True)
class SpawnRendezvous:
    """Spawn mode: a FileStore in a fresh 0700 directory (nothing listens on the network) and a fresh secret,
    both handed to the workers through their environment only."""
    directory: str
    store: object
    secret: bytes | None
    children: list = field(default_factory=list)    # ranks 1..N-1, once spawn_workers started them

    @classmethod
    def create(cls, world_size: int) -> "SpawnRendezvous":
        directory = tempfile.mkdtemp(prefix=f"nvtp_store_{os.getpid()}_")      # mode 0700; the maker's pid
        return cls(directory, file_store(directory, world_size),
                   None if trust.insecure() else trust.new_secret())

    def wait_for_workers(self) -> None:
        """Rank 0, before the process group: every spawned rank has reached the store, or this raises as soon as
        one has exited (an import error, a bad environment) instead of waiting out the group's timeout."""
        pending = dict(enumerate(self.children, start=1))
        deadline = time.monotonic() + STORE_TIMEOUT.total_seconds()
        while pending:
            for rank, child in list(pending.items()):
                if self.store.check([_READY_KEY.format(rank)]):
                    del pending[rank]
                elif child.poll() is not None:
                    raise RuntimeError(f"worker rank {rank} exited with code {child.returncode} while starting "
                                       "(its own error is printed above)")
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"worker ranks {sorted(pending)} did not start within {STORE_TIMEOUT}")
            time.sleep(0.02)

    def env(self) -> dict:
        out = {SPAWN_STORE_ENV: self.directory, SPAWN_OWNER_ENV: f"{os.getpid()}:{proc_start_time(os.getpid())}"}
        if self.secret is not None:
            out[SPAWN_SECRET_ENV] = self.secret.decode()
        return out

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def file_store(directory: str, world_size: int) -> "dist.FileStore":
    store = dist.FileStore(os.path.join(directory, "store"), world_size)
    store.set_timeout(STORE_TIMEOUT)
    return store


def join_spawned(info: DistInfo) -> None:
    """A spawned worker takes its store and secret from its environment (and out of it, for its children), and
    starts watching rank 0 (OwnerWatch)."""
    directory = os.environ.pop(SPAWN_STORE_ENV)
    pid, _, ticks = os.environ.pop(SPAWN_OWNER_ENV, "0:").partition(":")
    watch = OwnerWatch(directory, int(pid), int(ticks) if ticks.isdigit() else None)
    atexit.register(watch.remove_if_orphaned)
    if watch.orphaned():        # rank 0 died while this process was starting
        watch.remove_if_orphaned()
        sys.stderr.write(f"[nanovllm_tp worker rank {info.rank}] rank 0 (pid {pid}) died before this rank "
                         "started; exiting\n")
        raise SystemExit(1)
    watch.start()
    info.store = file_store(directory, info.world_size)
    info.store.set(_READY_KEY.format(info.rank), b"1")
    secret = os.environ.pop(SPAWN_SECRET_ENV, None)
    info.secret = None if secret is None else secret.encode()


@dataclass(slots=True)
class OwnerWatch:
    """What a spawned worker owes a rank 0 that died without cleaning up (kill -9): the store directory and
    rank 0's shared memory (named nvtp_<its pid>_) are removed, at once from a watching thread and again at exit;
    a worker that has not left ORPHAN_GRACE_S after the death (stuck waiting for rank 0 in the store or a
    collective while starting) is ended. Rank 0 is known by pid and start time, as the plan reader knows it:
    its parent pid alone is not enough, a worker may see rank 0 dead before the kernel re-parents it."""
    directory: str
    owner: int
    ticks: int | None         # rank 0's start time

    def orphaned(self) -> bool:
        return os.getppid() != self.owner or (self.ticks is not None and proc_start_time(self.owner) != self.ticks)

    def start(self) -> None:
        threading.Thread(target=self._watch, name="nvtp-owner-watch", daemon=True).start()

    def remove_if_orphaned(self) -> None:
        if self.orphaned():
            from nanovllm_tp.distributed.shm_ring import unlink_by_prefix
            shutil.rmtree(self.directory, ignore_errors=True)
            unlink_by_prefix(f"nvtp_{self.owner}_")

    def _watch(self) -> None:
        while not self.orphaned():
            time.sleep(0.5)
        self.remove_if_orphaned()
        time.sleep(ORPHAN_GRACE_S)
        self.remove_if_orphaned()
        sys.stderr.write(f"[nanovllm_tp worker rank {os.environ.get('RANK')}] rank 0 (pid {self.owner}) died and "
                         f"this rank did not leave within {ORPHAN_GRACE_S:.0f} s; ending it\n")
        os._exit(1)


def multi_node() -> bool:
    """torchrun with ranks on more than one node (known from the environment, before joining anything)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    return world > envs.local_ranks(world)


def torchrun_secret(info: DistInfo) -> None:
    """Under torchrun: the operator's secret; on one node without one, rank 0 makes a fresh one and hands it
    to the other ranks through a 0600 file in a private directory (only its path goes through the store)."""
    info.secret = trust.secret_from_env()
    if info.secret is not None or trust.insecure():
        return
    if multi_node():
        trust.require_secret_for(True)
    directory = None
    if info.rank == 0:
        info.secret = trust.new_secret()
        directory = tempfile.mkdtemp(prefix="nvtp_secret_")
        info.store.set("nvtp_secret_path", trust.write_private_file(directory, "secret", info.secret))
    try:
        if info.rank != 0:
            info.secret = trust.read_secret_file(info.store.get("nvtp_secret_path").decode())
        dist.barrier(group=_cpu_group)          # everyone has read it: the file can go
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and SPAWN_ENV not in os.environ)


def engine_rank() -> int:
    """This process's rank in its engine: under torchrun with data-parallel replicas its rank inside its replica
    (torchrun_replicas.py), else RANK (torchrun, or a worker rank 0 spawned), else 0."""
    placement = torchrun_replicas.current()
    if placement is not None:
        return placement.rank
    return int(os.environ.get("RANK", 0)) if launched_by_torchrun() or SPAWN_ENV in os.environ else 0


def rank0_host() -> str:
    """Where rank 0's services bind and are reached; a data-parallel replica's ranks share a node: loopback."""
    if torchrun_replicas.current() is not None:
        return "127.0.0.1"
    host = envs.get("NANOVLLM_TP_HOST") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
    return socket.gethostbyname(host)


def free_store() -> "dist.TCPStore":
    """A store on a port the OS picks (port 0), so two engines starting at once never collide."""
    return dist.TCPStore(rank0_host(), 0, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)


@contextlib.contextmanager
def _gloo_on_loopback(enabled: bool):
    """Spawned engines keep gloo's listening sockets on the loopback interface while the groups are made."""
    if not enabled or "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        yield
    finally:
        os.environ.pop("GLOO_SOCKET_IFNAME", None)


def init_process_group(rank: int, world_size: int, device: torch.device, store=None) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    with _gloo_on_loopback(store is not None and rank0_host().startswith("127.")):
        if store is None:
            dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=STORE_TIMEOUT, **kwargs)
        else:
            dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                                    world_size=world_size, timeout=STORE_TIMEOUT, **kwargs)
        set_tp(rank, world_size, dist.group.WORLD)
        global _cpu_group
        # Host-side bootstrap messages (ports, node ids) go over gloo even when the model uses NCCL.
        _cpu_group = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo")


def share_store(info: DistInfo) -> None:
    """Under torchrun: rank 0 opens a store on a free port and tells the others the port (an int tensor)."""
    port = torch.zeros(1, dtype=torch.int64)
    if info.rank == 0:
        info.store = free_store()
        port[0] = info.store.port
    dist.broadcast(port, src=0, group=_cpu_group)
    if info.rank != 0:
        info.store = dist.TCPStore(info.host, int(port[0]), is_master=False, timeout=STORE_TIMEOUT)


def node_ranks(world_size: int, my_node: int) -> list[int]:
    """Every rank's node index (all-gathered over a CPU group, whatever the device backend)."""
    mine = torch.tensor([my_node], dtype=torch.int64)
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(gathered, mine, group=_cpu_group)
    return [int(t[0]) for t in gathered]


def config_to_json(config) -> str:
    return json.dumps({f.name: getattr(config, f.name) for f in fields(config) if f.name != "model_config"})


def spawn_workers(config, world_size: int, rendezvous: SpawnRendezvous) -> list[subprocess.Popen]:
    """Start ranks 1..N-1 as fresh interpreters; the config travels as JSON, never pickled, and the store
    directory and secret in their environment (readable by this user only)."""
    children = []
    for rank in range(1, world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=rank0_host(), GROUP_RANK="0",
                   **rendezvous.env())
        env.pop("MASTER_PORT", None)
        env[SPAWN_ENV] = "1"
        children.append(subprocess.Popen(
            [sys.executable, "-m", "nanovllm_tp.workers.worker", "--config", config_to_json(config)], env=env))
    rendezvous.children = children
    return children


def stop_children(children: list[subprocess.Popen], timeout: float = 5.0) -> None:
    """Wait for workers to leave after a shutdown message; SIGTERM, then SIGKILL, the ones that don't."""
    for sig_timeout, action in ((timeout, None), (2.0, "terminate"), (2.0, "kill")):
        alive = [c for c in children if c.poll() is None]
        if not alive:
            return
        for child in alive:
            if action:
                getattr(child, action)()
        for child in alive:
            try:
                child.wait(timeout=sig_timeout)
            except subprocess.TimeoutExpired:
                pass


def exit_on_sigterm() -> None:
    """SIGTERM becomes SystemExit, so cleanup runs: rank 0's atexit closes the channel and stops every rank; a
    worker (torchrun's agent sends SIGTERM when another rank fails) releases its runner and the group."""
    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_sigterm)
