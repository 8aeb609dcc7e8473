"""The help groups of the engine and server flags: which group lists each knob in a command's --help, the groups in
the order a new user needs them (the model and the address first, kernels and tracing last), as vLLM's serve
--help groups its flags.

A knob named in no group is listed under its config's own group ("other engine flags", "other server flags"), so
a new knob is in --help without a line here. A name here that no config declares is skipped."""
import argparse
import weakref

# (group title, the knobs it lists, by field name), most-used first
GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model", ("model", "served_model_name", "revision", "download_dir", "tokenizer", "dtype", "quantization",
               "max_model_len", "generation_config")),
    ("server", ("host", "port", "api_key", "log_level", "disable_log_stats", "enable_log_requests",
                "disable_log_requests", "max_log_len", "disable_uvicorn_access_log", "disable_fastapi_docs",
                "http_priority", "threads")),
    ("chat, tools and reasoning", ("chat_template", "enable_auto_tool_choice", "tool_call_parser",
                                   "reasoning_parser",
                                   "trust_request_chat_template")),
    ("parallelism", ("tensor_parallel_size", "pipeline_parallel_size", "pipeline_micro_batches",
                     "data_parallel_size", "router", "replica_roles", "restart_dead_replicas")),
    ("memory and batching", ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "gpu_memory_utilization",
                             "kv_cache_dtype", "kvcache_block_size", "enable_prefix_caching", "scheduling_policy",
                             "stream_interval", "seed")),
    ("request limits", ("max_waiting_requests", "max_n", "max_logprobs", "max_request_body_bytes",
                        "max_prompts_per_request", "max_choices_per_request", "max_stop_strings",
                        "max_stop_string_chars", "grammar_compile_timeout")),
    ("LoRA adapters", ("enable_lora", "max_loras", "max_lora_rank", "lora_dtype", "lora_modules",
                       "allow_runtime_lora_updating", "lora_root")),
    ("speculative decoding, embeddings, batch invariance", ("speculative_config", "pooler_config",
                                                            "batch_invariant")),
    ("device and kernels", ("device", "attention_backend", "enforce_eager", "cpu_kernels", "fused_decode",
                            "packed_linear", "shm_allreduce")),
    ("liveness and shutdown", ("engine_iteration_timeout", "shutdown_timeout")),
    ("tracing", ("trace_path", "trace_layers")),
)

GROUP_OF: dict[str, str] = {name: title for title, names in GROUPS for name in names}
_PLACE: dict[str, int] = {name: i for i, name in enumerate(name for _, names in GROUPS for name in names)}

# one set of groups per parser, made in GROUPS' order the first time a config adds its flags to it (argparse
# prints groups in the order they were made and leaves out the empty ones)
_made: "weakref.WeakKeyDictionary[argparse.ArgumentParser, dict]" = weakref.WeakKeyDictionary()


def help_order(name: str) -> int:
    """Where the knob `name` is listed in its group (the order of GROUPS; a knob in no group after the rest)."""
    return _PLACE.get(name, len(_PLACE))


def group_for(parser: argparse.ArgumentParser, name: str, fallback: str):
    """The argument group of `parser` that lists the knob `name`; `fallback`'s group (made on first use, after
    GROUPS') for a knob in no group."""
    groups = _made.get(parser)
    if groups is None:
        groups = _made[parser] = {title: parser.add_argument_group(title) for title, _ in GROUPS}
    title = GROUP_OF.get(name, fallback)
    if title not in groups:
        groups[title] = parser.add_argument_group(title)
    return groups[title]
