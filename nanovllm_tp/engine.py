"""Rank 0's engine: scheduler + this rank's runner (+ the other ranks, reached through the plan channel)."""
import logging
import os

import torch

from nanovllm_tp.config import EngineConfig
from nanovllm_tp.layers.attention import set_attention_backend
from nanovllm_tp.scheduler import Scheduler, SchedulerConfig, Sequence
from nanovllm_tp.workers.kv_cache import blocks_for_budget
from nanovllm_tp.workers.model_runner import ModelRunner

log = logging.getLogger("nanovllm_tp")

DEFAULT_CPU_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device_and_dtype(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but torch sees no CUDA device")
    use_cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if config.dtype != "auto":
        dtype = _DTYPES[config.dtype]
    elif use_cuda:
        dtype = _DTYPES.get(config.model_config.torch_dtype.replace("torch.", ""), torch.bfloat16)
    else:
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        raise ValueError("float16 is not supported on CPU; use float32 or bfloat16")
    return device, dtype


def choose_attention_backend(device: torch.device, dtype: torch.dtype):
    """flash-attn on CUDA when it imports and supports the dtype; the torch backend otherwise."""
    from nanovllm_tp.layers.attention import TorchBackend
    if device.type == "cuda":
        from nanovllm_tp.layers.flash_backend import FlashBackend, flash_available
        if flash_available() and dtype in (torch.float16, torch.bfloat16):
            return FlashBackend()
        log.warning("flash-attn unavailable for %s on this machine; using the torch SDPA attention backend", dtype)
    return TorchBackend()


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device, self.dtype = resolve_device_and_dtype(config)
        backend = choose_attention_backend(self.device, self.dtype)
        set_attention_backend(backend)
        if config.kvcache_block_size is None:
            config.kvcache_block_size = 256 if backend.name == "flash" else 16
        backend.check_block_size(config.kvcache_block_size)
        torch.manual_seed(config.seed)
        self.runner = ModelRunner(config, self.device, self.dtype)
        self.runner.allocate_kv_cache(self._num_kv_blocks())
        self.scheduler = Scheduler(SchedulerConfig(
            num_kvcache_blocks=self.runner.num_kv_blocks, kvcache_block_size=config.kvcache_block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len, enable_prefix_caching=config.enable_prefix_caching,
            eos_token_ids=config.model_config.eos_token_ids))
        if self.device.type == "cuda" and not config.enforce_eager:
            from nanovllm_tp.workers.cuda_graph import CUDAGraphRunner
            self.runner.graphs = CUDAGraphRunner(self.runner, config.max_num_seqs, config.max_model_len)
        log.info("engine ready: %s", self.runner.describe())

    def _num_kv_blocks(self) -> int:
        block_bytes = self.runner.kv_block_bytes()
        budget = self.config.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                from nanovllm_tp.workers.cuda_graph import profile_kv_budget
                budget = profile_kv_budget(self.runner, self.config)
            else:
                budget = DEFAULT_CPU_KV_BYTES
        num_blocks = blocks_for_budget(budget, block_bytes)
        needed = -(-self.config.max_model_len // self.config.kvcache_block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache budget of {budget / 2**20:.1f} MiB per rank holds {num_blocks} blocks of "
                f"{self.config.kvcache_block_size} tokens ({block_bytes} bytes each), but one "
                f"max_model_len={self.config.max_model_len} sequence needs {needed}: raise kv_cache_memory "
                "(or gpu_memory_utilization) or lower max_model_len")
        return num_blocks

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[list[Sequence], int, bool]:
        """Run one step: (finished sequences, tokens computed, whether it was a prefill)."""
        plan = self.scheduler.schedule()
        if plan is None:
            return [], 0, False
        try:
            logits = self.runner.execute(plan)
            tokens = self.runner.sample(logits, plan)
        except BaseException:
            self.scheduler.abort_all()
            raise
        return self.scheduler.postprocess(tokens), plan.num_tokens, plan.is_prefill

    def close(self) -> None:
        pass
