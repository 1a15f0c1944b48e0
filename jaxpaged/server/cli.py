"""`jaxpaged serve`: start the engine, log what it sized and compiled, and run uvicorn.

    jaxpaged serve                                   # the embedded demo model on 127.0.0.1:8000
    jaxpaged serve /path/to/model --port 8000 --max-model-len 4096 --api-key sk-local
"""

import argparse
import importlib.util
import logging
import sys
import time

from jaxpaged import cli_flags
from jaxpaged.cli_flags import PORT

logger = logging.getLogger("jaxpaged.server")

DEMO_MODEL_NAME = "jaxpaged-demo"
# What the `server` extra installs (pyproject.toml), checked before anything slow starts.
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (vLLM's names); the engine flags come from `add_engine_flags`."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model directory (default: the demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=PORT, default=8000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send (default: MODEL)")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    parser.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level")  # fmt: skip
    parser.add_argument("--enable-log-requests", action="store_true", help="include prompt text in request logs")


def serve(args: argparse.Namespace) -> int:
    """Runs the server until interrupted; returns the exit code."""
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(f"jaxpaged serve needs the server extra ({', '.join(missing)} missing): pip install 'jaxpaged[server]'",
              file=sys.stderr)  # fmt: skip
        return 1
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"got two models: {args.model_tag!r} and --model {args.model!r}; give one")
    model = args.model_tag or args.model
    engine_args = cli_flags.engine_args(args, model=model)  # every flag checked before JAX loads
    name = args.served_model_name or model or DEMO_MODEL_NAME
    logger.info("starting the engine for %s (loading JAX and the model, then compiling)", engine_args.model)
    import uvicorn

    from jaxpaged.engine import LLMEngine
    from jaxpaged.server.app import build_app
    from jaxpaged.server.async_engine import AsyncEngine

    start = time.perf_counter()
    engine = LLMEngine(engine_args)
    _log_start_up(engine, time.perf_counter() - start)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, name, api_key=args.api_key, log_prompts=args.enable_log_requests)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            timeout_graceful_shutdown=5)  # fmt: skip
    logger.info("serving %r at http://%s:%d/v1 (API key %s)", name, args.host, args.port,
                "required" if args.api_key else "not required")  # fmt: skip
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        async_engine.shutdown()
    return 0


def _log_start_up(engine, seconds: float) -> None:
    import jax

    plan, runner, config = engine.plan, engine.runner, engine.model_config
    dtype = jax.tree.leaves(runner.params)[0].dtype
    programs = len(getattr(runner, "compiled", runner.layouts))
    logger.info(
        "engine ready in %.1f s: model %s (%s, %d layers, dtype %s, max_model_len %d); KV cache %d blocks x %d = "
        "%d tokens (%.3f GiB), max concurrency %.2f at max_model_len; %d step programs (token buckets %s) "
        "compiled in %.1f s", seconds, engine.args.model, config.architecture, config.num_layers, dtype,
        engine.max_model_len, plan.num_blocks - 1, plan.block_size, plan.num_tokens, plan.pool_bytes / 2**30,
        plan.max_concurrency, programs, sorted(runner.layouts), engine.compile_seconds,
    )  # fmt: skip
