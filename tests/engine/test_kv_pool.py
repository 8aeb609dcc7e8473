"""A request handed between two engines whose KV pools are shared (workers/kv_pool.py, the kv_shared_pool knob):
the payload names its blocks and their versions, and the importer copies them from pool to pool. The tokens are
those of a run that never moved (greedy fp32: transformers' too; bf16; int8 with its scales); a block the exporter
took for other tokens before the import, a pool that is gone, a wrong token or block id: the completion computes
again, to the same tokens, and the engine serves on."""
import os
import subprocess
import sys

import msgpack
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.kv_transfer import export_request, import_request
from tests.engine.test_kv_transfer import BS, GREEDY, KNOBS, PROMPT, alone, finish, steps
from tests.helpers import hf_greedy


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Two fp32 engines with shared pools; the first's pool small (40 blocks), so that its freed blocks are
    taken again by the next long prompt."""
    probe = LLM(tiny_model_dir, **KNOBS)
    block_bytes = probe.engine.runner.kv_block_bytes()
    probe.close()
    first = LLM(tiny_model_dir, **{**KNOBS, "kv_cache_memory": 41 * block_bytes})
    second = LLM(tiny_model_dir, **KNOBS)
    assert first.stats()["num_kv_blocks"] == 40 and first.engine.runner.kv_pool is not None
    yield first, second
    first.close()
    second.close()


def handed(first: LLM, rid: str, prompt, params: SamplingParams, k: int) -> tuple[dict, bytes]:
    """The request on `first` for k steps, then exported by reference: (its tokens so far, the payload)."""
    first.add_request(prompt, params, request_id=rid)
    before = steps(first, rid, k)
    return before, export_request(first, rid, by_reference=True)


def test_a_hand_off_copies_pool_to_pool_and_decodes_on(engines, hf_model):
    first, second = engines
    want = alone(first, PROMPT, GREEDY)[0]
    assert want == hf_greedy(hf_model, PROMPT, GREEDY.max_tokens)
    moved = second.stats()["kv_transfer"]
    before, payload = handed(first, "ref", PROMPT, GREEDY, k=5)
    row = msgpack.unpackb(payload)["completions"][0]
    blocks = -(-(len(PROMPT) + 5 - 1) // BS)
    assert row["kv"] is None and len(row["blocks"]) == len(row["versions"]) == blocks
    assert len(payload) < 2000           # the KV stays in the pool: the payload is the request's state
    computed = second.stats()["num_computed_tokens"]
    import_request(second, payload)
    after = finish(second, "ref")[0]
    assert before[0] + after == want
    stats = second.stats()
    assert stats["num_computed_tokens"] - computed == len(after)        # nothing computed again
    block_bytes = second.engine.runner.kv_block_bytes()
    assert stats["kv_transfer"]["blocks_in"] - moved["blocks_in"] == blocks
    assert stats["kv_transfer"]["bytes_in"] - moved["bytes_in"] == blocks * block_bytes
    assert stats["kv_transfer"]["completions_recomputed"] == moved["completions_recomputed"]


@pytest.mark.parametrize("knobs", [{"dtype": "bfloat16"}, {"kv_cache_dtype": "int8"}], ids=["bf16", "int8"])
def test_each_kv_format_moves_pool_to_pool(tiny_model_dir, knobs):
    with LLM(tiny_model_dir, **KNOBS, **knobs) as first, LLM(tiny_model_dir, **KNOBS, **knobs) as second:
        want = alone(first, PROMPT, GREEDY)[0]
        before, payload = handed(first, "fmt", PROMPT, GREEDY, k=3)
        import_request(second, payload)
        assert before[0] + finish(second, "fmt")[0] == want
        assert second.stats()["kv_transfer"]["completions_recomputed"] == 0


def test_blocks_taken_for_other_tokens_before_the_import_are_computed_again(engines):
    first, second = engines
    prompt = list(range(300, 345))     # not PROMPT: the second engine's prefix cache would hold its blocks
    want = alone(first, prompt, GREEDY)[0]
    _, payload = handed(first, "stale", prompt, GREEDY, k=4)
    # two prompts that need 38 of the 40 blocks take the ones the request freed (its versions move), although
    # freed blocks are taken again least recently freed first
    first.generate([list(range(200, 200 + 300)), list(range(600, 600 + 300))], SamplingParams(max_tokens=1),
                   use_tqdm=False)
    recomputed = second.stats()["kv_transfer"]["completions_recomputed"]
    computed = second.stats()["num_computed_tokens"]
    import_request(second, payload)
    got = finish(second, "stale")[0]
    assert second.stats()["kv_transfer"]["completions_recomputed"] == recomputed + 1
    assert second.stats()["num_computed_tokens"] - computed > len(prompt)      # its tokens computed again
    assert got == want[4:]
    assert second.stats()["kv_cache_usage"] == 0.0


@pytest.mark.parametrize("edit", ["token", "block", "pid", "closed"])
def test_a_pool_that_cannot_be_read_means_computing_again(tiny_model_dir, engines, edit):
    """A wrong token (another file, or another pool, at that fd), a block id past the pool, a process that is not
    there, the exporting engine closed: the completion computes again, to the same tokens."""
    first, second = engines
    # an engine whose pool the second has not mapped yet (a mapped pool is known by its token, whatever the pid)
    exporter = LLM(tiny_model_dir, **KNOBS) if edit in ("pid", "closed") else first
    start = 400 + 50 * ["token", "block", "pid", "closed"].index(edit)
    prompt = list(range(start, start + 45))           # a prompt the second engine holds no block of
    want = alone(exporter, prompt, GREEDY)[0]
    _, payload = handed(exporter, f"bad-{edit}", prompt, GREEDY, k=3)
    d = msgpack.unpackb(payload)
    if edit == "token":
        d["pool"]["token"] = "0" * 32
    elif edit == "block":
        d["completions"][0]["blocks"][-1] = 10 ** 6
    elif edit == "pid":
        d["pool"]["pid"] = _dead_pid()
    else:
        exporter.close()
    recomputed = second.stats()["kv_transfer"]["completions_recomputed"]
    import_request(second, msgpack.packb(d, use_bin_type=True))
    assert finish(second, f"bad-{edit}")[0] == want[3:]
    assert second.stats()["kv_transfer"]["completions_recomputed"] == recomputed + 1
    if exporter is not first:
        exporter.close()


def test_a_pool_reference_to_a_fifo_or_a_socket_does_not_hang(engines, tmp_path):
    """A pool field naming an fd of this process that is a FIFO (its open would wait for a writer) or a socket:
    refused as no pool, and the completion computes again."""
    import socket
    first, second = engines
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    sock = socket.socket()
    try:
        for k, fd in enumerate((reader, sock.fileno())):
            prompt = list(range(700 + 50 * k, 745 + 50 * k))
            want = alone(first, prompt, GREEDY)[0]
            _, payload = handed(first, f"fd-{k}", prompt, GREEDY, k=3)
            d = msgpack.unpackb(payload)
            d["pool"].update(pid=os.getpid(), fd=fd, token="1" * 32)
            import_request(second, msgpack.packb(d, use_bin_type=True))
            assert finish(second, f"fd-{k}")[0] == want[3:]
    finally:
        os.close(reader)
        sock.close()


@pytest.mark.parametrize("pool, field", [
    ({"pid": 1, "fd": 3}, "pool"),
    ({"pid": 1, "fd": 3, "token": "../../etc/passwd".ljust(32, "x")}, "pool"),
    ({"pid": 0, "fd": 3, "token": "0" * 32}, "pool"),
    (None, "pool"),
], ids=["no-token", "path-token", "pid-0", "blocks-without-pool"])
def test_a_malformed_pool_field_is_refused_by_name(engines, pool, field):
    first, second = engines
    _, payload = handed(first, "malformed", PROMPT, GREEDY, k=2)
    d = msgpack.unpackb(payload)
    d["pool"] = pool
    with pytest.raises(ValueError, match=field):
        import_request(second, msgpack.packb(d, use_bin_type=True))
    assert "malformed" not in second._requests and second.stats()["num_waiting"] == 0


def test_the_pool_is_a_memory_file_of_the_engine_alone(engines):
    """No name in /dev/shm; the engine's fd is a memfd, closed with the engine (nothing left on any exit)."""
    first, _ = engines
    pool = first.engine.runner.kv_pool
    assert os.readlink(f"/proc/self/fd/{pool.fd}").startswith("/memfd:nanovllm-tp-kv-pool")
    assert not [n for n in os.listdir("/dev/shm") if "kv-pool" in n]


def test_kv_shared_pool_off_keeps_private_memory_and_exports_bytes(tiny_model_dir):
    with LLM(tiny_model_dir, **KNOBS, kv_shared_pool=False) as first, LLM(tiny_model_dir, **KNOBS) as second:
        assert first.engine.runner.kv_pool is None
        want = alone(first, PROMPT, GREEDY)[0]
        before, payload = handed(first, "private", PROMPT, GREEDY, k=3)
        assert msgpack.unpackb(payload)["completions"][0]["kv"] is not None
        import_request(second, payload)
        assert before[0] + finish(second, "private")[0] == want


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
