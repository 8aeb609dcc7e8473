"""Configuration: every engine knob declared once (engine_config.py: EngineConfig; knobs.py: what `knob(...)`
makes of a declaration), the checks across knobs and against the model (config_checks.py), the model's facts
(model_config.py) and a rank's device, dtype and attention backend (platform.py). Environment variables are read in
nanovllm_tp/envs.py only.

`from nanovllm_tp.config import EngineConfig` (and the other names of engine_config.py) keeps working; they are
imported on first use, so that a light module can import `nanovllm_tp.config.knobs` without the rest."""


def __getattr__(name):
    import importlib
    engine_config = importlib.import_module(f"{__name__}.engine_config")    # not through this function again
    if name in engine_config.__all__:
        return getattr(engine_config, name)
    raise AttributeError(f"module 'nanovllm_tp.config' has no attribute {name!r}")
