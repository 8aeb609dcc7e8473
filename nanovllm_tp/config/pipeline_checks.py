"""EngineConfig's checks of pipeline_parallel_size: the features that do not run across pipeline stages yet,
refused by name before anything starts, and the split of the model's layers over the stages."""

# knob -> (whether its value asks for the feature, what the feature is)
NOT_WITH_PIPELINE = {
    "speculative_config": (lambda v: v is not None, "speculative decoding"),
    "enable_lora": (lambda v: v is True, "LoRA adapters"),
    "pooler_config": (lambda v: v is not None, "embeddings (pooling)"),
    "batch_invariant": (lambda v: v is True, "batch invariance"),
}


def check_pipeline(config) -> None:
    """Refuse what does not work under pipeline parallelism yet; settle CUDA graphs off (every step runs eager:
    a stage's graph would have to capture its sends and receives)."""
    if config.pipeline_parallel_size == 1:
        if config.pipeline_micro_batches not in (None, 1):
            raise ValueError(f"pipeline_micro_batches={config.pipeline_micro_batches} needs pipeline_parallel_size "
                             "> 1: without stages there is one step in flight")
        return
    for name, (asks, feature) in NOT_WITH_PIPELINE.items():
        if asks(getattr(config, name)):
            raise ValueError(f"{feature} ({name}={getattr(config, name)!r}) is not implemented with "
                             f"pipeline_parallel_size={config.pipeline_parallel_size} yet: leave {name} at its "
                             "default, or run pipeline_parallel_size=1")
    config.enforce_eager = True


def check_pipeline_against_model(config) -> None:
    """Every stage holds at least one decoder layer (the even split, or $NANOVLLM_TP_PP_LAYER_PARTITION's)."""
    if config.pipeline_parallel_size == 1:
        return
    from nanovllm_tp.distributed.pp_partition import layer_counts
    layer_counts(config.model_config.num_hidden_layers, config.pipeline_parallel_size)
