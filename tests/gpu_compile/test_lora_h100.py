"""LoRA's step programs compiled for an H100 (no GPU used; `test_h100_programs.py` says how):
Llama-3.1-8B's shapes, two layers, bfloat16, with the adapter pool of 1 and of 8 slots of rank
16. Every program waits on no host and loops over no adapter; its temporaries grow with the
slots by one layer's adapter slices at most, never by a `[S, D, F]` weight-sized array; and the
pool is donated with the cache (updated in place, never copied). A step with no adapter runs
the variant without LoRA deltas, the base engine's program to the byte."""

import pytest

from tests.gpu_compile.test_h100_programs import SMALL_POOL, assert_no_host_waits, compile_for_h100, model_dir

RANK = 16


LORA = ", LoRA"  # in a LoRA variant's description


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    """{slots: {program (described as without LoRA): executable}} for no LoRA (0), and the LoRA
    variants of 1 slot and 8 slots; "8 without" is the 8-slot engine's programs without LoRA."""
    model = model_dir(tmp_path_factory.mktemp("8b"), "llama-3.1-8b", num_hidden_layers=2)
    out = {0: compile_for_h100(model, SMALL_POOL, dtype="bfloat16")[0]}
    for slots in (1, 8):
        options = dict(enable_lora=True, max_loras=slots, max_lora_rank=RANK)
        compiled = compile_for_h100(model, SMALL_POOL, dtype="bfloat16", **options)[0]
        out[slots] = {name.replace(LORA, ""): e for name, e in compiled.items() if LORA in name}
        if slots == 8:
            out["8 without"] = {name: e for name, e in compiled.items() if LORA not in name}
    assert set(out[1]) == set(out[8]) == set(out["8 without"]) == set(out[0])
    return out


def test_lora_programs_wait_on_no_host_and_loop_over_no_adapter(programs):
    """No host waits, and the same loops as without LoRA (none over the adapters)."""
    loops = {name: executable.as_text().count(" while(") for name, executable in programs[0].items()}
    for slots in (1, 8):
        assert_no_host_waits(programs[slots])
        assert {name: e.as_text().count(" while(") for name, e in programs[slots].items()} == loops


def test_temporaries_grow_by_one_layers_adapters_at_most(programs):
    """8 slots add at most one layer's adapter slices to a program's temporaries (measured: 7.3
    -> 19.4 MiB for a 16-token step, a layer's slices being 20 MiB): never a `[S, D, F]`-sized
    gather per token or per slot, and nothing that grows with the layers. The pool (KV and
    adapters) is donated and updated in place."""
    d, kv, f = 4096, 1024, 14336
    ins_outs = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]  # q k v o gate up down
    layer_slices = sum(i + o for i, o in ins_outs) * 8 * RANK * 2  # bfloat16, 8 slots
    pool_bytes = 2 * layer_slices  # the two layers' adapters
    for name in programs[0]:
        base, eight = (programs[s][name].memory_analysis().temp_size_in_bytes for s in (0, 8))
        assert eight - base <= layer_slices, (name, base, eight, layer_slices)
        analysis = programs[8][name].memory_analysis()
        assert analysis.alias_size_in_bytes >= SMALL_POOL * 0.95 + pool_bytes, (name, analysis)


def test_steps_without_adapters_run_the_base_engines_programs(programs):
    """An engine with LoRA runs a step no adapter is in with the base engine's program: the same
    temporaries (no delta computed), the pool still donated."""
    for name, executable in programs["8 without"].items():
        analysis, base = executable.memory_analysis(), programs[0][name].memory_analysis()
        assert analysis.temp_size_in_bytes == base.temp_size_in_bytes, name
        assert analysis.alias_size_in_bytes >= base.alias_size_in_bytes, name
