"""The embedding tests' reference and model directories: transformers' AutoModel last_hidden_state, pooled and
normalized by hand; copies of the tiny checkpoint with sentence-transformers pooling files or a Matryoshka flag."""
import json
import os
import shutil

import torch


def hf_embedding(model, ids: list[int], kind: str = "LAST", normalize: bool = True,
                 dimensions: int | None = None) -> torch.Tensor:
    """`model`: transformers' AutoModel (fp32); the pooled final hidden state of the prompt."""
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    if dimensions is not None:
        v = v[:dimensions]
    return torch.nn.functional.normalize(v, dim=-1) if normalize else v


def cosine(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float(a @ b / (a.norm() * b.norm()))


def model_copy(src: str, dst: str, pooling_mode: str | None = None, normalize: bool = True,
               config_extra: dict | None = None) -> str:
    """A copy of the checkpoint directory `src`; `pooling_mode` (pooling_mode_mean_tokens, pooling_mode_cls_token,
    pooling_mode_lasttoken): sentence-transformers files (modules.json, 1_Pooling/config.json, a Normalize module
    when `normalize`); `config_extra`: keys added to config.json."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config_extra:
        with open(path, "w") as f:
            json.dump({**config, **config_extra}, f)
    if pooling_mode is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                   {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
        if normalize:
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                            "type": "sentence_transformers.models.Normalize"})
        with open(os.path.join(dst, "modules.json"), "w") as f:
            json.dump(modules, f)
        os.makedirs(os.path.join(dst, "1_Pooling"))
        modes = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
                 "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens", "pooling_mode_lasttoken")
        with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
            json.dump({"word_embedding_dimension": config["hidden_size"], **{m: m == pooling_mode for m in modes}}, f)
    return dst
