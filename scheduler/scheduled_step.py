"""What one scheduled step hands the engine, and what comes back to the scheduler with the sampled tokens.

`Scheduler.schedule()` returns a ScheduledStep: the StepPlan every rank runs, the SamplingBatch rank 0 samples,
and the prompt chunks whose logprobs rank 0 computes. `Scheduler.postprocess()` takes the tokens and the
logprobs back and is the one place that writes them into the sequences.
"""
from dataclasses import dataclass, field

import numpy as np

from nanovllm_tp.scheduler.plan import StepPlan
from nanovllm_tp.scheduler.rows import SamplingBatch


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of some positions: the chosen token's logprob and rank (1 = most likely) and the top-N."""
    logprob: np.ndarray       # float32 [positions]
    rank: np.ndarray          # int64 [positions]
    top_ids: np.ndarray       # int64 [positions, N]
    top_logprobs: np.ndarray  # float32 [positions, N]

    def positions(self, top_n: list[int] | int) -> list["PositionLogprob"]:
        """One PositionLogprob per position, keeping top_n (per position, or one count for all) of the top-N."""
        n = [top_n] * len(self.logprob) if isinstance(top_n, int) else top_n
        return [PositionLogprob(lp, r, ids[:k], lps[:k]) for lp, r, ids, lps, k in
                zip(self.logprob.tolist(), self.rank.tolist(), self.top_ids.tolist(), self.top_logprobs.tolist(), n)]


@dataclass(slots=True)
class PositionLogprob:
    """The logprobs of one position of a sequence (Sequence.logprobs / prompt_logprobs hold these)."""
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class PromptChunk:
    """A prompt chunk whose prompt tokens want logprobs: logits row rows[i] predicts token_ids[i]."""
    seq: object               # the Sequence
    rows: np.ndarray          # int64: rows of the step's logits
    token_ids: np.ndarray     # int64: the prompt tokens those rows predict (positions not recorded yet)


@dataclass(slots=True)
class PoolChunk:
    """A prompt chunk of an embedding request: the step's tokens (rows of its hidden states) its pooling sums, and
    whether the prompt ends with this chunk (then the embedding is made)."""
    seq: object               # the Sequence
    token_rows: np.ndarray    # int64: indices into the step's tokens (may be empty: a middle chunk of last-token)
    final: bool


@dataclass(slots=True)
class ScheduledStep:
    plan: StepPlan                    # what every rank runs
    sampling: SamplingBatch           # rank 0: one entry per row that produces a token
    prompt_chunks: list[PromptChunk]  # rank 0: prompt logprobs to compute from the step's logits
    pool_chunks: list[PoolChunk] = field(default_factory=list)   # rank 0: hidden states to pool (embeddings)
