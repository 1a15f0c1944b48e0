"""Pipeline parallelism on 8 CPU devices: the same tokens as transformers for every stage count
and TP x PP split, each stage holding only its layers' weights and KV blocks.

The tiny model has 5 decoder layers, which 2 stages split 3 + 2 and 4 stages 2 + 1 + 1 + 1 (a
stage shorter than the longest passes activations through its empty slot). Prompts of several
lengths are prefilled together, so sequences straddle the micro-batches a step is cut into.
"""

import dataclasses

import jax
import numpy as np
import pytest
import torch
import tp_workload
from engine_fixtures import hf_greedy
from flax import nnx
from tiny_models import save_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.dummy import dummy_params
from jaxpaged.checkpoint.loader import _load_converted, load_model
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.setup import device_weight_bytes
from jaxpaged.engine_args import EngineArgs
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import LayerArrays
from jaxpaged.parallel.mesh import TensorParallel, make_mesh
from jaxpaged.planning.plan import make_plan
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.paged_generate import PagedGenerator

MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42] * 5, [300], [7] * 12]


@pytest.fixture(scope="module")
def pp_model(tmp_path_factory):
    """(model dir, transformers model, its greedy continuations of PROMPTS)."""
    path = str(tmp_path_factory.mktemp("llama_pp"))
    hf = save_hf_model("llama_pp", path)
    return path, hf, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def resolve(path: str, tp: int, pp: int, **options) -> EngineConfig:
    args = EngineArgs(
        model=path, dtype="float32", tensor_parallel_size=tp, pipeline_parallel_size=pp, skip_tokenizer_init=True
    )
    return EngineConfig.resolve(dataclasses.replace(args, **options))


def split(path: str, tp: int, pp: int, **options) -> TensorParallel:
    """The mesh and sharding table of `tp` devices per stage x `pp` stages (engine options too)."""
    layout = resolve(path, tp, pp, **options).layout
    return TensorParallel(layout, make_mesh(tp, None, pp))


@pytest.mark.parametrize("tp,pp", [(1, 2), (1, 4), (2, 2), (4, 2)])
def test_greedy_tokens_and_prompt_logits_equal_transformers(pp_model, tp, pp):
    path, hf, references = pp_model
    _, model = load_model(path, "float32", parallel=split(path, tp, pp))
    generator = PagedGenerator(model, block_size=4, block_shuffle_seed=0)
    assert generator.generate(PROMPTS, MAX_TOKENS) == references
    prompt = PROMPTS[1] + PROMPTS[0]  # 22 tokens in chunks of 8: every micro-batch cuts the chunk
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(prompt, chunk_size=8), expected, atol=2e-4)


def stage_rows(parallel: TensorParallel) -> dict:
    """Each device's stage: its row of the `[pp, tp]` mesh."""
    return {d: s for s, row in enumerate(parallel.mesh.devices) for d in row}


def test_every_weight_and_pool_shard_sits_on_its_stage(pp_model):
    """TP 2 x PP 2: slot j of stage s holds decoder layer `layer_at(s, j)` (its TP shard) on that
    stage's devices only, the empty slot zeros; the loaded and the dummy weights agree with the
    unpipelined model's layer by layer; the pool's shards hold one stage's slots of one kv head."""
    path, _, _ = pp_model
    parallel = split(path, 2, 2)
    pipe, rows = parallel.layout.pipeline, stage_rows(parallel)
    assert pipe.layers_per_stage == (3, 2) and pipe.max_layers == 3
    _, model = load_model(path, "float32", parallel=parallel)
    _, flat = load_model(path, "float32", parallel=split(path, 2, 1))
    is_slots = lambda x: isinstance(x, LayerArrays)  # noqa: E731
    staged = jax.tree_util.tree_flatten_with_path(nnx.state(model), is_leaf=is_slots)[0]
    unstaged = dict(jax.tree_util.tree_flatten_with_path(nnx.state(flat), is_leaf=is_slots)[0])
    per_layer = [(path_, leaf) for path_, leaf in staged if is_slots(leaf)]
    assert len(per_layer) == 9  # q, k, v, o, gate, up, down, two norms
    for key, slots in per_layer:
        assert len(slots.arrays) == 3
        for slot, array in enumerate(slots.arrays):
            assert array.shape[0] == 2 and len(array.addressable_shards) == 4
            for shard in array.addressable_shards:
                stage = rows[shard.device]
                assert shard.index[0] == slice(stage, stage + 1)  # the device holds its own stage's layer
                layer = pipe.layer_at(stage, slot)
                data = np.asarray(shard.data)[0]
                if layer is None:
                    assert not data.any()
                else:
                    np.testing.assert_array_equal(data, np.asarray(unstaged[key][layer])[shard.index[1:]])
    for key, leaf in staged:  # the embedding, LM head, final norm: every stage, split over its 2 devices
        if not is_slots(leaf):
            assert {s.data.shape for s in leaf.addressable_shards} == {
                s.data.shape for s in unstaged[key].addressable_shards
            }
    report = make_plan(path, gpu_memory=2**30, tensor_parallel_size=2, pipeline_parallel_size=2, dtype="float32")
    assert device_weight_bytes(model) == report["weight_bytes_per_gpu"]
    config = resolve(path, 2, 2, load_format="dummy", seed=3)
    dummy = dummy_params(config.model, np.float32, config.load, parallel)
    dummy_flat = dummy_params(config.model, np.float32, config.load, split(path, 2, 1))
    down = ("layers", "mlp", "down_proj")
    for layer in range(config.model.num_layers):
        stage, slot = pipe.stage_of(layer), pipe.slot_of(layer)
        np.testing.assert_array_equal(np.asarray(dummy[down][slot])[stage], np.asarray(dummy_flat[down][layer]))
    assert not np.asarray(dummy[down][2])[1].any()  # stage 1's empty slot
    generator = PagedGenerator(model, block_size=4)
    pool, _, _ = generator._setup([16], 16)
    for shard in pool.k.addressable_shards:  # [P * slots * NB, BS, K, H]: a stage's slots, one kv head
        stage = rows[shard.device]
        assert shard.data.shape == (pool.k.shape[0] // 2, 4, 1, 8)
        assert shard.index[0] == slice(stage * pool.k.shape[0] // 2, (stage + 1) * pool.k.shape[0] // 2)


@pytest.mark.parametrize(
    "tp,options",
    [
        (2, dict(kv_offloading_size=2**-14, preemption_mode="swap")),  # a host tier: swapped out and in
        (1, dict(preemption_mode="recompute", speculative_config={"method": "ngram", "num_speculative_tokens": 2})),
    ],
    ids=["swap-host-tier", "recompute-ngram"],
)
def test_engine_at_two_stages_equals_transformers_through_preemption_and_prefix_hits(pp_model, tp, options):
    """The tensor-parallel workload (shared prefixes, chunked prefill, a pool too small for every
    sequence at once) at PP 2: continuous batching, prefix hits and preemption give
    transformers' tokens, with the pool's blocks of both stages freed at the end."""
    path, hf, _ = pp_model
    prompts = tp_workload.prompts()
    engine = LLMEngine(EngineArgs(**{**tp_workload.engine_options(path, tp, pp=2), **options}))
    outputs = tp_workload.run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    if "kv_offloading_size" in options:
        assert stats["kv_swapped_in_blocks"] > 0
        assert engine.runner.kv_transfer.host.shape[2] == 2 * 3  # [C, 2, P * slots, BS, K, H]: every slot


@pytest.mark.parametrize("tp,pp,layers_per_device", [(1, 5, 1), (2, 2, 5)], ids=["equal-stages", "unequal-stages"])
def test_converted_checkpoint_restores_into_its_stages(pp_model, tmp_path, tp, pp, layers_per_device):
    """A jaxpaged-convert directory at PP: with equal stages (5 layers over 5) each device reads
    only its stage's layer of every stacked tensor, with unequal ones (3 + 2) every layer; either
    way the slots are cut on the devices and equal the HF directory's, slot by slot, where they
    lie (whose tokens the tests above check)."""
    path, _, _ = pp_model
    converted = str(tmp_path / "converted")
    convert_checkpoint(path, converted, dtype="float32", progress=False)
    parallel = split(path, tp, pp)
    config = resolve(path, tp, pp).model
    _, restored = _load_converted(converted, config, "float32", parallel)
    stacked = restored["layers"]["mlp"]["down_proj"]  # [L, F, D], F split over the stage's devices
    assert {s.data.shape[0] for s in stacked.addressable_shards} == {layers_per_device}
    _, model = load_model(converted, "float32", parallel=parallel)
    _, from_hf = load_model(path, "float32", parallel=parallel)
    is_slots = lambda x: isinstance(x, LayerArrays)  # noqa: E731
    want = dict(jax.tree_util.tree_flatten_with_path(nnx.state(from_hf), is_leaf=is_slots)[0])
    for key, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model), is_leaf=is_slots)[0]:
        pairs = zip(leaf.arrays, want[key].arrays) if is_slots(leaf) else [(leaf, want[key])]
        for got, expected in pairs:
            assert got.sharding.is_equivalent_to(expected.sharding, got.ndim)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_quantized_weights_split_over_stages_give_the_unsplit_tokens(pp_model):
    """Weights quantized at load (int4: codes, scales and zero points per group) split over 2
    stages x 2 devices, over an fp8 KV pool (its scales split over the stages' layer slots),
    give the same greedy tokens as the quantized model on one device."""
    path, _, _ = pp_model
    kwargs = dict(quantization="int4", quantization_group_size=16)
    _, one = load_model(path, "float32", **kwargs)
    _, staged = load_model(path, "float32", parallel=split(path, 2, 2, **kwargs), **kwargs)
    fp8 = "float8_e4m3fn"
    expected = PagedGenerator(one, block_size=4, kv_dtype=fp8).generate(PROMPTS, MAX_TOKENS)
    assert PagedGenerator(staged, block_size=4, kv_dtype=fp8).generate(PROMPTS, MAX_TOKENS) == expected
    assert jax.tree.leaves(staged.layers.attn.q_proj_quant.get_value())[0].shape[0] == 2  # slots [P, ...]
