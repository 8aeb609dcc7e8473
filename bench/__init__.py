"""Benchmarks, apart from the commands users run (launch/): each module is `nanovllm-tp bench KIND` (and
`python -m nanovllm_tp.bench.KIND`); throughput.py is the default kind. What every benchmark shares: common.py
(flags, model, output), workload.py, env.py, report.py; the peers: hf.py, vllm.py (+ peer.py, run under vLLM's own
interpreter), llamacpp.py, compared through compare.py."""
