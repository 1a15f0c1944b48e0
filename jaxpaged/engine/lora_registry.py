"""The LoRA adapters an engine has been asked for (no JAX): each read once and kept in host
memory, the `max_cpu_loras` most recently used, and read again from its directory when the pool
needs one that was evicted.

One name is one adapter for the engine's life (vLLM's rule): a request naming it with another
id or directory is refused. Blocks computed under an adapter are cached under its files'
fingerprint (`Sequence.cache_salt`), so they never serve another adapter or the base model.

An adapter a JAX trainer hands over (`update`) has no directory: its arrays are kept as given
(on the device), each update a new version with a key of its own, so sequences that started
with one version finish with it while the next ones start with the new one, and no cached block
of one version serves another. A version no sequence holds is forgotten at the next update.
"""

import collections
import os

from jaxpaged.checkpoint.lora import LoraWeights, read_lora_weights
from jaxpaged.config.lora import check_adapter_shapes
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
      mesh_config: the model as the mesh holds it (kv heads repeated), the layout of the
        adapters `update` takes (default: `config`).
    """

    def __init__(
        self, config: ModelConfig, lora: LoraConfig, kv_replicas: int = 1, mesh_config: ModelConfig | None = None
    ):
        self.config, self.limits, self.kv_replicas = config, lora, kv_replicas
        self.mesh_config = mesh_config or config  # a trainer's adapters come in the mesh's layout
        self.names: dict[str, tuple[LoRARequest, str]] = {}  # name -> (request, key)
        self.requests: dict[str, LoRARequest] = {}  # key -> request (every registration's)
        self._weights: collections.OrderedDict[str, LoraWeights] = collections.OrderedDict()
        self._in_memory: dict[str, LoraWeights] = {}  # key -> a trainer's adapter (never evicted)
        self._versions: dict[str, int] = {}  # name -> updates of that in-memory adapter so far

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
        if not request.lora_path:
            raise ValueError(
                f"LoRARequest.lora_path='' for adapter {request.lora_name!r}: give the adapter's directory "
                "(an adapter without one is made by update_lora)"
            )
        if not os.path.isdir(request.lora_path):
            raise ValueError(f"LoRARequest.lora_path={request.lora_path!r} is not a directory")
        weights = self._read(request)
        key = f"lora:{request.lora_int_id}:{weights.fingerprint}"
        self.names[request.lora_name] = (request, key)
        self.requests[key] = request
        self._keep(key, weights)
        return key

    def update(self, name: str, a: dict, b: dict, in_use: set[str]) -> LoRARequest:
        """Makes `(a, b)` (checked: `config.lora.check_adapter_shapes`) the adapter named `name`
        from now on, a new version of it if it exists; forgets its versions no key of `in_use`
        (the live sequences' adapters) holds. Returns the request that runs with it (its
        `lora_path` empty).

        Raises:
          ValueError: the name is an adapter read from a directory, or the arrays do not fit.
        """
        known = self.names.get(name)
        if known is not None and known[0].lora_path:
            raise ValueError(
                f"update_lora: {name!r} is the adapter read from {known[0].lora_path}; give the trainer's "
                f"adapter another name, or remove_lora({name!r}) first"
            )
        if set(a) != set(b):
            raise ValueError(
                f"update_lora: the adapter's A projections {sorted(a)} and B projections {sorted(b)} differ"
            )
        check_adapter_shapes({k: (a[k].shape, b[k].shape) for k in a}, self.mesh_config, self.limits.max_lora_rank)
        ids = [r.lora_int_id for r in self.requests.values()]
        request = known[0] if known else LoRARequest(name, 1 + max(ids, default=0), "")
        version = self._versions[name] = self._versions.get(name, 0) + 1
        key = f"lora:{request.lora_int_id}:trainer:{version}"
        self._forget_versions(name, in_use)
        self._in_memory[key] = LoraWeights(dict(a), dict(b), key)
        self.names[name], self.requests[key] = (request, key), request
        return request

    def remove(self, name: str, in_use: set[str] = frozenset()) -> bool:
        """Forgets the name (requests already queued keep their adapter; an in-memory adapter's
        versions no key of `in_use` holds are dropped); False if unknown."""
        self._forget_versions(name, in_use)
        return self.names.pop(name, None) is not None

    def _forget_versions(self, name: str, in_use: set[str]) -> None:
        """Drops the in-memory adapter `name`'s versions that no key of `in_use` holds."""
        for old in [k for k in self._in_memory if self.requests[k].lora_name == name and k not in in_use]:
            del self._in_memory[old], self.requests[old]

    def weights(self, key: str) -> LoraWeights:
        """A registration's weights (read again if evicted from host memory)."""
        if key in self._in_memory:
            return self._in_memory[key]
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
