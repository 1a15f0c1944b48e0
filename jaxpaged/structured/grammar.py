r"""llguidance grammar text from a request's `StructuredOutputsParams`, and its cheap check.

The grammar text (llguidance's JSON grammar format) is also the key of the compiled-grammar
cache: two requests with the same constraint share one compiled grammar.

JSON is compact unless the request gives a `whitespace_pattern`: no whitespace between tokens
(separators "," and ":"), so a model cannot spin on whitespace inside a document until
`max_tokens` cuts it (vLLM's `disable_any_whitespace` is therefore always on here).

In a `regex` constraint `\d` is an ASCII digit, `[0-9]`, as in vLLM's default backend and in a
JSON schema's `pattern` (llguidance alone reads it as any Unicode digit: a date regex then
writes Tamil or Cham digits).
"""

import copy
import json

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured.llg import llguidance

_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint (not validated: see `check`).

    Raises:
      ValueError: `structured_outputs.<kind>: ...` when the text cannot even be read (a JSON
        schema that is not JSON, a grammar GBNF cannot convert, a bad structural tag).
    """
    kind = params.kind
    try:
        if kind == "json":
            return _json_grammar(params, params.json)
        if kind == "json_object":
            return _json_grammar(params, {"type": "object"})
        if kind == "regex":
            return llguidance().LLMatcher.grammar_from_regex(ascii_digits(params.regex))
        if kind == "choice":
            return llguidance().grammar_from("choice", list(params.choice))
        if kind == "grammar":
            return llguidance().grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
        return _structural_tag_grammar(params.structural_tag)
    except (ValueError, TypeError, KeyError, AssertionError) as err:
        raise ValueError(f"structured_outputs.{kind}: {err}") from None


def check(params: StructuredOutputsParams) -> None:
    """Validates a constraint without a tokenizer or an engine (a millisecond for typical
    schemas): what the server answers a 400 with.

    Raises:
      ValueError: with a message starting `structured_outputs.<kind>:` naming what is wrong.
    """
    text = grammar_text(params)
    error = llguidance().LLMatcher.validate_grammar(text)
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {error.strip()}")


def ascii_digits(pattern: str) -> str:
    r"""`pattern` with `\d` as `[0-9]` (`0-9` inside a character class) and `\D` as `[^0-9]`
    outside one; escapes, and a `]` that opens a class as a literal, are read as a regex reads
    them. (`\D` inside a class stays: "not a digit" has no range to join the class with.)"""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt == "d":
                out.append("0-9" if in_class else "[0-9]")
            elif nxt == "D" and not in_class:
                out.append("[^0-9]")
            else:
                out.append(c + nxt)
            i += 2
            continue
        out.append(c)
        i += 1
        if c == "[" and not in_class:
            in_class = True
            for literal in ("^", "]"):  # `[^` and a `]` right after the opening are part of the class
                if pattern.startswith(literal, i):
                    out.append(literal)
                    i += 1
        elif c == "]" and in_class:
            in_class = False
    return "".join(out)


def _json_grammar(params: StructuredOutputsParams, schema) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as err:
            raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
    if params.disable_additional_properties and isinstance(schema, dict):
        schema = _no_additional_properties(copy.deepcopy(schema))
    options = dict(_COMPACT)
    if params.whitespace_pattern is not None:
        options = {"whitespace_flexible": False, "whitespace_pattern": params.whitespace_pattern}
    return llguidance().LLMatcher.grammar_from_json_schema(schema, overrides=options)


def _no_additional_properties(schema):
    """Sets `additionalProperties: false` on every object schema that does not say otherwise
    (in place; returns it)."""
    if isinstance(schema, dict):
        if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _no_additional_properties(value)
    elif isinstance(schema, list):
        for value in schema:
            _no_additional_properties(value)
    return schema


def _structural_tag_grammar(text: str) -> str:
    """vLLM's structural tag (`{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`)
    as llguidance's lazily triggered tags: free text with constrained tagged parts."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("structures"), list) or not spec.get("triggers"):
        raise ValueError('expected {"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}')
    tags = []
    for s in spec["structures"]:
        trigger = next((t for t in spec["triggers"] if s["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"no trigger starts the structure beginning {s['begin']!r}")
        tags.append(
            llguidance().StructTag(trigger=trigger, begin=s["begin"], grammar=s.get("schema", {}), end=s["end"])
        )
    return llguidance().LLMatcher.grammar_from_lark(llguidance().StructTag.to_grammar(tags))
