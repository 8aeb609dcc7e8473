"""Speculative decoding with a draft model: a smaller model with the target's tokenizer, run on rank 0 alone.

The draft keeps its own KV cache with the target's block count and block size, indexed by the target's block
tables and slot mapping. It runs every plan the target runs (`follow`, without its LM head), so its KV holds
every token the target computed: prefix-cache hits, recompute after preemption, the block copies of n > 1
siblings and the rollback of rejected positions (overwritten by a later plan, never counted) come with the
target's bookkeeping. To propose k tokens for a row (`propose`), it decodes greedily k times over the positions
the scheduler has just given KV slots for; the target's verify step then writes those slots in its own cache.

The draft runs at TP 1 on rank 0: with the target at TP > 1, the other ranks wait for the verify plan while rank 0
proposes. Its KV is paid for from the target's KV budget (build_runner divides the budget by the target's and the
draft's block bytes together, so every rank holds that many blocks).
"""
import contextlib
import dataclasses

import numpy as np
import torch

from nanovllm_tp.config.engine_config import LORA_DEFAULTS, EngineConfig
from nanovllm_tp.config.platform import resolve_attention_backend
from nanovllm_tp.distributed.parallel_state import TPState, tp_scope
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.scheduler.plan import DECODE, StepPlan, slot_mapping
from nanovllm_tp.scheduler.speculative import Proposer, SpeculativeConfig, wanting
from nanovllm_tp.utils import trace
from nanovllm_tp.utils.context import reset_context


def draft_config(config: EngineConfig) -> EngineConfig:
    """The draft's EngineConfig (validated; TP 1, the target's block size and max_model_len), after checking that
    it can draft for the target: the same vocabulary (token for token), and no layer that reads further back
    than the target's windows keep. Refusals name the draft; nothing is loaded but configs and tokenizers."""
    from nanovllm_tp.checkpoint.loader import load_tokenizer
    spec = SpeculativeConfig.from_dict(config.speculative_config, config.tensor_parallel_size)
    # the draft proposes from its own weights alone: adapters of the target are not the draft's (what it proposes
    # for an adapter's request is checked by the target as any proposal is)
    draft = dataclasses.replace(config, model=spec.model, tensor_parallel_size=1, speculative_config=None,
                                trace_path=None, trace_layers=False, enable_lora=False, **LORA_DEFAULTS)
    try:
        draft.validate()
    except (ValueError, TypeError) as exc:
        raise ValueError(f"speculative_config model {spec.model!r}: {exc}") from None
    target_vocab = load_tokenizer(config.tokenizer or config.model).get_vocab()
    draft_vocab = load_tokenizer(spec.model).get_vocab()
    if draft_vocab != target_vocab:
        differ = sorted(t for t in set(draft_vocab) ^ set(target_vocab))[:3] or sorted(
            t for t in target_vocab if draft_vocab[t] != target_vocab[t])[:3]
        raise ValueError(f"speculative_config model {spec.model!r} has another vocabulary than {config.model!r} "
                         f"({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. {differ}): a draft needs the "
                         "target's tokenizer")
    kept = config.model_config.layer_windows
    if kept and all(kept):      # the target frees blocks behind its widest window: the draft must not read them
        reads = draft.model_config.layer_windows
        if not (reads and all(reads) and max(reads) <= max(kept)):
            raise ValueError(f"speculative_config model {spec.model!r} reads further back than the target's "
                             f"sliding windows ({max(kept)} tokens) keep")
    return draft


class DraftProposer(Proposer):
    def __init__(self, config: EngineConfig, draft: EngineConfig, device: torch.device, dtype: torch.dtype):
        """The draft model (`draft`: draft_config(config)) on rank 0, weights only: `allocate` gives it its KV
        cache."""
        from nanovllm_tp.workers.model_runner import ModelRunner
        self.k = SpeculativeConfig.from_dict(config.speculative_config).num_speculative_tokens
        self.config = draft
        self.vocab_size = min(config.model_config.vocab_size, self.config.model_config.vocab_size)
        with self._scope():
            backend = resolve_attention_backend(self.config, device, dtype)
            self.runner = ModelRunner(self.config, device, dtype, backend)

    @contextlib.contextmanager
    def _scope(self):
        """TP 1 (whatever the target's group) and the engine's cpu_kernels setting, while the draft computes."""
        with tp_scope(TPState()), cpu_kernels.switched(self.config.cpu_kernels):
            yield

    def kv_block_bytes(self) -> int:
        return self.runner.kv_block_bytes()

    def allocate(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def read_kv(self, block_ids: list[int], prefix: str) -> dict:
        """Its cache over these blocks as bytes (workers/kv_blocks.py), each part named with `prefix`: a request
        that leaves with its KV takes the draft's too (engine/kv_transfer.py)."""
        from nanovllm_tp.workers.kv_blocks import read_blocks
        return {prefix + name: data for name, data in read_blocks(self.runner, block_ids).items()}

    def write_kv(self, parts: dict, prefix: str, rows: list[int], block_ids: list[int]) -> None:
        """The parts named with `prefix` (checked against this cache), their blocks `rows`, into `block_ids`."""
        from nanovllm_tp.workers.kv_blocks import write_blocks
        mine = {name[len(prefix):]: data for name, data in parts.items() if name.startswith(prefix)}
        write_blocks(self.runner, mine, rows, block_ids)

    def describe(self) -> str:
        return (f"draft {self.config.model} on rank 0, {self.k} tokens a step, linear "
                f"{self.runner.describe().split('linear ', 1)[1]}")

    def limits(self, seqs) -> dict[int, int]:
        return {seq.seq_id: self.k for seq in wanting(seqs)}

    @torch.inference_mode()
    def follow(self, plan: StepPlan) -> None:
        """Run the target's plan through the draft: its KV then holds what the target's does."""
        runner = self.runner
        with self._scope(), trace.span("draft_follow"):
            if plan.block_copies is not None and len(plan.block_copies):
                runner.copy_blocks(plan.block_copies)
            input_ids, positions = runner.prepare(plan)
            try:
                runner.model(input_ids, positions)
            finally:
                reset_context()

    @torch.inference_mode()
    def propose(self, seqs: list, ks: list[int], block_copies) -> list[list[int]]:
        """k greedy tokens per row: pass j feeds each row's last token (then its previous proposal) at position
        num_tokens - 1 + j; rows drop out as their k is reached."""
        runner, bs = self.runner, self.config.kvcache_block_size
        rows = len(seqs)
        tables = np.full((rows, max(len(s.block_table) for s in seqs)), -1, np.int32)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_table)] = s.block_table
        tokens = np.fromiter((s.token_ids[-1] for s in seqs), np.int64, rows)
        start = np.fromiter((s.num_tokens - 1 for s in seqs), np.int64, rows)
        ks = np.asarray(ks, np.int64)
        out = np.zeros((rows, int(ks.max())), np.int64)
        with self._scope(), trace.span("draft_propose"):
            if block_copies:        # n > 1 siblings' copied blocks, which the step's plan carries
                runner.copy_blocks(np.asarray(block_copies, np.int32).reshape(-1, 2))
            for j in range(out.shape[1]):
                live = np.flatnonzero(ks > j)
                positions = start[live] + j
                plan = StepPlan(step_id=0, kind=DECODE, input_ids=tokens[live], positions=positions,
                                slot_mapping=slot_mapping(tables, live, positions, bs),
                                cu_seqlens_q=np.arange(len(live) + 1, dtype=np.int32),
                                context_lens=(positions + 1).astype(np.int32), block_tables=tables[live])
                logits = runner.execute(plan)
                tokens[live] = logits[:, :self.vocab_size].argmax(-1).cpu().numpy()
                out[live, j] = tokens[live]
        return [out[i, :k].tolist() for i, k in enumerate(ks.tolist())]

    def release(self) -> None:
        self.runner.release()
