"""`jaxpaged bench`: vLLM's benchmark commands, with vLLM's subcommands, flags and metric names.

    jaxpaged bench throughput [--dataset-name sharegpt|random|prefix] [--compare-transformers]   # offline, LLM API
    jaxpaged bench latency [--batch-size 1 --input-len 32 --output-len 128]                      # one batch, end to end
    jaxpaged bench serve [--base-url URL] [--request-rate 4] [--save-result]                      # any OpenAI server
    jaxpaged bench plot RESULT.json ... --output chart.png                                        # serve results
    jaxpaged bench startup                                                                         # start-up time
    jaxpaged bench extraction [--num-prompts 64]                               # clinical notes to JSON, constrained or not

Building the parser imports no JAX; each command imports what it needs when it runs.
"""

import argparse

from jaxpaged.entrypoints.cli_flags import HelpFormatter, add_engine_flags

COMMANDS = ("throughput", "latency", "serve", "plot", "startup", "extraction")


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Adds `bench` and its subcommands to the `jaxpaged` parser's subcommands."""
    bench = commands.add_parser(
        "bench",
        help="benchmarks: " + ", ".join(COMMANDS),
        formatter_class=HelpFormatter,
        allow_abbrev=False,
        description=__doc__.split("\n\n")[0],
    )
    sub = bench.add_subparsers(
        dest="bench_command", required=True, metavar="{" + ",".join(COMMANDS) + "}", help="the benchmark to run"
    )

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter, allow_abbrev=False)

    from jaxpaged.bench import latency, plot, serve, throughput

    parser = command("throughput", "offline throughput of LLM.generate (requests/s, tokens/s)")
    throughput.add_throughput_flags(parser)
    add_engine_flags(parser, job_sized=("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    parser.set_defaults(run=throughput.run)

    parser = command("latency", "end-to-end latency of one fixed batch")
    latency.add_latency_flags(parser)
    add_engine_flags(parser, job_sized=("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    parser.set_defaults(run=latency.run, enable_prefix_caching=False)  # vLLM's default here: iterations repeat

    parser = command("serve", "load an OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput, goodput")
    serve.add_serve_bench_flags(parser)
    parser.set_defaults(run=serve.run)

    parser = command("plot", "latency-vs-throughput charts (PNG) from saved bench serve results")
    plot.add_plot_flags(parser)
    parser.set_defaults(run=plot.run)

    from jaxpaged.bench import startup

    parser = command("startup", "start-up time of the engine")
    startup.add_startup_flags(parser)
    parser.set_defaults(run=startup.run)

    from jaxpaged.bench import extraction

    parser = command("extraction", "the clinical-notes extraction workload: JSON-constrained vs free, prefix caching")
    extraction.add_extraction_flags(parser)
    add_engine_flags(parser, job_sized=("max_num_seqs", "max_num_batched_tokens", "max_model_len"))
    parser.set_defaults(run=extraction.run)
