"""Rank 0's check of a request's LoRARequest before the engine sees it: the engine runs adapters, the request is
well formed, and its directory is a PEFT adapter this model can run (read once per lora_int_id)."""
import dataclasses
import os

from nanovllm_tp.lora.peft_dir import AdapterSpec, read_adapter
from nanovllm_tp.lora.request import LoRARequest


class AdapterRegistry:
    def __init__(self, enabled: bool, max_rank: int, targets: dict[str, tuple[int, int]]):
        self.enabled, self.max_rank, self.targets = enabled, max_rank, targets
        self.known: dict[int, tuple[LoRARequest, AdapterSpec]] = {}     # lora_int_id -> (request, adapter)

    def check(self, request) -> LoRARequest | None:
        """The request as the engine keeps it (lora_path absolute), None for None; ValueError/TypeError naming what
        is wrong."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest (from nanovllm_tp import LoRARequest), got "
                            f"{type(request).__name__}")
        if not self.enabled:
            raise ValueError(f"lora_request {request.lora_name!r}: LoRA is not enabled (LLM(..., enable_lora=True), "
                             "serve --enable-lora)")
        request.check()
        path = os.path.abspath(request.lora_path)
        known = self.known.get(request.lora_int_id)
        if known is not None:
            if (known[0].lora_name, known[0].lora_path) != (request.lora_name, path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is adapter {known[0].lora_name!r} at "
                                 f"{known[0].lora_path}; give {request.lora_name!r} at {path} an id of its own")
            return known[0]
        spec = read_adapter(path, self.targets, self.max_rank)
        request = dataclasses.replace(request, lora_path=path)
        self.known[request.lora_int_id] = (request, spec)
        return request

    def check_all(self, lora_request, n: int) -> list[LoRARequest | None]:
        """One per prompt: a single request (or None) for all n, or a list of n."""
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != n:
                raise ValueError(f"got {len(lora_request)} lora_requests for {n} prompts")
            return [self.check(r) for r in lora_request]
        return [self.check(lora_request)] * n

    def forget(self, lora_id: int) -> None:
        """A later request with this id is read afresh (the server unloaded it)."""
        self.known.pop(lora_id, None)
