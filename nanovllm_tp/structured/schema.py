"""JSON schemas walked: the keywords that hold data or maps of schemas, `rewrite_subschemas` (one object's
subschemas rewritten, for the backend's and the tools' schema rewrites), and a check the grammar backend does not
make: whether the schema's local references let a value end.

`{"$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
"$ref": "#/$defs/A"}` compiles, but every value it describes holds another one inside it: no finite JSON value
matches, and an output would nest until max_tokens. `check_terminates` finds such schemas before any token is
generated.

The rule, a least fixpoint: a local reference can end once its target can end, counting only the references
already known to end. A schema can end unless it certainly cannot: `false`; a reference that cannot end; an
anyOf / oneOf none of whose branches can end, an allOf with a branch that cannot; an object whose required
property cannot end; an array whose required items (minItems, prefixItems) cannot end. Every other keyword
(types, enum, const, formats, bounds) is taken to leave some value, and a schema without a type takes scalars, so the check refuses only what certainly
accepts nothing, and leaves every narrower case to the backend.
"""
from urllib.parse import unquote

MAX_REFS = 512            # schemas with more distinct local references are not checked (the fixpoint is quadratic)


def check_terminates(schema) -> None:
    """ValueError when the schema's references make every value infinite."""
    if not isinstance(schema, dict) or "$ref" not in _text_of_keys(schema):
        return
    refs: dict[str, object] = {}
    _collect(schema, schema, refs)
    if not refs or len(refs) > MAX_REFS:
        return
    ends: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref, target in refs.items():
            if ref not in ends and _can_end(target, ends, refs):
                ends.add(ref)
                changed = True
    if not _can_end(schema, ends, refs):
        stuck = sorted(r for r in refs if r not in ends)
        raise ValueError("the schema accepts no finite JSON value: every value of "
                         f"{', '.join(repr(r) for r in stuck[:3])} must hold another one (a required property or "
                         "item that refers back, with no other way to end)")


def _text_of_keys(schema) -> set:
    """Every key that appears anywhere in the schema (to skip the check when no $ref does)."""
    keys, stack = set(), [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            keys.update(node)
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return keys


# keywords whose values are data, not schemas; keywords whose values map names (any names, "enum" or "$ref" too)
# to schemas
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example"})
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rewrite_subschemas(schema: dict, rewrite) -> dict:
    """A copy of one schema object with rewrite(value, keyword) in place of each keyword's value, the data
    keywords' values kept as written and each schema of a map keyword rewritten under the map's keyword."""
    out = {}
    for key, value in schema.items():
        if key in DATA_KEYWORDS:
            out[key] = value
        elif key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: rewrite(sub, key) for name, sub in value.items()}
        else:
            out[key] = rewrite(value, key)
    return out


def _collect(node, root, refs: dict) -> None:
    """Every local reference (`#` or `#/json/pointer`) the schema uses, with its target (missing: left out)."""
    if isinstance(node, list):
        for item in node:
            _collect(item, root, refs)
        return
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
        target = _resolve(root, ref)
        if target is not _MISSING:
            refs[ref] = target
    for key, value in node.items():
        if key not in DATA_KEYWORDS:
            _collect(value, root, refs)


_MISSING = object()


def _resolve(root, ref: str):
    node = root
    pointer = unquote(ref[1:])
    if not pointer:
        return root
    if not pointer.startswith("/"):
        return _MISSING                      # an anchor: not followed
    for part in pointer[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _can_end(node, ends: set, refs: dict) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in refs and ref not in ends:
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_can_end(b, ends, refs) for b in branches):
            return False
    branches = node.get("allOf")
    if isinstance(branches, list) and not all(_can_end(b, ends, refs) for b in branches):
        return False
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if "enum" in node or "const" in node:
        return True
    if types is not None and types - {"object", "array"}:
        return True                          # a scalar type (or null) always has a value to end with
    if types is None:
        return True                          # no type: any value, a scalar too (as the backend reads it)
    return ("object" in types and _object_can_end(node, ends, refs)) or \
        ("array" in types and _array_can_end(node, ends, refs))


def _object_can_end(node, ends, refs) -> bool:
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    required = node.get("required")
    for name in required if isinstance(required, list) else ():
        if name in props and not _can_end(props[name], ends, refs):
            return False
    return True


def _array_can_end(node, ends, refs) -> bool:
    need = node.get("minItems", 0)
    need = need if isinstance(need, int) and not isinstance(need, bool) else 0
    prefix = node.get("prefixItems")
    prefix = prefix if isinstance(prefix, list) else []
    for item in prefix[:need]:
        if not _can_end(item, ends, refs):
            return False
    if need > len(prefix) and "items" in node and not _can_end(node["items"], ends, refs):
        return False
    return True
