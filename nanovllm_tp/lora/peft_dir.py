"""PEFT LoRA adapter directories: `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).

`read_adapter` is rank 0's check of a directory before any request uses it (the config, then every tensor's name
and shape against the model's LoRA targets, reading headers only); `load_tensors` is what every rank reads when
the adapter is given a slot. What the engine does not implement is refused by name."""
import math
import os
from dataclasses import dataclass

from nanovllm_tp.utils.checks import json_object

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PREFIX = "base_model.model."
_PARTS = {".lora_A.weight": 0, ".lora_B.weight": 1}
# adapter_config.json keys whose non-default values the engine does not implement, and what each means
_REFUSED = {"use_dora": "DoRA (use_dora)", "modules_to_save": "modules_to_save (fully trained extra modules)",
            "rank_pattern": "per-module ranks (rank_pattern)", "alpha_pattern": "per-module alphas (alpha_pattern)",
            "fan_in_fan_out": "fan_in_fan_out weights", "layer_replication": "layer_replication",
            "lora_bias": "LoRA biases (lora_bias)", "target_parameters": "target_parameters",
            "trainable_token_indices": "trainable_token_indices", "use_qalora": "QALoRA (use_qalora)"}


@dataclass(slots=True)
class AdapterSpec:
    """An adapter that passed read_adapter: its directory, rank, scale (alpha / r, or alpha / sqrt(r) with
    rsLoRA) and the modules it adapts (HF names)."""
    path: str
    rank: int
    scale: float
    modules: tuple[str, ...]


def _config(path: str) -> dict:
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a directory")
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {CONFIG_FILE}")
    return json_object(file)


def _scale(config: dict, file: str) -> tuple[int, float]:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{file}: peft_type {kind!r} is not implemented (only LORA)")
    for key, what in _REFUSED.items():
        if config.get(key) not in (None, False, {}, []):
            raise ValueError(f"{file}: {what} is not implemented")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{file}: bias={config['bias']!r} is not implemented (only 'none')")
    r, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{file}: r must be a positive int, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    return r, alpha / (math.sqrt(r) if config.get("use_rslora") else r)


def module_of(name: str) -> tuple[str, int] | None:
    """(HF module name, 0 for A / 1 for B) of an adapter tensor name, or None for a name of another kind."""
    if not name.startswith(_PREFIX):
        return None
    for suffix, part in _PARTS.items():
        if name.endswith(suffix):
            return name[len(_PREFIX):-len(suffix)], part
    return None


def read_adapter(path: str, targets: dict[str, tuple[int, int]], max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter directory against the model: `targets` maps each module the engine adapts (HF name)
    to its (in_features, out_features). ValueError naming what is wrong."""
    from safetensors import safe_open
    path = os.path.abspath(path)
    config = _config(path)
    rank, scale = _scale(config, os.path.join(path, CONFIG_FILE))
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank={max_rank}")
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"LoRA adapter {path!r} has no {WEIGHTS_FILE} (other weight formats are not read)")
    shapes: dict[str, list] = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                found = module_of(name)
                if found is None:
                    raise ValueError(f"{file}: tensor {name!r} is not a LoRA A/B weight (embedding and other "
                                     "adapter kinds are not implemented)")
                shapes.setdefault(found[0], [None, None])[found[1]] = tuple(f.get_slice(name).get_shape())
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not shapes:
        raise ValueError(f"{file} holds no LoRA weights")
    for module, (a, b) in shapes.items():
        if module not in targets:
            pieces = sorted({t.rsplit(".", 1)[-1] for t in targets})
            short = module.rsplit(".", 1)[-1]
            raise ValueError(f"LoRA adapter {path!r} targets {module!r}, which the model does not have"
                             if short in pieces else f"LoRA adapter {path!r} targets {short!r} ({module}), which is "
                             f"not implemented: the engine adapts {', '.join(pieces)}")
        if a is None or b is None:
            raise ValueError(f"{file}: {module} has lora_{'A' if a is None else 'B'} missing")
        fan_in, fan_out = targets[module]
        if a != (rank, fan_in) or b != (fan_out, rank):
            raise ValueError(f"{file}: {module} has lora_A {list(a)} and lora_B {list(b)}; the model needs "
                             f"[{rank}, {fan_in}] and [{fan_out}, {rank}] (r={rank})")
    return AdapterSpec(path, rank, scale, tuple(sorted(shapes)))


def load_tensors(path: str) -> tuple[float, dict[str, tuple]]:
    """(scale, {HF module name: (A, B)}) of an adapter directory (read_adapter checked it on rank 0)."""
    from safetensors.torch import load_file
    _, scale = _scale(_config(path), path)
    pairs: dict[str, list] = {}
    for name, tensor in load_file(os.path.join(path, WEIGHTS_FILE)).items():
        module, part = module_of(name)
        pairs.setdefault(module, [None, None])[part] = tensor
    return scale, {m: tuple(p) for m, p in pairs.items()}
