"""The server's LoRA flags, read before anything heavy loads (no web framework, no JAX):
`--lora-modules` and vLLM's switch for changing adapters while serving (`lora_routes.py`)."""

import json
import os

from jaxpaged.lora_request import LoRARequest

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's own switch, its name kept


def runtime_updates() -> bool:
    """Whether the load and unload routes are on (`RUNTIME_LORA_ENV` is 1 or true)."""
    return os.environ.get(RUNTIME_LORA_ENV, "").lower() in ("1", "true")


def parse_lora_modules(values: list[str]) -> dict[str, LoRARequest]:
    """`--lora-modules` values, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, as
    adapters with ids 1, 2, ... in order.

    Raises:
      ValueError: a value of neither form, or a name given twice (naming the flag).
    """
    modules: dict[str, LoRARequest] = {}
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                name, path = item["name"], item["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'--lora-modules {value}: give name=path or {{"name": ..., "path": ...}}') from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value}: give name=path (or vLLM's JSON form)")
        if name in modules:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        modules[name] = LoRARequest(name, len(modules) + 1, path)
    return modules
