"""The engine in a training loop: new weights (the engine's pytree shared, host arrays, plain
weights quantized by an fp8 or int4 engine, Hugging Face pairs) give a fresh engine's tokens on 1, 2 and
4 devices; bad weights are refused naming the parameter with nothing changed; the old weights'
buffers are gone; sleep and wake give back and take the memory they say; pausing; the scoring
path's log-probabilities equal the sampler's."""

import functools
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file
from tiny_models import save_hf_model

from jaxpaged.checkpoint.loader import load_model
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.functional import token_logprobs
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.worker.weight_update import WeightUpdateError

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [30, 31, 32]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)
# The sampler's log-probabilities (decode and prefill programs) against the scoring path's (one
# prefill of the whole sequence) for bfloat16 weights on a CPU: measured max |delta| 8e-3.
BF16_LOGPROB_TOLERANCE = 3e-2


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Two checkpoints of the same shapes with different weights (A and B)."""
    out = []
    for seed in (0, 1):
        path = str(tmp_path_factory.mktemp(f"weights{seed}"))
        save_hf_model("llama_tp", path, seed=seed)
        out.append(path)
    return out


@functools.cache
def _engine(path: str, tp: int, quantization: str | None) -> LLMEngine:
    args = EngineArgs(
        model=path,
        dtype="bfloat16",
        tensor_parallel_size=tp,
        quantization=quantization,
        **({"quantization_group_size": 32} if quantization == "int4" else {}),  # groups dividing its 64 inputs
        skip_tokenizer_init=True,
        max_model_len=32,
        max_num_seqs=2,
        max_num_batched_tokens=32,
    )
    return LLMEngine(args)


def run(engine: LLMEngine, params=(GREEDY, SEEDED)) -> list:
    """Every prompt under every sampling params: the completions (tokens, logprobs)."""
    for i, (p, sp) in enumerate((p, sp) for sp in params for p in PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0]) for o in engine.step() if o.finished)
    return [done[i] for i in range(len(done))]


def tokens(engine: LLMEngine) -> list[list[int]]:
    return [c.token_ids for c in run(engine)]


def leaves(engine: LLMEngine) -> list:
    return jax.tree.leaves(engine.get_params())


def total_bytes(arrays) -> int:
    return sum(x.nbytes for x in arrays)


def assert_refused(engine: LLMEngine, weights, match: str) -> None:
    before = leaves(engine)
    with pytest.raises(WeightUpdateError, match=match):
        engine.update_weights(weights)
    assert all(a is b for a, b in zip(leaves(engine), before)), "a refused update changed the engine"


@pytest.mark.parametrize("tp,quantization", [(1, None), (1, "int4"), (2, None), (4, "fp8")])
def test_new_weights_give_a_fresh_engines_tokens(dirs, tp, quantization):
    engine, fresh = _engine(dirs[0], tp, quantization), _engine(dirs[1], tp, quantization)
    expected_a, expected_b = tokens(engine), tokens(fresh)
    assert expected_a != expected_b

    # refusals name the parameter; nothing changes
    tree = nnx.to_pure_dict(fresh.get_params())
    del tree["final_norm"]
    assert_refused(engine, tree, r"missing final_norm\.scale")
    tree = nnx.to_pure_dict(fresh.get_params())
    tree["embed"] = jnp.zeros((3, 4), tree["embed"].dtype)
    assert_refused(engine, tree, r"embed is bfloat16\[3, 4\], expected bfloat16\[512, 64\]")
    tree = nnx.to_pure_dict(fresh.get_params())
    tree["final_norm"]["scale"] = tree["final_norm"]["scale"].astype(jnp.float32)
    assert_refused(engine, tree, r"final_norm\.scale is float32\[64\], expected bfloat16\[64\]")
    assert_refused(engine, [("model.layers.0.mlp.up.weight", np.zeros((128, 64)))], "not a parameter")
    assert_refused(engine, [("model.norm.weight", np.zeros(63))], "model.norm.weight.*shape")

    # the fresh engine's own arrays: shared, not copied; the old buffers are gone
    old = [weakref.ref(x) for x in leaves(engine)]
    stats = engine.update_weights(fresh.get_params())
    assert stats.copied_bytes == 0 and stats.shared_bytes == total_bytes(leaves(fresh))
    gc.collect()
    assert not any(r() is not None for r in old), "a buffer of the old weights is still alive"
    live = {id(x) for x in jax.live_arrays()}
    assert all(id(x) in live for x in leaves(engine))
    assert tokens(engine) == expected_b

    # Hugging Face pairs (vLLM's load_weights): copied from the host, quantized where the engine quantizes
    stats = engine.update_weights(load_file(f"{dirs[0]}/model.safetensors").items())
    assert stats.copied_bytes > 0 and (stats.quantized_bytes > 0) == (quantization is not None)
    assert tokens(engine) == expected_a

    if quantization is None:  # host arrays of the engine's structure
        host = jax.tree.map(np.asarray, nnx.to_pure_dict(fresh.get_params()))
        stats = engine.update_weights(host)
        assert stats.copied_bytes == total_bytes(leaves(fresh)) and stats.shared_bytes == 0
    else:  # what a trainer holds: plain bfloat16 weights, quantized on the devices
        # (int4 on one device: the plain weights on the default device; the engine's layout is for its groups)
        parallel = None if quantization == "int4" else engine.runner.parallel
        _, model = load_model(dirs[1], "bfloat16", parallel=parallel, scan_layers=False)
        stats = engine.update_weights(nnx.state(model))
        assert stats.quantized_bytes > 0
    assert tokens(engine) == expected_b


def test_update_resets_the_prefix_cache(dirs):
    engine = _engine(dirs[0], 1, None)
    run(engine, [GREEDY])
    assert engine.get_stats()["num_cached_tokens"] > 0
    engine.update_weights(engine.get_params())
    assert engine.get_stats()["num_cached_tokens"] == 0


def test_what_followers_cannot_follow_is_refused_over_several_processes(dirs):
    """With a step channel (the leader of `--nnodes` > 1) sleep and weight updates are refused
    naming why, nothing changed; pausing and the prefix cache are the leader's alone and work."""
    engine = _engine(dirs[0], 1, None)
    before = leaves(engine)
    engine.runner.channel = object()  # only its presence is read before the refusals
    try:
        for call in (
            lambda: engine.sleep(1),
            lambda: engine.update_weights(engine.get_params()),
            engine.reload_weights,
        ):
            with pytest.raises(RuntimeError, match="several processes .* followers? .* diverge"):
                call()
        assert engine.reset_prefix_cache()
        engine.pause_generation("keep")
        engine.resume_generation()
    finally:
        engine.runner.channel = None
    assert not engine.is_sleeping() and all(a is b for a, b in zip(leaves(engine), before))


def test_a_disk_tier_refuses_new_weights_and_a_draft_model_refuses_sleep(dirs, monkeypatch):
    """The disk tier's files hold the checkpoint's KV under its fingerprint (later engines read
    them): new weights are refused naming kv_cache_dir. Sleep does not free a draft model's
    arrays: refused naming speculative_config. Nothing changes."""
    engine = _engine(dirs[0], 1, None)
    before = leaves(engine)
    monkeypatch.setattr(engine, "disk_tier", object())  # only its presence is read before the refusal
    with pytest.raises(RuntimeError, match="kv_cache_dir"):
        engine.update_weights(engine.get_params())
    monkeypatch.undo()
    monkeypatch.setattr(engine.runner, "draft", object())
    with pytest.raises(RuntimeError, match="draft model .speculative_config"):
        engine.sleep(1)
    monkeypatch.undo()
    assert not engine.is_sleeping() and all(a is b for a, b in zip(leaves(engine), before))


def test_sleep_and_wake_free_and_restore(dirs):
    engine = _engine(dirs[0], 1, None)
    engine.reload_weights()
    expected = tokens(engine)
    for level in (1, 2):
        held = [weakref.ref(x) for x in leaves(engine) + jax.tree.leaves(engine.runner.cache)]
        claimed = total_bytes(leaves(engine)) + total_bytes(jax.tree.leaves(engine.runner.cache))
        before = total_bytes(jax.live_arrays())
        engine.sleep(level)
        gc.collect()
        assert not any(r() is not None for r in held), f"sleep({level}) kept a device array"
        assert before - total_bytes(jax.live_arrays()) >= claimed
        with pytest.raises(RuntimeError, match="asleep"):
            engine.get_params()
        engine.wake_up()
        if level == 2:
            with pytest.raises(RuntimeError, match="no weights"):
                tokens(engine)
            engine.abort_request(engine.unfinished_request_ids())
            engine.step()
            engine.update_weights(load_file(f"{dirs[0]}/model.safetensors").items())
        assert tokens(engine) == expected


def test_pause_keeps_or_aborts_requests(dirs):
    engine = _engine(dirs[0], 1, None)
    expected = tokens(engine)
    engine.pause_generation("keep")
    for i, (p, sp) in enumerate((p, sp) for sp in (GREEDY, SEEDED) for p in PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    assert engine.step() == [] and engine.get_stats()["generation_tokens"] == engine.num_generation_tokens
    engine.resume_generation()
    done = {}
    while engine.has_unfinished_requests():
        done.update((int(o.request_id), o.outputs[0].token_ids) for o in engine.step() if o.finished)
    assert [done[i] for i in range(len(done))] == expected
    engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, GREEDY)
    engine.pause_generation("abort")
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    engine.resume_generation()


def test_scoring_path_matches_the_samplers_logprobs(dirs):
    """The engine's sampled tokens' log-probabilities equal `token_logprobs`' within
    `BF16_LOGPROB_TOLERANCE` (different programs: the sampler's come from decode steps); the
    scoring path run by the engine's holder and by a trainer sharing the arrays is one program:
    equal bitwise. Gradients flow through it."""
    engine = _engine(dirs[0], 1, None)
    engine.reload_weights()
    score = jax.jit(token_logprobs, static_argnums=0)
    graphdef = engine.get_graphdef()
    for prompt, c in zip(PROMPTS, run(engine, [SEEDED])):
        seq = jnp.asarray([prompt + list(c.token_ids)])
        ours = np.asarray(score(graphdef, engine.get_params(), seq))[0, len(prompt) - 1 :]
        sampled = np.array([entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs)])
        np.testing.assert_allclose(ours, sampled, atol=BF16_LOGPROB_TOLERANCE)
    trainer = jax.tree.map(lambda x: x, engine.get_params())  # the trainer's tree of the same arrays
    assert np.array_equal(score(graphdef, trainer, seq), score(graphdef, engine.get_params(), seq))
    grads = jax.grad(lambda p: token_logprobs(graphdef, p, seq).sum())(trainer)
    assert all(bool(jnp.isfinite(g.astype(jnp.float32)).all()) for g in jax.tree.leaves(grads))
    assert float(jnp.abs(grads["embed"][...].astype(jnp.float32)).sum()) > 0


def test_dev_mode_routes(dirs, monkeypatch):
    """/sleep, /wake_up, /pause, ... exist only with JAXPAGED_SERVER_DEV_MODE=1 and drive the
    engine between steps (this test ends the module: the server's thread takes the engine)."""
    import asyncio

    import httpx

    from jaxpaged.server.app import build_app
    from jaxpaged.server.async_engine import AsyncEngine
    from jaxpaged.server.dev_routes import DEV_MODE_ENV

    engine = _engine(dirs[0], 1, None)
    served = AsyncEngine(engine)

    async def calls(app, requests):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return [await http.request(method, url) for method, url in requests]

    try:
        [off] = asyncio.run(calls(build_app(served, "m"), [("POST", "/sleep")]))
        assert off.status_code == 404
        monkeypatch.setenv(DEV_MODE_ENV, "1")
        app = build_app(served, "m")
        sleeping = asyncio.run(calls(app, [("POST", "/sleep?level=1"), ("GET", "/is_sleeping")]))
        assert [r.status_code for r in sleeping] == [200, 200] and sleeping[1].json() == {"is_sleeping": True}
        assert engine.is_sleeping()
        rest = asyncio.run(
            calls(
                app,
                [
                    ("POST", "/wake_up"),
                    ("POST", "/reset_prefix_cache"),
                    ("POST", "/pause?mode=keep"),
                    ("GET", "/is_paused"),
                    ("POST", "/pause?mode=later"),
                    ("POST", "/resume"),
                    ("GET", "/is_sleeping"),
                ],
            )
        )
        assert [r.status_code for r in rest] == [200, 200, 200, 200, 400, 200, 200]
        assert rest[3].json() == {"is_paused": True} and rest[6].json() == {"is_sleeping": False}
        assert "mode='later'" in rest[4].json()["error"]["message"]
        assert not engine.is_paused() and not engine.is_sleeping()
    finally:
        served.shutdown()
