"""Start-up: `jaxpaged bench startup` reports every program the engine compiles; the scanned and the
unrolled decoder layers compute the same thing; the compilation cache is on by default."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpaged.cli import main
from jaxpaged.config.hf_config import read_model_config
from jaxpaged.config.model_config import ModelConfig
from jaxpaged.engine.setup import use_compilation_cache
from jaxpaged.engine_args import EngineArgs, default_compilation_cache_dir
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR
from jaxpaged.model import AttentionMetadata, Llama, init_kv_pool

LIMITS = ["--max-num-seqs", "2", "--max-model-len", "64", "--max-num-batched-tokens", "32", "--block-size", "16"]


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_bench_startup_compiles_and_reports_every_program(tmp_path, capsys, scan):
    out = tmp_path / "startup.json"
    flags = ["--model", DEMO_MODEL_DIR, *LIMITS, "--num-scheduler-steps", "4", "--compile-threads", "2"]
    assert (
        main(["bench", "startup", *flags, "--output-json", str(out), "--scan-layers" if scan else "--no-scan-layers"])
        == 0
    )
    report = json.loads(out.read_text())
    names = [row["program"] for row in report["programs"]]
    # token buckets 16 and 32 (2 seqs each) -> 2 mixed steps; decode bucket 16 -> a decode step and
    # fused steps; 2 seqs of 1 row -> four samplers (with and without a token mask)
    assert names == [
        "memory probe: mixed step, 32 tokens x 1 step(s), 2 seqs",
        "mixed step, 16 tokens x 1 step(s), 2 seqs",
        "mixed step, 32 tokens x 1 step(s), 2 seqs",
        "decode step, 16 tokens x 1 step(s), 2 seqs",
        "decode step, 16 tokens x 4 step(s), sampler plain, 2 seqs",
        "sampler plain, 2 seqs x 1 row(s)",
        "sampler filter+logprobs, 2 seqs x 1 row(s)",
        "sampler mask, 2 seqs x 1 row(s)",
        "sampler filter+logprobs+mask, 2 seqs x 1 row(s)",
        "penalty-row seeding",
    ]
    assert report["num_programs"] == 10 and report["scan_layers"] is scan and report["compile_threads"] == 2
    assert report["num_layers"] == 4 and report["platform"] == "cpu" and report["compilation_cache_dir"] is None
    assert (report["tensor_parallel_size"], report["pipeline_parallel_size"]) == (1, 1)
    # (the samplers and the seeding program are the same in both cases: JAX may reuse them from
    # memory within a process)
    assert all(row["compile_s"] > 0 and row["lower_s"] > 0 for row in report["programs"] if " step" in row["program"])
    assert report["total_compile_s"] == pytest.approx(sum(r["compile_s"] for r in report["programs"]), abs=0.01)
    assert 0 < report["wall_s"] <= report["total_lower_s"] + report["total_compile_s"] + 5
    assert f"ready after {report['wall_s']:.1f} s" in capsys.readouterr().out


def test_bench_startup_names_a_bad_flag(capsys):
    assert main(["bench", "startup", "--compile-threads", "0"]) == 2
    assert "--compile-threads" in capsys.readouterr().err


def test_bench_startup_for_a_gpu_says_what_to_install_without_the_cuda_plugin(capsys, monkeypatch):
    """Where JAX has no CUDA plugin (as in the test venv), `--target h100` cannot describe an H100
    (tests/gpu_compile/ runs the real thing where the gpu-compile extra is installed)."""
    from jax.experimental import topologies

    def no_plugin(**kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    assert main(["bench", "startup", "--target", "h100", "--model", DEMO_MODEL_DIR, *LIMITS]) == 2
    err = capsys.readouterr().err
    assert "--target h100" in err and "pip install 'jax[cuda12-local]==" in err and "topology not implemented" in err
    assert main(["bench", "startup", "--target", "h100", "--compilation-cache-dir", "/tmp/cc"]) == 2
    assert "--compilation-cache-dir" in capsys.readouterr().err  # a warm start needs the GPU itself


TINY_CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_scanned_and_unrolled_layers_give_the_same_logits_and_pool(dtype):
    """Three layers over a mixed batch (a 5-token prompt chunk and a decode): the scan over the
    stacked layers and the same layers unrolled write the same pool and give the same logits."""
    config = TINY_CONFIG
    model = Llama(config, dtype, rngs=nnx.Rngs(0), attention="reference", scan_layers=True)  # stacked
    graphdef, params = nnx.split(model)
    tables = np.zeros((2, 4), np.int32)
    tables[0, :2], tables[1, :1] = [3, 5], [2]
    positions = np.array([0, 1, 2, 3, 4, 3, 0, 0], np.int32)  # seq 0: 5 prompt tokens; seq 1: its 4th token
    slots = np.array([tables[0, p // 4] * 4 + p % 4 for p in positions[:5]] + [2 * 4 + 3, 0, 0], np.int32)
    meta = AttentionMetadata(
        positions=jnp.asarray(positions),
        slot_mapping=jnp.asarray(slots),
        cu_q_lens=jnp.array([0, 5, 6], jnp.int32),
        kv_lens=jnp.array([5, 4], jnp.int32),
        block_tables=jnp.asarray(tables),
        num_seqs=jnp.array(2, jnp.int32),
    )
    pool = init_kv_pool(config, num_blocks=8, block_size=4, dtype=dtype)
    # seq 1's first 3 tokens are already in its block, in every layer
    filled = jax.random.normal(jax.random.key(1), (config.num_layers, 4, 2, 8))
    rows = [layer * 8 + 2 for layer in range(config.num_layers)]
    pool = type(pool)(
        k=pool.k.at[np.array(rows)].set(filled.astype(pool.k.dtype)),
        v=pool.v.at[np.array(rows)].set(-filled.astype(pool.v.dtype)),
        num_layers=config.num_layers,
    )
    token_ids = jnp.array([5, 9, 11, 3, 7, 13, 0, 0], jnp.int32)

    def run(scan: bool):
        layers = nnx.merge(graphdef, params)
        layers.scan_layers = scan
        hidden, new_pool = layers(token_ids, pool, meta)
        return layers.compute_logits(hidden), new_pool

    scanned, unrolled = jax.jit(lambda: run(True))(), jax.jit(lambda: run(False))()
    # XLA fuses the two programs differently: equal up to rounding (one bfloat16 step at most)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip((scanned[0], scanned[1].k, scanned[1].v), (unrolled[0], unrolled[1].k, unrolled[1].v)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    # each layer wrote its own blocks: layer l's copy of block 3 (seq 0) differs between layers
    written = np.asarray(scanned[1].k).reshape(config.num_layers, 8, 4, 2, 8)[:, 3]
    assert not np.array_equal(written[0], written[1]) and not np.array_equal(written[1], written[2])


def test_compilation_cache_is_on_by_default_per_user(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert EngineArgs(model=DEMO_MODEL_DIR).compilation_cache_dir == "auto"
    assert default_compilation_cache_dir() == str(tmp_path / "jaxpaged" / "xla")
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        assert use_compilation_cache("auto") == str(tmp_path / "jaxpaged" / "xla")
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))  # JAX's own setting wins
        assert use_compilation_cache("auto") == str(tmp_path / "mine")
        assert use_compilation_cache("none") is None and jax.config.jax_compilation_cache_dir is None
    finally:
        use_compilation_cache(before or "none")


def test_unrolled_engines_hold_per_layer_arrays_and_give_the_scanned_tokens():
    """`--no-scan-layers` runs over per-layer arrays split once at start-up (no layer slice in
    the step program) and generates what the scanned engine generates."""
    from jaxpaged import LLM, SamplingParams
    from jaxpaged.model import LayerArrays

    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["In the beginning", "And the LORD said unto Moses"]
    texts = {}
    for scan in (True, False):
        llm = LLM(DEMO_MODEL_DIR, max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, scan_layers=scan)
        texts[scan] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        layers = llm.llm_engine.runner.params["layers"]
        leaves = jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, LayerArrays))
        if scan:
            assert all(not isinstance(leaf, LayerArrays) and leaf.shape[0] == 4 for leaf in leaves)
        else:
            assert all(isinstance(leaf, LayerArrays) and len(leaf.arrays) == 4 for leaf in leaves)
            assert {a.shape for leaf in leaves for a in leaf.arrays} >= {(256, 4, 64), (4, 64, 256)}  # q_proj, o_proj
    assert texts[True] == texts[False]


def test_unrolled_models_hold_per_layer_arrays_from_creation_and_load(tmp_path):
    """Unrolled layers hold each per-layer parameter as `LayerArrays` from the start: a new model,
    one loaded from safetensors (each layer's tensor placed as it is read) and one restored from a
    converted checkpoint (split once), each array with one layer's sharding and the values of the
    stacked (scanned) model's rows."""
    from tiny_models import save_hf_model

    from jaxpaged.checkpoint.convert import convert_checkpoint
    from jaxpaged.checkpoint.loader import load_model
    from jaxpaged.model import LayerArrays
    from jaxpaged.parallel.mesh import TensorParallel, param_path

    config = TINY_CONFIG
    fresh = {scan: Llama(config, jnp.float32, rngs=nnx.Rngs(0), scan_layers=scan) for scan in (True, False)}
    hf_dir, converted = str(tmp_path / "hf"), str(tmp_path / "converted")
    save_hf_model("llama_tp", hf_dir)
    convert_checkpoint(hf_dir, converted, dtype="float32", progress=False)
    parallel = TensorParallel.create(read_model_config(hf_dir), 2)
    loaded = {
        (source, scan): load_model(source, "float32", parallel=parallel, scan_layers=scan)[1]
        for source in (hf_dir, converted)
        for scan in (True, False)
    }
    pairs = [(fresh[True], fresh[False], None)] + [
        (loaded[s, True], loaded[s, False], parallel) for s in (hf_dir, converted)
    ]
    for stacked_model, split_model, mesh in pairs:
        stacked = dict(jax.tree_util.tree_flatten_with_path(nnx.state(stacked_model.layers))[0])
        split = jax.tree_util.tree_flatten_with_path(
            nnx.state(split_model.layers), is_leaf=lambda x: isinstance(x, LayerArrays)
        )[0]
        assert len(split) == len(stacked) == 9
        for path, layers in split:
            assert isinstance(layers, LayerArrays) and len(layers.arrays) == split_model.config.num_layers
            for i, array in enumerate(layers.arrays):
                np.testing.assert_array_equal(np.asarray(array), np.asarray(stacked[path])[i])
                if mesh is not None:
                    expected = mesh.layer_sharding(("layers", *param_path(path)))
                    assert array.sharding.is_equivalent_to(expected, array.ndim), path


def test_a_scan_over_per_layer_arrays_is_refused():
    model = Llama(TINY_CONFIG, jnp.float32, rngs=nnx.Rngs(0), attention="reference", scan_layers=False)
    model.scan_layers = True
    pool = init_kv_pool(TINY_CONFIG, num_blocks=4, block_size=4, dtype=jnp.float32)
    meta = AttentionMetadata(
        positions=jnp.zeros(8, jnp.int32),
        slot_mapping=jnp.zeros(8, jnp.int32),
        cu_q_lens=jnp.array([0, 1], jnp.int32),
        kv_lens=jnp.array([1], jnp.int32),
        block_tables=jnp.ones((1, 1), jnp.int32),
        num_seqs=jnp.array(1, jnp.int32),
    )
    with pytest.raises(ValueError, match="build it with scan_layers=True"):
        model(jnp.zeros(8, jnp.int32), pool, meta)
