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
    """Adapters by name, each registration keyed by its id and files (`register`'s key): a
    sequence, a pool slot and the host cache hold the key, so an adapter removed and another
    registered under its name never share a slot or a cached block.

    Args:
      config: the base model's configuration (the checkpoint's).
      lora: the engine's LoRA limits.
      kv_replicas: how often the mesh repeats each kv head (tensor parallelism over more
        devices than kv heads; 1 otherwise).
    """

    def __init__(self, config: ModelConfig, lora: LoraConfig, kv_replicas: int = 1):
        self.config, self.limits, self.kv_replicas = config, lora, kv_replicas
        self.names: dict[str, tuple[LoRARequest, str]] = {}  # name -> (request, key)
        self.requests: dict[str, LoRARequest] = {}  # key -> request (every registration's)
        self._weights: collections.OrderedDict[str, LoraWeights] = collections.OrderedDict()

    def register(self, request: LoRARequest) -> str:
        """Checks and reads (once) the adapter a request names; returns its key (also the cache
        salt its sequences' blocks are cached under).

        Raises:
          ValueError: the name taken by another adapter, or the adapter refused (its files named).
        """
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(request).__name__}")
        known = self.names.get(request.lora_name)
        if known is not None:
            if (known[0].lora_int_id, known[0].lora_path) != (request.lora_int_id, request.lora_path):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} is already this engine's adapter of id "
                    f"{known[0].lora_int_id} at {known[0].lora_path}; give another adapter another name"
                )
            return known[1]
        if not os.path.isdir(request.lora_path):
            raise ValueError(f"LoRARequest.lora_path={request.lora_path!r} is not a directory")
        weights = self._read(request)
        key = f"lora:{request.lora_int_id}:{weights.fingerprint}"
        self.names[request.lora_name] = (request, key)
        self.requests[key] = request
        self._keep(key, weights)
        return key

    def remove(self, name: str) -> bool:
        """Forgets the name (requests already queued keep their adapter); False if unknown."""
        return self.names.pop(name, None) is not None

    def weights(self, key: str) -> LoraWeights:
        """A registration's weights (read again if evicted from host memory)."""
        weights = self._weights.get(key)
        if weights is None:
            weights = self._read(self.requests[key])
        self._keep(key, weights)
        return weights

    def _read(self, request: LoRARequest) -> LoraWeights:
        try:
            return read_lora_weights(request.lora_path, self.config, self.limits.max_lora_rank, self.kv_replicas)
        except ValueError as err:
            raise ValueError(f"LoRA adapter {request.lora_name!r}: {err}") from None

    def _keep(self, key: str, weights: LoraWeights) -> None:
        self._weights[key] = weights
        self._weights.move_to_end(key)
        while len(self._weights) > (self.limits.max_cpu_loras or self.limits.max_loras):
            self._weights.popitem(last=False)
