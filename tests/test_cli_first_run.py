"""The first run as a newcomer meets it: every flag checked (and named) before JAX loads, prompts
checked before compiling, progress shown while compiling, JSONL options honoured or rejected,
config-only directories and presets with dummy weights, and `generate ""` agreeing with the server."""

import importlib.metadata
import inspect
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from jaxpaged.cli import build_parser, main
from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`jaxpaged ARGV` in a fresh interpreter that reports whether JAX got imported."""
    code = (
        "import sys; from jaxpaged.cli import main; rc = main(sys.argv[1:]); "
        "print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX', file=sys.stderr); sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


# Bad flags and prompts, each named by its flag: every one is reported before JAX loads (one
# interpreter checks them all: test_no_bad_input_loads_jax).
BAD_INPUT = [
    (["generate", "--max-num-seqs", "0", "hi"], "--max-num-seqs 0: must be an integer of at least 1"),
    (["generate", "--block-size", "12", "hi"], "--block-size 12: must be a power of two"),
    (
        ["generate", "--gpu-memory-utilization", "1.5", "hi"],
        "--gpu-memory-utilization 1.5: must be a number in (0, 1]",
    ),
    (["generate", "--temperature", "-1", "hi"], "--temperature must be non-negative"),
    (["generate", "--top-k", "-3", "hi"], "--top-k must be 0 or -1"),
    (["generate", "--model", "llama-3.1-8b", "hi"], "--model llama-3.1-8b: is a preset"),
    (
        ["generate", "--model", "/no/such/dir", "hi"],
        "--model /no/such/dir: is not a directory (nothing is downloaded)",
    ),
    (["generate", "--max-tokens", "5000", "In the beginning"], "more than the model's context of 1024 tokens"),
    (["generate", "--max-model-len", "8", "In the beginning"], "more than --max-model-len 8"),
    (["generate", "--seed", "abc", "hi"], "'abc' is neither an integer nor 'random'"),
    (["generate", "--kv-cache-memory-bytes", "lots", "hi"], "cannot read 'lots' as a memory size"),
    (["serve", "--port", "80000"], "80000 is not a TCP port"),
    (["serve", "/no/such/dir"], "--model /no/such/dir: is not a directory (nothing is downloaded)"),
    (["serve", "--chat-template", "/no/t.jinja"], "--chat-template /no/t.jinja: no such file"),
    (["serve", "--revision", "v2"], "--revision v2: vLLM's option, refused here: jaxpaged reads local directories"),
    (["generate", "--max-logprobs", "21", "hi"], "--max-logprobs 21: must be an integer from 0 to 20"),
    (
        ["generate", "--generation-config", "/no/dir", "hi"],
        "--generation-config /no/dir: that directory holds no generation_config.json",
    ),
    (
        ["serve", "--max-model-len", "4096"],
        "--max-model-len 4096: exceeds the model's max_position_embeddings=1024; ask for 1024 tokens or fewer",
    ),
    (["generate", "--kv-offloading-size", "0", "hi"], "--kv-offloading-size 0.0: must be a positive number of GiB"),
    (
        ["generate", "--preemption-mode", "swap", "hi"],
        "--preemption-mode swap: swaps to the host tier: set --kv-offloading-size too",
    ),
    (
        ["generate", "--kv-cache-dir", "/tmp/kv", "hi"],
        "--kv-cache-dir /tmp/kv: reads and writes through the host tier: set --kv-offloading-size too",
    ),
    (
        ["generate", "--kv-offloading-size", "1", "--kv-cache-dir", "/tmp/kv", "--no-enable-prefix-caching", "hi"],
        "it does nothing with --enable-prefix-caching off",
    ),
    (
        ["serve", "--max-num-batched-tokens", "4", "--max-num-seqs", "8"],
        "--max-num-batched-tokens 4: must be at least --max-num-seqs (8)",
    ),
    (["plan", "--model", "llama-3.1-8b", "--gpu-memory", "80"], "'80' has no unit; write e.g. 80GiB"),
    (["serve", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
]

# Runs `main` on each argv of argv[1] (JSON) in this one interpreter; prints, as JSON, each
# call's exit code and what it wrote to stderr, then whether JAX was imported at all.
EVERY_BAD_INPUT = """
import contextlib, io, json, sys
from jaxpaged.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stderr(io.StringIO()) as err:
        results.append((main(argv), err.getvalue()))
print(json.dumps({"results": results, "jax_imported": "jax" in sys.modules}))
"""


@pytest.fixture
def cli_globals(monkeypatch):
    """Puts back what `main` sets for a process it owns: the jaxpaged logger's level, the root
    logger's handlers and TRANSFORMERS_VERBOSITY."""
    monkeypatch.setattr(logging.getLogger("jaxpaged"), "level", logging.getLogger("jaxpaged").level)
    monkeypatch.setattr(logging.getLogger(), "handlers", list(logging.getLogger().handlers))
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", os.environ.get("TRANSFORMERS_VERBOSITY", "error"))


@pytest.mark.parametrize("argv, message", BAD_INPUT)
def test_bad_input_is_named_by_its_flag_before_jax_loads(argv, message, capsys, cli_globals):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err


def test_no_bad_input_loads_jax():
    """Every BAD_INPUT case in one fresh interpreter, one after the other: each is refused with
    its message, and JAX was never imported."""
    argvs = [argv for argv, _ in BAD_INPUT]
    result = subprocess.run(
        [sys.executable, "-c", EVERY_BAD_INPUT, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.splitlines()[-1])
    for (argv, message), (code, err) in zip(BAD_INPUT, report["results"]):
        assert code == 2 and message in err and "Traceback" not in err, (argv, err)
    assert not report["jax_imported"], "a bad input was refused only after JAX was imported"


def test_serve_reports_a_busy_port_at_once_naming_the_flag():
    """The port is bound before anything loads: a port in use is one line within seconds, not an
    error after the model has loaded and every program compiled."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        result = run_cli("serve", "--port", str(port))
    assert time.monotonic() - start < 20
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"jaxpaged: error: --port {port}: 127.0.0.1:{port} is already in use; choose another --port "
        "(0 picks a free one) or stop the process listening there",
        "NO_JAX",
    ]


def test_data_parallel_replicas_need_engine_processes_and_are_the_server_s():
    """`--data-parallel-size` runs replicas in engine processes: refused on the server's thread, and
    by `generate` (one engine), each one line naming the flag."""
    result = run_cli("serve", "--data-parallel-size", "2", "--no-engine-process", "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "jaxpaged: error: --data-parallel-size 2: each replica runs in an engine process of its own; "
        "drop --no-engine-process",
        "NO_JAX",
    ]
    result = run_cli("generate", "-dp", "2", "hello")
    assert result.returncode == 2, result.stderr
    assert "--data-parallel-size 2: replicas are served by jaxpaged serve --data-parallel-size" in result.stderr


def test_serve_reports_missing_devices_before_http_starts():
    """`--tensor-parallel-size 2` on one device: one line naming the flag, before the server
    starts (the engine's own thread would report it with a traceback, after listening)."""
    env = {**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # one CPU device
    result = run_cli("serve", "--tensor-parallel-size", "2", "--port", "0", env=env)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert lines[-2] == "jaxpaged: error: --tensor-parallel-size 2: needs 2 devices, but JAX sees 1 (cpu devices)"
    assert "Traceback" not in result.stderr and "listening" not in result.stderr, result.stderr


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except FileNotFoundError:  # it ended meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # field 4, after the parenthesised name
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# The `read` system call's number (/proc/PID/syscall's first field): a pipe read is where the
# server waits for its engine process's device check.
READ_SYSCALL = {"x86_64": 0, "aarch64": 63}[os.uname().machine]


def _proc_file(pid: int, name: str) -> str:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read().strip()
    except OSError:
        return "gone"


def _waiting_for_the_check(pid: int, seconds: float = 0.3) -> bool:
    """Whether `pid`'s main thread stays in one `read` of a socket, with the same arguments, for
    `seconds`: the server waiting on its engine process's pipe for the device check, as JAX loads
    there (not uvicorn's idle loop, which waits in epoll once the check passed, nor a read of a
    file, which a loaded machine can stretch past `seconds`)."""
    with open(f"/proc/{pid}/syscall") as f:
        first = f.read()
    if first.startswith("running") or int(first.split()[0]) != READ_SYSCALL:
        return False
    try:  # the engine's pipe is a socket pair; a file read (an import on a loaded machine) is not it
        if not os.readlink(f"/proc/{pid}/fd/{int(first.split()[1], 16)}").startswith("socket:"):
            return False
    except OSError:
        return False
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.02)
        with open(f"/proc/{pid}/syscall") as f:
            if f.read() != first:
                return False
    return True


def _interrupt_while_the_engine_checks(lines: list[str]):
    """Starts `jaxpaged serve`, sends Ctrl-C while it waits for its engine process's device check;
    returns (server, engine pids), or None when the check passed first (HTTP up: Ctrl-C would
    drain instead), the server then killed."""
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxpaged.cli", "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # Ctrl-C as a terminal delivers it, also when this test runs in a background job (a
        # non-interactive shell's `&` starts its jobs with SIGINT ignored, and children inherit that)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # Read as it comes: the server and its engine process write to this pipe, and a full pipe
    # would block whichever writes next (the server's exit line included).
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not (engines := [pid for pid in _children(server.pid) if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engines, "no engine process started"
    while server.poll() is None and time.monotonic() < deadline:
        if any("/live answers now" in line for line in lines):
            break
        if _waiting_for_the_check(server.pid):
            server.send_signal(signal.SIGINT)
            return server, engines, reader
    server.kill()
    server.wait()
    for pid in engines:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    reader.join(10)
    return None


def test_serve_interrupted_while_the_engine_starts_exits_and_ends_the_engine_process():
    """Ctrl-C while the engine process loads JAX (the server waits for its device check): one line,
    status 130, and the engine process is gone. It ignores SIGTERM (the server drains on it), so
    multiprocessing's exit used to wait on it forever. (An attempt whose check passes before the
    test sees the server waiting for it is started again: Ctrl-C then drains a running server.)"""
    for _ in range(3):
        lines: list[str] = []
        started = _interrupt_while_the_engine_checks(lines)
        if started is not None:
            break
    assert started is not None, "the server never waited for its engine's check: " + "".join(lines)
    server, engines, reader = started
    try:
        status = server.wait(timeout=30)
    except subprocess.TimeoutExpired:  # what each process of the tree waits in, for the report
        waits = {pid: _proc_file(pid, "syscall") + " | " + _proc_file(pid, "wchan") for pid in [server.pid, *engines]}
        pytest.fail(f"no exit 30 s after Ctrl-C; processes {waits}; stderr:\n{''.join(lines)}")
    finally:
        server.kill()
    assert status == 130, "".join(lines)
    reader.join(10)
    stderr = "".join(lines)
    assert "jaxpaged serve: interrupted" in stderr.splitlines() and "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in engines)


ENGINE_OWNER_EXITS = """
import signal, time
from jaxpaged.engine.core_process import EngineCoreProcess
from jaxpaged.engine_args import EngineArgs

def ignores_sigterm(pid):
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
    return mask >> (signal.SIGTERM - 1) & 1

core = EngineCoreProcess(EngineArgs(model="demo"))
while core.process.is_alive() and not ignores_sigterm(core.process.pid):
    time.sleep(0.05)
"""  # then exits without core.stop()


def test_an_engine_process_never_holds_its_owners_exit():
    """The engine process ignores SIGTERM, which multiprocessing's exit handler sends daemonic
    children before joining them: an owner that exits without `stop` (Ctrl-C while it is being
    constructed: seen once in CI) used to wait forever. It is killed at exit."""
    owner = subprocess.run(
        [sys.executable, "-c", ENGINE_OWNER_EXITS], cwd=ROOT, timeout=60, capture_output=True, text=True
    )
    assert owner.returncode == 0, owner.stderr


def test_version_names_the_installed_package(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"jaxpaged {importlib.metadata.version('jaxpaged')}\n"


@pytest.mark.parametrize(
    "argv, level",
    [
        (["generate", "hi"], "INFO"),
        (["--log-level", "DEBUG", "generate", "hi"], "DEBUG"),
        (["generate", "--log-level", "WARNING", "hi"], "WARNING"),
        (["serve", "--log-level", "ERROR"], "ERROR"),
        (["--log-level", "DEBUG", "plan", "--model", "llama-3.1-8b", "--log-level", "WARNING"], "WARNING"),
        (["bench", "latency", "--log-level", "WARNING"], "WARNING"),
    ],
)
def test_log_level_goes_before_or_after_the_subcommand(argv, level):
    assert build_parser().parse_args(argv).log_level == level


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["generate", "--max-num-seq", "3", "hi"],
            "jaxpaged generate: error: unrecognized arguments: --max-num-seq (did you mean --max-num-seqs?)",
        ),
        (["generate", "--temprature=0", "hi"], "unrecognized arguments: --temprature=0 (did you mean --temperature?)"),
        (
            ["serve", "--tensor-paralel-size", "2"],
            "jaxpaged serve: error: unrecognized arguments: --tensor-paralel-size (did you mean --tensor-parallel-size?)",
        ),
        (
            ["bench", "serve", "--num-promts", "3"],
            "jaxpaged bench serve: error: unrecognized arguments: --num-promts 3 (did you mean --num-prompts?)",
        ),
        (["serve", "--frobnicate"], "jaxpaged serve: error: unrecognized arguments: --frobnicate\n"),  # no guess
        (["generate", "--log-level", "LOUD", "hi"], "jaxpaged generate: error: --log-level LOUD: use DEBUG, INFO"),
    ],
)
def test_a_mistyped_flag_is_answered_with_the_closest_one(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["serve", "/models/m", "-tp", "2"], dict(model_tag="/models/m", tensor_parallel_size=2)),
        (
            ["serve", "--model", "/m", "--trust-remote-code", "--enforce-eager", "--disable-log-requests"],
            dict(model="/m", trust_remote_code=True, enforce_eager=True, disable_log_requests=True),
        ),
        (
            ["serve", "/m", "--host", "0.0.0.0", "--port", "8001", "--api-key", "k", "--served-model-name", "m"]
            + ["--max-model-len", "4096", "--gpu-memory-utilization", "0.85", "--max-num-seqs", "128"]
            + ["--max-num-batched-tokens", "8192", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8"]
            + ["--quantization", "fp8", "--block-size", "32", "--no-enable-prefix-caching", "--seed", "7"]
            + ["--load-format", "dummy", "--tensor-parallel-size=4", "--enable-log-requests"],
            dict(
                host="0.0.0.0",
                port=8001,
                max_model_len=4096,
                gpu_memory_utilization=0.85,
                max_num_batched_tokens=8192,
                kv_cache_dtype="fp8",
                enable_prefix_caching=False,
                seed=7,
                tensor_parallel_size=4,
                enable_log_requests=True,
            ),
        ),
        (
            ["serve", "/m", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"],
            dict(enable_auto_tool_choice=True, tool_call_parser="llama3_json"),
        ),
        (["generate", "-tp", "2", "--enforce-eager", "hi"], dict(tensor_parallel_size=2, enforce_eager=True)),
        (
            ["bench", "throughput", "--model", "/m", "-tp", "8", "--trust-remote-code"],
            dict(tensor_parallel_size=8, trust_remote_code=True),
        ),
        (["bench", "latency", "-tp", "2", "--batch-size", "8"], dict(tensor_parallel_size=2, batch_size=8)),
        (
            ["bench", "throughput", "--dataset-name", "random", "--random-input-len", "512"]
            + ["--random-output-len", "128", "--random-range-ratio", "0.1", "--n", "4"],
            dict(input_len=512, output_len=128, random_range_ratio=0.1, n=4),
        ),
        (
            ["bench", "serve", "--backend", "openai-chat", "--dataset-name", "sharegpt", "--sharegpt-output-len", "64"]
            + ["--label", "run1", "--save-result", "--save-detailed", "--num-warmups", "4"]
            + ["--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99", "--random-prefix-len", "0"],
            dict(backend="openai-chat", output_len=64, label="run1", save_detailed=True, num_warmups=4),
        ),
        (["bench", "serve", "--endpoint-type", "openai-chat"], dict(backend="openai-chat", endpoint=None)),
        (
            ["serve", "--chat-template", "t.jinja", "--root-path", "/api", "--disable-uvicorn-access-log"],
            dict(chat_template="t.jinja", root_path="/api", disable_uvicorn_access_log=True),
        ),
        (
            ["serve", "--allowed-origins", '["https://app.example"]', "--allowed-methods", '["POST"]']
            + ["--allow-credentials", "--uvicorn-log-level", "debug"],
            dict(
                allowed_origins=["https://app.example"],
                allowed_methods=["POST"],
                allow_credentials=True,
                uvicorn_log_level="debug",
            ),
        ),
        (
            ["serve", "/m", "--enable-chunked-prefill", "--swap-space", "8", "--max-logprobs", "5"]
            + ["--generation-config", "vllm"],
            dict(enable_chunked_prefill=True, swap_space=8.0, max_logprobs=5, generation_config="vllm"),
        ),
    ],
)
def test_vllm_command_lines_parse(argv, expected):
    """vLLM's command lines run unchanged: its flags, its short forms, its compatibility flags."""
    args = build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in expected} == expected


def test_compatibility_options_say_what_they_mean_here():
    from jaxpaged.engine_args import EngineArgs, compatibility_notes

    assert compatibility_notes(EngineArgs(model="m")) == []
    notes = compatibility_notes(EngineArgs(model="m", trust_remote_code=True, enforce_eager=True))
    assert [note.split(": ")[0] for note in notes] == ["trust_remote_code", "enforce_eager"]
    assert compatibility_notes(EngineArgs(model="m", enable_chunked_prefill=True)) == []  # what happens anyway
    notes = compatibility_notes(EngineArgs(model="m", enable_chunked_prefill=False, swap_space=16.0))
    assert [note.split(": ")[0] for note in notes] == ["enable_chunked_prefill", "swap_space"]
    assert all("accepted for vLLM compatibility; changes nothing: " in note for note in notes)
    serve = next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]
    flags = serve._option_string_actions
    for flag in ("--trust-remote-code", "--enforce-eager", "--disable-log-requests"):
        assert flags[flag].help.startswith("accepted for vLLM compatibility; changes nothing: "), flag
    assert flags["-tp"] is flags["--tensor-parallel-size"]


def test_every_flag_has_help_with_its_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in commands.items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            help_text = sub.formatter_class(name)._get_help_string(action)
            assert help_text.strip(), f"{name} {action.option_strings} has no help"
            if action.option_strings and action.default not in (None, False):
                assert "default" in help_text, f"{name} {action.option_strings} does not show its default"


def test_help_answers_without_jax():
    result = run_cli("serve", "--help")
    assert result.returncode == 0 and "--max-num-seqs N" in result.stdout and "NO_JAX" in result.stderr


def test_python_api_logs_at_info_unless_configured_or_switched_off(monkeypatch):
    from jaxpaged.entrypoints.logging_setup import configure_default_logging

    jaxpaged_logger, root = logging.getLogger("jaxpaged"), logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # an application that configured nothing
    monkeypatch.setattr(jaxpaged_logger, "handlers", [])
    monkeypatch.setattr(jaxpaged_logger, "level", logging.NOTSET)
    monkeypatch.setenv("JAXPAGED_CONFIGURE_LOGGING", "0")
    configure_default_logging()
    assert jaxpaged_logger.handlers == []  # the quiet switch
    monkeypatch.delenv("JAXPAGED_CONFIGURE_LOGGING")
    monkeypatch.setenv("JAXPAGED_LOGGING_LEVEL", "loud")
    with pytest.raises(ValueError, match="JAXPAGED_LOGGING_LEVEL='loud': use one of DEBUG, INFO, WARNING, ERROR"):
        configure_default_logging()
    monkeypatch.delenv("JAXPAGED_LOGGING_LEVEL")
    configure_default_logging()
    (handler,) = jaxpaged_logger.handlers
    assert isinstance(handler, logging.StreamHandler) and jaxpaged_logger.level == logging.INFO
    configure_default_logging()
    assert len(jaxpaged_logger.handlers) == 1  # once
    monkeypatch.setattr(jaxpaged_logger, "handlers", [])
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # the application's own setup stays
    configure_default_logging()
    assert jaxpaged_logger.handlers == []


def test_demo_is_the_default_model_and_transformers_advice_is_silenced():
    from jaxpaged.engine_args import EngineArgs
    from jaxpaged.entrypoints.llm import LLM

    assert EngineArgs(model="demo").model == DEMO_MODEL_DIR
    assert inspect.signature(LLM).parameters["model"].default == "demo"
    # transformers' "PyTorch was not found" banner is an advisory warning: none shows after importing jaxpaged
    code = "import jaxpaged, transformers.utils.logging as l; l.get_logger('probe').warning_advice('ADVICE')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ADVICE" not in result.stderr, result.stderr


def test_generate_shows_progress_while_compiling(caplog):
    with caplog.at_level(logging.INFO, logger="jaxpaged"):
        assert main(["generate", "--temperature", "0", "--max-tokens", "4", "In the beginning"]) == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "jaxpaged"]
    assert lines[0].startswith("generate: 1 prompt(s)")
    # a mixed step, a decode step, fused decode steps, four samplers (plain, full, and both masked)
    assert any(line.startswith("compiling 8 step programs") for line in lines), lines
    assert any(line.startswith("compiled 8 step programs in") for line in lines), lines  # the same count
    progress = [line for line in lines if line.startswith("compiled step program ")]  # + the penalty-row seeding
    assert sorted(line.split(":")[0] for line in progress) == [f"compiled step program {i}/8" for i in range(1, 9)]
    assert any(": mixed step, 16 tokens x 1 step(s), 1 seqs in " in line for line in progress), progress
    sized = next(line for line in lines if line.startswith("KV cache:"))
    assert "sized from the job: max_num_seqs=1 x max_model_len=8 tokens (CPU)" in sized, sized


def test_jsonl_lines_carry_their_own_sampling_options(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    lines = [
        {"prompt": "And God said", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
        {"prompt": "And God said", "max_tokens": 7, "temperature": 0, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "ignore_eos": True},
    ]
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    dst = tmp_path / "out.jsonl"
    assert main(["generate", "--input", str(src), "--output", str(dst), "--max-tokens", "50"]) == 0
    rows = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [3, 7, 2]
    assert rows[0]["token_ids"] == rows[1]["token_ids"][:3]  # both greedy from the same prompt
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).apply_chat_template(
        lines[2]["messages"], add_generation_prompt=True, tokenize=False
    )
    assert rows[2]["prompt"] == rendered != "Hi"  # the rendered conversation is what was completed
    assert main(["generate", "--input", str(src), "--max-tokens", "50"]) == 0
    printed = capsys.readouterr().out
    assert rows[2]["prompt"] + rows[2]["text"] in printed  # messages lines print the rendered prompt


@pytest.mark.parametrize(
    "line, message",
    [
        ({"prompt": "x", "max_token": 3}, "in.jsonl:1: unknown field(s) ['max_token']"),
        ({"prompt": "x", "n": 2}, "unknown field(s) ['n']"),
        ({"prompt": "x", "temperature": -2}, 'in.jsonl:1: field "temperature" must be non-negative'),
        ({"prompt": "x", "prompt_token_ids": [1]}, "exactly one of prompt, prompt_token_ids, messages"),
        ({"text": "x"}, "exactly one of prompt, prompt_token_ids, messages (got none)"),
    ],
)
def test_jsonl_options_are_honoured_or_rejected(tmp_path, capsys, line, message):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n")
    assert main(["generate", "--input", str(src)]) == 2
    assert message in capsys.readouterr().err


def test_config_only_directory_runs_dummy_weights_on_token_ids(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(open(os.path.join(DEMO_MODEL_DIR, "config.json")).read())
    src = tmp_path / "ids.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}) + "\n")
    assert main(["generate", "--model", str(model), "--input", str(src)]) == 2
    err = capsys.readouterr().err
    assert "has no weights" in err and "use --load-format dummy" in err
    assert main(["generate", "--model", str(model), "--load-format", "dummy", "text prompt"]) == 2
    assert "prompts must be token ids" in capsys.readouterr().err
    assert main(["generate", "--model", str(model), "--load-format", "dummy", "--input", str(src)]) == 0
    [row] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["prompt_token_ids"] == [5, 6, 7] and len(row["token_ids"]) == 4


def test_seed_random_gives_fresh_samples_and_the_default_repeats(capsys):
    def sample(*flags):
        assert main(["generate", "--max-tokens", "24", "--temperature", "1.0", "--top-k", "0", *flags, "And"]) == 0
        return capsys.readouterr().out

    assert sample() == sample(), "the default --seed 0 must repeat"
    assert sample("--seed", "random") != sample("--seed", "random")


def test_empty_prompt_generates_from_bos_as_the_server_does(capsys):
    """`generate ""` and the server agree (test_server.py): text "" is the BOS token alone when
    the tokenizer adds one, as in vLLM and OpenAI; a prompt with no tokens at all is rejected."""
    assert main(["generate", "--temperature", "0", "--max-tokens", "5", ""]) == 0
    assert capsys.readouterr().out.strip()


def test_messages_name_what_the_user_wrote(tmp_path, capsys):
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "hi", "max_tokens": 0}\n')
    assert main(["generate", "--input", str(lines)]) == 2
    assert f'{lines}:1: field "max_tokens" must be at least 1, got 0' in capsys.readouterr().err  # not --max-tokens
    assert main(["generate", "--max-tokens", "0", "hi"]) == 2
    assert "error: --max-tokens must be at least 1, got 0" in capsys.readouterr().err
    from jaxpaged.entrypoints.convert_cli import main as convert

    with pytest.raises(SystemExit) as done:
        convert(["--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    assert done.value.code == 2
    assert f"--hf-dir {tmp_path / 'nope'} is not a directory; give a downloaded" in capsys.readouterr().err
    plan = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    assert "(default: 80GiB)" in plan.format_help().replace("\n", " ").replace("  ", "")


def test_serve_with_two_data_parallel_replicas_answers_from_both_and_drains():
    """`jaxpaged serve --data-parallel-size 2` end to end: two engine processes start (the
    shared engines' demo-server configuration: its compiled programs are in the cache), a request
    pinned to each replica (`X-data-parallel-rank`) is answered, `/metrics` counts both, and
    SIGTERM drains and exits 0 with both engine processes gone."""
    import re

    import httpx

    flags = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jaxpaged.cli",
            "serve",
            "-dp",
            "2",
            "--port",
            "0",
            *flags,
            "--num-scheduler-steps",
            "1",
        ],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stderr), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        found = []
        while not found and server.poll() is None and time.monotonic() < deadline:
            found = [m[1] for line in list(lines) if (m := re.search(r"listening at (http://\S+)/v1", line))]
            time.sleep(0.1)
        assert found, "".join(lines)[-3000:]
        url = found[0]
        engines = [pid for pid in _children(server.pid) if _alive(pid) and "spawn_main" in _proc_file(pid, "cmdline")]
        assert len(engines) == 2, engines
        while time.monotonic() < deadline and httpx.get(f"{url}/health").status_code != 200:
            time.sleep(0.2)
        body = {"model": "jaxpaged-demo", "prompt": "And God said", "max_tokens": 4, "temperature": 0}
        texts = []
        for rank in (0, 1):
            reply = httpx.post(f"{url}/v1/completions", json=body, headers={"X-data-parallel-rank": str(rank)})
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
        assert texts[0] == texts[1]  # greedy: the same text from either replica
        metrics = httpx.get(f"{url}/metrics").text
        (prompt_tokens,) = re.findall(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", metrics, re.MULTILINE)
        tokens = httpx.post(f"{url}/tokenize", json={"model": body["model"], "prompt": body["prompt"]}).json()["tokens"]
        assert float(prompt_tokens) == 2 * len(tokens)
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, "".join(lines)[-3000:]
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in engines) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in engines)
    finally:
        server.kill()
        reader.join(10)
