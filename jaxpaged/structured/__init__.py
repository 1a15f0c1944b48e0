"""Structured outputs with llguidance: grammars from `StructuredOutputsParams`, compiled off the
engine thread and cached, a matcher per sequence, and the packed token bitmask the sampler
applies on the device.

`check(params)` validates a constraint cheaply without an engine (the server calls it to answer
a 400 before a request reaches the engine).
"""

from jaxpaged.structured.grammar import check, grammar_text

__all__ = ["check", "grammar_text"]
