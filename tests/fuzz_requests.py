"""Deterministic generator of hostile (and some valid) HTTP requests for the OpenAI server.

`generate_cases(seed)` returns a list of `Case`s: raw request bytes and headers, never built by a
JSON library that would refuse the input, so bodies can hold NaN / Infinity, integers with hundreds
of digits, lone surrogate escapes ("\\ud800"), invalid UTF-8, duplicate keys and deep nesting.
Every case has a short `desc` for the failure report. The same seed gives the same cases.

Requests that might be valid are kept cheap (prompts x n x max_tokens stays small), so the whole
set runs in seconds on a CPU engine; the few deliberately heavy ones are listed in `_special`.
"""

import dataclasses
import json
import math
import random
from typing import Any

API_KEY = "sk-fuzz"
MODEL = "demo"
VOCAB = 4096
MAX_MODEL_LEN = 128
BODY_CAP = 4 * 2**20

AUTH = (b"authorization", f"Bearer {API_KEY}".encode())
JSON_CT = (b"content-type", b"application/json")


@dataclasses.dataclass
class Case:
    """One request. `endpoint` is the label counted in the report; `stream` is True when the body
    literally says `"stream": true` (a 200 must then be SSE); `expect` is a status the answer must
    have (None: any 200 or 4xx)."""

    endpoint: str
    method: str
    path: str
    body: bytes | None
    headers: list[tuple[bytes, bytes]]
    desc: str
    stream: bool = False
    expect: int | None = None
    chunked: bool = False  # send the body with Transfer-Encoding: chunked (no Content-Length)
    timeout: float | None = None  # seconds to wait for the whole answer (None: the test's default)


class Raw:
    """A JSON value written exactly as `text` (for literals no encoder would produce)."""

    def __init__(self, text: str, label: str | None = None):
        self.text, self.label = text, label or (text if len(text) <= 24 else f"{text[:12]}..<{len(text)} chars>")

    def __repr__(self) -> str:
        return self.label


class Pairs(list):
    """A JSON object given as (key, value) pairs, so keys may repeat."""


def dumps(value: Any, ascii_only: bool = True) -> str:
    """JSON text: NaN / Infinity for non-finite floats, big ints as digits, lone surrogates as
    \\uXXXX escapes (ascii_only) or raw (then encode with 'surrogatepass' to get invalid UTF-8)."""
    if isinstance(value, Raw):
        return value.text
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "Infinity" if value > 0 else "-Infinity"
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=ascii_only)
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{dumps(k, ascii_only)}:{dumps(v, ascii_only)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{dumps(k, ascii_only)}:{dumps(v, ascii_only)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dumps(v, ascii_only) for v in value) + "]"
    raise TypeError(f"cannot encode {type(value)}")


def encode(value: Any, ascii_only: bool = True) -> bytes:
    return dumps(value, ascii_only).encode("utf-8", "surrogatepass")


def short(value: Any, width: int = 28, depth: int = 0) -> str:
    """A compact description of a JSON value for reports."""
    if depth > 3:
        return "..."
    if isinstance(value, Raw):
        return value.label
    if isinstance(value, str):
        text = repr(value) if len(value) <= width else f"{value[:8]!r}..<str {len(value)}>"
        return text
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{short(k, 10, depth + 1)}:{short(v, 10, depth + 1)}" for k, v in value[:3]) + "}"
    if isinstance(value, dict):
        items = list(value.items())
        more = f",..<{len(items)} keys>" if len(items) > 3 else ""
        return "{" + ",".join(f"{short(k, 10, depth + 1)}:{short(v, 10, depth + 1)}" for k, v in items[:3]) + more + "}"
    if isinstance(value, (list, tuple)):
        if len(value) > 3:
            return f"[{short(value[0], 10, depth + 1)},..<list {len(value)}>]"
        return "[" + ",".join(short(v, 10, depth + 1) for v in value) + "]"
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10**12:
        exp = math.log2(abs(value))
        return f"{'-' if value < 0 else ''}2**{exp:.0f}" if exp.is_integer() else f"<int {len(str(value))} digits>"
    return repr(value)


# -- value pools ---------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")
BIG = 10**400  # 401 digits: Python's json parses it (its int limit is 4300 digits)
NUMBERS = [
    -1,
    0,
    1,
    2,
    3,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32,
    2**53 + 1,
    2**63,
    -(2**63),
    2**64,
    BIG,
    -BIG,
    Raw("1e400"),
    Raw("-1e400"),
    Raw("1" + "0" * 5000, "<int 5001 digits>"),
    Raw("1e-99999"),
    Raw("-0"),
    Raw("1.0"),
    Raw("100.0"),
    Raw("1E+2"),
    -0.0,
    0.0,
    1e39,
    -1e39,
    3.4028235e38,
    3.5e38,
    1e308,
    -1e308,
    1e-45,
    5e-324,
    1e-300,
    0.5,
    1.5,
    2.0000001,
    -2.5,
    NAN,
    INF,
    -INF,
]
WRONG_TYPES = ["", "abc", "1", "1.5", "NaN", "true", [], [1], [None], {}, {"a": 1}, None, True, False, [[[]]]]
TEXTS = [
    "hello",
    "",
    " ",
    "\x00",
    "\ud800",
    "a\udfffb",
    "\udc80\ud800",
    "\ud83d",
    "x\ud83d\ude00\ud800",
    "\U0001f600",
    "\U0010ffff",
    "\ufeff",
    "\u202e\u0645\u0631\u062d\u0628\u0627",
    "<|user|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "{{ messages }}",
    "{% for x in range(10**9) %}x{% endfor %}",
    "\n" * 50,
    "\u00e9" * 100,
    "x" * 5000,
    "\\",
    '"',
    "\u65e5\u672c\u8a9e",
    "\r\n\t\b\f",
    "\u2028\u2029",
    "e\u0301\u0301\u0301",
]
LONE_SURROGATES = ["\ud800", "\udfff", "a\udfffb", "\udc80\ud800", "\ud83d", "ok\udbff"]
WORDS = ["and", "the", "earth", "lord", "said", "unto", "him", "light", "water", "\U0001f600", "\u00e9t\u00e9"]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _long_text(rng: random.Random, size: int) -> str:
    """ASCII text of exactly `size` characters (so its JSON length is predictable)."""
    words = [w for w in WORDS if w.isascii()]
    block = " ".join(rng.choice(words) for _ in range(20_000)) + " "  # ~100 KB, repeated
    return (block * (size // len(block) + 1))[:size]


def _any_value(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.45:
        return rng.choice(NUMBERS)
    if r < 0.75:
        return rng.choice(WRONG_TYPES)
    return rng.choice(TEXTS)


def _nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


# -- field-specific hostile values ---------------------------------------------------------------


def _prompt_values(rng: random.Random) -> list:
    return [
        rng.choice(TEXTS),
        [rng.choice(TEXTS), "ok"],
        [],
        [[]],
        [""],
        [1, 2, 3],
        [0],
        [4095],
        [4096],
        [-1],
        [2**31],
        [2**63],
        [BIG],
        [[1, 2], [99999]],
        [[1], []],
        [1.5],
        [True, False],
        [None],
        [["a"]],
        5,
        None,
        {},
        {"prompt": "x"},
        [1, "a"],
        [[1, 2], "a"],
        _nested(200),
        Raw("NaN"),
        [NAN],
        [INF],
        ["x"] * 300,
        [[4095] * 3] * 20,
        [[5000]],
        [[-5]],
        rng.choice(LONE_SURROGATES),
        [rng.choice(LONE_SURROGATES)],
    ]


def _stop_values(rng: random.Random) -> list:
    return [
        rng.choice(TEXTS),
        [rng.choice(TEXTS)],
        [""],
        ["a"] * 17,
        ["stop"] * 1000,
        [None],
        [1],
        1,
        True,
        {},
        ["x" * 100_000],
        rng.choice(LONE_SURROGATES),
        ["ok", rng.choice(LONE_SURROGATES)],
        [[]],
        [NAN],
        ["a"] * 16,
    ]


def _stop_token_id_values(rng: random.Random) -> list:
    return [
        [0],
        [1],
        [4095],
        [4096],
        [-1],
        [2**31],
        [2**63],
        [BIG],
        "1",
        [1.5],
        [None],
        list(range(10_000)),
        [Raw("1e400")],
        7,
        {"0": 1},
    ]


def _logit_bias_values(rng: random.Random) -> list:
    return [
        {"1": 5},
        {},
        {"abc": NAN},
        {rng.choice(LONE_SURROGATES): 1},
        [],
        "x",
        {"1": BIG},
        {"1": "x"},
        {"-1": 100},
        {"99999999999999999999": -100},
        None,
    ]


def _stream_options_values(rng: random.Random) -> list:
    return [
        {"include_usage": True},
        {"include_usage": "x"},
        None,
        [],
        "yes",
        {"include_usage": NAN},
        {"unknown": 1},
        {"include_usage": None},
        {"include_usage": 1},
        True,
    ]


def _message(rng: random.Random) -> Any:
    role, content = rng.choice(["user", "system", "assistant"]), _text(rng, rng.randint(1, 6))
    r = rng.random()
    if r < 0.15:
        role = rng.choice(TEXTS + WRONG_TYPES + LONE_SURROGATES)
    elif r < 0.35:
        content = rng.choice(TEXTS + WRONG_TYPES + LONE_SURROGATES + NUMBERS)
    elif r < 0.5:
        part = rng.choice(
            [
                {"type": "text", "text": rng.choice(TEXTS)},
                {"type": "image_url", "image_url": {"url": "http://x"}},
                {"type": "text"},
                {"text": "x"},
                {"type": rng.choice(LONE_SURROGATES), "text": "x"},
                {"type": 1},
                {"type": "text", "text": rng.choice(LONE_SURROGATES)},
                "text",
                None,
                {"type": "text", "text": [1]},
            ]
        )
        content = [part, {"type": "text", "text": "ok"}]
    elif r < 0.6:
        return rng.choice(
            [
                {},
                {"role": "user"},
                {"content": "x"},
                "user",
                None,
                [],
                5,
                {"role": "user", "content": "x", "name": rng.choice(TEXTS + WRONG_TYPES)},
                {"role": "user", "content": "x", "tool_calls": [{"id": 1}], "extra": {"deep": [[[]]]}},
            ]
        )
    return {"role": role, "content": content}


def _messages_values(rng: random.Random) -> list:
    return [
        [],
        {},
        "hi",
        None,
        5,
        [_message(rng)],
        [_message(rng), _message(rng)],
        [{"role": "user", "content": "x"}] * 2000,
        [{"role": "system", "content": "be brief"}],
        [{"role": "user", "content": _nested(200, "x")}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}] * 500}],
        _nested(200, {"role": "user", "content": "x"}),
    ]


_SPECIFIC = {
    "prompt": _prompt_values,
    "stop": _stop_values,
    "stop_token_ids": _stop_token_id_values,
    "logit_bias": _logit_bias_values,
    "stream_options": _stream_options_values,
    "messages": _messages_values,
}

SHARED_FIELDS = [
    "model",
    "n",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "cache_salt",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "max_tokens",
]
COMPLETION_FIELDS = SHARED_FIELDS + ["prompt", "logprobs", "echo", "suffix"]
CHAT_FIELDS = SHARED_FIELDS + ["messages", "max_completion_tokens", "logprobs", "top_logprobs", "add_generation_prompt"]
STR_FIELDS = {"model", "user", "cache_salt", "suffix"}


def _field_value(rng: random.Random, field: str) -> Any:
    if field in _SPECIFIC and rng.random() < 0.7:
        return rng.choice(_SPECIFIC[field](rng))
    if field in STR_FIELDS and rng.random() < 0.5:
        return rng.choice(TEXTS + LONE_SURROGATES + [MODEL, "other-model"])
    if field in ("n", "logprobs", "top_logprobs", "max_tokens", "max_completion_tokens") and rng.random() < 0.4:
        return rng.choice([0, 1, 5, 20, 21, 64, 100, 127, 128, 129, 4096, 10**6, 2**31, -1])
    return _any_value(rng)


# -- valid requests (cheap) ----------------------------------------------------------------------


def _valid_completion(rng: random.Random) -> dict:
    r = rng.random()
    if r < 0.5:
        prompt: Any = _text(rng, rng.randint(1, 8))
    elif r < 0.65:
        prompt = [_text(rng, rng.randint(1, 5)) for _ in range(rng.randint(1, 3))]
    elif r < 0.8:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
    elif r < 0.9:
        prompt = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))] for _ in range(rng.randint(1, 3))]
    else:
        prompt = rng.choice(["", "\x00", "\U0001f600\u65e5\u672c", "<|user|>", "\u202e\ufeff"])
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": rng.randint(1, 4)}
    if rng.random() < 0.7:
        body["model"] = MODEL
    _valid_sampling(rng, body)
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 5)
    return body


def _valid_chat(rng: random.Random) -> dict:
    messages = [{"role": "user", "content": _text(rng, rng.randint(1, 6))}]
    if rng.random() < 0.4:
        messages.insert(0, {"role": "system", "content": "be brief"})
    if rng.random() < 0.2:
        messages[-1]["content"] = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    body: dict[str, Any] = {"messages": messages}
    body["max_completion_tokens" if rng.random() < 0.5 else "max_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.7:
        body["model"] = MODEL
    _valid_sampling(rng, body)
    if rng.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = rng.randint(0, 5)
    return body


def _valid_sampling(rng: random.Random, body: dict) -> None:
    if rng.random() < 0.5:
        body["temperature"] = 0
    else:
        body["temperature"] = rng.choice([0.5, 1.0])
        if rng.random() < 0.4:
            body["n"] = rng.randint(1, 3)
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([1, 10, 10**9])
        if rng.random() < 0.3:
            body["top_p"] = rng.choice([0.5, 1])
        if rng.random() < 0.3:
            body["seed"] = rng.choice([0, 7, 2**40, -5])
    if rng.random() < 0.3:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.2:
        body["stop"] = rng.choice(["\n", ["the", "and"]])
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if rng.random() < 0.1:  # accepted with no effect (jaxpaged/server/fields.py); unknown fields are a 400
        body[rng.choice(["user", "metadata", "store"])] = {"nested": [1, 2, {"x": None}]}


def _cost(body: Any, chat: bool) -> int:
    """Rough tokens to generate if the body happened to be valid (to keep fuzzing cheap)."""
    if not isinstance(body, dict):
        return 0

    def as_int(key, default):
        v = body.get(key, default)
        try:  # pydantic's lax mode reads 100.0, "100", true and 1E+2 as ints
            v = int(float(v.text if isinstance(v, Raw) else v))
        except (TypeError, ValueError, OverflowError):
            return default
        return v if 0 < v <= 10**6 else default

    prompt = body.get("prompt")
    num = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    max_tokens = (
        as_int("max_completion_tokens", as_int("max_tokens", MAX_MODEL_LEN)) if chat else as_int("max_tokens", 16)
    )
    return num * max(as_int("n", 1), 1) * min(max_tokens, MAX_MODEL_LEN)


# -- request assembly ------------------------------------------------------------------------------


def _post(endpoint: str, path: str, body: Any, desc: str, *, headers=None, expect=None, ascii_only=True) -> Case:
    stream = isinstance(body, dict) and body.get("stream") is True
    return Case(endpoint, "POST", path, encode(body, ascii_only), headers or [AUTH, JSON_CT], desc, stream, expect)


def _mutated(rng: random.Random, chat: bool) -> Case:
    """A valid body with 1-3 fields replaced by hostile values (or removed), plus extras."""
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for _ in range(50):
        body = _valid_chat(rng) if chat else _valid_completion(rng)
        changes = []
        for field in rng.sample(fields, rng.randint(1, 3)):
            if rng.random() < 0.08:
                body.pop(field, None)
                changes.append(f"-{field}")
            else:
                body[field] = _field_value(rng, field)
                changes.append(f"{field}={short(body[field])}")
        if rng.random() < 0.1:
            key = rng.choice(["foo", "\ud800", "", "n\u0000", "x" * 300, "__proto__", "constructor"])
            body[key] = _any_value(rng)
            changes.append(f"extra {short(key, 10)}")
        if rng.random() < 0.25 and "stream" not in body:
            body["stream"] = True
            changes.append("stream=True")
        if _cost(body, chat) <= 1500:
            break
    else:
        raise AssertionError("could not draw a cheap mutation")
    endpoint = "chat" if chat else "completions"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return _post(endpoint, path, body, f"{endpoint} mutate " + "; ".join(changes))


def _tokenize_case(rng: random.Random) -> Case:
    r = rng.random()
    if r < 0.12:
        body: Any = (
            {"prompt": _text(rng, 5)} if rng.random() < 0.5 else {"messages": [{"role": "user", "content": "hi"}]}
        )
        body["model"] = MODEL
        return _post("tokenize", "/tokenize", body, f"tokenize valid {short(body)}", expect=200)
    if r < 0.5:
        body = {"prompt": rng.choice(TEXTS + LONE_SURROGATES + WRONG_TYPES + NUMBERS)}
    elif r < 0.7:
        body = {"messages": rng.choice(_messages_values(rng))}
    elif r < 0.8:
        body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    else:
        body = {"prompt": "hello"}
        for key in rng.sample(["model", "add_special_tokens", "add_generation_prompt", "prompt"], 2):
            body[key] = _any_value(rng) if key != "model" else rng.choice(TEXTS + LONE_SURROGATES + WRONG_TYPES)
    if rng.random() < 0.05:
        body = rng.choice([[], "x", None, 5, _nested(200, {})])
    return _post("tokenize", "/tokenize", body, f"tokenize {short(body, 40)}")


def _detokenize_case(rng: random.Random) -> Case:
    r = rng.random()
    if r < 0.12:
        body: Any = {"tokens": [rng.randrange(VOCAB) for _ in range(rng.randint(0, 10))], "model": MODEL}
        return _post("detokenize", "/detokenize", body, f"detokenize valid {short(body)}", expect=200)
    tokens = rng.choice(
        [
            [-1],
            [4096],
            [2**31],
            [2**63],
            [BIG],
            [-BIG],
            [NAN],
            [INF],
            [1.5],
            [Raw("1.0")],
            ["1"],
            [None],
            [True],
            "1 2",
            None,
            {},
            [[1]],
            [0, 1, 4095, 4096, -1, 2**70],
            [Raw("1" + "0" * 5000, "<int 5001 digits>")],
            [Raw("1e400")],
            _nested(200),
        ]
    )
    body = {"tokens": tokens}
    if rng.random() < 0.2:
        body["model"] = rng.choice(TEXTS + LONE_SURROGATES + WRONG_TYPES)
    if rng.random() < 0.05:
        body = rng.choice([[], "x", None, 5, {"token": [1]}])
    return _post("detokenize", "/detokenize", body, f"detokenize {short(body, 40)}")


def _get_case(rng: random.Random, endpoint: str) -> Case:
    path = "/v1/models" if endpoint == "models" else "/health"
    headers = [AUTH]
    desc, expect = f"GET {path}", 200
    r = rng.random()
    if r < 0.3:
        path += rng.choice(["?x=1", "?model=%ff%fe", "?a=" + "b" * 2000, "?\u00e9=%ed%a0%80", "#frag"])
        desc += " with query"
    elif r < 0.45:
        return Case(
            endpoint,
            "GET",
            path,
            b'{"x": NaN, "y": "\xed\xa0\x80"',
            [AUTH, JSON_CT],
            f"{desc} with junk body",
            expect=200,
        )
    elif r < 0.55:
        headers = [AUTH, (b"accept", rng.choice([b"text/html", b"\xff\xfe", b"*/*;q=NaN"]))]
        desc += " odd accept"
    return Case(endpoint, "GET", path, None, headers, desc, expect=expect)


AUTH_VALUES = [
    (None, "missing key"),
    (b"Bearer wrong", "wrong key"),
    (b"Bearer " + API_KEY.encode() + b"x", "key+suffix"),
    (b"Bearer " + API_KEY[:-1].encode(), "key prefix"),
    (b"bearer " + API_KEY.encode(), "lowercase scheme"),
    (b"Basic c2stZnV6ejo=", "Basic scheme"),
    (b"Token " + API_KEY.encode(), "Token scheme"),
    (API_KEY.encode(), "no scheme"),
    (b"Bearer", "scheme only"),
    (b"Bearer  " + API_KEY.encode(), "two spaces"),
    (b"", "empty value"),
    (b"Bearer \xff\xfe\xfd", "latin-1 bytes"),
    (b"Bearer sk-fuzz\xe9", "key+latin-1 byte"),
    ("Bearer sk-f\u00fczz".encode(), "utf-8 umlaut"),
    (b"\xed\xa0\x80", "surrogate bytes"),
    (b"Bearer " + b"k" * 8000, "8000-byte key"),
    (b"Bearer sk-fuzz\x7f", "DEL byte"),
]


REJECTED = {
    "missing key",
    "wrong key",
    "key+suffix",
    "key prefix",
    "Basic scheme",
    "Token scheme",
    "scheme only",
    "empty value",
    "latin-1 bytes",
    "key+latin-1 byte",
    "utf-8 umlaut",
    "surrogate bytes",
    "8000-byte key",
    "DEL byte",
}


def _auth_case(rng: random.Random) -> Case:
    target = rng.choice(
        [
            ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
            ("POST", "/tokenize", {"prompt": "hi"}),
            ("POST", "/detokenize", {"tokens": [1, 2]}),
            ("GET", "/v1/models", None),
            ("GET", "/metrics", None),
            ("GET", "/version", None),
            ("GET", "/health", None),
        ]
    )
    method, path, body = target
    r = rng.random()
    good = AUTH[1]
    if r < 0.25:
        pair = rng.choice(
            [
                (good, b"Bearer wrong"),
                (b"Bearer wrong", good),
                (good, good),
                (b"Bearer a", b"Bearer b"),
                (good, b"\xff"),
                (b"", good),
            ]
        )
        headers = [(b"authorization", pair[0]), (b"authorization", pair[1])]
        desc = f"two Authorization headers {pair[0][:12]!r},{pair[1][:12]!r}"
    else:
        value, desc = rng.choice(AUTH_VALUES)
        headers = [] if value is None else [(rng.choice([b"authorization", b"Authorization", b"AUTHORIZATION"]), value)]
    if body is not None:
        headers.append(JSON_CT)
    # /health needs no key; /metrics may be open (as in vLLM) or not; elsewhere a key that is
    # plainly wrong or missing must get 401
    expect = 200 if path == "/health" else None if path == "/metrics" else 401 if desc in REJECTED else None
    return Case(
        "auth",
        method,
        path,
        None if body is None else encode(body),
        headers,
        f"auth {method} {path}: {desc}",
        expect=expect,
    )


def _other_case(rng: random.Random) -> Case:
    method, path = rng.choice(
        [
            ("GET", "/v1/completions"),
            ("PUT", "/v1/chat/completions"),
            ("DELETE", "/tokenize"),
            ("OPTIONS", "/v1/models"),
            ("GET", "/nope"),
            ("POST", "/v1/models"),
            ("GET", "/v1/models/demo"),
            ("POST", "/v1/completions/x"),
            ("GET", "/v1/models/"),
            ("GET", "/health/"),
            ("PATCH", "/detokenize"),
            ("GET", "/%ff%fe"),
            ("GET", "/v1/../health"),
            ("GET", "/v1//models"),
            ("POST", "/v1/embeddings"),
            ("GET", "/docs"),
            ("GET", "/openapi.json"),
            ("GET", "/version"),
            ("GET", "/metrics"),
            ("TRACE", "/health"),
        ]
    )
    body = b'{"prompt": "x"}' if method in ("POST", "PUT", "PATCH") else None
    return Case("other", method, path, body, [AUTH, JSON_CT] if body else [AUTH], f"{method} {path}")


# -- hand-written cases ------------------------------------------------------------------------------


def _special(rng: random.Random) -> list[Case]:
    cases = []
    add = cases.append
    C, CH = "/v1/completions", "/v1/chat/completions"
    chat_msg = [{"role": "user", "content": "hi"}]

    def raw(endpoint, path, data: bytes, desc, headers=None, expect=None, stream=False):
        add(Case(endpoint, "POST", path, data, headers or [AUTH, JSON_CT], desc, stream, expect))

    # list amplification: one bad element per item of a long list (each answer must stay small)
    for desc, body in (
        ("prompt: [1.5] * 200,000", {"prompt": [1.5] * 200_000}),
        ("prompt: [{}] * 200,000", {"prompt": [{}] * 200_000}),
        ("prompt: [[1.5]] * 100,000", {"prompt": [[1.5]] * 100_000}),
        ("prompt: [5] * 200,000 (over max_model_len)", {"prompt": [5] * 200_000}),
        ("stop_token_ids: [1] * 5,000 (over --max-stop-token-ids)", {"prompt": "a", "stop_token_ids": [1] * 5_000}),
        ("stop_token_ids: ['x'] * 500", {"prompt": "a", "stop_token_ids": ["x"] * 500}),
        ("stop: [1] * 100,000", {"prompt": "a", "stop": [1] * 100_000}),
        ("logit_bias of 100,000 bad entries", {"prompt": "a", "logit_bias": {str(i): "x" for i in range(100_000)}}),
        ("cache_salt of 100,000 characters", {"prompt": "a", "cache_salt": "s" * 100_000}),
        ("model name of 1 MiB", {"prompt": "a", "model": "m" * 2**20}),
    ):
        raw("completions", C, encode(body), f"list amplification: {desc}", expect=400 if "model" not in body else 404)
    for desc, body in (
        ("messages: [{'role': 1}] * 100,000", {"messages": [{"role": 1}] * 100_000}),
        ("content parts: [{}] * 100,000", {"messages": [{"role": "user", "content": [{}] * 100_000}]}),
        ("a role of 1 MiB", {"messages": [{"role": "u" * 2**20, "content": "hi"}]}),
        ("a name of 1 MiB", {"messages": [{"role": "user", "name": "n" * 2**20, "content": "hi"}]}),
    ):
        raw("chat", CH, encode(body), f"list amplification: {desc}", expect=400)
    raw("tokenize", "/detokenize", encode({"tokens": [1.5] * 200_000}), "detokenize: [1.5] * 200,000", expect=400)

    # bodies over and under the 4 MiB cap
    over = BODY_CAP + 17
    big = encode({"prompt": _long_text(rng, over - 20), "max_tokens": 1})
    raw("completions", C, big, "body just over 4 MiB (Content-Length)", expect=413)
    over_chat = encode({"messages": [{"role": "user", "content": _long_text(rng, over)}]})
    raw("chat", CH, over_chat, "chat body just over 4 MiB", expect=413)
    raw("tokenize", "/tokenize", encode({"prompt": _long_text(rng, over)}), "tokenize body just over 4 MiB", expect=413)
    raw("completions", C, b"[" * (BODY_CAP + 1), "4 MiB + 1 of '['", expect=413)
    chunk_body = encode({"prompt": _long_text(rng, over), "max_tokens": 1})
    add(
        Case(
            "completions",
            "POST",
            C,
            chunk_body,
            [AUTH, JSON_CT],
            "body just over 4 MiB, chunked (no Content-Length)",
            expect=413,
            chunked=True,
        )
    )
    add(
        Case(
            "completions",
            "POST",
            C,
            b" " * (BODY_CAP + 1),
            [AUTH, JSON_CT],
            "4 MiB + 1 spaces, chunked",
            expect=413,
            chunked=True,
        )
    )
    raw("completions", C, encode({"prompt": _long_text(rng, 2**20), "max_tokens": 1}), "1 MiB prompt")
    raw("completions", C, encode({"prompt": _long_text(rng, BODY_CAP - 64), "max_tokens": 1}), "4 MiB - 30 B prompt")
    raw("chat", CH, encode({"messages": [{"role": "user", "content": _long_text(rng, 2**20)}]}), "1 MiB chat content")
    raw("tokenize", "/tokenize", encode({"prompt": _long_text(rng, 2**20)}), "tokenize 1 MiB prompt")
    for count, expect in ((MAX_MODEL_LEN, 200), (200_000, 400)):  # no sequence is longer than max_model_len
        tokens = [rng.randrange(VOCAB) for _ in range(count)]
        raw("detokenize", "/detokenize", encode({"tokens": tokens}), f"detokenize {count} tokens", expect=expect)
    raw("completions", C, encode({"prompt": [[1, 2, 3]] * 100_000, "max_tokens": 1}), "100k token-id prompts")
    raw("completions", C, encode({"prompt": ["x"] * 100_000 + [5], "max_tokens": 1}), "100k prompts, last an int")
    raw("chat", CH, encode({"messages": [{"role": "user", "content": "x"}] * 50_000}), "50k chat messages")
    raw("completions", C, encode({"prompt": "hi", "stop": ["s"] * 100_000}), "100k stop strings")
    raw("completions", C, encode({"prompt": "hi", "stop_token_ids": [5] * 200_000}), "200k stop_token_ids")

    # deep nesting
    for depth in (200, 900, 5_000, 100_000):
        raw("completions", C, b"[" * depth + b"]" * depth, f"{depth} nested lists (closed)")
        raw(
            "completions",
            C,
            b'{"prompt": ' + b"[" * depth + b"]" * depth + b', "max_tokens": 1}',
            f"prompt = {depth} nested lists",
        )
        raw(
            "chat",
            CH,
            b'{"messages": [{"role": "user", "content": ' + b"[" * depth + b"]" * depth + b"}]}",
            f"chat content = {depth} nested lists",
        )
        raw(
            "tokenize",
            "/tokenize",
            b'{"prompt": "x", "extra": ' + b'{"a":' * depth + b"1" + b"}" * depth + b"}",
            f"tokenize extra field = {depth} nested objects",
        )
    raw("completions", C, b"[" * 100_000, "100k unclosed '['")
    raw("detokenize", "/detokenize", b'{"tokens": ' + b"[" * 3_000_000, "3M unclosed '[' (under the cap)")
    raw("completions", C, b'{"a":' * 500_000, "500k unclosed objects")

    # empty / not JSON / odd content types
    raw("completions", C, b"", "empty body")
    raw("chat", CH, b"", "chat empty body")
    raw("tokenize", "/tokenize", b"", "tokenize empty body")
    raw("detokenize", "/detokenize", b"", "detokenize empty body")
    raw("completions", C, b"null", "body null")
    raw("completions", C, b'"prompt"', "body is a string")
    raw("completions", C, b"[]", "body is a list")
    raw("completions", C, b"1e400", "body is 1e400")
    raw("completions", C, b"NaN", "body is NaN")
    raw("completions", C, b"{", "truncated object")
    raw("completions", C, b'{"prompt": "hi",}', "trailing comma")
    raw("completions", C, b"{'prompt': 'hi'}", "single quotes")
    raw("completions", C, b'{"prompt": "hi"} {"prompt": "x"}', "two JSON documents")
    raw("completions", C, b'{"prompt": "hi", "max_tokens": 1}\x00', "trailing NUL")
    raw("completions", C, b'\xef\xbb\xbf{"prompt": "hi", "max_tokens": 1}', "UTF-8 BOM")
    raw("completions", C, '{"prompt": "hi", "max_tokens": 1}'.encode("utf-16"), "UTF-16 body with BOM")
    raw("completions", C, '{"prompt": "hi", "max_tokens": 1}'.encode("utf-32-le"), "UTF-32-LE body")
    raw("completions", C, b'{"prompt": "\\u', "truncated escape")
    raw("completions", C, b'{"prompt": "\\x41"}', "invalid escape \\x")
    raw("completions", C, b'{"prompt": "a\nb", "max_tokens": 1}', "raw newline in string")
    body = b'{"prompt": "hi", "max_tokens": 1}'
    for ct in [
        b"text/plain",
        b"application/x-www-form-urlencoded",
        b"multipart/form-data; boundary=abc",
        b"application/json; charset=latin-1",
        b"application/json; charset=utf-16",
        b"application/vnd.x+json",
        b"application/JSON",
        b"",
        b"application/json\xff",
        b"application/json; boundary=\xe9\xe9",
        b"*/*",
        b"application/octet-stream",
        b"application/json, text/plain",
    ]:
        raw("completions", C, body, f"content-type {ct[:40]!r}", headers=[AUTH, (b"content-type", ct)])
    raw("completions", C, body, "no content-type", headers=[AUTH])
    raw(
        "completions",
        C,
        b"prompt=hi&max_tokens=1",
        "form body",
        headers=[AUTH, (b"content-type", b"application/x-www-form-urlencoded")],
    )
    raw(
        "completions",
        C,
        b'--abc\r\nContent-Disposition: form-data; name="prompt"\r\n\r\nhi\r\n--abc--\r\n',
        "multipart body",
        headers=[AUTH, (b"content-type", b"multipart/form-data; boundary=abc")],
    )
    raw("chat", CH, b'{"messages": [{"role": "user", "content": "hi"}]', "chat truncated", headers=[AUTH, JSON_CT])

    # invalid UTF-8 in the body
    for data, what in [
        (b'{"prompt": "\xed\xa0\x80"}', "CESU surrogate bytes"),
        (b"\xff\xfe", "bytes ff fe"),
        (b'{"prompt": "\xe2\x82"}', "truncated 3-byte sequence"),
        (b'{"prompt": "\xc0\xaf"}', "overlong"),
        (b'{"prompt": "abc\xff", "max_tokens": 1}', "0xff in string"),
        (b"\xff" * 100, "100 x 0xff"),
        (b'{"prompt": "\xf4\x90\x80\x80"}', "above U+10FFFF"),
        (b'{"\xed\xb0\x80": 1}', "surrogate key"),
        (b'{"prompt": "hi", "max_tokens": 1, "stream": true, "user": "\xed\xa0\x80"}', "stream + bad user"),
        (b'{"prompt": "\xe9t\xe9"}', "latin-1 text"),
        (b"\xfe\xff\x00{", "UTF-16-BE BOM junk"),
        (b"\x00\x00\x00{", "UTF-32 junk"),
    ]:
        raw("completions", C, data, f"invalid UTF-8: {what}")
    raw("chat", CH, b'{"messages": [{"role": "\xed\xa0\x80", "content": "\xff"}]}', "chat invalid UTF-8 role/content")
    raw("tokenize", "/tokenize", b'{"prompt": "\xed\xbf\xbf"}', "tokenize CESU bytes")
    raw("detokenize", "/detokenize", b'{"tokens": [1, 2\xff]}', "detokenize 0xff in list")
    for surrogate in LONE_SURROGATES:
        s = surrogate
        raw(
            "completions",
            C,
            encode({"prompt": "a", "max_tokens": 1, "stream": True, "stop": [s]}),
            f"stream + stop {s!r}",
            stream=True,
        )
        raw("completions", C, encode({"prompt": s, "max_tokens": 1}, ascii_only=False), f"prompt {s!r} as raw bytes")
        raw("completions", C, encode({"prompt": [s, "ok"], "max_tokens": 1}), f"prompt list with {s!r}")
        raw("tokenize", "/tokenize", encode({"prompt": s}), f"tokenize prompt {s!r}")
        raw("chat", CH, encode({"messages": [{"role": s, "content": s}]}), f"chat role+content {s!r}")
        raw("tokenize", "/tokenize", encode({"messages": [{"role": "user", "content": s}]}), f"tokenize messages {s!r}")
        for field in ("model", "user", "cache_salt", "suffix"):
            raw("completions", C, encode({"prompt": "a", "max_tokens": 1, field: s}), f"{field} {s!r}")

    # NaN / Infinity everywhere, as raw text
    for lit in ("NaN", "Infinity", "-Infinity", "1e400", "-0.0", "1e-400", "nan", "inf", "+1", "01", ".5", "0x10"):
        for field in ("temperature", "top_p", "n", "max_tokens", "presence_penalty", "seed", "min_p", "top_k"):
            raw("completions", C, f'{{"prompt": "a", "max_tokens": 2, "{field}": {lit}}}'.encode(), f"{field}: {lit}")
        raw(
            "chat",
            CH,
            f'{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": 1, "top_logprobs": {lit}, '
            f'"logprobs": true}}'.encode(),
            f"chat top_logprobs: {lit}",
        )
        raw("detokenize", "/detokenize", f'{{"tokens": [{lit}]}}'.encode(), f"detokenize tokens [{lit}]")

    # duplicate keys (the last wins in Python's json)
    raw("completions", C, encode(Pairs([("prompt", "a"), ("max_tokens", 1), ("max_tokens", 10**9)])), "dup max_tokens")
    raw(
        "completions",
        C,
        encode(Pairs([("prompt", "a"), ("max_tokens", 1), ("stream", True), ("stream", "x")])),
        "dup stream",
    )
    raw(
        "completions",
        C,
        encode(Pairs([("prompt", "\ud800"), ("prompt", "ok"), ("max_tokens", 1)])),
        "dup prompt, first a lone surrogate",
    )

    # n, logprobs, max_tokens at and past their limits (cheap when valid: one short prompt)
    for n in (0, -1, 2, 128, 129, 1000, 2**31, 2**63, BIG):
        raw("completions", C, encode({"prompt": "a", "max_tokens": 2, "n": n, "temperature": 1}), f"n={short(n)}")
        raw("chat", CH, encode({"messages": chat_msg, "max_tokens": 1, "n": n, "temperature": 1}), f"chat n={short(n)}")
    raw(
        "completions",
        C,
        encode({"prompt": "a", "max_tokens": 1, "n": 128, "temperature": 1, "stream": True}),
        "n=128 stream",
        stream=True,
        expect=200,
    )
    raw("completions", C, encode({"prompt": ["p"] * 1000, "max_tokens": 1}), "1000 prompts, max_tokens=1")
    raw(
        "completions",
        C,
        encode({"prompt": ["p"] * 20, "max_tokens": 1, "n": 128, "temperature": 1}),
        "20 prompts x n=128",
    )
    for lp in (-1, 0, 5, 20, 21, 4095, 4096, 10**6, 2**31, BIG, True, 1.5):
        raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "logprobs": lp}), f"logprobs={short(lp)}")
        raw(
            "chat",
            CH,
            encode({"messages": chat_msg, "max_tokens": 1, "logprobs": True, "top_logprobs": lp}),
            f"chat top_logprobs={short(lp)}",
        )
    raw("chat", CH, encode({"messages": chat_msg, "max_tokens": 1, "top_logprobs": 3}), "top_logprobs without logprobs")
    for mt in (0, -1, 126, 127, 128, 129, 10**6, 2**31 - 1, 2**31, 2**63, BIG):
        raw(
            "completions",
            C,
            encode({"prompt": "a", "max_tokens": mt, "stream": True}),
            f"max_tokens={short(mt)}",
            stream=True,
        )
        raw(
            "chat",
            CH,
            encode({"messages": chat_msg, "max_completion_tokens": mt}),
            f"chat max_completion_tokens={short(mt)}",
        )
    raw("completions", C, encode({"prompt": "a", "max_tokens": 2, "min_tokens": 5}), "min_tokens > max_tokens")
    raw(
        "completions",
        C,
        encode({"prompt": "a", "max_tokens": 3, "min_tokens": 3, "stop_token_ids": [1]}),
        "min_tokens = max_tokens",
        expect=200,
    )
    for ids in ([4095], [4096], [-1], [2**31], [2**63], [BIG], [0], [[4096]], [[1], [-1]], [[0, 4095], [4096, 1]]):
        raw("completions", C, encode({"prompt": ids, "max_tokens": 1}), f"token-id prompt {short(ids)}")
        raw(
            "completions",
            C,
            encode({"prompt": ids, "max_tokens": 1, "stream": True}),
            f"stream token-id prompt {short(ids)}",
            stream=True,
        )
    raw("completions", C, encode({"prompt": list(range(127)), "max_tokens": 1}), "127-token prompt + 1", expect=200)
    raw("completions", C, encode({"prompt": list(range(128)), "max_tokens": 1}), "128-token prompt + 1", expect=400)
    raw("completions", C, encode({"prompt": list(range(127)), "max_tokens": None}), "127-token prompt, max_tokens null")
    for stop in (["a"] * 16, ["a"] * 17, ["a"] * 10_000, ["x" * 1_000_000], [""], "", ["\x00"]):
        raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "stop": stop}), f"stop {short(stop)}")
    raw(
        "completions",
        C,
        encode({"prompt": "a", "max_tokens": 1, "stop": [_text(rng, 3)] * 16, "stream": True}),
        "16 stop strings, stream",
        stream=True,
        expect=200,
    )
    raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "echo": True}), "echo")
    raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "suffix": "b"}), "suffix")
    raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "seed": BIG}), "seed 10**400")
    raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "seed": -BIG, "temperature": 1}), "seed -10**400")
    raw("completions", C, encode({"prompt": "a", "max_tokens": 1, "top_k": BIG, "temperature": 1}), "top_k 10**400")
    raw(
        "chat",
        CH,
        encode({"messages": chat_msg, "max_tokens": 1, "stream": True, "stream_options": None}),
        "chat stream, stream_options null",
        stream=True,
        expect=200,
    )
    raw("chat", CH, encode({"messages": [{"role": "user", "content": None}], "max_tokens": 1}), "chat content null")
    raw("chat", CH, encode({"messages": [{"role": "x" * 100_000, "content": "hi"}], "max_tokens": 1}), "100k-char role")
    raw(
        "chat",
        CH,
        encode({"messages": [{"role": "user", "content": "{{ 7 * 7 }}{% raise %}"}], "max_tokens": 1}),
        "chat template-like content",
        expect=200,
    )
    raw(
        "chat",
        CH,
        encode({"messages": chat_msg, "add_generation_prompt": False, "max_tokens": 1}),
        "no generation prompt",
        expect=200,
    )
    raw("tokenize", "/tokenize", encode({"prompt": "a", "add_special_tokens": "no"}), "tokenize add_special_tokens str")
    raw("tokenize", "/tokenize", encode({}), "tokenize {}")
    raw("detokenize", "/detokenize", encode({"tokens": []}), "detokenize []", expect=200)
    raw("detokenize", "/detokenize", encode({"tokens": [0, 1, 2]}), "detokenize specials", expect=200)

    # a burst: multi-prompt requests whose later prompt the engine rejects, between short valid
    # ones; the rejected request must not disturb requests in flight (each must still finish)
    for i in range(24):
        bad = [[[1, 2], [VOCAB]], [[5], [-1]], [[7, 8, 9], [2**31]], [[3], [4], [VOCAB + 7]]][i % 4]
        raw(
            "completions",
            C,
            encode({"prompt": bad, "max_tokens": 1}),
            f"burst: token-id prompts {short(bad)}",
            expect=400,
        )
        for stream in (False, True):
            body = {"prompt": _text(rng, 2), "max_tokens": 1, "stream": stream}
            add(
                Case(
                    "completions",
                    "POST",
                    C,
                    encode(body),
                    [AUTH, JSON_CT],
                    f"burst: valid max_tokens=1 stream={stream} beside rejected multi-prompt requests",
                    stream,
                    200,
                    timeout=10,
                )
            )
    return cases


def generate_cases(seed: int = 20250101, scale: float = 1.0) -> list[Case]:
    """The whole fuzz set: hand-written cases plus `scale` x ~700 drawn ones."""
    rng = random.Random(seed)
    cases = _special(rng)
    plan = [
        ("completions", 230),
        ("chat", 190),
        ("tokenize", 80),
        ("detokenize", 60),
        ("models", 20),
        ("health", 20),
        ("auth", 80),
        ("other", 30),
        ("valid_completion", 45),
        ("valid_chat", 35),
    ]
    drawn = []
    for kind, count in plan:
        for _ in range(max(1, int(count * scale))):
            drawn.append(kind)
    rng.shuffle(drawn)
    for kind in drawn:
        if kind == "completions":
            cases.append(_mutated(rng, chat=False))
        elif kind == "chat":
            cases.append(_mutated(rng, chat=True))
        elif kind == "tokenize":
            cases.append(_tokenize_case(rng))
        elif kind == "detokenize":
            cases.append(_detokenize_case(rng))
        elif kind in ("models", "health"):
            cases.append(_get_case(rng, kind))
        elif kind == "auth":
            cases.append(_auth_case(rng))
        elif kind == "other":
            cases.append(_other_case(rng))
        elif kind == "valid_completion":
            body = _valid_completion(rng)
            cases.append(
                _post("completions", "/v1/completions", body, f"completions valid {short(body, 40)}", expect=200)
            )
        else:
            body = _valid_chat(rng)
            cases.append(_post("chat", "/v1/chat/completions", body, f"chat valid {short(body, 40)}", expect=200))
    return cases
