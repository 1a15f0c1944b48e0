"""Mixtures of experts: the grouped matmul against numpy for routings that leave experts empty or
give one expert every row; its work does not grow with the number of experts; quantized experts;
and the engine (prefix caching, chunked prefill, preemption) equal to transformers unsharded,
with experts split over their FFN width, and with whole experts per device (expert parallelism),
each expert's weights on the device the sharding table names.

Logits and greedy tokens of the three architectures against transformers: test_hf_parity.py
(variants mixtral_moe, qwen2_moe, qwen3_moe).
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import tp_workload
import transformers
from checkpoint_edits import copy_checkpoint
from engine_fixtures import hf_greedy
from int4_checkpoints import pack_saved_checkpoint, round_to_nearest
from tiny_models import BASE, VARIANTS, save_hf_model

from jaxpaged.checkpoint.convert import convert_checkpoint
from jaxpaged.checkpoint.loader import load_model, load_params
from jaxpaged.config.hf_config import model_config_from_hf, read_model_config
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.model.group_quant import code_dtype, quantize_groups
from jaxpaged.model.grouped_matmul import grouped_matmul, num_tiles, tile_rows
from jaxpaged.model.moe import dense_experts_reference, experts_ffn
from jaxpaged.model.quant import quantize_weight
from jaxpaged.parallel.mesh import TensorParallel, make_mesh, param_path
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.paged_generate import PagedGenerator

D, F = 16, 24


def routings(rng, num_tokens: int, num_experts: int, top_k: int) -> dict[str, np.ndarray]:
    """`[T, K]` expert choices: random; every token to the same top-k (those get every row, the
    rest none); only the last experts; a token's experts distinct as a router gives them."""
    random = np.stack([rng.permutation(num_experts)[:top_k] for _ in range(num_tokens)])
    same = np.tile(np.arange(top_k), (num_tokens, 1))
    last = np.tile(np.arange(num_experts - top_k, num_experts), (num_tokens, 1))
    return {"random": random, "same experts": same, "last experts": last}


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (5, 8, 2), (40, 8, 2), (9, 16, 8)])
def test_grouped_matmul_equals_numpy_for_any_routing(num_tokens, num_experts, top_k):
    rng = np.random.default_rng(num_tokens)
    w = rng.normal(size=(num_experts, D, F)).astype(np.float32)
    for name, experts in routings(rng, num_tokens, num_experts, top_k).items():
        flat = experts.reshape(-1)
        order = np.argsort(flat, kind="stable")
        rows = rng.normal(size=(flat.size, D)).astype(np.float32)
        sizes = np.bincount(flat, minlength=num_experts).astype(np.int32)
        matmul = jax.jit(lambda rows, sizes, w: grouped_matmul(rows, sizes, lambda x, e: x @ w[e], F))
        ours = matmul(jnp.asarray(rows), jnp.asarray(sizes), jnp.asarray(w))
        expected = np.einsum("MD,MDF->MF", rows, w[flat[order]])
        np.testing.assert_allclose(np.asarray(ours), expected, rtol=1e-5, atol=1e-5, err_msg=name)


def test_tiles_bound_the_padding_and_not_the_experts():
    """NT tiles of TM rows hold any routing; with no more rows than experts (decode) the work is
    exactly the rows, for 8 experts or 128."""
    for rows, experts in [(16, 8), (16, 128), (4096, 8), (4096, 128), (7, 3)]:
        tile = tile_rows(rows, experts)
        worst = rows + min(experts, rows) * (tile - 1)  # every non-empty group wastes tile - 1 rows
        assert num_tiles(rows, experts, tile) * tile <= worst < (num_tiles(rows, experts, tile) + 1) * tile
    assert num_tiles(16, 16, tile_rows(16, 16)) * tile_rows(16, 16) == 16
    assert num_tiles(16, 128, tile_rows(16, 128)) * tile_rows(16, 128) == 16


def matmul_flops(fn, *args) -> int:
    """2 x multiply-adds of every `dot_general` in `fn`'s program, a loop's body times its trip
    count. (XLA's `cost_analysis()` counts a loop body once, so it cannot tell.)"""

    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contract, _), _ = eqn.params["dimension_numbers"]
                lhs = eqn.invars[0].aval.shape
                total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(np.prod([lhs[d] for d in contract]))
            trips = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
            for sub in _subjaxprs(eqn):
                total += trips * count(sub)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _subjaxprs(eqn):
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):
                yield v.jaxpr
            elif hasattr(v, "eqns"):
                yield v


def test_matmul_work_is_the_routed_rows_not_the_experts():
    """At top-2 the experts' FFN does the same matmul work for 16 and 64 experts, exactly the
    T * K routed rows' (decode: no more rows than experts, tiles of one row), where the dense
    all-experts product grows 4x."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(8, D)), jnp.float32)
    weights = jnp.full((8, 2), 0.5, jnp.float32)
    work = {}
    for num_experts in (16, 64):
        experts = jnp.asarray(np.stack([rng.permutation(num_experts)[:2] for _ in range(8)]), jnp.int32)
        arrays = {
            n: jnp.asarray(rng.normal(size=(num_experts, *s)), jnp.float32)
            for n, s in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D)))
        }
        grouped = matmul_flops(lambda a, x, w, e: experts_ffn(a, None, 2, x, w, e), arrays, x, weights, experts)
        dense = matmul_flops(
            lambda a, x, w, e: dense_experts_reference(x, w, e, a["gate_proj"], a["up_proj"], a["down_proj"]),
            arrays,
            x,
            weights,
            experts,
        )
        work[num_experts] = grouped, dense
    rows = 8 * 2
    combine = 2 * 8 * 2 * D  # the weighted sum of each token's 2 outputs
    assert work[16][0] == work[64][0] == 3 * 2 * rows * D * F + combine
    assert work[64][1] > 3.9 * work[16][1]


def test_pallas_grouped_matmul_experts_equal_the_dense_product():
    """The experts' FFN through the Pallas grouped-matmul kernel (interpreted here; what the
    Pallas backend runs on a GPU) equals the dense all-experts product, for a decode-sized step
    (one-row tiles) and a prefill-sized one, with one expert chosen by no token."""
    rng = np.random.default_rng(3)
    wide_d, wide_f, num_experts = 128, 256, 4
    arrays = {
        n: jnp.asarray(rng.normal(size=(num_experts, *s)) / 8, jnp.float32)
        for n, s in (("gate_proj", (wide_d, wide_f)), ("up_proj", (wide_d, wide_f)), ("down_proj", (wide_f, wide_d)))
    }
    for num_tokens in (2, 24):
        x = jnp.asarray(rng.normal(size=(num_tokens, wide_d)), jnp.float32)
        experts = jnp.asarray(np.stack([rng.permutation(3)[:2] for _ in range(num_tokens)]), jnp.int32)  # never 3
        weights = jnp.asarray(rng.dirichlet([1, 1], size=num_tokens), jnp.float32)
        ours = experts_ffn(arrays, None, 2, x, weights, experts, kernels=True)
        dense = dense_experts_reference(
            x, weights, experts, arrays["gate_proj"], arrays["up_proj"], arrays["down_proj"]
        )
        np.testing.assert_allclose(np.asarray(ours), np.asarray(dense), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(("method", "num_tokens"), [("int8", 6), ("fp8", 6), ("int4", 6), ("int4", 40)])
def test_quantized_experts_equal_the_dense_product_of_their_values(method, num_tokens):
    """Each expert weight as its quantized pair (`[E, out, in]` and `[E, out]` scales), or its
    int4 triple (`[E, in, out]` codes, `[E, G, out]` scales and zero points, each expert in groups
    of 8 inputs), gives what the dense reference gives with the dequantized weights (fp8 also
    quantizes the activations per row: a looser tolerance). int4 at 6 tokens: tiles of 2 rows,
    multiplied group by group; at 40: tiles of 16 rows, each tile's expert weight dequantized."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(num_tokens, D)), jnp.float32)
    experts = jnp.asarray(routings(rng, num_tokens, 4, 2)["random"], jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(num_tokens, 2)), jnp.float32)
    plain, arrays = {}, {}
    for name, shape in (("gate_proj", (D, F)), ("up_proj", (D, F)), ("down_proj", (F, D))):
        w = jnp.asarray(rng.normal(size=(4, *shape)), jnp.float32)
        if method == "int4":
            codes, scale, zero = quantize_groups(w, 4, 8, 1, num_lead=1)
            arrays.update({name + "_quant": codes, name + "_scale": scale, name + "_zero": zero})
            groups = codes.reshape(4, shape[0] // 8, 8, shape[1]).astype(jnp.float32)  # [E, G, 8, out]
            plain[name] = ((groups - zero[:, :, None]) * scale[:, :, None]).reshape(4, *shape)
            assert float(jnp.max(jnp.abs(plain[name] - w))) < float(jnp.max(scale))  # int4, not the weight itself
            continue
        q, scale = quantize_weight(w, method, 1, num_lead=1)
        arrays[name + "_quant"], arrays[name + "_scale"] = q, scale
        plain[name] = jnp.swapaxes(q.astype(jnp.float32) * scale[..., None], 1, 2)  # back to [E, in, out]
    ours = jax.jit(experts_ffn, static_argnums=(1, 2))(arrays, method, 2, x, weights, experts)
    expected = dense_experts_reference(x, weights, experts, plain["gate_proj"], plain["up_proj"], plain["down_proj"])
    tolerance = 0.1 if method == "fp8" else 1e-5
    err = float(jnp.linalg.norm(ours - expected) / jnp.linalg.norm(expected))
    assert err < tolerance, err


MAX_TOKENS = 10
INT4_GROUP = 16  # hidden 64, heads 4 x 16, expert widths 128 (Mixtral) and 32, shared 96: all divide


def int4_reference(path, variant: str, **config):
    """The tiny `variant` (its config changed by `config`) saved to `path / "int4"` (run with
    `--quantization int4`) and transformers on its round-to-nearest values saved to
    `path / "dequantized"` (an independent quantizer, tests/int4_checkpoints.py); returns (the
    int4 model's directory, the dequantized transformers model)."""
    model_dir, reference_dir = str(path / "int4"), str(path / "dequantized")
    save_hf_model(variant, model_dir, **config)
    round_to_nearest(copy_checkpoint(model_dir, reference_dir), INT4_GROUP)
    return model_dir, transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()


def test_int4_experts_logits_and_tokens_equal_transformers_on_the_dequantized_weights(tmp_path):
    """`--quantization int4` quantizes every expert and Qwen2-MoE's shared expert in groups of
    its own inputs: logits and greedy tokens equal transformers run on the round-to-nearest
    weights. A 70-token prompt gives the 4 experts tiles of 32 rows (each tile's expert weight
    dequantized), 9 tokens tiles of 4 (group by group). (Mixtral int4: the engine test below.)"""
    model_dir, hf = int4_reference(tmp_path, "qwen2_moe")
    config, model = load_model(model_dir, "float32", quantization="int4", quantization_group_size=INT4_GROUP)
    assert config.weight_group_size == INT4_GROUP and model.layers.moe.gate_proj_zero is not None
    generator = PagedGenerator(model)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, n).tolist() for n in (9, 70)]
    with torch.no_grad():
        for prompt in prompts:
            ours = generator.prompt_logits(prompt)
            np.testing.assert_allclose(ours, hf(torch.tensor([prompt])).logits[0].numpy(), atol=2e-4)
    for prompt, tokens in zip(prompts, generator.generate(prompts, MAX_TOKENS)):
        assert tokens == hf_greedy(hf, prompt, MAX_TOKENS)


# What each kind's checkpoint leaves in float, as its tools write it, and a list that also leaves
# one expert's w2 in float (refused: a projection is quantized in every expert or in none).
NOT_CONVERTED = {
    "awq": ("modules_to_not_convert", ["gate"], ["gate", "experts.3.w2"]),
    "compressed_group": (
        "ignore",
        ["lm_head", "re:.*block_sparse_moe[.]gate$"],
        ["lm_head", "re:.*block_sparse_moe[.]gate$", "model.layers.0.block_sparse_moe.experts.3.w2"],
    ),
}


@pytest.mark.parametrize(
    ("variant", "kind"),
    [("mixtral_moe", "awq"), ("mixtral_moe", "compressed_group"), ("qwen2_moe", "gptq_act_order_asym")],
)
def test_awq_gptq_and_compressed_experts_equal_transformers_on_their_dequantized_weights(tmp_path, variant, kind):
    """A mixture of experts' AWQ and compressed-tensors (Mixtral: each expert's w1, w2, w3 packed,
    the routers left in float, by `modules_to_not_convert: ["gate"]` as AutoAWQ writes it, by
    `ignore: ["lm_head", "re:.*block_sparse_moe[.]gate$"]` as llm-compressor does) and GPTQ
    act-order (Qwen2-MoE: each expert's own input order, and the shared expert's) checkpoints:
    logits and greedy tokens equal transformers on the packer's dequantized weights. A checkpoint
    that leaves one expert's projection in float but not the others' is refused naming it."""
    model_dir, reference_dir = tmp_path / kind, tmp_path / "dequantized"
    save_hf_model(variant, str(model_dir))
    field, left_float, uneven = NOT_CONVERTED.get(kind, (None, None, None))
    pack_saved_checkpoint(model_dir, kind, reference_dir, **({field: left_float} if field else {}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    config, model = load_model(model_dir, "float32")
    assert config.weight_act_order == (kind == "gptq_act_order_asym")
    assert_logits_and_tokens_equal(model, hf, atol=2e-4)
    if field:
        hf_config = json.loads((model_dir / "config.json").read_text())
        hf_config["quantization_config"][field] = uneven
        (model_dir / "config.json").write_text(json.dumps(hf_config))
        with pytest.raises(ValueError, match=rf"layers\.0\.block_sparse_moe\.experts\.3\.w2: .*{field}="):
            load_model(model_dir, "float32")


def assert_logits_and_tokens_equal(model, hf, atol: float) -> None:
    """A 9-token prompt's logits (to `atol`) and greedy tokens of `model` equal `hf`'s."""
    generator = PagedGenerator(model)
    prompt = np.random.default_rng(0).integers(3, 500, 9).tolist()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0].numpy()
    np.testing.assert_allclose(generator.prompt_logits(prompt), reference, atol=atol)
    assert generator.generate([prompt], MAX_TOKENS)[0] == hf_greedy(hf, prompt, MAX_TOKENS)


def test_autoawq_qwen2_moe_keeps_its_float_projections_float(tmp_path):
    """A Qwen2-MoE AWQ checkpoint as AutoAWQ writes it: `modules_to_not_convert: ["gate"]` leaves
    every `gate_proj` (each expert's and the shared expert's), the routers and the shared expert's
    gate in float; `shared_expert` here also leaves the whole shared expert in float. It loads
    with those projections float and the others (attention, the experts' up and down) 4-bit:
    logits and greedy tokens equal transformers on the dequantized weights, and jaxpaged-convert
    keeps the same arrays (codes stored int4, the float projections float32). A projection stored
    in float but not listed (the shared expert's up_proj once `shared_expert` is dropped) is
    refused naming its missing codes."""
    model_dir, reference_dir = tmp_path / "awq", tmp_path / "dequantized"
    save_hf_model("qwen2_moe", str(model_dir))
    pack_saved_checkpoint(model_dir, "awq", reference_dir, modules_to_not_convert=["gate", "shared_expert"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()
    config, model = load_model(model_dir, "float32")
    moe = model.layers.moe  # layer 0's arrays:
    assert (
        moe.gate_proj.get_value()[0].dtype == moe.shared_up_proj.get_value()[0].dtype == jnp.float32
    )  # [E, D, F], [D, S]
    assert (
        moe.up_proj_quant.get_value()[0].dtype == model.layers.attn.q_proj_quant.get_value()[0].dtype == code_dtype(4)
    )
    assert not hasattr(moe, "gate_proj_quant") and not hasattr(moe, "shared_down_proj_quant")
    assert_logits_and_tokens_equal(model, hf, atol=1e-4)

    out = convert_checkpoint(model_dir, tmp_path / "converted", "float32", progress=False)
    (_, converted), (_, original) = load_params(out), load_params(model_dir)
    for name, array in {**original["layers"]["moe"], **original["layers"]["attn"]}.items():
        stored = converted["layers"]["moe" if name in original["layers"]["moe"] else "attn"][name]
        assert stored.dtype == array.dtype, name
        np.testing.assert_array_equal(stored, array, err_msg=name)
    assert {"gate_proj", "up_proj_quant", "shared_up_proj", "router"} <= set(converted["layers"]["moe"])

    hf_config = json.loads((model_dir / "config.json").read_text())
    hf_config["quantization_config"]["modules_to_not_convert"] = ["gate"]
    (model_dir / "config.json").write_text(json.dumps(hf_config))
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.shared_expert\.up_proj\.qweight' is missing: .*float"
    ):
        load_model(model_dir, "float32")


def run_engine(path: str, n: int, prompts, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineArgs(**{**tp_workload.engine_options(path, n), **kwargs}))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o) for o in engine.step() if o.finished)
    return [done[i].outputs[0].token_ids for i in range(len(prompts))], engine


def expert_arrays(engine: LLMEngine, arrays_per_weight: int) -> list:
    """`(path, array)` of every expert array of the engine's model (one layer's each): a weight,
    or its quantized arrays (`arrays_per_weight` of them)."""
    leaves = jax.tree_util.tree_flatten_with_path(engine.runner.params)[0]
    names = ("gate_proj", "up_proj", "down_proj")
    paths = [(param_path(p), leaf) for p, leaf in leaves]
    found = [(p, leaf) for p, leaf in paths if p[1:2] == ("moe",) and {p[-1], p[-1].rsplit("_", 1)[0]} & set(names)]
    assert len(found) == 3 * 2 * arrays_per_weight  # 3 weights, 2 layers
    return found


# Tiny variants of the engine test: Mixtral with 6 experts, which 4 devices do not divide.
VARIANT_CONFIGS = {"mixtral_6_experts": ("mixtral_moe", {"num_local_experts": 6})}


@pytest.mark.parametrize(
    ("variant", "n", "expert_parallel", "quantization"),
    [("mixtral_moe", 1, False, None), ("qwen2_moe", 2, False, "int4"), ("mixtral_6_experts", 4, True, "int4")],
)
def test_engine_tokens_equal_transformers_unsharded_and_split(tmp_path, variant, n, expert_parallel, quantization):
    """Prefix caching, chunked prefill and preemption (tp_workload): Mixtral's 8 experts on one
    device; Qwen2-MoE's 4 experts and its shared expert in int4, split over their FFN width on 2
    (each expert's scales and zero points with its inputs); and Mixtral with 6 experts in int4
    over 4 devices as whole experts, 2, 2, 1 and 1 (8 slots, the last of devices 2 and 3 empty:
    zeros, never routed to). int4 runs equal
    transformers on the round-to-nearest weights."""
    variant, config = VARIANT_CONFIGS.get(variant, (variant, {}))
    if quantization is None:
        path, hf = str(tmp_path), save_hf_model(variant, str(tmp_path), **config)
        options = {}
    else:
        path, hf = int4_reference(tmp_path, variant, **config)
        options = {"quantization": quantization, "quantization_group_size": INT4_GROUP}
    prompts = tp_workload.prompts()
    tokens, engine = run_engine(path, n, prompts, enable_expert_parallel=expert_parallel, **options)
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    num_experts = read_model_config(path).moe.num_experts
    slots = {0: [0, 1], 1: [2, 3], 2: [4, None], 3: [5, None]}  # device -> its slots' experts (6 over 4)
    for name, array in expert_arrays(engine, 1 if quantization is None else 3):
        for shard in array.addressable_shards:
            experts, *rest = shard.index
            if expert_parallel:  # device d holds whole experts, its share of the slots
                d = list(array.sharding.mesh.devices.flat).index(shard.device)
                assert range(array.shape[0])[experts] == range(2 * d, 2 * d + 2), name
                assert shard.data.shape[1:] == array.shape[1:], name
                held = [bool(jnp.any(shard.data[i] != 0)) for i in range(2)]
                assert held == [e is not None for e in slots[d]], name
            else:  # every expert, a 1/n share of its FFN width (or of its groups)
                assert len(range(num_experts)[experts]) == num_experts, name
                assert np.prod(shard.data.shape) * n == np.prod(array.shape), name


def test_expert_parallel_over_8_devices_gives_the_one_device_tokens(tmp_path):
    """Qwen3-MoE's 16 experts, 2 whole ones per device on 8 (top-4, so most tokens' experts lie
    on several devices): two requests, the second arriving while the first decodes (continuous
    batching; the 30-token prompt prefills in chunks beside it), give the one-device tokens."""
    save_hf_model("qwen3_moe_tp", str(tmp_path))
    prompts = tp_workload.prompts()[3:]  # 5 and 30 tokens
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def tokens(n: int) -> list[list[int]]:
        engine = LLMEngine(EngineArgs(**tp_workload.engine_options(str(tmp_path), n), enable_expert_parallel=n > 1))
        engine.add_request("0", {"prompt_token_ids": prompts[0]}, params)
        done = {o.request_id: o for _ in range(3) for o in engine.step() if o.finished}
        engine.add_request("1", {"prompt_token_ids": prompts[1]}, params)
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
        return [done[str(i)].outputs[0].token_ids for i in range(2)]

    assert tokens(8) == tokens(1)


@pytest.mark.parametrize(("field", "value"), [("decoder_sparse_step", 2), ("mlp_only_layers", [0])])
def test_layers_mixing_dense_and_sparse_mlps_are_refused_by_name(field, value):
    hf = {**BASE, **VARIANTS["qwen3_moe"][2], "architectures": ["Qwen3MoeForCausalLM"], field: value}
    with pytest.raises(ValueError, match=f"{field}=.* is not supported"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    ("quantization", "expert_parallel"), [("fp8", False), ("fp8", True)], ids=["ffn-split", "expert-parallel"]
)
def test_quantized_experts_over_an_fp8_kv_pool_split_over_2_devices_give_the_one_device_tokens(
    tmp_path, quantization, expert_parallel
):
    """Quantization composes: fp8 expert weights (each expert's quantized pair, activations
    quantized per token) over an fp8 KV pool, split over 2 devices by FFN width or as 4 whole
    experts each, give the tokens of the same quantized model on one device. Split by FFN width,
    each device holds a share of the down projection's inputs: their maximum is taken over both
    devices, or each would scale a token by its own share's (the logits moved by 1.2 of 5)."""
    path = str(tmp_path)
    save_hf_model("mixtral_moe", path)
    config, one = load_model(path, "float32", quantization=quantization)
    layout = TensorParallelLayout(config, 2, expert_parallel=expert_parallel)
    parallel = TensorParallel(layout, make_mesh(2))
    _, split = load_model(path, "float32", parallel=parallel, quantization=quantization)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42] * 5, [300]]
    fp8 = "float8_e4m3fn"
    expected = PagedGenerator(one, block_size=4, kv_dtype=fp8).generate(prompts, MAX_TOKENS)
    assert PagedGenerator(split, block_size=4, kv_dtype=fp8).generate(prompts, MAX_TOKENS) == expected


def test_expert_parallel_spreads_experts_a_device_count_does_not_divide():
    """Slots even out the devices (no device two experts more than another); more devices than
    experts, or no experts, are refused naming the flag."""
    config = model_config_from_hf({**BASE, **VARIANTS["mixtral_moe"][2], "architectures": ["MixtralForCausalLM"]})
    config = dataclasses.replace(config, num_heads=8)  # (8 devices split them)

    def layout(num_experts: int, n: int) -> TensorParallelLayout:
        return TensorParallelLayout(
            dataclasses.replace(config, moe=dataclasses.replace(config.moe, num_experts=num_experts)), n, True
        )

    assert layout(8, 4).empty_expert_slots == () and layout(8, 4).mesh_config.moe == config.moe
    assert layout(6, 4).empty_expert_slots == (5, 7)
    assert layout(6, 4).mesh_config.moe.expert_slots == (0, 1, 2, 3, 4, 6)
    qwen = layout(60, 8)  # Qwen1.5/Qwen2-MoE's 60 over 8: 8, 8, 8, 8, 7, 7, 7, 7
    assert qwen.empty_expert_slots == (39, 47, 55, 63)
    assert qwen.mesh_shape(("layers", "moe", "gate_proj"), (2, 60, 64, 128)) == (2, 64, 64, 128)  # [L, E, D, F]
    assert qwen.device_shape(("layers", "moe", "router"), (2, 64, 60)) == (2, 64, 8)  # [L, D, E]
    experts = np.arange(6 * 2 * 3, dtype=np.float32).reshape(1, 6, 2, 3) + 1  # [L, E, D, F], one layer
    for array in (experts, jnp.asarray(experts)):  # a checkpoint's numpy, the dummy loader's jax
        slots = np.asarray(
            TensorParallel(layout(6, 4), make_mesh(4)).to_mesh_layout(("layers", "moe", "up_proj"), array)
        )
        np.testing.assert_array_equal(slots[:, [0, 1, 2, 3, 4, 6]], experts)
        assert not slots[:, [5, 7]].any()
    with pytest.raises(TensorParallelError, match="tensor_parallel_size=8 exceeds the number of experts \\(6\\)"):
        layout(6, 8)
    dense = dataclasses.replace(config, architecture="llama", moe=None)
    with pytest.raises(TensorParallelError, match="has no experts; drop --enable-expert-parallel"):
        TensorParallelLayout(dense, 2, True)


def test_group_sizes_that_do_not_divide_an_experts_inputs_or_split_a_group_are_refused():
    """Each expert is quantized alone, in groups of its own inputs: a size that does not divide
    the experts' FFN width is refused naming it; so is a tensor-parallel size that would split an
    expert's groups, which expert parallelism (whole experts) does not, nor a projection held in
    float (a shared expert an AWQ checkpoint leaves unquantized has no groups to split)."""
    config = model_config_from_hf({**BASE, **VARIANTS["qwen2_moe"][2], "architectures": ["Qwen2MoeForCausalLM"]})
    with pytest.raises(ValueError, match="=64 does not divide each expert's intermediate size=32"):
        config.with_weight_groups((4, 64))
    with pytest.raises(ValueError, match="=64 does not divide shared_expert_intermediate_size=96"):
        dataclasses.replace(config, moe=dataclasses.replace(config.moe, expert_size=64)).with_weight_groups((4, 64))
    grouped = dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_expert_size=64))
    grouped = grouped.with_weight_groups((4, 32))  # each expert's 32 inputs: one group
    with pytest.raises(TensorParallelError, match="expert_mlp inputs hold 1 groups of 32"):
        TensorParallelLayout(grouped, 2)
    assert TensorParallelLayout(grouped, 2, expert_parallel=True).param_mesh_axes(
        ("layers", "moe", "down_proj_scale")
    ) == (None, "tp", None, None)  # [L, E, G, D]: whole experts, their groups with them
    with pytest.raises(TensorParallelError, match="shared_mlp inputs hold 6 groups of 16"):
        TensorParallelLayout(config.with_weight_groups((4, 16)), 4, expert_parallel=True)
    shared = tuple(("layers", "moe", f"shared_{w}_proj") for w in ("gate", "up", "down"))
    TensorParallelLayout(config.with_weight_groups((4, 16), float_weights=shared), 4, expert_parallel=True)
