"""What a request asks of LoRA: the adapter it runs with (vLLM's `LoRARequest`). Imports nothing
of jaxpaged."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter (PEFT's format: `adapter_config.json` and `adapter_model.safetensors` in
    `lora_path`) that a request runs with, on an engine started with `enable_lora=True`.

    Attributes:
      lora_name: the adapter's name (the server's `model` field names it); one name is one
        adapter for the engine's life.
      lora_int_id: a positive id, unique per adapter (vLLM's).
      lora_path: the adapter's directory ("" for an adapter a JAX trainer handed over with
        `LLM.update_lora`, which returns its request).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name={self.lora_name!r} must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id={self.lora_int_id!r} must be a positive integer")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest.lora_path={self.lora_path!r}: give the adapter's directory")
