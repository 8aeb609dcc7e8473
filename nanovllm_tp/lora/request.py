"""LoRARequest: which adapter a request runs with, by vLLM's field names and order."""
from dataclasses import dataclass

MAX_NAME_CHARS = 256


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """`lora_name`: the adapter's name (the server's model name for it); `lora_int_id`: a positive id, unique per
    adapter (the engine keys its slots and the prefix cache by it); `lora_path`: a PEFT adapter directory
    (adapter_config.json and adapter_model.safetensors)."""
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def to_wire(self) -> list:
        """[name, id, path]: how the server's messages and KV payloads name an adapter (LoRARequest(*those))."""
        return [self.lora_name, self.lora_int_id, self.lora_path]

    def check(self) -> None:
        """Field types and ranges (the directory itself is read by peft_dir.read_adapter)."""
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise TypeError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if len(self.lora_name) > MAX_NAME_CHARS:
            raise ValueError(f"LoRARequest.lora_name has {len(self.lora_name)} characters; at most {MAX_NAME_CHARS}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be a positive int, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be an adapter directory, "
                             f"got {self.lora_path!r}")
