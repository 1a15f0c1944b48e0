"""Which request fields the server honours, accepts with no effect, or refuses (docs/server.md's table).

Every field a request model declares is honoured (`protocol.py`). The rest of OpenAI's and
vLLM's fields are screened here before the model sees the body:

- `NO_EFFECT`: accepted and dropped, because nothing here could act on them (say why);
- `REFUSED`: a 400 naming the field unless its value is the neutral one (null, false, the
  default), so a client never gets output that silently ignores what it asked for;
- anything else: a 400 naming it as unrecognized (OpenAI's own wording).

A field a request model declares always wins over these tables, so a later branch that
implements a refused field only adds it to the model.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

from jaxpaged.server.errors import APIError, echo


def _neutral(value: Any) -> bool:
    return value in (None, False, "", [], {})


@dataclasses.dataclass(frozen=True)
class Refused:
    """A field refused (400) unless `accepts(value, body)` holds; `reason` is the message's tail."""

    reason: str
    accepts: Callable[[Any, dict], bool] = lambda value, body: _neutral(value)


BOTH, COMPLETIONS, CHAT = "both", "completions", "chat"

# field -> (endpoint, why it changes nothing)
NO_EFFECT: dict[str, tuple[str, str]] = {
    "user": (BOTH, "an end-user id for the provider's abuse monitoring; it does not affect the output"),
    "safety_identifier": (BOTH, "OpenAI's successor of `user`: an id for abuse monitoring"),
    "metadata": (BOTH, "tags for OpenAI's stored-completions dashboard; nothing here stores or lists completions"),
    "store": (BOTH, "asks OpenAI to store the completion; this server keeps nothing after a response"),
    "service_tier": (BOTH, "OpenAI's latency tier; this server has one tier"),
    "prompt_cache_key": (BOTH, "a routing hint for OpenAI's prompt cache; prefix caching here is automatic"),
    "include_reasoning": (CHAT, "vLLM's switch for a reasoning parser's output; there is no reasoning parser here"),
    "session_id": (BOTH, "vLLM's stable session id for routing; one server routes nothing"),
    "return_token_offsets": (BOTH, "vLLM's: only its render endpoints use it; generation ignores it there too"),
    "return_mm_kwargs": (BOTH, "vLLM's: only its render endpoints use it; there is no multimodal input"),
    # vllm-router (0.1.17) re-serialises every request with its own fields at their defaults
    "separate_reasoning": (CHAT, "vllm-router's reasoning-parser switch; there is no reasoning parser here"),
    "stream_reasoning": (CHAT, "vllm-router's reasoning-parser switch; there is no reasoning parser here"),
}

REFUSED: dict[str, tuple[str, Refused]] = {
    "best_of": (BOTH, Refused("only best_of = n is supported", lambda v, body: v is None or v == body.get("n", 1))),
    "use_beam_search": (BOTH, Refused("beam search is not supported")),
    "length_penalty": (BOTH, Refused("it applies to beam search only", lambda v, body: v is None or v == 1)),
    "logits_processors": (BOTH, Refused("it runs arbitrary code; the server loads none")),
    "priority": (BOTH, Refused("the scheduler is first-come first-served", lambda v, body: v in (None, 0))),
    "kv_transfer_params": (BOTH, Refused("disaggregated prefill is not supported")),
    "vllm_xargs": (BOTH, Refused("there are no custom extensions to pass them to")),
    "return_tokens_as_token_ids": (BOTH, Refused("logprobs name tokens by their text")),
    "return_token_ids": (BOTH, Refused("responses carry text, not token ids")),
    "mm_processor_kwargs": (BOTH, Refused("there is no multimodal input")),
    # vllm-router's (SGLang's vocabulary), sent false by the router on every request
    "no_stop_trim": (BOTH, Refused("use include_stop_str_in_output to keep the stop string")),
    "return_hidden_states": (BOTH, Refused("responses carry no hidden states")),
    # completions declare prompt_logprobs (and echo) themselves; on chat they are refused
    "prompt_logprobs": (
        CHAT,
        Refused(
            "prompt logprobs are answered on /v1/completions (with echo or prompt_logprobs)", lambda v, body: v is None
        ),
    ),
    "truncation_side": (BOTH, Refused("truncation keeps the last tokens", lambda v, body: v in (None, "left"))),
    "thinking_token_budget": (BOTH, Refused("there is no reasoning model support")),
    "watermarking": (BOTH, Refused("there is no watermarking")),
    "logprob_token_ids": (BOTH, Refused("logprobs are the top ones (top_logprobs / logprobs)")),
    "repetition_detection": (BOTH, Refused("there is no repetition detection")),
    "stream_interval": (BOTH, Refused("every step's tokens are streamed", lambda v, body: v in (None, 1))),
    "return_prompt_text": (BOTH, Refused("responses do not carry the rendered prompt")),
    "routed_experts_prompt_start": (BOTH, Refused("there are no experts", lambda v, body: v in (None, 0))),
    "ec_transfer_params": (BOTH, Refused("disaggregated encoding is not supported")),
    "media_io_kwargs": (BOTH, Refused("there is no multimodal input")),
    "prompt_embeds": (COMPLETIONS, Refused("prompts are text or token ids")),
    # chat's echo is vLLM's (prepend the last message to the reply); completions' echo is its own field
    "echo": (CHAT, Refused("chat's echo (prepend the last message to the reply) is not supported")),
    "chat_template": (CHAT, Refused("a per-request template is not accepted; the model's own template renders")),
    "reasoning_effort": (CHAT, Refused("there is no reasoning model support")),
    "functions": (CHAT, Refused("deprecated by OpenAI: use `tools`")),
    "function_call": (CHAT, Refused("deprecated by OpenAI: use `tool_choice`")),
    "modalities": (CHAT, Refused("the output is text only", lambda v, body: v in (None, ["text"]))),
    "audio": (CHAT, Refused("the output is text only")),
    "prediction": (CHAT, Refused("predicted outputs are not supported")),
    "web_search_options": (CHAT, Refused("there is no web search")),
    "verbosity": (CHAT, Refused("it is a hint to OpenAI's models only")),
}


def _applies(endpoint: str, to: str) -> bool:
    return endpoint in (BOTH, to)


def screen(data: dict, declared: dict, endpoint: str) -> dict:
    """`data` without its no-effect and neutral refused fields.

    Args:
      data: the request body (a JSON object).
      declared: the request model's fields (they win over the tables).
      endpoint: `COMPLETIONS` or `CHAT`.

    Raises:
      APIError: 400 naming a refused field with a non-neutral value, or an unrecognized field.
    """
    kept = {}
    for key, value in data.items():
        if key in declared:
            kept[key] = value
        elif key in NO_EFFECT and _applies(NO_EFFECT[key][0], endpoint):
            continue
        elif key in REFUSED and _applies(REFUSED[key][0], endpoint):
            refused = REFUSED[key][1]
            if not refused.accepts(value, data):
                raise APIError(f"{key} is not supported: {refused.reason}", param=key)
        else:
            name = echo(str(key))
            raise APIError(
                f"Unrecognized request argument supplied: {name} (see docs/server.md's table of request fields)",
                param=name,
            )
    return kept
