"""Parameter tables (no JAX here): how an architecture declares its parameters, and what follows
from the declarations.

  spec.py       a `ParamSpec` per parameter: its path in the model state, its logical axes (its
                shape follows from the model config), its checkpoint name and layout (a part of
                a fused tensor: `Fused`), whether weight quantization replaces it, how it is
                initialised; the logical axis names
  tables.py     every array of a model state with its shape and logical axes (quantized pairs
                included), looked up by path
  quantized.py  a model configuration with its weights' quantization applied (which groups its
                projections get, which the checkpoint leaves in float)

The architectures' tables (`jaxpaged.config.architectures`) are written in `spec.py`'s terms; the
model creates its parameters from them (`jaxpaged.model`), the sharding rules split them by their
axes (`jaxpaged.parallel`), the checkpoint key map reads them (`jaxpaged.checkpoint.hf_keys`), and
`jaxpaged plan` counts their bytes (`jaxpaged.planning`), all through `tables.py`.
"""
