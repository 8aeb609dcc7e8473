"""Decode steps on CPU with the decoder layers run by csrc/decoder.c (the `fused_decode` knob).

A decode step through the modules makes about a dozen Python module calls, ctypes calls and fresh tensors per
layer around kernels that, for one row, run for microseconds each: at one stream that overhead is as large as the
matmuls. `FusedDecode` describes every layer once (its packed weights, norms, rotary table, KV cache: the
`LayerDesc` records below, the C structs' twins) and hands a step's rows to one C call for all layers (one rank),
or one per half layer with the all-reduces between (TP). The C code calls the kernels the modules call, in their
order, so a decode step's hidden states are the modules' to the bit. Steps whose rows each add a few tokens to a
cached prefix (speculative verify steps) run too, as one decode row per token (the attention backend's
`as_decode`): their attention is then the decode kernel's, each token's as a decode step of it would compute it, instead of the prefill attention.
With LoRA, each adapted linear's `LoRATables` sit in its `LinearDesc` and the step's `SlotGroups` in its
`StepDesc`: decoder.c adds the deltas after the linear with csrc/lora.c's call, the one `LoRALayer.apply` makes.

It runs where every piece of every layer has such a kernel: the plain `DecoderLayer` of blocks.py (SiLU MLP,
q/k norms or none, any window and logit cap), weights quantized for csrc/linear_q.c or packed for csrc/linear.c
(under packed_linear=auto, where csrc/linear.c won the step's row-count bucket), no bias on the row-parallel
layers, a KV cache in the model dtype or quantized (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2: the K/V stored by
csrc/kv_store.c with their scales and read by the decode kernel, as the attention layer's modules do), the `cpu`
attention backend, no layer hooks (`--trace-layers`), and LoRA rows only where the step's adapted tokens all go to
csrc/lora.c (`LoRABatch.heavy` empty: no slot with more than KERNEL_TOKENS_PER_SLOT tokens). Anything else
(prompts, oneDNN-packed weights, other layer kinds, a step with more than that many tokens of one adapter) runs
through the modules.
"""
import ctypes
from ctypes import c_float, c_int32, c_int64, c_void_p

import torch

from nanovllm_tp.distributed.parallel_state import all_reduce, tp_size
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.kernel_choice import ChosenWeight, bucket
from nanovllm_tp.layers.norm_rope_act import RMSNorm, SiluAndMul
from nanovllm_tp.layers.packed_linear import C_KERNEL, BlockedWeight
from nanovllm_tp.layers.quant import QuantWeight
from nanovllm_tp.models.blocks import DecoderAttention, DecoderLayer, DecoderModel, GatedMLP
from nanovllm_tp.utils.context import get_context

LINEAR_QUANT, LINEAR_DENSE = 1, 2     # decoder.c's kinds of linear_desc


class LinearDesc(ctypes.Structure):
    _fields_ = [("packed", c_void_p), ("bias", c_void_p), ("lora", c_void_p), ("n", c_int64), ("k", c_int64),
                ("kind", c_int32), ("qtype", c_int32)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("input_norm", c_void_p), ("post_norm", c_void_p), ("q_norm", c_void_p), ("k_norm", c_void_p),
                ("cos_sin", c_void_p), ("k_cache", c_void_p), ("v_cache", c_void_p), ("k_scale", c_void_p),
                ("v_scale", c_void_p), ("eps", c_float), ("qk_eps", c_float), ("scale", c_float), ("softcap", c_float),
                ("heads", c_int32), ("kv_heads", c_int32), ("dim", c_int32), ("rot_dim", c_int32),
                ("block_size", c_int32), ("window", c_int32), ("cos_bf16", c_int32), ("hidden", c_int32),
                ("kv", c_int32)]


class StepDesc(ctypes.Structure):
    _fields_ = [("positions", c_void_p), ("slots", c_void_p), ("tables", c_void_p), ("lens", c_void_p),
                ("lora", c_void_p), ("table_stride", c_int64), ("rows", c_int64), ("bf16", c_int32),
                ("first", c_int32)]


def _plain(model: DecoderModel) -> bool:
    """Whether every layer is blocks.py's plain decoder layer with a SiLU-gated MLP (exact types: a subclass may
    change the math)."""
    return all(type(layer) is DecoderLayer and type(layer.self_attn) is DecoderAttention
               and type(layer.mlp) is GatedMLP and type(layer.mlp.act) is SiluAndMul
               and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
               for layer in model.own_layers())


class FusedDecode:
    """The decoder layers of one model as csrc/decoder.c runs them; `__call__` is DecoderModel's layer loop for
    the steps it can run (None for the others)."""

    def __init__(self, model: DecoderModel):
        self.layers = model.own_layers()     # under pipeline parallelism, this stage's
        # with enable_lora, the LoRABatch every LoRA layer shares: the step's rows by slot
        self.lora = next((m.lora.batch for m in model.modules() if getattr(m, "lora", None) is not None), None)
        self.tables: dict[tuple, ctypes.Array | None] = {}     # (KV cache, dtype, row bucket) -> LayerDesc array
        self.keep: list[torch.Tensor] = []      # tensors the tables point at that the modules do not hold
        self.steps = 0       # the steps run here
        self.verify_steps = 0     # of which steps of several tokens a row (see _token_rows)
        self.lora_steps = 0       # of which steps with adapted rows

    @classmethod
    def of(cls, model) -> "FusedDecode | None":
        return cls(model) if isinstance(model, DecoderModel) and _plain(model) else None

    def __call__(self, hidden: torch.Tensor, positions: torch.Tensor, residual: torch.Tensor | None = None):
        """(hidden, residual) after every layer, or None where the step runs through the modules. `residual`: the
        previous pipeline stage's, on a stage after the first (None: hidden is the embedding)."""
        ctx = get_context()
        first = self.layers[0]
        attn = first.self_attn.attn
        if (not hidden.is_cpu or hidden.dtype not in cpu_kernels.DTYPES
                or attn.backend is None or attn.backend.name != "cpu" or first._forward_pre_hooks
                or first._forward_hooks or (kernels := cpu_kernels.active()) is None):
            return None
        rows = hidden.shape[0]
        groups = self._lora_groups()
        if groups is False:
            return None
        per_token = self._token_rows(ctx, attn.backend) if ctx.is_prefill else (ctx.block_tables, ctx.context_lens)
        table = self._table(hidden.dtype, bucket(rows)) if per_token is not None else None
        if table is None:
            return None
        hidden = hidden.contiguous()
        from_embedding = residual is None
        residual = torch.empty_like(hidden) if from_embedding else residual.contiguous()
        positions, slots = positions.to(torch.int64).contiguous(), ctx.slot_mapping.to(torch.int64).contiguous()
        tables, lens = per_token[0].to(torch.int32).contiguous(), per_token[1].to(torch.int32).contiguous()
        step = StepDesc(positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                        None if groups is None else ctypes.addressof(groups.desc), tables.stride(0), rows,
                        int(hidden.dtype is torch.bfloat16), int(from_embedding))
        if tp_size() == 1:
            failed = kernels._decoder_layers(table, len(table), hidden.data_ptr(), residual.data_ptr(),
                                             ctypes.byref(step))
        else:
            failed = 0
            for layer in table:
                failed |= kernels._decoder_attention(ctypes.byref(layer), hidden.data_ptr(), residual.data_ptr(),
                                                     ctypes.byref(step))
                hidden = all_reduce(hidden)       # in place: the same storage
                step.first = 0
                failed |= kernels._decoder_mlp(ctypes.byref(layer), hidden.data_ptr(), residual.data_ptr(),
                                               ctypes.byref(step))
                hidden = all_reduce(hidden)
        if failed:
            raise MemoryError("the fused decoder layers could not allocate their scratch")
        self.steps += 1
        self.verify_steps += ctx.is_prefill
        self.lora_steps += groups is not None
        return hidden, residual

    def _lora_groups(self):
        """The step's SlotGroups where it has adapted rows, None where it has none, False where csrc/lora.c would
        not take them all (its LoRA then runs through the modules: torch's matmuls for a heavy slot)."""
        batch = self.lora
        if batch is None or not batch.runs:
            return None
        return batch.groups if batch.groups is not None and not batch.heavy else False

    @staticmethod
    def _token_rows(ctx, backend):
        """A step whose rows each continue their sequence by a few tokens (speculative verify steps; a short last
        prompt chunk over a cached prefix) as one decode row per token: the (block tables, context lengths) the
        attention backend worked out for it (`as_decode`, each token seeing its row's KV up to itself). None for
        other steps (prompts, which go through the modules' prefill attention)."""
        if ctx.as_decode is None:
            backend.prepare(ctx)
        short, index, decode_ctx = ctx.as_decode or ((), None, None)
        if not short or index is not None:       # index None: every token of the step is in a short row
            return None
        return decode_ctx.block_tables, decode_ctx.context_lens

    def _table(self, dtype: torch.dtype, row_bucket: int):
        attn = self.layers[0].self_attn.attn
        key = (attn.k_cache.data_ptr(), attn.k_cache.numel(), dtype, row_bucket)
        if key not in self.tables:
            if not attn.k_cache.numel():
                return None
            descs = [self._layer(layer, dtype, row_bucket) for layer in self.layers]
            self.tables[key] = None if None in descs else (LayerDesc * len(descs))(*descs)
        return self.tables[key]

    def _layer(self, layer: DecoderLayer, dtype: torch.dtype, row_bucket: int) -> LayerDesc | None:
        sa, mlp = layer.self_attn, layer.mlp
        attn, rotary = sa.attn, sa.rotary_emb
        linears = [self._linear(lin, dtype, row_bucket, row_parallel)
                   for lin, row_parallel in ((sa.qkv_proj, False), (sa.o_proj, True), (mlp.gate_up_proj, False),
                                             (mlp.down_proj, True))]
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([sa.q_norm, sa.k_norm] if sa.qk_norm else [])
        # a dense cache in the activations' dtype, or an 8-bit one with its scales (csrc/kv_store.c's formats)
        kv = 0 if attn.kv_scales is None else cpu_kernels.KV_CODES.get(attn.k_cache.dtype)
        if (None in linears or any(n.weight.dtype is not dtype for n in norms) or kv is None
                or (not kv and attn.k_cache.dtype is not dtype) or sa.q_size != attn.num_heads * attn.head_dim):
            return None
        k_scale, v_scale = (None, None) if not kv else (t.data_ptr() for t in attn.kv_scales)
        cos_sin = rotary.cos_sin if rotary.cos_sin.dtype in cpu_kernels.DTYPES else rotary.cos_sin.float()
        self.keep.append(cos_sin)
        qk = (sa.q_norm.weight.data_ptr(), sa.k_norm.weight.data_ptr()) if sa.qk_norm else (None, None)
        return LayerDesc(*linears, layer.input_layernorm.weight.data_ptr(),
                         layer.post_attention_layernorm.weight.data_ptr(), *qk, cos_sin.data_ptr(),
                         attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), k_scale, v_scale, layer.input_layernorm.eps,
                         sa.q_norm.eps if sa.qk_norm else 0.0, attn.scale, attn.softcap, attn.num_heads,
                         attn.num_kv_heads, attn.head_dim, cos_sin.shape[1], attn.k_cache.shape[1], attn.window,
                         int(cos_sin.dtype is torch.bfloat16), layer.input_layernorm.weight.shape[0], kv)

    def _linear(self, lin, dtype: torch.dtype, row_bucket: int, row_parallel: bool) -> LinearDesc | None:
        """The layer's matmul (and its LoRA tables) as decoder.c runs it, or None: a form it has no kernel for, or a
        row-parallel bias (added after the all-reduce)."""
        packed, bias = lin.packed, lin.bias
        if row_parallel and bias is not None:
            return None
        if isinstance(packed, ChosenWeight):
            i = packed.pick[row_bucket]
            if packed.runs[i] is not C_KERNEL.run:
                return None
            packed = packed.forms[i]
        if isinstance(packed, QuantWeight):
            kind, qtype, n, k, bias = LINEAR_QUANT, packed.qtype, packed.out_features, packed.in_features, \
                None if bias is None else bias.float().contiguous()
        elif isinstance(packed, BlockedWeight) and packed.data.dtype is dtype:
            kind, qtype, n, k, bias = LINEAR_DENSE, 0, packed.out_features, packed.in_features, \
                None if bias is None else bias.to(dtype).contiguous()
        else:
            return None
        if bias is not None:
            self.keep.append(bias)
        lora = None if lin.lora is None else ctypes.addressof(lin.lora.tables)
        return LinearDesc(packed.data.data_ptr(), None if bias is None else bias.data_ptr(), lora, n, k, kind, qtype)
