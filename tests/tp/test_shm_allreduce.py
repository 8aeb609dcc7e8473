"""Shared-memory all-reduce between real processes: bit-exact rank-order sums, gloo fallback for big
tensors, a dead or departed peer raises within seconds, and no /dev/shm segment is left behind."""
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback

import pytest
import torch

from tests.procs import alive, segments_of

pytestmark = [pytest.mark.spawn, pytest.mark.slow]

SHAPES = [(1,), (7,), (3, 5, 17), (64, 1024), (256, 1024)]     # (256, 1024) fp32 = exactly 1 MiB


def _inputs(rank: int, call: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _expected(world: int, call: int, shape, dtype) -> torch.Tensor:
    acc = _inputs(0, call, shape, dtype) + _inputs(1, call, shape, dtype)
    for r in range(2, world):
        acc = acc + _inputs(r, call, shape, dtype)
    return acc


def _join(rank, world, tmp, slot_bytes=1 << 20, timeout_s=60.0, gloo=False):
    """Rank 0 creates the segment and shares its name through a FileStore; the others attach."""
    import torch.distributed as dist

    from nanovllm_tp.distributed import shm_allreduce as sar
    store = dist.FileStore(os.path.join(tmp, "store"), world)
    if gloo:
        from nanovllm_tp.distributed.parallel_state import set_tp
        dist.init_process_group("gloo", store=dist.PrefixStore("pg", store), rank=rank, world_size=world)
        set_tp(rank, world, dist.group.WORLD)
    if rank == 0:
        ar = sar.ShmAllReduce.create(world, slot_bytes, timeout_s)
        store.set("ar", ar.name)
    else:
        ar = sar.ShmAllReduce.attach(store.get("ar").decode(), rank, timeout_s)
    sar._installed = ar
    return ar


class _Stdout:
    """A child's messages to the test: one JSON line each on stdout (nothing is pickled)."""

    @staticmethod
    def put(msg):
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def _child(scenario, rank, world, tmp, q=_Stdout):
    torch.set_num_threads(1)
    try:
        q.put((rank, "pid", os.getpid()))
        if scenario == "sums":
            from nanovllm_tp.distributed.parallel_state import all_reduce
            ar = _join(rank, world, tmp, gloo=True)
            call, fell_back = 0, 0
            for dtype in (torch.float32, torch.bfloat16):
                for shape in SHAPES + [(257, 1024), (1024, 1024)]:     # the last two are over 1 MiB in fp32
                    for _ in range(3):
                        call += 1
                        x = _inputs(rank, call, shape, dtype)
                        fell_back += not ar.fits(x)
                        y = all_reduce(x)
                        want = _expected(world, call, shape, dtype)
                        if ar.fits(_inputs(rank, call, shape, dtype)) or world == 2:    # gloo: its own order
                            assert y is x and torch.equal(x, want), (shape, dtype)
                        else:
                            torch.testing.assert_close(x, want, atol=0.05, rtol=0.02)
            for i in range(3000):                                    # many consecutive calls, both parities
                call += 1
                shape = (1 + i % 9, 4 + i % 5)
                x = all_reduce(_inputs(rank, call, shape, torch.float32))
                assert torch.equal(x, _expected(world, call, shape, torch.float32)), i
            q.put((rank, "ok", (ar._gen, fell_back)))
            ar.close()
        elif scenario in ("kill1", "kill0", "close1", "late1"):
            victim = int(scenario[-1])
            ar = _join(rank, world, tmp, timeout_s=2.0 if scenario == "late1" else 60.0)
            x = ar.all_reduce(torch.ones(16))
            assert torch.equal(x, torch.full((16,), float(world)))
            if rank == victim:
                q.put((rank, "ready", None))
                if scenario.startswith("kill"):
                    time.sleep(1.0)
                    os.kill(os.getpid(), signal.SIGKILL)
                elif scenario == "close1":
                    time.sleep(1.0)
                    ar.close()
                time.sleep(30)
                return
            t0 = time.monotonic()
            try:
                ar.all_reduce(torch.ones(16))
                q.put((rank, "error", "all_reduce returned"))
            except RuntimeError as exc:
                q.put((rank, "raised", (str(exc), time.monotonic() - t0)))
            ar.close()
    except BaseException:  # noqa: BLE001 - reported to the test process
        q.put((rank, "error", traceback.format_exc()))


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(scenario, world, tmp_path, timeout=120):
    """Start `world` fresh interpreters running _child; collect their JSON lines until done."""
    procs = []
    msgs, pids = [], {}
    sel = selectors.DefaultSelector()
    try:
        for rank in range(world):
            code = (f"import sys; sys.path.insert(0, {REPO!r}); from tests.tp.test_shm_allreduce import _child; "
                    f"_child({scenario!r}, {rank}, {world}, {str(tmp_path)!r})")
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
            procs.append(proc)
            sel.register(proc.stdout, selectors.EVENT_READ)
        deadline, open_pipes, done = time.monotonic() + timeout, world, False
        while open_pipes and not done and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=0.2):
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                    continue
                rank, kind, value = json.loads(line)
                if kind == "pid":
                    pids[rank] = value
                else:
                    msgs.append((rank, kind, value))
                if kind in ("raised", "error") or (kind == "ok" and sum(k == "ok" for _, k, _ in msgs) == world):
                    done = True
    finally:
        for proc in procs:
            try:
                proc.wait(timeout=5 if scenario == "sums" else 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            proc.stdout.close()
        sel.close()
    errors = [v for _, k, v in msgs if k == "error"]
    assert not errors, errors[0]
    return msgs, pids


def _no_segments(pids):
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(segments_of(p) for p in pids.values()):
        time.sleep(0.1)
    return not any(segments_of(p) for p in pids.values())


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_rank_order_and_big_tensors_fall_back(tmp_path, world):
    msgs, pids = _run("sums", world, tmp_path)
    oks = [v for _, k, v in msgs if k == "ok"]
    assert len(oks) == world
    gens, fell_back = oks[0]
    assert all(v == oks[0] for v in oks) and fell_back == 2 * 3 * 2 - 3    # bf16 (257, 1024) fits in 1 MiB
    assert gens > 3000
    assert _no_segments(pids)


@pytest.mark.parametrize("scenario,victim", [("kill1", 1), ("kill0", 0), ("close1", 1)])
def test_dead_or_departed_peer_raises_quickly(tmp_path, scenario, victim):
    msgs, pids = _run(scenario, 2, tmp_path)
    raised = [v for r, k, v in msgs if k == "raised"]
    assert raised, msgs
    text, took = raised[0]
    assert f"rank {victim}" in text
    assert took < 1.0 + 5.0     # the victim waits 1 s before dying
    assert _no_segments(pids)
    assert not any(alive(p) for p in pids.values())


def test_hard_timeout(tmp_path):
    msgs, pids = _run("late1", 2, tmp_path)
    text, took = next(v for r, k, v in msgs if k == "raised")
    assert "rank 1" in text and "within" in text and 1.5 < took < 5
    assert _no_segments(pids)
