"""Tensor parallelism on 8 CPU devices: the same tokens for every tensor-parallel size, and every
parameter and the KV pool split where the sharding table says.

The tiny models have 8 query heads and fewer kv heads than the largest size (kv heads are then
repeated), Qwen2's vocabulary of 500 splits over 2 and 4 devices but not 8, and the workload
exercises prefix caching, chunked prefill, preemption and fused decode steps.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tp_workload
from engine_fixtures import hf_greedy
from flax import nnx
from shard_checks import check_loaded_into_shards
from tiny_models import save_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.loader import load_model
from jaxpaged.config.hf_config import model_config_from_hf, read_model_config
from jaxpaged.config.presets import get_preset
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.setup import build_model, device_weight_bytes, plan_cache
from jaxpaged.engine_args import EngineArgs, EngineArgsError
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import LayerArrays, Llama
from jaxpaged.parallel.mesh import TensorParallel, bytes_per_device, make_mesh, param_path
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.planning.memory import sequence_state_bytes
from jaxpaged.planning.plan import make_plan
from jaxpaged.sampling_params import SamplingParams

SIZES = (1, 2, 4, 8)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """variant -> (model dir, transformers' greedy continuations of tp_workload's prompts): each
    variant saved and run through transformers once for the module's tests (none writes to it)."""
    saved = {}

    def get(variant: str) -> tuple[str, list[list[int]]]:
        if variant not in saved:
            path = str(tmp_path_factory.mktemp(variant))
            hf = save_hf_model(variant, path)
            saved[variant] = path, [hf_greedy(hf, p, MAX_TOKENS) for p in tp_workload.prompts()]
        return saved[variant]

    return get


@pytest.fixture(scope="module", params=["llama_tp", "qwen2_tp", "mistral_tp", "phi3_tp", "gemma3_tp"])
def tp_model(request, saved_model):
    """(variant, model dir, prompts, transformers' greedy continuations)."""
    path, references = saved_model(request.param)
    return request.param, path, tp_workload.prompts(), references


def make_engine(path: str, n: int, **kwargs) -> LLMEngine:
    return LLMEngine(EngineArgs(**{**tp_workload.engine_options(path, n), **kwargs}))


run = tp_workload.run


@pytest.mark.parametrize("n", SIZES)
def test_greedy_tokens_equal_transformers_for_every_size(tp_model, n):
    variant, path, prompts, references = tp_model
    engine = make_engine(path, n)
    outputs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == references, f"{variant} on {n} devices differs from transformers"
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    # The default layout (layers unrolled): the per-layer arrays split at start-up keep each
    # layer's shards where the table puts them (kv heads repeated where devices outnumber them).
    config = read_model_config(path)
    [q] = jax.tree.leaves(
        engine.runner.params["layers"]["attn"]["q_proj"], is_leaf=lambda x: isinstance(x, LayerArrays)
    )
    assert [a.sharding.spec for a in q.arrays] == [
        engine.parallel.layer_sharding(("layers", "attn", "q_proj")).spec
    ] * config.num_layers
    shard = (config.hidden_size, config.num_heads // n, config.head_dim)  # query heads split over n
    assert {s.data.shape for s in q.arrays[0].addressable_shards} == {shard}


@pytest.mark.parametrize("n", [2, 4])  # 4: each of llama_tp's 2 kv heads repeated on 2 devices
def test_host_tier_swaps_per_device_shards_and_tokens_equal_transformers(saved_model, n):
    """The small-pool workload with a host tier: preempted sequences are swapped out and in,
    each device copying its own kv heads, with transformers' tokens."""
    path, references = saved_model("llama_tp")
    prompts = tp_workload.prompts()
    engine = make_engine(path, n, kv_offloading_size=2**-14)  # 64 KiB: 16 to 32 host blocks
    outputs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == references
    stats = engine.get_stats()
    assert stats["num_preemptions"] > 0 and stats["kv_swapped_in_blocks"] > 0 and stats["kv_load_bytes"] > 0
    k = engine.runner.kv_transfer.host.shape[4]  # the host block holds every device's heads
    assert k == TensorParallelLayout(read_model_config(path), n).mesh_config.num_kv_heads


def test_seeded_sampling_penalties_and_logprobs_agree_across_sizes(tmp_path):
    save_hf_model("llama_tp", str(tmp_path))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42] * 5, [300]]
    params = SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=7,
        max_tokens=10,
        ignore_eos=True,
        logprobs=3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
    )
    runs = {n: run(make_engine(str(tmp_path), n), prompts, params) for n in (1, 8)}
    for one, eight in zip(runs[1], runs[8]):
        assert one.token_ids == eight.token_ids
        np.testing.assert_allclose(one.cumulative_logprob, eight.cumulative_logprob, rtol=1e-4)
        for a, b in zip(one.logprobs, eight.logprobs):
            assert list(a) == list(b)  # the same top-3 ids
            np.testing.assert_allclose([x.logprob for x in a.values()], [x.logprob for x in b.values()], atol=1e-4)


# Every parameter's expected split over 8 devices for llama_tp (8 heads, 2 kv heads repeated to
# 8, MLP 128, vocabulary 512), written out rather than read from the table it checks.
EXPECTED_SPECS = {  # the decoder layers' parameters are stacked: a leading layer axis, never split
    "embed": ("tp", None),
    "lm_head": (None, "tp"),
    "q_proj": (None, None, "tp", None),
    "k_proj": (None, None, "tp", None),
    "v_proj": (None, None, "tp", None),
    "o_proj": (None, "tp", None, None),
    "gate_proj": (None, None, "tp"),
    "up_proj": (None, None, "tp"),
    "down_proj": (None, "tp", None),
    "scale": (),
}
EXPECTED_SHARDS = {  # one device's shard (2 layers)
    "embed": (64, 64),
    "lm_head": (64, 64),
    "q_proj": (2, 64, 1, 8),
    "k_proj": (2, 64, 1, 8),
    "v_proj": (2, 64, 1, 8),
    "o_proj": (2, 1, 8, 64),
    "gate_proj": (2, 64, 16),
    "up_proj": (2, 64, 16),
    "down_proj": (2, 16, 64),
    "scale": (64,),
    "layer_scale": (2, 64),
}


def test_every_parameter_and_the_pool_are_split_as_the_table_says(saved_model):
    """--scan-layers on 8 devices: the stacked parameters are split as the table says, and the
    scan slicing each layer out of its shards gives transformers' tokens."""
    path, references = saved_model("llama_tp")
    engine = make_engine(path, 8, scan_layers=True)
    prompts = tp_workload.prompts()
    outputs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == references
    leaves = jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]
    assert len(leaves) == 9 + 3  # every parameter is checked
    for path, leaf in leaves:
        name = param_path(path)[-1]
        spec = tuple(leaf.sharding.spec) + (None,) * (leaf.ndim - len(leaf.sharding.spec))
        expected = EXPECTED_SPECS[name] + (None,) * (leaf.ndim - len(EXPECTED_SPECS[name]))
        assert spec == expected, f"{jax.tree_util.keystr(path)}: {spec}"
        shard = EXPECTED_SHARDS["layer_scale" if name == "scale" and leaf.ndim == 2 else name]
        assert {s.data.shape for s in leaf.addressable_shards} == {shard}, name
        assert len(leaf.addressable_shards) == 8
    pool = engine.runner.cache.kv.k  # [L * NB, BS, K, H]
    assert pool.shape[2] == 8 and {s.data.shape[2] for s in pool.addressable_shards} == {1}
    # kv head h lives on devices 4h .. 4h+3, next to the query heads that read it
    k_proj = engine.runner.params["layers"]["attn"]["k_proj"][...][0]
    np.testing.assert_array_equal(np.asarray(k_proj[:, 0]), np.asarray(k_proj[:, 3]))
    assert not np.array_equal(np.asarray(k_proj[:, 3]), np.asarray(k_proj[:, 4]))


def test_per_device_bytes_shrink_and_match_jaxpaged_plan(tmp_path):
    """Weights and KV bytes per device shrink with the size and equal `jaxpaged plan`'s numbers;
    the engine's pool is plan's pool less the activations it measures and the per-sequence state."""
    save_hf_model("llama_tp", str(tmp_path))
    memory = 64 * 2**20  # a pretend device: 64 MiB
    weights, kv_per_token = [], []
    for n in SIZES:
        args = EngineArgs(
            model=str(tmp_path),
            dtype="float32",
            tensor_parallel_size=n,
            skip_tokenizer_init=True,
            max_model_len=64,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            gpu_memory_utilization=0.5,
        )
        config = EngineConfig.resolve(args)
        parallel = TensorParallel(config.layout, make_mesh(n))
        model = build_model(config, parallel)
        # The engine reads the allocator's limit, which is XLA_PYTHON_CLIENT_MEM_FRACTION (0.95) of the device.
        engine_plan = plan_cache(config, model, parallel, memory_bytes=int(memory * 0.95))
        report = make_plan(
            str(tmp_path),
            gpu_memory=memory,
            context=64,
            gpu_memory_utilization=0.5,
            tensor_parallel_size=n,
            dtype="float32",
        )
        assert device_weight_bytes(model) == report["weight_bytes_per_gpu"]
        on_devices = bytes_per_device(nnx.state(model))
        assert len(on_devices) == n and max(on_devices.values()) == min(on_devices.values())  # an even split
        assert engine_plan.bytes_per_token == report["kv_bytes_per_token"]
        per_block = engine_plan.bytes_per_token * engine_plan.block_size
        # the engine also holds the per-sequence state (penalty tables, last tokens), which plan leaves out
        state = sequence_state_bytes(args.max_num_seqs, config.model.vocab_size)
        gap = report["kv_pool_bytes_per_gpu"] - (engine_plan.pool_bytes + engine_plan.activation_bytes + state)
        assert engine_plan.activation_bytes > 0 and abs(gap) < per_block, (n, gap)
        weights.append(report["weight_bytes_per_gpu"])
        kv_per_token.append(report["kv_bytes_per_token"])
    assert weights == sorted(weights, reverse=True) and len(set(weights)) == len(SIZES)
    assert kv_per_token[:2] == [2 * 2 * 2 * 8 * 4, 2 * 2 * 1 * 8 * 4]  # 2 kv heads, then 1 per device
    assert kv_per_token[2:] == kv_per_token[1:2] * 2  # repeated kv heads: one per device


def test_sizes_that_do_not_split_are_named(tmp_path):
    save_hf_model("llama_tp", str(tmp_path))
    with pytest.raises(EngineArgsError, match="tensor_parallel_size=3: must divide num_attention_heads=8"):
        EngineConfig.resolve(EngineArgs(model=str(tmp_path), tensor_parallel_size=3, skip_tokenizer_init=True))
    with pytest.raises(EngineArgsError, match="tensor_parallel_size=16: must divide num_attention_heads=8"):
        EngineConfig.resolve(EngineArgs(model=str(tmp_path), tensor_parallel_size=16, skip_tokenizer_init=True))
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=16 needs 16 devices, but JAX sees 8"):
        make_mesh(16)


@pytest.mark.parametrize("n", [4, 8])
def test_llama_70b_shards_are_what_jaxpaged_plan_counts(n):
    """The engine's layout of Llama-3.1-70B (abstract: shapes and shardings, no weights) puts on
    each GPU exactly the bytes `jaxpaged plan` reports, and a pool of plan's kv heads per GPU."""
    config = model_config_from_hf(get_preset("llama-3.1-70b"))
    parallel = TensorParallel.create(config, n)
    model = nnx.eval_shape(
        lambda: Llama(parallel.layout.mesh_config, jnp.bfloat16, rngs=nnx.Rngs(0), parallel=parallel, scan_layers=True)
    )
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model))[0]
    per_device = sum(math.prod(parallel.param_sharding(param_path(p)).shard_shape(x.shape)) * 2 for p, x in leaves)
    report = make_plan("llama-3.1-70b", gpu_memory=80 * 2**30, context=8192, tensor_parallel_size=n)
    assert per_device == report["weight_bytes_per_gpu"]
    pool = parallel.pool_sharding.shard_shape((16, 16, parallel.layout.mesh_config.num_kv_heads, 128))
    assert pool[2] == report["kv_heads_per_gpu"] == 8 // n


@pytest.mark.parametrize("n", [2, 4])
def test_checkpoints_load_straight_into_their_shards(tmp_path, n):
    """From safetensors and from a converted (Orbax) checkpoint: every tensor arrives split as
    the table says and holds the checkpoint's values (kv heads repeated at N=4)."""
    hf_dir, converted = str(tmp_path / "hf"), str(tmp_path / "converted")
    save_hf_model("llama_tp", hf_dir)
    convert_checkpoint(hf_dir, converted, dtype="float32", progress=False)
    config = read_model_config(hf_dir)
    _, single = load_model(hf_dir, "float32", scan_layers=True)
    parallel = TensorParallel.create(config, n)
    check_loaded_into_shards(
        (hf_dir, converted),
        parallel,
        single,
        lambda leaf, expected, message: np.testing.assert_array_equal(np.asarray(leaf), expected, err_msg=message),
    )


def test_dummy_weights_are_the_same_model_for_every_size(tmp_path):
    """`load_format="dummy"` makes the checkpoint's random weights on the mesh (each device its
    shard): the same model, so the same greedy tokens, on 1 and 8 devices."""
    save_hf_model("llama_tp", str(tmp_path))
    prompts = [[5, 6, 7, 8, 9], [300] * 7]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one, eight = (run(make_engine(str(tmp_path), n, load_format="dummy"), prompts, params) for n in (1, 8))
    assert [o.token_ids for o in one] == [o.token_ids for o in eight]


def test_bfloat16_demo_model_gives_the_same_text_split_over_four_devices():
    """The trained demo model in bfloat16 (its checkpoint dtype; 2 kv heads, repeated onto 4
    devices): the same greedy text on one device and on four."""
    from jaxpaged import LLM
    from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

    prompts = ["In the beginning", "And God said", "The LORD is my shepherd"]
    texts = {}
    for n in (1, 4):
        llm = LLM(
            DEMO_MODEL_DIR,
            dtype="bfloat16",
            tensor_parallel_size=n,
            max_model_len=128,
            max_num_seqs=4,
            max_num_batched_tokens=32,
        )
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
        texts[n] = [o.outputs[0].text for o in outputs]
    assert texts[1] == texts[4]
