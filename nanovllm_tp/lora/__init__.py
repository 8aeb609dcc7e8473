"""Multi-LoRA serving: `LoRARequest` (vLLM's), PEFT adapter directories (`peft_dir.py`), the per-rank slot tables
and the batched low-rank matmul (`layers.py`). Rank 0's LRU of slots is torch-free: `scheduler/lora_slots.py`.

Importing this package does not import torch (the HTTP process and the scheduler read `LoRARequest`)."""
from nanovllm_tp.lora.request import LoRARequest

__all__ = ["LoRARequest"]
