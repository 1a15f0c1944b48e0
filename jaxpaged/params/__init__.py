"""What follows from an architecture's parameter table (`jaxpaged.config.architectures`): every
array of a model state with its shape and logical axes (quantized pairs included), looked up by
path (no JAX here).

A table (`jaxpaged.config.params.ParamSpec`s) says of each parameter its path in the model
state, its logical axes (its shape follows from the model config), its checkpoint name and
layout, whether weight quantization replaces it, and how it is initialised. The model creates its
parameters from it (`jaxpaged.model`), the sharding rules split them by their axes
(`jaxpaged.parallel`), the checkpoint key map reads them (`jaxpaged.checkpoint.hf_keys`), and
`jaxpaged plan` counts their bytes (`jaxpaged.planning`), all through `tables.py`.
"""
