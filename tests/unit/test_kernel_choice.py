"""The linear kernel chosen per weight shape and row-count bucket (layers/kernel_choice.py): the buckets, the
winner rule, the cache on disk and what invalidates it, the dispatch of a step to its bucket's real kernel, and
the AMX probe's fallback."""
import errno
import json

import pytest
import torch
import torch.nn.functional as F

from nanovllm_tp.layers import cpu_build, cpu_features, cpu_kernels, kernel_choice
from nanovllm_tp.layers.kernel_choice import BUCKETS, TIMED_ROWS, ChosenWeight, bucket, choose, winners_of
from nanovllm_tp.layers.packed_linear import C_KERNEL, ONEDNN
from tests.helpers import alternate_kernel_tables, kernel_cache

needs_both = pytest.mark.skipif(not (cpu_kernels.load() and torch.float32 in cpu_kernels.load().linear_dtypes
                                     and ONEDNN.can_run(torch.zeros(1, 2))),
                                reason="csrc/linear.c's fp32 kernel or oneDNN does not run on this CPU")


def test_rows_fall_in_the_buckets_1_2to4_5to8_9to16_17to32_33to64_more():
    edges = {0: 0, 1: 0, 2: 1, 4: 1, 5: 2, 8: 2, 9: 3, 16: 3, 17: 4, 32: 4, 33: 5, 64: 5, 65: 6, 300: 6, 1 << 20: 6}
    assert {rows: bucket(rows) for rows in edges} == edges
    assert [bucket(rows) for rows in TIMED_ROWS] == list(range(len(BUCKETS)))    # each timed inside its bucket
    assert BUCKETS == ("1", "2-4", "5-8", "9-16", "17-32", "33-64", ">64")


def test_a_second_layout_is_kept_only_where_it_wins_by_more_than_the_margin():
    c = [10.0, 12.0, 20.0, 40.0, 80.0, 160.0, 640.0]          # fastest in 4 buckets: the main layout
    onednn = [16.0, 14.0, 25.0, 50.0, 78.4, 120.0, 621.0]      # faster in the last 3: by 2%, 25%, 3%
    assert winners_of({"c": c, "onednn": onednn}) == ("c", "c", "c", "c", "c", "onednn", "c")
    assert winners_of({"c": c, "onednn": [x * 0.97 for x in c]}) == ("onednn",) * 7     # one layout: the main one
    assert winners_of({"c": c}) == ("c",) * 7


def test_timings_other_work_spoiled_are_recognised():
    """Calls of a kernel cost more with more rows, and one row reads the weight once: a table that says otherwise
    was measured while something else ran (it is measured again, then not cached)."""
    sane = {"c": [10.0, 12.0, 20.0, 40.0, 80.0, 160.0, 640.0], "onednn": [30.0, 20.0, 25.0, 50.0, 90.0, 150.0, 600.0]}
    assert not kernel_choice.disturbed(sane, 1 << 20)
    assert kernel_choice.disturbed({**sane, "c": [10.0, 12.0, 20.0, 40.0, 900.0, 160.0, 640.0]}, 1 << 20)
    assert kernel_choice.disturbed({**sane, "onednn": [40_000.0] * 7}, 1 << 20)    # 1 MiB at 26 MB/s
    assert not kernel_choice.disturbed({"onednn": [40_000.0] * 7}, 56 << 20)      # 56 MiB at 1.5 GB/s: may be


def _weights(shapes, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


@needs_both
def test_the_table_is_measured_once_cached_per_cpu_and_source_then_reused(tmp_path, monkeypatch):
    cache = kernel_cache(tmp_path, monkeypatch)
    weights = _weights([(48, 64), (48, 64), (80, 64)])
    first = choose(weights)
    files = list(cache.glob("kernel-choice-float32-*.json"))
    assert len(files) == 1 and files[0] == kernel_choice.cache_path(torch.float32)
    table = kernel_choice.table_of_chosen(first.values())
    assert [c.key for c in table] == ["48x64", "80x64"] and not any(c.cached for c in table)
    for c in table:
        assert set(c.micros) == {"c", "onednn"} and all(len(t) == len(BUCKETS) and min(t) > 0
                                                        for t in c.micros.values())
    assert first[id(weights[0])].choice is first[id(weights[1])].choice      # one table per shape
    written = files[0].read_text()
    assert json.loads(written)["shapes"]["80x64"]["winners"] == list(table[1].winners)

    again = kernel_choice.table_of_chosen(choose(weights).values())
    assert all(c.cached for c in again) and [c.winners for c in again] == [c.winners for c in table]
    assert files[0].read_text() == written                                    # read, not written again
    more = kernel_choice.table_of_chosen(choose(_weights([(80, 64), (32, 128)])).values())
    assert [c.cached for c in more] == [True, False]                          # a new shape is measured and added
    assert set(json.loads(files[0].read_text())["shapes"]) == {"48x64", "80x64", "32x128"}

    monkeypatch.setattr(cpu_features, "cpu_model", lambda: "another CPU")     # another CPU model: measured afresh
    assert kernel_choice.cache_path(torch.float32) != files[0]
    assert not any(c.cached for c in kernel_choice.table_of_chosen(choose(weights).values()))
    monkeypatch.undo()
    changed = tmp_path / "linear.c"                                           # another source version: likewise
    changed.write_bytes(cpu_build.SOURCES[2].read_bytes() + b"\n/* changed */\n")
    path = kernel_choice.cache_path(torch.float32)
    monkeypatch.setattr(cpu_build, "SOURCES", [*cpu_build.SOURCES[:2], changed, *cpu_build.SOURCES[3:]])
    assert kernel_choice.cache_path(torch.float32) != path
    assert kernel_choice.cache_path(torch.bfloat16) != kernel_choice.cache_path(torch.float32)   # per dtype


@needs_both
def test_a_step_runs_its_buckets_winner_on_the_real_kernels(tmp_path, monkeypatch):
    """Winners alternating by bucket (a table rewritten on disk, then read back): every row count gives exactly
    the output of its bucket's kernel run alone, and both layouts are kept and counted."""
    cache = kernel_cache(tmp_path, monkeypatch)
    w, b = _weights([(40, 96), (40,)])
    choose([w])
    alternate_kernel_tables(cache)
    chosen = choose([w])[id(w)]
    assert isinstance(chosen, ChosenWeight) and chosen.choice.cached
    assert chosen.choice.winners == ("c", "onednn", "c", "onednn", "c", "onednn", "c")
    assert chosen.choice.extra_bytes >= w.nbytes            # the second layout's memory
    forms = {"c": C_KERNEL.pack(w), "onednn": ONEDNN.pack(w)}
    for rows in (1, 3, 6, 12, 20, 40, 100, 257):
        x = torch.randn(rows, 96)
        kernel = kernel_choice.CANDIDATES[chosen.choice.winners[bucket(rows)]]
        want = kernel.run(x, forms[kernel.name], b)
        assert torch.equal(chosen(x, b), want), rows
        torch.testing.assert_close(want, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    rows = chosen.choice.rows()
    assert [(r["bucket"], r["winner"]) for r in rows] == list(zip(BUCKETS, chosen.choice.winners))
    assert all(set(r["us"]) == {"c", "onednn"} for r in rows)


@needs_both
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculation_runs_the_c_kernel_whose_rows_do_not_depend_on_the_row_count(tmp_path, monkeypatch, dtype):
    """row_invariant (speculative decoding): the C kernel in every decode bucket, the table's winner (what an engine
    without speculation runs) for a prefill; and the C kernel's rows are bit for bit the same at 1, 5 (a verify
    step of k = 4) and 40 rows, so a verify row's logits are the one-row step's."""
    if dtype not in cpu_kernels.load().linear_dtypes:
        pytest.skip("csrc/linear.c has no bf16 kernel on this CPU")
    cache = kernel_cache(tmp_path, monkeypatch)
    w = torch.randn(72, 128).to(dtype)
    choose([w])
    alternate_kernel_tables(cache)          # the table: c, onednn, c, ... by bucket
    plain = choose([w])[id(w)].choice.winners
    chosen = choose([w], row_invariant=True)[id(w)]
    assert chosen.choice.winners == ("c",) * (len(BUCKETS) - 1) + (plain[-1],) and plain[1] == "onednn"
    assert kernel_choice.read_table(kernel_choice.cache_path(dtype))["72x128"]["winners"] == list(plain)
    x = torch.randn(40, 128).to(dtype)
    alone = torch.cat([chosen(x[i:i + 1], None) for i in range(40)])
    assert torch.equal(chosen(x[:5], None), alone[:5]) and torch.equal(chosen(x, None), alone)


def test_a_weight_no_candidate_runs_keeps_f_linear(tmp_path, monkeypatch):
    kernel_cache(tmp_path, monkeypatch)
    w = torch.randn(8, 6, dtype=torch.float16)
    assert choose([w]) == {id(w): None}


def test_amx_falls_back_unless_the_cpu_has_it_and_linux_grants_it():
    amx = frozenset(cpu_features.AMX_FLAGS)
    assert cpu_features.amx_state(frozenset({"avx512f", "avx512_bf16"})) == "absent"
    assert cpu_features.amx_state(amx, request=lambda: errno.EPERM) == "denied: EPERM"   # a seccomp filter, say
    # the real request: refused here unless this CPU has AMX (then it is granted)
    state = cpu_features.amx_state(amx)
    assert state == "granted" if amx <= cpu_features.cpu_flags() else state.startswith("denied: ")
    assert cpu_features.amx() == ("absent" if not amx <= cpu_features.cpu_flags() else state)


def test_the_cache_path_needs_the_candidates_registered():
    """bench_kernels --fresh deletes cache_path() before any engine has loaded: a process that imported
    kernel_choice alone must not name a file (its key would lack the candidates: another file than the engine's),
    and one that imported the kernels as bench_kernels does names the file this process's engines read."""
    import subprocess
    import sys
    head = "import torch; torch.set_num_threads(1); from nanovllm_tp.layers import kernel_choice"
    tail = "; print(kernel_choice.cache_path(torch.float32))"
    alone = subprocess.run([sys.executable, "-c", head + tail], capture_output=True, text=True)
    assert alone.returncode and "import nanovllm_tp.layers.packed_linear first" in alone.stderr
    registered = subprocess.run([sys.executable, "-c", head + ", packed_linear" + tail], capture_output=True,
                                text=True, check=True).stdout.strip()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)                # the thread count is part of the key
        assert registered == str(kernel_choice.cache_path(torch.float32))
    finally:
        torch.set_num_threads(threads)
