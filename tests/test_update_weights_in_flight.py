"""`update_weights` while requests run (async scheduling: a step in flight; chunked prefill; a
small pool that preempts by swap): no request is lost, every token sampled after an update
comes from the new weights over the K/V each position kept, and the prefix cache never serves
K/V of older weights, also not from a sequence swapped out before an update and back in after.

Two updates: A -> B while sequences decode and one is mid-prefill, B -> C while one is swapped
out. The reference is transformers: one `DynamicCache` per sequence, each position's K/V and each
token computed by the weights the engine computed it with."""

import pytest
import torch
import transformers
from engine_fixtures import make_model_dir
from tiny_models import build_hf_model

from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine_args import EngineArgs
from jaxpaged.sampling_params import SamplingParams

VARIANT = "llama_gqa4"
BYTES_PER_BLOCK = 2 * 2 * 2 * 16 * 4 * 16  # K and V, 2 layers, 2 kv heads, 16 tokens, float32, head_dim 16
MAX_TOKENS = 24
# 9 to 45 tokens: chunked at 16 tokens a step, and 8 blocks cannot hold them all (swaps)
PROMPTS = [list(range(3 + 7 * i, 3 + 7 * i + n)) for i, n in enumerate((20, 37, 18, 45, 9))]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(the checkpoint of weights A, then A, B and C as transformers models)."""
    path = str(tmp_path_factory.mktemp("weights_a"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # token by token through a tiny model: 10x faster than 2 threads here
    yield path, [make_model_dir(path, VARIANT), build_hf_model(VARIANT, seed=1), build_hf_model(VARIANT, seed=2)]
    torch.set_num_threads(threads)


def reference(prompt: list[int], phases: list, last) -> list[int]:
    """transformers' greedy output of a sequence whose weights changed: `phases` holds, for each
    update, the weights before it, the tokens the sequence had sampled by then (the step in
    flight's too) and the positions whose K/V it kept; `last` computes the rest."""
    seq, cache = list(prompt), transformers.DynamicCache()

    def forward(model, tokens):
        return model(torch.tensor([tokens]), cache=cache, use_cache=True).logits[0, -1]

    with torch.no_grad():
        for model, num_tokens, num_kv in [*phases, (last, len(prompt) + MAX_TOKENS, None)]:
            while len(seq) < num_tokens:
                seq.append(int(forward(model, seq[cache.get_seq_length() :]).argmax()))
            if num_kv is not None and num_kv > cache.get_seq_length():  # computed without sampling (a chunk)
                forward(model, seq[cache.get_seq_length() : num_kv])
            assert num_kv is None or num_kv == cache.get_seq_length(), "K/V dropped: recomputed, not swapped"
    return seq[len(prompt) :]


def step_until(engine: LLMEngine, outputs: dict, ready) -> None:
    for _ in range(100):
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        if ready():
            return
    pytest.fail("the engine never reached the state to update weights in")


def test_update_weights_while_requests_run(models):
    path, hf = models
    engine = LLMEngine(
        EngineArgs(
            model=path,
            dtype="float32",
            skip_tokenizer_init=True,
            max_model_len=96,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            kv_cache_memory_bytes=9 * BYTES_PER_BLOCK,  # 8 blocks and the null block
            kv_offloading_size=32 * BYTES_PER_BLOCK / 2**30,
            preemption_mode="swap",
        )
    )
    assert engine.runner.async_scheduling
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, GREEDY)
        seqs.append(engine._seqs[str(i)][0])
    sched, outputs = engine.scheduler, {}
    swapped = sched.block_manager.host_tier.swapped
    phases = [[] for _ in PROMPTS]
    was_swapped = set()

    def update(weights: int) -> None:
        assert engine.runner.busy
        for s, phase in zip(seqs, phases):  # what the weights so far computed of each sequence
            kept = swapped[s.seq_id][1] if s.seq_id in swapped else s.num_computed_tokens
            phase.append((hf[weights - 1], s.num_tokens + s.num_pending_tokens, kept))
            if s.seq_id in swapped:
                was_swapped.add(int(s.request_id))
        engine.update_weights([(name, t.numpy()) for name, t in hf[weights].state_dict().items()])

    def decoding_and_prefilling() -> bool:
        computed = [(s.num_computed_tokens, s.num_prompt_tokens) for s in sched.running]
        return any(c > p for c, p in computed) and any(0 < c < p for c, p in computed)

    step_until(engine, outputs, decoding_and_prefilling)
    update(1)
    step_until(
        engine, outputs, lambda: swapped and any(s.num_computed_tokens > s.num_prompt_tokens for s in sched.running)
    )
    update(2)
    assert not outputs and was_swapped
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    assert engine.get_stats()["kv_swapped_in_blocks"] > 0
    for i, prompt in enumerate(PROMPTS):
        assert outputs[str(i)].finish_reason == "length", i
        assert outputs[str(i)].token_ids == reference(prompt, phases[i], hf[2]), f"request {i}"

    # The same prompts (and prompts + outputs) again, the swapped sequences' first (their blocks
    # are the most recently cached): only K/V computed wholly by C may be reused.
    order = sorted(range(len(PROMPTS)), key=lambda i: i not in was_swapped)
    again = [PROMPTS[i] for i in order] + [PROMPTS[i] + list(outputs[str(i)].token_ids[:16]) for i in order]
    for i, prompt in enumerate(again):
        engine.add_request(f"again{i}", {"prompt_token_ids": prompt}, GREEDY)
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
    for i, prompt in enumerate(again):
        assert outputs[f"again{i}"].token_ids == reference(prompt, [], hf[2]), f"again{i}: older K/V reused"
