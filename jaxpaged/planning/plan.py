"""`jaxpaged plan`: what a model needs on a GPU (weights, KV cache, concurrency), without a GPU.

    parameters           = all of them, and those one token computes with (a mixture of experts:
                           its top-k experts' share of the experts' parameters)
    GPUs                 = tensor_parallel_size x pipeline_parallel_size (stages of contiguous
                           layers, each on its own tensor-parallel GPUs)
    weights per GPU      = every parameter of the architecture's table (jaxpaged.config.architectures),
                           split over the tensor-parallel GPUs by the engine's sharding rules
                           (jaxpaged.parallel.sharding: heads, MLP width, vocabulary); under
                           pipeline parallelism a GPU holds its stage's layer slots (the longest
                           stage's layers: every stage runs the same program) and, on every
                           stage, the embedding, final norm and LM head; with
                           --quantization fp8/int8 the decoder's matrices take 1 byte per weight
                           plus a float32 scale per output channel; int4: half a byte per weight
                           plus a float32 scale and an int8 zero point per group of
                           --quantization-group-size inputs (awq/gptq on a config without a
                           quantization_config, e.g. a preset: the same, as the engine holds
                           a 4-bit checkpoint of that format)
    KV bytes per token   = 2 x layers (a stage's slots) x KV heads per GPU x head_dim x KV dtype bytes
    KV pool per GPU      = GPU memory x gpu_memory_utilization - weights per GPU
    max concurrency      = pool blocks / blocks of one request of `context` tokens

The options are resolved by the engine's own resolver (`EngineConfig.for_shapes`: the same
checks, the same errors as `jaxpaged serve`), and the pool arithmetic is the engine's own
(`jaxpaged.planning.memory.plan_kv_cache`): `plan` is the two and a report. The engine also
subtracts the largest compiled step's activations, which only a compile can measure, so leave
headroom in `gpu_memory_utilization`.
"""

import json
import math

from jaxpaged.config import defaults
from jaxpaged.config.checks import check_choice
from jaxpaged.config.lora import pool_bytes as lora_pool_bytes
from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token
from jaxpaged.config.params.tables import state_params, state_shapes
from jaxpaged.config.presets import load_config_dict
from jaxpaged.config.quantization import (
    DEFAULT_GROUP_SIZE,
    DTYPE_BYTES,
    KV_CACHE_DTYPES,
    QUANTIZED_WEIGHT_DTYPES,
    checkpoint_quantization,
    group_dtypes,
)
from jaxpaged.engine_config import EngineConfig
from jaxpaged.parallel.pipeline import PipelineLayout
from jaxpaged.parallel.sharding import TensorParallelLayout
from jaxpaged.planning.memory import format_bytes, plan_kv_cache

MODEL_DTYPES = ("float32", "bfloat16", "float16")
# 4-bit checkpoint formats `plan` sizes for a config not stored in them (a preset): as int4.
PLANNED_AS_INT4 = ("awq", "gptq")
# What `--kv-cache-dtype` takes: the engine's names, and a plain dtype to plan for.
PLAN_KV_CACHE_DTYPES = (*KV_CACHE_DTYPES, *MODEL_DTYPES)


def count_parameters(
    config: ModelConfig,
    tensor_parallel_size: int = 1,
    pipeline: PipelineLayout | None = None,
    expert_parallel: bool = False,
) -> tuple[int, int]:
    """`(total, per GPU)` parameter counts of `Llama(config)`, split by the sharding table (on
    the fullest GPU: its stage's `pipeline.max_layers` layer slots; None: one stage).

    Raises:
      TensorParallelError: the model does not split over `tensor_parallel_size` GPUs.
    """
    shapes = state_shapes(config)
    layout = TensorParallelLayout(config, tensor_parallel_size, expert_parallel, pipeline)
    return sum(math.prod(s) for s in shapes.values()), layout.device_elements(shapes)


def count_active_parameters(config: ModelConfig) -> int:
    """Parameters one token computes with: all of a dense model's; of a mixture of experts, its
    `top_k` experts' share of the experts' parameters and everything else."""
    total = sum(math.prod(s) for s in state_shapes(config).values())
    if config.moe is None:
        return total
    shapes = state_shapes(config)
    experts = sum(math.prod(shapes[path]) for path, p in state_params(config).items() if p.spec.per_expert)
    return total - experts * (config.moe.num_experts - config.moe.top_k) // config.moe.num_experts


def weight_bytes_per_gpu(
    config: ModelConfig,
    dtype: str,
    quantization: str | None,
    tensor_parallel_size: int,
    expert_parallel: bool = False,
    pipeline: PipelineLayout | None = None,
) -> int:
    """Bytes of the parameters on the fullest GPU: `dtype` each, quantized weights 1 byte and
    their scales float32, or group-quantized (`config.weight_group_size`) their codes'
    bits, float32 scales and int8 zero points (split by the sharding table like their weights,
    whole experts per device with `expert_parallel`; of the layers, a `pipeline` stage's slots,
    None: one stage)."""
    layout = TensorParallelLayout(config, tensor_parallel_size, expert_parallel, pipeline)
    element = {"plain": DTYPE_BYTES[dtype], "scale": DTYPE_BYTES["float32"]}
    if config.weight_group_size is not None:
        element |= {role: DTYPE_BYTES[dtype] for role, dtype in group_dtypes(config.weight_bits).items()}
    elif quantization is not None:
        element["quant"] = DTYPE_BYTES[QUANTIZED_WEIGHT_DTYPES[quantization]]
    roles = {path: p.role for path, p in state_params(config, quantization is not None).items()}
    shapes = state_shapes(config, quantization)
    return int(sum(layout.device_elements({path: shape}) * element[roles[path]] for path, shape in shapes.items()))


def make_plan(
    model: str,
    *,
    gpu_memory: int,
    context: int | None = None,
    gpu_memory_utilization: float = defaults.GPU_MEMORY_UTILIZATION,
    tensor_parallel_size: int = defaults.TENSOR_PARALLEL_SIZE,
    pipeline_parallel_size: int = defaults.PIPELINE_PARALLEL_SIZE,
    pp_layer_partition: str | None = None,
    enable_expert_parallel: bool = False,
    dtype: str = defaults.DTYPE,
    kv_cache_dtype: str = defaults.KV_CACHE_DTYPE,
    quantization: str | None = None,
    quantization_group_size: int = DEFAULT_GROUP_SIZE,
    block_size: int = defaults.BLOCK_SIZE,
    enable_lora: bool = False,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    suggest: bool = True,
) -> dict:
    """The plan as a JSON-ready dict (bytes are per GPU unless the key says `_all_gpus`).

    Args:
      pp_layer_partition: layers per pipeline stage as `--pp-layer-partition` takes them
        ("20,12"); None: balanced.
      enable_lora, max_loras, max_lora_rank: a LoRA adapter pool of `max_loras` slots of rank
        `max_lora_rank` (whole on every GPU, in the model's dtype) beside the weights.
      suggest: when the model does not fit, say in the note which layout on more GPUs does.

    Raises:
      ValueError: an unknown model, dtype, memory size, or a context over the model's limit; a
        split the model does not take (`TensorParallelError`, `PipelineParallelError`).
    """
    name, raw = load_config_dict(model)  # (the report's names and the 4-bit what-if below)
    check_choice("kv_cache_dtype", kv_cache_dtype, PLAN_KV_CACHE_DTYPES)
    # A 4-bit checkpoint format named for a config without its quantization_config (a preset:
    # "how much does 70B-AWQ need") is counted as the engine holds such a checkpoint: int4 codes
    # with a scale and a zero point per group of --quantization-group-size inputs.
    held_as = quantization
    if quantization in PLANNED_AS_INT4 and checkpoint_quantization(raw) is None:
        held_as = "int4"
    engine = EngineConfig.for_shapes(
        model,
        context_flag="context",
        max_model_len=context,
        dtype=dtype,
        kv_cache_dtype="auto" if kv_cache_dtype in MODEL_DTYPES else kv_cache_dtype,
        quantization=held_as,
        quantization_group_size=quantization_group_size,
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        pp_layer_partition=pp_layer_partition,
        enable_expert_parallel=enable_expert_parallel,
        block_size=block_size,
        gpu_memory_utilization=gpu_memory_utilization,
        **(dict(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank) if enable_lora else {}),
    )
    config, context, held_as = engine.model, engine.max_model_len, engine.load.quantization
    if dtype == "auto":
        dtype = engine.load.checkpoint.dtype or "float32"
        if dtype not in MODEL_DTYPES:
            raise ValueError(
                f"the checkpoint's dtype {dtype!r} is not supported; give `dtype` ({', '.join(MODEL_DTYPES)})"
            )
    named = quantization if held_as == "int4" and quantization in PLANNED_AS_INT4 else held_as
    kv_dtype = kv_cache_dtype if kv_cache_dtype in MODEL_DTYPES else engine.cache.kv_dtype(dtype)
    tp, ep, pipeline = tensor_parallel_size, enable_expert_parallel, engine.layout.pipeline
    total_params, _ = count_parameters(config, tp, pipeline, ep)
    weights = weight_bytes_per_gpu(config, dtype, held_as, tp, ep, pipeline)
    lora = engine.lora
    adapters = 0
    if lora.enable_lora:  # (as the engine's start-up plan counts it)
        adapters = lora_pool_bytes(engine.layout.mesh_config, lora.max_loras, lora.max_lora_rank, DTYPE_BYTES[dtype])
    device_config = engine.layout.device_config
    per_token = kv_bytes_per_token(device_config, DTYPE_BYTES[kv_dtype])
    report = {
        "model": name,
        "architecture": raw["architectures"][0],
        "num_parameters": total_params,
        "num_active_parameters": count_active_parameters(config),
        "dtype": dtype,
        "quantization": named,
        "weight_bits": config.weight_bits,
        "weight_group_size": config.weight_group_size,
        "kv_cache_dtype": kv_dtype,
        "tensor_parallel_size": tp,
        "enable_expert_parallel": ep,
        "pipeline_parallel_size": pipeline.size,
        "layers_per_stage": list(pipeline.layers_per_stage),
        "num_gpus": tp * pipeline.size,
        "gpu_memory_bytes": gpu_memory,
        "gpu_memory_utilization": gpu_memory_utilization,
        "context": context,
        "block_size": block_size,
        "weight_bytes_per_gpu": weights,
        "lora_pool_bytes_per_gpu": adapters,
        "kv_bytes_per_token": per_token,
        "kv_bytes_per_token_all_gpus": kv_bytes_per_token(config, DTYPE_BYTES[kv_dtype]),
        "kv_bytes_per_request": per_token * context,
        "kv_heads_per_gpu": device_config.num_kv_heads,
    }
    try:
        plan = plan_kv_cache(
            device_config,
            dtype_bytes=DTYPE_BYTES[kv_dtype],
            block_size=block_size,
            max_model_len=context,
            device_memory_bytes=gpu_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            weight_bytes=weights + adapters,
        )
    except ValueError:
        budget = int(gpu_memory * gpu_memory_utilization) - weights - adapters
        note = (
            f"weights take {format_bytes(weights)}"
            + (f" and the LoRA adapter pool {format_bytes(adapters)}" if adapters else "")
            + f" of the {format_bytes(int(gpu_memory * gpu_memory_utilization))} "
            f"that --gpu-memory-utilization {gpu_memory_utilization} allows per GPU, leaving "
            f"{format_bytes(max(budget, 0))} for the KV cache; one request of --context {context} needs "
            f"{format_bytes(per_token * context)}"
        )
        options = dict(
            gpu_memory=gpu_memory,
            context=context,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_expert_parallel=ep,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            quantization=quantization,
            block_size=block_size,
            enable_lora=enable_lora,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
        )
        if suggest:
            fitting = next(((t, p) for t, p in _larger_layouts(tp, pipeline.size) if _fits(model, t, p, options)), None)
            if fitting is not None:
                t, p = fitting
                note += f"; --tensor-parallel-size {t}" + (f" --pipeline-parallel-size {p}" if p > 1 else "") + " fits"
        report.update(
            fits=False, kv_pool_bytes_per_gpu=0, kv_cache_blocks=0, pool_tokens=0, max_concurrency=0.0, note=note
        )
        return report
    report.update(
        fits=True,
        kv_pool_bytes_per_gpu=plan.pool_bytes,
        kv_cache_blocks=plan.num_blocks - 1,
        pool_tokens=plan.num_tokens,
        max_concurrency=round(plan.max_concurrency, 2),
        note="activation memory and the per-sequence state (penalty tables: max_num_seqs x vocabulary x 5 bytes) "
        "are not counted (the engine measures and counts them at start-up); leave headroom",
    )
    return report


# GPUs of one machine: tensor parallelism's all-reduces want its fast interconnect, so a layout
# that needs more GPUs adds pipeline stages (a stage per machine) rather than widening TP.
GPUS_PER_NODE = 8


def _larger_layouts(tp: int, pp: int):
    """`(tensor_parallel_size, pipeline_parallel_size)` layouts on more GPUs than `tp x pp`
    (neither size lowered), fewest GPUs first (at most 64); of equal GPUs, the widest tensor
    parallelism up to a machine's `GPUS_PER_NODE` (or `tp`) first."""
    for gpus in (2, 4, 8, 16, 32, 64):
        if gpus <= tp * pp:
            continue
        t = min(gpus, max(tp, GPUS_PER_NODE))
        while t >= tp:
            if gpus % t == 0 and gpus // t >= pp:
                yield t, gpus // t
            t //= 2


def _fits(model: str, tensor_parallel_size: int, pipeline_parallel_size: int, options: dict) -> bool:
    try:
        return make_plan(
            model,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            suggest=False,
            **options,
        )["fits"]
    except ValueError:  # e.g. the heads do not split over that many GPUs
        return False


def _active(r: dict) -> str:
    active = r["num_active_parameters"]
    return "" if active == r["num_parameters"] else f" ({active:,} active per token)"


def _size(n: int) -> str:
    return f"{n:,} B" + (f" ({format_bytes(n)})" if n >= 2**10 else "")


def _quantization_row(r: dict) -> str:
    if r["weight_group_size"] is not None:
        return f"{r['quantization']} ({r['weight_bits']}-bit, groups of {r['weight_group_size']})"
    return r["quantization"] or "none"


def _experts(r: dict) -> str:
    return ", whole experts per GPU (expert parallel)" if r["enable_expert_parallel"] else ""


def _stages(r: dict) -> str:
    pp, layers = r["pipeline_parallel_size"], r["layers_per_stage"]
    if pp == 1:
        return f"1 stage of {layers[0]} layers; {r['num_gpus']} GPU(s) in all"
    split = " + ".join(map(str, layers))
    return f"{pp} stages of {split} layers; {r['tensor_parallel_size']} x {pp} = {r['num_gpus']} GPUs in all"


def format_plan(r: dict) -> str:
    """The plan as an aligned, human-readable table."""
    tp = r["tensor_parallel_size"]
    rows = [
        ("model", f"{r['model']} [{r['architecture']}]"),
        ("parameters", f"{r['num_parameters']:,}" + _active(r)),
        ("dtype / KV cache dtype", f"{r['dtype']} / {r['kv_cache_dtype']}"),
        ("weight quantization", _quantization_row(r)),
        ("tensor parallel", f"{tp} GPU(s) per stage, {r['kv_heads_per_gpu']} KV head(s) per GPU" + _experts(r)),
        ("pipeline parallel", _stages(r)),
        ("GPU memory x utilization", f"{_size(r['gpu_memory_bytes'])} x {r['gpu_memory_utilization']}"),
        ("weights per GPU", _size(r["weight_bytes_per_gpu"])),
        *([("LoRA adapter pool per GPU", _size(r["lora_pool_bytes_per_gpu"]))] if r["lora_pool_bytes_per_gpu"] else []),
        (
            "KV bytes per token per GPU",
            _size(r["kv_bytes_per_token"])
            + (f"  (all GPUs: {r['kv_bytes_per_token_all_gpus']:,} B)" if r["num_gpus"] > 1 else ""),
        ),
        (f"KV per request ({r['context']:,} tokens) per GPU", _size(r["kv_bytes_per_request"])),
        ("KV pool per GPU", _size(r["kv_pool_bytes_per_gpu"])),
        ("pool tokens", f"{r['pool_tokens']:,} ({r['kv_cache_blocks']:,} blocks of {r['block_size']})"),
        (f"max concurrency at {r['context']:,}", f"{r['max_concurrency']:.2f} requests"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append(("" if r["fits"] else "DOES NOT FIT: ") + r["note"])
    return "\n".join(lines)


def run(args) -> int:
    """`jaxpaged plan` with parsed arguments; prints the table or (with --json) JSON.

    Returns:
      0 when the model fits, 1 when it does not (the report says what would).
    """
    report = make_plan(
        args.model,
        gpu_memory=args.gpu_memory,
        context=args.context,
        gpu_memory_utilization=args.gpu_memory_utilization,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        pp_layer_partition=args.pp_layer_partition,
        enable_expert_parallel=args.enable_expert_parallel,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        block_size=args.block_size,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0 if report["fits"] else 1
