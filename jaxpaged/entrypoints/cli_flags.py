"""Command-line flags derived from `EngineArgs`, the argument types they share, and errors
rewritten to name flags (`--max-num-seqs`) rather than Python fields (`max_num_seqs`).

No JAX here: every flag is parsed and checked before anything slow is imported.
"""

import argparse
import dataclasses
import re

from jaxpaged.config.checks import OptionError
from jaxpaged.config.defaults import DEMO_MODEL_DIR  # the CLI's modules import it from here
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig

_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_bytes(text: str, *, unit_required: bool = False) -> int:
    """ "80GiB", "80G" (binary), "80GB" (decimal), "1.5TiB" or, unless `unit_required`, a plain
    byte count -> bytes.

    Raises:
      ValueError: unreadable, or a bare number where a unit is required.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a memory size; write e.g. 80GiB, 80GB or 85899345920")
    if unit_required and not unit:
        raise ValueError(f"{text!r} has no unit; write e.g. {text}GiB or {text}GB")
    return int(float(match.group(1)) * _UNITS[unit])


def _type(name: str, convert):
    """An argparse type whose errors read "invalid NAME value: ..." with our message."""

    def parse(text: str):
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = name
    return parse


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port (0-65535; 0 picks a free one)")
    return port


def _seed(text: str) -> int | None:
    if text.lower() in ("random", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is neither an integer nor 'random'") from None


PORT = _type("port", _port)
BYTES = _type("size", parse_bytes)
BYTES_WITH_UNIT = _type("size", lambda text: parse_bytes(text, unit_required=True))

# Flag types that are not the field's plain Python type.
_FLAG_TYPES = {"kv_cache_memory_bytes": BYTES, "seed": _type("seed", _seed), "master_port": PORT}


def flag_name(field: str) -> str:
    """The command-line flag of an `EngineArgs` (or any) field: `max_num_seqs` -> `--max-num-seqs`."""
    return "--" + field.replace("_", "-")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every flag's help unless the help already says its default."""

    def __init__(self, prog: str):
        super().__init__(prog, max_help_position=36)

    def _get_help_string(self, action: argparse.Action) -> str:
        if "default" in (action.help or "") or action.default is None:
            return action.help or ""
        return super()._get_help_string(action)


def add_engine_flags(
    parser: argparse.ArgumentParser, *, job_sized: tuple[str, ...] = (), defaults: dict | None = None
) -> None:
    """One flag per `EngineArgs` field (vLLM's names), with its help text and default.

    Args:
      parser: the subcommand's parser.
      job_sized: fields this subcommand sizes to its workload unless given (default None).
      defaults: this subcommand's own defaults of some fields (shown in --help).
    """
    defaults = defaults or {}
    for f in dataclasses.fields(EngineArgs):
        meta = f.metadata
        if not meta["flag"]:
            continue
        kwargs = dict(default=defaults.get(f.name, f.default), help=meta["help"], dest=f.name)
        if f.name == "model" and "model" not in defaults:
            kwargs["help"] += " (default: the embedded demo model)"
        if f.name in job_sized:
            kwargs.update(default=None, help=meta["help"].split(" (default")[0] + " (default: sized to the job)")
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            flag_type = _FLAG_TYPES.get(f.name) or _plain_type(f.type)
            kwargs.update(type=flag_type, choices=meta["choices"])
            kwargs["metavar"] = meta["metavar"] or (None if meta["choices"] else _METAVARS.get(flag_type, "TEXT"))
        parser.add_argument(flag_name(f.name), *meta["aliases"], **kwargs)


_METAVARS = {int: "N", float: "X"}


def _plain_type(annotation):
    for t in (int, float):
        if annotation in (t, t | None):
            return t
    return str


def engine_options(args: argparse.Namespace, **overrides) -> EngineArgs:
    """`EngineArgs` from parsed engine flags (the demo model when no model was given), not yet
    resolved against the model (`EngineConfig.resolve`)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}
    values.update(overrides)
    values["model"] = values.get("model") or DEMO_MODEL_DIR
    return EngineArgs(**values)


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    """The engine's configuration from parsed engine flags, resolved: every flag checked and the
    model's configuration read, without JAX."""
    return EngineConfig.resolve(engine_options(args, **overrides))


def engine_args(args: argparse.Namespace, **overrides) -> EngineArgs:
    """`EngineArgs` from parsed engine flags, checked as `engine_config` checks them (a "random"
    seed drawn: the engine runs with the one logged here)."""
    options = engine_options(args, **overrides)
    return dataclasses.replace(options, seed=EngineConfig.resolve(options).load.seed)


def describe_error(err: Exception, parser: argparse.ArgumentParser) -> str:
    """An error message for the command line: fields become the flags of `parser` that set them
    (`OptionError`'s field, fields quoted in backticks, and `snake_case=` names)."""

    def flag(name: str, otherwise: str) -> str:
        return flag_name(name) if _has_flag(parser, name) else otherwise

    if isinstance(err, OptionError) and _has_flag(parser, err.field):
        text = f"{flag_name(err.field)} {_show(err.value)}: {err.reason}"
    else:
        text = str(err)
    text = re.sub(r"`([a-z_]+)`", lambda m: flag(m.group(1), m.group(1)), text)
    # "SamplingParams.top_k", "max_model_len=...": a qualified field, or one with an underscore.
    # A name in double quotes is a JSON key (a --input line's own field), and one with an
    # extension a file name (generation_config.json): neither is a flag.
    pattern = r"(?:\bSamplingParams\.)?(?<!\")\b([a-z]+(?:_[a-z]+)+|(?<=SamplingParams\.)[a-z]+)\b(?!\"|\.\w)"
    return re.sub(pattern, lambda m: flag(m.group(1), m.group(0)), text)


def _show(value) -> str:
    return "random" if value is None else str(value)


def _has_flag(parser: argparse.ArgumentParser, field: str) -> bool:
    return flag_name(field) in parser._option_string_actions
