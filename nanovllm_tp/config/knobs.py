"""An engine knob is one declaration: a field of EngineConfig made with `knob(...)` (type from its annotation,
default, help, flags, range or choices). From the declarations come:

- `check_knobs(config)`: the type and range checks of every knob (ValueError/TypeError naming it);
- `config_from_kwargs(cls, model, kwargs)`: what `LLM(model, **kwargs)` builds, unknown names refused with the
  closest known one;
- `add_args(cls, parser)` / `kwargs_of(cls, args)` / `argv_of(cls, args)`: every CLI's engine flags, their
  parsed values as LLM keyword arguments, and back into flags (a child server started with the same engine);
  config.py's add_engine_args / engine_kwargs / engine_argv apply them to EngineConfig.

So a new knob is a field; LLM(...), generate, the benchmarks and serve take it without another line.
"""
import argparse
import json
import os
import types
import typing
from dataclasses import MISSING, dataclass, field, fields

from nanovllm_tp.config.flag_groups import group_for, help_order
from nanovllm_tp.utils import checks


@dataclass(frozen=True, slots=True)
class Knob:
    help: str
    flags: tuple[str, ...] = ()        # CLI option strings; default: --the-field-name
    choices: tuple | None = None       # strings: the values allowed
    minimum: float | None = None       # numbers: the smallest value allowed
    maximum: float | None = None
    open_minimum: bool = False         # the minimum itself is refused
    path: bool = False                 # a str field that also takes an os.PathLike
    metavar: str | None = None


def knob(default=MISSING, *, help: str, default_factory=MISSING, **options):
    """A field of EngineConfig that is an engine knob (see the module's docstring)."""
    return field(default=default, default_factory=default_factory, metadata={"knob": Knob(help=help, **options)})


def knob_fields(cls) -> list:
    return [f for f in fields(cls) if "knob" in f.metadata]


def _base_type(annotation) -> tuple[type, bool]:
    """(the type, whether None is allowed) of `T` or `T | None`."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    return annotation, False


def check_value(name: str, value, f) -> None:
    """The declared checks of one knob: type (strict: no bool for a number, no float for an int), range,
    choices."""
    k: Knob = f.metadata["knob"]
    kind, optional = _base_type(f.type)
    if kind is int:
        checks.integer(name, value, k.minimum, k.maximum, optional)
    elif kind is float:
        if not (value is None and optional):
            checks.number(name, value, k.minimum, k.maximum, k.open_minimum)
    elif kind is bool:
        checks.flag(name, value)
    elif kind is dict:
        if not (value is None and optional) and not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict{' or None' if optional else ''}, got {type(value).__name__}")
    elif kind is list:
        if not (value is None and optional) and not (isinstance(value, list) and
                                                     all(isinstance(v, str) for v in value)):
            raise TypeError(f"{name} must be a list of strings{' or None' if optional else ''}, got {value!r}")
    elif not (value is None and optional):
        if not isinstance(value, (str, os.PathLike) if k.path else str):
            raise TypeError(f"{name} must be a {'path' if k.path else 'string'}{' or None' if optional else ''}, "
                            f"got {type(value).__name__}")
        if k.choices is not None and value not in k.choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, k.choices))}, got {value!r}")


def check_knobs(config) -> None:
    for f in knob_fields(type(config)):
        check_value(f.name, getattr(config, f.name), f)


# vLLM names whose feature is not an engine argument here, and where it is
NOT_ENGINE_ARGUMENTS = {
    "data_parallel_size": "data-parallel replicas are a server feature: `nanovllm-tp serve MODEL "
                          "--data-parallel-size D` (one endpoint, requests routed among D engines); offline, run one "
                          "LLM per process",
}


def config_from_kwargs(cls, model, kwargs: dict):
    """cls(model=model, **kwargs), with an unknown keyword refused by name and the closest knob offered."""
    names = [f.name for f in knob_fields(cls)]
    for key in kwargs:
        if key in NOT_ENGINE_ARGUMENTS and key not in names:
            raise TypeError(f"{key!r} is not an engine argument: {NOT_ENGINE_ARGUMENTS[key]}")
        if key not in names or key == "model":
            hint = checks.did_you_mean(key, names) or f"; the engine's knobs: {', '.join(names)}"
            raise TypeError(f"unknown engine argument {key!r}{hint}")
    return cls(model=model, **kwargs)


# ---- command lines ----

def _default(f):
    return f.default_factory() if f.default_factory is not MISSING else f.default


def _flags(f) -> tuple[str, ...]:
    return f.metadata["knob"].flags or ("--" + f.name.replace("_", "-"),)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object is needed, got {text!r}")
    return value


def _help(k: Knob, kind, default) -> str:
    """A knob's help with its default: on/off for a switch, the value, or "none" where the help does not say."""
    if kind is bool:
        return f"{k.help} (default: {'on' if default else 'off'})"
    if default is None:
        return k.help if "default" in k.help else f"{k.help} (default: none)"
    return f"{k.help} (default: {default})"


def add_args(config_cls, parser: argparse.ArgumentParser, title: str = "engine") -> None:
    """Every knob of config_cls as a flag of `parser` (dest: the field's name), each in its help group
    (flag_groups.py: model, server, parallelism, ...; a knob in none: "other {title} flags"). `--model` is
    optional here: the commands run the embedded tiny checkpoint without it."""
    for f in sorted(knob_fields(config_cls), key=lambda f: help_order(f.name)):
        k, (kind, _) = f.metadata["knob"], _base_type(f.type)
        default = None if f.name == "model" else _default(f)
        help_text = _help(k, kind, default)
        group = group_for(parser, f.name, f"other {title} flags")
        if kind is bool:
            group.add_argument(*_flags(f), dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        elif kind is list:      # several values after one flag (vLLM's --lora-modules a=x b=y)
            group.add_argument(*_flags(f), dest=f.name, nargs="+", default=default, metavar=k.metavar,
                               help=help_text)
        else:
            group.add_argument(*_flags(f), dest=f.name, type=_json_object if kind is dict else kind,
                               default=default, choices=k.choices, metavar=k.metavar or ("JSON" if kind is dict else None),
                               help=help_text)


def kwargs_of(config_cls, args: argparse.Namespace) -> dict:
    """The parsed engine flags as keyword arguments of LLM (model included)."""
    return {f.name: getattr(args, f.name) for f in knob_fields(config_cls)}


def argv_of(config_cls, args: argparse.Namespace) -> list[str]:
    """The engine flags of `args` that differ from their defaults, as a command line that parses back to them."""
    argv = []
    for f in knob_fields(config_cls):
        value, flag = getattr(args, f.name), _flags(f)[0]
        if value == (None if f.name == "model" else _default(f)):
            continue
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv
