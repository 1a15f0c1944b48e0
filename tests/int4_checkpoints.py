"""Independent packers of the 4/8-bit checkpoint formats, and tiny checkpoints built with them.

Written from the formats' descriptions (AutoAWQ's `WQLinear_GEMM`, AutoGPTQ's v1 `QuantLinear`,
compressed-tensors' `pack-quantized` compressor), not from jaxpaged's readers: a float weight is
quantized in groups of input features (min/max scales, as GPTQ's and llm-compressor's observers
without their error feedback), and the integer codes are packed into int32 words exactly as each
format lays them out. Each packer also returns its own dequantized weight, `(code - zero) *
scale` with the scale as stored, the reference a reader must reproduce.
"""

import functools
import json
import os
import re

import numpy as np
import torch
from checkpoint_edits import copy_checkpoint, edit_tensors, save_quantized_checkpoint
from tiny_models import build_hf_model

AWQ_SLOT_FEATURE = (0, 2, 4, 6, 1, 3, 5, 7)  # the output feature (of 8) each 4-bit slot of a word holds
# The decoder projections of a saved Llama-family or mixture-of-experts checkpoint: attention's
# q/k/v/o, the MLP's, each expert's (Mixtral's w1, w2, w3) and a shared expert's; not the routers.
# Phi-3's fused qkv_proj and gate_up_proj are one linear each.
PROJECTION_NAME = re.compile(r"\.([qkvo]_proj|qkv_proj|gate_proj|up_proj|gate_up_proj|down_proj|w[123])\.weight$")


def quantize(w: np.ndarray, bits: int, groups: np.ndarray, sym: bool, min_zero: int = 0) -> tuple[np.ndarray, ...]:
    """Min/max quantization of `w [in, out]` with input feature i in group `groups[i]`, an
    asymmetric zero point at least `min_zero`.

    Returns:
      `(codes [in, out], scale [G, out] float32, zero [G, out])` (integers in int64), codes in
      `0 .. 2**bits - 1`; a symmetric zero is `2**(bits - 1)`.
    """
    maxq = 2**bits - 1
    num_groups = int(groups.max()) + 1
    scale = np.zeros((num_groups, w.shape[1]), np.float32)
    zero = np.zeros((num_groups, w.shape[1]), np.int64)
    for g in range(num_groups):
        rows = w[groups == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            amax = np.maximum(-lo, hi)
            scale[g] = 2 * amax / maxq
            zero[g] = 2 ** (bits - 1)
        else:
            scale[g] = (hi - lo) / maxq
            zero[g] = np.clip(np.round(-lo / scale[g]), min_zero, maxq)
    codes = np.clip(np.round(w / scale[groups]) + zero[groups], 0, maxq).astype(np.int64)
    return codes, scale, zero


def stored_scale(scale: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(scale).to(dtype)


def dequantized(codes, scale: torch.Tensor, zero, groups) -> np.ndarray:
    """`(codes - zero[g]) * scale[g]` `[in, out]`, the scale as stored."""
    s = scale.to(torch.float32).numpy()
    return (codes.astype(np.float32) - zero[groups].astype(np.float32)) * s[groups]


def pack(codes: np.ndarray, bits: int, axis: int, slot_feature=None) -> torch.Tensor:
    """Codes packed `32 // bits` per int32 along `axis`: slot j of word c (bits `bits*j` upwards)
    holds feature `n*c + slot_feature[j]` (in order unless `slot_feature` says otherwise)."""
    n = 32 // bits
    slot_feature = slot_feature or tuple(range(n))
    c = np.moveaxis(codes.astype(np.uint64), axis, 0)
    words = np.zeros((c.shape[0] // n, *c.shape[1:]), np.uint64)
    for j in range(n):
        words |= c[slot_feature[j] :: n] << np.uint64(bits * j)
    return torch.from_numpy(np.moveaxis(words.astype(np.uint32).view(np.int32), 0, axis).copy())


def contiguous_groups(num_in: int, group_size: int | None) -> np.ndarray:
    return np.arange(num_in) // (group_size or num_in)


def shuffled_groups(num_in: int, group_size: int, rng: np.random.Generator) -> np.ndarray:
    """GPTQ's act-order grouping: groups formed over a permutation of the inputs, each input's
    group listed in the original order."""
    order = rng.permutation(num_in)
    groups = np.empty(num_in, np.int64)
    groups[order] = np.arange(num_in) // group_size
    return groups


def pack_awq(w: np.ndarray, group_size: int | None, scale_dtype=torch.float16) -> tuple[dict, np.ndarray]:
    """AWQ GEMM tensors of `w [out, in]` (suffix -> tensor) and the dequantized `[out, in]`."""
    groups = contiguous_groups(w.shape[1], group_size)
    codes, scale, zero = quantize(w.T, 4, groups, sym=False)
    s = stored_scale(scale, scale_dtype)
    tensors = {
        "qweight": pack(codes, 4, axis=1, slot_feature=AWQ_SLOT_FEATURE),
        "qzeros": pack(zero, 4, axis=1, slot_feature=AWQ_SLOT_FEATURE),
        "scales": s,
    }
    return tensors, dequantized(codes, s, zero, groups).T


def pack_gptq(
    w: np.ndarray, bits: int, group_size: int | None, sym: bool, desc_act: bool, rng: np.random.Generator
) -> tuple[dict, np.ndarray]:
    """GPTQ v1 tensors of `w [out, in]` (zero points stored minus one) and the dequantized `[out, in]`."""
    num_in = w.shape[1]
    groups = shuffled_groups(num_in, group_size, rng) if desc_act else contiguous_groups(num_in, group_size)
    codes, scale, zero = quantize(w.T, bits, groups, sym, min_zero=1)  # v1 cannot store 0 (its -1 overflows)
    s = stored_scale(scale, torch.float16)
    tensors = {
        "qweight": pack(codes, bits, axis=0),
        "qzeros": pack(zero - 1, bits, axis=1),
        "scales": s,
        "g_idx": torch.from_numpy(groups.astype(np.int32)),
    }
    return tensors, dequantized(codes, s, zero, groups).T


def pack_compressed(
    w: np.ndarray, bits: int, group_size: int | None, sym: bool, actorder: bool, rng: np.random.Generator
) -> tuple[dict, np.ndarray]:
    """compressed-tensors pack-quantized tensors of `w [out, in]` and the dequantized `[out, in]`.
    Codes are the signed values plus `2**(bits-1)`; zero points (asymmetric) likewise."""
    num_in = w.shape[1]
    groups = shuffled_groups(num_in, group_size, rng) if actorder else contiguous_groups(num_in, group_size)
    codes, scale, zero = quantize(w.T, bits, groups, sym)
    s = stored_scale(scale.T.copy(), torch.bfloat16)  # [out, G]
    tensors = {
        "weight_packed": pack(codes.T, bits, axis=1),
        "weight_scale": s,
        "weight_shape": torch.tensor(w.shape, dtype=torch.int64),
    }
    if not sym:
        tensors["weight_zero_point"] = pack(zero.T, bits, axis=0)
    if actorder:
        tensors["weight_g_idx"] = torch.from_numpy(groups.astype(np.int32))
    return tensors, dequantized(codes, s.T, zero, groups).T


def awq_config(group_size: int | None) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size or -1, "zero_point": True, "version": "gemm"}


def gptq_config(bits: int, group_size: int | None, sym: bool, desc_act: bool) -> dict:
    return {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group_size or -1,
        "sym": sym,
        "desc_act": desc_act,
        "checkpoint_format": "gptq",
        "damp_percent": 0.01,
        "true_sequential": True,
    }


def compressed_config(bits: int, group_size: int | None, sym: bool, actorder: bool) -> dict:
    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": sym,
        "strategy": "group" if group_size else "channel",
        "group_size": group_size,
        "dynamic": False,
        "actorder": "group" if actorder else None,
    }
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }


# name -> (format, bits, group size as a multiple of the base one (None: per channel), symmetric, act order)
KINDS = {
    "awq": ("awq", 4, 1, False, False),
    "gptq_sym": ("gptq", 4, 1, True, False),
    "gptq_act_order_asym": ("gptq", 4, 0.5, False, True),
    "gptq_8bit_channel": ("gptq", 8, None, False, False),
    "compressed_group": ("compressed-tensors", 4, 1, True, False),
    "compressed_channel": ("compressed-tensors", 4, None, True, False),
    "compressed_asym_actorder": ("compressed-tensors", 4, 0.5, False, True),
}


def checkpoint_kinds(group_size: int = 32) -> dict:
    """The checkpoint variants the tests build (`KINDS`), by name: (packer of one `[out, in]`
    weight `(w, rng) -> (tensors, dequantized)`, config.json's quantization_config). Act-order
    variants use groups of half `group_size` (more groups to shuffle)."""
    kinds = {}
    for name, (fmt, bits, scale, sym, act_order) in KINDS.items():
        g = None if scale is None else int(group_size * scale)
        if fmt == "awq":
            kinds[name] = (lambda w, rng, g=g: pack_awq(w, g), awq_config(g))
        elif fmt == "gptq":
            packer = functools.partial(pack_gptq, bits=bits, group_size=g, sym=sym, desc_act=act_order)
            kinds[name] = (lambda w, rng, packer=packer: packer(w, rng=rng), gptq_config(bits, g, sym, act_order))
        else:
            packer = functools.partial(pack_compressed, bits=bits, group_size=g, sym=sym, actorder=act_order)
            kinds[name] = (lambda w, rng, packer=packer: packer(w, rng=rng), compressed_config(bits, g, sym, act_order))
    return kinds


def write_int4_checkpoint(model, kind: str, out_dir: str, group_size: int = 32, seed: int = 0):
    """Quantizes every decoder projection of the HF `model` (in place: each becomes the packer's
    dequantized weight, float32) with the `kind` packer, and saves the checkpoint to `out_dir`
    (model.safetensors + config.json with its quantization_config; other tensors as they are).

    Returns:
      `model`, now the model the checkpoint stands for.
    """
    packer, qconfig = checkpoint_kinds(group_size)[kind]
    rng = np.random.default_rng(seed)
    model = model.float()
    tensors = {name: p.detach().clone().contiguous() for name, p in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    with torch.no_grad():
        for i in range(model.config.num_hidden_layers):
            layer = f"model.layers.{i}."
            projections = [n for n in tensors if n.startswith(layer) and PROJECTION_NAME.search(n)]
            for prefix in (n.removesuffix(".weight") for n in projections):
                stored, dequant = packer(tensors.pop(prefix + ".weight").numpy(), rng)
                tensors.update({f"{prefix}.{suffix}": t for suffix, t in stored.items()})
                model.get_submodule(prefix).weight.copy_(torch.from_numpy(dequant))
    model.config.dtype = torch.float32  # the other tensors as the float32 model holds them
    save_quantized_checkpoint(model, tensors, out_dir, qconfig)
    return model


def save_int4_checkpoint(variant: str, kind: str, out_dir: str, seed: int = 0) -> torch.nn.Module:
    """`write_int4_checkpoint` of the tiny `variant` (tests/tiny_models.py)."""
    return write_int4_checkpoint(build_hf_model(variant, seed), kind, out_dir, seed=seed)


def round_to_nearest(model_dir, group_size: int) -> None:
    """Rewrites the projections of the saved float32 checkpoint `model_dir` (`PROJECTION_NAME`)
    as their 4-bit round-to-nearest values, dequantized: min/max asymmetric groups of
    `group_size` contiguous inputs (AWQ's grid with float32 scales), what `--quantization int4`
    holds (each expert alone)."""

    def edit(tensors):
        for name, w in tensors.items():
            if PROJECTION_NAME.search(name):
                tensors[name] = np.ascontiguousarray(pack_awq(w, group_size, torch.float32)[1])

    edit_tensors(model_dir, edit)


def pack_saved_checkpoint(model_dir, kind: str, reference_dir, group_size: int = 32, **quantization_config) -> None:
    """Re-saves the float32 checkpoint `model_dir` with every projection (`PROJECTION_NAME`: each
    expert's its own) packed by the `kind` packer and config.json's `quantization_config` (updated
    with `quantization_config`); `reference_dir` gets the checkpoint with the packer's dequantized
    weights, the model transformers runs as the reference. A `modules_to_not_convert` leaves the
    projections whose module names hold one of its entries in float, as AutoAWQ does; an `ignore`
    those whose module name is one of its entries, or starts with a match of an entry's regular
    expression after `re:`, as compressed-tensors' matcher does."""
    packer, qconfig = checkpoint_kinds(group_size)[kind]
    copy_checkpoint(model_dir, reference_dir)
    rng = np.random.default_rng(0)
    dequantized = {}
    not_converted = quantization_config.get("modules_to_not_convert", [])
    ignore = quantization_config.get("ignore", [])

    def ignored(module: str) -> bool:
        patterns = [entry[3:] for entry in ignore if entry.startswith("re:")]
        return module in ignore or any(re.match(pattern, module) for pattern in patterns)

    def converted(name: str) -> bool:
        module = name.removesuffix(".weight")
        return (
            bool(PROJECTION_NAME.search(name)) and not any(m in module for m in not_converted) and not ignored(module)
        )

    def edit(tensors):
        for name in [n for n in tensors if converted(n)]:
            stored, weight = packer(tensors.pop(name).numpy(), rng)
            dequantized[name] = np.ascontiguousarray(weight)
            tensors.update({name.removesuffix("weight") + suffix: t for suffix, t in stored.items()})

    edit_tensors(model_dir, edit, framework="torch")
    edit_tensors(reference_dir, lambda tensors: tensors.update(dequantized))
    path = os.path.join(model_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["quantization_config"] = {**qconfig, **quantization_config}
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
