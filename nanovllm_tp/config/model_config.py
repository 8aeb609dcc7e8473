"""The model facts the engine runs on (ModelConfig), read through transformers' AutoConfig from a HF directory or
a .gguf file, 4.x and 5.x formats; what the engine does not implement is refused by name."""
import json
import os
from dataclasses import dataclass

from nanovllm_tp.utils.checks import json_object

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
        from nanovllm_tp.checkpoint.gguf import find_gguf
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
        from nanovllm_tp.checkpoint.gguf import hf_config
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
