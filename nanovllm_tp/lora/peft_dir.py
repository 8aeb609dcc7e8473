"""PEFT LoRA adapter directories: `adapter_config.json` (r, lora_alpha, use_rslora, target_modules) and
`adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` [r, in], `...lora_B.weight` [out, r]).

`read_adapter` is rank 0's check of a directory before any request uses it (the config, its fields against peft's
LoraConfig, then every tensor's name and shape against the model's LoRA targets, and its values: finite);
`load_tensors` is what every rank reads when the adapter is given a slot. What the engine does not implement is
refused by name."""
import math
import os
import re
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
            "trainable_token_indices": "trainable_token_indices", "use_qalora": "QALoRA (use_qalora)",
            "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
            "use_bdlora": "block-diagonal LoRA (use_bdlora)", "arrow_config": "Arrow routing (arrow_config)",
            "monteclora_config": "MonteCLoRA (monteclora_config)", "velora_config": "VeLoRA (velora_config)",
            "kasa_config": "KaSA (kasa_config)"}
# peft's LoraConfig fields that do not change what a saved adapter computes: bookkeeping, training and
# initialisation settings, and which modules got weights (the weights file says that itself). r, lora_alpha,
# use_rslora, target_modules, bias and peft_type are read. Any other key with a value (not null, false or empty:
# what peft writes for a field left at its default) is refused, as a field whose meaning the engine cannot know.
_HARMLESS = {"task_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
             "exclude_modules", "lora_dropout", "init_lora_weights", "layers_to_transform", "layers_pattern",
             "megatron_config", "megatron_core", "loftq_config", "eva_config", "corda_config", "lora_ga_config",
             "qalora_group_size", "runtime_config", "ensure_weight_tying"}
_READ = {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "bias"}
NOT_AN_ADAPTER = "no LoRA adapter there (a directory holding adapter_config.json and adapter_model.safetensors)"


@dataclass(slots=True)
class AdapterSpec:
    """An adapter that passed read_adapter: its directory, rank, scale (alpha / r, or alpha / sqrt(r) with
    rsLoRA) and the modules it adapts (HF names)."""
    path: str
    rank: int
    scale: float
    modules: tuple[str, ...]


def _config(path: str) -> dict:
    """The adapter's config. One message for a path that is not there and one that is not an adapter (which
    directories exist is nobody's business)."""
    if not all(os.path.isfile(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter {path!r}: {NOT_AN_ADAPTER}")
    return json_object(os.path.join(path, CONFIG_FILE))


def _unset(value) -> bool:
    return value is None or value is False or value == {} or value == [] or value == ""


def _scale(config: dict, file: str) -> tuple[int, float]:
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{file}: peft_type {kind!r} is not implemented (only LORA)")
    for key, what in _REFUSED.items():
        if not _unset(config.get(key)):
            raise ValueError(f"{file}: {what} is not implemented")
    unknown = sorted(k for k, v in config.items() if k not in _REFUSED and k not in _HARMLESS and k not in _READ
                     and not _unset(v))
    if unknown:
        raise ValueError(f"{file}: {', '.join(map(repr, unknown))} is not a LoRA setting this engine knows; an "
                         "adapter is refused rather than run with a setting that may change what it computes")
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


def _pieces(targets) -> list[str]:
    return sorted({t.rsplit(".", 1)[-1] for t in targets})


def _check_target_modules(config: dict, file: str, targets: dict) -> None:
    """adapter_config.json's target_modules against what the engine adapts: a list of module names (peft matches
    each as a name's last components), "all-linear", or a regular expression over the model's module names; a
    module the engine cannot adapt (embed_tokens, lm_head, ...) is refused by name."""
    wanted, pieces = config.get("target_modules"), _pieces(targets)
    if wanted is None or wanted == "all-linear":
        return
    if isinstance(wanted, str):
        try:
            pattern = re.compile(wanted)
        except re.error as exc:
            raise ValueError(f"{file}: target_modules {wanted!r} is not a regular expression ({exc})") from None
        other = [n for n in ("model.embed_tokens", "lm_head", "model.norm") if pattern.fullmatch(n)]
        if other:
            raise ValueError(f"{file}: target_modules {wanted!r} matches {other[0]!r}, which the engine cannot "
                             f"adapt: it adapts {', '.join(pieces)}")
        return
    if not isinstance(wanted, list) or not all(isinstance(m, str) for m in wanted):
        raise ValueError(f"{file}: target_modules must be a list of module names or a string, got {wanted!r}")
    for m in wanted:
        if m.rsplit(".", 1)[-1] not in pieces:
            raise ValueError(f"{file}: target_modules names {m!r}, which the engine cannot adapt: it adapts "
                             f"{', '.join(pieces)}")


def read_adapter(path: str, targets: dict[str, tuple[int, int]], max_rank: int) -> AdapterSpec:
    """Check a PEFT adapter directory against the model: `targets` maps each module the engine adapts (HF name)
    to its (in_features, out_features). Every weight is read once, to refuse NaN or infinite values (which would
    turn every logprob of a request into NaN). ValueError naming what is wrong."""
    import torch
    from safetensors import safe_open
    path = os.path.abspath(path)
    config = _config(path)
    file = os.path.join(path, CONFIG_FILE)
    rank, scale = _scale(config, file)
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, above max_lora_rank={max_rank}")
    _check_target_modules(config, file, targets)
    file = os.path.join(path, WEIGHTS_FILE)
    shapes: dict[str, list] = {}
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                found = module_of(name)
                if found is None:
                    raise ValueError(f"{file}: tensor {name!r} is not a LoRA A/B weight (embedding and other "
                                     "adapter kinds are not implemented)")
                shapes.setdefault(found[0], [None, None])[found[1]] = tuple(f.get_slice(name).get_shape())
                tensor = f.get_tensor(name)
                if not tensor.is_floating_point():
                    raise ValueError(f"{file}: tensor {name!r} is {tensor.dtype}, not floating point")
                if not bool(torch.isfinite(tensor).all()):
                    raise ValueError(f"{file}: tensor {name!r} holds NaN or infinite values")
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read {file}: {exc}") from None
    if not shapes:
        raise ValueError(f"{file} holds no LoRA weights")
    for module, (a, b) in shapes.items():
        if module not in targets:
            pieces = _pieces(targets)
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
