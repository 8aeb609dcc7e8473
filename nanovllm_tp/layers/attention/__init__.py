"""Paged attention: the layer models use, and the backends behind it as one interface.

`base.py` declares the interface (`AttentionBackend`) and the table that `@register_backend` fills; each other
module holds one backend and registers it; `registry.py` finds them all and chooses one for a device, dtype and
block size (EngineConfig.attention_backend, "auto" by default).
"""
from nanovllm_tp.layers.attention.base import AttentionBackend, register_backend
from nanovllm_tp.layers.attention.layer import Attention, store_kvcache

__all__ = ["Attention", "AttentionBackend", "register_backend", "store_kvcache"]
