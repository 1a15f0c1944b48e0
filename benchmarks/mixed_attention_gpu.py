"""A mixed step's attention two ways, on the GPU: every row on the ragged kernel (the engine before
the split) against its leading decode rows on the decode kernel and the rest on the ragged kernel
(`jaxpaged.model.mixed_attention.mixed_paged_attention`, the engine now). Llama-3.1-8B attention
(32 query / 8 KV heads, head_dim 128), bf16, block size 16, NaN in every page nobody owns.

Each case is a step as the scheduler packs one: D decode rows first (contexts drawn uniformly
from a range like ShareGPT's), then prefill chunks, padded to the step's token bucket. Both ways
are checked against the jnp reference first, then timed as `kernels_gpu.py` times (calls chained
in one jitted loop, minus an empty loop's time; medians). The JSON is rewritten after every case.

Then decode batches of ShareGPT-like contexts (log-normal, 20 to 2,000 tokens, in arrival order):
the decode kernel visiting the sequences longest first (its default) against in batch order.

    python -m benchmarks.mixed_attention_gpu --out mixed.json     # on the GPU
    python -m benchmarks.mixed_attention_gpu --smoke --out x.json # tiny shapes, interpret mode (CPU)
"""

import argparse
import functools
import gc
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from benchmarks.kernels_gpu import BS, check, paged_batch, parse_timing, reference_or_none, run_phases, save, time_loop
from jaxpaged.model.metadata import AttentionMetadata
from jaxpaged.model.mixed_attention import mixed_paged_attention
from pallas_kernels import ragged_paged_attention, reference

# name -> (decode rows, their context range, prefill chunks as (kv_len, q_len), token bucket)
CASES = {
    # today's GPU limits (256 sequences, 2,048 tokens): a ShareGPT mixed step
    "256-decodes+3-prompts": (256, (64, 1200), [(230, 230), (500, 500), (1000, 1000)], 2048),
    # vLLM's limits (1,024 sequences, 16,384 tokens)
    "1024-decodes+chunks": (1024, (64, 1500), [(700, 700), (2100, 2048), (1200, 1200)], 8192),
    # few decodes beside a long chunk (a prompt arriving into a light batch)
    "8-decodes+2k-chunk": (8, (64, 1200), [(2048, 2048)], 4096),
}
SMOKE_CASES = {"4-decodes+2-prompts": (4, (1, 40), [(BS + 1, BS + 1), (37, 21)], 64)}
# name -> (sequences, median context, longest context) of a decode batch
DECODE_ORDER_CASES = {"1024-sharegpt-like": (1024, 400, 2000), "256-sharegpt-like": (256, 400, 2000)}
SMOKE_DECODE_ORDER_CASES = {"6-varied": (6, 20, 90)}


def step_args(key, cfg, decodes, context_range, chunks, bucket):
    """(q, k_pool, v_pool, AttentionMetadata) of one packed mixed step."""
    lo, hi = context_range
    contexts = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30))).integers(lo, hi + 1, decodes)
    kv_lens = [int(n) for n in contexts] + [kv for kv, _ in chunks]
    q_lens = [1] * decodes + [q for _, q in chunks]
    width = max(-(-n // BS) for n in kv_lens)
    k_pool, v_pool, tables = paged_batch(key, kv_lens, width, cfg.kv_heads, cfg.head_dim, jnp.bfloat16, True)
    assert sum(q_lens) <= bucket, (sum(q_lens), bucket)
    q = jax.random.normal(jax.random.fold_in(key, 1), (bucket, cfg.heads, cfg.head_dim)).astype(jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    meta = AttentionMetadata(
        positions=jnp.zeros(bucket, jnp.int32),
        slot_mapping=jnp.zeros(bucket, jnp.int32),
        cu_q_lens=cu,
        kv_lens=jnp.asarray(kv_lens, jnp.int32),
        block_tables=tables,
        num_seqs=jnp.int32(len(kv_lens)),
    )
    return q, k_pool, v_pool, meta, sum(q_lens)


def ragged_only(q, k_pool, v_pool, meta, interpret):
    """Every row of the step on the ragged kernel."""
    return ragged_paged_attention(
        q, k_pool, v_pool, meta.cu_q_lens, meta.kv_lens, meta.block_tables, meta.num_seqs, interpret=interpret
    )


def reference_step(q, k_pool, v_pool, meta):
    return reference.ragged_paged_attention(
        q, k_pool, v_pool, meta.cu_q_lens, meta.kv_lens, meta.block_tables, meta.num_seqs
    )


def bench_mixed(cfg, log, results):
    print("== a mixed step: all rows on the ragged kernel vs its decode rows on the decode kernel ==")
    for i, (name, case) in enumerate(cfg.cases.items()):
        q, k_pool, v_pool, meta, real = step_args(jax.random.key(10 + i), cfg, *case)
        args = (q, k_pool, v_pool, meta)
        before = functools.partial(ragged_only, interpret=cfg.interpret)
        after = functools.partial(mixed_paged_attention, pallas_kernels)
        ref = reference_or_none(reference_step, args)
        for label, fn in (("ragged only", before), ("decode + ragged", after)):
            out = jax.jit(fn)(*args)
            check(f"{name}: {label}", out[:real], None if ref is None else ref[:real], jnp.bfloat16, log)
        base = time_loop(lambda q_, *_: q_, args, cfg)
        row = dict(case=name, decode_rows=case[0], chunks=case[2], bucket=case[3], real_tokens=real, baseline_s=base)
        for key, fn in (("ragged_only_s", before), ("decode_plus_ragged_s", after)):
            row[key] = max(time_loop(fn, args, cfg) - base, 1e-9)
        row["speedup"] = row["ragged_only_s"] / row["decode_plus_ragged_s"]
        print(
            f"  {name}: ragged only {row['ragged_only_s'] * 1e6:.1f} us, decode + ragged "
            f"{row['decode_plus_ragged_s'] * 1e6:.1f} us ({row['speedup']:.2f}x)"
        )
        results["mixed"].append(row)
        save(results, cfg.out)
        del args, k_pool, v_pool, ref
        gc.collect()


def decode_contexts(seed: int, seqs: int, median: int, longest: int) -> list[int]:
    """Log-normal contexts (sigma 1) around `median`, clipped to [1, longest], in arrival order."""
    drawn = np.random.default_rng(seed).lognormal(np.log(median), 1.0, seqs)
    return [int(n) for n in np.clip(drawn, 1, longest)]


def bench_decode_order(cfg, log, results):
    print("== decode: sequences visited longest first vs in batch order ==")
    for i, (name, (seqs, median, longest)) in enumerate(cfg.decode_order_cases.items()):
        key = jax.random.key(50 + i)
        lens_list = decode_contexts(50 + i, seqs, median, longest)
        width = max(-(-n // BS) for n in lens_list)
        k_pool, v_pool, tables = paged_batch(key, lens_list, width, cfg.kv_heads, cfg.head_dim, jnp.bfloat16, True)
        q = jax.random.normal(jax.random.fold_in(key, 1), (seqs, cfg.heads, cfg.head_dim)).astype(jnp.bfloat16)
        lens = jnp.asarray(lens_list, jnp.int32)
        args = (q, k_pool, v_pool, tables, lens)
        ref = reference_or_none(reference.paged_decode_attention, args)
        ways = {
            "longest_first_s": functools.partial(pallas_kernels.paged_decode_attention, interpret=cfg.interpret),
            "batch_order_s": functools.partial(
                pallas_kernels.paged_decode_attention, interpret=cfg.interpret, longest_first=False
            ),
        }
        for label, fn in ways.items():
            check(f"{name}: {label[:-2]}", jax.jit(fn)(*args), ref, jnp.bfloat16, log)
        base = time_loop(lambda q_, *_: q_, args, cfg)
        row = dict(case=name, seqs=seqs, context_median=median, context_max=max(lens_list), baseline_s=base)
        row["kv_bytes"] = 2 * sum(lens_list) * cfg.kv_heads * cfg.head_dim * 2
        for label, fn in ways.items():
            row[label] = max(time_loop(fn, args, cfg) - base, 1e-9)
        row["speedup"] = row["batch_order_s"] / row["longest_first_s"]
        row["longest_first_gb_s"] = row["kv_bytes"] / row["longest_first_s"] / 1e9
        print(
            f"  {name}: longest first {row['longest_first_s'] * 1e6:.1f} us ({row['longest_first_gb_s']:.0f} GB/s), "
            f"batch order {row['batch_order_s'] * 1e6:.1f} us ({row['speedup']:.2f}x)"
        )
        results["decode_order"].append(row)
        save(results, cfg.out)
        del args, k_pool, v_pool, ref
        gc.collect()


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU check of the script)")
    p.add_argument("--out", required=True, help="the JSON to write")
    cfg = parse_timing(p, argv)
    cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.cases = 32, 8, 128, CASES
    cfg.decode_order_cases = DECODE_ORDER_CASES
    if cfg.smoke:
        cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.cases = 8, 2, 64, SMOKE_CASES
        cfg.decode_order_cases = SMOKE_DECODE_ORDER_CASES
        cfg.reps, cfg.warmup, cfg.iters, cfg.hbm_bytes = 2, 0, 1, 1 << 20
    elif not cfg.gpu:
        p.error("no GPU backend: run on a GPU, or pass --smoke for the CPU check")
    return cfg


def main(argv=None) -> int:
    cfg = parse(argv)
    kind = getattr(jax.devices()[0], "device_kind", "cpu")
    os.makedirs(os.path.dirname(os.path.abspath(cfg.out)), exist_ok=True)
    print(f"jax {jax.__version__} on {kind}; interpret={cfg.interpret}")
    results = dict(
        device=kind, jax=jax.__version__, smoke=cfg.smoke, complete=False, checks=[], mixed=[], decode_order=[]
    )
    phases = [
        lambda: bench_mixed(cfg, results["checks"], results),
        lambda: bench_decode_order(cfg, results["checks"], results),
    ]
    return run_phases(cfg, results, phases)


if __name__ == "__main__":
    sys.exit(main())
