r"""llguidance grammar text from a request's `StructuredOutputsParams`, and its cheap check.

The grammar text (llguidance's JSON grammar format) is also the key of the compiled-grammar
cache: two requests with the same constraint share one compiled grammar.

JSON is compact unless the request gives a `whitespace_pattern`: no whitespace between tokens
(separators "," and ":"), so a model cannot spin on whitespace inside a document until
`max_tokens` cuts it (vLLM's `disable_any_whitespace` is therefore always on here).

In a `regex` constraint `\d`, `\w` and `\s` are ASCII (`[0-9]`, `[0-9A-Za-z_]`, `[ \t\n\r\f\v]`),
as in vLLM's default backend and in a JSON schema's `pattern` (llguidance alone reads them as
Unicode classes: a date regex then writes Tamil or Cham digits). `\b` and other lookarounds are
not supported by llguidance: a 400.

Budgets: a constraint's own text (the schema as JSON, the regex, the grammar, the choices) is at
most `max_bytes` long before any work is done on it (`constraint_bytes`; llguidance's time grows
faster than linearly in it: a schema of 10,000 properties, 289 KB, took 2.2 s to check and 9.3 s
to compile on this project's 2-core machine), and llguidance builds every grammar under
`parser_limits()`: at most `MAX_GRAMMAR_SYMBOLS` symbols (llguidance aborts past 65,525), errors
that do not echo the grammar.
"""

import json

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured.llg import llguidance

_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# The most symbols a grammar may have (llguidance's own limit is 500,000, but its lexer asserts
# fewer than 65,525: 100,000 `choice` options passed its check and then aborted the compile).
MAX_GRAMMAR_SYMBOLS = 50_000
# What a grammar's error says at most (a digest: llguidance's messages can quote the grammar).
MAX_ERROR_CHARS = 300


def parser_limits():
    """llguidance's `LLParserLimits` for every check and compile: bounded grammar size, errors that
    do not quote the grammar or the parser's state."""
    return llguidance().LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


def digest(message: str) -> str:
    """The first line of a grammar engine's message, at most `MAX_ERROR_CHARS` characters."""
    line = message.strip().split("\n", 1)[0]
    return line if len(line) <= MAX_ERROR_CHARS else line[: MAX_ERROR_CHARS - 3] + "..."


def constraint_bytes(params: StructuredOutputsParams) -> int:
    """The size of a constraint's own text, in UTF-8 bytes: its JSON schema or choices as compact
    JSON, its regex, grammar or structural tag as written (`json_object`: 0)."""
    value = getattr(params, params.kind)
    if params.kind == "json_object":
        return 0
    if not isinstance(value, str):
        try:
            value = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return 0  # grammar_text says what is wrong with it
    return len(value.encode("utf-8", "surrogatepass"))


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
            return llguidance().LLMatcher.grammar_from_regex(ascii_classes(params.regex))
        if kind == "choice":
            return llguidance().grammar_from("choice", list(params.choice))
        if kind == "grammar":
            return llguidance().grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
        return _structural_tag_grammar(params.structural_tag)
    except (ValueError, TypeError, KeyError, AssertionError) as err:
        raise ValueError(f"structured_outputs.{kind}: {digest(str(err))}") from None
    except RecursionError:
        raise ValueError(f"structured_outputs.{kind}: nested too deeply") from None


def check(params: StructuredOutputsParams, max_bytes: int | None = None) -> None:
    """Validates a constraint without a tokenizer or an engine (a millisecond for typical
    schemas, seconds near the budget): what the server answers a 400 with.

    Args:
      params: the constraint.
      max_bytes: its budget (`constraint_bytes`; None: none), the server's `--max-grammar-bytes`.

    Raises:
      ValueError: with a message starting `structured_outputs.<kind>:` naming what is wrong.
    """
    size = constraint_bytes(params)
    if max_bytes is not None and size > max_bytes:
        raise ValueError(
            f"structured_outputs.{params.kind}: the constraint is {size} bytes; the server compiles at most "
            f"{max_bytes} (--max-grammar-bytes)"
        )
    text = grammar_text(params)
    error = llguidance().LLMatcher.validate_grammar(text, None, limits=parser_limits())
    if error:
        raise ValueError(f"structured_outputs.{params.kind}: {digest(error)}")


# A regex's class escapes with vLLM's (ASCII) meaning, as the ranges of a character class.
ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(pattern: str) -> str:
    r"""`pattern` with `\d`, `\w` and `\s` in ASCII (`ASCII_CLASSES`: `[0-9]`, or `0-9` inside a
    character class) and `\D`, `\W`, `\S` as their negations outside one; escapes, and a `]`
    that opens a class as a literal, are read as a regex reads them. (`\D`, `\W`, `\S` inside a
    class stay: a negation has no range to join the class with.)"""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in ASCII_CLASSES:
                out.append(ASCII_CLASSES[nxt] if in_class else f"[{ASCII_CLASSES[nxt]}]")
            elif nxt.lower() in ASCII_CLASSES and not in_class:
                out.append(f"[^{ASCII_CLASSES[nxt.lower()]}]")
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
        schema = _no_additional_properties(schema)
    options = dict(_COMPACT)
    if params.whitespace_pattern is not None:
        options = {"whitespace_flexible": False, "whitespace_pattern": params.whitespace_pattern}
    return llguidance().LLMatcher.grammar_from_json_schema(schema, overrides=options)


def _no_additional_properties(schema):
    """A copy of `schema` with `additionalProperties: false` on every object schema that does not
    say otherwise (iterative: any depth the body limit allows)."""

    def fresh(value):
        return {} if isinstance(value, dict) else [] if isinstance(value, list) else value

    root = fresh(schema)
    stack = [(schema, root)]
    while stack:
        source, copy = stack.pop()
        items = source.items() if isinstance(source, dict) else enumerate(source)
        for key, value in items:
            new = fresh(value)
            if isinstance(copy, dict):
                copy[key] = new
            else:
                copy.append(new)
            if new is not value:
                stack.append((value, new))
        if isinstance(source, dict) and (source.get("type") == "object" or "properties" in source):
            copy.setdefault("additionalProperties", False)
    return root


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
