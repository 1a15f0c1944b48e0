"""GPU correctness and speed of the Pallas kernels, against peers measured in the same run.

0. HBM bandwidth, measured: a large array read and written in place, back to back; the decode
   table gives each kernel's bandwidth as a fraction of this measured number (and of the datasheet).
1. Correctness (interpret=False on a GPU): each kernel against its jnp reference on random data
   with NaN in every page nobody owns, mixed lengths across block edges, bf16 and f32 (f32 twice:
   with IEEE f32 dots, and as the engine runs it, see TOL_F32_TF32); then again at every benchmark
   shape. Prints the max relative error; exits non-zero on a mismatch or a NaN. Peers are checked
   against the reference too (a wrong peer makes a ratio meaningless).
2. Speed, Llama-3.1-8B attention (32 q heads, 8 kv heads, head_dim 128), bf16, block size 16:
   - decode: achieved bandwidth (KV bytes read + q + out, over time) for batch 1/8/64/256 x
     context 512/2K/8K; peers: the jnp reference under XLA, JAX's own Pallas
     `jax.experimental.pallas.ops.gpu.paged_attention` (its [K, NB, BS, H] layout, converted
     once outside the timing), and our ragged kernel on the same decode batch;
   - prefill: TFLOP/s (causal FLOPs 4·N·H·T(T+1)/2) of one 512/2K/8K-token prompt; peers: the
     jnp reference and `jax.nn.dot_product_attention(implementation="cudnn")` on contiguous K/V.
   Each timing runs `--reps` calls in one jitted loop (each call's input depends on the previous
   output, so nothing is hoisted), minus the same loop around an empty body; medians of
   `--iters` after `--warmup` runs. Decode rotates among copies of the KV data (other pages,
   same pool) so that small cases read HBM, not the 50 MB L2.

The JSON is rewritten after every section and every timed shape, so a run stopped part-way
keeps what it measured.

Usage (H100/H200, jax 0.11.2 with CUDA, no network needed):
  python -m benchmarks.kernels_gpu --out benchmarks/results/kernels_h100.json
  python -m benchmarks.kernels_gpu --smoke    # tiny shapes, interpret mode: checks the script on CPU
"""

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import paged_decode_attention, ragged_paged_attention, reference, write_kv

BS = 16
PEAK_HBM = {"H100": 3.35e12, "H200": 4.8e12}  # bytes/s (SXM parts)
TOL = {"bfloat16": 2e-2, "float32": 1e-4}
# The kernels' dots carry no precision, and the Pallas Triton lowering turns an f32 dot of
# DEFAULT precision into a TF32 dot (10-bit mantissa), as XLA does for f32 matmuls on a GPU: the
# engine's f32 path runs in TF32. Against the HIGHEST-precision reference that is ~3e-4 relative
# error (2.6e-4 was measured on an H100), so the as-shipped f32 check allows 1e-3: a wrong index,
# mask or softmax still errs by O(1). The same kernels traced under
# `jax.default_matmul_precision("highest")` lower to IEEE f32 dots and keep the 1e-4 check.
TOL_F32_TF32 = 1e-3
HBM_COPY_BYTES = 2 << 30  # the bandwidth probe's array: far larger than L2


class Mismatch(AssertionError):
    pass


def rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(out).all():
        return float("nan")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def reference_or_none(fn, args):
    """The XLA reference output, or None where it does not fit in memory (its scores are f32)."""
    try:
        return jax.block_until_ready(jax.jit(fn)(*args))
    except Exception as e:  # noqa: BLE001 - typically RESOURCE_EXHAUSTED at the largest shapes
        print(f"  reference failed ({type(e).__name__}: {str(e)[:120]}); skipping this check")
        return None


def peer_output(label, fn, *args):
    """A peer's output, or None (printed) if the peer cannot run here: it must not end the run."""
    try:
        return jax.block_until_ready(jax.jit(fn)(*args))
    except Exception as e:  # noqa: BLE001
        print(f"  --  {label} failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def check(name: str, out, ref, dtype, log: list, tol: float | None = None) -> float | None:
    """Fails loudly unless `out` is NaN-free and within `tol` (default: the dtype's) of `ref`."""
    if ref is None or out is None:
        log.append(dict(name=name, rel_err=None, ok=None))
        return None
    err = rel_err(out, ref)
    ok = err < (tol or TOL[jnp.dtype(dtype).name])  # NaN compares False
    print(f"  {'ok ' if ok else 'BAD'} {name:<58} rel err {err:.2e}")
    log.append(dict(name=name, rel_err=err, ok=ok))
    if not ok:
        raise Mismatch(f"{name}: relative error {err} (NaN means a NaN in the output)")
    return err


def paged_batch(key, lens, width, kv_heads, head_dim, dtype, poison):
    """Random pools with each sequence on shuffled pages; with `poison`, every slot no sequence
    owns (null block, spare blocks, page tails) is NaN. Returns k_pool, v_pool, tables."""
    pages = [-(-n // BS) for n in lens]
    num_blocks = sum(pages) + 2
    ids = np.random.default_rng(int(jax.random.randint(key, (), 0, 2**30))).permutation(np.arange(1, num_blocks))
    tables, owned, start = np.zeros((len(lens), width), np.int32), np.zeros((num_blocks, BS), bool), 0
    for s, (n, p) in enumerate(zip(lens, pages)):
        tables[s, :p] = ids[start : start + p]
        start += p
        owned[tables[s, np.arange(n) // BS], np.arange(n) % BS] = True
    kk, kv = jax.random.split(key)
    shape = (num_blocks, BS, kv_heads, head_dim)
    k_pool, v_pool = (jax.random.normal(k_, shape, dtype) for k_ in (kk, kv))
    if poison:
        mask = jnp.asarray(owned)[:, :, None, None]
        k_pool, v_pool = jnp.where(mask, k_pool, jnp.nan), jnp.where(mask, v_pool, jnp.nan)
    return k_pool, v_pool, jnp.asarray(tables)


def ragged_args(key, kv_lens, q_lens, heads, head_dim, dtype, poison, pad_tokens=0):
    n, k = heads
    k_pool, v_pool, tables = paged_batch(key, kv_lens, max(-(-x // BS) for x in kv_lens), k, head_dim, dtype, poison)
    q = jax.random.normal(jax.random.fold_in(key, 1), (sum(q_lens) + pad_tokens, n, head_dim)).astype(dtype)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k_pool, v_pool, cu, jnp.asarray(kv_lens, jnp.int32), tables, jnp.int32(len(kv_lens))


def jax_paged_peer(q, k_pool, v_pool, tables, lens, interpret):
    """JAX's deprecated Pallas GPU paged attention (a benchmark peer only, never the product)."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jpa  # noqa: PLC0415

    kt, vt = jnp.moveaxis(k_pool, 2, 0), jnp.moveaxis(v_pool, 2, 0)  # [K, NB, BS, H], once
    splits = max(s for s in (16, 8, 4, 2, 1) if tables.shape[-1] % s == 0)
    kernel = functools.partial(jpa.paged_attention, k_splits=splits, interpret=interpret)
    scale = q.shape[-1] ** -0.5  # its logits are q.k unscaled (seen on the first H100 run: rel err 11.4 = ~sqrt(128))

    def peer(q_, *rest):
        return kernel((q_ * scale).astype(q_.dtype), *rest)

    # Pools travel as arguments: a closure would bake gigabytes into the program as constants.
    return peer, (q, kt, vt, tables, lens)


def sdpa_peer(implementation):
    """jax.nn.dot_product_attention over one contiguous causal prompt ([T, N, H] in and out)."""
    fn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)
    return lambda q_, k_, v_: fn(q_[None], k_[None], v_[None])[0]


def lower_for_cuda(fn, args) -> str:
    """Lowers `jax.jit(fn)` for an H100 on any machine (Pallas -> Triton needs no GPU)."""
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def time_loop(fn, args, cfg, rotate=None) -> float:
    """Median seconds per call of `fn(*args)`, `cfg.reps` calls chained in one jitted loop.

    With `rotate`, `args[rotate]` has a leading copies axis and call i uses copy i % copies."""

    def run(*args):
        def body(i, carry):
            a = list(args)
            a[0] = a[0] + carry
            if rotate is not None:
                a[rotate] = jax.lax.dynamic_index_in_dim(a[rotate], i % a[rotate].shape[0], keepdims=False)
            out = fn(*a)
            return (jnp.sum(out.astype(jnp.float32)) * 0).astype(a[0].dtype)

        return jax.lax.fori_loop(0, cfg.reps, body, jnp.zeros((), args[0].dtype))

    run = jax.jit(run)
    for _ in range(cfg.warmup):
        jax.block_until_ready(run(*args))
    times = []
    for _ in range(cfg.iters):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t0) / cfg.reps)
    return statistics.median(times)


def timed(label, fn, args, cfg, baseline, rotate=None):
    try:
        return max(time_loop(fn, args, cfg, rotate) - baseline, 1e-9)
    except Exception as e:  # a peer failing (OOM, unsupported) must not end the run
        print(f"    {label} failed: {type(e).__name__}: {str(e)[:200]}")
        return None


def kernel_precisions(kernel, args, dtype, cfg):
    """`(label, output, tolerance)` of `kernel(*args)` as the engine runs it; for f32 also traced
    under HIGHEST matmul precision (IEEE f32 dots in the Triton lowering), held to 1e-4."""
    if jnp.dtype(dtype) != jnp.float32:
        return [("", jax.jit(kernel)(*args), None)]
    with jax.default_matmul_precision("highest"):  # part of jit's cache key: a separate compile
        ieee = jax.jit(kernel)(*args)
    as_run = jax.jit(kernel)(*args)
    default_tol = TOL_F32_TF32 if cfg.gpu else TOL["float32"]  # interpret mode computes in f32
    return [(" (IEEE dots)", ieee, TOL["float32"]), (" (default dots: TF32 on GPU)", as_run, default_tol)]


def measure_hbm_bandwidth(cfg) -> float:
    """Bytes per second of an in-place `x + 1` over `cfg.hbm_bytes` of int32 (each byte read once
    and written once), `cfg.reps` calls queued back to back; the median of `cfg.iters` runs."""
    add_one = jax.jit(lambda x: x + jnp.int32(1), donate_argnums=0)
    x = jax.random.randint(jax.random.key(3), (cfg.hbm_bytes // 4,), 0, 1 << 30, jnp.int32)  # never zeros
    for _ in range(max(cfg.warmup, 1)):
        x = add_one(x)
    jax.block_until_ready(x)
    times = []
    for _ in range(cfg.iters):
        start = time.perf_counter()
        for _ in range(cfg.reps):
            x = add_one(x)
        jax.block_until_ready(x)
        times.append((time.perf_counter() - start) / cfg.reps)
    del x
    bandwidth = 2 * cfg.hbm_bytes / statistics.median(times)
    print(f"== HBM: in-place read+write of {cfg.hbm_bytes >> 20} MiB: {bandwidth / 1e9:.0f} GB/s ==")
    return bandwidth


def correctness(cfg, log):
    print("== correctness (NaN in unowned pages, mixed lengths) ==")
    key = jax.random.key(0)
    decode = functools.partial(paged_decode_attention, interpret=cfg.interpret)
    ragged = functools.partial(ragged_paged_attention, interpret=cfg.interpret)
    for dtype in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dtype).name
        lens = cfg.decode_lens
        k_pool, v_pool, tables = paged_batch(key, lens, cfg.decode_width, cfg.kv_heads, cfg.head_dim, dtype, True)
        q = jax.random.normal(key, (len(lens), cfg.heads, cfg.head_dim)).astype(dtype)
        args = (q, k_pool, v_pool, tables, jnp.asarray(lens, jnp.int32))
        with jax.default_matmul_precision("highest"):
            ref = reference.paged_decode_attention(*args)
        for label, out, tol in kernel_precisions(decode, args, dtype, cfg):
            check(f"decode {name}{label} lens={lens}", out, ref, dtype, log, tol)
        kv_lens, q_lens = zip(*cfg.ragged_mix)
        args = ragged_args(key, kv_lens, q_lens, (cfg.heads, cfg.kv_heads), cfg.head_dim, dtype, True, pad_tokens=3)
        with jax.default_matmul_precision("highest"):
            ref = reference.ragged_paged_attention(*args)
        for label, out, tol in kernel_precisions(ragged, args, dtype, cfg):
            if np.asarray(out[sum(q_lens) :]).any():
                raise Mismatch(f"ragged{label}: padding rows are not zero")
            check(f"ragged {name}{label} (kv, q)={cfg.ragged_mix}", out, ref, dtype, log, tol)
    shape = (8, BS, cfg.kv_heads, cfg.head_dim)
    pools = [jax.random.normal(jax.random.fold_in(key, i), shape).astype(jnp.bfloat16) for i in (2, 3)]
    slots = jnp.asarray([5, 17, 40, 127], jnp.int32)
    new = [jax.random.normal(jax.random.fold_in(key, i), (4, *shape[2:])).astype(jnp.bfloat16) for i in (4, 5)]
    outs = jax.jit(write_kv)(*pools, *new, slots)
    for pool, n, o in zip(pools, new, outs):
        want = np.asarray(pool, np.float32).reshape(-1, *shape[2:]).copy()
        want[np.asarray(slots)] = np.asarray(n, np.float32)
        if not np.array_equal(np.asarray(o, np.float32).reshape(want.shape), want):
            raise Mismatch("write_kv wrote something other than the slots")
    print("  ok  write_kv writes exactly the slots")


def add_bandwidth(row: dict, results: dict) -> None:
    """The row's achieved GB/s and its fraction of the measured and the datasheet bandwidth."""
    seconds = row["ours_s"]
    row["ours_GBps"] = None if seconds is None else row["bytes"] / seconds / 1e9
    for key, peak in (("frac_of_measured_hbm", results["hbm_copy_Bps"]), ("frac_of_peak_hbm", results["peak_hbm_Bps"])):
        row[key] = None if seconds is None or not peak else row["bytes"] / seconds / peak


def bench_decode(cfg, log, results):
    print("== decode: batch x context, bf16 ==")
    dtype, key = jnp.bfloat16, jax.random.key(1)
    item = jnp.dtype(dtype).itemsize
    for batch in cfg.batches:
        for ctx in cfg.contexts:
            kv_bytes = batch * ctx * cfg.kv_heads * cfg.head_dim * 2 * item
            copies = int(min(16, max(1, -(-cfg.rotate_bytes // kv_bytes))))
            lens = jnp.full((batch,), ctx, jnp.int32)
            k_pool, v_pool, tables = paged_batch(
                key, [ctx] * batch * copies, -(-ctx // BS), cfg.kv_heads, cfg.head_dim, dtype, False
            )
            tables = tables.reshape(copies, batch, -1)  # copy c reads its own pages of one pool
            q = jax.random.normal(key, (batch, cfg.heads, cfg.head_dim)).astype(dtype)
            args = (q, k_pool, v_pool, tables, lens)
            ours = functools.partial(paged_decode_attention, interpret=cfg.interpret)
            cu = jnp.arange(batch + 1, dtype=jnp.int32)
            ragged = lambda q_, kp, vp, t, n: ragged_paged_attention(  # noqa: E731
                q_, kp, vp, cu, n, t, jnp.int32(batch), interpret=cfg.interpret
            )
            one = (q, k_pool, v_pool, tables[0], lens)
            ref = reference_or_none(reference.paged_decode_attention, one)
            check(f"decode b={batch} ctx={ctx}", jax.jit(ours)(*one), ref, dtype, log)
            check(f"ragged(decode batch) b={batch} ctx={ctx}", jax.jit(ragged)(*one), ref, dtype, log)
            row = dict(batch=batch, context=ctx, copies=copies, bytes=kv_bytes + 2 * q.size * item)
            base = time_loop(lambda q_, *_: q_, args, cfg, rotate=3)
            row["baseline_s"] = base
            row["ours_s"] = timed("ours", ours, args, cfg, base, rotate=3)
            row["ragged_s"] = timed("ragged", ragged, args, cfg, base, rotate=3)
            row["xla_ref_s"] = timed("xla ref", reference.paged_decode_attention, args, cfg, base, rotate=3)
            peer, peer_args = jax_paged_peer(*args, interpret=False)
            peer_one = (*peer_args[:3], tables[0], lens)
            if not cfg.gpu:  # it cannot be interpreted: at least check that the call lowers
                lower_for_cuda(peer, peer_one)
                print(f"  ok  jax paged_attention b={batch} ctx={ctx} lowers for CUDA (no GPU here)")
            else:
                label = f"jax paged_attention b={batch} ctx={ctx}"
                try:
                    check(label, peer_output(label, peer, *peer_one), ref, dtype, log)
                except Mismatch as err:  # the peer's output is wrong: report it, time ours anyway
                    print(f"  --  peer disagrees with the reference (not ours): {err}")
                row["jax_pallas_s"] = timed("jax paged_attention", peer, peer_args, cfg, base, rotate=3)
            del peer_args, peer_one
            add_bandwidth(row, results)
            results["decode"].append(row)
            save(results, cfg.out)
            del k_pool, v_pool, tables, args, one, ref
            gc.collect()


def bench_prefill(cfg, log, results):
    print("== prefill: one causal prompt, bf16 ==")
    dtype, key = jnp.bfloat16, jax.random.key(2)
    for tokens in cfg.prompts:
        args = ragged_args(key, [tokens], [tokens], (cfg.heads, cfg.kv_heads), cfg.head_dim, dtype, False)
        q, k_pool, v_pool, cu, kv_lens, tables, num_seqs = args
        ours = functools.partial(ragged_paged_attention, interpret=cfg.interpret)
        ref = reference_or_none(reference.ragged_paged_attention, args)
        check(f"ragged prefill T={tokens}", jax.jit(ours)(*args), ref, dtype, log)
        # Contiguous K/V of the same prompt for cuDNN (gathered once, outside the timing).
        k = k_pool[tables[0]].reshape(-1, cfg.kv_heads, cfg.head_dim)[:tokens]
        v = v_pool[tables[0]].reshape(-1, cfg.kv_heads, cfg.head_dim)[:tokens]
        impl = "cudnn" if cfg.gpu else "xla"
        sdpa = sdpa_peer(impl)
        label = f"dot_product_attention[{impl}] T={tokens}"
        check(label, peer_output(label, sdpa, q, k, v), ref, dtype, log)
        base = time_loop(lambda q_, *_: q_, args, cfg)
        row = dict(tokens=tokens, flops=4 * cfg.heads * cfg.head_dim * tokens * (tokens + 1) // 2, baseline_s=base)
        row["ours_s"] = timed("ours", ours, args, cfg, base)
        row["xla_ref_s"] = timed("xla ref", reference.ragged_paged_attention, args, cfg, base)
        row[f"sdpa_{impl}_s"] = timed(f"dot_product_attention[{impl}]", sdpa, (q, k, v), cfg, base)
        for name, seconds in (("ours_TFLOPs", row["ours_s"]), ("sdpa_TFLOPs", row[f"sdpa_{impl}_s"])):
            row[name] = None if seconds is None else row["flops"] / seconds / 1e12
        results["prefill"].append(row)
        save(results, cfg.out)
        del args, k_pool, v_pool, k, v, ref
        gc.collect()


def fmt_t(t):
    return "   -    " if t is None else f"{t * 1e6:8.1f}"


def ratio(a, b):
    return "  -  " if a is None or b is None else f"{b / a:5.2f}"


def report(results):
    print("\n== decode (µs per call; GB/s of ours; % of measured HBM; x = peer time / ours) ==")
    print("batch   ctx    ours  GB/s  %meas   ragged x    xla-ref x   jax-pallas x")
    for r in results["decode"]:
        gbs, frac = r["ours_GBps"], r["frac_of_measured_hbm"]
        pct = "  -  " if frac is None else f"{100 * frac:5.1f}"
        gbs_s = "   -" if gbs is None else f"{gbs:6.0f}"
        print(
            f"{r['batch']:5d} {r['context']:5d} {fmt_t(r['ours_s'])} {gbs_s} {pct} {fmt_t(r['ragged_s'])}"
            f" {ratio(r['ours_s'], r['ragged_s'])} {fmt_t(r['xla_ref_s'])} {ratio(r['ours_s'], r['xla_ref_s'])}"
            f" {fmt_t(r.get('jax_pallas_s'))} {ratio(r['ours_s'], r.get('jax_pallas_s'))}"
        )
    print("\n== prefill (µs per call; TFLOP/s; x = peer time / ours) ==")
    print("tokens     ours TFLOP/s   xla-ref x   sdpa (TFLOP/s) x")
    for r in results["prefill"]:
        sdpa_key = next(k for k in r if k.startswith("sdpa_") and k.endswith("_s"))
        tf_s = {k: "  -  " if r[k] is None else f"{r[k]:6.1f}" for k in ("ours_TFLOPs", "sdpa_TFLOPs")}
        print(
            f"{r['tokens']:6d} {fmt_t(r['ours_s'])} {tf_s['ours_TFLOPs']} {fmt_t(r['xla_ref_s'])}"
            f" {ratio(r['ours_s'], r['xla_ref_s'])} {fmt_t(r[sdpa_key])} ({tf_s['sdpa_TFLOPs']})"
            f" {ratio(r['ours_s'], r[sdpa_key])}"
        )


def parse_timing(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Adds the timing flags every kernel benchmark takes, parses, and sets the device facts
    (`gpu`, `interpret`, `rotate_bytes`, `hbm_bytes`)."""
    p.add_argument("--reps", type=int, default=20, help="calls per timed loop")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5, help="timed loops; the median is reported")
    p.add_argument("--rotate-mb", type=int, default=256, help="decode KV data rotated through per loop")
    cfg = p.parse_args(argv)
    cfg.gpu = jax.default_backend() == "gpu"
    cfg.interpret = not cfg.gpu
    cfg.rotate_bytes, cfg.hbm_bytes = cfg.rotate_mb << 20, HBM_COPY_BYTES
    return cfg


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU check of the script)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<device>.json)")
    p.add_argument("--only", choices=["correctness", "decode", "prefill"], default=None)
    cfg = parse_timing(p, argv)
    cfg.heads, cfg.kv_heads, cfg.head_dim = 32, 8, 128  # Llama-3.1-8B attention
    cfg.batches, cfg.contexts, cfg.prompts = [1, 8, 64, 256], [512, 2048, 8192], [512, 2048, 8192]
    cfg.decode_lens, cfg.decode_width = [1, BS - 1, BS, BS + 1, 300, 2000, 0], 160
    cfg.ragged_mix = [
        (1, 1),
        (BS + 1, 1),
        (700, 1),
        (BS - 1, BS - 1),
        (BS + 1, BS + 1),
        (300, 300),
        (37, 21),
        (150, 64),
    ]
    if cfg.smoke:
        cfg.heads, cfg.kv_heads, cfg.head_dim = 8, 2, 64
        cfg.batches, cfg.contexts, cfg.prompts = [2], [64], [40]
        cfg.decode_lens, cfg.decode_width = [1, BS + 1, 70, 0], 8
        cfg.ragged_mix = [(1, 1), (BS + 1, BS + 1), (37, 21)]
        cfg.reps, cfg.warmup, cfg.iters, cfg.rotate_bytes, cfg.hbm_bytes = 2, 0, 1, 1 << 16, 1 << 20
    elif not cfg.gpu:
        p.error("no GPU backend: run on a GPU, or pass --smoke for the CPU check")
    return cfg


def save(results: dict, path: str) -> None:
    """Writes the results so far (called after every section and timed shape)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


def run_phases(cfg, results: dict, phases: list, report=None, gap: str = "") -> int:
    """Measures the HBM copy bandwidth, then runs each phase (a callable) in order, saving `results`
    to cfg.out after each. A Mismatch ends the run (exit 1, what was measured saved); otherwise
    `report(results)` where given, the checks' count and worst error, and results marked complete
    (exit 0). `gap` goes before the last two lines printed."""
    try:
        results["hbm_copy_Bps"] = measure_hbm_bandwidth(cfg)
        save(results, cfg.out)
        for phase in phases:
            phase()
            save(results, cfg.out)
    except Mismatch as err:
        save(results, cfg.out)
        print(f"\nFAILED: {err}", file=sys.stderr)
        return 1
    if report is not None:
        report(results)
    errs = [c["rel_err"] for c in results["checks"] if c["rel_err"] is not None]
    print(f"{gap}all {len(errs)} checks passed; max relative error {max(errs, default=0.0):.2e}")
    results["complete"] = True
    save(results, cfg.out)
    print(f"{gap}wrote {cfg.out}")
    return 0


def main(argv=None) -> int:
    cfg = parse(argv)
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", str(device))
    cfg.out = cfg.out or os.path.join("benchmarks", "results", f"kernels_{kind.replace(' ', '_')}.json")
    peak = next((v for k, v in PEAK_HBM.items() if k in kind), None)
    print(f"jax {jax.__version__} on {kind}; interpret={cfg.interpret}")
    results = dict(
        device=kind,
        jax=jax.__version__,
        smoke=cfg.smoke,
        complete=False,
        peak_hbm_Bps=peak,
        hbm_copy_Bps=None,
        checks=[],
        decode=[],
        prefill=[],
    )
    phases = {
        "correctness": lambda: correctness(cfg, results["checks"]),
        "decode": lambda: bench_decode(cfg, results["checks"], results),
        "prefill": lambda: bench_prefill(cfg, results["checks"], results),
    }
    chosen = [phase for name, phase in phases.items() if cfg.only in (None, name)]
    return run_phases(cfg, results, chosen, report=report, gap="\n")


if __name__ == "__main__":
    sys.exit(main())
