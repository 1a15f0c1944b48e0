"""The LoRA adapters an engine has been asked for (no JAX): each read once and kept in host
memory, the `max_cpu_loras` most recently used, and read again from its directory when the pool
needs one that was evicted.

One name is one adapter for the engine's life (vLLM's rule): a request naming it with another
id or directory is refused. Blocks computed under an adapter are cached under its files'
fingerprint (`Sequence.cache_salt`), so they never serve another adapter or the base model.
"""

import collections
import os

from jaxpaged.checkpoint.lora import LoraWeights, read_lora_weights
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.sections import LoraConfig
from jaxpaged.lora_request import LoRARequest


class LoraRegistry:
    """Adapters by name.

    Args:
      config: the base model's configuration (the checkpoint's).
      lora: the engine's LoRA limits.
      kv_replicas: how often the mesh repeats each kv head (tensor parallelism over more
        devices than kv heads; 1 otherwise).
    """

    def __init__(self, config: ModelConfig, lora: LoraConfig, kv_replicas: int = 1):
        self.config, self.limits, self.kv_replicas = config, lora, kv_replicas
        self.requests: dict[str, LoRARequest] = {}
        self.fingerprints: dict[str, str] = {}
        self._weights: collections.OrderedDict[str, LoraWeights] = collections.OrderedDict()

    def register(self, request: LoRARequest) -> str:
        """Checks and reads (once) the adapter a request names; returns the cache salt its
        sequences' blocks are cached under.

        Raises:
          ValueError: the name taken by another adapter, or the adapter refused (its files named).
        """
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.requests.get(request.lora_name)
        if known is not None and (known.lora_int_id, known.lora_path) != (request.lora_int_id, request.lora_path):
            raise ValueError(
                f"LoRA adapter {request.lora_name!r} is already this engine's adapter of id {known.lora_int_id} "
                f"at {known.lora_path}; give another adapter another name"
            )
        if not os.path.isdir(request.lora_path):
            raise ValueError(f"LoRARequest.lora_path={request.lora_path!r} is not a directory")
        if known is None:
            weights = self._read(request)
            self.requests[request.lora_name] = request
            self.fingerprints[request.lora_name] = weights.fingerprint
            self._keep(request.lora_name, weights)
        return f"lora:{self.fingerprints[request.lora_name]}"

    def weights(self, name: str) -> LoraWeights:
        """A registered adapter's weights (read again if evicted from host memory)."""
        weights = self._weights.get(name)
        if weights is None:
            weights = self._read(self.requests[name])
        self._keep(name, weights)
        return weights

    def _read(self, request: LoRARequest) -> LoraWeights:
        try:
            return read_lora_weights(request.lora_path, self.config, self.limits.max_lora_rank, self.kv_replicas)
        except ValueError as err:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {err}") from None

    def _keep(self, name: str, weights: LoraWeights) -> None:
        self._weights[name] = weights
        self._weights.move_to_end(name)
        while len(self._weights) > (self.limits.max_cpu_loras or self.limits.max_loras):
            self._weights.popitem(last=False)
