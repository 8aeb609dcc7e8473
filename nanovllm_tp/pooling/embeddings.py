"""Embeddings on rank 0: the results (vLLM's EmbeddingRequestOutput shape), a request's state between the engine
and the caller, and the step's pooled sums of hidden states. Torch is imported only where the sums are made (the
HTTP process reads the result types, and numpy is left to rank 0 too)."""
from dataclasses import dataclass


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


class EmbeddingState:
    """One embedding request on rank 0 (LLM's counterpart of output_processor.RequestState). It is its own single
    completion: `completions[0].seq` is its sequence, as LLM's abort and bookkeeping read a request's sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], seq):
        self.request_id, self.prompt, self.prompt_ids, self.seq = request_id, prompt, prompt_ids, seq
        self.completions = (self,)

    @property
    def finished(self) -> bool:
        return self.seq.is_finished

    def update(self, seq) -> None:
        """Nothing to detokenize, no stop string to match."""
        return None

    def output(self, full: bool = False) -> EmbeddingRequestOutput | None:
        """The embedding once the request finished (empty when it was aborted), None before."""
        if not self.seq.is_finished:
            return None
        done = self.seq.finish_reason != "abort" and self.seq.embedding is not None
        vector = self.seq.embedding.tolist() if done else []
        return EmbeddingRequestOutput(self.request_id, EmbeddingOutput(vector), self.prompt_ids, True, self.prompt)


def pool_sums(hidden, chunks):
    """numpy float32 [chunks, hidden]: per pool chunk, the sum of the hidden states at its token rows (zeros for
    none)."""
    import numpy as np
    import torch
    counts = torch.tensor([len(c.token_rows) for c in chunks])
    rows = torch.from_numpy(np.concatenate([c.token_rows for c in chunks])).to(hidden.device)
    chunk_of_row = torch.repeat_interleave(torch.arange(len(chunks)), counts).to(hidden.device)
    out = torch.zeros(len(chunks), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    out.index_add_(0, chunk_of_row, hidden[rows].float())
    return out.cpu().numpy()
