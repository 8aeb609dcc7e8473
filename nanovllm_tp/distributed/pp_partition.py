"""Which decoder layers each pipeline stage holds: contiguous ranges, as even as the layer count allows.

The default split gives every stage num_layers // stages layers and hands the remainder out one layer each to
the stages before the last, from the second-to-last backwards (the last stage also runs the final norm and the
LM head, the first the embedding lookup, which is cheap): 4 layers over 3 stages are 1, 2, 1. vLLM splits the
same way, so a partition tuned for one runs on the other. $NANOVLLM_TP_PP_LAYER_PARTITION ("3,5") overrides it.
Torch-free: config checks and tests read it without a process group.
"""
from nanovllm_tp import envs

PARTITION_ENV = "NANOVLLM_TP_PP_LAYER_PARTITION"


def layer_counts(num_layers: int, stages: int) -> list[int]:
    """Layers per stage, from the environment's partition if set, else the even split. ValueError where the
    layers cannot be split so that every stage holds at least one."""
    if stages < 1:
        raise ValueError(f"pipeline_parallel_size must be at least 1, got {stages}")
    text = envs.get(PARTITION_ENV)
    if text is not None and text.strip():
        return _parse(text, num_layers, stages)
    if num_layers < stages:
        raise ValueError(f"pipeline_parallel_size={stages} exceeds the model's {num_layers} decoder layers (every "
                         "stage holds at least one)")
    counts = [num_layers // stages] * stages
    for i in range(2, num_layers % stages + 2):
        counts[-i] += 1
    return counts


def _parse(text: str, num_layers: int, stages: int) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"${PARTITION_ENV}={text!r}: expected comma-separated layer counts, e.g. \"2,2\"") from None
    if len(counts) != stages:
        raise ValueError(f"${PARTITION_ENV}={text!r} names {len(counts)} stages; pipeline_parallel_size is {stages}")
    if min(counts) < 1:
        raise ValueError(f"${PARTITION_ENV}={text!r}: every stage holds at least one layer")
    if sum(counts) != num_layers:
        raise ValueError(f"${PARTITION_ENV}={text!r} sums to {sum(counts)} layers; the model has {num_layers}")
    return counts


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The decoder layers of `stage` (0-based) out of `stages`."""
    counts = layer_counts(num_layers, stages)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])
