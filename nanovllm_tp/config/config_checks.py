"""EngineConfig's checks that read more than one knob, a file or the model: what EngineConfig.validate runs beside
each knob's own check (knobs.check_knobs). Each settles what it checks in place: the model made a local path (a
hub id resolved, checkpoint/hub.py), the trace path plain and absolute, max_model_len from the model, enforce_eager
where CUDA graphs cannot run."""
import os
from dataclasses import fields

from nanovllm_tp.config.knobs import check_value

LORA_KNOBS = ("max_loras", "max_lora_rank", "lora_dtype")     # meaningful with enable_lora only


def lora_defaults(config) -> dict:
    """The LoRA knobs' declared defaults (config: EngineConfig, the class or one of its instances)."""
    return {f.name: f.default for f in fields(config) if f.name in LORA_KNOBS}


def check_model_path(config) -> None:
    """The model as a local path: a directory or .gguf file as given, else a Hugging Face hub id resolved through
    huggingface_hub (checkpoint/hub.py: the cache, a download where missing) at `revision`, in `download_dir`."""
    if not isinstance(config.model, (str, os.PathLike)):
        raise TypeError(f"model must be a path to a model directory or a Hugging Face hub id, got "
                        f"{type(config.model).__name__}")
    config.model = os.fspath(config.model)
    declared = {f.name: f for f in fields(config)}
    for name in ("revision", "download_dir"):         # read below, before check_knobs runs
        check_value(name, getattr(config, name), declared[name])
    if config.download_dir is not None:
        config.download_dir = os.path.abspath(os.path.expanduser(os.fspath(config.download_dir)))
    from nanovllm_tp.checkpoint.hub import resolve_model
    config.model = resolve_model(config.model, config.revision, config.download_dir)
    if not (os.path.isdir(config.model) or (os.path.isfile(config.model) and config.model.endswith(".gguf"))):
        raise ValueError(f"model directory {config.model!r} does not exist (give a local Hugging Face directory or "
                         ".gguf file, a Hugging Face hub id such as org/name, or make one with python -m "
                         "nanovllm_tp.launch.make_tiny DIR)")


def check_tokenizer_path(config) -> None:
    """The tokenizer knob as a local path (a hub id resolved as the model's, its tokenizer files only, in
    `download_dir`), or None: the model's own tokenizer."""
    declared = {f.name: f for f in fields(config)}
    check_value("tokenizer", config.tokenizer, declared["tokenizer"])
    if config.tokenizer is None:
        return
    from nanovllm_tp.checkpoint.hub import resolve_tokenizer
    path = resolve_tokenizer(os.path.expanduser(os.fspath(config.tokenizer)), config.download_dir)
    if not os.path.exists(path):
        raise ValueError(f"tokenizer {config.tokenizer!r} is neither a local directory or .gguf file nor a Hugging "
                         "Face hub id (org/name)")
    from nanovllm_tp.checkpoint.loader import TOKENIZER_FILES
    from nanovllm_tp.checkpoint.gguf import find_gguf
    if not find_gguf(path) and not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        raise ValueError(f"tokenizer {config.tokenizer!r}: {path} holds no tokenizer files "
                         f"({', '.join(TOKENIZER_FILES)}) and no .gguf file")
    config.tokenizer = os.path.abspath(path)


def check_trace(config) -> None:
    if config.trace_path is None:
        if config.trace_layers is True:
            raise ValueError("trace_layers=True needs trace_path (where to write the trace)")
        return
    if not isinstance(config.trace_path, (str, os.PathLike)):
        raise TypeError(f"trace_path must be a file path, got {type(config.trace_path).__name__}")
    path = os.path.abspath(os.fspath(config.trace_path))    # spawned and torchrun ranks write beside it
    if not os.path.isdir(os.path.dirname(path)) or os.path.isdir(path):
        raise ValueError(f"trace_path {config.trace_path!r}: not a file path in an existing directory")
    config.trace_path = path


def check_sub_configs(config) -> None:
    """The knobs that are dicts or names of their own (speculative_config, pooler_config, attention_backend),
    each by the module that implements it."""
    from nanovllm_tp.scheduler.speculative import SpeculativeConfig
    SpeculativeConfig.from_dict(config.speculative_config, config.tensor_parallel_size)
    from nanovllm_tp.pooling.params import check_pooler_config
    check_pooler_config(config.pooler_config)
    from nanovllm_tp.layers.attention.registry import check_backend_name
    check_backend_name(config.attention_backend)


def check_batch_invariant(config) -> None:
    """batch_invariant settles the kernels it needs (packed_linear c, the cpu attention backend) and refuses the
    knobs that would take another path. A row's result must not depend on its step's other rows: csrc/linear.c
    computes each row of a chunk with its own accumulators in the same order whatever the row count (oneDNN and
    F.linear pick their blocking by shape), and the C decode kernel reads each query's KV in place, in the same
    order whether the query is a decode row, one of a prefill's tokens, or a speculative proposal (SDPA's
    blocking depends on the prompt's length)."""
    if not config.batch_invariant:
        return
    import torch
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        raise ValueError("batch_invariant runs on CPU only for now: pass device='cpu'")
    wrong = [f"{name}={getattr(config, name)!r}" for name, allowed in
             (("packed_linear", ("auto", "c")), ("attention_backend", ("auto", "cpu")), ("cpu_kernels", (True,)),
              ("quantization", ("auto", "none")), ("kv_cache_dtype", ("auto",)))
             if getattr(config, name) not in allowed]
    if wrong:
        raise ValueError(f"batch_invariant needs the C kernels' row-independent paths; {', '.join(wrong)} would "
                         "take another (leave them at their defaults)")
    config.packed_linear, config.attention_backend = "c", "cpu"


def check_against_model(config) -> None:
    """The knobs against the model read into config.model_config: length, LoRA, the TP split, quantization."""
    mc = config.model_config
    if config.max_model_len is None:
        config.max_model_len = mc.max_position_embeddings
    elif config.max_model_len > mc.max_position_embeddings:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's "
                         f"max_position_embeddings={mc.max_position_embeddings}")
    if config.max_model_len < 2:
        raise ValueError("max_model_len must be at least 2 (one prompt token and one generated token)")
    if mc.num_experts:
        config.enforce_eager = True    # the MoE block reads its per-expert token counts on the host
    check_lora(config)
    tp = config.tensor_parallel_size
    if mc.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads={mc.num_attention_heads}")
    for name in ("intermediate_size", "moe_intermediate_size"):
        if getattr(mc, name) % tp:
            raise ValueError(f"tensor_parallel_size={tp} must divide {name}={getattr(mc, name)}")
    if mc.num_key_value_heads % tp and tp % mc.num_key_value_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_key_value_heads={mc.num_key_value_heads} must "
                         "divide one another (kv heads are replicated when tp exceeds them)")
    check_quantization(config)


def check_lora(config) -> None:
    if not config.enable_lora:
        for name, default in lora_defaults(config).items():
            if getattr(config, name) != default:
                raise ValueError(f"{name}={getattr(config, name)} needs enable_lora=True")
        return
    if config.max_loras > config.max_num_seqs:
        raise ValueError(f"max_loras={config.max_loras} exceeds max_num_seqs={config.max_num_seqs} (a step never "
                         "holds more adapters than rows)")
    config.enforce_eager = True    # LoRA rows take the eager path: their slots vary from step to step


def check_quantization(config) -> None:
    """A quantized .gguf on CPU keeps its blocks whole on every rank (on CUDA it is dequantized); int8 runs on
    CPU, from a checkpoint that is not quantized already."""
    import torch
    from nanovllm_tp.checkpoint.gguf import check_block_split, find_gguf, quantized_types
    gguf = find_gguf(config.model)
    on_cpu = config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available())
    if config.quantization == "auto" and gguf and on_cpu:
        check_block_split(gguf, config.tensor_parallel_size)
    if config.quantization == "int8":
        if not on_cpu:
            raise ValueError("quantization='int8' runs on CPU only: pass device='cpu'")
        kinds = set().union(*quantized_types(gguf)) if gguf else set()
        if kinds:
            raise ValueError(f"quantization='int8' quantizes a bf16/fp32 checkpoint; {config.model} is quantized "
                             f"already ({'+'.join(sorted(kinds))}): use quantization='auto'")
