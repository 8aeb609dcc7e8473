"""Turns a StepPlan into tensors and runs this rank's shard of the model (rank 0's engine samples).

Every rank runs the same code on the same plan; only rank 0 receives logits (gathered from the LM head).
"""
import gc
import logging

import torch

from nanovllm_tp.config import cpu_threads
from nanovllm_tp.config.engine_config import EngineConfig
from nanovllm_tp.distributed import pipeline
from nanovllm_tp.distributed.parallel_state import tp_rank, tp_size
from nanovllm_tp.utils import trace
from nanovllm_tp.utils.context import Context, reset_context, set_context
import numpy as np

from nanovllm_tp.checkpoint.gguf import keep_gguf_blocks
from nanovllm_tp.checkpoint.loader import load_model
from nanovllm_tp.layers import cpu_kernels, kernel_choice
from nanovllm_tp.layers.attention import Attention, AttentionBackend
from nanovllm_tp.layers.packed_linear import linear_paths, pack_cpu_weights, quantization_of
from nanovllm_tp.layers.quant import INT8
from nanovllm_tp.models import model_class
from nanovllm_tp.models.blocks import DecoderModel
from nanovllm_tp.models.fused_decode import FusedDecode
from nanovllm_tp.scheduler.plan import StepPlan
from nanovllm_tp.workers.kv_cache import allocate_kv_cache, kv_block_bytes
from nanovllm_tp.workers.kv_pool import SharedKVPool

log = logging.getLogger("nanovllm_tp")


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, backend: AttentionBackend):
        self.config, self.backend = config, backend
        self.device, self.dtype = device, dtype
        self.block_size = config.kvcache_block_size
        mc = config.model_config
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                self.model = model_class(mc.architecture)(mc)
        finally:
            torch.set_default_dtype(previous)
        keep_blocks, message = keep_gguf_blocks(config, device)
        if message and tp_rank() == 0:
            log.info(message)
        load_model(self.model, config.model, keep_blocks)
        self.lora = None     # lora.layers.LoRAModel with enable_lora (before packing: it reads the weights' shapes)
        if config.enable_lora:
            from nanovllm_tp.lora.layers import LoRAModel
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, config.lora_dtype)
        # speculation: verify rows must compute as plain decoding's one row does (kernel_choice.choose)
        pack_cpu_weights(self.model, config.packed_linear, int8=self._int8(config),
                         row_invariant=config.speculative_config is not None)
        self.quantization = quantization_of(self.model)     # "none", or the quantized types the weights run in
        if config.batch_invariant and device.type == "cpu" and linear_paths(self.model) != "c" and tp_rank() == 0:
            log.warning("batch_invariant: csrc/linear.c does not run this model's %s weights on this CPU (it needs "
                        "AVX-512%s), so its linear layers run %s, whose sums may change with a step's row count: "
                        "a request's tokens can then depend on its company", str(dtype).removeprefix("torch."),
                        " BF16" if dtype == torch.bfloat16 else " F", linear_paths(self.model))
        self.model.eval()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for attn in self.attention_layers:
            attn.backend = backend
        body = getattr(self.model, "model", None)
        if config.fused_decode and device.type == "cpu" and isinstance(body, DecoderModel):
            body.fused = FusedDecode.of(body)     # decode steps' layers in one C call where they can run there
        self.num_kv_blocks = 0
        self.kv_scales = None
        self.kv_pool: SharedKVPool | None = None    # the cache's memory file where kv_shared_pool shares it
        self.graphs = None    # a CUDAGraphRunner once decode graphs are captured
        self._hidden = None   # rank 0: the last step's final hidden states, when it had embedding rows
        self.rank0 = tp_rank() == 0 and pipeline.is_first_stage()    # the engine's rank 0, which samples

    def _int8(self, config: EngineConfig) -> bool:
        """quantization "int8": through csrc/linear_q.c, or its torch reference with cpu_kernels off; dense where
        the kernels cannot run (logged)."""
        if config.quantization != "int8":
            return False
        kernels = cpu_kernels.load() if config.cpu_kernels else None
        if config.cpu_kernels and (kernels is None or INT8 not in kernels.quant_types):
            if tp_rank() == 0:
                log.warning("quantization='int8': the weights stay %s, the int8 kernels cannot run here (%s)",
                            self.dtype, "no C compiler" if kernels is None else "no AVX-512 VNNI")
            return False
        return True

    def kv_block_bytes(self) -> int:
        layer = self.attention_layers[0]
        return kv_block_bytes(len(self.attention_layers), self.block_size, layer.num_kv_heads, layer.head_dim,
                              self.dtype, self.config.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """num_blocks usable blocks plus one null block that padded rows write into."""
        self.num_kv_blocks = num_blocks
        layer = self.attention_layers[0]
        shape = (len(self.attention_layers), num_blocks + 1, self.block_size, layer.num_kv_heads, layer.head_dim)
        self.kv_pool = self._shared_pool(shape)
        if self.kv_pool is not None:
            parts = self.kv_pool.parts
            self.k_cache, self.v_cache = parts["k"], parts["v"]
            self.kv_scales = (parts["k_scale"], parts["v_scale"]) if "k_scale" in parts else None
        else:
            self.k_cache, self.v_cache, self.kv_scales = allocate_kv_cache(
                *shape, self.dtype, self.device, self.config.kv_cache_dtype)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.k_cache[i], self.v_cache[i]
            attn.kv_scales = None if self.kv_scales is None else (self.kv_scales[0][i], self.kv_scales[1][i])

    def _shared_pool(self, shape: tuple[int, ...]) -> SharedKVPool | None:
        """The kv_shared_pool knob's pool (workers/kv_pool.py): a CPU engine of one rank; None elsewhere, or where
        the memory file cannot be made (logged: the cache is then private memory)."""
        if not self.config.kv_shared_pool or self.device.type != "cpu" or tp_size() > 1 or pipeline.pp_size() > 1:
            return None
        try:
            return SharedKVPool.create(shape, self.kv_cache_format(), self.config.kv_cache_dtype != "auto")
        except OSError as exc:
            log.warning("kv_shared_pool: the KV cache stays in private memory (%s); a hand-off then carries its KV "
                        "as bytes", exc)
            return None

    def drop_kv_cache(self) -> None:
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.tensor([])
            attn.kv_scales = None
        self.k_cache = self.v_cache = self.kv_scales = None
        if self.kv_pool is not None:
            self.kv_pool.close()
            self.kv_pool = None
        self.num_kv_blocks = 0

    @property
    def null_slot(self) -> int:
        return self.num_kv_blocks * self.block_size

    def _to_device(self, array, dtype=None) -> torch.Tensor:
        t = torch.from_numpy(array.copy() if not array.flags.writeable else array)
        return t.to(self.device, dtype=dtype, non_blocking=True)

    def prepare(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        q_lens = plan.cu_seqlens_q[1:] - plan.cu_seqlens_q[:-1]
        context_lens = plan.context_lens
        ctx = Context(
            is_prefill=plan.is_prefill,
            cu_seqlens_q=self._to_device(plan.cu_seqlens_q),
            max_seqlen_q=int(q_lens.max()), max_seqlen_k=int(context_lens.max()),
            slot_mapping=self._to_device(plan.slot_mapping),
            context_lens=self._to_device(context_lens),
            block_tables=self._to_device(plan.block_tables),
            has_cached_prefix=bool((context_lens > q_lens).any()),
            context_lens_cpu=context_lens.tolist(), q_lens_cpu=q_lens.tolist(),
            logits_indices=None if plan.prompt_logits is None and plan.hidden_rows is None else
            self._to_device(self.logits_indices(plan)),
        )
        self.backend.prepare(ctx)
        set_context(ctx)
        return self._to_device(plan.input_ids), self._to_device(plan.positions)

    @staticmethod
    def logits_indices(plan: StepPlan) -> np.ndarray:
        """Every token of the rows flagged in plan.prompt_logits, none of the rows in plan.hidden_rows (embeddings),
        the last token of the others."""
        cu, rows = plan.cu_seqlens_q.astype(np.int64), plan.num_rows
        every = np.zeros(rows, bool) if plan.prompt_logits is None else plan.prompt_logits
        none = np.zeros(rows, bool) if plan.hidden_rows is None else plan.hidden_rows
        return np.concatenate([np.arange(cu[i + 1] if skip else cu[i] if all_ else cu[i + 1] - 1, cu[i + 1])
                               for i, (all_, skip) in enumerate(zip(every.tolist(), none.tolist()))])

    def take_hidden(self) -> torch.Tensor | None:
        """Rank 0: the final hidden states [tokens, hidden] of the last step run, if it had embedding rows."""
        hidden, self._hidden = self._hidden, None
        return hidden

    def copy_blocks(self, copies: np.ndarray) -> None:
        """Copy whole KV blocks (src -> dst) in every layer, a quantized cache's scales with them."""
        src = torch.from_numpy(copies[:, 0].astype(np.int64)).to(self.device)
        dst = torch.from_numpy(copies[:, 1].astype(np.int64)).to(self.device)
        tensors = [self.k_cache, self.v_cache, *(self.kv_scales or ())]
        for t in tensors:
            t = t.view(torch.uint8) if t.element_size() == 1 else t      # torch copies no fp8 by index on CPU
            t[:, dst] = t[:, src]

    @torch.inference_mode()
    def execute(self, plan: StepPlan, collect: bool = True) -> torch.Tensor | None:
        """Forward one step; logits on rank 0 (a row per sampled token, plus every prompt token of the rows in
        plan.prompt_logits; None when every row is an embedding's), None on the other ranks. Rank 0 keeps the
        final hidden states of a step with embedding rows for take_hidden(). Under pipeline parallelism
        collect=False leaves the logits on their way: rank 0 takes them later with collect_logits(plan)."""
        if self.device.type == "cpu":
            cpu_threads.tick()               # the thread count follows other processes' load (once a second)
        if plan.block_copies is not None and len(plan.block_copies):
            self.copy_blocks(plan.block_copies)
        if self.graphs is not None and not plan.is_prefill and self.graphs.can_run(plan.num_rows):
            with trace.span("graph_replay"):
                return self.graphs.run(plan)
        with trace.span("prepare"):
            input_ids, positions = self.prepare(plan)
            if self.lora is not None:
                self.lora.prepare(plan)
        try:
            if pipeline.pp_size() > 1:
                self._execute_stage(plan, input_ids, positions)
                return self.collect_logits(plan) if self.rank0 and collect else None
            with trace.span("forward"):
                hidden = self.model(input_ids, positions)
            if plan.hidden_rows is not None:
                # replicated on every rank after the last all-reduce and the final norm: rank 0's copy is whole
                self._hidden = hidden if tp_rank() == 0 else None
                if plan.hidden_rows.all():
                    return None       # no row wants logits: the LM head (and its gather) is skipped on every rank
            with trace.span("lm_head"):
                return self.model.compute_logits(hidden)
        finally:
            reset_context()

    def _execute_stage(self, plan: StepPlan, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """One pipeline stage's part of a step: the previous stage's activations in (after the first), this stage's
        layers, the activations out to the next stage, or on the last its logits to rank 0 (which is on the first
        stage and takes them with collect_logits)."""
        carried = None
        if not pipeline.is_first_stage():
            carried = pipeline.recv_activations(plan.step_id, plan.num_tokens, self.model.hidden_size, self.dtype,
                                                self.device)
        with trace.span("forward"):
            out = self.model(input_ids, positions, carried)
        if not pipeline.is_last_stage():
            pipeline.send_activations(plan.step_id, *out)
            return
        with trace.span("lm_head"):
            logits = self.model.compute_logits(out)
        if logits is not None:        # the stage's TP rank 0 holds them gathered
            pipeline.send_logits(plan.step_id, logits.to(self.dtype))

    @torch.inference_mode()
    def collect_logits(self, plan: StepPlan) -> torch.Tensor:
        """Rank 0 under pipeline parallelism: the logits of `plan`, a step it has run its stage of, from the last
        stage (steps are collected in the order they were run)."""
        return pipeline.recv_logits(plan.step_id, pipeline.last_stage_leader(), self.dtype, self.device)

    def release(self, hand_back: bool = True) -> None:
        """Drop graphs, KV cache and weights; called before the process group is destroyed, which NCCL cannot
        do while graphs that captured its kernels are alive. hand_back: return the memory to the GPU now
        (skipped on failure paths, where a kernel stuck on a dead peer would block the synchronize)."""
        pipeline.forget_sends()
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.drop_kv_cache()
        self.model = self.lora = None
        self.attention_layers = []
        if hand_back and self.device.type == "cuda":     # now, not when the allocator likes
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def describe(self) -> str:
        table = kernel_choice.table_of(self.model)
        kernels = f" (per bucket: {kernel_choice.summary(table)})" if table else ""
        stage = (f", pipeline stage {pipeline.pp_stage()}/{pipeline.pp_size()} (layers "
                 f"{self.model.model.stage_layers.start}..{self.model.model.stage_layers.stop - 1})"
                 if pipeline.pp_size() > 1 else "")
        return (f"rank {tp_rank()}/{tp_size()}{stage} on {self.device} ({self.dtype}), attention "
                f"{self.backend.name}, linear {linear_paths(self.model)}{kernels}, quantization {self.quantization}, "
                f"{self.num_kv_blocks} KV blocks of {self.block_size} ({self.kv_cache_format()}"
                f"{' + fp32 scales' if self.config.kv_cache_dtype != 'auto' else ''})"
                f"{', decode layers fused' if getattr(getattr(self.model, 'model', None), 'fused', None) else ''}")

    def kv_cache_format(self) -> str:
        """The KV cache's storage: the model dtype's name for "auto", else the 8-bit format ("fp8" as
        "fp8_e4m3")."""
        kv = self.config.kv_cache_dtype
        return str(self.dtype).removeprefix("torch.") if kv == "auto" else {"fp8": "fp8_e4m3"}.get(kv, kv)
