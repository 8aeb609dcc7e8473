"""The generation_config knob (vLLM's --generation-config): the request defaults a model's generation_config.json
gives. `auto` reads the model's own file, a directory reads the file there, `vllm` reads none. Of the file, only
vLLM's sampling fields count, each where the file sets it: temperature, top_p, top_k, min_p, repetition_penalty,
and max_new_tokens, which becomes max_tokens. A request that leaves such a field unset gets the file's value
(the server's bodies, `LLM.generate` without sampling parameters, `LLM.get_default_sampling_params()`); a value a
request gives wins. do_sample is not read (as in vLLM): a file's temperature applies whatever do_sample says."""
import os

from nanovllm_tp.utils import checks

FILE = "generation_config.json"
# the file's field -> SamplingParams' field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MODES = ("auto", "vllm")


def _folder(config) -> str | None:
    """The directory whose generation_config.json gives the defaults, or None (vllm; a model file)."""
    if config.generation_config == "vllm":
        return None
    if config.generation_config == "auto":
        return config.model if os.path.isdir(config.model) else os.path.dirname(config.model)
    return config.generation_config


def check_generation_config(config) -> None:
    """generation_config settled (a directory made absolute) and its defaults read once, so that a bad file is
    refused before any rank starts: ValueError naming the file and the field."""
    value = config.generation_config
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"generation_config must be 'auto', 'vllm' or a directory, got {type(value).__name__}")
    value = os.fspath(value)
    if value not in MODES:
        path = os.path.abspath(os.path.expanduser(value))
        if not os.path.isdir(path):
            raise ValueError(f"generation_config {value!r} is not 'auto', 'vllm' or a directory")
        if not os.path.isfile(os.path.join(path, FILE)):
            raise ValueError(f"generation_config {value!r}: the directory holds no {FILE}")
        value = path
    config.generation_config = value
    sampling_defaults(config)


def sampling_defaults(config) -> dict:
    """{SamplingParams field: value} of the fields the file sets (empty: vllm, or no file); each checked as
    SamplingParams checks it (ValueError / TypeError naming the file)."""
    folder = _folder(config)
    path = os.path.join(folder, FILE) if folder else None
    if path is None or not os.path.isfile(path):
        return {}
    try:
        data = checks.json_object(path)
    except ValueError as exc:
        raise ValueError(f"{exc}; --generation-config vllm does not read it") from None
    defaults = {FIELDS[k]: v for k, v in data.items() if k in FIELDS and v is not None}
    from nanovllm_tp.sampling_params import SamplingParams
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{path}: {exc} (--generation-config vllm does not read the file)") from None
    return defaults
