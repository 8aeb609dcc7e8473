"""Chat tools on the server: the schema that enforces tool_choice "required" or a named function, the reading of
what a model wrote under "auto" (Hermes `<tool_call>` JSON, as Qwen2.5/Qwen3/SmolLM2-family templates ask for,
and Llama 3.x JSON calls), and OpenAI's `delta.tool_calls` for streams.

"required": the output is constrained to a JSON array of {"name": a tool's name, "parameters": its arguments};
a named function: to that function's arguments alone. Either way each call's arguments are streamed as the
model writes them, in pieces that concatenate to the arguments' JSON. Under "auto" text streams as content until
a tool call begins; each call is sent whole once its JSON is complete. --tool-call-parser (vLLM's names: hermes,
llama3_json) makes "auto" read one of the two formats only; --no-enable-auto-tool-choice refuses "auto" (vLLM's
behaviour without --enable-auto-tool-choice).
"""
import json
import re
import secrets
from dataclasses import dataclass, field

from nanovllm_tp.structured.schema import rewrite_subschemas

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# --tool-call-parser: vLLM's names of the formats "auto" reads (None: either); llama4_json is vLLM's other name
# for its Llama 3 JSON parser
TOOL_PARSERS = {"hermes": "<tool_call>{...}</tool_call> blocks", "llama3_json": "JSON calls",
                "llama4_json": "JSON calls"}
PYTHON_TAG = "<|python_tag|>"          # Llama 3.x: what a JSON tool call may start with
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


@dataclass(slots=True)
class ToolMode:
    """A chat request's tools (their `function` objects) and what tool_choice makes of them."""
    functions: list[dict]
    choice: str                        # "none", "auto", "required" or "named"
    name: str | None = None            # the named function
    parallel: bool = True              # more than one call per answer ("required")
    parser: str | None = None          # the format "auto" reads (TOOL_PARSERS; None: either)

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def schema(self) -> dict | None:
        """The JSON schema the output must follow (None: the model writes freely)."""
        params = {f["name"]: f.get("parameters") or {"type": "object"} for f in self.functions}
        if self.choice == "named":
            return params[self.name]
        if self.choice != "required":
            return None
        # Each tool's parameters go under the wrapper's $defs, their own "#..." references re-rooted there, so
        # that "#/$defs/X" in a tool (pydantic's shape) and "#" (recursion) still mean that tool's schema.
        defs = {f"tool{i}": rebase_refs(p, f"#/$defs/tool{i}") for i, p in enumerate(params.values())}
        items = [{"type": "object", "properties": {"name": {"const": n}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
                  "required": ["name", "parameters"], "additionalProperties": False} for i, n in enumerate(params)]
        return {"$defs": defs, "type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": items[0] if len(items) == 1 else {"anyOf": items}}

    def parse(self, text: str) -> tuple[str | None, list[tuple[str, str]]]:
        """(content, [(name, arguments JSON)]) of a whole answer."""
        if self.choice == "named":
            return None, [(self.name, text.strip())]
        if self.choice == "required":
            return None, [(c.name, c.args) for c in scan_calls(text) if c.name is not None]
        if self.choice == "auto":
            return parse_auto(text, self.names, self.parser)
        return text, []

    def streamer(self) -> "ToolStreamer":
        return ToolStreamer(self)


def rebase_refs(schema, root: str):
    """A copy of `schema` with every local reference ("#", "#/...") made relative to `root` (where the schema
    is placed inside another one); other references are left for the schema compiler to judge."""
    if isinstance(schema, list):
        return [rebase_refs(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = rewrite_subschemas(schema, lambda sub, key: rebase_refs(sub, root))    # a "$ref" inside data stays
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def check_tool_parser(parser: str | None, auto: bool) -> None:
    """--tool-call-parser's name and --enable-auto-tool-choice together: ValueError in one line."""
    if parser is None:
        return
    if parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {parser!r} is not implemented: this server reads "
                         + ", ".join(f"{name} ({what})" for name, what in TOOL_PARSERS.items()))
    if not auto:
        raise ValueError("--tool-call-parser is the format tool_choice \"auto\" reads, which "
                         "--no-enable-auto-tool-choice turns off")


def parse_auto(text: str, names: set[str], parser: str | None = None) -> tuple[str | None, list[tuple[str, str]]]:
    """Hermes blocks (a last one may lack its closing tag), else one or more Llama 3 JSON calls (`;`-separated,
    maybe after <|python_tag|>); calls to unknown tools or unreadable JSON leave the text as content. `parser`:
    hermes reads the blocks only, llama3_json / llama4_json the JSON calls only."""
    if parser is not None and parser != "hermes":
        return _json_calls(text, names)
    if HERMES_OPEN in text:
        calls = [_call_of(m.group(1), names) for m in _HERMES.finditer(text)]
        if calls and all(calls):
            content = _HERMES.sub("", text).strip()
            return content or None, calls
        return text, []
    return _json_calls(text, names) if parser is None else (text, [])


def _json_calls(text: str, names: set[str]) -> tuple[str | None, list[tuple[str, str]]]:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if body.startswith("{"):
        calls = [_call_of(part, names) for part in body.split(";") if part.strip()]
        if calls and all(calls):
            return None, calls
    return text, []


def _call_of(raw: str, names: set[str]) -> tuple[str, str] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):            # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return obj["name"], json.dumps(args, ensure_ascii=False)


@dataclass(slots=True)
class ScannedCall:
    name: str | None = None
    args: str = ""                     # the arguments' JSON text so far (a prefix of the final text)
    args_done: bool = False


def scan_calls(text: str) -> list[ScannedCall]:
    """The calls of a (possibly partial) `[{"name": ..., "parameters": {...}}, ...]` text, keys in any order:
    each name once its string is complete, each call's arguments text as far as it goes."""
    calls: list[ScannedCall] = []
    depth, in_str, esc, str_start = 0, False, False, 0
    mode, key, value_start, value_open = None, None, None, ""
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 2 and mode == "key":
                    key, mode = json.loads(text[str_start:i + 1]), "colon"
                elif depth == 2 and mode == "value" and value_open == '"':
                    _close(calls[-1], key, text[value_start:i + 1])
                    mode = "after"
            continue
        if mode == "value" and value_start is None and not ch.isspace():
            value_start, value_open = i, ch
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            depth += 1
            if depth == 2 and ch == "{":
                calls.append(ScannedCall())
                mode = "key"
        elif ch in "}]":
            depth -= 1
            if depth == 2 and mode == "value" and value_open in "{[":
                _close(calls[-1], key, text[value_start:i + 1])
                mode = "after"
            elif depth == 1 and mode == "value":
                _close(calls[-1], key, text[value_start:i].rstrip())
                mode = None
        elif depth == 2 and ch == ":" and mode == "colon":
            mode, value_start = "value", None
        elif depth == 2 and ch == ",":
            if mode == "value":
                _close(calls[-1], key, text[value_start:i].rstrip())
            mode = "key"
    if mode == "value" and value_start is not None and key in ("parameters", "arguments"):
        calls[-1].args = text[value_start:]         # in progress: what there is of it
    return calls


def _close(call: ScannedCall, key: str | None, value: str) -> None:
    if key == "name":
        call.name = json.loads(value)
    elif key in ("parameters", "arguments"):
        call.args, call.args_done = value, True


@dataclass(slots=True)
class ToolStreamer:
    """Turns a streamed answer's text deltas into OpenAI delta content and delta.tool_calls."""
    mode: ToolMode
    text: str = ""
    sent_content: int = 0              # characters of text sent as content (auto)
    ids: list[str] = field(default_factory=list)
    sent_args: list[int] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls deltas) for the new text; `finished`: the answer is complete."""
        self.text += delta
        choice = self.mode.choice
        if choice == "none":
            return delta, []
        if choice == "named":
            return "", self._calls([ScannedCall(self.mode.name, self.text.lstrip(), finished)])
        if choice == "required":
            return "", self._calls(scan_calls(self.text))
        return self._auto(finished)

    def _calls(self, calls: list[ScannedCall]) -> list[dict]:
        out = []
        for i, c in enumerate(calls):
            if c.name is None:
                break                             # a call is announced once its name is known
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                out.append({"index": i, "id": self.ids[i], "type": "function",
                            "function": {"name": c.name, "arguments": c.args}})
            elif len(c.args) > self.sent_args[i]:
                out.append({"index": i, "function": {"arguments": c.args[self.sent_args[i]:]}})
            self.sent_args[i] = len(c.args)
        return out

    def _auto(self, finished: bool) -> tuple[str, list[dict]]:
        text, parser = self.text, self.mode.parser
        start = text.find(HERMES_OPEN) if parser in (None, "hermes") else -1
        json_like = parser != "hermes" and text.lstrip().startswith(("{", PYTHON_TAG[:2]))
        if not finished:
            if start < 0 and not json_like:       # content, but not a tag's beginning at the end
                safe = len(text) - (_tag_prefix(text) if parser in (None, "hermes") else 0)
                content, self.sent_content = text[self.sent_content:safe], max(self.sent_content, safe)
                return content, []
            if start >= 0:
                content = text[self.sent_content:start] if start > self.sent_content else ""
                self.sent_content = max(self.sent_content, start)
                done = [m for m in _HERMES.finditer(text, start) if m.group(0).endswith(HERMES_CLOSE)]
                calls = [_call_of(m.group(1), self.mode.names) for m in done]
                return content, self._whole(calls)
            return "", []
        content, calls = parse_auto(text[self.sent_content:], self.mode.names, parser)
        head = text[self.sent_content:start] if start > self.sent_content else ""
        self.sent_content = len(text)
        if not calls:
            return content or "", []
        return head, self._whole(calls)

    def _whole(self, calls: list) -> list[dict]:
        out = []
        for i, c in enumerate(calls):
            if c is None or i < len(self.ids):
                continue
            self.ids.append(new_call_id())
            self.sent_args.append(len(c[1]))
            out.append({"index": i, "id": self.ids[i], "type": "function",
                        "function": {"name": c[0], "arguments": c[1]}})
        return out

    @property
    def called(self) -> bool:
        return bool(self.ids)


def _tag_prefix(text: str) -> int:
    """The length of the longest end of text that begins HERMES_OPEN (held back: it may become the tag)."""
    for n in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-n:]):
            return n
    return 0
