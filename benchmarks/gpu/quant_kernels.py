"""The decode kernel over a float8 KV pool against the same kernel over a bfloat16 pool.

    python -m benchmarks.gpu.quant_kernels --out quant_kernels.json   # on a GPU (interpret=False)
    python -m benchmarks.gpu.quant_kernels --smoke --out /tmp/k.json   # tiny shapes, interpret mode

0. HBM bandwidth, measured as `kernels_gpu.py` does (in-place read+write of 2 GiB).
1. Correctness, interpret=False on a GPU: `paged_decode_attention` and `ragged_paged_attention`
   over float8_e4m3fn (and e5m2) pools with a scale per kv head and NaN in every slot nobody
   owns (the null block, spare blocks, page tails), mixed lengths across block edges, against
   the jnp reference on the same float8 values; exits non-zero on a mismatch or a NaN.
2. Speed, Llama-3.1-8B attention (32 q heads, 8 kv heads, head_dim 128, block 16), bf16 q:
   for each batch x context, the same random K/V in a bfloat16 pool and quantized to a
   float8_e4m3fn pool with scales; microseconds per call, achieved GB/s over the bytes read
   (the pool's K and V of every token attended, at the pool's itemsize, plus q, the output and
   the block tables), as a fraction of the measured HBM bandwidth, and the ratio fp8 / bf16 of
   the times (0.5 would be all of the halved bytes turned into time). Each shape's fp8 output is
   also checked against the reference. Timing as in `kernels_gpu.py` (`time_loop`: `--reps`
   chained calls in one jitted loop minus an empty loop, medians of `--iters`, KV copies rotated
   so small cases read HBM rather than L2).

The JSON is rewritten after every section and every shape.
"""

import argparse
import functools
import gc
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels_gpu import (
    BS,
    PEAK_HBM,
    Mismatch,
    check,
    paged_batch,
    parse_timing,
    ragged_args,
    reference_or_none,
    run_phases,
    save,
    time_loop,
)
from pallas_kernels import paged_decode_attention, ragged_paged_attention, reference

FP8 = {"e4m3fn": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
TOL_FP8 = 2e-2  # both sides read the same float8 values; the kernel's error is its bf16 dots'


def scales(key, kv_heads: int) -> tuple[jax.Array, jax.Array]:
    """Per-kv-head dequantisation scales in [0.5, 2): not 1, so a scale dropped or misapplied shows."""
    k, v = jax.random.split(key)
    return tuple(jax.random.uniform(x, (kv_heads,), jnp.float32, 0.5, 2.0) for x in (k, v))


@functools.partial(jax.jit, static_argnums=2)
def to_fp8(pool: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """`pool / scale[kv head]` rounded to float8 (NaN stays NaN), in the pool's shape."""
    nb, bs, kh, hd = pool.shape
    return reference.quantize(pool.reshape(nb * bs, kh, hd), scale, dtype).reshape(pool.shape)


def correctness(cfg, log: list) -> None:
    print("== correctness: float8 pools with per-head scales, NaN in unowned slots ==")
    key = jax.random.key(0)
    k_scale, v_scale = scales(jax.random.fold_in(key, 7), cfg.kv_heads)
    quant = dict(k_scale=k_scale, v_scale=v_scale)
    for name, dtype in FP8.items():
        lens = cfg.decode_lens
        k_pool, v_pool, tables = paged_batch(key, lens, cfg.decode_width, cfg.kv_heads, cfg.head_dim, jnp.float32, True)
        k_pool, v_pool = to_fp8(k_pool, k_scale, dtype), to_fp8(v_pool, v_scale, dtype)
        assert bool(jnp.isnan(k_pool.astype(jnp.float32)).any()), "the poison must survive the rounding to float8"
        q = jax.random.normal(key, (len(lens), cfg.heads, cfg.head_dim)).astype(jnp.bfloat16)
        args = (q, k_pool, v_pool, tables, jnp.asarray(lens, jnp.int32))
        with jax.default_matmul_precision("highest"):
            ref = reference.paged_decode_attention(*args, **quant)
        out = jax.jit(functools.partial(paged_decode_attention, interpret=cfg.interpret, **quant))(*args)
        check(f"decode float8_{name} pool, bf16 q, lens={lens}", out, ref, jnp.bfloat16, log, TOL_FP8)
        kv_lens, q_lens = zip(*cfg.ragged_mix)
        q, k_pool, v_pool, cu, kv, tables, n = ragged_args(
            key, kv_lens, q_lens, (cfg.heads, cfg.kv_heads), cfg.head_dim, jnp.float32, True, pad_tokens=3
        )
        args = (
            q.astype(jnp.bfloat16),
            to_fp8(k_pool, k_scale, dtype),
            to_fp8(v_pool, v_scale, dtype),
            cu,
            kv,
            tables,
            n,
        )
        with jax.default_matmul_precision("highest"):
            ref = reference.ragged_paged_attention(*args, **quant)
        out = jax.jit(functools.partial(ragged_paged_attention, interpret=cfg.interpret, **quant))(*args)
        if np.asarray(out[sum(q_lens) :], np.float32).any():
            raise Mismatch(f"ragged float8_{name}: padding rows are not zero")
        check(f"ragged float8_{name} pool, bf16 q, (kv, q)={cfg.ragged_mix}", out, ref, jnp.bfloat16, log, TOL_FP8)


def timing(label, fn, args, cfg, baseline) -> float | None:
    try:
        return max(time_loop(fn, args, cfg, rotate=3) - baseline, 1e-9)
    except Exception as err:  # noqa: BLE001 - one shape failing (OOM) must not end the run
        print(f"    {label} failed: {type(err).__name__}: {str(err)[:300]}")
        return None


def bench_decode(cfg, log: list, results: dict) -> None:
    print("== decode: bf16 pool vs float8_e4m3fn pool (bf16 q) ==")
    key = jax.random.key(1)
    k_scale, v_scale = scales(jax.random.fold_in(key, 7), cfg.kv_heads)
    for batch in cfg.batches:
        for ctx in cfg.contexts:
            tokens_bytes = batch * ctx * cfg.kv_heads * cfg.head_dim * 2  # K and V, per byte of itemsize
            copies = int(min(16, max(1, -(-cfg.rotate_bytes // (2 * tokens_bytes)))))
            lens = jnp.full((batch,), ctx, jnp.int32)
            k_pool, v_pool, tables = paged_batch(
                key, [ctx] * batch * copies, -(-ctx // BS), cfg.kv_heads, cfg.head_dim, jnp.bfloat16, False
            )
            tables = tables.reshape(copies, batch, -1)  # copy c reads its own pages of one pool
            q = jax.random.normal(key, (batch, cfg.heads, cfg.head_dim)).astype(jnp.bfloat16)
            other = 2 * q.size * 2 + batch * tables.shape[-1] * 4  # q in, output out, the block tables
            row = dict(batch=batch, context=ctx, copies=copies)
            for name, dtype in (("bf16", None), ("fp8", jnp.float8_e4m3fn)):
                quant = {} if dtype is None else dict(k_scale=k_scale, v_scale=v_scale)
                if dtype is not None:  # the same values, quantized; the bf16 pools go
                    k_pool, v_pool = to_fp8(k_pool, k_scale, dtype), to_fp8(v_pool, v_scale, dtype)
                    gc.collect()
                args = (q, k_pool, v_pool, tables, lens)
                kernel = functools.partial(paged_decode_attention, interpret=cfg.interpret, **quant)
                if dtype is not None:
                    one = (q, k_pool, v_pool, tables[0], lens)
                    ref = (
                        reference_or_none(functools.partial(reference.paged_decode_attention, **quant), one)
                        if batch * ctx <= cfg.max_checked_tokens
                        else None
                    )
                    if ref is not None:
                        check(
                            f"decode float8_e4m3fn b={batch} ctx={ctx}",
                            jax.jit(kernel)(*one),
                            ref,
                            jnp.bfloat16,
                            log,
                            TOL_FP8,
                        )
                    del ref
                base = time_loop(lambda q_, *_: q_, args, cfg, rotate=3)
                seconds = timing(f"{name} b={batch} ctx={ctx}", kernel, args, cfg, base)
                nbytes = tokens_bytes * jnp.dtype(k_pool.dtype).itemsize + other
                row[name] = dict(
                    pool_dtype=jnp.dtype(k_pool.dtype).name,
                    kv_bytes=tokens_bytes * jnp.dtype(k_pool.dtype).itemsize,
                    bytes=nbytes,
                    baseline_s=base,
                    s=seconds,
                    GBps=None if seconds is None else nbytes / seconds / 1e9,
                    frac_of_measured_hbm=None
                    if seconds is None or not results["hbm_copy_Bps"]
                    else nbytes / seconds / results["hbm_copy_Bps"],
                    frac_of_peak_hbm=None
                    if seconds is None or not results["peak_hbm_Bps"]
                    else nbytes / seconds / results["peak_hbm_Bps"],
                )
            b, f = row["bf16"]["s"], row["fp8"]["s"]
            row["time_ratio_fp8_over_bf16"] = None if b is None or f is None else f / b
            row["speedup_fp8"] = None if b is None or f is None else b / f
            results["decode"].append(row)
            save(results, cfg.out)
            print(
                f"  b={batch:4d} ctx={ctx:5d}: bf16 {fmt_us(b)} µs {fmt_gbs(row['bf16'])}, fp8 {fmt_us(f)} µs "
                f"{fmt_gbs(row['fp8'])}, fp8/bf16 time {fmt_ratio(row['time_ratio_fp8_over_bf16'])}",
                flush=True,
            )
            del k_pool, v_pool, tables, args, q
            gc.collect()


def fmt_us(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def fmt_gbs(entry: dict) -> str:
    if entry.get("GBps") is None:
        return "(- GB/s)"
    frac = entry.get("frac_of_measured_hbm")
    return f"({entry['GBps']:.0f} GB/s" + ("" if frac is None else f", {100 * frac:.0f}% of measured HBM") + ")"


def fmt_ratio(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (a CPU check of the script)")
    p.add_argument("--out", required=True, help="the JSON file")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="2048,8192")
    cfg = parse_timing(p, argv)
    cfg.heads, cfg.kv_heads, cfg.head_dim = 32, 8, 128  # Llama-3.1-8B attention
    cfg.batches = [int(x) for x in cfg.batches.split(",")]
    cfg.contexts = [int(x) for x in cfg.contexts.split(",")]
    cfg.decode_lens, cfg.decode_width = [1, BS - 1, BS, BS + 1, 300, 2000, 0], 160
    cfg.ragged_mix = [(1, 1), (BS + 1, 1), (700, 1), (BS - 1, BS - 1), (BS + 1, BS + 1), (300, 300), (37, 21)]
    cfg.max_checked_tokens = 64 * 8192  # larger shapes: the reference's f32 gather is slow to build; speed only
    if cfg.smoke:
        cfg.heads, cfg.kv_heads, cfg.head_dim = 8, 2, 64
        cfg.batches, cfg.contexts = [2], [64]
        cfg.decode_lens, cfg.decode_width = [1, BS + 1, 70, 0], 8
        cfg.ragged_mix = [(1, 1), (BS + 1, BS + 1), (37, 21)]
        cfg.reps, cfg.warmup, cfg.iters, cfg.rotate_bytes, cfg.hbm_bytes = 2, 0, 1, 1 << 16, 1 << 20
    elif not cfg.gpu:
        p.error("no GPU backend: run on a GPU, or pass --smoke for the CPU check")
    return cfg


def main(argv=None) -> int:
    cfg = parse(argv)
    kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {kind}; interpret={cfg.interpret}", flush=True)
    results = dict(
        device=kind,
        jax=jax.__version__,
        smoke=cfg.smoke,
        complete=False,
        peak_hbm_Bps=next((v for k, v in PEAK_HBM.items() if k in kind), None),
        hbm_copy_Bps=None,
        shapes=dict(heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, block_size=BS),
        checks=[],
        decode=[],
    )
    return run_phases(
        cfg,
        results,
        [lambda: correctness(cfg, results["checks"]), lambda: bench_decode(cfg, results["checks"], results)],
    )


if __name__ == "__main__":
    sys.exit(main())
