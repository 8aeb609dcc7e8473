"""Rank 0's engine under LLM: LLMEngine (llm_engine.py: the ranks, one step, failures, close) and what happens to a
step's tokens on their way to the user (output_processor.py: detokenization, stop strings, RequestOutputs)."""
