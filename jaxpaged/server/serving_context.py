"""`ServingContext`: what the completions and chat-completions handlers share (the engine, the
served model name, the tokenizer threads, the server's limits) and the checks every request
passes before the engine sees it (readiness, model name, sequences, lengths, response size, the
structured-output constraint).
"""

import asyncio
import dataclasses
import logging

from jaxpaged.lora_request import LoRARequest
from jaxpaged.server.data_parallel import EngineClient
from jaxpaged.server.grammar_checks import GrammarChecks
from jaxpaged.server.limits import ServerLimits
from jaxpaged.server.protocol import APIError, echo
from jaxpaged.server.request_body import ListLimits
from jaxpaged.server.tokenizer_pool import TokenizerPool
from jaxpaged.structured.shortest_document import shortest_document

logger = logging.getLogger("jaxpaged.server")
MAX_LOGGED_DOCUMENT_CHARS = 80  # of the shortest document, in the cut-off warning


@dataclasses.dataclass
class ServingContext:
    """What the handlers share: the engine, the names the model is served under (the first is the
    one responses and metrics carry when a request names none), whether request logs may include
    prompt text (`--enable-log-requests`), the per-request sequence cap, the
    tokenizer threads (made once the engine is ready) and the server's limits.
    """

    engine: EngineClient
    model_names: tuple[str, ...]
    log_prompts: bool = False
    max_sequences_per_request: int = 1024
    tokenizer_pool_size: int = 2
    limits: ServerLimits = dataclasses.field(default_factory=ServerLimits)
    tool_call_parser: str | None = None  # --tool-call-parser with --enable-auto-tool-choice, else None
    chat_template: str | None = None  # --chat-template: used instead of the tokenizer's
    # the LoRA adapters requests may name as their `model` (--lora-modules, /v1/load_lora_adapter)
    lora_modules: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)
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
        self.grammar_checks = GrammarChecks(self.limits.max_grammar_bytes, self.limits.grammar_check_timeout)

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
        """400 naming the request's constraint field when its grammar is over budget or cannot be
        compiled (503 while the checks are busy); checked off the event loop (`grammar_checks.py`).
        A warning in the log when `max_tokens` is below the tokens of the shortest output the
        constraint allows, where that can be computed (`structured/shortest_document.py`): the
        output will end cut off (vLLM's behaviour too, so not an error)."""
        if params.structured_outputs is None:
            return
        await self.grammar_checks.check(params.structured_outputs, field)
        if params.max_tokens is None or self._pool is None:
            return

        def shortest_and_its_tokens(tokenizer):
            document = shortest_document(params.structured_outputs)
            if document is None:
                return None, 0
            return document, len(tokenizer.encode(document, add_special_tokens=False))

        document, tokens = await self._pool.run(shortest_and_its_tokens)
        if document is not None and tokens > params.max_tokens:
            shown = (
                document if len(document) <= MAX_LOGGED_DOCUMENT_CHARS else document[:MAX_LOGGED_DOCUMENT_CHARS] + "..."
            )
            logger.warning(
                "max_tokens=%d is below the %d tokens of the shortest output %s allows (%r): the output "
                'will end cut off (finish_reason "length"); raise max_tokens',
                params.max_tokens,
                tokens,
                field,
                shown,
            )

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

    @property
    def model_name(self) -> str:
        """The first served name: the metrics' label, and a response's `model` when its request named none."""
        return self.model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: a served name, or no name); 404
        `model_not_found` for any other name."""
        self.require_ready()
        if model is None or model in self.model_names:
            return None
        if model in self.lora_modules:
            return self.lora_modules[model]
        raise APIError(f"The model `{echo(model)}` does not exist.", 404, param="model", code="model_not_found")

    def response_model(self, model: str | None) -> str:
        """A response's `model`: the served name its request used (checked), else the first (vLLM's)."""
        return model if model is not None else self.model_name

    def check_cache_salt(self, salt: str | None) -> None:
        """400 when `cache_salt` is longer than `--max-cache-salt-chars`."""
        limit = self.limits.max_cache_salt_chars
        if salt is not None and len(salt) > limit:
            raise APIError(
                f"cache_salt has {len(salt)} characters; at most {limit} are accepted (--max-cache-salt-chars)",
                param="cache_salt",
            )

    def check_response_size(self, prompt_lens: list[int], params, num_logprobs: int | None, echo: bool = False):
        """400 when the response could hold more tokens and logprobs than `--max-response-entries`:
        per prompt, n choices x max_tokens x (1 + top logprobs) (max_tokens unset: the room the
        prompt leaves in max_model_len), plus in each choice the prompt's tokens x (1 +
        prompt_logprobs) with prompt_logprobs (echo with logprobs asks for them), or the prompt's
        tokens with echo alone."""
        limit = self.limits.max_response_entries
        per_token = 1 + (num_logprobs or 0)
        per_prompt_token = 1 + params.prompt_logprobs if params.prompt_logprobs is not None else int(echo)
        room = [params.max_tokens or self.engine.config.max_model_len - n for n in prompt_lens]
        generated = sum(r * params.n * per_token for r in room)
        prompts = sum(n * params.n * per_prompt_token for n in prompt_lens)
        if generated + prompts > limit:
            parts = [
                f"{len(prompt_lens) * params.n} choice(s) x max_tokens {max(room)} x (1 + {num_logprobs or 0} "
                f"top logprobs) = {generated}"
            ]
            if prompts:
                what = (
                    f"(1 + {params.prompt_logprobs} prompt_logprobs)" if params.prompt_logprobs is not None else "echo"
                )
                parts.append(f"{sum(prompt_lens)} prompt tokens x n={params.n} x {what} = {prompts}")
            raise APIError(
                f"this response could hold {generated + prompts} tokens and logprobs ({'; '.join(parts)}); the "
                f"server returns at most {limit} (--max-response-entries): lower n, max_tokens, logprobs, "
                "prompt_logprobs or the prompts",
                param="prompt_logprobs" if prompts > generated else "max_tokens",
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
