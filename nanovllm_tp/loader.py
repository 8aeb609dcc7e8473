"""safetensors -> parameters. Every rank opens the files lazily and reads only the slices it keeps."""
import glob
import os

from safetensors import safe_open
from torch import nn

from nanovllm_tp.layers.linear import default_weight_loader


def load_model(model: nn.Module, model_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {model_dir!r}")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    loaded_names = set()
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for ckpt_name in f.keys():
                if "rotary_emb.inv_freq" in ckpt_name:
                    continue
                target, shard = ckpt_name, ()
                for piece, (ours, shard_id) in packed.items():
                    if f".{piece}." in ckpt_name:
                        target, shard = ckpt_name.replace(f".{piece}.", f".{ours}."), (shard_id,)
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {ckpt_name!r} in {os.path.basename(path)} has no "
                                     "matching parameter in the model")
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, f.get_slice(ckpt_name), *shard)
                loaded_names.add(target)
    missing = {name for name in params if name not in loaded_names}
    if "lm_head.weight" in missing and model.lm_head.weight is model.model.embed_tokens.weight:
        missing.discard("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks weights for: {sorted(missing)[:8]}")
