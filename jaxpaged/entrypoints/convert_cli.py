"""`jaxpaged-convert`: Hugging Face safetensors -> jaxpaged (Orbax) checkpoint.

jaxpaged-convert --hf-dir ./Llama-3.1-8B --out ./llama-8b-jax --dtype bfloat16

A compressed-tensors FP8 checkpoint (e.g. a public Llama FP8) is converted with its weights
still in float8, an AWQ, GPTQ or compressed-tensors pack-quantized one with them still 4/8-bit;
`--quantization int4` quantizes a plain checkpoint's weights to 4 bits while converting (see
`jaxpaged.checkpoint.convert`).
"""

import argparse
import os
import sys

from jaxpaged.config.quantization import DEFAULT_GROUP_SIZE, GROUP_QUANT_BITS

PROG = "jaxpaged-convert"


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `jaxpaged-convert`."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a Hugging Face Llama/Mistral/Qwen2 safetensors checkpoint to jaxpaged's "
        "Orbax format (params/, config and tokenizer files, jaxpaged_format.json).",
    )
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "float16", "auto"),
        help="parameter dtype on disk; 'auto' keeps the checkpoint's (default: bfloat16); the weights of a "
        "pre-quantized checkpoint stay as they are (compressed-tensors FP8: float8 with float32 scales; AWQ, GPTQ, "
        "pack-quantized: 4/8-bit codes with float32 scales and int8 zero points)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=tuple(GROUP_QUANT_BITS),
        help="quantize a plain checkpoint's decoder projections while converting: int4 rounds to nearest with a "
        "scale and a zero point per group of --quantization-group-size inputs, as jaxpaged's --quantization int4 "
        "does at load; the converted directory records it (default: keep the checkpoint's weights)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        default=DEFAULT_GROUP_SIZE,
        help=f"input features per group of --quantization int4 (default: {DEFAULT_GROUP_SIZE})",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the converter; returns 0, or exits with status 2 and one error line on bad input.

    Args:
      argv: arguments without the program name (default: `sys.argv[1:]`).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isfile(os.path.join(args.hf_dir, "config.json")):
        what = "has no config.json" if os.path.isdir(args.hf_dir) else "is not a directory"
        parser.exit(
            2,
            f"{PROG}: error: --hf-dir {args.hf_dir} {what}; give a downloaded Hugging Face model directory "
            "(config.json and *.safetensors; a Hub id must be downloaded first, e.g. with "
            "`hf download ID --local-dir DIR`)\n",
        )
    from jaxpaged.checkpoint.convert import convert_checkpoint  # after parsing: --help stays fast

    try:
        out = convert_checkpoint(
            args.hf_dir,
            args.out,
            dtype=args.dtype,
            overwrite=args.overwrite,
            progress=not args.no_progress,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        parser.exit(2, f"{PROG}: error: {e}\n")
    print(f"{PROG}: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
