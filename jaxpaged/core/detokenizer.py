"""Incremental detokenization and stop-string matching (host side, no JAX).

Decoding one token at a time is wrong for byte-level BPE: a multi-byte character may be split
across tokens, and a tokenizer may merge spaces differently in context. Like vLLM, each new
token is decoded together with a few tokens before it, and text is released only once it no
longer ends in an incomplete character (U+FFFD).
"""

from collections.abc import Sequence

# Tokens of context decoded before the new ones (enough for any merge to settle).
CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, one delta at a time.

    `spaces_between_special_tokens` works as in vLLM's detokenizer for slow tokenizers: the text
    is cut into pieces, each kept special token alone and each run of other tokens decoded
    together, and the pieces are joined with " ". vLLM's fast-tokenizer path ignores the flag,
    as Hugging Face's decode does (every tokenizer's, since transformers 5); here it applies to
    every tokenizer, because callers set it expecting it to do what its name says. Two
    departures keep ordinary output unchanged: only special tokens (the ones
    `skip_special_tokens` drops) are set apart, not vLLM's whole added vocabulary (tokens such
    as `<think>` or `<tool_call>`, which parsers match exactly), so with `skip_special_tokens`
    the flag has no effect; and no space goes between the prompt and the first output piece,
    since the prompt is not part of the output. With the flag False the tokenizer's own decode
    is used as is (it adds no spaces).

    Args:
      tokenizer: a Hugging Face tokenizer.
      prompt_token_ids: the prompt (context for the first generated tokens; not in the output).
      skip_special_tokens: drop special tokens from the text.
      spaces_between_special_tokens: with special tokens kept, put a space between each one and
        the text or special token next to it in the output (see above).
      stop: stop strings; the first one found ends the text there.
      include_stop_str_in_output: keep the matched stop string at the end of the text.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = self._output_start = len(self.tokens)
        self.skip_special_tokens = skip_special_tokens
        keep_apart = spaces_between_special_tokens and not skip_special_tokens
        self._special = frozenset(tokenizer.all_special_ids) if keep_apart else frozenset()
        self.stop = [s for s in stop if s]
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self.stop_reason: str | None = None
        self._emitted = 0  # characters of `text` already handed out by `take_delta`

        # A fast tokenizer without clean-up decodes exactly like its Rust backend, minus the
        # Python wrapper's overhead (a few microseconds per call, two calls per token).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = (
            backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True) else None
        )

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _text(self, start: int, end: int) -> str:
        """Text of `self.tokens[start:end]`, with special tokens set apart by spaces if asked."""
        ids = self.tokens[start:end]
        if not self._special.intersection(ids):
            return self._decode(ids)
        pieces: list[tuple[int, list[int]]] = []  # (position of the first token, token ids)
        for k, token in enumerate(ids, start):
            if token in self._special or not pieces or pieces[-1][1][-1] in self._special:
                pieces.append((k, [token]))
            else:
                pieces[-1][1].append(token)
        # A space only between two pieces of the output: none after the prompt's context.
        return "".join(
            (" " if i and k > self._output_start else "") + self._decode(piece) for i, (k, piece) in enumerate(pieces)
        )

    def add_token(self, token_id: int) -> bool:
        """Appends one generated token; returns True when a stop string was matched."""
        self.tokens.append(token_id)
        prefix = self._text(self.prefix_offset, self.read_offset)
        full = self._text(self.prefix_offset, len(self.tokens))
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return False  # an incomplete character: wait for the next token
        new_text = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0) + 1)
        self.text += new_text
        return self._match_stop(start)

    def _match_stop(self, search_from: int) -> bool:
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is None:
            return False
        at, s = best
        self.text = self.text[: at + len(s)] if self.include_stop else self.text[:at]
        self.stop_reason = s
        return True

    def _flush(self) -> None:
        """At the end, releases text still waiting for a character to complete (it never will)."""
        if self.stop_reason is None and self.read_offset < len(self.tokens):
            prefix = self._text(self.prefix_offset, self.read_offset)
            self.text += self._text(self.prefix_offset, len(self.tokens))[len(prefix) :]
            self.prefix_offset = self.read_offset = len(self.tokens)

    def take_delta(self, finished: bool) -> str:
        """Text not handed out yet. While running, the last characters that could begin a stop
        string are held back, so a streamed stop string never has to be taken back."""
        if finished:
            self._flush()
        end = len(self.text)
        if not finished and self.stop and not self.include_stop:
            end = max(self._emitted, end - max(len(s) for s in self.stop) + 1)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta


class NoDetokenizer:
    """Stands in for `IncrementalDetokenizer` when the engine runs without a tokenizer
    (`skip_tokenizer_init=True`): outputs carry token ids and empty text."""

    text = ""
    stop_reason = None

    def add_token(self, token_id: int) -> bool:
        return False

    def take_delta(self, finished: bool) -> str:
        return ""
