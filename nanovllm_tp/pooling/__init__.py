"""Embeddings: the request's parameters and a model's pooling declaration (params.py, torch-free: the HTTP process
and the scheduler read it) and rank 0's side (embeddings.py: the outputs, per-request state, pooled sums)."""
