"""The device inputs of a step, declared once (numpy only, no JAX here).

Each entry of `STEP_FIELDS` is one field of the packed int32 buffer that carries a step to the
device: the packer's `Layout` sizes and orders the buffer from it, the device side
(`step_programs.unpack`) turns each field back into the `StepInput` (or `AttentionMetadata`)
field of the same name, and `StepPacker.pack` writes each (`tests/test_step_fields.py` holds
the three to the table and to `StepInput`'s annotations). A kernel that needs new metadata is
one entry here, the field on `StepInput` or `AttentionMetadata`, and the packer's line that
writes it.
"""

import dataclasses

import numpy as np

# Token ids a sequence may not sample yet (EOS and stop_token_ids before min_tokens), per row.
MAX_BANNED = 16
# Logit-bias entries per request (OpenAI's limit for `logit_bias`): each sampling row carries
# this many (token id, bias) pairs, padded with id V.
MAX_LOGIT_BIAS = 300
# Rows of `SamplingTensors`, in buffer order; float rows are bit-cast.
SAMPLING_FIELDS = (
    ("temperature", np.float32),
    ("top_k", np.int32),
    ("top_p", np.float32),
    ("min_p", np.float32),
    ("presence_penalty", np.float32),
    ("frequency_penalty", np.float32),
    ("repetition_penalty", np.float32),
    ("seed", np.int32),
    ("index", np.int32),
    ("position", np.int32),
    ("slot", np.int32),
    ("ban_until", np.int32),
)

TARGETS = ("step", "metadata", "fused")
KINDS = ("int", "bool", "float32", "sampling")


@dataclasses.dataclass(frozen=True)
class StepField:
    """One field of the packed step.

    Attributes:
      name: the buffer's view and the device field of that name.
      dims: its shape in the letters of `StepInput`'s annotations: T tokens, S sequences, S1
        S + 1, P pages per block table, SR sampling rows (S * R), B `MAX_BANNED`, LB
        `MAX_LOGIT_BIAS`, F the rows of `SAMPLING_FIELDS`; "" a scalar.
      target: "step" (a `StepInput` field), "metadata" (an `AttentionMetadata` field) or
        "fused" (read by the fused decode program only).
      kind: how the int32 words become the device value: "int" as they are, "bool" nonzero,
        "float32" bit-cast, "sampling" the `SamplingTensors` rows (`SAMPLING_FIELDS`).
      speculative: only with R > 1 (checking proposals); None in the `StepInput` otherwise.
    """

    name: str
    dims: str
    target: str = "step"
    kind: str = "int"
    speculative: bool = False


STEP_FIELDS = (
    StepField("token_ids", "T"),
    StepField("positions", "T", "metadata"),
    StepField("slot_mapping", "T", "metadata"),
    StepField("token_slot", "T"),
    StepField("token_is_output", "T", kind="bool"),
    StepField("from_last", "T", kind="bool"),
    StepField("cu_q_lens", "S1", "metadata"),
    StepField("kv_lens", "S", "metadata"),
    StepField("logits_indices", "SR"),
    StepField("num_drafts", "S", speculative=True),
    StepField("reset_slots", "S"),
    StepField("last_slot", "S"),
    StepField("live_steps", "S", "fused"),
    StepField("sampling", "F SR", kind="sampling"),
    StepField("block_tables", "S P", "metadata"),
    StepField("banned_ids", "SR B"),
    StepField("num_seqs", "", "metadata"),
    StepField("prompt_targets", "T"),  # the prompt token after each token (prompt logprobs)
    StepField("logit_bias_ids", "SR LB"),
    StepField("logit_bias_values", "SR LB", kind="float32"),
    StepField("lora_slots", "T"),  # each token's LoRA adapter slot (0: the base model)
)


def field_shapes(num_tokens: int, num_seqs: int, pages: int, rows_per_seq: int) -> list[tuple[str, tuple[int, ...]]]:
    """Each field's name and shape in a bucket of T tokens, S sequences, P pages and R sampling
    rows per sequence, in buffer order."""
    sizes = {
        "T": num_tokens,
        "S": num_seqs,
        "S1": num_seqs + 1,
        "P": pages,
        "SR": num_seqs * rows_per_seq,
        "B": MAX_BANNED,
        "LB": MAX_LOGIT_BIAS,
        "F": len(SAMPLING_FIELDS),
    }
    return [(f.name, tuple(sizes[d] for d in f.dims.split())) for f in STEP_FIELDS]
