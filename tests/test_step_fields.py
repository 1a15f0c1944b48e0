"""The step's device inputs are one table (`worker/step_fields.py`): the packed layout, the device
side's unpacking and the packer's writes all follow it, and it agrees with `StepInput`'s and
`AttentionMetadata`'s annotated fields. A field added in one place only fails here."""

import ast
import dataclasses
import inspect
import textwrap
import typing

import jax.numpy as jnp
import numpy as np

from jaxpaged.functional import StepInput
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.worker.step_fields import KINDS, STEP_FIELDS, TARGETS
from jaxpaged.worker.step_packer import Layout, StepPacker
from jaxpaged.worker.step_programs import unpack

DTYPES = {"int": "Int", "bool": "Bool", "float32": "Float"}


def _annotated(cls, skip: set[str]) -> dict[str, tuple[str, str]]:
    """A dataclass's array fields: name -> (jaxtyping dtype name, dims)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        kind = next(t for t in typing.get_args(f.type) or (f.type,) if t is not type(None))  # (X | None: X)
        out[f.name] = (getattr(getattr(kind, "dtype", None), "__name__", None), getattr(kind, "dim_str", None))
    return out


def test_the_table_is_step_inputs_and_metadatas_fields_with_their_shapes_and_dtypes():
    step = _annotated(StepInput, {"metadata"})
    metadata = _annotated(AttentionMetadata, {"decode_only"})
    assert all(f.target in TARGETS and f.kind in KINDS for f in STEP_FIELDS)
    assert len({f.name for f in STEP_FIELDS}) == len(STEP_FIELDS)
    declared = {f.name: f for f in STEP_FIELDS}
    assert {n for n, f in declared.items() if f.target == "step"} == set(step)
    assert {n for n, f in declared.items() if f.target == "metadata"} == set(metadata)
    for name, (dtype, dims) in {**step, **metadata}.items():
        field = declared[name]
        if field.kind == "sampling":  # SamplingTensors: its rows (`[F, SR]` in the buffer)
            assert dtype is None and field.dims.split()[-1] == "SR"
            continue
        assert (DTYPES[field.kind], field.dims) == (dtype, dims), name


def test_the_packer_writes_every_field_and_nothing_else():
    """`StepPacker.pack` writes its views by name (`v["..."]`): exactly the table's fields."""
    source = textwrap.dedent(inspect.getsource(StepPacker.pack))
    written = {
        node.slice.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Name)
        and node.value.id == "v"
        and isinstance(node.slice, ast.Constant)
    }
    assert written == {f.name for f in STEP_FIELDS}


def test_unpacking_gives_each_field_its_view_and_value():
    """Every field of a layout with proposals (R = 2) comes back from a buffer of distinct words
    at its view, converted as its kind says; with R = 1 the speculative fields are None, and
    without LoRA (a step no adapter is in) the adapter slots are."""
    layout = Layout(num_tokens=16, num_seqs=4, pages=3, rows_per_seq=2)
    flat = np.arange(layout.size, dtype=np.int32)
    views, inp = layout.views(flat), unpack(layout, jnp.asarray(flat), lora=True)
    for field in STEP_FIELDS:
        if field.target == "fused":
            continue
        value = getattr(inp.metadata if field.target == "metadata" else inp, field.name)
        words = views[field.name]
        if field.kind == "sampling":
            assert np.asarray(value.seed).tolist() == words[7].tolist()  # an int row of SamplingTensors
            assert np.asarray(value.temperature).view(np.int32).tolist() == words[0].tolist()
        elif field.kind == "bool":
            assert np.asarray(value).tolist() == (words != 0).tolist(), field.name
        else:
            assert np.asarray(value).view(np.int32).tolist() == words.tolist(), field.name
    single = unpack(Layout(16, 4, 3), jnp.zeros(Layout(16, 4, 3).size, jnp.int32))
    assert all(getattr(single, f.name) is None for f in STEP_FIELDS if f.speculative)
    assert single.lora_slots is None and unpack(layout, jnp.asarray(flat)).lora_slots is None
