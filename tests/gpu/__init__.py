"""Checks that need a CUDA device: CUDA graphs, the Triton/varlen/flash attention backends, KV sizing.

They skip cleanly without CUDA. Run with `python -m pytest tests/gpu -q` from the repository root, or through
`bash scripts/gpu_check.sh`, which also measures throughput.
"""
