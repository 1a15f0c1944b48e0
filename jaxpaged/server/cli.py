"""`jaxpaged serve`: start the engine, log what it sized and compiled, and run uvicorn.

jaxpaged serve                                   # the embedded demo model on 127.0.0.1:8000
jaxpaged serve /path/to/model --port 8000 --max-model-len 4096 --api-key sk-local
"""

import argparse
import errno
import gc
import importlib.util
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from jaxpaged.engine_args import compatibility_notes
from jaxpaged.engine_config import EngineConfig
from jaxpaged.entrypoints import cli_flags
from jaxpaged.entrypoints.cli_flags import PORT
from jaxpaged.server.limits import RESERVED_FILES, ServerLimits, add_limit_flags, limits_from
from jaxpaged.server.lora_modules import parse_lora_modules
from jaxpaged.server.tool_parsers import TOOL_PARSERS

logger = logging.getLogger("jaxpaged.server")

DEMO_MODEL_NAME = "jaxpaged-demo"
# The API key may come from the environment (a Kubernetes Secret) rather than the command line.
API_KEY_ENV = "JAXPAGED_API_KEY"
# After an engine failure, clients get their errors for this long before the process exits.
DEAD_DRAIN_SECONDS = 2.0
# After the drain aborts what is left, its clients get their last events for this long.
ABORT_FLUSH_SECONDS = 1.0
DISABLE_LOG_REQUESTS = (
    "accepted for vLLM compatibility; changes nothing: request logs hold ids and token counts, and prompt text "
    "only with --enable-log-requests"
)
# What the `server` extra installs (pyproject.toml), checked before anything slow starts.
SERVER_MODULES = ("fastapi", "uvicorn", "prometheus_client")
SERVER_USAGE = "openai_api_server"  # vLLM's usage context of its API server: the server's default batch limits


def load_chat_template(value: str) -> str:
    """`--chat-template`: a file's text, or the value itself when it is a template (vLLM's rule),
    checked as Jinja before anything loads.

    Raises:
      ValueError: naming --chat-template: no such file, or a template Jinja cannot parse.
    """
    import jinja2

    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            template = f.read()
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise ValueError(f"--chat-template {value}: no such file, and not a Jinja template either")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {err.lineno}: {err.message})") from None
    return template


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (vLLM's names); the engine flags come from `add_engine_flags`."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", help="model directory (default: the demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=PORT, default=8000, help="TCP port to listen on")
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the `model` clients send; several names are each accepted and listed, the first names the metrics "
        "(default: MODEL)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /live and /metrics "
        f"(default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level",
    )
    parser.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no uvicorn access-log line per request"
    )
    parser.add_argument(
        "--root-path",
        default="",
        metavar="PATH",
        help="the path prefix a reverse proxy serves this server under (FastAPI's root_path; default: none)",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's",
    )
    parser.add_argument(
        "--profiler-dir",
        metavar="DIR",
        help="adds POST /start_profile and /stop_profile: a jax.profiler trace of the engine's process into DIR "
        "(TensorBoard's profile plugin, XProf or Perfetto open it; vLLM's --profiler-config torch_profiler_dir)",
    )
    parser.add_argument("--enable-log-requests", action="store_true", help="include prompt text in request logs")
    parser.add_argument("--disable-log-requests", action="store_true", help=DISABLE_LOG_REQUESTS)
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight requests may finish before they are aborted",
    )
    parser.add_argument(
        "--max-num-waiting",
        type=int,
        default=10_000,
        metavar="N",
        help="sequences that may wait beyond the running ones; more get 503 with Retry-After",
    )
    parser.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=1024,
        metavar="N",
        help="most sequences (prompts x n) one request may ask for; more get 400",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine core in a child process and detokenize in the server's (off the engine's critical "
        "path); --no-engine-process runs it on a thread of the server's process",
    )
    parser.add_argument(
        "--tokenizer-pool-size",
        type=int,
        default=2,
        metavar="N",
        help="threads that tokenize and detokenize (and compile structured-output grammars) off the event loop",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='vLLM\'s: chat requests may send tool_choice "auto" (the default when they send tools): the '
        'model\'s own tool-call format is parsed by --tool-call-parser. Without it "auto" gets 400; '
        '"none", "required" and a named function work either way',
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_PARSERS),
        default=None,
        help="vLLM's: the model's tool-call format, for --enable-auto-tool-choice: llama3_json (Llama 3.1/3.2 "
        'JSON tool calls, {"name": ..., "parameters": ...}), hermes (<tool_call>{...}</tool_call>: Hermes, Qwen)',
    )
    for name, what in (
        ("origins", "origins (e.g. https://app.example)"),
        ("methods", "methods"),
        ("headers", "headers"),
    ):
        parser.add_argument(
            f"--allowed-{name}",
            type=_json_list,
            default=["*"],
            metavar="JSON",
            help=f"vLLM's CORS flag, as a JSON list: the {what} browsers may use across origins "
            f'(default: ["*"], any, as in vLLM{"; [] sends no CORS headers at all" if name == "origins" else ""})',
        )
    parser.add_argument(
        "--allow-credentials",
        action="store_true",
        help="vLLM's CORS flag: allow credentials (default: off, as in vLLM)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="vLLM's: LoRA adapters (PEFT directories) requests may name as their model, as name=path or "
        'JSON {"name": ..., "path": ...}; needs --enable-lora',
    )
    add_limit_flags(parser)


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON list of strings, e.g. '[\"*\"]'")
    return value


def serve(args: argparse.Namespace) -> int:
    """Runs the server until SIGTERM/SIGINT (exit 0 after draining) or an engine failure (exit 1).

    1. Flags are checked and the port bound before JAX loads, then the devices and (on a CPU)
       the host memory, each error one line naming its flag (exit 2). Then HTTP starts: `/live`
       answers while the engine loads and compiles on its own thread; `/health` (readiness) turns
       200 when it is ready.
    2. On SIGTERM or SIGINT the server stops admitting (503), lets in-flight requests finish for
       up to `--shutdown-timeout` seconds, aborts the rest (their KV blocks return) and exits 0.
    3. If the engine fails, every request in flight fails at once, `/health` turns 503, and the
       process exits 1 after a short drain, so a supervisor (Kubernetes, systemd) restarts it.
    """
    if args.node_rank > 0:  # a follower serves nothing: it runs process 0's steps on its devices
        from jaxpaged.engine.follower import run_follower

        run_follower(cli_flags.engine_args(args, model=args.model_tag or args.model, usage_context=SERVER_USAGE))
        return 0
    missing = [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"jaxpaged serve needs the server extra ({', '.join(missing)} missing): pip install 'jaxpaged[server]'",
            file=sys.stderr,
        )
        return 1
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"got two models: {args.model_tag!r} and --model {args.model!r}; give one")
    for flag, value, minimum in (
        ("--shutdown-timeout", args.shutdown_timeout, 0),
        ("--max-num-waiting", args.max_num_waiting, 0),
        ("--max-sequences-per-request", args.max_sequences_per_request, 1),
        ("--tokenizer-pool-size", args.tokenizer_pool_size, 1),
    ):
        if value < minimum:
            raise ValueError(f"{flag} {value}: must be at least {minimum}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError(
            f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(sorted(TOOL_PARSERS))})"
        )
    chat_template = load_chat_template(args.chat_template) if args.chat_template else None
    lora_modules = parse_lora_modules(args.lora_modules or [])
    if lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules: the server serves LoRA adapters with --enable-lora; add it")
    limits = limits_from(args)
    _make_room_for_connections(limits.max_connections + RESERVED_FILES)
    model = args.model_tag or args.model
    engine_args = cli_flags.engine_options(args, model=model, usage_context=SERVER_USAGE)
    config = EngineConfig.resolve(engine_args)  # once: checked before JAX loads, handed to the engine
    notes = compatibility_notes(engine_args) + (
        [f"disable_log_requests: {DISABLE_LOG_REQUESTS}"] if args.disable_log_requests else []
    )
    for note in notes:
        logger.info(note)
    listener = _bind(args.host, args.port)  # a port in use is reported now, not after compiling
    names = args.served_model_name or [model or DEMO_MODEL_NAME]
    replicas = config.parallel.data_parallel_size
    if replicas > 1 and not args.engine_process:
        raise ValueError(
            f"--data-parallel-size {replicas}: each replica runs in an engine process of its own; "
            "drop --no-engine-process"
        )
    cores = []
    if args.engine_process:
        from jaxpaged.engine.core_process import EngineCoreProcess

        # every replica starts now (they check their devices, load and compile side by side)
        cores = [EngineCoreProcess(config.for_replica(r), on_ready=_log_start_up) for r in range(replicas)]
    try:
        return _run(args, config, cores, listener, names, limits, chat_template, lora_modules)
    finally:
        # Whatever ended the server (an error or Ctrl-C while starting included), the engine processes
        # go with it: they ignore SIGTERM, so multiprocessing's exit would otherwise wait on them forever.
        for core in cores:
            core.stop(timeout=0.0)


def _run(
    args: argparse.Namespace,
    config: EngineConfig,
    cores: list,
    listener: socket.socket,
    names: list[str],
    limits: ServerLimits,
    chat_template: str | None,
    lora_modules: dict,
) -> int:
    """`serve` once its flags are checked and its port bound: checks the devices and host memory
    (in the engine processes `cores`, one `EngineCoreProcess` per data-parallel replica, or here
    when there are none), then runs uvicorn until it stops."""
    port = listener.getsockname()[1]
    for core in cores:
        core.wait_checked()  # devices and host memory, checked where the engine runs, before HTTP starts
    if not cores:
        from jaxpaged.engine.setup import check_engine_fits

        check_engine_fits(config)  # devices and host memory, before HTTP starts
    logger.info(
        "starting the engine for %s in %s (loading JAX and the model, then compiling); "
        "/live answers now, /health once it is ready",
        config.load.model,
        f"{len(cores)} replicas, each in a process of its own"
        if len(cores) > 1
        else "a process of its own"
        if cores
        else "a thread of the server's process",
    )
    import uvicorn

    from jaxpaged.server.app import CorsPolicy, build_app
    from jaxpaged.server.async_engine import AsyncEngine

    exit_code = 0
    server: uvicorn.Server | None = None

    def on_dead(err: BaseException) -> None:  # engine thread: fail fast, let the supervisor restart us
        nonlocal exit_code
        exit_code = 1
        logger.error("%s; exiting in %.0f s", err, DEAD_DRAIN_SECONDS)
        threading.Timer(DEAD_DRAIN_SECONDS, lambda: setattr(server, "should_exit", True)).start()

    start = time.perf_counter()

    def build():
        from jaxpaged.engine.llm_engine import LLMEngine

        engine = LLMEngine(config)
        _log_start_up(engine, time.perf_counter() - start)
        return engine

    if len(cores) > 1:
        from jaxpaged.server.data_parallel import DataParallelEngine, core_replicas

        start_replica = core_replicas(config, cores, max_num_waiting=args.max_num_waiting, on_ready=_log_start_up)
        async_engine = DataParallelEngine(start_replica, len(cores), on_dead=on_dead)
    else:
        async_engine = AsyncEngine(cores[0] if cores else build, max_num_waiting=args.max_num_waiting, on_dead=on_dead)
    async_engine.when_ready(_freeze_startup_heap)
    app = build_app(
        async_engine,
        names,
        api_key=args.api_key,
        log_prompts=args.enable_log_requests,
        max_sequences_per_request=args.max_sequences_per_request,
        tokenizer_pool_size=args.tokenizer_pool_size,
        limits=limits,
        tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        chat_template=chat_template,
        profiler_dir=args.profiler_dir,
        lora_modules=lora_modules,
        cors=CorsPolicy(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
    )
    from jaxpaged.server.http_protocol import guarded_h11_protocol

    config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        root_path=args.root_path,
        timeout_graceful_shutdown=ABORT_FLUSH_SECONDS,
        http=guarded_h11_protocol(limits),
        limit_concurrency=limits.limit_concurrency,
        timeout_keep_alive=limits.timeout_keep_alive,
        h11_max_incomplete_event_size=limits.h11_max_incomplete_event_size,
    )
    server = _draining_server(config, async_engine, args.shutdown_timeout)
    logger.info(
        "listening at http://%s:%d/v1 (API key %s)",
        args.host,
        port,
        "required" if args.api_key else "not required",
    )
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal that stopped it once it is done; after our drain the
        # process exits normally (0, or 1 after an engine failure) instead of dying of it.
        signal.signal(signal.SIGTERM, lambda sig, frame: None)
    try:
        server.run(sockets=[listener])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        async_engine.shutdown()  # aborts what is left; every KV block returns
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


def _freeze_startup_heap() -> None:
    """Takes what start-up left alive (modules, tokenizer, app) out of the GC's full collections.

    A full collection walks every tracked object while holding the interpreter lock: over the
    start-up heap that is a few hundred milliseconds of nobody answering `/health`, each time
    requests' garbage triggers one. Frozen objects are never walked again (vLLM's API server does
    the same once it is up). Runs once, before `/health` says ready.
    """
    gc.collect()
    gc.freeze()


def _bind(host: str, port: int) -> socket.socket:
    """The server's socket, bound to `host`:`port` (uvicorn listens on it).

    Raises:
      ValueError: the port is in use, or the address cannot be bound, naming the flag.
    """
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as err:
        raise ValueError(f"--host {host}: not an address of this machine ({err.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: restarts need no wait
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: {host}:{port} is already in use; choose another --port (0 picks a free one) "
                "or stop the process listening there"
            ) from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None
    return sock


def _make_room_for_connections(files: int) -> None:
    """Raises the process's soft file limit to `files` if it is lower (up to the hard limit).

    Raises:
      ValueError: the hard limit is lower, naming the flag that sizes it.
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < files:
        if hard != resource.RLIM_INFINITY and hard < files:
            raise ValueError(
                f"--limit-concurrency needs {files} open files (connections plus {RESERVED_FILES} for the "
                f"process) but the process may open at most {hard}: lower --limit-concurrency or raise "
                "the limit (ulimit -n)"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (files, hard))


def _draining_server(config, async_engine, shutdown_timeout: float):
    """uvicorn's server, which drains before it stops. The first SIGTERM/SIGINT marks the engine
    draining (new requests get 503, `/health` turns 503); in-flight requests get up to
    `shutdown_timeout` seconds to finish; the rest are aborted, so their streams end properly
    (finish_reason "abort", then `[DONE]`); only then does uvicorn shut down. A second signal
    during the drain ends the wait at once (the same abort follows); later ones are ignored, so
    uvicorn never cuts responses off with its forced exit."""
    import uvicorn

    class Server(uvicorn.Server):
        hurry = threading.Event()

        def handle_exit(self, sig, frame) -> None:
            if not async_engine.is_running and not async_engine.draining:
                return super().handle_exit(sig, frame)  # nothing to drain
            if async_engine.draining:
                if not self.hurry.is_set():
                    logger.info("signal %d again: ending the drain now", sig)
                    self.hurry.set()
                return
            async_engine.draining = True
            logger.info("signal %d: draining; in-flight requests get up to %.0f s", sig, shutdown_timeout)
            threading.Thread(target=self._drain, args=(sig, frame), name="jaxpaged-drain", daemon=True).start()

        def _drain(self, sig, frame) -> None:
            deadline = time.monotonic() + shutdown_timeout
            while async_engine.num_unfinished_seqs and time.monotonic() < deadline and not self.hurry.is_set():
                self.hurry.wait(0.05)
            left = async_engine.num_unfinished_seqs
            if left:
                logger.info("shutdown timeout: aborting %d sequence(s) still in flight", left)
                async_engine.abort_all()
                time.sleep(ABORT_FLUSH_SECONDS)  # let their last events reach the clients
            super().handle_exit(sig, frame)

    return Server(config)


def _log_start_up(engine, seconds: float) -> None:
    import jax

    plan, runner, config = engine.plan, engine.runner, engine.config.model
    dtype = jax.tree.leaves(runner.params)[0].dtype
    # the count the "compiling N step programs" line announced (penalty seeding and KV copies included)
    programs = len(getattr(runner, "compile_report", None) or runner.layouts)
    memory = engine.device_memory_stats()
    logger.info(
        "engine ready in %.1f s: model %s (%s, %d layers, dtype %s, max_model_len %d); KV cache %d blocks x %d = "
        "%d tokens (%.3f GiB), max concurrency %.2f at max_model_len; %d step programs (token buckets %s) "
        "compiled in %.1f s; per device: weights %.3f GiB, KV pool %.3f GiB, step temporaries up to %.3f GiB",
        seconds,
        engine.config.load.model,
        config.architecture,
        config.num_layers,
        dtype,
        engine.config.max_model_len,
        plan.num_blocks - 1,
        plan.block_size,
        plan.num_tokens,
        plan.pool_bytes / 2**30,
        plan.max_concurrency,
        programs,
        sorted(runner.layouts),
        engine.compile_seconds,
        memory["device_weight_bytes"] / 2**30,
        memory["kv_cache_bytes"] / 2**30,
        memory["step_temp_bytes"] / 2**30,
    )
