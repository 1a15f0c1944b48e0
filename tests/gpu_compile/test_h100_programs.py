"""The step programs an H100 runs, compiled here for it (XLA's deviceless compilation, see
jaxpaged/bench/gpu_targets.py), and what their memory analysis says on the product's platform:

- no program's temporaries grow with the KV pool, in every dtype, KV cache dtype and split (tensor
  and pipeline parallel), with the layers unrolled or scanned (the pool-size defect, checked where
  it would cost most);
- unrolled over per-layer arrays (the default), a step reads every weight where it lies; scanned,
  XLA copies each layer's weights out of the stack before its Triton GEMMs, every step (why
  scanning is not the default: the temporaries hold a layer's weights);
- at int4, steps of any size (16-token decode, 256-sequence decode and its fused steps, 2,048-token
  mixed) read the 4-bit codes in the Pallas group-quantized matmul (no widened weight written, no
  per-group partials in the temporaries);
- `jaxpaged bench startup --target h100` compiles an engine's whole program set for an H100.

Needs JAX's CUDA plugin (`pip install -e '.[gpu-compile]'`); CI runs these with the GPU
machines' JAX (stage 2). No GPU is used.
"""

import copy
import dataclasses
import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest


def _has_cuda_plugin() -> bool:
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


if not _has_cuda_plugin():  # shown as skipped, with why (CI's stage 2 installs the plugin)
    pytest.skip(
        "needs JAX's CUDA plugin to compile for an H100: pip install -e '.[gpu-compile]'", allow_module_level=True
    )

from jaxpaged.bench.gpu_targets import GPU_TARGETS, compiling_for_target, prepare_environment  # noqa: E402 (after the skip)
from jaxpaged.bench.startup import abstract_worker  # noqa: E402 (after the skip)
from jaxpaged.config.presets import get_preset  # noqa: E402 (after the skip)
from jaxpaged.engine_args import EngineArgs  # noqa: E402 (after the skip)
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR  # noqa: E402 (after the skip)

prepare_environment()

MiB = 2**20
SMALL_POOL, LARGE_POOL = 64 * MiB, 1280 * MiB  # 20x
TOLERANCE = 64 * 1024  # bytes of alignment noise


def model_dir(tmp_path, name: str, **config) -> str:
    """A directory holding `name`'s published config.json with `config` changed."""
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**copy.deepcopy(get_preset(name)), **config}))
    return str(path)


def tiny_dir(tmp_path) -> str:
    """Llama-shaped and small (head_dim 64, the kernels' smallest), for compiling many programs."""
    return model_dir(
        tmp_path,
        "llama-3.1-8b",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=2048,
    )


def h100_engine_args(model: str, pool_bytes: int, **options) -> EngineArgs:
    """A dummy-weight engine over `model` with a pool of `pool_bytes` (4 sequences of 1,024
    tokens, steps of 16 unless `options` say otherwise), uncached, as the H100 tests compile it."""
    limits = dict(max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=16)
    return EngineArgs(
        model=model,
        load_format="dummy",
        skip_tokenizer_init=True,
        compilation_cache_dir="none",
        kv_cache_memory_bytes=pool_bytes,
        **{**limits, **options},
    )


def compile_for_h100(model: str, pool_bytes: int, samplers: bool = False, only=None, **options) -> tuple[dict, object]:
    """An engine over `model` with `options` (4 sequences of 1,024 tokens, steps of 16 unless they
    say otherwise) started on shapes for H100s, through the engine's own start-up
    (`prepare_device_worker`): its step programs (those `only(program)` keeps, when given; or,
    with `samplers`, its samplers) compiled, `({program: its compiled executable}, the runner's
    abstract params)`."""
    args = h100_engine_args(model, pool_bytes, **options)
    with compiling_for_target("h100", args.tensor_parallel_size * args.pipeline_parallel_size) as devices:
        runner = abstract_worker(args, devices).runner
        assert runner.parallel.mesh.devices.flat[0].device_kind == GPU_TARGETS["h100"].description
        every = [p for p in runner.step_programs.all() if only is None or only(p)]
        every = runner.step_programs.samplers(every) if samplers else every
        compiled = {runner.step_programs.describe(p): runner.compile_program(p) for p in every}
    return compiled, runner.params


# An all-gather of the LM head's weight (its op metadata names the parameter): XLA's choice when
# only the logits' replicated sharding is pinned (1 GiB of temporaries for 8B at TP 2).
LM_HEAD_GATHER = re.compile(r"all-gather(?:-start)?\([^\n]*lm_head")

CASES = [
    pytest.param(dict(dtype="bfloat16"), id="bfloat16"),
    pytest.param(dict(dtype="float16"), id="float16"),
    pytest.param(dict(dtype="float32"), id="float32"),
    pytest.param(dict(dtype="bfloat16", kv_cache_dtype="fp8"), id="bfloat16-kv-fp8"),
    pytest.param(dict(dtype="bfloat16", kv_cache_dtype="fp8", quantization="fp8"), id="fp8-weights-kv-fp8"),
    pytest.param(dict(dtype="bfloat16", quantization="int8"), id="int8-weights"),
    pytest.param(dict(dtype="bfloat16", tensor_parallel_size=2), id="bfloat16-2-gpus"),
    pytest.param(dict(dtype="bfloat16", tensor_parallel_size=4), id="bfloat16-4-gpus-kv-heads-repeated"),
    pytest.param(dict(dtype="bfloat16", tensor_parallel_size=2, pipeline_parallel_size=2), id="bfloat16-2x2-stages"),
    pytest.param(dict(dtype="bfloat16", scan_layers=True), id="bfloat16-scanned"),
    pytest.param(
        dict(dtype="bfloat16", kv_cache_dtype="fp8", scan_layers=True, tensor_parallel_size=2),
        id="kv-fp8-scanned-2-gpus",
    ),
]


@pytest.mark.parametrize("options", CASES)
def test_no_h100_program_temporaries_grow_with_the_pool(tmp_path, options):
    assert_pool_independent(tiny_dir(tmp_path), options)


def test_gemma3_programs_with_per_layer_windows_compile_without_host_waits(tmp_path):
    """Gemma-3-1b's heads (head_dim 256, one kv head), six layers (five sliding, one full: each
    layer's window and frequencies traced), small widths: every step program compiles for an
    H100, waits on no host, and its temporaries do not grow with the pool."""
    model = model_dir(
        tmp_path, "gemma-3-1b", hidden_size=256, intermediate_size=512, num_hidden_layers=6, vocab_size=512
    )
    assert_pool_independent(model, dict(dtype="bfloat16"))


def assert_pool_independent(model: str, options: dict) -> None:
    """`model`'s step programs with `options`, compiled for an H100 over a small and a 20x larger
    pool: no host waits, the same temporaries, the pool donated and updated in place (and under
    tensor parallelism the LM head's shards never gathered)."""
    small, _ = compile_for_h100(model, SMALL_POOL, **options)
    large, _ = compile_for_h100(model, LARGE_POOL, **options)
    compiled = large
    assert_no_host_waits(large)
    small = {p: c.memory_analysis() for p, c in small.items()}
    large = {p: c.memory_analysis() for p, c in large.items()}
    # a mixed step, a decode step, fused decode steps (pipeline ticks: none fused)
    assert set(small) == set(large) and len(small) == (2 if options.get("pipeline_parallel_size", 1) > 1 else 3)
    grown = {
        p: (small[p].temp_size_in_bytes, large[p].temp_size_in_bytes)
        for p in small
        if abs(large[p].temp_size_in_bytes - small[p].temp_size_in_bytes) > TOLERANCE
    }
    assert not grown, f"temporaries (small pool, large pool) grow with the pool: {grown}"
    for p, analysis in large.items():  # the pool is donated and updated in place, not copied out
        assert analysis.alias_size_in_bytes >= LARGE_POOL * 0.95, (p, analysis)
    if options.get("tensor_parallel_size", 1) > 1:  # logits gathered, never the LM head's shards
        gathered = {p: LM_HEAD_GATHER.findall(c.as_text()) for p, c in compiled.items()}
        assert not any(gathered.values()), gathered


@pytest.fixture(scope="module")
def llama_8b_bfloat16(tmp_path_factory):
    """Llama-3.1-8B's shapes, two layers, bfloat16, unrolled: `(model dir, {program: its memory
    analysis}, the runner's abstract params)`."""
    model = model_dir(tmp_path_factory.mktemp("8b"), "llama-3.1-8b", num_hidden_layers=2)
    compiled, params = compile_for_h100(model, SMALL_POOL, dtype="bfloat16")
    return model, {p: c.memory_analysis() for p, c in compiled.items()}, params


def test_8b_programs_at_32k_and_128k_contexts_grow_only_by_their_block_tables(tmp_path):
    """Issue 48's lengths: Llama-3.1-8B's shapes (two layers, bfloat16) with --max-model-len 32768
    and 131072 (llama3 RoPE scaling's full context) compile for an H100; against 4,096, each step
    program's temporaries grow by at most two copies of the block tables' growth (4 sequences x
    blocks per sequence x 4 bytes: 124 KiB at 128K; measured one copy in a step, two in the fused
    steps), nothing that scales with the context's tokens; the pool (1.25 GiB: one 128K request)
    is updated in place."""
    model = model_dir(tmp_path, "llama-3.1-8b", num_hidden_layers=2)
    temps = {}
    for context in (4096, 32768, 131072):
        compiled, _ = compile_for_h100(model, LARGE_POOL, dtype="bfloat16", max_model_len=context)
        analyses = {p: c.memory_analysis() for p, c in compiled.items()}
        temps[context] = {p: a.temp_size_in_bytes for p, a in analyses.items()}
        assert all(a.alias_size_in_bytes >= LARGE_POOL * 0.95 for a in analyses.values()), context
    print("temporaries (bytes) by context:", temps)
    for context in (32768, 131072):
        tables = 4 * (context // 16 - 4096 // 16) * 4  # sequences x more blocks each x int32
        grown = {p: t - temps[4096][p] for p, t in temps[context].items()}
        assert set(temps[context]) == set(temps[4096]), context
        assert all(0 <= g <= 2 * tables + TOLERANCE for g in grown.values()), (context, tables, grown)


def test_unrolled_steps_read_weights_in_place_and_scanned_steps_copy_them(llama_8b_bfloat16):
    """Llama-3.1-8B's shapes, two layers: one layer's weights are 416 MiB in bfloat16."""
    model, unrolled, params = llama_8b_bfloat16
    scanned, _ = compile_for_h100(model, SMALL_POOL, dtype="bfloat16", scan_layers=True)
    scanned = {p: c.memory_analysis() for p, c in scanned.items()}
    layer_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params["layers"])) // 2
    assert 400 * MiB < layer_bytes < 440 * MiB
    temps = {p: (unrolled[p].temp_size_in_bytes // MiB, scanned[p].temp_size_in_bytes // MiB) for p in unrolled}
    print("temporaries (MiB, unrolled vs scanned):", temps)
    assert all(u.temp_size_in_bytes < layer_bytes / 4 for u in unrolled.values()), temps
    assert all(s.temp_size_in_bytes >= layer_bytes for s in scanned.values()), temps


def test_int4_steps_read_4_bit_codes_in_the_pallas_kernel(llama_8b_bfloat16):
    """Llama-3.1-8B's shapes at int4 (groups of 128), two layers, steps of at most 16 tokens: every
    projection's int4 codes go to the Pallas group-quantized matmul (a Triton call each, beside
    the attention kernel's), no program writes a widened weight (the census's upcasts), and no
    per-group partials `[G, T, O]` are written: the temporaries exceed bfloat16's (the same
    programs) by less than half of the largest projection's (32 x 16 x 14336 in bfloat16, 14 MiB;
    XLA's product wrote one per projection, 55 MiB for a step under jax 0.10.2)."""
    from benchmarks.gpu.hlo_census import census

    model, bfloat16, _ = llama_8b_bfloat16
    compiled, params = compile_for_h100(model, SMALL_POOL, dtype="bfloat16", quantization="int4")
    codes = [x for x in jax.tree.leaves(params["layers"]) if x.dtype == jnp.int4]
    assert len(codes) == 14  # 7 projections x 2 layers, 4-bit on the GPU
    partials = 16 * max(x.size for x in codes) // 128 * 2  # tokens x groups x outputs, bfloat16
    temps = {
        p: (round(bfloat16[p].temp_size_in_bytes / MiB, 1), round(c.memory_analysis().temp_size_in_bytes / MiB, 1))
        for p, c in compiled.items()
    }
    print("temporaries (MiB, bfloat16 vs int4):", temps)
    for program, executable in compiled.items():
        found = census(executable.as_text(), {x.size for x in codes})
        triton_calls = found["custom_calls"].get("__gpu$xla.gpu.triton", 0)
        assert found["weight_sized"]["upcasts"] == 0 and triton_calls >= 14 + 2, (program, found)
        temp = executable.memory_analysis().temp_size_in_bytes
        assert temp - bfloat16[program].temp_size_in_bytes < partials // 2, temps


def test_int4_large_steps_read_4_bit_codes_in_the_pallas_kernel(tmp_path):
    """Llama-3.1-8B's shapes, two layers, 256 sequences and steps of 2,048 tokens: at int4 the
    256-sequence decode step, its 4 fused decode steps and the 2,048-token mixed step also run every
    projection through the Pallas kernel (more tokens than a group, where XLA's product would
    widen each weight into a bfloat16 temporary, and in the fused steps hoist layers' widened
    weights out of the loop: 3.5 GiB of temporaries for 32 layers on an H100). No weight-sized
    upcast, and the temporaries (activations) are bfloat16's for the same programs, within 1 MiB:
    no widened weight (one layer's gate_proj is 112 MiB in bfloat16) among them."""
    from benchmarks.gpu.hlo_census import census

    model = model_dir(tmp_path, "llama-3.1-8b", num_hidden_layers=2)
    options = dict(max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048, num_scheduler_steps=4)
    large = lambda p: p.tokens == (256 if p.decode else 2048)  # noqa: E731
    bfloat16, _ = compile_for_h100(model, SMALL_POOL, only=large, dtype="bfloat16", **options)
    compiled, params = compile_for_h100(model, SMALL_POOL, only=large, dtype="bfloat16", quantization="int4", **options)
    codes = [x for x in jax.tree.leaves(params["layers"]) if x.dtype == jnp.int4]
    temps = {
        p: (
            round(bfloat16[p].memory_analysis().temp_size_in_bytes / MiB, 1),
            round(c.memory_analysis().temp_size_in_bytes / MiB, 1),
        )
        for p, c in compiled.items()
    }
    print("temporaries (MiB, bfloat16 vs int4):", temps)
    assert len(compiled) == 3 and any("x 4 step(s)" in p for p in compiled), list(compiled)
    for program, executable in compiled.items():
        found = census(executable.as_text(), {x.size for x in codes})
        triton_calls = found["custom_calls"].get("__gpu$xla.gpu.triton", 0)
        assert found["weight_sized"]["upcasts"] == 0 and triton_calls >= 14 + 2, (program, found)
        temp = executable.memory_analysis().temp_size_in_bytes
        assert temp - bfloat16[program].memory_analysis().temp_size_in_bytes < MiB, temps


def test_bench_startup_compiles_the_demo_engine_for_an_h100(tmp_path):
    from jaxpaged.cli import main

    out = tmp_path / "startup.json"
    assert (
        main(
            [
                "bench",
                "startup",
                "--target",
                "h100",
                "--model",
                DEMO_MODEL_DIR,
                "--max-num-seqs",
                "4",
                "--max-num-batched-tokens",
                "32",
                "--max-model-len",
                "256",
                "--output-json",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["device"] == "NVIDIA H100 80GB HBM3" and report["deviceless"] is True
    assert report["platform"] == "gpu" and report["scan_layers"] is False
    # probe, 2 mixed, a decode and fused decode steps, 4 samplers (with and without a mask), seeding
    assert report["num_programs"] == len(report["programs"]) == 10
    assert np.isclose(report["total_compile_s"], sum(p["compile_s"] for p in report["programs"]), atol=0.01)


def assert_no_host_waits(compiled: dict) -> None:
    """XLA:GPU runs a `conditional` by copying its predicate to the host and waiting for the
    stream, and a `while` without a known trip count the same way every iteration: no compiled
    program may hold a conditional, a host callback, or a loop of unknown trip count (the fused
    decode steps and the layer scan have known ones)."""
    for program, executable in compiled.items():
        text = executable.as_text()
        assert not re.findall(r"\bconditional\(", text), f"{program}: a conditional"
        assert "callback" not in text and "xla_python" not in text, f"{program}: a host callback"
        for loop in re.findall(r"\bwhile\([^\n]*", text):
            assert "known_trip_count" in loop, f"{program}: a while loop of unknown trip count"


@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(dtype="bfloat16"), id="bfloat16"),
        pytest.param(
            dict(dtype="bfloat16", speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
            id="speculative",
        ),
    ],
)
def test_no_h100_sampler_waits_on_the_host(tmp_path, options):
    """The samplers an H100 runs (both variants; with proposals, R rows per sequence) wait on
    nothing (the step programs are checked with the pool sizes above, in every configuration)."""
    compiled, _ = compile_for_h100(tiny_dir(tmp_path), SMALL_POOL, samplers=True, **options)
    assert any("sampler filter+logprobs+mask" in p for p in compiled) and all("sampler" in p for p in compiled)
    assert_no_host_waits(compiled)


@pytest.mark.parametrize(
    "target, usage, limits",
    [
        pytest.param("h100", "llm_class", (1024, 16384), id="h100-llm"),
        pytest.param("h100", "openai_api_server", (1024, 8192), id="h100-server"),
        pytest.param("h200", "llm_class", (1024, 16384), id="h200-llm"),
    ],
)
def test_engines_on_large_gpus_take_vllms_batch_limits(tmp_path, target, usage, limits):
    """Left unset, max_num_seqs and max_num_batched_tokens are vLLM's for the GPU and entry point
    (the engine's own start-up on described GPUs: their kind and memory); given ones stay."""
    args = EngineArgs(
        model=tiny_dir(tmp_path),
        load_format="dummy",
        skip_tokenizer_init=True,
        compilation_cache_dir="none",
        max_model_len=2048,
        usage_context=usage,
    )
    with compiling_for_target(target, 1) as devices:
        scheduling = abstract_worker(args, devices).config.scheduling
        assert (scheduling.max_num_seqs, scheduling.max_num_batched_tokens) == limits
        given = abstract_worker(dataclasses.replace(args, max_num_seqs=64), devices).config.scheduling
        assert (given.max_num_seqs, given.max_num_batched_tokens) == (64, limits[1])
