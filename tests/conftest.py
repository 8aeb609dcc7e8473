import os
import subprocess
import sys

import pytest

from tests.procs import left_behind, run_files

# One thread per test process keeps the 2-core CI machine from oversubscribing when ranks run side by side.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from nanovllm_tp.launch.make_tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("tiny") / "qwen3-tiny"))


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llm(tiny_model_dir):
    """A shared TP=1 engine for tests that only need one; tests that change knobs build their own."""
    from nanovllm_tp import LLM
    return LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=64 << 20)


@pytest.fixture
def both_paths():
    """Runs fn once with the C kernels and once with them switched off (the torch/numpy code every other device
    runs): (fast, reference)."""
    def run(fn):
        from nanovllm_tp.layers import cpu_kernels
        assert cpu_kernels.load() is not None
        with cpu_kernels.switched(True):
            fast = fn()
        with cpu_kernels.switched(False):
            assert cpu_kernels.active() is None
            reference = fn()
        return fast, reference
    return run


def pytest_collection_modifyitems(config, items):
    """Tests marked `long` run only when the -m expression names them (`-m long`, `-m "long and not spawn"`)."""
    if "long" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="a long form: select it with -m long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


# --busy-cores N: N processes spin for the whole run, so that a suite run shows its time limits hold on a loaded
# machine. Each spinner ends by itself once pytest is gone, however pytest ends.
_SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(200000): pass\n"


def pytest_addoption(parser):
    parser.addoption("--busy-cores", type=int, default=0, metavar="N",
                     help="keep N cores busy with spinning processes while the tests run")
    parser.addoption("--packed-linear", metavar="MODE", help="the packed_linear knob's default for every engine the "
                     "tests start, in this process and in the ranks and servers it spawns "
                     "($NANOVLLM_TP_PACKED_LINEAR); c+onednn runs the kernel table an Intel Xeon with AMX measures "
                     "(csrc/linear.c up to 8 rows, oneDNN from 9) on any CPU. Tests that set the knob keep theirs.")


def pytest_configure(config):
    mode = config.getoption("packed_linear", None)
    if mode:
        os.environ["NANOVLLM_TP_PACKED_LINEAR"] = mode


@pytest.fixture(scope="session", autouse=True)
def busy_cores(request):
    spinners = [subprocess.Popen([sys.executable, "-c", _SPIN]) for _ in range(request.config.getoption("busy_cores"))]
    yield len(spinners)
    for p in spinners:
        p.kill()
        p.wait()


# Nothing left behind: after each test, no socket directory, shared-memory segment or torchrun log directory whose
# maker is gone; after the session, none of the engine's directories at all.
@pytest.fixture(scope="session", autouse=True)
def nothing_left_by_the_session():
    before = run_files()
    yield
    leaks = left_behind(before, unowned=True)
    assert not leaks, f"the test session left these behind: {leaks}"


@pytest.fixture(autouse=True)
def nothing_left_by_the_test():
    before = run_files()
    yield
    leaks = left_behind(before)
    assert not leaks, f"this test left these behind: {leaks}"
