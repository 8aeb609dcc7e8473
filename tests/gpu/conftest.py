"""Fixtures for the CUDA tests: every engine a test builds gives its GPU memory back before the next test."""
import gc

import pytest
import torch


def release_llm(llm) -> None:
    """Close an LLM: LLM.close() frees its weights, KV cache and CUDA graphs and empties the allocator."""
    llm.close()


@pytest.fixture
def release():
    return release_llm


@pytest.fixture(autouse=True)
def _cuda_memory_back_after_each_test():
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
