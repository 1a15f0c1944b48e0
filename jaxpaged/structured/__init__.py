"""Structured outputs with llguidance: grammars from `StructuredOutputsParams`, compiled off the
engine thread and cached, a matcher per sequence, and the packed token bitmask the sampler
applies on the device.

`check(params)` validates a constraint cheaply without an engine (the server calls it to answer
a 400 before a request reaches the engine); `shortest_document(params)` the shortest output it
allows, where that can be computed (the server warns when `max_tokens` is below it).
"""

from jaxpaged.structured.backend import GrammarBackend
from jaxpaged.structured.constraint import SequenceConstraint, bad_words_token_ids, fill_bitmask
from jaxpaged.structured.grammar import check, grammar_text

__all__ = ["GrammarBackend", "SequenceConstraint", "bad_words_token_ids", "check", "fill_bitmask", "grammar_text"]
