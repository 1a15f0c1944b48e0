"""Tool calls out of a model's text, whole or as it streams (vLLM's parser names and formats).

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, with free
  text around them (Hermes 2/3, Qwen 2.5).
- `llama3_json`: the reply is a JSON object `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`, several separated by `;` (Llama 3.1/3.2's
  JSON tool calling); a reply that does not start with `{` is plain content.
- `required` (not a flag value): the JSON array `tool_choice: "required"` constrains the output
  to, `[{"name": ..., "parameters": {...}}, ...]`.
- `named`: the whole reply is the arguments of the one function `tool_choice` names.

Each parser is a small state machine over the growing text (`feed` the new text, then `finish`):
it emits content as soon as it cannot be part of a tool call, and each tool call as vLLM streams
it: a first delta with the call's `id`, `type` and `name` (arguments `""`), then fragments of its
arguments. When a call's object names the function first (`{"name": ..., "arguments": {`, as
models and the required schema write it), the head goes out as soon as the name is complete and
the arguments stream as they are generated, as the model wrote them; otherwise the call goes out
once its object is complete (arguments re-serialised). Scanning is incremental, so a long reply
costs time linear in its length. The whole text's result (`extract`) is the same machine run
once, so streamed and whole replies agree.
"""

import json
import re
import uuid

TOOL_CALL_ID_PREFIX = "chatcmpl-tool-"
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
# a call object that names its function before its (object or array) arguments
_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=[{\[])')
HEAD_WINDOW = 1024  # the head must appear within this many characters of the object's start


def tool_call_id() -> str:
    return f"{TOOL_CALL_ID_PREFIX}{uuid.uuid4().hex}"


def _call_from(text: str, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """`(name, arguments JSON text)` of one tool-call object, or None when it is not one."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        return obj["name"], args
    return obj["name"], json.dumps(args, ensure_ascii=False)


class _JsonEnd:
    """Finds where one JSON object or array ends, fed a piece at a time (strings and escapes aware)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.scanned = 0, False, False, 0
        self.end: int | None = None

    def feed(self, text: str) -> int | None:
        """Scans `text` (the value so far, starting at its bracket) past what was scanned before;
        returns the index just past the value's end, or None while it is open."""
        if self.end is not None:
            return self.end
        for i in range(self.scanned, len(text)):
            ch = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.scanned = self.end = i + 1
                    return i + 1
        self.scanned = len(text)
        return None


class ToolCallStream:
    """Deltas (`{"content": ...}` or `{"tool_calls": [...]}`) of one choice, as its text grows.

    Attributes:
      calls: the complete tool calls so far, as OpenAI's `tool_calls` entries.
      content: all content emitted so far.
    """

    def __init__(self, max_calls: int | None = None):
        self.text, self.pos = "", 0  # pos: everything before it has been emitted or consumed
        self.calls: list[dict] = []
        self.content = ""
        self.max_calls = max_calls

    def feed(self, new: str) -> list[dict]:
        self.text += new
        out: list[dict] = []
        self._advance(out, final=False)
        return out

    def finish(self) -> list[dict]:
        out: list[dict] = []
        self._advance(out, final=True)
        self._flush(out)
        return out

    def _advance(self, out: list[dict], final: bool) -> None:
        raise NotImplementedError

    def _flush(self, out: list[dict]) -> None:
        """At the end: whatever is left unconsumed is content."""
        self._emit_content(out, self.text[self.pos :])
        self.pos = len(self.text)

    def _emit_content(self, out: list[dict], text: str) -> None:
        if text:
            self.content += text
            out.append({"content": text})

    def _emit_head(self, out: list[dict], name: str) -> int | None:
        """A new call's first delta; its index (None past `max_calls`: the call is dropped)."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None  # parallel_tool_calls=false: the first call only
        index, call_id = len(self.calls), tool_call_id()
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": ""}})
        head = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        out.append({"tool_calls": [head]})
        return index

    def _emit_arguments(self, out: list[dict], index: int | None, fragment: str) -> None:
        if index is not None and fragment:
            self.calls[index]["function"]["arguments"] += fragment
            out.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})

    def _emit_call(self, out: list[dict], name: str, arguments: str) -> None:
        self._emit_arguments(out, self._emit_head(out, name), arguments)


class _CallObject:
    """One tool-call JSON object as it streams (`text` is the object so far, from its `{`)."""

    def __init__(self, args_keys: tuple[str, ...]):
        self.args_keys, self.end = args_keys, _JsonEnd()
        self.args: _JsonEnd | None = None  # set once the head has gone out
        self.args_start = self.sent = 0
        self.index: int | None = None

    def feed(self, owner: ToolCallStream, text: str, out: list[dict]) -> int | None:
        """Emits what `text` adds; returns the object's end once it is complete (then it has
        been emitted as a call, or as content when it is not one)."""
        end = self.end.feed(text)
        if self.args is None:
            head = _HEAD.match(text[:HEAD_WINDOW])
            if head is not None and (end is not None or len(text) > head.end()):
                self.index = owner._emit_head(out, json.loads(head.group(1)))
                self.args, self.args_start = _JsonEnd(), head.end()
        if self.args is not None:
            args_text = text[self.args_start :]
            args_end = self.args.feed(args_text)
            upto = args_end if args_end is not None else len(args_text)
            owner._emit_arguments(out, self.index, args_text[self.sent : upto])
            self.sent = upto
        elif end is not None:  # no head first: the whole object, parsed
            call = _call_from(text[:end], self.args_keys)
            if call is None:
                owner._emit_content(out, text[:end])
            else:
                owner._emit_call(out, *call)
        return end


class NamedStream(ToolCallStream):
    """`tool_choice` names the function: the whole reply is its arguments, streamed as they come."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def _advance(self, out: list[dict], final: bool) -> None:
        new = self.text[self.pos :]
        if not self.calls:
            self._emit_call(out, self.name, "")
        if new:
            self.calls[0]["function"]["arguments"] += new
            out.append({"tool_calls": [{"index": 0, "function": {"arguments": new}}]})
        self.pos = len(self.text)


class ObjectSequenceStream(ToolCallStream):
    """Tool-call JSON objects one after another, with `separators` between them (llama3_json's
    `;`, the required array's brackets and commas); anything else turns the rest into content.

    Args:
      args_keys: the keys that may hold the arguments, first found wins.
      opening: text that may come first and is dropped (`<|python_tag|>`); with
        `content_unless_object`, a reply that does not start with `{` (or `opening`) is content.
    """

    def __init__(self, separators: str, args_keys, opening: str = "", content_unless_object=False, max_calls=None):
        super().__init__(max_calls)
        self.separators, self.args_keys, self.opening = separators, tuple(args_keys), opening
        self.state = "start" if content_unless_object else "between"
        self.call: _CallObject | None = None

    def _advance(self, out: list[dict], final: bool) -> None:
        while self.pos < len(self.text):
            rest = self.text[self.pos :]
            if self.state == "content":
                self._flush(out)
            elif self.state == "start":
                stripped = rest.lstrip()
                if not stripped or (self.opening and self.opening.startswith(stripped) and not final):
                    return  # undecided: only whitespace, or the beginning of the opening tag
                if self.opening and stripped.startswith(self.opening):
                    self.pos += len(rest) - len(stripped) + len(self.opening)
                    self.state = "between"
                else:
                    self.state = "between" if stripped.startswith("{") else "content"
            elif self.state == "between":
                ch = rest[0]
                if ch.isspace() or ch in self.separators:
                    self.pos += 1
                elif ch == "{":
                    self.state, self.call = "object", _CallObject(self.args_keys)
                else:
                    self.state = "content"
            else:  # inside an object
                end = self.call.feed(self, rest, out)
                if end is None:
                    if final:  # cut short: what has not gone out as a call is content
                        self.pos += self.call.args_start + self.call.sent if self.call.args else 0
                    return
                self.pos += end
                self.state = "between"


class HermesStream(ToolCallStream):
    """`<tool_call>{...}</tool_call>` blocks inside free text. The tag's beginning is held back
    until it is certain; a block's object streams as a call (`_CallObject`); a block that does not
    hold a JSON object is parsed once it closes, or at the end."""

    def __init__(self, max_calls=None):
        super().__init__(max_calls)
        self.state, self.searched = "text", 0  # text | pre (after the tag) | object | post | raw
        self.call: _CallObject | None = None

    def _advance(self, out: list[dict], final: bool) -> None:
        while True:
            rest = self.text[self.pos :]
            if self.state == "text":
                start = rest.find(HERMES_OPEN)
                if start < 0:
                    hold = 0 if final else _partial_suffix(rest, HERMES_OPEN)
                    self._emit_content(out, rest[: len(rest) - hold])
                    self.pos += len(rest) - hold
                    return
                self._emit_content(out, rest[:start])
                self.pos += start + len(HERMES_OPEN)
                self.state = "pre"
            elif self.state == "pre":
                stripped = rest.lstrip()
                if not stripped:
                    if final:
                        self._emit_content(out, HERMES_OPEN)
                    return
                if stripped[0] == "{":
                    self.pos += len(rest) - len(stripped)
                    self.state, self.call = "object", _CallObject(("arguments", "parameters"))
                else:
                    self.state, self.searched = "raw", self.pos
            elif self.state == "object":
                end = self.call.feed(self, rest, out)
                if end is None:
                    if final and self.call.args is not None:
                        self.pos += self.call.args_start + self.call.sent
                    elif final:
                        self._emit_content(out, HERMES_OPEN)
                    return
                self.pos += end
                self.state = "post"
            elif self.state == "post":
                stripped = rest.lstrip()
                if stripped.startswith(HERMES_CLOSE):
                    self.pos += len(rest) - len(stripped) + len(HERMES_CLOSE)
                    self.state = "text"
                elif HERMES_CLOSE.startswith(stripped) and not final:
                    return  # maybe the closing tag
                else:
                    self.state = "text"  # no closing tag: what follows is text
            else:  # raw: not an object; parsed as a whole once the block closes
                end = self.text.find(HERMES_CLOSE, max(self.pos, self.searched))
                if end < 0:
                    self.searched = max(self.pos, len(self.text) - len(HERMES_CLOSE) + 1)
                    if final:
                        self._close_raw(out, rest, HERMES_OPEN + rest)
                        self.pos = len(self.text)
                    return
                body = self.text[self.pos : end]
                self._close_raw(out, body, HERMES_OPEN + body + HERMES_CLOSE)
                self.pos, self.state = end + len(HERMES_CLOSE), "text"

    def _close_raw(self, out: list[dict], body: str, raw: str) -> None:
        call = _call_from(body.strip(), ("arguments", "parameters"))
        if call is None:
            self._emit_content(out, raw)
        else:
            self._emit_call(out, *call)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (held back: it may be the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def llama3_json(max_calls=None) -> ToolCallStream:
    return ObjectSequenceStream(";", ("parameters", "arguments"), PYTHON_TAG, True, max_calls)


def hermes(max_calls=None) -> ToolCallStream:
    return HermesStream(max_calls)


def required(max_calls=None) -> ToolCallStream:
    return ObjectSequenceStream("[,]", ("parameters", "arguments"), max_calls=max_calls)


# --tool-call-parser values (vLLM's names)
TOOL_PARSERS = {"hermes": hermes, "llama3_json": llama3_json}


def extract(stream: ToolCallStream, text: str) -> tuple[str | None, list[dict]]:
    """`(content, tool_calls)` of a whole reply; content is None when it is only whitespace
    around tool calls (OpenAI's `content: null`)."""
    stream.feed(text)
    stream.finish()
    content = stream.content
    if stream.calls and not content.strip():
        content = None
    return content, stream.calls
