"""Engine start-up: the model (loaded or dummy), the context limit, stop tokens and the KV plan."""

import json
import logging
import os

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpaged.checkpoint.loader import load_model, read_hf_config, resolve_dtype
from jaxpaged.config.engine_args import EngineArgs
from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token
from jaxpaged.model import Llama, kv_storage_dtype
from jaxpaged.planning.memory import GiB, KVCachePlan, plan_kv_cache

logger = logging.getLogger("jaxpaged")

# Without a device memory figure (CPU), the pool gets at most this share of the machine's memory.
CPU_KV_CACHE_SHARE = 0.25
# Temporaries may differ this much between the probe and the real programs (alignment, scalars).
TEMP_SLACK_BYTES = 1 << 20


def build_model(args: EngineArgs) -> tuple[ModelConfig, Llama, int]:
    """Loads (or, with load_format="dummy", randomly initialises) the model.

    Returns:
      `(config, model, max_model_len)` with max_model_len validated against the model.
    """
    config, raw = read_hf_config(args.model)
    max_model_len = config.check_max_model_len(args.max_model_len or config.max_context_len)
    if args.load_format == "dummy":
        dtype = resolve_dtype(args.dtype, raw.get("dtype") or raw.get("torch_dtype"))
        model = nnx.jit(
            lambda: Llama(config, jnp.dtype(dtype), rngs=nnx.Rngs(args.seed), attention=args.attention_backend)
        )()
    else:
        config, model = load_model(args.model, args.dtype, attention=args.attention_backend)
    logger.info("model %s: %s, %d layers, dtype %s", args.model, config.architecture, config.num_layers,
                model.embed[...].dtype)  # fmt: skip
    return config, model, max_model_len


def eos_token_ids(args: EngineArgs, config: ModelConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (vLLM stops at any)."""
    ids = set(config.eos_token_ids)
    path = os.path.join(args.model, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def host_memory_bytes() -> int:
    """Physical memory of this machine (what a CPU "device" has)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_cache(args: EngineArgs, model: Llama, mesh: jax.sharding.Mesh, max_model_len: int) -> KVCachePlan:
    """Sizes the KV pool from the device's memory (or the explicit budget, or on a CPU the job)."""
    dtype_bytes = kv_storage_dtype(model.embed[...].dtype, mesh.devices.flat[0].platform).itemsize
    common = dict(dtype_bytes=dtype_bytes, block_size=args.block_size, max_model_len=max_model_len)
    if args.kv_cache_memory_bytes is not None:
        return plan_kv_cache(model.config, kv_cache_memory_bytes=args.kv_cache_memory_bytes, **common)
    stats = mesh.devices.flat[0].memory_stats() or {}
    if "bytes_limit" not in stats:
        return plan_kv_cache(model.config, **common, **_cpu_budget(args, model.config, dtype_bytes, max_model_len))
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    activations = _peak_activation_bytes(args, model, mesh, max_model_len)
    # The allocator's limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the device (see jaxpaged/__init__.py).
    fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
    total = stats["bytes_limit"] / fraction
    utilization = args.gpu_memory_utilization
    if utilization > fraction:
        logger.warning("gpu_memory_utilization=%s exceeds the JAX allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION=%s); "
                       "planning with %s", utilization, fraction, fraction)  # fmt: skip
        utilization = fraction
    return plan_kv_cache(
        model.config, device_memory_bytes=int(total), gpu_memory_utilization=utilization,
        weight_bytes=weights, activation_bytes=activations, **common,
    )  # fmt: skip


def _cpu_budget(args: EngineArgs, config: ModelConfig, dtype_bytes: int, max_model_len: int) -> dict:
    """A CPU has no device memory figure: room for `max_num_seqs` requests of `max_model_len`
    (what the job can use at once), capped at a share of the machine's memory."""
    per_block = kv_bytes_per_token(config, dtype_bytes) * args.block_size
    want = (args.max_num_seqs * -(-max_model_len // args.block_size) + 1) * per_block  # + the null block
    cap = int(host_memory_bytes() * CPU_KV_CACHE_SHARE)
    if want <= cap:
        why = f"the job: max_num_seqs={args.max_num_seqs} x max_model_len={max_model_len} tokens (CPU)"
        return dict(kv_cache_memory_bytes=want, sized_from=why)
    why = (f"{CPU_KV_CACHE_SHARE:.0%} of this machine's memory (CPU; max_num_seqs={args.max_num_seqs} x "
           f"max_model_len={max_model_len} would need {want / GiB:.2f} GiB; set kv_cache_memory_bytes to choose)")  # fmt: skip
    return dict(kv_cache_memory_bytes=cap, sized_from=why)


def check_step_memory(plan: KVCachePlan, temp_bytes: dict[tuple[int, int], int]) -> None:
    """After warm-up: the compiled steps' temporaries (with the real pool) fit what the plan
    reserved for them, so gpu_memory_utilization means what it says.

    Args:
      plan: the KV plan; `activation_bytes` is what it reserved (0 when nothing was measured).
      temp_bytes: temporaries of each compiled program, from XLA's memory analysis.

    Raises:
      RuntimeError: a program needs more than the plan reserved (with the numbers and the knob).
    """
    if not plan.activation_bytes or not temp_bytes:
        return
    program, worst = max(temp_bytes.items(), key=lambda kv: kv[1])
    if worst > plan.activation_bytes + TEMP_SLACK_BYTES:
        raise RuntimeError(
            f"the step program for token bucket {program[0]} x {program[1]} steps needs {worst / GiB:.3f} GiB of "
            f"temporaries with the real KV pool, but the plan reserved {plan.activation_bytes / GiB:.3f} GiB "
            "(the largest single step, measured with a small pool); lower gpu_memory_utilization or set "
            "kv_cache_memory_bytes"
        )


def _peak_activation_bytes(args: EngineArgs, model: Llama, mesh, max_model_len: int) -> int:
    """Temporaries of the largest step bucket, from XLA's memory analysis (pool kept tiny)."""
    from jaxpaged.worker.model_runner import ModelRunner  # the runner needs the plan; this probe does not

    pages = -(-max_model_len // args.block_size)
    probe = ModelRunner(
        model, mesh=mesh, num_blocks=pages + 1, block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=max_model_len,
        kv_dtype=model.embed[...].dtype,
    )  # fmt: skip
    program = (max(probe.layouts), 1)
    probe.compile_bucket(*program)
    temp = probe.temp_bytes[program]
    logger.info("peak activation memory of the largest step: %.2f GiB", temp / 2**30)
    return temp
