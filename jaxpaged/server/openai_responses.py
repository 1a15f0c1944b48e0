"""`POST /v1/responses`, OpenAI's Responses API, in vLLM's supported subset: a request becomes a
chat completion (`create_chat_completion`, so every limit, check and tool parser of chat holds)
and its answer, whole or streamed, becomes a response.

Honoured: `input` (a string, or a list of messages — roles user, system, developer, assistant;
content a string or `input_text`/`output_text` parts — and `function_call` /
`function_call_output` items), `instructions` (a system message first), `max_output_tokens`,
`temperature`, `top_p`, `stream` (the Responses events: `response.created` ...
`response.output_text.delta` ... `response.completed`), `text.format` (`text`, `json_schema`,
`json_object`), function `tools`, `tool_choice`, `parallel_tool_calls`, `metadata` (echoed);
vLLM's extras `top_k`, `min_p`, `repetition_penalty`, `seed`, `ignore_eos` (guidellm sends it),
`cache_salt`, `request_id`.
No effect: `user`, `service_tier`, `truncation: "disabled"`, `store: false`.
Refused by name (400): `store: true` and `previous_response_id` (responses are not stored: send
the whole conversation in `input`), `background`, `reasoning`, `include`, `top_logprobs`,
`truncation: "auto"`, `prompt`, non-function tools and non-text content parts. An unknown field
is a 400 naming it. Errors name the Responses field (`max_output_tokens`, `text.format`, `input`).
"""

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ConfigDict, Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jaxpaged.server.errors import APIError, echo
from jaxpaged.server.event_stream import EventStreamResponse
from jaxpaged.server.protocol import ChatCompletionRequest
from jaxpaged.server.protocol import Request as RequestBody
from jaxpaged.server.serving import create_chat_completion
from jaxpaged.server.serving_context import ServingContext

# chat's field -> the Responses field a client sent it as (for error messages)
_FIELD_OF = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}
# Fields refused unless null / false / empty, with why.
_REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation in input",
    "background": "background responses are not supported",
    "reasoning": "reasoning options are not supported",
    "include": "no extra output can be included",
    "top_logprobs": "logprobs are not supported on /v1/responses (use /v1/chat/completions)",
    "prompt": "prompt templates are not supported: send input",
}
_PASSED_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "cache_salt",
    "request_id",
)


class ResponsesRequest(RequestBody):
    """The body of `POST /v1/responses` (see the module docstring for what each field does)."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    prompt: dict[str, Any] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    cache_salt: str | None = None
    request_id: str | None = None

    def refuse_unsupported(self) -> None:
        for name, why in _REFUSED.items():
            if getattr(self, name):
                raise APIError(f"{name}: {why}", param=name)
        if self.store:
            raise APIError("store: responses are not stored; send store false or leave it out", param="store")
        if self.truncation not in (None, "disabled"):
            raise APIError(
                f"truncation {echo(repr(self.truncation))}: only 'disabled' (a prompt over the context is a 400)",
                param="truncation",
            )


def _text(content, where: str) -> str:
    """A message's text: a string, or its `input_text` / `output_text` parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"{where}.content: a string or a list of input_text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise APIError(
                f"{where}.content[{j}]: only input_text and output_text parts are supported, got {echo(repr(kind))}",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of `instructions` and `input`."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(f"{where}.role {echo(repr(role))}: user, system, developer or assistant", param="input")
            role = "system" if role == "developer" else role
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments", "")}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        else:
            raise APIError(
                f"{where}.type {echo(repr(kind))}: message, function_call and function_call_output are supported",
                param="input",
            )
    return messages


def _response_format(text: dict | None) -> dict | None:
    fmt = (text or {}).get("format")
    unknown = set(text or {}) - {"format"}
    if unknown:
        raise APIError(f"text.{sorted(unknown)[0]}: not supported (text.format is)", param="text")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise APIError(f"text.format.type {echo(repr(fmt.get('type')))}: text, json_schema or json_object", param="text")


def _tools(body: ResponsesRequest) -> tuple[list | None, Any]:
    tools = None
    if body.tools is not None:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise APIError(
                    f"tools[{i}].type {echo(repr(tool.get('type')))}: only function tools are supported", param="tools"
                )
            tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return tools, choice


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request asks for."""
    body.refuse_unsupported()
    chat: dict[str, Any] = {"model": body.model, "messages": _messages(body), "stream": body.stream}
    chat.update({name: getattr(body, name) for name in _PASSED_THROUGH if getattr(body, name) is not None})
    if body.max_output_tokens is not None:
        chat["max_tokens"] = body.max_output_tokens
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    fmt = _response_format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    tools, choice = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    if choice is not None:
        chat["tool_choice"] = choice
    if body.parallel_tool_calls is not None:
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [_FIELD_OF.get(str(p), str(p)) for p in first["loc"]]
        raise APIError(f"{'.'.join(loc)}: {first['msg']}", param=loc[0] if loc else None) from None


def _renamed(err: APIError) -> APIError:
    """Chat's error with the Responses field names."""
    field = _FIELD_OF.get(err.param or "")
    if field is None:
        return err
    message = field + err.message[len(err.param) :] if err.message.startswith(err.param) else err.message
    return APIError(message, err.status, param=field, code=err.code, type=err.type)


class _Builder:
    """A response object as its output arrives (streamed deltas or a whole chat message)."""

    def __init__(self, body: ResponsesRequest, model: str):
        self.id = f"resp_{uuid.uuid4().hex}"
        self.body, self.model, self.created = body, model, int(time.time())
        self.items: list[dict] = []  # output items in order
        self.message: dict | None = None  # the message item, once it has text
        self.calls: dict[int, dict] = {}  # chat tool-call index -> function_call item
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def add_text(self, text: str) -> dict:
        """The message item (made on first text; the text appended)."""
        if self.message is None:
            content = [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant"}
            self.message = {**item, "content": content}
            self.items.append(self.message)
        self.message["content"][0]["text"] += text
        return self.message

    def add_call(self, index: int, call_id: str | None, name: str | None) -> dict:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress"}
        item.update(call_id=call_id or f"call_{uuid.uuid4().hex}", name=name or "", arguments="")
        self.calls[index] = item
        self.items.append(item)
        return item

    def response(self, status: str | None = None) -> dict:
        status = status or ("incomplete" if self.finish_reason == "length" else "completed")
        for item in self.items:
            item["status"] = "completed" if status != "in_progress" else item["status"]
        usage = None
        if self.usage is not None:
            usage = {
                "input_tokens": self.usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": self.usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                },
                "output_tokens": self.usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.usage["total_tokens"],
            }
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": [dict(item) for item in self.items] if status != "in_progress" else [],
            "usage": usage,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls if body.parallel_tool_calls is not None else True,
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "truncation": "disabled",
            "user": body.user,
        }

    def from_chat(self, chat: dict) -> dict:
        """The whole response from a whole chat completion."""
        choice = chat["choices"][0]
        message = choice["message"]
        if message.get("content"):
            self.add_text(message["content"])
        for i, call in enumerate(message.get("tool_calls") or []):
            self.add_call(i, call.get("id"), call["function"]["name"])["arguments"] = call["function"]["arguments"]
        self.finish_reason, self.usage = choice.get("finish_reason"), chat.get("usage")
        return self.response()


class _Events:
    """The Responses stream's events, numbered."""

    def __init__(self):
        self.number = 0

    def __call__(self, kind: str, **data) -> str:
        event = {"type": kind, "sequence_number": self.number, **data}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def _stream(builder: _Builder, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The Responses events of a streamed chat completion's SSE chunks."""
    event = _Events()
    yield event("response.created", response=builder.response("in_progress"))
    yield event("response.in_progress", response=builder.response("in_progress"))
    async for line in chunks:
        if not line.startswith("data: {"):
            continue  # "[DONE]": the completion is sent below
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = chunk["error"]
            yield event("error", code=error.get("code") or error.get("type"), message=error["message"], param=None)
            return
        if chunk.get("usage"):
            builder.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                first = builder.message is None
                item = builder.add_text(delta["content"])
                place = {"item_id": item["id"], "output_index": builder.items.index(item)}
                if first:
                    yield event(
                        "response.output_item.added", output_index=place["output_index"], item={**item, "content": []}
                    )
                    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                    yield event("response.content_part.added", **place, content_index=0, part=part)
                yield event("response.output_text.delta", **place, content_index=0, delta=delta["content"], logprobs=[])
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                item = builder.calls.get(call["index"])
                if item is None:
                    item = builder.add_call(call["index"], call.get("id"), function.get("name"))
                    yield event("response.output_item.added", output_index=builder.items.index(item), item=dict(item))
                if function.get("arguments"):
                    item["arguments"] += function["arguments"]
                    place = {"item_id": item["id"], "output_index": builder.items.index(item)}
                    yield event("response.function_call_arguments.delta", **place, delta=function["arguments"])
            if choice.get("finish_reason"):
                builder.finish_reason = choice["finish_reason"]
    final = builder.response()
    for index, item in enumerate(final["output"]):
        if item["type"] == "message":
            text, place = item["content"][0]["text"], {"item_id": item["id"], "output_index": index}
            yield event("response.output_text.done", **place, content_index=0, text=text, logprobs=[])
            yield event("response.content_part.done", **place, content_index=0, part=item["content"][0])
        else:
            place = {"item_id": item["id"], "output_index": index}
            yield event(
                "response.function_call_arguments.done", **place, arguments=item["arguments"], name=item["name"]
            )
        yield event("response.output_item.done", output_index=index, item=item)
    yield event(f"response.{final['status']}", response=final)


async def create_response(ctx: ServingContext, body: ResponsesRequest, raw: Request) -> Response:
    """`POST /v1/responses`: the chat completion of `chat_request(body)`, answered as a response."""
    chat = chat_request(body)
    try:
        answer = await create_chat_completion(ctx, chat, raw)
    except APIError as err:
        raise _renamed(err) from None
    builder = _Builder(body, ctx.response_model(body.model))
    if isinstance(answer, EventStreamResponse):
        return answer.mapped(lambda chunks: _stream(builder, chunks))
    if answer.status_code != 200:  # the client went away (499)
        return answer
    return JSONResponse(builder.from_chat(json.loads(answer.body)))
