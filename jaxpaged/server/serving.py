"""`/v1/completions` and `/v1/chat/completions`: prompts in, OpenAI responses or SSE chunks out.

Each handler checks that the engine is ready and the model name, turns the body into
`SamplingParams`, caps the request's sequences, bounds the prompt's length in characters,
tokenizes on the tokenizer threads (never on the event loop), checks lengths against
`max_model_len`, and adds all of its requests to the engine at once; only then does a response
start, so every bad request is a 400 with OpenAI's error shape. A client that goes away aborts
its requests.
"""

import asyncio
import dataclasses
import functools
import json
import logging
import time
import uuid

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from jaxpaged.outputs import CompletionOutput, Logprob, RequestOutput
from jaxpaged.server.async_engine import AsyncEngine, EngineDeadError, RequestFailedError, RequestStream
from jaxpaged.server.limits import ServerLimits
from jaxpaged.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, echo, error_body
from jaxpaged.server.request_body import ListLimits
from jaxpaged.server.tokenizer_pool import TokenizerPool
from jaxpaged.server.tools import ToolMode, tool_mode
from jaxpaged.server.tools import message as tools_message
from jaxpaged.structured import check as structured_check

logger = logging.getLogger("jaxpaged.server")


@dataclasses.dataclass
class ServingContext:
    """What the handlers share: the engine, the name the model is served under, whether request
    logs may include prompt text (`--enable-log-requests`), the per-request sequence cap, the
    tokenizer threads (made once the engine is ready) and the server's limits.
    """

    engine: AsyncEngine
    model_name: str
    log_prompts: bool = False
    max_sequences_per_request: int = 1024
    tokenizer_pool_size: int = 2
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice, else None
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    _pool: TokenizerPool | None = None

    def require_ready(self) -> None:
        """503 unless the engine is serving (starting, draining or dead otherwise)."""
        if self.engine.dead is not None:
            raise APIError("the engine is not running", 503, type="server_error")
        if not self.engine.is_ready:
            message = "the server is shutting down" if self.engine.draining else "the engine is starting; retry shortly"
            raise APIError(message, 503, type="server_error")

    def __post_init__(self):
        self.engine.when_ready(self._start_pool)  # loads tokenizers off the event loop

    def _start_pool(self) -> None:
        if self.engine.tokenizer_dir is not None:
            self._pool = TokenizerPool(self.engine.tokenizer_dir, self.tokenizer_pool_size)

    @property
    def pool(self) -> TokenizerPool:
        """The tokenizer threads (400 when the engine runs without a tokenizer)."""
        if self._pool is None:
            raise APIError("the model is served without a tokenizer: send token ids", param="prompt")
        return self._pool

    async def run_blocking(self, fn, *args):
        """`fn(*args)` on a worker thread (the tokenizer threads when there are: they bound how
        many such jobs run at once), never on the event loop."""
        if self._pool is None:
            return await asyncio.to_thread(fn, *args)
        return await self._pool.run(lambda _tokenizer: fn(*args))

    async def check_structured(self, params, field: str | None) -> None:
        """400 naming the request's constraint field when its grammar cannot be compiled; the
        compilation (seconds for a huge schema) runs off the event loop."""
        if params.structured_outputs is None:
            return
        err = await self.run_blocking(_check_quietly, params.structured_outputs)
        if err is not None:
            raise APIError(f"{field}: {str(err)[:500]}", param=field)

    @property
    def sampling_defaults(self) -> dict:
        """The model's generation config (`--generation-config`): defaults of unset request fields."""
        return dict(self.engine.config.load.sampling_defaults)

    @property
    def list_limits(self) -> ListLimits:
        """The longest list each body field may hold (known once the engine's config is)."""
        return ListLimits(
            self.engine.config.max_model_len,
            self.max_sequences_per_request,
            self.limits.max_stop_token_ids,
            self.engine.config.model.vocab_size,
        )

    def check_model(self, model: str | None) -> None:
        """404 `model_not_found` unless `model` is None or the served name."""
        self.require_ready()
        if model is not None and model != self.model_name:
            raise APIError(f"The model `{echo(model)}` does not exist.", 404, param="model", code="model_not_found")

    def check_cache_salt(self, salt: str | None) -> None:
        """400 when `cache_salt` is longer than `--max-cache-salt-chars`."""
        limit = self.limits.max_cache_salt_chars
        if salt is not None and len(salt) > limit:
            raise APIError(
                f"cache_salt has {len(salt)} characters; at most {limit} are accepted (--max-cache-salt-chars)",
                param="cache_salt",
            )

    def check_response_size(self, num_sequences: int, prompt_lens: list[int], params, num_logprobs: int | None):
        """400 when sequences x max_tokens x (1 + top logprobs) exceeds `--max-response-entries`
        (max_tokens unset: the room each prompt leaves in max_model_len)."""
        limit = self.limits.max_response_entries
        per_entry = 1 + (num_logprobs or 0)
        room = [params.max_tokens or self.engine.config.max_model_len - n for n in prompt_lens]
        entries = sum(r * params.n * per_entry for r in room)
        if entries > limit:
            raise APIError(
                f"this response could hold {entries} tokens and logprobs ({num_sequences} sequence(s) x "
                f"max_tokens {max(room)} x (1 + {num_logprobs or 0} top logprobs)); the server returns at most "
                f"{limit} (--max-response-entries): lower n, max_tokens or logprobs",
                param="max_tokens",
            )

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """400 when one request asks for more sequences than `max_sequences_per_request`."""
        if num_prompts * n > self.max_sequences_per_request:
            raise APIError(
                f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences; "
                f"the server takes at most {self.max_sequences_per_request} per request",
                param="n",
            )

    def check_text_length(self, chars: int, what: str) -> None:
        """400 before tokenizing when `chars` characters must be more tokens than `max_model_len`."""
        limit = self.engine.config.max_model_len * self.pool.max_token_chars
        if chars > limit:
            raise APIError(
                f"the {what} has {chars} characters: more than the {self.engine.config.max_model_len} tokens of "
                f"this model's maximum context length can hold (at most {limit} characters)",
                param=what,
                code="context_length_exceeded",
            )

    def check_length(self, num_prompt: int, max_tokens: int | None, what: str) -> None:
        """400 `context_length_exceeded` when prompt + max_tokens cannot fit `max_model_len`."""
        limit = self.engine.config.max_model_len
        if max_tokens is None and num_prompt >= limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens, and the {what} has {num_prompt} "
                "tokens, which leaves no room for the completion. Please shorten the "
                f"{what}.",
                param=what,
                code="context_length_exceeded",
            )
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the {what}, {max_tokens} in the "
                f"completion). Please reduce the length of the {what} or completion.",
                param=what,
                code="context_length_exceeded",
            )


def _check_quietly(structured) -> ValueError | None:
    """`jaxpaged.structured.check`'s error, returned rather than raised (off the event loop)."""
    try:
        structured_check(structured)
    except ValueError as err:
        return err
    return None


def truncate(prompt: dict, keep: int | None, max_model_len: int) -> dict:
    """`truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: max_model_len), as the engine
    keeps them; the text is dropped when tokens were."""
    if keep is None:
        return prompt
    keep = max_model_len if keep == -1 else keep
    ids = prompt["prompt_token_ids"]
    return prompt if len(ids) <= keep else {"prompt_token_ids": ids[-keep:]}


async def completion_prompts(ctx: ServingContext, prompt, add_special_tokens: bool = True) -> list[dict]:
    """`LLMEngine.add_request` prompts for the `prompt` field's four forms (tokenized off the loop)."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not items:
        raise APIError("prompt must not be empty", param="prompt")
    texts = [item for item in items if isinstance(item, str)]
    for text in texts:
        ctx.check_text_length(len(text), "prompt")
    special = add_special_tokens
    encoded = iter(
        await ctx.pool.run(lambda tok: [tok.encode(t, add_special_tokens=special) for t in texts]) if texts else []
    )
    prompts = []
    for item in items:
        if isinstance(item, str):  # "" is BOS alone when the tokenizer adds one, as in vLLM
            prompts.append({"prompt": item, "prompt_token_ids": next(encoded)})
        else:
            prompts.append({"prompt_token_ids": list(item)})
        if not prompts[-1]["prompt_token_ids"]:
            raise APIError("the prompt is empty (it has no tokens)", param="prompt")
    return prompts


async def chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> dict:
    """Renders the conversation with the tokenizer's chat template and tokenizes it (off the loop)."""
    conversation = [m.to_template() for m in body.messages]

    def template_inputs() -> tuple[dict, int]:
        kwargs = body.template_kwargs()  # the template may render tools and documents: their JSON counts
        extra = len(json.dumps([kwargs.get("tools"), kwargs.get("documents")])) if body.tools or body.documents else 0
        return kwargs, extra

    # megabytes of tools or documents are copied and measured off the event loop
    kwargs, extra = await ctx.run_blocking(template_inputs) if body.tools or body.documents else template_inputs()
    # every string the template sees counts (role and name too), before any is rendered
    ctx.check_text_length(
        sum(len(v) for m in conversation for v in m.values() if isinstance(v, str)) + extra, "messages"
    )
    special = body.add_special_tokens

    def render(tokenizer):
        try:
            text = tokenizer.apply_chat_template(
                conversation, tokenize=False, chat_template=ctx.chat_template, **kwargs
            )
        except Exception as err:  # no template, or the template rejects the conversation
            return err
        return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=special)}

    result = await ctx.pool.run(render)
    if isinstance(result, Exception):
        raise APIError(
            f"the model's chat template rejects these messages{_template_reason(result)}", param="messages"
        ) from None
    return result


def _template_reason(err: Exception) -> str:
    """The template's own message (jinja's `raise_exception`), never an internal exception."""
    from jinja2 import TemplateError

    return f": {err}" if isinstance(err, TemplateError) and str(err) else ""


async def create_completion(ctx: ServingContext, body: CompletionRequest, raw: Request) -> Response:
    """`POST /v1/completions`: one engine request per prompt, choices indexed prompt-major."""
    ctx.check_model(body.model)
    params = body.sampling_params(ctx.engine.config.model.vocab_size, ctx.sampling_defaults)
    num_prompts = (
        1 if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)) else len(body.prompt)
    )
    ctx.check_sequences(num_prompts, params.n)
    ctx.check_cache_salt(body.cache_salt)
    await ctx.check_structured(params, body.constraint_field)
    max_len = ctx.engine.config.max_model_len
    prompts = await completion_prompts(ctx, body.prompt, body.add_special_tokens)
    prompts = [truncate(p, params.truncate_prompt_tokens, max_len) for p in prompts]
    for p in prompts:
        ctx.check_length(len(p["prompt_token_ids"]), params.max_tokens, "prompt")
    lens = [len(p["prompt_token_ids"]) for p in prompts]
    ctx.check_response_size(num_prompts * params.n, lens, params, body.logprobs)
    kind = _Kind(chat=False, num_logprobs=body.logprobs, prompt_logprobs=body.prompt_logprobs is not None)
    if body.echo:
        kind.echo = await _echo_texts(ctx, prompts)
        kind.echo_only = body.echo_only
    return await _run(ctx, raw, body, params, prompts, kind)


async def _echo_texts(ctx: ServingContext, prompts: list[dict]) -> list[tuple[str, str, list[int]]]:
    """Per prompt, what `echo` prepends: its text (decoded for token-id prompts), its first
    token's text (which has no logprob) and its token ids."""

    def texts(tok):
        return [
            (p["prompt"] if "prompt" in p else tok.decode(p["prompt_token_ids"]), tok.decode(p["prompt_token_ids"][:1]))
            for p in prompts
        ]

    return [(text, first, p["prompt_token_ids"]) for (text, first), p in zip(await ctx.pool.run(texts), prompts)]


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest, raw: Request) -> Response:
    """`POST /v1/chat/completions`: the conversation through the chat template, one request."""
    ctx.check_model(body.model)
    vocab_size = ctx.engine.config.model.vocab_size

    def params_and_tools():
        tools = tool_mode(body, ctx.tool_call_parser)
        return body.sampling_params(vocab_size, tools.schema if tools else None, ctx.sampling_defaults), tools

    # tool schemas are copied into the required schema: megabytes of them never on the event loop
    params, tools = await ctx.run_blocking(params_and_tools) if body.tools else params_and_tools()
    ctx.check_sequences(1, params.n)
    ctx.check_cache_salt(body.cache_salt)
    await ctx.check_structured(params, body.constraint_field)
    prompt = truncate(await chat_prompt(ctx, body), params.truncate_prompt_tokens, ctx.engine.config.max_model_len)
    ctx.check_length(len(prompt["prompt_token_ids"]), params.max_tokens, "messages")
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    ctx.check_response_size(params.n, [len(prompt["prompt_token_ids"])], params, num_logprobs)
    return await _run(ctx, raw, body, params, [prompt], _Kind(chat=True, num_logprobs=num_logprobs, tools=tools))


@dataclasses.dataclass
class _Kind:
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
            return _chat_logprobs(token_ids, logprobs, self.num_logprobs)
        return _completion_logprobs(token_ids, logprobs, self.num_logprobs, offset, first_text)

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


class _Usage:
    def __init__(self):
        self.prompt: dict[str, int] = {}
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


async def _run(ctx, raw: Request, body, params, prompts: list[dict], kind: _Kind) -> Response:
    engine_id = f"{kind.prefix}-{uuid.uuid4().hex}"
    ids = [f"{engine_id}-{i}" for i in range(len(prompts))]
    # vLLM's request_id names the response; the engine's ids stay unique whatever clients send
    request_id = f"{kind.prefix}-{body.request_id}" if body.request_id else engine_id
    stream = await ctx.engine.add_requests(ids, prompts, params, cache_salt=body.cache_salt)
    logger.info(
        "%s: %d prompt(s), %d prompt tokens, n=%d, max_tokens=%s, stream=%s",
        request_id,
        len(prompts),
        sum(len(p["prompt_token_ids"]) for p in prompts),
        params.n,
        params.max_tokens,
        body.stream,
    )
    if ctx.log_prompts:
        for rid, p in zip(ids, prompts):
            logger.info("%s: prompt %r", rid, p.get("prompt") or p["prompt_token_ids"])
    head = {"id": request_id, "object": kind.object(body.stream), "created": int(time.time()), "model": ctx.model_name}
    index_of = {rid: i * params.n for i, rid in enumerate(ids)}
    if kind.echo is not None:
        kind.prompt_of = {rid: i for i, rid in enumerate(ids)}
    if body.stream:
        events = _events(stream, kind, head, index_of, params.n * len(prompts), body.include_usage)
        return EventStreamResponse(events, on_close=stream.abort, write_timeout=ctx.limits.stream_write_timeout)
    result = await run_until_disconnect(raw, _collect(stream, kind, index_of))
    if result is None:
        logger.info("%s: client disconnected; aborted", request_id)
        return Response(status_code=499)
    choices, usage = result
    # Only the joining of finished JSON fragments is left (megabytes at most: one C call each).
    content = await asyncio.to_thread(_render, kind, head, choices, usage)
    logger.info("%s: finished, %d completion tokens, %d response bytes", head["id"], usage.completion, len(content))
    return Response(content, media_type="application/json")


_dumps = functools.partial(json.dumps, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class _Choice:
    """One choice of a non-streamed response, built as its outputs arrive.

    Its logprobs are turned into JSON fragments (strings) delta by delta, on the event loop, a
    step's tokens at a time: a response of n x max_tokens x top logprobs entries keeps no such
    number of Python objects alive. That matters beyond memory: the garbage collector's full
    collections walk every live container while holding the interpreter lock, and with a
    quarter of a million `Logprob`s alive they stalled `/health` for up to a second (py-spy:
    `gc_collect_main` under the render and output threads). Strings are not tracked by the GC.
    """

    KEYS = {False: ("tokens", "token_logprobs", "top_logprobs", "text_offset"), True: ("content",)}

    def __init__(self, kind: _Kind, c: CompletionOutput, request_id: str):
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
            lps = _chat_logprobs(c.token_ids, c.logprobs, self.kind.num_logprobs)
        else:
            lps = _completion_logprobs(c.token_ids, c.logprobs, self.kind.num_logprobs, self.offset)
            self.offset += sum(len(token) for token in lps["tokens"])
        for key, parts in self.parts.items():
            parts.append(_dumps(lps[key])[1:-1])  # the list's items, without its brackets

    def render(self, index: int) -> str:
        """The choice's JSON (the same as `_Kind.choice` with every token's logprobs)."""
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
            choice["prompt_logprobs"] = _prompt_logprobs_json(self.prompt_lps)
        return choice


def _render(kind: _Kind, head: dict, choices: dict[int, _Choice], usage: "_Usage") -> bytes:
    """The response body: `head`, the choices in index order, and the usage, as JSON bytes."""
    parts = ",".join(choices[i].render(i) for i in sorted(choices))
    return f'{_dumps(head)[:-1]},"choices":[{parts}],"usage":{_dumps(usage.to_dict())}}}'.encode()


def _prompt_logprobs_json(entries: list | None) -> list | None:
    """vLLM's `prompt_logprobs` of a choice: None, then {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in entry.items()
        }
        for entry in entries
    ]


async def _collect(stream: RequestStream, kind: _Kind, index_of: dict) -> tuple[dict[int, _Choice], "_Usage"]:
    """Every output of the stream, accumulated per choice (the stream is aborted on the way out)."""
    usage, choices = _Usage(), {}
    try:
        prompt_lps = {}  # request id -> its prompt logprobs (in one output)
        async for out in stream:
            usage.add(out)
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id] = out.prompt_logprobs
            for c in out.outputs:
                i = index_of[out.request_id] + c.index
                choice = choices.get(i) or choices.setdefault(i, _Choice(kind, c, out.request_id))
                choice.add(c)
                # one sequence's tokens of one step at a time, between other work (`/health`):
                # an output of n sequences x K steps x top logprobs is tens of milliseconds
                await asyncio.sleep(0)
    finally:
        stream.abort()
    for choice in choices.values():
        choice.prompt_lps = prompt_lps.get(choice.request_id)
    if kind.echo_only:  # the token generated to get there is not part of the answer
        usage.completion = 0
    return choices, usage


async def _events(
    stream: RequestStream, kind: _Kind, head: dict, index_of: dict, num_choices: int, include_usage: bool
):
    usage, done, offsets, tool_streams = _Usage(), set(), {}, {}
    extra = {"usage": None} if include_usage else {}
    try:
        if kind.chat:
            for i in range(num_choices):
                delta = {"role": "assistant", "content": ""}
                role = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None, "stop_reason": None}
                yield _sse({**head, "choices": [role], **extra})
        prompt_lps, held = {}, {}  # echo: request id -> prompt logprobs; choice -> output held for them
        async for out in stream:
            usage.add(out)
            if out.prompt_logprobs is not None:
                prompt_lps[out.request_id] = out.prompt_logprobs
            for c in out.outputs:
                i = index_of[out.request_id] + c.index
                if i in done or not (c.text or c.token_ids or c.finish_reason):
                    continue
                text, ids, lps, first = c.text, c.token_ids, c.logprobs, ""
                if kind.echo is not None and i not in offsets:  # the prompt goes first, once
                    pending = held.pop(i, None)
                    if pending is not None:  # what came while its prompt logprobs had not
                        text, ids = pending[0] + text, pending[1] + ids
                        lps = None if lps is None else pending[2] + lps
                    if kind.num_logprobs is not None and out.request_id not in prompt_lps:
                        held[i] = (text, ids, list(lps or []))  # a sibling computes them: wait for it
                        continue
                    text, ids, lps, first = kind.echoed(
                        kind.prompt_of[out.request_id], text, ids, lps, prompt_lps.get(out.request_id)
                    )
                elif kind.echo_only:
                    text, ids, lps = "", [], []
                if c.finish_reason:
                    done.add(i)
                if kind.tools is not None:
                    stream_i = tool_streams.setdefault(i, kind.tools.stream())
                    for choice in kind.tool_chunks(i, c, stream_i):
                        yield _sse({**head, "choices": [choice], **extra})
                    continue
                offset = offsets.get(i, 0)
                choice = kind.choice(i, text, ids, lps, c, chunk=True, offset=offset, first_text=first)
                offsets[i] = offset + len(text)
                yield _sse({**head, "choices": [choice], **extra})
        if include_usage:
            if kind.echo_only:
                usage.completion = 0
            yield _sse({**head, "choices": [], "usage": usage.to_dict()})
        logger.info("%s: finished, %d completion tokens", head["id"], usage.completion)
        yield "data: [DONE]\n\n"
    except (EngineDeadError, RequestFailedError) as err:
        yield _sse(error_body(str(err), "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        stream.abort()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop, and call `on_close`, as soon as the client goes away.

    Starlette only watches for a disconnect under ASGI < 2.4; this watches always, so a
    request is aborted even before its first token. A client that stops reading (its socket's
    buffers full) for `write_timeout` seconds is treated as gone: output never piles up
    unbounded behind a reader that does not read.
    """

    def __init__(self, content, on_close, write_timeout: float):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close, self._write_timeout = on_close, write_timeout

    async def __call__(self, scope, receive, send) -> None:
        async def send_in_time(message) -> None:
            with anyio.fail_after(self._write_timeout):  # TimeoutError: an OSError, handled below
                await send(message)

        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send_in_time)
                    except OSError:  # the client went away mid-send, or stopped reading
                        pass
                    finally:
                        group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._on_close()
            await self.body_iterator.aclose()


async def run_until_disconnect(raw: Request, coro):
    """Awaits `coro`, unless the client disconnects first: then cancels it and returns None."""
    task = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else None


def _top(entry: dict[int, Logprob], num: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num] if num else []


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def _completion_logprobs(token_ids: list[int], logprobs: list, num: int, offset: int, first_text: str = "") -> dict:
    """OpenAI's completions `logprobs`; an entry None (an echoed prompt's first token, which
    nothing precedes) has token `first_text` and null logprobs."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        if entry is None:
            text = first_text
            token_lps.append(None)
            tops.append(None)
        else:
            text = entry[token_id].decoded_token or ""
            token_lps.append(_finite(entry[token_id].logprob))
            tops.append({(lp.decoded_token or ""): _finite(lp.logprob) for lp in _top(entry, num)})
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(token_ids: list[int], logprobs: list, num: int) -> dict:
    def item(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in _top(entry, num)]})
    return {"content": content}
