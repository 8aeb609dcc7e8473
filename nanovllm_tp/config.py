"""Engine knobs (validated before anything starts) and the model facts read through transformers' AutoConfig
from a HF directory or a .gguf file."""
import json
import os
from dataclasses import dataclass, field, fields

from nanovllm_tp.checks import json_object
from nanovllm_tp.knobs import add_args, argv_of, check_knobs, config_from_kwargs, knob, kwargs_of


# rope_type -> the keys it needs beyond rope_theta (layers/norm_rope_act.rope_inv_freq implements each)
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor", "original_max_position_embeddings")}
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
_INT_FIELDS = _REQUIRED + ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...] = ()
    rope_scaling: dict | None = None        # rope parameters other than plain RoPE (rope_type and its keys)
    sliding_window: int | None = None       # the window of the layers that have one (None: no layer has)
    layer_windows: tuple[int, ...] = ()     # per layer: its sliding window, 0 for a layer that sees everything
    # mixture of experts (architecture files that have one set these through config_options)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    o_proj_bias: bool = False               # a bias on o_proj (Llama and Qwen3 with attention_bias; never Qwen2)
    mlp_bias: bool = False                  # biases on gate, up and down (Llama's mlp_bias)
    hidden_act: str = "silu"                # the gated MLP's activation (layers/norm_rope_act.GATED_ACTIVATIONS)
    query_pre_attn_scalar: float = 0        # attention scale = this ** -0.5 (0: head_dim, the usual)
    attn_logit_softcap: float = 0.0         # cap * tanh(score / cap) on attention scores (0: none)
    final_logit_softcap: float = 0.0        # the same on the logits
    scale_embeddings: bool = False          # embeddings times sqrt(hidden_size) (Gemma)
    local_rope_theta: float = 0.0           # RoPE base of the windowed layers, plain RoPE (0: as the others)
    rotary_dim: int = 0                     # features of each head that RoPE rotates (0: all of them)

    def layer_rope(self, layer: int) -> tuple[float, dict | None]:
        """(RoPE base, scaling) of one layer: a windowed layer's own base where the config has one."""
        if self.local_rope_theta and self.layer_windows[layer]:
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    @classmethod
    def from_pretrained(cls, model: str) -> "ModelConfig":
        """Read a HF model directory or a .gguf file through transformers' AutoConfig; refuse by name what the
        engine does not implement."""
        from nanovllm_tp.gguf_checkpoint import find_gguf
        from nanovllm_tp.models import ARCHITECTURES, model_class
        gguf = find_gguf(model)
        hf = _auto_config(model, gguf)
        archs = list(getattr(hf, "architectures", None) or [])
        if gguf and not archs:
            from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            archs = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(hf.model_type, hf.model_type)]
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or hf.model_type!r} in {model}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        _check_int_fields({name: getattr(hf, name, None) for name in _INT_FIELDS}, model)
        theta, scaling, local_theta = _rope(hf, model)
        heads = hf.num_attention_heads
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or ("bfloat16" if gguf else "float32")
        options = model_class(arch).config_options(hf)
        _check_activation(options, model)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
        partial = _partial_rotary_factor(hf)
        if partial != 1.0 and not model_class(arch).partial_rotary:
            raise ValueError(f"partial_rotary_factor={partial} in {model} is not implemented for {arch}")
        return cls(
            architecture=arch, vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None) or 0,
            num_hidden_layers=hf.num_hidden_layers, num_attention_heads=heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=head_dim, rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
            rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)), rope_theta=theta, rope_scaling=scaling,
            local_rope_theta=local_theta,
            max_position_embeddings=getattr(hf, "max_position_embeddings", None) or 4096,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            torch_dtype=str(dtype).replace("torch.", ""), eos_token_ids=_eos_ids(model, gguf, hf),
            **_windows(hf, model), **options)


def _auto_config(model: str, gguf: str | None):
    from transformers import AutoConfig
    if gguf is None:
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model!r} is not a model directory: no config.json (or .gguf file) in it")
        raw = json_object(path)
        missing = [k for k in _REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"{path} lacks {', '.join(missing)}")
        _check_int_fields(raw, path)
        if raw.get("quantization_config"):
            raise ValueError(f"quantization_config in {path}: quantized checkpoints are not implemented "
                             "(a .gguf file of Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or K-quant tensors runs quantized)")
    try:
        if gguf is None:
            return AutoConfig.from_pretrained(model)
        from nanovllm_tp.gguf_checkpoint import hf_config
        return hf_config(gguf)
    except Exception as exc:    # transformers' own validation errors are not all ValueErrors
        raise ValueError(f"cannot read the model config of {model!r}: {exc}") from None


def _check_int_fields(values: dict, where: str) -> None:
    for name in _INT_FIELDS:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"config field {name} must be a positive int, got {value!r} ({where})")


def _check_activation(options: dict, model: str) -> None:
    """The architecture's reading of its activation (hidden_act, or Gemma's hidden_activation), refused by name
    unless the gated MLP has it."""
    from nanovllm_tp.layers.norm_rope_act import GATED_ACTIVATIONS
    act = options.setdefault("hidden_act", "silu")
    if act == "swish":
        act = options["hidden_act"] = "silu"
    if act not in GATED_ACTIVATIONS:
        raise ValueError(f"hidden_act={act!r} in {model} is not implemented (only {', '.join(GATED_ACTIVATIONS)})")


def _partial_rotary_factor(hf) -> float:
    """The share of each head that RoPE rotates: a config field, or (transformers 5.x) a rope parameter."""
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    factor = getattr(hf, "partial_rotary_factor", None)
    return float(factor if factor is not None else params.get("partial_rotary_factor") or 1.0)


def _rope(hf, model: str) -> tuple[float, dict | None, float]:
    """rope_theta, the scaling parameters (None for plain RoPE) and the windowed layers' own base (0: none);
    transformers 5.x nests them under rope_parameters (per layer type where they differ: Gemma 3), 4.x keeps
    rope_theta flat beside rope_scaling."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    if isinstance(params.get("full_attention"), dict):
        local = dict(params.get("sliding_attention") or {})
        if (local.get("rope_type") or "default") != "default":
            raise ValueError(f"rope_parameters of sliding_attention layers of type {local['rope_type']!r} in "
                             f"{model} are not implemented (only default)")
        theta, scaling, _ = _rope_params(dict(params["full_attention"]), hf, model)
        return theta, scaling, float(local.get("rope_theta") or 0.0)
    return _rope_params(params, hf, model)


def _rope_params(params: dict, hf, model: str) -> tuple[float, dict | None, float]:
    theta = float(params.pop("rope_theta", None) or getattr(hf, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type") or params.get("type") or "default"
    params.pop("type", None)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling rope_type {kind!r} in {model} is not implemented "
                         f"(supported: {', '.join(ROPE_TYPES)})")
    params.pop("partial_rotary_factor", None)       # _partial_rotary_factor reads it
    if kind == "default":
        return theta, None, 0.0
    params["rope_type"] = kind
    if kind == "yarn":
        params.setdefault("original_max_position_embeddings", getattr(hf, "max_position_embeddings", None))
        if params.get("factor") is None and params["original_max_position_embeddings"]:
            params["factor"] = hf.max_position_embeddings / params["original_max_position_embeddings"]
    missing = [k for k in ROPE_TYPES[kind] if params.get(k) is None]
    if missing:
        raise ValueError(f"rope_scaling of type {kind!r} in {model} lacks {', '.join(missing)}")
    return theta, params, 0.0


def _windows(hf, model: str) -> dict:
    """sliding_window and layer_windows: which layers use the window. transformers 5.x lists layer_types
    (Qwen2/3 derive them from use_sliding_window and max_window_layers, Gemma from its pattern); a 4.x Qwen config
    gates the window with use_sliding_window (layers from max_window_layers on); Mistral's window is on in every
    layer whenever it is set."""
    window = getattr(hf, "sliding_window", None)
    layers = hf.num_hidden_layers
    types = getattr(hf, "layer_types", None)
    if types is not None:
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} in {model} are not implemented "
                             "(only sliding_attention and full_attention)")
        sliding = [t == "sliding_attention" for t in types]
    elif getattr(hf, "use_sliding_window", True):
        first = getattr(hf, "max_window_layers", 0) if hasattr(hf, "use_sliding_window") else 0
        sliding = [i >= first for i in range(layers)]
    else:
        sliding = [False] * layers
    if len(sliding) != layers:
        raise ValueError(f"layer_types in {model} lists {len(sliding)} layers, not num_hidden_layers={layers}")
    if not window or not any(sliding):
        return {"sliding_window": None, "layer_windows": (0,) * layers}
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"config field sliding_window must be a positive int, got {window!r} ({model})")
    return {"sliding_window": window, "layer_windows": tuple(window if s else 0 for s in sliding)}


def _eos_ids(model: str, gguf: str | None, hf) -> tuple[int, ...]:
    eos = None
    gen_path = os.path.join(model, "generation_config.json")
    if gguf is None and os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = getattr(hf, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _env_packed_linear() -> str:
    from nanovllm_tp import envs
    mode = envs.get("NANOVLLM_TP_PACKED_LINEAR", "auto")
    return {"1": "auto", "all": "auto", "0": "off"}.get(mode, mode)


def _env_flag(name: str):
    def read() -> bool:
        from nanovllm_tp import envs
        return envs.flag(name)
    return read


@dataclass(slots=True)
class EngineConfig:
    """Every engine knob, declared once: LLM(model, **kw) takes these names, and every command's engine flags
    are made from them (knobs.py)."""
    model: str = knob(help="Hugging Face model directory, .gguf file or directory holding one (commands: default "
                           "the embedded tiny checkpoint)", path=True)
    tensor_parallel_size: int = knob(1, help="tensor-parallel ranks", flags=("--tensor-parallel-size", "-tp", "--tp"),
                                     minimum=1)
    dtype: str = knob("auto", help="weights and activations; auto: float32 on CPU, the checkpoint's dtype on CUDA",
                      choices=("auto", "float32", "float16", "bfloat16"))
    device: str = knob("auto", help="auto: cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    max_model_len: int | None = knob(None, help="longest sequence, prompt and output (default: the model's "
                                                "max_position_embeddings)", minimum=1)
    max_num_seqs: int = knob(256, help="most sequences in one step", minimum=1)
    max_num_batched_tokens: int = knob(8192, help="most tokens in one step (longer prompts are chunked)", minimum=1)
    kvcache_block_size: int | None = knob(None, help="tokens per KV block (default: the attention backend's: 256 "
                                                     "with flash-attn, 16 otherwise)",
                                          flags=("--block-size", "--kvcache-block-size"), minimum=1)
    attention_backend: str = knob("auto", help="auto, or a backend's name: torch, cpu (C decode kernel), "
                                               "torch-cuda, flash")
    kv_cache_dtype: str = knob("auto", help="KV cache storage (vLLM's names): auto (the model's dtype), int8, fp8 "
                                            "(= fp8_e4m3) or fp8_e5m2: 8-bit values with one fp32 scale per token "
                                            "and KV head (absmax), about twice the blocks of bf16 in the same memory",
                               choices=("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"))
    kv_cache_memory: int | None = knob(None, help="KV cache bytes per rank (CPU default 1 GiB; on CUDA it "
                                                  "overrides gpu_memory_utilization)", minimum=1)
    gpu_memory_utilization: float = knob(0.9, help="fraction of GPU memory the engine may use (weights, "
                                                   "activations, KV cache)", minimum=0.0, open_minimum=True,
                                         maximum=1.0)
    enforce_eager: bool = knob(False, help="no CUDA graphs")
    enable_prefix_caching: bool = knob(True, help="reuse the KV blocks of prompt prefixes seen before",
                                       flags=("--enable-prefix-caching", "--prefix-caching"))
    seed: int = knob(0, help="the engine's seed (requests without one draw from it)", minimum=0)
    trace_path: str | None = knob(None, help="write a Chrome/Perfetto trace of every rank's steps here at close "
                                             "(open it in https://ui.perfetto.dev)",
                                  flags=("--trace", "--trace-path"), metavar="OUT.json", path=True)
    trace_layers: bool = knob(False, help="with --trace: a span per decoder layer")
    stream_interval: int = knob(1, help="report a running request's output every N new tokens (first and last at "
                                        "once); larger N streams fewer, larger chunks for less CPU per token",
                                minimum=1)
    cpu_kernels: bool = knob(help="CPU layers, attention decode and the sampler through the C kernels where "
                                  "they build (off: torch ops, the reference path); default from "
                                  "$NANOVLLM_TP_CPU_KERNELS", default_factory=_env_flag("NANOVLLM_TP_CPU_KERNELS"))
    fused_decode: bool = knob(True, help="CPU decode and speculative verify steps: the decoder layers as one C "
                                         "call of the kernels their modules call (csrc/decoder.c; a decode step's "
                                         "results the modules' to the bit) where every piece has one; off: layer "
                                         "by layer through the modules (comparisons)")
    packed_linear: str = knob(help="CPU linear kernels: auto (the fastest per weight shape and row count, measured "
                                   "on this CPU at load and cached; LLM.stats()['linear_kernels']), or one forced "
                                   "for comparisons: c (csrc/linear.c where it runs, else oneDNN), bf16 (c for "
                                   "bf16 weights only), onednn, off (F.linear); default from "
                                   "$NANOVLLM_TP_PACKED_LINEAR", choices=("auto", "c", "bf16", "onednn", "off"),
                              default_factory=_env_packed_linear)
    quantization: str = knob("auto", help="weights: auto (a .gguf's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K "
                                          "and Q6_K tensors stay quantized on CPU, run by AVX-512 VNNI kernels; dequantized at load where those "
                                          "cannot run, with a log line), none (dequantize at load), int8 (CPU: "
                                          "quantize a bf16/fp32 checkpoint's linear layers at load, int8 per "
                                          "output channel, activations per block of 128 inputs)",
                             choices=("auto", "none", "int8"))
    shm_allreduce: bool = knob(help="all-reduce through shared memory between same-node CPU ranks (off: gloo); "
                                    "default from $NANOVLLM_TP_SHM_ALLREDUCE",
                               default_factory=_env_flag("NANOVLLM_TP_SHM_ALLREDUCE"))
    speculative_config: dict | None = knob(None, help="speculative decoding, as vLLM's dict: {\"method\": \"ngram\", "
                                                      "\"num_speculative_tokens\": K, \"prompt_lookup_max\": N, "
                                                      "\"prompt_lookup_min\": M} or {\"method\": \"draft_model\", "
                                                      "\"model\": DIR, \"num_speculative_tokens\": K} (a smaller "
                                                      "model with the same tokenizer, run on rank 0)")
    pooler_config: dict | None = knob(None, help="embeddings: the pooling to use instead of the one the model's "
                                                 "files declare, as vLLM's dict: {\"pooling_type\": \"LAST\" | "
                                                 "\"MEAN\" | \"CLS\", \"normalize\": true | false}")
    scheduling_policy: str = knob("fcfs", help="fcfs: requests in arrival order; priority: by each request's "
                                               "priority (lower first, then arrival), and a waiting request may "
                                               "preempt running ones of a lower priority",
                                  choices=("fcfs", "priority"))
    grammar_compile_timeout: float = knob(10.0, help="seconds a request's structured output (JSON schema, regex, "
                                                     "choice, grammar) may take to compile; past it the request "
                                                     "fails with a ValueError (a 400 from the server)",
                                          minimum=0.0, open_minimum=True)
    enable_lora: bool = knob(False, help="serve LoRA adapters (PEFT directories) beside the base model: "
                                         "generate(..., lora_request=LoRARequest(...)), serve --lora-modules; rows of "
                                         "different adapters and none share a step (no CUDA graphs)")
    max_loras: int = knob(1, help="with enable_lora: adapters resident at once (every rank's slots); a request "
                                  "whose adapter finds every slot held by running requests waits", minimum=1)
    max_lora_rank: int = knob(16, help="with enable_lora: the largest adapter rank accepted (it sizes the slots)",
                              minimum=1)
    lora_dtype: str = knob("auto", help="with enable_lora: the dtype adapters are held and read in (vLLM's knob); "
                                        "auto: the model's; bfloat16 under a float32 or quantized model halves the "
                                        "bytes a step reads (sums still in float32), not bit-exact against peft",
                           choices=("auto", "bfloat16", "float32"))
    model_config: ModelConfig | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_kwargs(cls, model, **kwargs) -> "EngineConfig":
        """What LLM(model, **kwargs) builds: unknown names are refused with the closest knob."""
        return config_from_kwargs(cls, model, kwargs)

    def validate(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a model directory, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        if not (os.path.isdir(self.model) or (os.path.isfile(self.model) and self.model.endswith(".gguf"))):
            raise ValueError(f"model directory {self.model!r} does not exist (no downloads here: give a local "
                             "Hugging Face directory or .gguf file, or make one with python -m "
                             "nanovllm_tp.launch.make_tiny DIR)")
        check_knobs(self)
        self._check_trace()
        from nanovllm_tp.scheduler.speculative import SpeculativeConfig
        SpeculativeConfig.from_dict(self.speculative_config, self.tensor_parallel_size)
        from nanovllm_tp.pooling_params import check_pooler_config
        check_pooler_config(self.pooler_config)
        from nanovllm_tp.layers.attention.registry import check_backend_name
        check_backend_name(self.attention_backend)
        mc = self.model_config = ModelConfig.from_pretrained(self.model)
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        elif self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2 (one prompt token and one generated token)")
        if mc.num_experts:
            self.enforce_eager = True    # the MoE block reads its per-expert token counts on the host
        self._check_lora()
        tp = self.tensor_parallel_size
        if mc.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={mc.num_attention_heads}")
        for name in ("intermediate_size", "moe_intermediate_size"):
            if getattr(mc, name) % tp:
                raise ValueError(f"tensor_parallel_size={tp} must divide {name}={getattr(mc, name)}")
        if mc.num_key_value_heads % tp and tp % mc.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={mc.num_key_value_heads} must "
                             "divide one another (kv heads are replicated when tp exceeds them)")
        self._check_quantization()

    def _check_quantization(self) -> None:
        """A quantized .gguf on CPU keeps its blocks whole on every rank (on CUDA it is dequantized); int8 runs on
        CPU, from a checkpoint that is not quantized already."""
        import torch
        from nanovllm_tp.gguf_checkpoint import check_block_split, find_gguf, quantized_types
        gguf = find_gguf(self.model)
        on_cpu = self.device == "cpu" or (self.device == "auto" and not torch.cuda.is_available())
        if self.quantization == "auto" and gguf and on_cpu:
            check_block_split(gguf, self.tensor_parallel_size)
        if self.quantization == "int8":
            if not on_cpu:
                raise ValueError("quantization='int8' runs on CPU only: pass device='cpu'")
            kinds = set().union(*quantized_types(gguf)) if gguf else set()
            if kinds:
                raise ValueError(f"quantization='int8' quantizes a bf16/fp32 checkpoint; {self.model} is quantized "
                                 f"already ({'+'.join(sorted(kinds))}): use quantization='auto'")

    def _check_lora(self) -> None:
        if not self.enable_lora:
            for name in LORA_DEFAULTS:
                if getattr(self, name) != LORA_DEFAULTS[name]:
                    raise ValueError(f"{name}={getattr(self, name)} needs enable_lora=True")
            return
        if self.max_loras > self.max_num_seqs:
            raise ValueError(f"max_loras={self.max_loras} exceeds max_num_seqs={self.max_num_seqs} (a step never "
                             "holds more adapters than rows)")
        self.enforce_eager = True    # LoRA rows take the eager path: their slots vary from step to step

    def _check_trace(self) -> None:
        if self.trace_path is None:
            if self.trace_layers is True:
                raise ValueError("trace_layers=True needs trace_path (where to write the trace)")
            return
        if not isinstance(self.trace_path, (str, os.PathLike)):
            raise TypeError(f"trace_path must be a file path, got {type(self.trace_path).__name__}")
        path = os.path.abspath(os.fspath(self.trace_path))    # spawned and torchrun ranks write beside it
        if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
            raise ValueError(f"trace_path {self.trace_path!r}: not a file path in an existing directory")
        self.trace_path = path


LORA_DEFAULTS = {f.name: f.default for f in fields(EngineConfig)
                 if f.name in ("max_loras", "max_lora_rank", "lora_dtype")}


def add_engine_args(parser) -> None:
    """Every EngineConfig knob as a flag of `parser` (argparse), dest the field's name: what every command
    takes."""
    add_args(EngineConfig, parser)


def engine_kwargs(args) -> dict:
    """The engine flags parsed by add_engine_args, as LLM keyword arguments (model may be None)."""
    return kwargs_of(EngineConfig, args)


def engine_argv(args) -> list[str]:
    """The engine flags parsed by add_engine_args that are not at their default, as a command line."""
    return argv_of(EngineConfig, args)

