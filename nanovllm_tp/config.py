"""Engine knobs (validated before anything starts) and the model facts read from a HF config.json."""
import json
import os
from dataclasses import dataclass, field


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
    o_proj_bias: bool = False    # Llama and Qwen3 bias o_proj when attention_bias is set; Qwen2 never does
    mlp_bias: bool = False       # Llama's mlp_bias: gate, up and down projections

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{model_dir!r} is not a model directory: no config.json in it")
        with open(path) as f:
            raw = json.load(f)
        from nanovllm_tp.models import ARCHITECTURES
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                             f"supported: {sorted(ARCHITECTURES)}")
        # transformers 5.x nests rope settings under rope_parameters; 4.x keeps rope_theta / rope_scaling flat.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ValueError(f"rope type {rope_type!r} in {path} is not supported yet (only plain RoPE)")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        is_qwen3 = arch == "Qwen3ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Qwen3 and Llama only when attention_bias says so.
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=is_qwen3,
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=_eos_ids(model_dir, raw),
            o_proj_bias=arch != "Qwen2ForCausalLM" and bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )


def _eos_ids(model_dir: str, raw: dict) -> tuple[int, ...]:
    eos = None
    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


_INT_KNOBS = ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens")


@dataclass(slots=True)
class EngineConfig:
    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"                  # auto: fp32 on CPU, the checkpoint's dtype on CUDA
    device: str = "auto"                 # auto: cuda when available, else cpu
    max_model_len: int | None = None     # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kvcache_block_size: int | None = None   # None: 256 with flash-attn, 16 otherwise
    kv_cache_memory: int | None = None   # bytes per rank; CPU default below, on CUDA overrides utilization
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    seed: int = 0
    model_config: ModelConfig | None = field(default=None, repr=False)

    def validate(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path to a model directory, got {type(self.model).__name__}")
        self.model = os.fspath(self.model)
        if not os.path.isdir(self.model):
            raise ValueError(f"model directory {self.model!r} does not exist (no downloads here: give a local "
                             "Hugging Face directory, or make one with python -m nanovllm_tp.launch.make_tiny DIR)")
        for name in _INT_KNOBS + ("seed",):
            _check_int(name, getattr(self, name), minimum=0 if name == "seed" else 1)
        for name in ("max_model_len", "kvcache_block_size", "kv_cache_memory"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if not isinstance(self.device, str) or self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        mc = self.model_config = ModelConfig.from_pretrained(self.model)
        if self.max_model_len is None:
            self.max_model_len = mc.max_position_embeddings
        elif self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be at least 2 (one prompt token and one generated token)")
        tp = self.tensor_parallel_size
        if mc.num_attention_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={mc.num_attention_heads}")
        if mc.intermediate_size % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size={mc.intermediate_size}")
        if mc.num_key_value_heads % tp and tp % mc.num_key_value_heads:
            raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={mc.num_key_value_heads} must "
                             "divide one another (kv heads are replicated when tp exceeds them)")


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
