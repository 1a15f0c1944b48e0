"""Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`: gemma-3-4b, -12b and
-27b) served as their language model, text in and text out: config.json's `text_config` is a
Gemma 3 text model's, its tensors are under `language_model.`, and the vision tower's and the
projector's are skipped. (Images are not supported: README, "Not supported yet".)"""

import dataclasses

from jaxpaged.config.architectures.gemma3 import ARCHITECTURE as GEMMA3

PARAMS = tuple(dataclasses.replace(spec, hf_name="language_model." + spec.hf_name) for spec in GEMMA3.params)

ARCHITECTURE = dataclasses.replace(
    GEMMA3,
    name="gemma3_vlm",
    hf_names=("Gemma3ForConditionalGeneration",),
    params=PARAMS,
    text_config="text_config",
    ignored_prefixes=("vision_tower.", "multi_modal_projector."),
)
