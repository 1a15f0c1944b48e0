"""Checks of option values that several front ends share (the engine's options, `jaxpaged plan`,
the KV planner), each declared once. No JAX here.

They raise `OptionError`, which names the option: front ends turn its `field` into their flag
(`jaxpaged.entrypoints.cli_flags.describe_error`), the engine's options into `EngineArgsError`.
"""


class OptionError(ValueError):
    """An option with a bad value; names the option so front ends can name their flag.

    Attributes:
      field: the option's name (an `EngineArgs` field where it is one).
      value: the value given.
      reason: what is wrong and how to fix it.
    """

    def __init__(self, field: str, value, reason: str):
        super().__init__(f"{field}={value!r}: {reason}")
        self.field, self.value, self.reason = field, value, reason

    def __reduce__(self):  # pickled from the engine-core process to the server, subclasses too
        return type(self), (self.field, self.value, self.reason)


def check_choice(field: str, value, choices) -> None:
    """Raises OptionError unless `value` is one of `choices`."""
    if value not in choices:
        raise OptionError(field, value, f"must be one of {', '.join(map(str, choices))}")


def check_block_size(block_size: int) -> None:
    """Raises OptionError unless `block_size` is a power of two (the kernels' tiles)."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, int)
        or block_size < 1
        or block_size & (block_size - 1)
    ):
        raise OptionError("block_size", block_size, "must be a power of two (8, 16, 32, ...)")


def check_batch_limits(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    """Raises OptionError unless a step's token budget holds one decode token of every sequence."""
    if max_num_batched_tokens < max_num_seqs:
        raise OptionError(
            "max_num_batched_tokens",
            max_num_batched_tokens,
            f"must be at least max_num_seqs ({max_num_seqs}); raise it or lower max_num_seqs",
        )


def check_memory_fraction(gpu_memory_utilization: float) -> None:
    """Raises OptionError unless `gpu_memory_utilization` is a number in (0, 1]."""
    value = gpu_memory_utilization
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise OptionError("gpu_memory_utilization", value, "must be a number in (0, 1]")


def json_object(value, error: type[ValueError], example: str) -> dict:
    """A JSON-object option (`speculative_config`, `kv_events_config`) as a dict: `value` itself,
    or its JSON text parsed.

    Raises:
      error: the text is not JSON, or not an object (`example` shows one).
    """
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise error(f"is not JSON ({err.msg} at character {err.pos})") from None
    if not isinstance(value, dict):
        raise error(f"must be a JSON object such as {example}")
    return value
