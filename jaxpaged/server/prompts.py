"""The engine's prompts of a request: completions' `prompt` field (its four forms) and chat's
conversation through the chat template, tokenized on the tokenizer threads; `truncate_prompt_tokens`;
and the texts `echo` puts in front of a completion.
"""

import json

from jaxpaged.server.protocol import APIError, ChatCompletionRequest
from jaxpaged.server.serving_context import ServingContext


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


async def echo_texts(ctx: ServingContext, prompts: list[dict]) -> list[tuple[str, str, list[int]]]:
    """Per prompt, what `echo` prepends: its text (decoded for token-id prompts), its first
    token's text (which has no logprob) and its token ids."""

    def texts(tok):
        return [
            (p["prompt"] if "prompt" in p else tok.decode(p["prompt_token_ids"]), tok.decode(p["prompt_token_ids"][:1]))
            for p in prompts
        ]

    return [(text, first, p["prompt_token_ids"]) for (text, first), p in zip(await ctx.pool.run(texts), prompts)]
