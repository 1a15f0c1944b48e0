"""A sequence's token constraint (host only): its grammar matcher, `allowed_token_ids` and
`bad_words`, advanced with every token appended to it, and the packed bitmask rows of a step.

Bit i of row word `i // 32` (bit `i % 32`) allows token i; `[S, W]` int32 with W = ceil(V / 32).

A constrained sequence skips the steps of tokens its constraint allows alone (`forced_run`):
plain decoding samples such a token whatever the logits, so a step computes them as extra query
tokens after the sequence's own token, without sampling them, and samples once after the last
(its mask row follows them: `fill_bitmask`'s `forced`).

With speculative decoding a constrained sequence then checks proposals after that run: the rest
of the tokens its grammar forces (`forced_tokens`: a JSON schema's keys and punctuation), then the
proposer's, all cut at the first the constraint rejects (`valid_prefix`). Its step has a mask row
per position: row j is what the constraint allows after the run and the first j proposals
(`fill_bitmask` advances the matcher over them and rolls it back), so each position samples
exactly as plain decoding would there.
"""

import concurrent.futures

import numpy as np

from jaxpaged.structured.backend import pack_bits
from jaxpaged.structured.grammar import digest
from jaxpaged.structured.llg import llguidance

# Below this many mask bits (rows x V) a step's grammar masks are filled on the calling thread:
# measured on 2 CPU cores with the demo model's 4,096-token vocabulary and the clinical-notes
# schema, 64 rows took 0.14 ms serially against 0.18 ms (median; up to 3 ms with the cores
# busy) on llguidance's threads. A 128K vocabulary reaches it at 16 rows.
PARALLEL_MIN_BITS = 1 << 21


def bad_words_token_ids(bad_words: list[str], tokenizer) -> list[list[int]]:
    """vLLM's encoding of `bad_words`: each word as it would start the text, and with a leading
    space when that gives a different first token and the same number of tokens (a word inside
    the text)."""
    out: list[list[int]] = []
    for word in bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [plain] if plain and plain not in out else []
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain) and spaced not in out:
            out.append(spaced)
    return out


class SequenceConstraint:
    """What one sequence may sample next.

    Args:
      vocab_size: V.
      grammar: the compiled grammar (a future of an `LLMatcher` at its start state), or None.
      valid_ids: with a grammar, `[W]` int32 bits of the ids the tokenizer has (a grammar
        allows no other; `GrammarBackend.valid_ids`).
      allowed_token_ids: only these may be sampled (None: any).
      bad_words: token-id sequences the output may not contain (`bad_words_token_ids`).
    """

    def __init__(
        self,
        vocab_size: int,
        grammar: concurrent.futures.Future | None = None,
        valid_ids: np.ndarray | None = None,
        allowed_token_ids: list[int] | None = None,
        bad_words: list[list[int]] | None = None,
    ):
        self.vocab_size = vocab_size
        self.valid_ids = valid_ids
        self.grammar = grammar
        self.matcher = None  # an llguidance LLMatcher once the grammar is compiled
        self.error: str | None = None  # the grammar failed to compile (or allows nothing)
        self.static_mask: np.ndarray | None = None  # [W] of allowed_token_ids
        if allowed_token_ids is not None:
            allowed = np.zeros(32 * -(-vocab_size // 32), bool)
            allowed[allowed_token_ids] = True
            self.static_mask = pack_bits(allowed[None])[0]
        self.bad_words = bad_words or []
        self.history: list[int] = []  # outputs so far (for multi-token bad words)
        self.num_accepted = 0  # tokens appended to the output

    @property
    def ready(self) -> bool:
        """Whether the grammar is compiled (or failed: see `error`); until then the sequence is
        not scheduled."""
        if self.grammar is None or self.matcher is not None or self.error is not None:
            return True
        if not self.grammar.done():
            return False
        try:
            self.matcher = self.grammar.result().deep_copy()
        except Exception as err:  # noqa: BLE001 - any compile failure fails this request only
            self.error = str(err)
        return True

    @property
    def needs_last_token(self) -> bool:
        """Whether its next mask depends on the token just sampled (a grammar, or a bad word of
        several tokens): its step cannot be scheduled before the previous one is read."""
        return self.grammar is not None or any(len(w) > 1 for w in self.bad_words)

    @property
    def is_stopped(self) -> bool:
        """The grammar is complete and nothing may follow (the sequence finishes: "stop"); a grammar
        that failed is not complete (see `failure`)."""
        return self.matcher is not None and self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def failure(self) -> str | None:
        """Why the grammar cannot continue (llguidance gave up: a limit reached, a token it
        rejected), a digest; None while it can."""
        if self.matcher is None or not self.matcher.is_error():
            return None
        return (
            f"structured_outputs: the grammar could not continue after {self.num_accepted} token(s): "
            f"{digest(self.matcher.get_error())}"
        )

    def accept(self, token_id: int) -> None:
        """Advances the constraint over a token appended to the sequence's output."""
        self.num_accepted += 1
        if self.bad_words:
            self.history.append(token_id)
        if self.matcher is not None and not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)  # a rejected token leaves it in error: `failure`

    def banned_now(self, ahead: list[int] = ()) -> list[int]:
        """Bad words' tokens banned at the next position (after the output and then `ahead`): a
        one-token word always, a longer word's last token when the output ends with its other
        tokens."""
        history = self.history + list(ahead) if ahead else self.history
        out = []
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or history[len(history) - len(prefix) :] == prefix:
                out.append(word[-1])
        return out

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (none without a grammar, or when it can
        end here or choose: see llguidance's `compute_ff_tokens`)."""
        if self.matcher is None or self.matcher.is_stopped() or limit <= 0:
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def forced_run(self, limit: int) -> list[int]:
        """Up to `limit` next tokens each of which the constraint allows alone after the ones before
        it: the grammar's forced tokens (`forced_tokens`) up to the first whose mask row (grammar,
        tokenizer, `allowed_token_ids`, bad words) allows any other token. Plain decoding samples
        exactly these, whatever the model's logits and sampling parameters."""
        tokens = self.forced_tokens(limit)
        if not tokens:
            return []
        fill = llguidance().numpy.fill_next_token_bitmask
        row = np.empty((1, self.valid_ids.size), np.int32)
        words = row[0].view(np.uint32)
        n = 0
        for token in tokens:
            fill(self.matcher, row, 0)
            row &= self.valid_ids
            if self.static_mask is not None:
                row &= self.static_mask
            for banned in self.banned_now(tokens[:n]):
                words[banned // 32] &= ~np.uint32(1 << (banned % 32))
            if np.bitwise_count(words).sum() != 1 or not words[token // 32] >> (token % 32) & 1:
                break
            self.matcher.consume_token(token)
            n += 1
        self.matcher.rollback(n)
        return tokens[:n]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the constraint allows, each after the ones before it."""
        n = len(tokens)
        if self.matcher is not None and n:
            n = 0 if self.matcher.is_stopped() else self.matcher.validate_tokens(tokens)
        if self.static_mask is not None:
            words = self.static_mask.view(np.uint32)
            n = next((j for j, t in enumerate(tokens[:n]) if not words[t // 32] >> (t % 32) & 1), n)
        if self.bad_words:
            n = next((j for j in range(n) if tokens[j] in self.banned_now(tokens[:j])), n)
        return n


def fill_bitmask(
    executor, constraints: list[tuple[SequenceConstraint, int, list[int], list[int]]], bitmask: np.ndarray
) -> None:
    """Writes the rows of constrained sequences into a step's `[rows, W]` bitmask (the other rows
    are left as they are: all ones). Grammars fill their first rows on this thread, or in parallel
    on llguidance's threads when there is enough work to pay for waking them
    (`PARALLEL_MIN_BITS`); a sequence's rows after its proposals' on this thread, its matcher
    advanced over them and rolled back.

    Args:
      executor: llguidance's thread pool.
      constraints: `(constraint, row, forced, proposals)` of each constrained sequence of the
        step: its first row, the tokens it computes unsampled before that row (its
        `forced_run`), and the proposals it checks (row + j is sampled after the forced tokens
        and the first j proposals, which its constraint allows: `valid_prefix`).
      bitmask: `[rows, W]` int32, C-contiguous.
    """
    grammar_rows = [(c, row, f, p) for c, row, f, p in constraints if c.matcher is not None]
    if grammar_rows:
        fill = llguidance().numpy
        for c, _, forced, _ in grammar_rows:
            for token in forced:
                c.matcher.consume_token(token)
        matchers = [(c.matcher, row) for c, row, _, _ in grammar_rows]
        if len(matchers) * bitmask.shape[1] * 32 >= PARALLEL_MIN_BITS:
            fill.fill_next_token_bitmask_par(executor, matchers, bitmask)
        else:
            for matcher, row in matchers:
                fill.fill_next_token_bitmask(matcher, bitmask, row)
        for c, row, forced, proposals in grammar_rows:
            if proposals and not c.matcher.is_stopped():
                for j, token in enumerate(proposals, 1):
                    c.matcher.consume_token(token)
                    fill.fill_next_token_bitmask(c.matcher, bitmask, row + j)
                c.matcher.rollback(len(proposals))
            c.matcher.rollback(len(forced))
        # the engine's constraints share one tokenizer: one `valid_ids`
        rows = [row + j for _, row, _, p in grammar_rows for j in range(len(p) + 1)]
        bitmask[rows] &= grammar_rows[0][0].valid_ids
    words = bitmask.view(np.uint32)
    for c, row, forced, proposals in constraints:
        if c.static_mask is not None:
            bitmask[row : row + len(proposals) + 1] &= c.static_mask
        for j in range(len(proposals) + 1):
            for token in c.banned_now(forced + proposals[:j]):
                words[row + j, token // 32] &= ~np.uint32(1 << (token % 32))
