"""Checkpoint formats: safetensors and GGUF files to parameters (loader.py, each rank reading only its slice) and
the tokenizer; GGUF's header, config, tokenizer and tensors (gguf_*.py) and which tensors stay quantized (gguf.py)."""
