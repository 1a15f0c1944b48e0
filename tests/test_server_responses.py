"""`POST /v1/responses` (issue 45) with the official `openai` client's `responses` calls, on the
shared demo engine: a response is the chat completion of the same conversation (greedy text and
usage equal), streamed as the Responses events in order (their deltas add up to the text);
`instructions`, message lists and function-call items; `text.format` JSON schemas; function
tools; `max_output_tokens` reached is `incomplete`; what is not supported is a 400 naming it."""

import json

import httpx
import pytest

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "In the beginning"}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Server:
    def __init__(self, demo_server):
        self.served = demo_server.serve("demo")
        self.http = httpx.Client(base_url=self.served.url, trust_env=False, timeout=120)
        self.client = openai.OpenAI(
            base_url=self.served.url + "/v1", api_key="unused", max_retries=0, http_client=httpx.Client(trust_env=False)
        )

    def close(self):
        self.served.close()


@pytest.fixture(scope="module")
def server(demo_server):
    srv = Server(demo_server)
    yield srv
    srv.close()


def test_a_response_is_the_chat_completion_of_its_conversation(server):
    chat = server.client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=12, temperature=0)
    response = server.client.responses.create(
        model="demo", instructions="Be brief.", input="In the beginning", max_output_tokens=12, temperature=0
    )
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "demo"
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    as_items = server.client.responses.create(
        model="demo",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "In the beginning"}]},
        ],
        max_output_tokens=12,
        temperature=0,
    )
    assert as_items.output_text == response.output_text


def test_streamed_events_come_in_order_and_add_up_to_the_text(server):
    whole = server.client.responses.create(model="demo", input="In the beginning", max_output_tokens=8, temperature=0)
    events = list(
        server.client.responses.create(
            model="demo", input="In the beginning", max_output_tokens=8, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 8 tokens reached
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 8 and "".join(deltas) == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == 8
    assert final.incomplete_details.reason == "max_output_tokens"


def test_text_format_json_schema_gives_a_document_of_it(server):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    response = server.client.responses.create(
        model="demo",
        input="A number:",
        max_output_tokens=30,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    assert response.status == "completed" and isinstance(json.loads(response.output_text)["n"], int)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_tool_is_a_function_call_item(server, stream):
    fields = dict(
        model="demo",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
    )
    if stream:
        events = list(server.client.responses.create(**fields, stream=True))
        added = [e for e in events if e.type == "response.output_item.added"]
        assert added and added[0].item.type == "function_call"
        arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        response = events[-1].response
        assert response.output[0].arguments == arguments
    else:
        response = server.client.responses.create(**fields)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # the call and its output sent back as items
    follow = server.client.responses.create(
        model="demo",
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
    )
    assert follow.output and follow.usage.input_tokens > response.usage.input_tokens


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"store": True}, "store", "not stored"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "whole conversation"),
        ({"background": True}, "background", "background"),
        ({"top_logprobs": 2}, "top_logprobs", "/v1/chat/completions"),
        ({"truncation": "auto"}, "truncation", "disabled"),
        ({"tools": [{"type": "web_search"}]}, "tools", "only function tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_text"),
        ({"input": [{"type": "reasoning"}]}, "input", "function_call_output"),
        ({"max_output_tokens": 100_000}, "input", "maximum context length is 128 tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
            "text.format",
            "text.format",
        ),
        ({"colour": "red"}, "colour", "colour"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(server, fields, param, says):
    body = {"model": "demo", "input": "In the beginning", **fields}
    response = server.http.post("/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_a_grammar_that_gives_up_at_once_is_a_400_streamed_or_not(server):
    """llguidance gives up on 600 optional properties once the object opens, before the first
    output leaves the engine: streamed too, a 400 naming why (a streamed response starts with its
    first output), never a 500 nor a stream that breaks."""
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(600)}}
    body = {
        "model": "demo",
        "input": "x",
        "stream": True,
        "max_output_tokens": 16,
        "text": {"format": {"type": "json_schema", "name": "wide", "schema": wide}},
    }
    for stream in (True, False):
        refused = server.http.post("/v1/responses", json={**body, "stream": stream})
        assert refused.status_code == 400, refused.text
        assert "could not continue" in refused.json()["error"]["message"]
