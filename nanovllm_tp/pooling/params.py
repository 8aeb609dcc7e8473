"""Embedding requests: `PoolingParams` (vLLM's names), the pooling a model declares, and the per-request pooling
the scheduler carries. Torch-free (the scheduler and the HTTP process import it); numpy only where a vector is made.

A model's pooling comes from its sentence-transformers files: `modules.json` names the modules, `1_Pooling/
config.json` (or wherever the Pooling module's path points) sets one `pooling_mode_*`, and a `Normalize` module
makes unit vectors. Without them the model is taken as a decoder embedding model: the last token's hidden state,
normalized (vLLM's default). The engine's pooler_config knob (vLLM's dict) overrides the kind and the
normalization. The hidden state is the output of the model's final norm.
"""
import json
import os
from dataclasses import dataclass

from nanovllm_tp.sampling_params import RequestOutputKind
from nanovllm_tp.utils.checks import flag, integer

LAST, MEAN, CLS = "LAST", "MEAN", "CLS"
_MODES = {"pooling_mode_lasttoken": LAST, "pooling_mode_mean_tokens": MEAN, "pooling_mode_cls_token": CLS}
_UNIMPLEMENTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(slots=True)
class PoolingParams:
    """Per-request embedding knobs. normalize: None = as the model says; dimensions: keep the first N features (a
    Matryoshka model only), then normalize; truncate_prompt_tokens: keep the last k prompt tokens (-1:
    max_model_len)."""
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        if self.normalize is not None:
            flag("normalize", self.normalize)
        integer("dimensions", self.dimensions, lo=1, optional=True)
        integer("truncate_prompt_tokens", self.truncate_prompt_tokens, lo=-1, optional=True)
        if self.truncate_prompt_tokens == 0:
            raise ValueError("truncate_prompt_tokens must be -1 (max_model_len) or >= 1, got 0")

    @property
    def output_kind(self) -> RequestOutputKind:
        """An embedding is reported once, whole."""
        return RequestOutputKind.FINAL_ONLY

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last truncate_prompt_tokens tokens (-1: max_model_len), or all of them when unset."""
        keep = self.truncate_prompt_tokens
        return ids if keep is None else ids[-(max_model_len if keep == -1 else keep):]

    def to_dict(self) -> dict:
        return {"normalize": self.normalize, "dimensions": self.dimensions,
                "truncate_prompt_tokens": self.truncate_prompt_tokens}


@dataclass(slots=True)
class Pooling:
    """One request's pooling, resolved against its model: what the scheduler and rank 0 need."""
    kind: str                     # LAST, MEAN or CLS
    normalize: bool
    dimensions: int | None = None

    @property
    def needs_every_token(self) -> bool:
        """Mean and CLS pooling read hidden states a cached prefix would skip: such prompts are computed whole."""
        return self.kind != LAST

    def finish(self, total, num_tokens: int):
        """The embedding (float32 numpy) from the summed hidden states of the pooled tokens."""
        import numpy as np
        v = np.asarray(total, np.float32) / (num_tokens if self.kind == MEAN else 1)
        if self.dimensions is not None:
            v = v[:self.dimensions]
        if self.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return v.astype(np.float32)


@dataclass(slots=True)
class ModelPooling:
    """A model's declared pooling, read once from its directory."""
    kind: str = LAST
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    refused: str | None = None    # why this model cannot embed (a sentence-transformers module not implemented)
    refused_pooling: str | None = None    # a pooling mode not implemented (a pooler_config may choose another)

    @classmethod
    def read(cls, model: str, pooler_config: dict | None = None) -> "ModelPooling":
        """From the model's files, then the engine's pooler_config (its pooling_type and normalize win)."""
        out = cls._from_files(model)
        if pooler_config:
            if "pooling_type" in pooler_config:
                out.kind, out.refused_pooling = pooler_config["pooling_type"], None
            out.normalize = pooler_config.get("normalize", out.normalize)
        return out

    @classmethod
    def _from_files(cls, model: str) -> "ModelPooling":
        if not os.path.isdir(model):
            return cls()
        config = _json(os.path.join(model, "config.json")) or {}
        dims = config.get("matryoshka_dimensions")
        out = cls(matryoshka=bool(dims) or config.get("is_matryoshka") is True,
                  matryoshka_dimensions=tuple(dims) if isinstance(dims, list) and dims else None)
        modules = _json(os.path.join(model, "modules.json"))
        if not isinstance(modules, list):
            return out
        out.normalize = False
        for m in modules:
            kind = str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else repr(m)
            if kind not in _KNOWN_MODULES:
                out.refused = f"its sentence-transformers module {kind!r} is not implemented"
            elif kind == "Normalize":
                out.normalize = True
            elif kind == "Pooling":
                out._read_pooling(_json(os.path.join(model, str(m.get("path", "")), "config.json")) or {})
        return out

    def _read_pooling(self, config: dict) -> None:
        modes = [_MODES[k] for k in _MODES if config.get(k)]
        others = [k for k in _UNIMPLEMENTED_MODES if config.get(k)]
        if others or len(modes) != 1:
            self.refused_pooling = (f"its pooling {', '.join(others)} is not implemented" if others else
                            f"its pooling config sets {len(modes)} modes (one of {sorted(_MODES)} is implemented)")
        else:
            self.kind = modes[0]

    def resolve(self, params: PoolingParams, hidden_size: int) -> Pooling:
        """The request's pooling; ValueError for what this model cannot do (as vLLM refuses it)."""
        if self.refused or self.refused_pooling:
            raise ValueError(f"this model cannot embed: {self.refused or self.refused_pooling}" +
                             ("" if self.refused else " (the pooler_config knob may choose another pooling)"))
        params.validate()
        d = params.dimensions
        if d is not None:
            if not self.matryoshka:
                raise ValueError("dimensions: this model does not declare Matryoshka embeddings (config.json's "
                                 "matryoshka_dimensions or is_matryoshka), so truncated embeddings would be poor")
            if self.matryoshka_dimensions is not None and d not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions must be one of this model's {list(self.matryoshka_dimensions)}, got {d}")
            if d > hidden_size:
                raise ValueError(f"dimensions must be <= the model's hidden size {hidden_size}, got {d}")
        normalize = self.normalize if params.normalize is None else params.normalize
        return Pooling(self.kind, normalize, d)


def check_pooler_config(config: dict | None) -> None:
    """The pooler_config knob: vLLM's names, the parts implemented here; ValueError/TypeError naming the key."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise TypeError(f"pooler_config must be a dict, got {type(config).__name__}")
    unknown = sorted(set(config) - {"pooling_type", "normalize"})
    if unknown:
        raise ValueError(f"pooler_config: {unknown} not implemented (pooling_type and normalize are)")
    if "pooling_type" in config and config["pooling_type"] not in (LAST, MEAN, CLS):
        raise ValueError(f"pooler_config: pooling_type must be one of {[LAST, MEAN, CLS]}, "
                         f"got {config['pooling_type']!r}")
    if "normalize" in config:
        flag("pooler_config.normalize", config["normalize"])


def _json(path: str):
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except ValueError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
