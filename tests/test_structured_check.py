"""`jaxpaged.structured.check`: cheap validation of a constraint without an engine (the server's
400s), and the grammar text (compact JSON by default)."""

import json

import pytest

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured import check, grammar_text
from jaxpaged.structured.grammar import ascii_classes

VALID = [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "array", "items": {"enum": ["x", "y"]}}'),
    StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='start: "a" b\nb: /[0-9]+/'),
    StructuredOutputsParams(grammar='root ::= "yes" | "no"'),  # GBNF
    StructuredOutputsParams(
        structural_tag='{"structures": [{"begin": "<f=x>", "schema": {"type": "object"}, "end": "</f>"}], '
        '"triggers": ["<f="]}'
    ),
]

INVALID = [
    (StructuredOutputsParams(json='{"type": "nope"}'), "structured_outputs.json:"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json: not valid JSON"),
    (StructuredOutputsParams(regex="a[b"), "structured_outputs.regex:"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar:"),
    (StructuredOutputsParams(grammar="root ::= ("), "structured_outputs.grammar:"),
    (StructuredOutputsParams(structural_tag="{}"), "structured_outputs.structural_tag:"),
]


@pytest.mark.parametrize("params", VALID, ids=lambda p: p.kind)
def test_valid_constraints_pass(params):
    check(params)


@pytest.mark.parametrize(("params", "prefix"), INVALID, ids=lambda x: getattr(x, "kind", ""))
def test_invalid_constraints_name_the_field(params, prefix):
    with pytest.raises(ValueError) as err:
        check(params)
    assert str(err.value).startswith(prefix)


def test_json_is_compact_unless_a_whitespace_pattern_is_given():
    compact = grammar_text(StructuredOutputsParams(json={"type": "object"}))
    assert '"whitespace_flexible":false' in compact and '"item_separator":","' in compact
    spaced = grammar_text(StructuredOutputsParams(json={"type": "object"}, whitespace_pattern=r"[ ]?"))
    assert '"whitespace_pattern":"[ ]?"' in spaced


def test_disable_additional_properties_closes_every_object():
    schema = {"type": "object", "properties": {"inner": {"type": "object", "properties": {}}}}
    text = grammar_text(StructuredOutputsParams(json=schema, disable_additional_properties=True))
    assert text.count('"additionalProperties":false') == 2
    assert "additionalProperties" not in str(schema)  # the request's schema is left alone


def test_without_llguidance_a_constraint_is_a_clear_error(monkeypatch):
    """The engine imports llguidance only for a constraint: without it (the GPU image) the rest
    runs, and a constrained request gets a ValueError saying how to install it."""
    import sys

    from jaxpaged.structured.llg import llguidance

    monkeypatch.setitem(sys.modules, "llguidance", None)  # as if not installed
    with pytest.raises(ValueError, match="need llguidance, which is not installed: pip install llguidance"):
        llguidance()
    with pytest.raises(ValueError, match="need llguidance"):
        check(StructuredOutputsParams(regex="a+"))


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"\d{4}-\d{2}-\d{2}", "[0-9]{4}-[0-9]{2}-[0-9]{2}"),
        (r"[\d.]+", "[0-9.]+"),
        (r"\D+", "[^0-9]+"),
        (r"[a\D]", r"[a\D]"),  # "not a digit" inside a class stays
        (r"\\d", r"\\d"),  # an escaped backslash, then a plain d
        (r"[]\d]", "[]0-9]"),  # a `]` that opens a class is a literal
        (r"[^]\d]x\d", "[^]0-9]x[0-9]"),
        (r"\[\d\]", r"\[[0-9]\]"),
        (r"\w+@\w+", "[0-9A-Za-z_]+@[0-9A-Za-z_]+"),
        (r"[\w.-]+", "[0-9A-Za-z_.-]+"),
        (r"\s*\S", r"[ \t\n\r\f\v]*[^ \t\n\r\f\v]"),
        (r"\W", "[^0-9A-Za-z_]"),
        (r"[\s\W]", r"[ \t\n\r\f\v\W]"),  # a negation inside a class stays
    ],
)
def test_regex_classes_are_ascii_as_in_vllm(pattern, ascii):
    assert ascii_classes(pattern) == ascii


def test_a_regex_digit_never_matches_another_scripts_digits():
    """`\\d` compiled for the demo tokenizer takes ASCII digits only (llguidance alone took Tamil
    and Cham digits, and a date regex wrote them)."""
    from transformers import AutoTokenizer

    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
    from jaxpaged.structured.backend import GrammarBackend

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    backend = GrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    try:
        for text, valid in (("2026-12", True), ("௨௦௨௬-௧௨", False), ("꩕꤈72-12", False)):
            matcher = backend.compile(StructuredOutputsParams(regex=r"\d{4}-\d{2}")).result().deep_copy()
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert (matcher.validate_tokens(ids) == len(ids)) is valid, text
    finally:
        backend.close()


# (schema, its shortest compact document, or None where there is none or it cannot be computed)
SHORTEST = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 3},
                "age": {"type": "integer", "exclusiveMinimum": 17},
                "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2},
                "note": {"type": "string"},
            },
            "required": ["name", "age", "tags"],
        },
        '{"name":"aaa","age":18,"tags":["",""]}',
    ),
    ({"type": ["integer", "null"], "minimum": 1000}, "1000"),
    ({"type": "number", "maximum": -12.5}, "-13"),
    ({"anyOf": [{"type": "object", "required": ["long_name"]}, {"type": "boolean"}]}, "true"),
    ({"enum": ["a long option", "short", 7]}, "7"),
    ({"type": "string", "format": "date"}, '"2000-01-01"'),
    (
        {"type": "array", "prefixItems": [{"const": "x"}, {"type": "null"}], "minItems": 3, "items": {"const": 5}},
        '["x",null,5]',
    ),
    ({"type": "object", "required": ["x"], "additionalProperties": {"type": "boolean"}}, '{"x":true}'),
    ({"$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"}, "{}"),
    (
        {
            "$defs": {"node": {"properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}},
            "$ref": "#/$defs/node",
        },
        None,
    ),  # a required cycle: no finite document
    ({"$ref": "https://example.com/schema.json"}, None),  # outside the schema
    (False, None),
]


@pytest.mark.parametrize(("schema", "document"), SHORTEST, ids=range(len(SHORTEST)))
def test_the_shortest_document_a_schema_allows(schema, document):
    """What the server compares with max_tokens (`structured/shortest_document.py`): exact here,
    and each document valid under its schema."""
    import jsonschema

    from jaxpaged.structured.shortest_document import shortest_json_document

    assert shortest_json_document(schema) == document
    if document is not None:
        jsonschema.validate(json.loads(document), schema)


def test_the_shortest_document_is_bounded_for_hostile_schemas():
    """A billion required items is cut at max_chars; a `$ref` chain that branches twice per level
    (2^60 paths in a few hundred bytes) and a schema deeper than MAX_DEPTH give None, quickly;
    and the other constraints."""
    from jaxpaged.structured.shortest_document import shortest_document, shortest_json_document

    assert len(shortest_json_document({"type": "array", "minItems": 10**9}, max_chars=1000)) == 1000
    branching = {"$defs": {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}] * 2} for i in range(60)}}
    branching["$defs"]["d60"] = {"type": "null"}
    assert shortest_json_document({**branching, "$ref": "#/$defs/d0"}) is None
    deep = {"type": "null"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    assert shortest_json_document(deep) is None
    # where it is not exact it errs short: 0.3 is the shortest number here; 1e20 as long as 10^20's shortest
    assert shortest_json_document({"type": "number", "exclusiveMinimum": 0.25, "maximum": 0.75}) == "0"
    assert shortest_json_document({"type": "number", "minimum": 10**20}) == "1e20"
    assert shortest_document(StructuredOutputsParams(choice=["yes", "no"])) == "no"
    assert shortest_document(StructuredOutputsParams(json_object=True)) == "{}"
    assert shortest_document(StructuredOutputsParams(regex=r"\d+")) is None
