"""OpenAI-compatible serving on rank 0: one engine loop thread owns the LLM; HTTP handlers hand it requests and
await per-request output queues (launch/serve.py is the command)."""
