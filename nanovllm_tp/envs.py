"""Every environment variable the engine reads, in one place, each with what it means.

Variables that switch an engine knob are defaults only: an `EngineConfig` field (an `LLM(...)` argument, a CLI
flag) given explicitly wins. Read through `get(name)`, which refuses names not declared here, so a variable cannot
be read somewhere without being listed. The launcher's own variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
torchrun's) and the private hand-over between rank 0 and the workers it spawns (distributed/launch.py) are the
launch protocol, not settings, and are not listed.
"""
import os

VARIABLES = {
    # engine knob defaults (EngineConfig fields of the same meaning)
    "NANOVLLM_TP_CPU_KERNELS": "default of cpu_kernels: 0 runs CPU layers and the sampler as torch ops",
    "NANOVLLM_TP_PACKED_LINEAR": "default of packed_linear: auto (1, all), c+onednn, c, bf16, onednn, off (0)",
    "NANOVLLM_TP_SHM_ALLREDUCE": "default of shm_allreduce: 0 keeps gloo for every all-reduce of same-node ranks",
    # trust (distributed/trust.py)
    "NANOVLLM_TP_SECRET": "the engine secret of a torchrun launch (its contents)",
    "NANOVLLM_TP_SECRET_FILE": "the engine secret of a torchrun launch (a 0600 file holding it)",
    "NANOVLLM_TP_INSECURE": "1: the plan channel is neither authenticated nor encrypted (benchmarks only)",
    # pipeline parallelism (distributed/pp_partition.py)
    "NANOVLLM_TP_PP_LAYER_PARTITION": "decoder layers per pipeline stage, comma-separated (\"3,5\"): overrides "
                                      "the even split (vLLM's VLLM_PP_LAYER_PARTITION); as many numbers as stages, "
                                      "summing to the model's layers",
    "NANOVLLM_TP_HOST": "the address other nodes reach rank 0 at (default MASTER_ADDR, else 127.0.0.1)",
    # CPU threads (config/cpu_threads.py)
    "NANOVLLM_TP_THREADS_AUTO": "set by serve where it chose the engine's threads itself: the engine ranks on this "
                                "node (OMP_NUM_THREADS is then a ceiling, and each rank follows the other "
                                "processes' load under it, as it does without OMP_NUM_THREADS)",
    # serving and files
    "NANOVLLM_TP_API_KEY": "the server's API key (launch/serve --api-key's default)",
    "NANOVLLM_TP_ALLOW_RUNTIME_LORA_UPDATING": "1: serve's /v1/load_lora_adapter and /v1/unload_lora_adapter are "
                                               "on (--allow-runtime-lora-updating's default)",
    "NANOVLLM_TP_CACHE": "where make_tiny keeps the embedded tiny checkpoint (default ~/.cache/nanovllm_tp)",
    # the CPU kernels' build (layers/cpu_build.py): standard variables
    "CC": "the C compiler that builds the CPU kernels (default cc)",
    # CPU threads: a standard variable
    "OMP_NUM_THREADS": "each CPU rank's thread count, fixed (--threads sets it); unset: config/cpu_threads.py",
    "XDG_CACHE_HOME": "the cache root: the built CPU kernels and kernel tables go in $XDG_CACHE_HOME/nanovllm_tp "
                      "(default ~/.cache)",
    # benchmarks
    "NANOVLLM_TP_OPENVINO_PYTHON": "the python of a virtualenv with openvino-genai and optimum-intel[openvino]: "
                                   "bench --compare openvino's --peer-python default; its end-to-end test runs "
                                   "it (skipped without)",
    # tests
    "NANOVLLM_TP_TEST_LLAMA_SERVER": "a llama.cpp llama-server binary: the tests of bench --compare llamacpp run it "
                                     "(skipped without)",
}


def get(name: str, default: str | None = None) -> str | None:
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared variable of nanovllm_tp.envs")
    return os.environ.get(name, default)


def flag(name: str) -> bool:
    """A switch that is on unless set to 0."""
    return get(name, "1") != "0"


def usable_cpus() -> set[int]:
    """The cores this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def cores_per_rank(ranks_on_node: int) -> int:
    """This node's usable cores shared by its ranks, at least one each: a CPU rank's thread count where
    OMP_NUM_THREADS does not say otherwise."""
    return max(1, len(usable_cpus()) // ranks_on_node)


def local_ranks(ranks: int) -> int:
    """This node's ranks: torchrun's LOCAL_WORLD_SIZE where it launched them, else `ranks` (all of them here)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
