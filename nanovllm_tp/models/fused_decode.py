"""Decode steps on CPU with the decoder layers run by csrc/decoder.c (the `fused_decode` knob).

A decode step through the modules makes about a dozen Python module calls, ctypes calls and fresh tensors per
layer around kernels that, for one row, run for microseconds each: at one stream that overhead is as large as the
matmuls. `FusedDecode` describes every layer once per row-count bucket (its packed weights, norms, rotary table,
KV cache: the `LayerDesc` records below, the C structs' twins) and runs a step's rows through decoder.c's pieces
of a layer (input norm, qkv, attention, o, post-attention norm, gate/up, SiLU-and-mul, down) in as few calls as
the step allows (its `Table`'s plan): one for all layers where every linear runs in C at one rank; under TP a cut
after each row-parallel linear for its all-reduce; and a cut around each linear that oneDNN runs for the step's
bucket (packed_linear onednn, or auto where oneDNN won the bucket: a `CallerLinear`), run here between two calls
through the callable the module's matmul reaches (`ONEDNN.run` on the packed form) on decoder.c's scratch rows
(`Scratch`, kept from step to step). The C code calls the kernels the modules call, in their order, so a decode
step's hidden states are the modules' to the bit. Steps whose rows each add a few tokens to a cached prefix
(speculative verify steps), and prompt steps whose prompts the `cpu` backend takes as decode rows (up to 512
tokens in all), run too, as one decode row per token (the attention backend's `as_decode`): their attention is
then the decode kernel's, each token's as a decode step of it would compute it, instead of the prefill
attention. With LoRA, each adapted linear's `LoRATables` sit in its `LinearDesc` and the step's
`SlotGroups` in its `StepDesc`: decoder.c adds the deltas after the linear with csrc/lora.c's call, the one
`LoRALayer.apply` makes; after a oneDNN linear `LoRALayer.apply` itself adds them.

It runs where every piece of every layer has such a kernel: the plain `DecoderLayer` of blocks.py (SiLU MLP,
q/k norms or none, any window and logit cap), weights quantized for csrc/linear_q.c (a merged layer of two
quantized types, QuantParts, run between calls through quant_matmul), packed for csrc/linear.c or by oneDNN (in
the activations' dtype; which, where packed_linear=auto packed both, by the step's bucket), no bias
on the row-parallel layers, a KV cache in the model dtype or quantized (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2:
the K/V stored by csrc/kv_store.c with their scales and read by the decode kernel, as the attention layer's
modules do), the `cpu` attention backend, no layer hooks (`--trace-layers`), and LoRA rows only where the step's
adapted tokens all go to csrc/lora.c (`LoRABatch.heavy` empty: no slot with more than KERNEL_TOKENS_PER_SLOT
tokens). Anything else (a step with a longer prompt, F.linear weights (packed_linear off), other layer kinds, a
step with more than that many tokens of one adapter) runs through the modules.
"""
import ctypes
from ctypes import c_float, c_int32, c_int64, c_void_p
from dataclasses import dataclass
from typing import Callable

import torch

from nanovllm_tp.distributed.parallel_state import all_reduce, tp_size
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.kernel_choice import ChosenWeight, bucket
from nanovllm_tp.layers.norm_rope_act import RMSNorm, SiluAndMul
from nanovllm_tp.layers.packed_linear import ONEDNN, BlockedWeight
from nanovllm_tp.layers.quant import QuantParts, QuantWeight, quant_matmul
from nanovllm_tp.models.blocks import DecoderAttention, DecoderLayer, DecoderModel, GatedMLP
from nanovllm_tp.utils.context import get_context

LINEAR_CALLER, LINEAR_QUANT, LINEAR_DENSE = 0, 1, 2     # decoder.c's kinds of linear_desc
# decoder.c's pieces of a layer, in order; PIECES of them a layer
INPUT_NORM, QKV, ATTEND, O, POST_NORM, GATE_UP, ACT, DOWN, PIECES = range(9)
# the linear pieces in LayerDesc's order: the scratch rows each reads and those it writes ("hidden": the layer's)
LINEAR_PIECES = {QKV: ("h", "qkv"), O: ("attn", "hidden"), GATE_UP: ("h", "gate_up"), DOWN: ("act", "hidden")}
ROW_PARALLEL = (O, DOWN)      # all-reduced after, at TP > 1
SCRATCH = ("h", "qkv", "q", "attn", "gate_up", "act")     # scratch_desc's fields


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


class ScratchDesc(ctypes.Structure):
    _fields_ = [(name, c_void_p) for name in SCRATCH]


@dataclass(slots=True)
class CallerLinear:
    """A linear that decoder.c leaves to its caller: oneDNN-packed for the table's row bucket, or a merged layer
    whose parts are of two quantized types (QuantParts). `run` (ONEDNN.run, quant_matmul) is the callable the
    module's matmul reaches for that bucket, directly or as its ChosenWeight's, here on the scratch rows `x`; its
    output goes to the rows `out`, after its LoRA deltas by the module's own `LoRALayer.apply`."""
    run: Callable
    form: object             # the packed form `run` takes: oneDNN's tensor, or QuantParts
    bias: torch.Tensor | None
    lora: object | None      # a lora.layers.LoRALayer
    x: str
    out: str


@dataclass(slots=True)
class Table:
    """One row bucket's layers as decoder.c runs them and a step's plan over them: ranges of pieces for one
    decoder_run call each, the CallerLinears between them, and None for an all-reduce of hidden (TP > 1)."""
    layers: ctypes.Array
    plan: list
    widths: dict[str, int]     # the scratch rows' widths (SCRATCH)
    callers: bool              # whether the plan has CallerLinears


@dataclass(slots=True)
class Scratch:
    """The rows decoder.c's pieces pass on, for steps of up to `rows` rows: kept from step to step, grown for
    a step with more."""
    rows: int
    dtype: torch.dtype
    widths: dict[str, int]
    tensors: dict[str, torch.Tensor]
    desc: ScratchDesc


def _plain(model: DecoderModel) -> bool:
    """Whether every layer is blocks.py's plain decoder layer with a SiLU-gated MLP (exact types: a subclass may
    change the math)."""
    return all(type(layer) is DecoderLayer and type(layer.self_attn) is DecoderAttention
               and type(layer.mlp) is GatedMLP and type(layer.mlp.act) is SiluAndMul
               and type(layer.input_layernorm) is RMSNorm and type(layer.post_attention_layernorm) is RMSNorm
               for layer in model.own_layers())


def _plan(callers: list[dict[int, CallerLinear]], reduce: bool) -> list:
    """A step's plan over a table's layers: its pieces in order, each layer's CallerLinears (`callers`: per layer,
    by piece) in their linear pieces' places, None (the all-reduce) after each row-parallel linear where `reduce`;
    the runs of pieces between those as ranges (one decoder_run call each)."""
    plan = []
    for i, layer in enumerate(callers):
        for piece in range(PIECES):
            op = layer.get(piece, i * PIECES + piece)
            if isinstance(op, int) and plan and isinstance(plan[-1], range) and plan[-1].stop == op:
                plan[-1] = range(plan[-1].start, op + 1)
            else:
                plan.append(range(op, op + 1) if isinstance(op, int) else op)
            if reduce and piece in ROW_PARALLEL:
                plan.append(None)
    return plan


def _table_of(described: list[tuple[LayerDesc, dict[int, CallerLinear]]]) -> Table:
    """The Table of the layers' (LayerDesc, CallerLinears by piece)."""
    descs = [d for d, _ in described]
    callers = [c for _, c in described]
    widths = {"h": max(d.hidden for d in descs), "qkv": max(d.qkv.n for d in descs),
              "q": max(d.heads * d.dim for d in descs), "gate_up": max(d.gate_up.n for d in descs),
              "act": max(d.down.k for d in descs)}
    widths["attn"] = widths["q"]
    return Table((LayerDesc * len(descs))(*descs), _plan(callers, tp_size() > 1), widths, any(callers))


class FusedDecode:
    """The decoder layers of one model as csrc/decoder.c runs them; `__call__` is DecoderModel's layer loop for
    the steps it can run (None for the others)."""

    def __init__(self, model: DecoderModel):
        self.layers = model.own_layers()     # under pipeline parallelism, this stage's
        # with enable_lora, the LoRABatch every LoRA layer shares: the step's rows by slot
        self.lora = next((m.lora.batch for m in model.modules() if getattr(m, "lora", None) is not None), None)
        self.tables: dict[tuple, Table | None] = {}     # (KV cache, dtype, row bucket) -> Table
        self.scratch: Scratch | None = None
        self.keep: list[torch.Tensor] = []      # tensors the tables point at that the modules do not hold
        self.steps = 0       # the steps run here
        self.verify_steps = 0     # of which steps of several tokens a row (see _token_rows)
        self.lora_steps = 0       # of which steps with adapted rows
        self.caller_steps = 0     # of which steps with linears run between decoder.c's calls (oneDNN's, QuantParts)

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
        scratch = self._scratch(rows, hidden.dtype, table.widths)
        hidden = hidden.contiguous()
        from_embedding = residual is None
        residual = torch.empty_like(hidden) if from_embedding else residual.contiguous()
        positions, slots = positions.to(torch.int64).contiguous(), ctx.slot_mapping.to(torch.int64).contiguous()
        tables, lens = per_token[0].to(torch.int32).contiguous(), per_token[1].to(torch.int32).contiguous()
        step = StepDesc(positions.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                        None if groups is None else ctypes.addressof(groups.desc), tables.stride(0), rows,
                        int(hidden.dtype is torch.bfloat16), int(from_embedding))
        for op in table.plan:
            if op is None:
                hidden = all_reduce(hidden)
            elif isinstance(op, range):
                if kernels._decoder_run(table.layers, op.start, op.stop, hidden.data_ptr(), residual.data_ptr(),
                                        ctypes.byref(scratch.desc), ctypes.byref(step)):
                    raise MemoryError("the fused decoder layers could not allocate their scratch")
            else:       # LinearBase.forward's matmul and LoRA deltas, on the scratch rows
                x = scratch.tensors[op.x][:rows]
                y = op.run(x, op.form, op.bias)
                if op.lora is not None and groups is not None:
                    y = op.lora.apply(x, y)
                (hidden if op.out == "hidden" else scratch.tensors[op.out][:rows]).copy_(y)
        self.steps += 1
        self.verify_steps += ctx.is_prefill
        self.lora_steps += groups is not None
        self.caller_steps += table.callers
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
        prompt chunk over a cached prefix) or are prompts the backend takes as decode rows (the `cpu` backend's of
        up to 512 tokens in all), as one decode row per token: the (block tables, context lengths) the attention
        backend worked out for it (`as_decode`, each token seeing its row's KV up to itself). None for other steps
        (a longer prompt among its rows: the modules' prefill attention)."""
        if ctx.as_decode is None:
            backend.prepare(ctx)
        short, index, decode_ctx = ctx.as_decode or ((), None, None)
        if not short or index is not None:       # index None: every token of the step is in a short row
            return None
        return decode_ctx.block_tables, decode_ctx.context_lens

    def _table(self, dtype: torch.dtype, row_bucket: int) -> Table | None:
        attn = self.layers[0].self_attn.attn
        key = (attn.k_cache.data_ptr(), attn.k_cache.numel(), dtype, row_bucket)
        if key not in self.tables:
            if not attn.k_cache.numel():
                return None
            described = [self._layer(layer, dtype, row_bucket) for layer in self.layers]
            self.tables[key] = None if None in described else _table_of(described)
        return self.tables[key]

    def _scratch(self, rows: int, dtype: torch.dtype, widths: dict[str, int]) -> Scratch:
        have = self.scratch
        if have is None or have.rows < rows or have.dtype is not dtype or have.widths != widths:
            tensors = {name: torch.empty(rows, widths[name], dtype=dtype) for name in SCRATCH}
            self.scratch = Scratch(rows, dtype, widths, tensors,
                                   ScratchDesc(*(tensors[name].data_ptr() for name in SCRATCH)))
        return self.scratch

    def _layer(self, layer: DecoderLayer, dtype: torch.dtype,
               row_bucket: int) -> tuple[LayerDesc, dict[int, CallerLinear]] | None:
        """The layer's LayerDesc for steps of the row bucket and its CallerLinears by piece, or None: a piece
        decoder.c cannot run."""
        sa, mlp = layer.self_attn, layer.mlp
        attn, rotary = sa.attn, sa.rotary_emb
        modules = {QKV: sa.qkv_proj, O: sa.o_proj, GATE_UP: mlp.gate_up_proj, DOWN: mlp.down_proj}
        linears = {piece: self._linear(modules[piece], dtype, row_bucket, piece) for piece in LINEAR_PIECES}
        norms = [layer.input_layernorm, layer.post_attention_layernorm] + ([sa.q_norm, sa.k_norm] if sa.qk_norm else [])
        # a dense cache in the activations' dtype, or an 8-bit one with its scales (csrc/kv_store.c's formats)
        kv = 0 if attn.kv_scales is None else cpu_kernels.KV_CODES.get(attn.k_cache.dtype)
        if (None in linears.values() or any(n.weight.dtype is not dtype for n in norms) or kv is None
                or (not kv and attn.k_cache.dtype is not dtype) or sa.q_size != attn.num_heads * attn.head_dim):
            return None
        k_scale, v_scale = (None, None) if not kv else (t.data_ptr() for t in attn.kv_scales)
        cos_sin = rotary.cos_sin if rotary.cos_sin.dtype in cpu_kernels.DTYPES else rotary.cos_sin.float()
        self.keep.append(cos_sin)
        qk = (sa.q_norm.weight.data_ptr(), sa.k_norm.weight.data_ptr()) if sa.qk_norm else (None, None)
        desc = LayerDesc(*(linears[piece][0] for piece in LINEAR_PIECES), layer.input_layernorm.weight.data_ptr(),
                         layer.post_attention_layernorm.weight.data_ptr(), *qk, cos_sin.data_ptr(),
                         attn.k_cache.data_ptr(), attn.v_cache.data_ptr(), k_scale, v_scale, layer.input_layernorm.eps,
                         sa.q_norm.eps if sa.qk_norm else 0.0, attn.scale, attn.softcap, attn.num_heads,
                         attn.num_kv_heads, attn.head_dim, cos_sin.shape[1], attn.k_cache.shape[1], attn.window,
                         int(cos_sin.dtype is torch.bfloat16), layer.input_layernorm.weight.shape[0], kv)
        return desc, {piece: caller for piece, (_, caller) in linears.items() if caller is not None}

    def _linear(self, lin, dtype: torch.dtype, row_bucket: int,
                piece: int) -> tuple[LinearDesc, CallerLinear | None] | None:
        """The layer's matmul (and its LoRA tables) as decoder.c runs it, with a CallerLinear where it is oneDNN's
        for the bucket or QuantParts (decoder.c stops before it); None: a form neither has a kernel for, or a
        row-parallel bias (added after the all-reduce)."""
        packed, bias = lin.packed, lin.bias
        if piece in ROW_PARALLEL and bias is not None:
            return None
        run = ONEDNN.run      # matmul's for a weight packed by oneDNN alone
        if isinstance(packed, ChosenWeight):
            i = packed.pick[row_bucket]
            run, packed = packed.runs[i], packed.forms[i]
        if isinstance(packed, torch.Tensor) and run is ONEDNN.run and packed.dtype is dtype:
            n, k = packed.shape
            return (LinearDesc(None, None, None, n, k, LINEAR_CALLER, 0),
                    CallerLinear(run, packed, bias, lin.lora, *LINEAR_PIECES[piece]))
        if isinstance(packed, QuantParts) and all(isinstance(p, QuantWeight) for p in packed.parts):
            # a merged layer of two quantized types (Q4_K_M's q, k in Q4_K beside v in Q6_K): part by part
            return (LinearDesc(None, None, None, packed.out_features, packed.parts[0].in_features, LINEAR_CALLER, 0),
                    CallerLinear(quant_matmul, packed, bias, lin.lora, *LINEAR_PIECES[piece]))
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
        return LinearDesc(packed.data.data_ptr(), None if bias is None else bias.data_ptr(), lora, n, k, kind,
                          qtype), None
