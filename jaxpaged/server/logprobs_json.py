"""Logprobs as OpenAI's and vLLM's JSON: completions' `logprobs` (tokens, token_logprobs,
top_logprobs, text_offset), chat's `logprobs.content`, and vLLM's `prompt_logprobs`.
"""

from jaxpaged.outputs import Logprob


def _top(entry: dict[int, Logprob], num: int) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank or 0)[:num] if num else []


def _finite(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def completion_logprobs(token_ids: list[int], logprobs: list, num: int, offset: int, first_text: str = "") -> dict:
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


def chat_logprobs(token_ids: list[int], logprobs: list, num: int) -> dict:
    """OpenAI's chat `logprobs`: per token, its text, logprob and UTF-8 bytes, and its `num` top
    alternatives."""

    def item(lp: Logprob) -> dict:
        token = lp.decoded_token or ""
        return {"token": token, "logprob": _finite(lp.logprob), "bytes": list(token.encode())}

    content = []
    for token_id, entry in zip(token_ids, logprobs):
        content.append({**item(entry[token_id]), "top_logprobs": [item(lp) for lp in _top(entry, num)]})
    return {"content": content}


def prompt_logprobs_json(entries: list | None) -> list | None:
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
