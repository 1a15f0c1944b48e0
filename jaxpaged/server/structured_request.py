"""The request fields that constrain output, mapped onto `SamplingParams.structured_outputs`.

Five ways to ask, all ending in one `StructuredOutputsParams` (vLLM's names):

- OpenAI's `response_format`: `text` (no constraint), `json_object`, `json_schema` (`schema`;
  `strict` changes nothing: the output always follows the schema), vLLM's `structural_tag`;
- vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`, `json_object`,
  `structural_tag`, and the options `disable_any_whitespace`, `disable_additional_properties`,
  `whitespace_pattern`, `disable_fallback`);
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (aliases of the
  same kinds), `guided_whitespace_pattern` (the option) and `guided_decoding_backend` (only the
  backend this server has), and chat's older top-level `structural_tag`;
- `tools` with `tool_choice` `"required"` or a named function (a JSON schema, see `tools.py`).

Two of them at once is a 400 naming both. A schema's size is bounded by the body's
(`--max-request-body-bytes`); whether it compiles is checked off the event loop (`serving_context.py`).
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.server.errors import APIError

# guided_decoding_backend values that name the backend this server has
BACKENDS = ("auto", "llguidance", "guidance")
GUIDED_ALIASES = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: OpenAI's `name`, `description`, `schema`, `strict`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text`, `json_object`, `json_schema`, or vLLM's `structural_tag`
    (whose other keys, `structures` and `triggers`, are the tag's definition)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` request object (exactly one constraint, plus options)."""

    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False

    def kinds(self) -> dict[str, Any]:
        given = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
            "structural_tag": self.structural_tag,
        }
        return {k: v for k, v in given.items() if v is not None}


def _response_format_kind(rf: ResponseFormat) -> dict[str, Any]:
    if rf.type == "json_object":
        return {"json_object": True}
    if rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(
                "response_format.json_schema is required when type is json_schema",
                param="response_format.json_schema",
            )
        schema = rf.json_schema.schema_
        return {"json": schema} if schema is not None else {"json_object": True}
    if rf.type == "structural_tag":
        return {"structural_tag": json.dumps(rf.model_dump(exclude_none=True))}
    return {}


def structured_outputs_of(
    body: Any, tool_schema: dict | None = None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's one output constraint and the field that gave it (None, None: it has none).

    Args:
      body: a completion or chat request (`protocol.py`).
      tool_schema: the JSON schema `tool_choice` asks for (chat), if any.

    Raises:
      APIError: two constraints (naming both), an option without a constraint, a backend this
        server does not have, or a constraint `StructuredOutputsParams` rejects.
    """
    sources: dict[str, dict[str, Any]] = {}
    if body.response_format is not None:
        kind = _response_format_kind(body.response_format)
        if kind:
            sources["response_format"] = kind
    so = body.structured_outputs
    if so is not None and so.kinds():
        sources["structured_outputs"] = so.kinds()
    for alias, kind in GUIDED_ALIASES.items():
        if getattr(body, alias) is not None:
            sources[alias] = {kind: getattr(body, alias)}
    if getattr(body, "structural_tag", None) is not None:
        sources["structural_tag"] = {"structural_tag": body.structural_tag}
    if tool_schema is not None:
        sources["tool_choice"] = {"json": tool_schema}
    if len(sources) > 1:
        first, second = list(sources)[:2]
        raise APIError(f"{first} and {second} both constrain the output; give only one of them", param=second)
    backend = body.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise APIError(
            f"guided_decoding_backend {backend!r:.40}: this server's structured-output backend is llguidance, "
            "chosen at start-up (use structured_outputs without a backend)",
            param="guided_decoding_backend",
        )
    options = {name: getattr(so, name) for name in OPTIONS} if so is not None else {}
    if body.guided_whitespace_pattern is not None:
        if options.get("whitespace_pattern") is not None:
            raise APIError(
                "guided_whitespace_pattern and structured_outputs.whitespace_pattern are both given; give one",
                param="guided_whitespace_pattern",
            )
        options["whitespace_pattern"] = body.guided_whitespace_pattern
    if not sources:
        given = [name for name, value in options.items() if value not in (None, False)]
        if given:
            field = "guided_whitespace_pattern" if given == ["whitespace_pattern"] and so is None else given[0]
            raise APIError(
                f"{field} needs a constraint (structured_outputs.json, regex, choice, grammar, json_object or "
                "response_format)",
                param=field,
            )
        return None, None
    (values,) = sources.values()
    if isinstance(values.get("structural_tag"), dict):
        values = {**values, "structural_tag": json.dumps(values["structural_tag"])}
    field = next(iter(sources))
    try:
        return StructuredOutputsParams(**values, **options), field
    except ValueError as err:
        message = str(err).replace("StructuredOutputsParams", "structured_outputs")
        raise APIError(message, param=field) from None
