"""The real engine's start-up: `LLM(...)` built from the engine flags, timed until it is ready,
then one short generate (the first token through the compiled programs).

    python -m benchmarks.gpu.engine_start --model llama-3.1-8b --load-format dummy --dtype bfloat16 \\
        --compilation-cache-dir DIR --output-json engine_start.json

Run it twice with the same empty DIR for a cold and then a warm start. Prints and writes the
seconds to import JAX and jaxpaged, to build the engine (weights, KV-cache planning, every step
program compiled or loaded from the cache), and for the first generate.
"""

import argparse
import dataclasses
import json
import os
import sys
import time

STARTED = time.perf_counter()

from jaxpaged.checkpoint.format import has_tokenizer  # noqa: E402
from jaxpaged.entrypoints.cli_flags import add_engine_flags, engine_args  # noqa: E402

FIRST_PROMPT_TOKENS = 16
FIRST_OUTPUT_TOKENS = 16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_flags(parser)
    parser.add_argument("--output-json", metavar="FILE", help="write the timings here")
    args = parser.parse_args(argv)
    skip = args.skip_tokenizer_init or not (os.path.isdir(args.model or "") and has_tokenizer(args.model))
    engine = engine_args(args, skip_tokenizer_init=skip)

    import jax

    from jaxpaged.entrypoints.llm import LLM
    from jaxpaged.sampling_params import SamplingParams

    imported = time.perf_counter()
    print(f"imports {imported - STARTED:.1f} s; jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    llm = LLM(**dataclasses.asdict(engine))
    ready = time.perf_counter()
    print(f"engine ready after {ready - imported:.1f} s", flush=True)
    params = SamplingParams(temperature=0, max_tokens=FIRST_OUTPUT_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": list(range(1, FIRST_PROMPT_TOKENS + 1))}], params, use_tqdm=False)
    generated = time.perf_counter()
    assert len(out[0].outputs[0].token_ids) == FIRST_OUTPUT_TOKENS
    result = {
        "model": engine.model,
        "dtype": engine.dtype,
        "load_format": engine.load_format,
        "compilation_cache_dir": engine.compilation_cache_dir,
        "device": jax.devices()[0].device_kind,
        "jax_version": jax.__version__,
        "import_s": round(imported - STARTED, 2),
        "ready_s": round(ready - imported, 2),
        "first_generate_s": round(generated - ready, 3),
        "total_s": round(generated - STARTED, 2),
        "stats": llm.get_stats(),
    }
    print(
        f"first generate ({FIRST_PROMPT_TOKENS} prompt tokens, {FIRST_OUTPUT_TOKENS} out) {generated - ready:.2f} s; "
        f"total {generated - STARTED:.1f} s",
        flush=True,
    )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
