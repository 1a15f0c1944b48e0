"""The shortest document a constraint allows, where it can be computed: what the server compares
with a request's `max_tokens` to warn that its output will end cut off.

`shortest_json_document(schema)` builds the compact JSON document of a schema with the fewest
characters: required properties only, `minItems` items, `minLength` characters, the number
closest to 0 in range, `true` for a boolean, the shortest `enum`/`const` value, the shortest
`anyOf`/`oneOf` branch, `$ref`s within the schema followed (a cycle through required properties
allows no finite document). Where it cannot know the length exactly it errs short (a lower
bound), so a warning built on it is never a false alarm: a string's `pattern` counts only its
`minLength`, `allOf` takes its longest part, `not`/`if`/`then`/`else`/`dependent*` are not read,
and a string is filled with one repeated character (which tokenizes into fewer tokens than text).
None where there is no document or the walk is past `MAX_DEPTH` or `MAX_STEPS`; a document longer than
`max_chars` is cut there (still a lower bound).
"""

import json
import math
from typing import Any

from jaxpaged.sampling_params import StructuredOutputsParams

MAX_DEPTH = 64  # nested schemas followed; deeper: None
MAX_STEPS = 100_000  # schemas visited (`$ref`s can make a small schema an exponential walk); more: None
_FORMATS = {  # the shortest value of each string format JSON schema names
    "date": "2000-01-01",
    "time": "00:00:00Z",
    "date-time": "2000-01-01T00:00:00Z",
    "email": "a@b.c",
    "uuid": "00000000-0000-0000-0000-000000000000",
    "ipv4": "0.0.0.0",
    "ipv6": "::",
    "uri": "a:",
}


def shortest_document(constraint: StructuredOutputsParams, max_chars: int = 100_000) -> str | None:
    """The shortest output `constraint` allows where it can be computed (a JSON schema, `json_object`,
    `choice`), else None (a regex, a grammar, a structural tag)."""
    if constraint.json is not None:
        try:
            schema = json.loads(constraint.json) if isinstance(constraint.json, str) else constraint.json
        except ValueError:
            return None
        return shortest_json_document(schema, max_chars)
    if constraint.json_object:
        return "{}"
    if constraint.choice:
        return min(constraint.choice, key=len)[:max_chars]
    return None


def shortest_json_document(schema: Any, max_chars: int = 100_000) -> str | None:
    """The shortest compact JSON document `schema` accepts (a lower bound where not exact; see the
    module), cut at `max_chars`; None where there is none or it cannot be computed."""
    walker = _Walker(schema, max_chars)
    try:
        document = walker.shortest(schema, 0, frozenset())
    except (_Unknown, TypeError, ValueError, AttributeError):  # malformed parts: not computable
        return None
    return None if document is None else document[:max_chars]


class _Unknown(Exception):
    """The schema is past what the walk follows (depth, a `$ref` outside the schema)."""


class _Walker:
    def __init__(self, root: Any, max_chars: int):
        self.root, self.max_chars = root, max_chars
        self.steps = 0

    def shortest(self, schema: Any, depth: int, refs: frozenset) -> str | None:
        self.steps += 1
        if depth > MAX_DEPTH or self.steps > MAX_STEPS:
            raise _Unknown
        if schema is True or schema == {}:
            return "0"
        if not isinstance(schema, dict):
            return None  # false (or not a schema): nothing is accepted
        if "$ref" in schema:
            ref = schema["$ref"]
            if ref in refs:
                return None  # a cycle through required parts: no finite document
            return self.shortest(self._resolve(ref), depth + 1, refs | {ref})
        if "const" in schema:
            return _dumps(schema["const"])
        if "enum" in schema:
            return _shortest(_dumps(v) for v in schema["enum"])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                rest = {k: v for k, v in schema.items() if k != key}
                return _shortest(self.shortest(_merge(rest, branch), depth + 1, refs) for branch in schema[key])
        if "allOf" in schema:
            parts = [self.shortest(part, depth + 1, refs) for part in schema["allOf"]]
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            parts.append(self.shortest(rest, depth + 1, refs))
            return None if None in parts else max(parts, key=len)
        types = schema.get("type")
        if isinstance(types, list):
            return _shortest(self.shortest({**schema, "type": t}, depth + 1, refs) for t in types)
        if types is None:
            types = _implied_type(schema)
        return self._of_type(types, schema, depth, refs)

    def _of_type(self, kind: str | None, schema: dict, depth: int, refs: frozenset) -> str | None:
        if kind == "object":
            return self._object(schema, depth, refs)
        if kind == "array":
            return self._array(schema, depth, refs)
        if kind == "string":
            text = _FORMATS.get(schema.get("format"), "")
            return _dumps(text + "a" * max(0, min(int(schema.get("minLength", 0)), self.max_chars) - len(text)))
        if kind in ("integer", "number"):
            return _number(schema, kind == "integer")
        if kind == "boolean":
            return "true"
        if kind == "null":
            return "null"
        return "0" if kind is None else None

    def _object(self, schema: dict, depth: int, refs: frozenset) -> str | None:
        properties = schema.get("properties", {})
        other = schema.get("additionalProperties", True)
        members, length = [], 2
        for name in schema.get("required", []):
            value = self.shortest(properties.get(name, other), depth + 1, refs)
            if value is None:
                return None
            members.append(f"{_dumps(name)}:{value}")
            length += len(members[-1]) + 1
            if length > self.max_chars:
                break
        return "{" + ",".join(members) + "}"

    def _array(self, schema: dict, depth: int, refs: frozenset) -> str | None:
        prefix = schema.get("prefixItems", [])
        items = schema.get("items", True)
        if isinstance(items, list):  # draft 4-7 tuples
            prefix, items = items, schema.get("additionalItems", True)
        members, length = [], 2
        for i in range(int(schema.get("minItems", 0))):
            value = self.shortest(prefix[i] if i < len(prefix) else items, depth + 1, refs)
            if value is None:
                return None
            members.append(value)
            length += len(value) + 1
            if length > self.max_chars:
                break
        return "[" + ",".join(members) + "]"

    def _resolve(self, ref: str) -> Any:
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise _Unknown  # outside the schema
        node = self.root
        for part in filter(None, ref[1:].split("/")):
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise _Unknown
        return node


def _merge(schema: dict, branch: Any) -> Any:
    """A branch of `anyOf`/`oneOf` with its parent's other keywords."""
    if branch is True:
        return schema or True
    return {**schema, **branch} if isinstance(branch, dict) else branch


def _implied_type(schema: dict) -> str | None:
    if {"properties", "required", "additionalProperties"} & schema.keys():
        return "object"
    if {"items", "prefixItems", "minItems"} & schema.keys():
        return "array"
    if {"minLength", "pattern", "format"} & schema.keys():
        return "string"
    if {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"} & schema.keys():
        return "number"
    return None


def _number(schema: dict, integer: bool) -> str | None:
    """The integer in range nearest 0 (for a number too: the shortest way to write one in range);
    a number's range that holds no integer gives its bound's integer part (a lower bound on the
    length), an integer's: None."""
    low, high = _bound(schema, "minimum", max, -math.inf), _bound(schema, "maximum", min, math.inf)
    low_int = max(math.ceil(low) if low > -math.inf else low, _exclusive(schema, "exclusiveMinimum", 1))
    high_int = min(math.floor(high) if high < math.inf else high, _exclusive(schema, "exclusiveMaximum", -1))
    if low_int <= 0 <= high_int:
        return "0"
    if low_int > high_int:
        return None if integer else _number_text(int(low if low > 0 else high))
    nearest = low_int if low_int > 0 else high_int
    return str(nearest) if integer else _number_text(nearest)  # the grammar writes integers without exponents


def _number_text(value: int) -> str:
    """`value` as JSON, or its exponent form's length where that is shorter (1e20 for 10^20)."""
    plain = str(value)
    digits = plain.lstrip("-")
    exponent = f"{plain[: len(plain) - len(digits)]}{digits[0]}e{len(digits) - 1}"
    return exponent if len(exponent) < len(plain) else plain


def _bound(schema: dict, key: str, pick, default: float) -> int | float:
    bounds = [schema.get(key), schema.get("exclusive" + key[0].upper() + key[1:])]
    return pick([b for b in bounds if _is_number(b)], default=default)


def _exclusive(schema: dict, key: str, step: int) -> int | float:
    """An integer's bound from an exclusive one: the next integer inside."""
    bound = schema.get(key)
    if not _is_number(bound):
        return -math.inf if step > 0 else math.inf
    return math.floor(bound) + 1 if step > 0 else math.ceil(bound) - 1


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shortest(documents) -> str | None:
    found = [d for d in documents if d is not None]
    return min(found, key=len) if found else None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
