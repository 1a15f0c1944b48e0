"""LoRA adapters (PEFT's format) served over the base model: greedy tokens and logprobs equal
transformers + PEFT (the adapter applied, not merged) for adapters of different ranks, targets
and scalings mixed in one batch with base-model rows; more adapters than the pool's slots take
turns; prefix-cache blocks never cross adapters; bad adapters are refused by name."""

import json
import os

import numpy as np
import peft
import pytest
import torch
from engine_fixtures import hf_greedy, make_model_dir

from jaxpaged import LLM, LoRARequest, SamplingParams

# (name, PEFT LoraConfig options): ranks 4 / 8 / 2 / 6, attention-only and MLP targets, rsLoRA,
# a rank_pattern and an alpha_pattern
ADAPTERS = {
    "attn-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "all-r8": dict(
        r=8, lora_alpha=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),
    "mlp-rs": dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["gate_proj", "down_proj"]),
    "patterns": dict(
        r=6,
        lora_alpha=12,
        target_modules=["o_proj", "up_proj"],
        rank_pattern={"up_proj": 3},
        alpha_pattern={"o_proj": 2},
    ),
}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 11], [300, 2, 8, 8, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [77, 78]]
NEW_TOKENS = 8


def save_adapter(base, name: str, path: str, seed: int):
    """A PEFT adapter of `ADAPTERS[name]` over `base` with random (not zero) B, saved to `path`;
    returns the PEFT model."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **ADAPTERS[name])
    model = peft.get_peft_model(base, config, adapter_name=name)
    with torch.no_grad():  # PEFT's non-default init is small: scale it so the adapters change tokens
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.mul_(8.0)
    model.save_pretrained(path, selected_adapters=[name])
    return model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Llama, its adapters on disk, and transformers + PEFT's greedy tokens for each
    (adapter, prompt)."""
    root = tmp_path_factory.mktemp("lora")
    model_dir = str(root / "base")
    base = make_model_dir(model_dir)
    base.eval()
    expected, dirs = {}, {}
    for seed, name in enumerate(ADAPTERS):
        out = str(root / name)
        fresh = make_model_dir(str(root / f"base-{name}"))  # PEFT wraps the model it is given
        peft_model = save_adapter(fresh, name, out, seed)
        dirs[name] = os.path.join(out, name) if os.path.isdir(os.path.join(out, name)) else out
        peft_model.eval()
        expected[name] = [hf_greedy(peft_model, p, NEW_TOKENS) for p in PROMPTS]
    expected[None] = [hf_greedy(base, p, NEW_TOKENS) for p in PROMPTS]
    return model_dir, dirs, expected


def request(dirs, name, i):
    return None if name is None else LoRARequest(name, i + 1, dirs[name])


def greedy(n: int = NEW_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_adapters_mixed_in_one_batch_equal_peft(setup):
    """Four adapters and the base model, every prompt under each, in one `generate` (the pool
    holds all four): each output equals transformers + PEFT's greedy tokens."""
    model_dir, dirs, expected = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=4, max_lora_rank=8, max_num_seqs=32, num_scheduler_steps=1)
    names = [*ADAPTERS, None]
    ids = {name: i for i, name in enumerate(ADAPTERS)}
    prompts, loras, want = [], [], []
    for name in names:
        for j, prompt in enumerate(PROMPTS):
            prompts.append({"prompt_token_ids": prompt})
            loras.append(None if name is None else LoRARequest(name, ids[name] + 1, dirs[name]))
            want.append(expected[name][j])
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got == want
    assert all(expected[name] != expected[None] for name in ADAPTERS)  # every adapter changes tokens


def test_more_adapters_than_slots_take_turns_and_the_cache_keeps_them_apart(setup):
    """A pool of one slot serves four adapters (each waits for the slot to free) with PEFT's
    tokens; the same prompt under two adapters and the base model shares no cached block, while
    the same prompt under the same adapter hits the cache."""
    model_dir, dirs, expected = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=2, num_scheduler_steps=1)
    names = list(ADAPTERS)
    prompts = [{"prompt_token_ids": PROMPTS[0]}] * len(names)
    loras = [LoRARequest(name, i + 1, dirs[name]) for i, name in enumerate(names)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outs] == [expected[n][0] for n in names]
    engine = llm.llm_engine
    hits = engine.get_stats()["prefix_cache_hits"]
    long_prompt = {"prompt_token_ids": PROMPTS[2] * 3}  # 39 tokens: two full blocks of 16
    llm.generate([long_prompt], greedy(2), use_tqdm=False, lora_request=loras[0])
    llm.generate([long_prompt], greedy(2), use_tqdm=False, lora_request=loras[1])
    llm.generate([long_prompt], greedy(2), use_tqdm=False)
    assert engine.get_stats()["prefix_cache_hits"] == hits  # no adapter reads another's blocks
    llm.generate([long_prompt], greedy(2), use_tqdm=False, lora_request=loras[1])
    assert engine.get_stats()["prefix_cache_hits"] > hits


def test_bad_adapters_and_requests_are_refused_by_name(setup, tmp_path):
    model_dir, dirs, _ = setup
    plain = LLM(model_dir, num_scheduler_steps=1)
    with pytest.raises(ValueError, match="start the engine with enable_lora=True"):
        plain.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("a", 1, dirs["attn-r4"]))
    llm = LLM(model_dir, enable_lora=True, max_lora_rank=4, num_scheduler_steps=1)
    with pytest.raises(ValueError, match="rank 8, above max_lora_rank=4; raise --max-lora-rank to 8"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("big", 1, dirs["all-r8"]))
    with pytest.raises(ValueError, match="is not a directory"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("gone", 2, str(tmp_path / "no")))
    bad = tmp_path / "dora"
    bad.mkdir()
    config = json.load(open(os.path.join(dirs["attn-r4"], "adapter_config.json")))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora=True: DoRA adapters are not supported"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("dora", 3, str(bad)))
    (bad / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] are not projections"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("head", 4, str(bad)))
    ok = LoRARequest("attn", 5, dirs["attn-r4"])
    llm.generate(["hi"], greedy(2), use_tqdm=False, lora_request=ok)
    with pytest.raises(ValueError, match="already this engine's adapter of id 5"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("attn", 6, dirs["mlp-rs"]))
    assert llm.llm_engine.remove_lora("attn") and not llm.llm_engine.remove_lora("attn")
    llm.generate(["hi"], greedy(2), use_tqdm=False, lora_request=LoRARequest("attn", 6, dirs["mlp-rs"]))  # a new one
    with pytest.raises(ValueError, match="LoRA adapter 'big': .*rank 8, above max_lora_rank=4"):
        llm.llm_engine.add_lora(LoRARequest("big", 7, dirs["all-r8"]))
    from jaxpaged.engine_args import EngineArgs, EngineArgsError

    for options, reason in [
        (dict(pipeline_parallel_size=2), "under pipeline parallelism"),
        (dict(nnodes=2, node_rank=0, master_addr="127.0.0.1"), "over several processes"),
        (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "with speculative decoding"),
        (dict(max_cpu_loras=0), "max_cpu_loras=0: must be an integer of at least --max-loras"),
    ]:
        with pytest.raises(EngineArgsError, match=reason):
            EngineArgs(model=model_dir, enable_lora=True, **options)
    with pytest.raises(ValueError, match="lora_int_id=0 must be a positive integer"):
        LoRARequest("x", 0, dirs["attn-r4"])
    again = LoRARequest("attn", 6, dirs["mlp-rs"])
    out = llm.generate(["hi"], greedy(2, logprobs=1), use_tqdm=False, lora_request=again)
    assert np.isfinite(out[0].outputs[0].cumulative_logprob)


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_adapters_equal_peft(setup, tp):
    """Over 2 devices, and over 4 (more devices than the model's 2 kv heads: the k/v adapters'
    heads repeated as the mesh holds the kv heads), the mixed batch gives PEFT's tokens."""
    model_dir, dirs, expected = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, tensor_parallel_size=tp, num_scheduler_steps=1)
    names = ["all-r8", None, "attn-r4"]
    ids = {name: i for i, name in enumerate(ADAPTERS)}
    prompts, loras, want = [], [], []
    for name in names:
        for j in (0, 2):
            prompts.append({"prompt_token_ids": PROMPTS[j]})
            loras.append(None if name is None else LoRARequest(name, ids[name] + 1, dirs[name]))
            want.append(expected[name][j])
    outs = llm.generate(prompts, greedy(), use_tqdm=False, lora_request=loras)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_the_server_serves_adapters_by_model_name_and_loads_them_at_runtime(setup, monkeypatch):
    """`--lora-modules` adapters are models of their own on the server: listed with the base as
    their parent, picked by a request's `model` (PEFT's tokens, as `LLM.generate` gives them), an
    unknown name a 404; with vLLM's runtime switch an adapter is loaded and unloaded by name."""
    import socket
    import threading
    import time

    import httpx
    import uvicorn

    from jaxpaged.server.app import build_app
    from jaxpaged.server.async_engine import AsyncEngine
    from jaxpaged.server.lora_modules import RUNTIME_LORA_ENV, parse_lora_modules

    model_dir, dirs, _ = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=2, max_lora_rank=8, num_scheduler_steps=1)
    modules = parse_lora_modules([f"attn={dirs['attn-r4']}", json.dumps({"name": "mlp", "path": dirs["mlp-rs"]})])
    prompt = PROMPTS[0]
    refs = {
        name: llm.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False, lora_request=lora)[0]
        for name, lora in [
            ("base", None),
            ("attn", modules["attn"]),
            ("all", LoRARequest("all-ref", 9, dirs["all-r8"])),
        ]
    }
    monkeypatch.setenv(RUNTIME_LORA_ENV, "true")
    engine = AsyncEngine(llm.llm_engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(engine, "base", lora_modules=modules), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        http = httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", trust_env=False, timeout=60)

        def complete(model):
            body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
            return http.post("/v1/completions", json=body)

        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
        assert cards["attn"]["parent"] == cards["mlp"]["parent"] == "base" and cards["base"]["parent"] is None
        for name in ("base", "attn"):
            reply = complete(name)
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == refs[name].outputs[0].text
        assert refs["attn"].outputs[0].token_ids != refs["base"].outputs[0].token_ids
        missing = complete("all")
        assert missing.status_code == 404 and "The model `all` does not exist." in missing.text
        bad = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": dirs["all-r8"] + "x"})
        assert bad.status_code == 400 and "is not a directory" in bad.text
        assert (
            http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": dirs["all-r8"]}).status_code
            == 200
        )
        assert complete("all").json()["choices"][0]["text"] == refs["all"].outputs[0].text
        info = [line for line in http.get("/metrics").text.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'waiting_lora_adapters=""' in info[0], info
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 200
        assert complete("attn").status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "attn"}).status_code == 404
    finally:
        server.should_exit = True
        thread.join(15)
        engine.shutdown()


def record_programs(runner) -> list:
    """The programs the runner dispatches from now on, appended to the returned list."""
    ran, pack = [], runner._pack

    def recording(*args):
        program, layout, flat = pack(*args)
        ran.append(program)
        return program, layout, flat

    runner._pack = recording
    return ran


def test_a_trainers_adapter_is_served_as_given_and_updated_without_compiling(setup):
    """A JAX trainer's adapter (a PEFT adapter's arrays, in the engine's layout) served with
    `update_lora`: PEFT's greedy tokens, and `token_logprobs(lora=...)` equals PEFT's
    log-probabilities; updated to another adapter's arrays under the same name, the requests made
    after it get that one's tokens, no cached block crosses the versions and nothing is compiled;
    updated while requests run, those finish with their version and the later ones get the new
    one (one slot: they wait for it); a step with no adapter runs the program without LoRA
    deltas. Bad adapters are refused."""
    import jax
    import jax.numpy as jnp
    from transformers import AutoModelForCausalLM

    from jaxpaged.checkpoint.lora import read_lora_weights
    from jaxpaged.functional import token_logprobs
    from jaxpaged.model.lora import LoraAdapter

    model_dir, dirs, expected = setup
    llm = LLM(model_dir, enable_lora=True, max_loras=1, max_lora_rank=8, num_scheduler_steps=1)
    engine, runner = llm.llm_engine, llm.llm_engine.runner
    config = engine.config.model

    def as_trainer_arrays(name):
        weights = read_lora_weights(dirs[name], config, max_rank=8)
        return LoraAdapter(
            {k: jnp.asarray(v) for k, v in weights.a.items()}, {k: jnp.asarray(v) for k, v in weights.b.items()}
        )

    ran = record_programs(runner)
    base = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in base] == expected[None]
    assert ran and not any(p.lora for p in ran)  # no adapter in the batch: no adapter deltas computed

    first = as_trainer_arrays("all-r8")
    trainer = llm.update_lora("trainer", first)
    assert trainer.lora_name == "trainer" and trainer.lora_path == ""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False, lora_request=trainer)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected["all-r8"]
    assert all(p.lora for p in ran[-NEW_TOKENS:])

    sequence = jnp.array([PROMPTS[0] + expected["all-r8"][0]], jnp.int32)
    ours = token_logprobs(llm.get_graphdef(), llm.get_params(), sequence, lora=first)
    hf = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), dirs["all-r8"]).eval()
    with torch.no_grad():
        logits = hf(torch.tensor(np.asarray(sequence))).logits[0, :-1].log_softmax(-1)
    theirs = logits.gather(1, torch.tensor(np.asarray(sequence)[0, 1:])[:, None])[:, 0].numpy()
    np.testing.assert_allclose(np.asarray(ours)[0], theirs, atol=2e-4)
    grads = jax.grad(lambda ad: token_logprobs(llm.get_graphdef(), llm.get_params(), sequence, lora=ad).sum())(first)
    assert jax.tree.structure(grads) == jax.tree.structure(first) and float(jnp.abs(grads.b["q_proj"]).max()) > 0

    long_prompt = {"prompt_token_ids": PROMPTS[2] * 3}  # two full blocks of 16
    llm.generate([long_prompt], greedy(2), use_tqdm=False, lora_request=trainer)
    hits, compiled, writers = (
        engine.get_stats()["prefix_cache_hits"],
        len(runner.compiled),
        runner._write_lora._cache_size(),
    )
    assert llm.update_lora("trainer", as_trainer_arrays("attn-r4")) == trainer
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False, lora_request=trainer)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected["attn-r4"]
    llm.generate([long_prompt], greedy(2), use_tqdm=False, lora_request=trainer)
    assert engine.get_stats()["prefix_cache_hits"] == hits  # the new version reads none of the old's blocks
    assert (len(runner.compiled), runner._write_lora._cache_size()) == (compiled, writers)

    # updated while requests of the old version run: they finish with it, the new ones (waiting
    # for the pool's one slot) run with the new version; nothing mixes, nothing is lost
    llm.update_lora("trainer", first)
    params = greedy()
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"old-{i}", {"prompt_token_ids": prompt}, params, lora_request=trainer)
    engine.step()
    llm.update_lora("trainer", as_trainer_arrays("attn-r4"))
    for i, prompt in enumerate(PROMPTS[:2]):
        engine.add_request(f"new-{i}", {"prompt_token_ids": prompt}, params, lora_request=trainer)
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        done.update((o.request_id, list(o.outputs[0].token_ids)) for o in engine.step() if o.finished)
    assert done == {
        **{f"old-{i}": expected["all-r8"][i] for i in range(2)},
        **{f"new-{i}": expected["attn-r4"][i] for i in range(2)},
    }

    llm.llm_engine.add_lora(LoRARequest("file", 3, dirs["mlp-rs"]))
    with pytest.raises(ValueError, match="update_lora: 'file' is the adapter read from"):
        llm.update_lora("file", first)
    wrong = LoraAdapter({"q_proj": first.a["q_proj"][:, :5]}, {"q_proj": first.b["q_proj"]})
    with pytest.raises(ValueError, match=r"adapter projection 'q_proj': A \(2, 5, 8\)"):
        llm.update_lora("other", wrong)
    with pytest.raises(ValueError, match="rank 16, above --max-lora-rank 8"):
        llm.update_lora("other", llm.init_lora(16))
    with pytest.raises(ValueError, match="LoRARequest.lora_path='' for adapter 'nowhere'"):
        llm.generate(["hi"], greedy(), use_tqdm=False, lora_request=LoRARequest("nowhere", 9))
