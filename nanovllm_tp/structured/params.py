"""StructuredOutputsParams: vLLM's names and rule (exactly one kind of constraint per request). Checked here for
shape only; whether a schema, regex or grammar compiles is the backend's check, also made before the engine
takes the request. Imports nothing heavy (the HTTP process reads it)."""
import json
from dataclasses import dataclass, fields

from nanovllm_tp.utils.checks import flag

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_SPEC_CHARS = 1 << 20        # a schema, regex or grammar longer than this is refused before compiling


@dataclass(slots=True)
class StructuredOutputsParams:
    json: dict | str | None = None           # a JSON schema (a dict, or its text)
    regex: str | None = None                 # the whole output matches it (Rust regex syntax: no look-around)
    choice: list[str] | None = None          # the output is exactly one of these strings
    grammar: str | None = None               # a context-free grammar: GBNF (llama.cpp's ::= rules) or Lark
    json_object: bool | None = None          # any JSON object
    disable_any_whitespace: bool = False     # JSON without whitespace between tokens (else a line break, indent)
    # None: an object that lists properties takes no other unless the schema says so (additionalProperties,
    # patternProperties); True: every object, listed properties or not; False: JSON Schema's open objects
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None    # JSON: the regex whitespace between tokens must match

    def __post_init__(self):
        self.validate()

    @classmethod
    def from_dict(cls, d) -> "StructuredOutputsParams":
        """From a request body's `structured_outputs` (or the wire); unknown keys are a ValueError naming them."""
        if isinstance(d, StructuredOutputsParams):
            return d
        if not isinstance(d, dict):
            raise TypeError(f"structured_outputs must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown or unsupported field(s) {', '.join(map(repr, unknown))} "
                             f"(supported: {', '.join(sorted(known))})")
        return cls(**d)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != f.default}

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) if given else 'none'}")
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise TypeError(f"structured_outputs.json must be a JSON schema (an object), got "
                                f"{type(schema).__name__}")
        elif kind in ("regex", "grammar"):
            _text(f"structured_outputs.{kind}", getattr(self, kind))
        elif kind == "choice":
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise TypeError("structured_outputs.choice must be a non-empty list of strings")
            for c in self.choice:
                _text("each of structured_outputs.choice", c)
        elif self.json_object is not True:
            raise TypeError(f"structured_outputs.json_object must be true, got {self.json_object!r}")
        flag("structured_outputs.disable_any_whitespace", self.disable_any_whitespace)
        if self.disable_additional_properties is not None:
            flag("structured_outputs.disable_additional_properties", self.disable_additional_properties)
        if self.whitespace_pattern is not None:
            _text("structured_outputs.whitespace_pattern", self.whitespace_pattern)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(f"structured_outputs.{kind} is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}")

    @property
    def spec(self) -> str:
        """The constraint as one canonical string (the compile cache's key, with the kind and the options; a JSON
        schema is compiled from it): a schema's keywords sorted, its `properties` in the order given, which is the
        order the answer writes them in."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        if self.kind == "json":
            value = _canonical_schema(value)
        return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))

    @property
    def key(self) -> tuple:
        return (self.kind, self.spec, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


_VALUES = frozenset(("const", "enum", "default", "examples"))      # instances, not schemas: kept as written


def _canonical_schema(node):
    """A JSON schema with every object's keywords sorted, except a `properties` map (property names in the
    schema's order) and the values of keywords that hold instances."""
    if isinstance(node, list):
        return [_canonical_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key in sorted(node):
        value = node[key]
        if key in _VALUES:
            out[key] = value
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: _canonical_schema(sub) for name, sub in value.items()}
        else:
            out[key] = _canonical_schema(value)
    return out


def _text(name: str, value) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{name} cannot be empty")
