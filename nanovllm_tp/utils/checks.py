"""The value checks of user input, one rule each, shared by SamplingParams and the engine knobs: strict types
(a bool is not a number, a float is not an int), then the range, in messages that name the field."""
import difflib
import json
import math

_FLOAT32_MAX = 3.4028234663852886e38


def number(name: str, value, lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite float32 number, got {value}")
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def integer(name: str, value, lo: int | None = None, hi: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if optional else ''}, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value}")


def flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def did_you_mean(name: str, known) -> str:
    """"; did you mean 'x'?" with the known name closest to an unknown one, or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def json_object(path: str) -> dict:
    """The JSON object a file holds (a config the user pointed at); ValueError naming the file otherwise."""
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return value
