"""The building blocks of every request body: strict JSON types (a bool is not a number, a float is not an int,
every integer within 64 bits), the string-or-lists unions (prompts, stop) told apart by a value's shape, and the base
models: unknown fields refused, null as absent, every string valid Unicode."""
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, model_validator
from pydantic_core import PydanticCustomError

INT64 = (-2**63, 2**63 - 1)
Int = Annotated[int, Field(ge=INT64[0], le=INT64[1])]     # strict like every field here: no bools, no floats
TokenKey = Annotated[int, Strict(False), Field(ge=INT64[0], le=INT64[1])]    # a token id as a JSON key ("42")


# The members of the string-or-lists unions below, by the shape of a value: errors come from the member a value
# is meant as (not the first one pydantic tried), and these names are left out of an error's field path.
UNION_MEMBERS = ("a string", "strings", "token ids", "token-id lists", "text parts", "a chat", "a prompt")


def shape_of(value) -> str | None:
    if isinstance(value, str):
        return "a string"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    return {list: "token-id lists", dict: "text parts"}.get(type(first)) or \
        ("token ids" if isinstance(first, (int, float)) else "strings")


Prompt = Annotated[
    Annotated[str, Tag("a string")] | Annotated[list[str], Tag("strings")] | Annotated[list[Int], Tag("token ids")]
    | Annotated[list[list[Int]], Tag("token-id lists")],
    Discriminator(shape_of, custom_error_type="prompt_type", custom_error_message="must be a string, a list of "
                  "strings, a list of token ids or a list of token-id lists")]


Stop = Annotated[Annotated[str, Tag("a string")] | Annotated[list[str], Tag("strings")],
                 Discriminator(lambda v: "strings" if isinstance(v, list) else "a string" if isinstance(v, str) else
                               None, custom_error_type="stop_type",
                               custom_error_message="must be a string or a list of strings")]


_NO_TEXT = {int, float, bool, type(None)}


def _invalid_text(data) -> tuple[str, int] | None:
    """(path, index) of the first string anywhere in the body (keys too) that is not valid Unicode (a lone
    surrogate from a \\ud800 escape), or None. Iterative: a deeply nested body cannot exhaust the stack; a list of
    numbers (token ids) is passed over at C speed."""
    todo = [((), data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            items = [(k, k) for k in value] + list(value.items())
        elif isinstance(value, list) and not set(map(type, value)) <= _NO_TEXT:
            items = enumerate(value)
        else:
            items = ()
        for key, item in items:
            if isinstance(item, (dict, list)):
                todo.append(((*path, key), item))
            elif isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:       # the path as ASCII: a key may be the bad string
                    return ".".join(map(str, (*path, key))).encode("ascii", "backslashreplace").decode(), exc.start
    return None


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """A field sent as null is left out: a declared one takes its default (OpenAI's optional fields are
        nullable), and any other asks for nothing (a message echoed back with its "tool_calls": null)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class TextBody(Body):
    """A request body: every string in it, anywhere, valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        bad = _invalid_text(data)
        if bad is not None:
            raise PydanticCustomError("invalid_unicode", "{param}: not valid Unicode text (a lone surrogate at "
                                      "index {index}); every string must encode as UTF-8",
                                      {"param": bad[0] or "body", "index": bad[1]})
        return data
