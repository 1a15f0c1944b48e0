"""`jaxpaged bench serve` against a `jaxpaged serve` of its own, at several request rates.

    python -m benchmarks.gpu.serve_load --model llama-3.1-8b --rates 4,16,inf --result-dir DIR \\
        --output-json serve.json --bench-flags "--dataset-name random --num-prompts 200" -- ENGINE FLAGS...

1. Start `jaxpaged serve MODEL ENGINE FLAGS` on a free port (its output is this script's) and wait
   for `/health` to answer 200 (the engine loaded and compiled).
2. For each rate, `jaxpaged bench serve --request-rate RATE --save-result` into DIR; rewrite
   `--output-json` after each (the runs so far, vLLM's keys without the per-request lists).
3. `jaxpaged bench plot` of the saved results into DIR/latency_vs_throughput.png; stop the server.

The client commands run in this process (they import no JAX; one interpreter start, not four).

The server needs fastapi, uvicorn and pydantic. Where they are missing (the GPU machine's image
lacks them) and the repository holds `.whl/` (made by `gpu_run.py --prepare-wheels`, carried with the
device call), they are installed from it into a private directory for the server alone.
"""

import argparse
import glob
import importlib.util
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = (sys.executable, "-m", "jaxpaged.cli")
SERVER_MODULES = ("fastapi", "uvicorn", "pydantic", "starlette")
WHEEL_DIR = os.path.join(ROOT, ".whl")
PRIVATE_SITE = "/tmp/jaxpaged-server-site"
PER_REQUEST_KEYS = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "generated_texts", "errors")


def server_env() -> dict:
    """The environment of the server: the repository on the path, and the server's packages
    from `.whl/` when this Python lacks them.

    Raises:
      RuntimeError: a server package is missing and there are no wheels to install it from.
    """
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    missing = [m for m in SERVER_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return env
    wheels = sorted(glob.glob(os.path.join(WHEEL_DIR, "*.whl")))
    if not wheels:
        raise RuntimeError(
            f"jaxpaged serve needs {', '.join(missing)}, missing here, and {WHEEL_DIR} holds no wheels: run "
            "`python -m benchmarks.gpu_run --prepare-wheels` on a machine with network and carry .whl"
        )
    print(
        f"installing {len(wheels)} wheels from {WHEEL_DIR} into {PRIVATE_SITE} (missing: {', '.join(missing)})",
        flush=True,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--upgrade",
            "--target",
            PRIVATE_SITE,
            *wheels,
        ],
        check=True,
    )
    env["PYTHONPATH"] = os.pathsep.join((PRIVATE_SITE, env["PYTHONPATH"]))
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen) -> float:
    """Seconds until `url/health` answers 200.

    Raises:
      RuntimeError: the server exited first.
    """
    start = time.perf_counter()
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"jaxpaged serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - start
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)


def stop(server: subprocess.Popen) -> None:
    """SIGINT (a graceful drain), then SIGKILL after 30 s."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--rates", default="4,16,inf", help="request rates, comma-separated")
    parser.add_argument("--bench-flags", default="", help="dataset flags of every bench serve, one string")
    parser.add_argument("--result-dir", required=True)
    parser.add_argument("--output-json", required=True)
    parser.add_argument("engine_flags", nargs=argparse.REMAINDER, help="after --: the server's engine flags")
    args = parser.parse_args(argv)
    engine_flags = args.engine_flags[1:] if args.engine_flags[:1] == ["--"] else args.engine_flags
    os.makedirs(args.result_dir, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    summary = {"model": args.model, "engine_flags": engine_flags, "rates": args.rates.split(","), "runs": []}
    server = subprocess.Popen(
        [*CLI, "serve", args.model, "--port", str(port), "--uvicorn-log-level", "warning", *engine_flags],
        env=server_env(),
    )
    try:
        summary["server_ready_s"] = round(wait_healthy(url, server), 1)
        print(f"jaxpaged serve ready at {url} after {summary['server_ready_s']} s", flush=True)
        from jaxpaged.cli import main as jaxpaged_cli

        paths = []
        for rate in summary["rates"]:
            name = f"serve_{rate}qps.json"
            returncode = jaxpaged_cli(
                [
                    "bench",
                    "serve",
                    "--port",
                    str(port),
                    "--request-rate",
                    rate,
                    "--disable-tqdm",
                    *shlex.split(args.bench_flags),
                    "--save-result",
                    "--result-dir",
                    args.result_dir,
                    "--result-filename",
                    name,
                ]
            )
            path = os.path.join(args.result_dir, name)
            if returncode != 0 and not os.path.isfile(path):
                raise RuntimeError(f"bench serve at rate {rate} exited with {returncode} and saved nothing")
            with open(path) as f:
                result = json.load(f)
            summary["runs"].append({k: v for k, v in result.items() if k not in PER_REQUEST_KEYS})
            paths.append(path)
            with open(args.output_json, "w") as f:
                json.dump(summary, f, indent=1)
        chart = os.path.join(args.result_dir, "latency_vs_throughput.png")
        if jaxpaged_cli(["bench", "plot", *paths, "--output", chart]) != 0:
            raise RuntimeError(f"bench plot of {paths} failed")
        summary["plot"] = chart
    finally:
        stop(server)
        with open(args.output_json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if all(r["failed"] == 0 for r in summary["runs"]) and "plot" in summary else 1


if __name__ == "__main__":
    sys.exit(main())
