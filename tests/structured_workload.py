"""The constraints the structured-output tests and benchmark use, and checks that an output obeys
each: a clinical-notes JSON schema (a dozen fields: enums, arrays, nested objects), a regex, a
choice and a Lark grammar (each with a bounded length, so a document always fits max_tokens)."""

import json
import re

import jsonschema

from jaxpaged.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "patient": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "sex": {"enum": ["female", "male", "unknown"]},
        "smoker": {"type": "boolean"},
        "diagnoses": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        "medications": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 8},
                    "dose_mg": {"type": "integer", "minimum": 0, "maximum": 1000},
                },
                "required": ["name", "dose_mg"],
                "additionalProperties": False,
            },
            "maxItems": 2,
        },
        "severity": {"enum": ["mild", "moderate", "severe"]},
        "follow_up": {"type": "boolean"},
        "vitals": {
            "type": "object",
            "properties": {
                "hr": {"type": "integer", "minimum": 20, "maximum": 250},
                "bp": {"type": "string", "pattern": "^[0-9]{2,3}/[0-9]{2,3}$"},
            },
            "required": ["hr", "bp"],
            "additionalProperties": False,
        },
        "allergies": {"type": "array", "items": {"enum": ["penicillin", "latex", "none"]}, "maxItems": 3},
        "notes": {"type": ["string", "null"], "maxLength": 16},
        "visit": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": [
        "patient",
        "age",
        "sex",
        "smoker",
        "diagnoses",
        "medications",
        "severity",
        "follow_up",
        "vitals",
        "allergies",
        "notes",
        "visit",
    ],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-[a-z]{2,6}"
CHOICES = ["yes", "no", "perhaps"]
LARK = 'start: "call " NAME "(" NUM ")"\nNAME: /[a-z]{1,8}/\nNUM: /[0-9]{1,3}/'
LARK_REGEX = r"call [a-z]{1,8}\([0-9]{1,3}\)"

CONSTRAINTS = {
    "json": StructuredOutputsParams(json=SCHEMA),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=LARK),
}


def obeys(kind: str, text: str) -> bool:
    """Whether `text` is a complete output of constraint `kind`."""
    if kind == "json":
        try:
            jsonschema.validate(json.loads(text), SCHEMA)
        except (json.JSONDecodeError, jsonschema.ValidationError):
            return False
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(LARK_REGEX, text) is not None
