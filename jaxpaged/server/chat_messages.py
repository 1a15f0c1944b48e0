"""Chat messages as requests carry them: text (or text parts), a `name`, and the tool-calling
history (assistant `tool_calls`, `tool` messages with `tool_call_id`), as the chat template
receives them."""

import json
from typing import Annotated, Any

from pydantic import BaseModel, Field, model_validator

from jaxpaged.server.errors import APIError, echo


def _list(item: Any) -> Any:
    """A list field whose validation stops at its first bad element: one error, not one per element."""
    return Annotated[list[item], Field(fail_fast=True)]


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class AssistantToolCall(BaseModel):
    """A tool call in an assistant message of the history."""

    id: str
    type: str = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    """One message; keys it does not know are accepted only with null values (what clients echo
    back from a response, e.g. `refusal`), anything else is a 400 naming the key."""

    role: str
    content: str | _list(ContentPart) | None = None
    name: str | None = None
    tool_calls: _list(AssistantToolCall) | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = next((k for k, v in data.items() if k not in cls.model_fields and v is not None), None)
            if unknown is not None:
                raise ValueError(f"unrecognized message field {echo(str(unknown))!r}")
            return {k: v for k, v in data.items() if k in cls.model_fields}
        return data

    def to_template(self) -> dict:
        """The message as the chat template wants it (text parts joined by newlines)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError("only text content parts are supported", param="messages")
            content = "\n".join(part.text or "" for part in content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            message["name"] = self.name
        if self.tool_calls:  # arguments as a dict, as templates (Llama 3.1's `| tojson`) expect
            message["tool_calls"] = [
                {"id": c.id, "type": c.type, "function": {"name": c.function.name, "arguments": _arguments(c)}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(call: AssistantToolCall) -> Any:
    try:
        value = json.loads(call.function.arguments)
    except ValueError:
        return call.function.arguments
    return value if isinstance(value, dict) else call.function.arguments
