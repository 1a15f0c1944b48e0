"""A mixture of experts' checkpoint tensors gathered into our per-expert parameters.

A checkpoint stores each expert's projection as a tensor of its own; our parameter holds a
layer's experts as one `[E, ...]` array (`jaxpaged.config.params.spec`, `EXPERTS`). The key map names
each tensor's expert (`KeySpec.expert`); `stack_experts` holds one parameter's experts of a
layer until all have been read (the key map orders them together), then yields them stacked.
"""

from collections.abc import Iterator

import numpy as np

from jaxpaged.checkpoint.hf_keys import KeySpec


def stack_experts(tensors: Iterator[tuple[KeySpec, np.ndarray]], num_experts: int) -> Iterator[tuple]:
    """`(target, layer, array)` of every tensor in our layout, each per-expert parameter's
    experts of one layer stacked `[E, ...]` once the last of them arrives.

    Args:
      tensors: `(key spec, array in our layout)` of every checkpoint tensor.
      num_experts: E (0 for a dense model).
    """
    pending: dict[tuple, dict[int, np.ndarray]] = {}
    for spec, array in tensors:
        if spec.expert is None:
            yield spec.target, spec.layer, array
            continue
        experts = pending.setdefault((spec.target, spec.layer), {})
        experts[spec.expert] = array
        if len(experts) == num_experts:
            del pending[(spec.target, spec.layer)]
            yield spec.target, spec.layer, np.stack([experts[e] for e in range(num_experts)])
    assert not pending, f"experts never completed: {sorted(pending)}"
