"""A model's configuration with its weights' quantization applied: which weight groups its
projections get, and which a checkpoint's format leaves in float (read from the parameter table:
`tables.py`)."""

from typing import Any

from jaxpaged.config.group_formats import GROUP_FORMATS
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.config.params.tables import float_weights
from jaxpaged.config.quantization import checkpoint_group_format, group_size_field, weight_groups


def with_quantized_weights(
    config: ModelConfig, quantization: str | None, group_size: int, hf_config: dict[str, Any]
) -> ModelConfig:
    """`config` with the weight groups `quantization` gives its projections (`weight_groups`;
    act-ordered when the checkpoint's format stores a group per input, GPTQ `desc_act`; those
    its format leaves in float, AWQ's `modules_to_not_convert` or compressed-tensors' `ignore`,
    held plain: `float_weights`).

    Raises:
      ValueError: the group size does not divide a projection's inputs (naming `group_size_field`),
        or contradicts the groups jaxpaged-convert quantized the weights in; a projection left in
        float in some layers or experts only (naming one of each).
    """
    stored = checkpoint_group_format(hf_config) if quantization in GROUP_FORMATS else None
    act_order = stored is not None and stored.act_order
    left_float = () if stored is None else float_weights(config, stored)
    groups = weight_groups(quantization, group_size, hf_config)
    return config.with_weight_groups(groups, act_order, group_size_field(quantization), left_float)
