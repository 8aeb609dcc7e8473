"""Engine knobs: EngineConfig declares each once (knobs.py makes LLM's keywords and every command's flags from
it); validate() runs each knob's own check, then the checks across knobs and against the model
(config_checks.py). The model's facts are model_config.py's ModelConfig."""
from dataclasses import dataclass, field

from nanovllm_tp.config.config_checks import (check_against_model, check_batch_invariant, check_model_path,
                                              check_sub_configs, check_tokenizer_path, check_trace, lora_defaults)
from nanovllm_tp.config.generation_defaults import check_generation_config
from nanovllm_tp.config.pipeline_checks import check_pipeline, check_pipeline_against_model
from nanovllm_tp.config.knobs import add_args, argv_of, check_knobs, config_from_kwargs, knob, kwargs_of
from nanovllm_tp.config.model_config import ModelConfig
from nanovllm_tp.sampling_params import MAX_LOGPROBS

__all__ = ["EngineConfig", "ModelConfig", "LORA_DEFAULTS", "add_engine_args", "engine_kwargs", "engine_argv"]


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
    model: str = knob(help="Hugging Face model directory, .gguf file or directory holding one, or a Hugging Face "
                           "hub id (org/name; org/name:Q4_K_M or org/name:FILE.gguf for one GGUF file of a repo), "
                           "found in huggingface_hub's cache or downloaded there (HF_HUB_OFFLINE=1: the cache "
                           "only); commands: default the embedded tiny checkpoint", path=True)
    revision: str | None = knob(None, help="with a hub id as model: the branch, tag or commit hash to use (default: "
                                           "main)")
    download_dir: str | None = knob(None, help="with a hub id as model: the huggingface_hub cache directory to look "
                                               "in and download to (default: huggingface_hub's, $HF_HUB_CACHE or "
                                               "$HF_HOME/hub)", path=True)
    tokenizer: str | None = knob(None, help="the tokenizer to use instead of the model's own: a Hugging Face "
                                            "directory, a .gguf file, or a hub id (org/name: its tokenizer files "
                                            "only, from huggingface_hub's cache or downloaded there, as the model's)",
                                 path=True)
    generation_config: str = knob("auto", help="the request defaults (vLLM's): auto (the sampling fields of the "
                                               "model's generation_config.json: temperature, top_p, top_k, min_p, "
                                               "repetition_penalty, and max_new_tokens as max_tokens, where a "
                                               "request leaves them unset), vllm (the file is not read: vLLM's "
                                               "defaults), or a directory holding a generation_config.json",
                                  metavar="auto|vllm|DIR", path=True)
    max_logprobs: int = knob(MAX_LOGPROBS, help="the most logprobs (and prompt_logprobs) per position one request "
                                                "may ask for; more is refused (vLLM's knob; -1: the whole "
                                                "vocabulary)", minimum=-1)
    tensor_parallel_size: int = knob(1, help="tensor-parallel ranks", flags=("--tensor-parallel-size", "-tp", "--tp"),
                                     minimum=1)
    pipeline_parallel_size: int = knob(1, help="pipeline stages: each holds a contiguous range of the decoder layers "
                                              "(and its KV cache) over its own tensor_parallel_size ranks, so the "
                                              "engine runs tensor_parallel_size x pipeline_parallel_size ranks; "
                                              "split evenly, or by $NANOVLLM_TP_PP_LAYER_PARTITION",
                                       flags=("--pipeline-parallel-size", "-pp", "--pp"), minimum=1)
    pipeline_micro_batches: int | None = knob(None, help="with pipeline_parallel_size > 1: steps in flight at once, "
                                                         "each of its own sequences, so every stage has work "
                                                         "(default: one per stage; 1: one step at a time, the "
                                                         "stages taking turns)", minimum=1)
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
    kv_shared_pool: bool = knob(True, help="CPU, one rank: keep the KV cache in a memory file other engines of "
                                           "this host and user map, so that a request's KV moves to another engine "
                                           "(a disaggregated hand-off) by one copy from pool to pool, not as bytes "
                                           "through the server (off: private memory)")
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
    fused_decode: bool = knob(True, help="CPU decode and speculative verify steps: the decoder layers as C calls "
                                         "of the kernels their modules call (csrc/decoder.c; one call for all layers "
                                         "where every linear runs in C, oneDNN's linears and merged layers of two "
                                         "quantized types between calls; a decode step's results the modules' to "
                                         "the bit) where every piece has one; off: "
                                         "layer by layer through the modules (comparisons)")
    packed_linear: str = knob(help="CPU linear kernels: auto (the fastest per weight shape and row count, measured "
                                   "on this CPU at load and cached; LLM.stats()['linear_kernels']), or one forced "
                                   "for comparisons: c+onednn (the table an AMX CPU measures, on any CPU: c up to "
                                   "8 rows, oneDNN from 9), c (csrc/linear.c where it runs, else oneDNN), bf16 (c "
                                   "for bf16 weights only), onednn, off (F.linear); default from "
                                   "$NANOVLLM_TP_PACKED_LINEAR",
                              choices=("auto", "c+onednn", "c", "bf16", "onednn", "off"),
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
    batch_invariant: bool = knob(False, help="a request's tokens and logprobs do not depend on what else the "
                                             "engine runs: batch company, chunked-prefill sizes, prefix-cache "
                                             "hits, preemption, speculation (at a fixed TP size and dtype). Every "
                                             "linear runs csrc/linear.c's row-independent kernel (packed_linear c) "
                                             "and every attention row the C decode kernel, prefill included. CPU "
                                             "only; slower (BENCHMARKS.md); vLLM's VLLM_BATCH_INVARIANT")
    model_config: ModelConfig | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor_parallel_size x pipeline_parallel_size."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_kwargs(cls, model, **kwargs) -> "EngineConfig":
        """What LLM(model, **kwargs) builds: unknown names are refused with the closest knob."""
        return config_from_kwargs(cls, model, kwargs)

    def validate(self) -> None:
        """Every knob checked, alone and together, and the model's config read (model_config); some knobs are
        settled on the way (paths, max_model_len, enforce_eager)."""
        check_model_path(self)
        check_tokenizer_path(self)
        check_knobs(self)
        check_trace(self)
        check_generation_config(self)
        check_sub_configs(self)
        check_batch_invariant(self)
        check_pipeline(self)
        self.model_config = ModelConfig.from_pretrained(self.model)
        check_against_model(self)
        check_pipeline_against_model(self)


LORA_DEFAULTS = lora_defaults(EngineConfig)


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

