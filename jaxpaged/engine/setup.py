"""Engine start-up: the model (loaded or dummy) on its mesh, the context limit, stop tokens and
the KV plan (per device: every number here is one device's share)."""

import dataclasses
import hashlib
import json
import logging
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpaged.checkpoint.dummy import dummy_params
from jaxpaged.checkpoint.format import TOKENIZER_FILES
from jaxpaged.checkpoint.kv_scales import checkpoint_kv_scales
from jaxpaged.checkpoint.loader import load_checkpoint, resolve_dtype
from jaxpaged.config.checks import OptionError
from jaxpaged.config.lora import pool_bytes
from jaxpaged.config.model_config import ModelConfig, kv_bytes_per_token
from jaxpaged.config.quantization import is_fp8
from jaxpaged.config.sections import LoadConfig
from jaxpaged.core.disk_tier import DiskTier
from jaxpaged.engine_args import EngineArgsError, default_compilation_cache_dir
from jaxpaged.engine_config import EngineConfig
from jaxpaged.model import Llama, kv_storage_dtype
from jaxpaged.parallel import multihost
from jaxpaged.parallel.mesh import TensorParallel, bytes_per_device, make_mesh
from jaxpaged.parallel.sharding import TensorParallelError, TensorParallelLayout
from jaxpaged.planning.memory import GiB, KVCachePlan, format_bytes, plan_kv_cache, sequence_state_bytes
from jaxpaged.planning.plan import weight_bytes_per_gpu
from jaxpaged.worker.draft_runner import DraftRunner, draft_engine_config
from jaxpaged.worker.model_runner import ModelRunner
from jaxpaged.worker.pipelined_runner import PipelinedRunner
from jaxpaged.worker.step_programs import Program

logger = logging.getLogger("jaxpaged")

# Without a device memory figure (CPU), the pool gets at most this share of the machine's memory.
CPU_KV_CACHE_SHARE = 0.25
# Temporaries may differ this much between the probe and the real programs (alignment, scalars).
TEMP_SLACK_BYTES = 1 << 20


@dataclasses.dataclass
class DeviceWorker:
    """Everything on the devices, started: the model on its mesh, the sized pool, the compiled
    step programs.

    Attributes:
      config: the engine's configuration, with the planned pool size.
      parallel: the mesh and sharding table.
      plan: the KV plan (per device; the same on every process).
      runner: the warmed-up runner; on the leader of several processes its `channel` sends each
        step to the followers.
      compile_seconds: how long warm-up compiled (the draft model's programs included).
      draft: the draft model's runner (speculative decoding with a draft model), or None.
    """

    config: EngineConfig
    parallel: TensorParallel
    plan: KVCachePlan
    runner: ModelRunner
    compile_seconds: float
    draft: DraftRunner | None = None


def start_device_worker(
    config: EngineConfig,
    eos_token_ids: frozenset[int] = frozenset(),
    devices: list | None = None,
    abstract: bool = False,
) -> DeviceWorker:
    """Joins the other processes (with nnodes > 1), builds the mesh, loads the model onto it,
    plans the pool, and compiles every step program (`eos_token_ids`: banned before a request's
    `min_tokens`; followers, which pack nothing, need none).

    `devices`: the mesh's devices (default: this process's). With `abstract` the same start-up
    runs on shapes alone: the model is made of shapes, nothing is loaded or allocated, the pool is
    `kv_cache_memory_bytes`, and every program is compiled, e.g. for GPUs described for deviceless
    compilation (`jaxpaged.bench.gpu_targets`: `jaxpaged bench startup --target`,
    tests/gpu_compile); the runner runs nothing.

    Raises:
      EngineArgsError: `abstract` without `kv_cache_memory_bytes` (no memory to size the pool from),
        fewer devices than `tensor_parallel_size`, or processes started with different settings.
    """
    worker = prepare_device_worker(config, eos_token_ids, devices, abstract)
    runner, draft, plan, threads = worker.runner, worker.draft, worker.plan, worker.config.compile.compile_threads
    seconds = runner.warm_up(threads)
    check_step_memory(plan, runner.temp_bytes)
    if draft is not None:
        seconds += draft.warm_up(threads)
        check_step_memory(plan, draft.temp_bytes)  # run one after another: each within the reserve
    if jax.process_count() > 1 and multihost.is_leader():
        runner.channel = multihost.StepChannel()  # from now on every device call is announced
    return dataclasses.replace(worker, compile_seconds=seconds)


def prepare_device_worker(
    config: EngineConfig,
    eos_token_ids: frozenset[int] = frozenset(),
    devices: list | None = None,
    abstract: bool = False,
    device_memory: int | None = None,
) -> DeviceWorker:
    """`start_device_worker` up to compiling: the model on its mesh, the planned pool, the runners
    (their programs not compiled yet; `compile_seconds` 0). `device_memory`: one device's total
    memory for the batch limits where the devices cannot tell it (a described GPU's published
    figure); default read from the allocator."""
    if abstract and config.cache.kv_cache_memory_bytes is None:
        raise EngineArgsError("kv_cache_memory_bytes", None, "an engine of shapes needs the pool's size")
    p = config.parallel
    multihost.initialize(p.nnodes, p.node_rank, p.master_addr, p.master_port)
    try:
        seed = multihost.agree_on_settings(config.shared_settings(), config.load.seed)
    except multihost.SettingsMismatchError as err:
        raise EngineArgsError(err.setting, err.value, err.reason) from None
    if seed != config.load.seed:  # the leader's (a follower's own only seeds dummy weights, which must match)
        logger.info("engine seed: %d (process 0's)", seed)
        config = config.with_seed(seed)
    use_compilation_cache(config.compile.compilation_cache_dir)
    parallel = engine_mesh(config, devices)
    config = with_device_batch_limits(config, parallel, device_memory)
    if not abstract:
        check_host_memory(config, parallel)
    model = build_model(config, parallel, abstract)
    draft_model, draft_parallel = build_draft_model(config, parallel, abstract)
    plan = plan_cache(config, model, parallel, draft=draft_model)
    agreed = multihost.agree_on_blocks(plan.num_blocks)
    if agreed != plan.num_blocks:
        plan = dataclasses.replace(
            plan,
            num_blocks=agreed,
            pool_bytes=agreed * plan.bytes_per_token * plan.block_size,
            sized_from=plan.sized_from + " (the smallest of all processes)",
        )
    logger.info(plan.summary())
    config = config.with_blocks(plan.num_blocks, host_tier_blocks(config, model, parallel))
    logger.info("preemption by %s", config.cache.resolved_preemption_mode)
    kv_scales = None if abstract else fp8_kv_scales(config, model.dtype)
    runner_type = PipelinedRunner if config.layout.pipeline.size > 1 else ModelRunner  # one tick a step
    runner = runner_type(model, parallel=parallel, config=config, kv_scales=kv_scales, eos_token_ids=eos_token_ids)
    draft = None
    if draft_model is not None:
        draft = runner.draft = DraftRunner(
            draft_model, parallel=draft_parallel, config=draft_engine_config(config, draft_parallel.layout)
        )
        logger.info(
            "draft model %s: %d layers, proposing %d tokens a step",
            config.speculative.model,
            draft.config.num_layers,
            draft.num_proposals,
        )
    return DeviceWorker(config, parallel, plan, runner, 0.0, draft)


def engine_mesh(config: EngineConfig, devices: list | None = None) -> TensorParallel:
    """The engine's mesh of `devices` (default: every process's) and its sharding table.

    Raises:
      EngineArgsError: fewer devices than `tensor_parallel_size` (x `pipeline_parallel_size`),
        naming how many there are.
    """
    tp, pp = config.layout.size, config.layout.pipeline.size
    try:
        return TensorParallel(config.layout, make_mesh(tp, devices, pp))
    except TensorParallelError as err:  # too few devices: "... needs N devices, but JAX sees M (...)"
        needs = "needs " + str(err).split(" needs ", 1)[1]
        if pp == 1:
            raise EngineArgsError("tensor_parallel_size", tp, needs) from None
        raise EngineArgsError(
            "pipeline_parallel_size",
            pp,
            f"tensor_parallel_size x pipeline_parallel_size = {tp} x {pp} {needs}; lower them, or add machines "
            "(`nnodes`: a stage per machine)",
        ) from None


def check_engine_fits(config: EngineConfig) -> None:
    """What start-up checks on this machine before it allocates anything, for a caller that wants
    the answer before the engine is built (`jaxpaged serve`: in the engine's process, or before the
    engine's thread starts): enough devices for `tensor_parallel_size` and, on a CPU, enough host
    memory.
    With several processes (`nnodes` > 1) the devices are only known once they have met: nothing
    is checked.

    Raises:
      EngineArgsError: naming the option.
    """
    if config.parallel.nnodes == 1:
        parallel = engine_mesh(config)
        check_host_memory(with_device_batch_limits(config, parallel, log=False), parallel)


def with_device_batch_limits(
    config: EngineConfig, parallel: TensorParallel, memory_bytes: int | None = None, log: bool = True
) -> EngineConfig:
    """`config` with the batch limits it leaves unset filled with vLLM's defaults for the mesh's
    devices (their kind and total memory: `memory_bytes` where given, e.g. a described GPU's
    published figure, else `device_total_memory_bytes`), logged (with `log`) when any was filled.

    Raises:
      EngineArgsError: the limits do not fit together (naming `max_num_batched_tokens`).
    """
    device = parallel.mesh.devices.flat[0]
    memory = memory_bytes if memory_bytes is not None else device_total_memory_bytes(parallel)
    s = config.scheduling
    try:
        resolved = config.with_batch_limits(parallel.platform, device.device_kind, memory)
    except OptionError as err:
        raise EngineArgsError(err.field, err.value, err.reason) from None
    r = resolved.scheduling
    if log and None in (s.max_num_seqs, s.max_num_batched_tokens):
        size = "" if memory is None else f", {format_bytes(memory)}"
        logger.info(
            "batch limits: max_num_seqs=%d, max_num_batched_tokens=%d (defaults for %s%s, %s)",
            r.max_num_seqs,
            r.max_num_batched_tokens,
            device.device_kind,
            size,
            s.usage_context,
        )
    return resolved


def device_total_memory_bytes(parallel: TensorParallel) -> int | None:
    """One device's total memory, as vLLM reads it for its batch limits: on a GPU the allocator's
    limit over its fraction (XLA_PYTHON_CLIENT_MEM_FRACTION); None on a CPU (and for described
    GPUs, which have no allocator)."""
    if parallel.platform == "cpu":
        return None
    try:
        limit = device_memory_bytes(parallel)
    except jax.errors.JaxRuntimeError:  # a described GPU (deviceless compilation): no memory stats
        return None
    return None if limit is None else int(limit / allocator_fraction())


def allocator_fraction() -> float:
    """The share of a GPU's memory JAX's allocator takes (see jaxpaged/__init__.py)."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def build_draft_model(
    config: EngineConfig, parallel: TensorParallel, abstract: bool = False
) -> tuple[Llama | None, TensorParallel | None]:
    """The draft model of speculative decoding (None without one), loaded like the target (or
    dummy weights with `load_format` dummy) onto the same devices, split by its own layout."""
    draft = config.draft
    if draft is None:
        return None, None
    draft_parallel = TensorParallel(TensorParallelLayout(draft.model, config.layout.size), parallel.mesh)
    load = dataclasses.replace(config.load, model=draft.path, quantization=None, checkpoint=draft.checkpoint)
    draft_engine = dataclasses.replace(
        config, model=draft.model, layout=draft_parallel.layout, load=load, speculative=None, draft=None
    )
    return build_model(draft_engine, draft_parallel, abstract), draft_parallel


def host_tier_blocks(config: EngineConfig, model: Llama, parallel: TensorParallel) -> int:
    """Blocks of the host tier that `kv_offloading_size` GiB hold (0 without one); logged.

    A host block holds K and V of every layer and every kv head of the mesh (under tensor
    parallelism each device offloads its own heads into it)."""
    cache = config.cache
    if cache.kv_offloading_size is None:
        return 0
    dtype_bytes = kv_element_bytes(config, model, parallel)
    per_block = kv_bytes_per_token(parallel.layout.mesh_config, dtype_bytes) * cache.block_size
    num_blocks = int(cache.kv_offloading_size * GiB) // per_block
    if num_blocks < 1:
        raise EngineArgsError(
            "kv_offloading_size",
            cache.kv_offloading_size,
            f"holds no block of {format_bytes(per_block)}; give at least {per_block / GiB:.6f}",
        )
    logger.info(
        "host KV tier: %d blocks x %d tokens = %d tokens (%s of host memory)",
        num_blocks,
        cache.block_size,
        num_blocks * cache.block_size,
        format_bytes(num_blocks * per_block),
    )
    return num_blocks


def fp8_kv_scales(config: EngineConfig, model_dtype) -> tuple | None:
    """An fp8 KV cache's scales: the checkpoint's when it has them (logged), else None (1)."""
    load = config.load
    if not is_fp8(config.cache.kv_dtype(model_dtype)):
        return None
    scales = None if load.load_format == "dummy" else checkpoint_kv_scales(load.model, config.model.num_layers)
    logger.info(
        "fp8 KV cache scales: %s", "the checkpoint's, per layer" if scales is not None else "1 (no checkpoint scales)"
    )
    return scales


def kv_element_bytes(config: EngineConfig, model: Llama, parallel: TensorParallel) -> int:
    """Bytes one element of the KV pool takes on the devices (its storage dtype's)."""
    return kv_storage_dtype(config.cache.kv_dtype(model.dtype), parallel.platform).itemsize


def start_disk_tier(config: EngineConfig, runner: ModelRunner) -> DiskTier | None:
    """The disk tier in `kv_cache_dir` (None without one), over the host tier's memory; logged."""
    cache = config.cache
    if cache.kv_cache_dir is None:
        return None
    memory = runner.kv_transfer.host
    fingerprint = kv_fingerprint(config, f"{runner.params_dtype}/{runner.kv_dtype}", memory, runner.parallel.platform)
    disk = DiskTier(cache.kv_cache_dir, fingerprint, int(cache.kv_cache_dir_size * GiB), memory)
    logger.info(
        "disk KV tier: %s, up to %s (%d blocks of %s), %d blocks there now",
        disk.directory,
        format_bytes(disk.capacity_bytes),
        disk.capacity_bytes // disk.file_bytes,
        format_bytes(disk.file_bytes),
        disk.num_files,
    )
    return disk


def kv_fingerprint(config: EngineConfig, dtype: str, memory, platform: str) -> bytes:
    """What a block's K/V bytes depend on: the model's configuration, its weights' identity, the
    dtypes (the model's / the KV cache's), the platform (its matmul precision), the block size and
    a host block's layout, and what changes the programs computing them (tensor-parallel size,
    pipeline stages, attention backend, layer scan, weight quantization)."""
    load = config.load
    identity = {
        "format": 1,
        "model": dataclasses.asdict(config.model),
        "weights": weights_identity(load),
        "dtype": dtype,
        "storage": memory.dtype.name,
        "block": list(memory.shape[1:]),
        "platform": platform,
        "block_size": config.cache.block_size,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "pipeline_stages": list(config.layout.pipeline.layers_per_stage),  # which layer each pool slot holds
        "attention_backend": load.attention_backend,
        "scan_layers": load.scan_layers,
        "quantization": load.quantization,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).digest()


def weights_identity(load: LoadConfig) -> dict:
    """The weights as a cache can tell them apart without reading them: the dummy weights' seed,
    or every file of the model directory but the tokenizer's, with its size and modification time."""
    if load.load_format == "dummy":
        return {"dummy_seed": load.seed}
    files = []
    for root, _, names in os.walk(load.model):
        for name in sorted(names):
            if name in TOKENIZER_FILES:
                continue
            stat = os.stat(os.path.join(root, name))
            files.append((os.path.relpath(os.path.join(root, name), load.model), stat.st_size, stat.st_mtime_ns))
    return {"files": sorted(files)}


def use_compilation_cache(setting: str) -> str | None:
    """Turns JAX's persistent compilation cache on (every program, however quick to compile) in
    the directory `compilation_cache_dir` names; returns it (None: "none", off)."""
    from jax.experimental.compilation_cache import compilation_cache

    if setting == "none":
        directory = None
    elif setting == "auto":
        directory = jax.config.jax_compilation_cache_dir or default_compilation_cache_dir()
    else:
        directory = setting
    jax.config.update("jax_compilation_cache_dir", directory)
    if directory is not None:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        logger.info("compilation cache: %s", directory)
    compilation_cache.reset_cache()  # JAX decides once whether to use a cache: ask again
    return directory


def build_model(config: EngineConfig, parallel: TensorParallel, abstract: bool = False) -> Llama:
    """Loads (or, with load_format="dummy", randomly initialises) the model onto its mesh, in
    the mesh layout; for unrolled layers, its layers' weights as per-layer arrays from the start.
    `abstract`: the model's shapes only (`nnx.eval_shape`)."""
    load, model_config = config.load, config.model
    if abstract:
        return _abstract_model(load, model_dtype(config), parallel)
    if load.load_format == "dummy":
        model = _dummy_model(model_config, model_dtype(config), load, parallel)
    else:
        model = load_checkpoint(
            load.model,
            model_config,
            load.checkpoint,
            load.dtype,
            attention=load.attention_backend,
            parallel=parallel,
            scan_layers=load.scan_layers,
            quantization=load.quantization,
        )
    logger.info(
        "model %s: %s, %d layers, dtype %s%s, KV cache %s",
        load.model,
        model_config.architecture,
        model_config.num_layers,
        model.dtype,
        f", {load.quantization} weights" if load.quantization else "",
        config.cache.kv_dtype(model.dtype),
    )
    return model


def model_dtype(config: EngineConfig) -> jnp.dtype:
    """The model's dtype: `dtype`, or with "auto" the config's (float32 if it names none)."""
    return jnp.dtype(resolve_dtype(config.load.dtype, config.load.checkpoint.dtype))


def _abstract_model(load: LoadConfig, dtype, parallel: TensorParallel) -> Llama:
    """The model in its mesh layout, as shapes only (`nnx.eval_shape`)."""
    return nnx.eval_shape(
        lambda: Llama(
            parallel.layout.mesh_config,
            dtype,
            rngs=nnx.Rngs(0),
            attention=load.attention_backend,
            parallel=parallel,
            scan_layers=load.scan_layers,
            quantization=load.quantization,
        )
    )


def _dummy_model(config: ModelConfig, dtype, load: LoadConfig, parallel: TensorParallel) -> Llama:
    """Random weights of the checkpoint's shapes (the same values for every tensor-parallel size),
    quantized with `load.quantization`, made on the mesh a decoder layer at a time, each array
    straight into its sharding (`jaxpaged.checkpoint.dummy`)."""
    graphdef, state = nnx.split(_abstract_model(load, dtype, parallel))
    params = nnx.to_pure_dict(state)
    for path, value in dummy_params(config, dtype, load, parallel).items():
        tree = params
        for key in path[:-1]:
            tree = tree[key]
        tree[path[-1]] = value
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)


# transformers' lazy first import is not thread-safe: two threads importing it at once (the output
# threads of two data-parallel replicas) can see a half-built module ("cannot import name
# 'AutoTokenizer'"). Tokenizers load one at a time.
_TOKENIZER_LOCK = threading.Lock()


def load_tokenizer(tokenizer_dir: str):
    """The checkpoint's tokenizer (transformers' AutoTokenizer). transformers is imported here, not
    at the top: it imports torch where torch is installed (seconds), which an engine without a
    tokenizer (`skip_tokenizer_init`, token-id prompts) never needs. Thread-safe."""
    with _TOKENIZER_LOCK:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)


def eos_token_ids(config: EngineConfig, tokenizer) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer (vLLM stops at any)."""
    ids = set(config.model.eos_token_ids)
    path = os.path.join(config.load.model, "generation_config.json")
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


def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int:
    """Memory this process can still take: the kernel's MemAvailable, or less where a cgroup v2
    limit (a container's) leaves less; the physical memory where neither can be read."""
    available = host_memory_bytes()
    if os.path.isfile(meminfo):
        with open(meminfo) as f:
            found = [line.split()[1] for line in f if line.startswith("MemAvailable:")]
        available = int(found[0]) * 1024 if found else available
    limit, current = os.path.join(cgroup, "memory.max"), os.path.join(cgroup, "memory.current")
    if os.path.isfile(limit) and os.path.isfile(current):
        with open(limit) as f, open(current) as g:
            text, used = f.read().strip(), int(g.read())
        if text != "max":
            available = min(available, int(text) - used)
    return available


def check_host_memory(config: EngineConfig, parallel: TensorParallel, available: int | None = None) -> None:
    """On a CPU, whose devices' memory is this machine's: refuses an engine whose weights, KV pool
    and host tier need more memory than is available, before anything is allocated.

    Counted: each of this process's devices' share of the weights (a draft model's too) and its
    pool (`kv_cache_memory_bytes`, or sized from the job as `plan_cache` sizes it), and the host
    tier; the step programs' temporaries come on top.

    Args:
      available: the bytes available (default `host_available_bytes()`).

    Raises:
      EngineArgsError: naming the bytes needed and available and the options that lower them.
    """
    if parallel.platform != "cpu":
        return
    load, cache, n = config.load, config.cache, parallel.size
    devices = sum(d.process_index == jax.process_index() for d in parallel.mesh.devices.flat)
    dtype = model_dtype(config)
    weights = devices * weight_bytes_per_gpu(
        config.model, dtype.name, load.quantization, n, config.layout.expert_parallel, config.layout.pipeline
    )
    if config.draft is not None:
        draft_dtype = jnp.dtype(resolve_dtype(load.dtype, config.draft.checkpoint.dtype)).name
        weights += devices * weight_bytes_per_gpu(config.draft.model, draft_dtype, None, n)
    pool = cache.kv_cache_memory_bytes
    if pool is None:
        element = kv_storage_dtype(cache.kv_dtype(dtype), parallel.platform).itemsize
        budget = _cpu_budget(
            cache.block_size,
            config.scheduling.max_num_seqs,
            parallel.layout.device_config,
            element,
            config.max_model_len,
        )
        pool = budget["kv_cache_memory_bytes"]
    host_tier = int(cache.kv_offloading_size * GiB) if cache.kv_offloading_size is not None else 0
    needed = weights + devices * pool + host_tier
    available = host_available_bytes() if available is None else available
    if needed <= available:
        return
    tier = f", host KV tier {format_bytes(host_tier)}" if host_tier else ""
    quantized = f", {load.quantization}" if load.quantization else ""
    if weights > available:
        fix = "quantize the weights (`quantization` int8: 1 byte each) or use a machine with more memory"
    else:
        fix = "lower `kv_cache_memory_bytes` (or `max_model_len`, `max_num_seqs`, `kv_offloading_size`)"
    raise EngineArgsError(
        "model",
        load.model,
        f"needs at least {format_bytes(needed)} of this machine's memory on the CPU (weights "
        f"{format_bytes(weights)} in {dtype.name}{quantized}, KV cache {format_bytes(pool)} x {devices} "
        f"device(s){tier}) but {format_bytes(available)} is available; {fix}",
    )


def device_weight_bytes(model: Llama) -> int:
    """Parameter bytes on the fullest device (measured from the placed shards)."""
    return max(bytes_per_device(nnx.state(model)).values())


def device_memory_bytes(parallel: TensorParallel) -> int | None:
    """The allocator's limit on the smallest of this process's devices of the mesh (processes
    then agree on the smallest plan); None on a CPU (no figure)."""
    local = [d for d in parallel.mesh.devices.flat if d.process_index == jax.process_index()]
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in local]
    return None if None in limits else min(limits)


def plan_cache(
    engine_config: EngineConfig,
    model: Llama,
    parallel: TensorParallel,
    memory_bytes: int | None = None,
    draft: Llama | None = None,
) -> KVCachePlan:
    """Sizes one device's KV pool from its memory (or the explicit budget, or on a CPU the job).

    Args:
      memory_bytes: the allocator's limit per device; default `device_memory_bytes(parallel)`.
      draft: a draft model: its weights come out of the memory too, and every block of the pool
        has a twin in the draft's pool (its bytes counted with the block's).
    """
    cache, max_model_len = engine_config.cache, engine_config.max_model_len
    config = parallel.layout.device_config
    dtype_bytes = kv_element_bytes(engine_config, model, parallel)
    extra = 0
    if draft is not None:
        draft_device = TensorParallelLayout(draft.config, parallel.size).device_config
        extra = kv_bytes_per_token(
            draft_device, kv_storage_dtype(cache.kv_dtype(draft.dtype), parallel.platform).itemsize
        )
    common = dict(
        dtype_bytes=dtype_bytes, block_size=cache.block_size, max_model_len=max_model_len, extra_bytes_per_token=extra
    )
    if cache.kv_cache_memory_bytes is not None:
        return plan_kv_cache(config, kv_cache_memory_bytes=cache.kv_cache_memory_bytes, **common)
    limit = memory_bytes if memory_bytes is not None else device_memory_bytes(parallel)
    max_num_seqs = engine_config.scheduling.max_num_seqs
    if limit is None:
        budget = _cpu_budget(cache.block_size, max_num_seqs, config, dtype_bytes, max_model_len, extra)
        return plan_kv_cache(config, **common, **budget)
    weights = device_weight_bytes(model) + (device_weight_bytes(draft) if draft is not None else 0)
    activations = _peak_activation_bytes(engine_config, model, parallel)
    fraction = allocator_fraction()  # the allocator's limit is this share of the device
    total = limit / fraction
    utilization = cache.gpu_memory_utilization
    if utilization > fraction:
        logger.warning(
            "gpu_memory_utilization=%s exceeds the JAX allocator's limit (XLA_PYTHON_CLIENT_MEM_FRACTION=%s); "
            "planning with %s",
            utilization,
            fraction,
            fraction,
        )
        utilization = fraction
    return plan_kv_cache(
        config,
        device_memory_bytes=int(total),
        gpu_memory_utilization=utilization,
        weight_bytes=weights,
        activation_bytes=activations,
        **common,
        state_bytes=sequence_state_bytes(max_num_seqs, engine_config.model.vocab_size)
        + _lora_pool_bytes(engine_config, model),
    )


def _lora_pool_bytes(engine_config: EngineConfig, model: Llama) -> int:
    """The LoRA adapter pool's bytes on each device (0 without LoRA): out of its memory like the
    weights."""
    lora = engine_config.lora
    if not lora.enable_lora:
        return 0
    return pool_bytes(
        engine_config.layout.mesh_config, lora.max_loras, lora.max_lora_rank, np.dtype(model.dtype).itemsize
    )


def _cpu_budget(
    block_size: int, max_num_seqs: int, config: ModelConfig, dtype_bytes: int, max_model_len: int, extra: int = 0
) -> dict:
    """A CPU has no device memory figure: room for `max_num_seqs` requests of `max_model_len`
    (what the job can use at once), capped at a share of the machine's memory."""
    per_block = (kv_bytes_per_token(config, dtype_bytes) + extra) * block_size
    want = (max_num_seqs * -(-max_model_len // block_size) + 1) * per_block  # + the null block
    cap = int(host_memory_bytes() * CPU_KV_CACHE_SHARE)
    if want <= cap:
        why = f"the job: max_num_seqs={max_num_seqs} x max_model_len={max_model_len} tokens (CPU)"
        return dict(kv_cache_memory_bytes=want, sized_from=why)
    why = (
        f"{CPU_KV_CACHE_SHARE:.0%} of this machine's memory (CPU; max_num_seqs={max_num_seqs} x "
        f"max_model_len={max_model_len} would need {want / GiB:.2f} GiB; set kv_cache_memory_bytes to choose)"
    )
    return dict(kv_cache_memory_bytes=cap, sized_from=why)


def check_step_memory(plan: KVCachePlan, temp_bytes: dict[Program, int]) -> None:
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
            f"the step program ({program.describe()}) needs {worst / GiB:.3f} GiB of "
            f"temporaries with the real KV pool, but the plan reserved {plan.activation_bytes / GiB:.3f} GiB "
            "(the largest single step, measured with a small pool); lower gpu_memory_utilization or set "
            "kv_cache_memory_bytes"
        )


def _peak_activation_bytes(config: EngineConfig, model: Llama, parallel: TensorParallel) -> int:
    """Device memory of the largest step beyond its donated state, from XLA's memory analysis
    (pool kept tiny): the larger of the largest mixed step (its model program's temporaries and
    the outputs that alias nothing, the logits handed to the sampler, then the largest sampler's
    temporaries) and the largest fused decode program (sampler inside). The fused program is not
    always the smaller: on the first H100 run, int4 weights widened outside its loop took 3.5 GiB
    there against 1.7 GiB for the largest mixed step, and the engine refused to start."""
    pages = -(-config.max_model_len // config.cache.block_size)
    probe = ModelRunner(model, parallel=parallel, config=config.with_blocks(pages + 1))
    program = Program(max(probe.layouts), 1, False, lora=probe.step_programs.lora)  # (LoRA's the larger)
    analysis = probe.compile_program(program).memory_analysis()
    handed_over = max(0, int(analysis.output_size_in_bytes) - int(analysis.alias_size_in_bytes))
    sampler = max(probe.step_programs.samplers([program]), key=lambda p: (p.num_seqs * p.rows_per_seq, p.options))
    probe.compile_program(sampler)
    temp = probe.temp_bytes[program] + handed_over + probe.temp_bytes[sampler]
    fused = [p for p in probe.step_programs.all() if p.steps > 1 and p.lora == probe.step_programs.lora]
    fused_temp = 0
    if fused:
        largest = max(fused, key=lambda p: p.tokens)
        probe.compile_program(largest)
        fused_temp = probe.temp_bytes[largest]
    logger.info(
        "peak activation memory of the largest step: %.2f GiB (model %.2f, logits %.2f, sampler %.2f; "
        "fused decode steps %.2f)",
        max(temp, fused_temp) / 2**30,
        probe.temp_bytes[program] / 2**30,
        handed_over / 2**30,
        probe.temp_bytes[sampler] / 2**30,
        fused_temp / 2**30,
    )
    return max(temp, fused_temp)
