"""Chat tools: `tools` and `tool_choice` in, `tool_calls` out (OpenAI's shapes, vLLM's behaviour).

- `tool_choice` `"none"`: the model answers in text (the template still sees `tools`, as in vLLM).
- a named function: the output is constrained to that function's `parameters` schema and becomes
  one tool call (`finish_reason` stays `"stop"`, as OpenAI's does for a forced function).
- `"required"`: the output is constrained to a JSON array of `{"name", "parameters"}` objects,
  one of the tools each (at most one with `parallel_tool_calls: false`); `finish_reason`
  `"tool_calls"`.
- `"auto"` (the default when `tools` are given): the model's own format, parsed by the
  `--tool-call-parser` the server was started with (`--enable-auto-tool-choice`; without it
  `"auto"` is a 400, as in vLLM); `finish_reason` `"tool_calls"` when it called one.

Named and required go through structured outputs, so their output always parses once the
engine constrains it.
"""

import copy
import dataclasses
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict

from jaxpaged.server import tool_parsers
from jaxpaged.server.errors import APIError, echo


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# a function without `parameters` takes none: `{}` (vLLM allows any object; that lets sampling run on to max_tokens)
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclasses.dataclass(frozen=True)
class ToolMode:
    """How one chat request's replies become messages: the constraint it adds, and its parser.

    Attributes:
      schema: the JSON schema the output is constrained to (named, required), or None.
      stream: a fresh `ToolCallStream` for one choice.
      forced: a named function (finish_reason stays "stop").
    """

    schema: dict | None
    stream: Callable[[], tool_parsers.ToolCallStream]
    forced: bool = False

    def finish_reason(self, calls: list, reason: str | None) -> str | None:
        return "tool_calls" if calls and reason == "stop" and not self.forced else reason


def tool_mode(body, auto_parser: str | None) -> ToolMode | None:
    """The request's `ToolMode` (None: no tool calls are parsed).

    Args:
      body: the chat request.
      auto_parser: `--tool-call-parser` when `--enable-auto-tool-choice` was given, else None.

    Raises:
      APIError: `tool_choice` without `tools`, a named function not in `tools`, duplicate names,
        or `"auto"` on a server started without `--enable-auto-tool-choice`.
    """
    tools, choice = body.tools, body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise APIError(f"tools: the function name {echo(duplicate)!r} is given twice", param="tools")
    choice = "auto" if choice is None else choice
    max_calls = 1 if body.parallel_tool_calls is False else None
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        tool = next((t for t in tools if t.function.name == name), None)
        if tool is None:
            raise APIError(f"tool_choice names {echo(name)!r}, which is not one of the tools", param="tool_choice")
        schema = tool.function.parameters or EMPTY_PARAMETERS
        return ToolMode(schema, lambda: tool_parsers.NamedStream(name), forced=True)
    if choice == "required":
        return ToolMode(required_schema(tools, max_calls), lambda: tool_parsers.required(max_calls))
    if auto_parser is None:
        raise APIError(
            'tool_choice "auto" needs the server started with --enable-auto-tool-choice and --tool-call-parser '
            '(send tool_choice "required", "none" or a named function instead)',
            param="tool_choice",
        )
    make = tool_parsers.TOOL_PARSERS[auto_parser]
    return ToolMode(None, lambda: make(max_calls))


def required_schema(tools: list[Tool], max_calls: int | None) -> dict:
    """A JSON array of one or more `{"name": <a tool>, "parameters": <its schema>}` objects; each
    tool's `$defs` move to the top, where their `#/$defs/...` references resolve."""
    defs: dict = {}
    variants = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) if tool.function.parameters else dict(EMPTY_PARAMETERS)
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise APIError(f"tools: two tools define $defs {echo(name)!r} differently", param="tools")
            defs[name] = schema
        variants.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if max_calls is not None:
        schema["maxItems"] = max_calls
    if defs:
        schema["$defs"] = defs
    return schema


def message(mode: ToolMode, text: str, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason of a whole reply."""
    content, calls = tool_parsers.extract(mode.stream(), text)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    elif content is None:
        msg["content"] = ""
    return msg, mode.finish_reason(calls, reason)
