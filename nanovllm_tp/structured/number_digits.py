"""Bounds on the digits of JSON numbers: a JSON constraint's number may not write digits until max_tokens.

llguidance's JSON grammars take any number of digits in a number's integer part, fraction and exponent (a bound
on the value bounds only the integer part, and a `number` without bounds has none), so a sampled answer can
write `1111...` until max_tokens and end as invalid JSON. llama.cpp's JSON-schema grammars hold an integer part
and a fraction to 16 digits each; here the same bounds hold, and an exponent takes at most 3 digits (a double's
exponent has at most 3: 1e308 is the largest). They are applied to the grammar's token mask, outside
llguidance: each sequence follows its output lexically (`NumberDigits`: outside a string, inside one, or in a
number's integer part, fraction or exponent with the digits written so far), and while it is in a number part,
tokens whose leading digits would take that part past its bound are masked out (`TokenDigits`). So every JSON
value is covered, `json_object`'s and a schema's open values too, and the grammar itself is unchanged: a number
can always end (with `.`, `e`, `,`, `}`, `]` or blanks) where it could before.

A schema that writes a number with more digits (a bound such as 1e17 or 1e-20, a `const`, an `enum` value)
raises the bound on that side to one digit past it for the whole constraint (`DigitLimits.of_schema`), so no
value the schema asks for is cut. A token's digits after its first run of digits are not counted at the step
that samples it (the tokenizers in use hold at most a few digits in a token): they count from the next step.
"""
import json
from dataclasses import dataclass
from decimal import Decimal

import numpy as np

INTEGER_DIGITS = 16          # llama.cpp's integral-part: [0] | [1-9] [0-9]{0,15}
FRACTION_DIGITS = 16         # llama.cpp's decimal-part: [0-9]{1,16}
EXPONENT_DIGITS = 3          # a double's exponent: at most 308

# lexical modes of a JSON text
OUTSIDE, STRING, ESCAPE, INTEGER, FRACTION, EXPONENT = range(6)
_DIGITS = frozenset(b"0123456789")


@dataclass(slots=True, frozen=True)
class DigitLimits:
    integer: int = INTEGER_DIGITS
    fraction: int = FRACTION_DIGITS
    exponent: int = EXPONENT_DIGITS

    @classmethod
    def of_schema(cls, schema) -> "DigitLimits":
        """The default bounds, each raised to one digit past the longest that a number written in the schema
        (any keyword's value: bounds, const, enum, multipleOf) has on that side, so that no value the schema
        asks for (one just past an exclusive bound too) is cut."""
        integer, fraction = INTEGER_DIGITS, FRACTION_DIGITS
        stack = [schema]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                stack.extend(node.values())
            elif isinstance(node, list):
                stack.extend(node)
            elif isinstance(node, (int, float)) and not isinstance(node, bool):
                whole, part = _plain_digits(node)
                integer, fraction = max(integer, whole + 1), max(fraction, part + 1)
        return cls(integer, fraction, EXPONENT_DIGITS)

    def of_mode(self, mode: int) -> int:
        return self.integer if mode == INTEGER else self.fraction if mode == FRACTION else self.exponent


def _plain_digits(value) -> tuple[int, int]:
    """Digits of the integer part and of the fraction of a number written without an exponent."""
    if isinstance(value, int):
        return len(str(abs(value))), 0
    if value != value or value in (float("inf"), float("-inf")):
        return 0, 0
    whole, _, part = format(abs(Decimal(repr(value))), "f").partition(".")
    return len(whole), len(part.rstrip("0"))


def limits_of(kind: str, spec: str) -> DigitLimits | None:
    """The bounds of a constraint's numbers: JSON kinds only (a regex or a grammar says what it takes)."""
    if kind == "json_object":
        return DigitLimits()
    if kind == "json":
        return DigitLimits.of_schema(json.loads(spec))
    return None


class TokenDigits:
    """Each token's bytes and the digits it starts with (after at most one sign, as an exponent may), and per
    number of digits a part still has room for, the bitmask of the tokens that fit (built on first use)."""
    __slots__ = ("data", "lead", "words", "_masks", "widest")

    def __init__(self, token_bytes: list[bytes], words: int):
        self.data, self.words = token_bytes, words
        lead = np.zeros(words * 32, np.int32)
        for t, data in enumerate(token_bytes):
            start = 1 if data[:1] in (b"+", b"-") else 0
            end = start
            while end < len(data) and data[end] in _DIGITS:
                end += 1
            lead[t] = end - start
        self.lead = lead
        self.widest = int(lead.max(initial=0))
        self._masks: dict[int, np.ndarray] = {}

    def fitting(self, room: int) -> np.ndarray | None:
        """The bitmask ([words] int32) of the tokens that start with at most `room` digits; None when all do."""
        room = max(room, 0)
        if room >= self.widest:
            return None
        mask = self._masks.get(room)
        if mask is None:
            bits = np.packbits(self.lead <= room, bitorder="little")
            mask = self._masks[room] = bits.view("<i4").astype(np.int32)
        return mask


@dataclass(slots=True)
class NumberDigits:
    """One sequence's place in its JSON output: the lexical mode and the digits of the number part it is in,
    after each output token (so that a rollback is a truncation)."""
    limits: DigitLimits
    tokens: TokenDigits
    states: list

    @classmethod
    def start(cls, limits: DigitLimits, tokens: TokenDigits) -> "NumberDigits":
        return cls(limits, tokens, [(OUTSIDE, 0)])

    def push(self, token: int) -> None:
        mode, count = self.states[-1]
        data = self.tokens.data[token] if 0 <= token < len(self.tokens.data) else b""
        for byte in data:
            mode, count = _step(mode, count, byte)
        self.states.append((mode, count))

    def pop(self, count: int) -> None:
        del self.states[len(self.states) - count:]

    def restrict(self, row: np.ndarray) -> None:
        """Masks out of `row` the tokens that would take the current number part past its bound."""
        mode, count = self.states[-1]
        if mode in (INTEGER, FRACTION, EXPONENT):
            fitting = self.tokens.fitting(self.limits.of_mode(mode) - count)
            if fitting is not None:
                row &= fitting


def _step(mode: int, count: int, byte: int) -> tuple[int, int]:
    if mode == STRING:
        return (ESCAPE, 0) if byte == 0x5C else (OUTSIDE, 0) if byte == 0x22 else (STRING, 0)
    if mode == ESCAPE:
        return STRING, 0
    if byte in _DIGITS and mode in (INTEGER, FRACTION, EXPONENT):
        return mode, count + 1
    if mode == INTEGER and byte == 0x2E:                        # .
        return FRACTION, 0
    if mode in (INTEGER, FRACTION) and byte in (0x65, 0x45):    # e E
        return EXPONENT, 0
    if mode == EXPONENT and byte in (0x2B, 0x2D) and count == 0:
        return EXPONENT, 0
    # outside a string and a number (a number ends at any other byte)
    if byte == 0x22:
        return STRING, 0
    if byte in _DIGITS:
        return INTEGER, 1
    if byte == 0x2D:                                            # -
        return INTEGER, 0
    return OUTSIDE, 0
