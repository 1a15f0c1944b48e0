"""Response rendering: `Kind` formats one endpoint's choices and chunks, `Usage` counts tokens,
`Choice` accumulates a non-streamed choice as JSON fragments, and `render` joins them into the
response body.
"""

import dataclasses
import functools
import json

from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.server.logprobs_json import chat_logprobs, completion_logprobs, prompt_logprobs_json
from jaxpaged.server.tools import ToolMode
from jaxpaged.server.tools import message as tools_message


@dataclasses.dataclass
class Kind:
    """Formats choices and chunks of one of the two endpoints."""

    chat: bool
    num_logprobs: int | None
    prompt_logprobs: bool = False  # choices carry vLLM's `prompt_logprobs`
    # completions' `echo`: per prompt (in order), its text, first token's text and token ids
    echo: list[tuple[str, str, list[int]]] | None = None
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    prompt_of: dict[str, int] = dataclasses.field(default_factory=dict)  # request id -> prompt index

    def echoed(self, prompt_index: int, text: str, token_ids: list, logprobs: list | None, prompt_lps: list | None):
        """`(text, token_ids, logprobs, first token's text)` of a choice with the prompt in front
        (`echo`), prompt logprobs first (the first token's is None)."""
        prompt_text, first, prompt_ids = self.echo[prompt_index]
        if self.echo_only:
            text, token_ids, logprobs = "", [], []
        if self.num_logprobs is None:
            return prompt_text + text, prompt_ids + token_ids, None, first
        return prompt_text + text, prompt_ids + token_ids, list(prompt_lps or []) + list(logprobs or []), first

    tools: ToolMode | None = None  # chat with tools: replies parsed into tool calls

    @property
    def prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"

    def object(self, chunk: bool) -> str:
        return ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"

    def choice(
        self,
        index: int,
        text: str,
        token_ids: list,
        logprobs: list | None,
        c: CompletionOutput,
        chunk: bool,
        offset: int = 0,
        first_text: str = "",
    ) -> dict:
        lps = self.logprobs(token_ids, logprobs, offset, first_text)
        if self.tools is not None and not chunk:
            message, reason = tools_message(self.tools, text, c.finish_reason)
            return {
                "index": index,
                "message": message,
                "logprobs": lps,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        if not self.chat:
            body = {"index": index, "text": text}
        elif chunk:
            body = {"index": index, "delta": {"content": text}}
        else:
            body = {"index": index, "message": {"role": "assistant", "content": text}}
        return {**body, "logprobs": lps, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}

    def logprobs(self, token_ids: list, logprobs: list | None, offset: int = 0, first_text: str = "") -> dict | None:
        """The choice's `logprobs` object (chat's or completions' shape), or None."""
        if self.num_logprobs is None or logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(token_ids, logprobs, self.num_logprobs)
        return completion_logprobs(token_ids, logprobs, self.num_logprobs, offset, first_text)

    def tool_chunks(self, index: int, c: CompletionOutput, stream) -> list[dict]:
        """Streamed choices of one output with tools: content and tool-call deltas as the parser
        finds them (the output's logprobs ride on the first; the finish reason on the last)."""
        deltas = stream.feed(c.text)
        if c.finish_reason:
            deltas += stream.finish()
        lps = self.logprobs(c.token_ids, c.logprobs)
        if not deltas and (lps is not None or c.finish_reason):
            deltas = [{}]
        reason = self.tools.finish_reason(stream.calls, c.finish_reason) if c.finish_reason else None
        return [
            {
                "index": index,
                "delta": delta,
                "logprobs": lps if j == 0 else None,
                "finish_reason": reason if j == len(deltas) - 1 else None,
                "stop_reason": c.stop_reason if j == len(deltas) - 1 else None,
            }
            for j, delta in enumerate(deltas)
        ]


class Usage:
    """The response's `usage`: prompt tokens and cached prompt tokens per engine request, and
    completion tokens, added up from its outputs."""

    def __init__(self, prompt_tokens: dict[str, int] | None = None):
        """`prompt_tokens`: each engine request's prompt length, when known before its outputs."""
        self.prompt: dict[str, int] = dict(prompt_tokens or {})
        self.cached: dict[str, int] = {}
        self.completion = 0

    def add(self, out: RequestOutput) -> None:
        self.prompt[out.request_id] = len(out.prompt_token_ids)
        self.cached[out.request_id] = out.num_cached_tokens
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def to_dict(self) -> dict:
        prompt = sum(self.prompt.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion,
            "total_tokens": prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
        }


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class Choice:
    """One choice of a non-streamed response, built as its outputs arrive.

    Its logprobs are turned into JSON fragments (strings) delta by delta, on the event loop, a
    step's tokens at a time: a response of n x max_tokens x top logprobs entries keeps no such
    number of Python objects alive. That matters beyond memory: the garbage collector's full
    collections walk every live container while holding the interpreter lock, and with a
    quarter of a million `Logprob`s alive they stalled `/health` for up to a second (py-spy:
    `gc_collect_main` under the render and output threads). Strings are not tracked by the GC.
    """

    KEYS = {False: ("tokens", "token_logprobs", "top_logprobs", "text_offset"), True: ("content",)}

    def __init__(self, kind: Kind, c: CompletionOutput, request_id: str):
        self.kind, self.last, self.text, self.offset = kind, c, "", 0
        self.request_id = request_id
        self.parts: dict[str, list[str]] = {key: [] for key in self.KEYS[kind.chat]}
        # With echo or prompt_logprobs the choice is rendered whole at the end (the prompt's
        # logprobs come with a sibling's first output): scoring requests, a few tokens long.
        self.whole = kind.echo is not None or kind.prompt_logprobs
        self.ids: list[int] = []
        self.lps: list = []
        self.prompt_lps: list | None = None  # set by `_collect` when the stream ends

    def add(self, c: CompletionOutput) -> None:
        self.text += c.text
        self.last = c
        if self.whole:
            self.ids += c.token_ids
            self.lps += c.logprobs or []
            return
        if self.kind.num_logprobs is None or not c.logprobs:
            return
        if self.kind.chat:
            lps = chat_logprobs(c.token_ids, c.logprobs, self.kind.num_logprobs)
        else:
            lps = completion_logprobs(c.token_ids, c.logprobs, self.kind.num_logprobs, self.offset)
            self.offset += sum(len(token) for token in lps["tokens"])
        for key, parts in self.parts.items():
            parts.append(_dumps(lps[key])[1:-1])  # the list's items, without its brackets

    def render(self, index: int) -> str:
        """The choice's JSON (the same as `Kind.choice` with every token's logprobs)."""
        if self.whole:
            return _dumps(self._whole_choice(index))
        body = self.kind.choice(index, self.text, [], None, self.last, chunk=False)
        keys = list(body)
        cut = keys.index("logprobs")
        left, right = (_dumps({k: body[k] for k in part}) for part in (keys[:cut], keys[cut + 1 :]))
        lps = "null"
        if self.kind.num_logprobs is not None:
            lps = "{" + ",".join(f'"{key}":[{",".join(p for p in parts if p)}]' for key, parts in self.parts.items())
            lps += "}"
        return f'{left[:-1]},"logprobs":{lps},{right[1:]}'

    def _whole_choice(self, index: int) -> dict:
        """The choice with the prompt in front (`echo`) and vLLM's `prompt_logprobs` when asked."""
        kind, text, ids, lps, first = self.kind, self.text, self.ids, self.lps, ""
        if kind.echo is not None:
            text, ids, lps, first = kind.echoed(kind.prompt_of[self.request_id], text, ids, lps, self.prompt_lps)
        choice = kind.choice(index, text, ids, lps, self.last, chunk=False, first_text=first)
        if kind.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_json(self.prompt_lps)
        return choice


def render(kind: Kind, head: dict, choices: dict[int, Choice], usage: Usage) -> bytes:
    """The response body: `head`, the choices in index order, and the usage, as JSON bytes."""
    parts = ",".join(choices[i].render(i) for i in sorted(choices))
    return f'{_dumps(head)[:-1]},"choices":[{parts}],"usage":{_dumps(usage.to_dict())}}}'.encode()
