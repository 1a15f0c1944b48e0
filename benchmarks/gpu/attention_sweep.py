"""Tile sweep of the attention kernels on a GPU: which `tiles=` makes each kernel fastest.

The first H100 run had the ragged (prefill) kernel at 0.43-0.53x cuDNN with one hard-coded tile
row (`pallas_kernels.ragged_attention._TILES`). This times the choices in one device call:

1. Cases, most valuable first (Llama-3.1-8B attention: 32 query / 8 KV heads, head_dim 128,
   bf16, block size 16, NaN in every pool slot no sequence owns):
   - `prefill_2048`: one causal 2,048-token prompt, over the whole ragged grid (rows x block_k x
     warps x stages; the default first, then by how many axes differ from it), for at most
     `--first-share` of the budget;
   - `mixed_2048`: an engine step of 2,048 tokens: a 1,536-token prefill chunk over 2,048 cached
     tokens, 256 decode tokens of 1-2K context, 256 padding tokens;
   - `prefill_8192`, `prefill_512`: one causal prompt;
   - `decode_b64`, `decode_b256`: the decode kernel, context 2,048, over its own grid.
   Cases after the first ragged one time only its `--top` fastest configs, and the default. `--tiles` replaces the ragged grid with the configs given.
2. Per config: the kernel's output is checked once against the jnp reference (relative error
   under the bf16 tolerance, no NaN), then timed with `kernels_gpu.time_loop` (chained calls in
   one jitted loop, minus an empty loop). A config that fails to trace, compile or run is
   recorded as `failed` with its error; a wrong result as `mismatch` (exit status 1).
3. Per case, in the same run: the default tiles' time (`x_default` = default time / this
   config's: above 1 is faster) and, for one prompt, cuDNN's
   (`jax.nn.dot_product_attention(implementation="cudnn")` on contiguous K/V; `x_cudnn` = cuDNN
   time / ours). TFLOP/s count the causal FLOPs, 4·N·H·(Q·(L-Q) + Q(Q+1)/2) per sequence of
   Q query and L context tokens (4·N·H·T(T+1)/2 for one prompt, as kernels_gpu counts); decode
   reports GB/s of KV read.

The JSON is rewritten after every config; `--max-seconds` is checked before every config and
stops the sweep cleanly (`stopped` says where). `ragged_overall` ranks the configs timed in every
ragged case by their geometric-mean `x_default`: its first entry is the candidate for `_TILES[128]`.

Usage (H100/H200, jax 0.11.2 with CUDA; ~6 minutes):
  python -m benchmarks.gpu.attention_sweep --out sweep.json
  python -m benchmarks.gpu.attention_sweep --smoke --out /tmp/s.json   # CPU, interpret, tiny
"""

import argparse
import functools
import gc
import itertools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernels_gpu import (
    BS,
    TOL,
    paged_batch,
    parse_timing,
    ragged_args,
    reference_or_none,
    rel_err,
    save,
    sdpa_peer,
    time_loop,
)
from pallas_kernels import paged_decode_attention, ragged_paged_attention, reference
from pallas_kernels.decode_attention import _BLOCK_K, _NUM_STAGES, _NUM_WARPS
from pallas_kernels.ragged_attention import _TILES

DTYPE = jnp.bfloat16
# Ragged (rows, block_k, num_warps, num_stages) and decode (block_k, num_warps, num_stages)
# grids; each axis lists the default first, so the product starts at the default.
RAGGED_GRID = ([128, 64, 256], [64, 128, 32], [8, 4], [2, 3, 4])
DECODE_GRID = ([128, 64, 256], [4, 8], [2, 3])


def nearest_first(axes) -> list:
    """The grid's configs, the default (every axis's first value) first, then by how many axes
    differ from it: a sweep cut short has timed the single changes."""
    default = [values[0] for values in axes]
    grid = [list(t) for t in itertools.product(*axes)]
    return sorted(grid, key=lambda t: sum(a != b for a, b in zip(t, default)))


def causal_flops(heads: int, head_dim: int, kv_lens, q_lens) -> int:
    """4·N·H·Σ (Q·(L-Q) + Q(Q+1)/2): each query token attends to its context up to itself."""
    return 4 * heads * head_dim * sum(q * (kv - q) + q * (q + 1) // 2 for kv, q in zip(kv_lens, q_lens))


def ragged_case(cfg, name, kv_lens, q_lens, pad_tokens=0):
    """A ragged case: its args, FLOPs, and for one prompt the contiguous K/V cuDNN reads."""
    key = jax.random.key(len(name))
    args = ragged_args(key, kv_lens, q_lens, (cfg.heads, cfg.kv_heads), cfg.head_dim, DTYPE, True, pad_tokens)
    case = dict(case=name, kernel="ragged", kv_lens=len(kv_lens), tokens=sum(q_lens) + pad_tokens)
    case["flops"] = causal_flops(cfg.heads, cfg.head_dim, kv_lens, q_lens)
    cudnn_args = None
    if len(kv_lens) == 1:  # one prompt: the same K/V gathered once, outside the timing
        q, k_pool, v_pool, _, _, tables, _ = args
        k, v = (p[tables[0]].reshape(-1, cfg.kv_heads, cfg.head_dim)[: kv_lens[0]] for p in (k_pool, v_pool))
        cudnn_args = (q, k, v)
    return case, args, cudnn_args


def decode_case(cfg, batch: int, ctx: int):
    key = jax.random.key(batch)
    k_pool, v_pool, tables = paged_batch(key, [ctx] * batch, -(-ctx // BS), cfg.kv_heads, cfg.head_dim, DTYPE, True)
    q = jax.random.normal(key, (batch, cfg.heads, cfg.head_dim)).astype(DTYPE)
    args = (q, k_pool, v_pool, tables, jnp.full((batch,), ctx, jnp.int32))
    kv_bytes = batch * ctx * cfg.kv_heads * cfg.head_dim * 2 * jnp.dtype(DTYPE).itemsize
    return dict(case=f"decode_b{batch}", kernel="decode", batch=batch, context=ctx, bytes=kv_bytes), args


def run_config(cfg, case, kernel, args, ref, tiles, baseline) -> dict:
    """Checks then times one config; never raises (the sweep goes on)."""
    entry = dict(tiles=list(tiles), status="ok", rel_err=None, seconds=None, error=None)
    fn = functools.partial(kernel, interpret=cfg.interpret, tiles=tuple(tiles))
    start = time.perf_counter()
    try:
        out = jax.block_until_ready(jax.jit(fn)(*args))
        entry["check_s"] = time.perf_counter() - start
        if ref is not None:
            entry["rel_err"] = err = rel_err(out, ref)
            if not err < TOL[jnp.dtype(DTYPE).name]:  # NaN fails too
                entry["status"] = "mismatch"
                return entry
        entry["seconds"] = max(time_loop(fn, args, cfg) - baseline, 1e-9)
    except Exception as e:  # noqa: BLE001 - a config that cannot compile or run is skipped
        entry["status"], entry["error"] = "failed", f"{type(e).__name__}: {str(e)[:300]}"
    return entry


def rate(case, seconds):
    """TFLOP/s (ragged) or GB/s of KV read (decode)."""
    if seconds is None:
        return None
    return case["flops"] / seconds / 1e12 if case["kernel"] == "ragged" else case["bytes"] / seconds / 1e9


def add_ratios(case: dict) -> None:
    default = next((c for c in case["configs"] if c["tiles"] == case["default_tiles"]), None)
    case["default_s"] = default and default["seconds"]
    for entry in case["configs"]:
        s = entry["seconds"]
        entry["rate"] = rate(case, s)
        entry["x_default"] = s and case["default_s"] and case["default_s"] / s
        entry["x_cudnn"] = s and case.get("cudnn_s") and case["cudnn_s"] / s


def ranked(case: dict) -> list:
    return sorted((c for c in case["configs"] if c["seconds"]), key=lambda c: c["seconds"])


def out_of_time(cfg, results, where: str) -> bool:
    """True (and `stopped` recorded) once `--max-seconds` has passed."""
    if time.perf_counter() <= cfg.deadline:
        return False
    results["stopped"] = f"--max-seconds {cfg.max_seconds:g} reached before {where}"
    save(results, cfg.out)
    return True


def sweep_case(cfg, results, case, kernel, args, grid, cudnn_args=None, share: float = 1.0) -> bool:
    """Times `grid` on one case, saving after every config; False once out of time. The case
    stops (`cut`, the sweep goes on) once it has spent `share` of the time left at its start."""
    case_deadline = time.perf_counter() + share * (cfg.deadline - time.perf_counter())
    results["cases"].append(case)
    case["configs"] = []
    ragged = case["kernel"] == "ragged"
    ref = reference_or_none(reference.ragged_paged_attention if ragged else reference.paged_decode_attention, args)
    case["baseline_s"] = baseline = time_loop(lambda q_, *_: q_, args, cfg)
    if cudnn_args is not None:
        impl = "cudnn" if cfg.gpu else "xla"
        fn = sdpa_peer(impl)
        try:
            out = jax.jit(fn)(*cudnn_args)
            case["cudnn_rel_err"] = None if ref is None else rel_err(out, ref)
            case["cudnn_s"] = max(time_loop(fn, cudnn_args, cfg) - baseline, 1e-9)
            case["cudnn_rate"] = rate(case, case["cudnn_s"])
        except Exception as e:  # noqa: BLE001 - the peer failing must not end the sweep
            case["cudnn_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"== {case['case']}: {len(grid)} configs; cuDNN {fmt_us(case.get('cudnn_s'))} µs ==", flush=True)
    for tiles in grid:
        if out_of_time(cfg, results, f"{case['case']} {tiles}"):
            return False
        if time.perf_counter() > case_deadline:
            case["cut"] = f"its share ({share:g}) of the time left spent before {tiles}"
            break
        entry = run_config(cfg, case, kernel, args, ref, tiles, baseline)
        case["configs"].append(entry)
        add_ratios(case)
        save(results, cfg.out)
        detail = entry["error"] or ("" if entry["rel_err"] is None else f"rel err {entry['rel_err']:.1e}")
        print(f"  {entry['status']:<8} {str(tiles):<18} {fmt_us(entry['seconds'])} µs  {detail}", flush=True)
    return True


def ragged_overall(results) -> list:
    """Configs timed in every ragged case, by geometric-mean x_default (best first)."""
    cases = [c for c in results["cases"] if c["kernel"] == "ragged"]
    speedups = {}
    for case in cases:
        for entry in case["configs"]:
            if entry["x_default"]:
                speedups.setdefault(tuple(entry["tiles"]), []).append(entry["x_default"])
    full = [(t, math.exp(np.mean(np.log(x)))) for t, x in speedups.items() if len(x) == len(cases)]
    return [dict(tiles=list(t), geomean_x_default=g) for t, g in sorted(full, key=lambda tx: -tx[1])]


def fmt_us(seconds) -> str:
    return "     -  " if seconds is None else f"{seconds * 1e6:8.1f}"


def report(results) -> None:
    for case in results["cases"]:
        unit = "TFLOP/s" if case["kernel"] == "ragged" else "GB/s"
        print(f"\n== {case['case']} (µs; {unit}; x default = default time / this; x cuDNN = cuDNN time / this) ==")
        for i, e in enumerate(ranked(case)[:10]):
            xc = "" if e["x_cudnn"] is None else f"  x cuDNN {e['x_cudnn']:.2f}"
            mark = "  (default)" if e["tiles"] == case["default_tiles"] else ""
            print(
                f"{i + 1:3d}. {str(e['tiles']):<18} {fmt_us(e['seconds'])} {e['rate']:8.1f}"
                f"  x default {e['x_default'] or 0:.2f}{xc}{mark}"
            )
        bad = [c["tiles"] for c in case["configs"] if c["status"] != "ok"]
        if bad:
            print(f"     not timed (failed or mismatch): {bad}")
    for row in results["ragged_overall"][:5]:
        print(f"ragged overall: {row['tiles']} geomean x default {row['geomean_x_default']:.3f}")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (a CPU check of the script)")
    p.add_argument("--out", required=True, help="the JSON file (rewritten after every config)")
    p.add_argument("--max-seconds", type=float, default=360.0, help="wall budget; checked before every config")
    p.add_argument("--top", type=int, default=6, help="first case's fastest configs that later ragged cases time")
    p.add_argument("--tiles", action="append", default=None, help="a ragged config R,BK,W,S (repeatable)")
    p.add_argument("--no-decode", action="store_true", help="skip the decode cases")
    p.add_argument("--first-share", type=float, default=0.6, help="of the budget, at most, for the first case's grid")
    p.set_defaults(reps=20, warmup=1, iters=5)  # kernels_gpu's loop; compiles, not timing, dominate a config
    cfg = parse_timing(p, argv)
    cfg.heads, cfg.kv_heads, cfg.head_dim = 32, 8, 128  # Llama-3.1-8B attention
    cfg.ragged_grid, cfg.decode_grid = nearest_first(RAGGED_GRID), nearest_first(DECODE_GRID)
    rng = np.random.default_rng(0)
    # (name, kv_lens, q_lens, padding tokens), most valuable first
    cfg.ragged_cases = [
        ("prefill_2048", [2048], [2048], 0),
        ("mixed_2048", [3584, *rng.integers(1024, 2049, 256).tolist()], [1536] + [1] * 256, 256),
        ("prefill_8192", [8192], [8192], 0),
        ("prefill_512", [512], [512], 0),
    ]
    cfg.decode_cases = [(64, 2048), (256, 2048)]
    if cfg.smoke:
        cfg.heads, cfg.kv_heads, cfg.head_dim = 8, 2, 64
        cfg.ragged_grid = [[128, 64, 4, 2], [16, 16, 4, 3], [8, 16, 4, 2]]  # the last is refused: rows < 16
        cfg.decode_grid = [[128, 4, 2], [32, 2, 3]]
        cfg.ragged_cases = [("prefill_40", [40], [40], 0), ("mixed_40", [50, 17, 33], [20, 1, 1], 2)]
        cfg.decode_cases = [(2, 40)]
        cfg.reps, cfg.warmup, cfg.iters, cfg.top = 1, 0, 1, 2
    elif not cfg.gpu:
        p.error("no GPU backend: run on a GPU, or pass --smoke for the CPU check")
    if cfg.tiles:
        cfg.ragged_grid = [[int(x) for x in t.split(",")] for t in cfg.tiles]
    return cfg


def main(argv=None) -> int:
    cfg = parse(argv)
    cfg.deadline = time.perf_counter() + cfg.max_seconds
    kind = jax.devices()[0].device_kind
    print(f"jax {jax.__version__} on {kind}; interpret={cfg.interpret}; budget {cfg.max_seconds:.0f} s", flush=True)
    default_ragged = list(_TILES[cfg.head_dim])
    default_decode = [_BLOCK_K[cfg.head_dim], _NUM_WARPS, _NUM_STAGES]
    results = dict(
        device=kind,
        jax=jax.__version__,
        smoke=cfg.smoke,
        complete=False,
        stopped=None,
        max_seconds=cfg.max_seconds,
        top=cfg.top,
        shapes=dict(heads=cfg.heads, kv_heads=cfg.kv_heads, head_dim=cfg.head_dim, block_size=BS, dtype="bfloat16"),
        default_tiles=dict(ragged=default_ragged, decode=default_decode),
        cases=[],
        ragged_overall=[],
    )
    going = True
    for i, (name, kv_lens, q_lens, pad) in enumerate(cfg.ragged_cases):
        if not going or out_of_time(cfg, results, name):
            going = False
            break
        # the default always (x_default needs it); after the first case its fastest `--top`
        grid = cfg.ragged_grid if i == 0 else [e["tiles"] for e in ranked(results["cases"][0])[: cfg.top]]
        grid = [default_ragged] + [t for t in grid if t != default_ragged]
        case, args, cudnn_args = ragged_case(cfg, name, kv_lens, q_lens, pad)
        case["default_tiles"] = default_ragged
        share = cfg.first_share if i == 0 and len(cfg.ragged_cases) > 1 else 1.0
        going = sweep_case(cfg, results, case, ragged_paged_attention, args, grid, cudnn_args, share)
        results["ragged_overall"] = ragged_overall(results)
        save(results, cfg.out)
        del args, cudnn_args
        gc.collect()
    for batch, ctx in [] if cfg.no_decode else cfg.decode_cases:
        if not going or out_of_time(cfg, results, f"decode_b{batch}"):
            going = False
            break
        case, args = decode_case(cfg, batch, ctx)
        case["default_tiles"] = default_decode
        going = sweep_case(cfg, results, case, paged_decode_attention, args, cfg.decode_grid)
        del args
        gc.collect()
    results["complete"] = going
    save(results, cfg.out)
    report(results)
    mismatches = [(c["case"], e["tiles"]) for c in results["cases"] for e in c["configs"] if e["status"] == "mismatch"]
    if mismatches:
        print(f"\nWRONG RESULTS (a kernel bug at these tiles): {mismatches}", file=sys.stderr)
    print(f"\nwrote {cfg.out}" + (f" (stopped: {results['stopped']})" if results["stopped"] else ""))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
