"""The load tools vLLM's users run, against `jaxpaged serve` (issue 45): guidellm's current release
(0.8.1, the tool vLLM's docs point to) completes its runs with no errors, on chat, completions and
responses, streamed as it streams (`stream_options` with vLLM's `continuous_usage_stats`), behind an API key.

guidellm needs torch, which the server-only venv this file runs in (CI stage 3) must not have: it
is installed in a venv of its own and run as a subprocess, found through `$JAXPAGED_GUIDELLM`:

    python3 -m venv .venv-tools && .venv-tools/bin/pip install torch==2.13.0 guidellm==0.8.1
    JAXPAGED_GUIDELLM=.venv-tools/bin/guidellm pytest tests/test_vllm_tools.py
"""

import json
import os
import subprocess

import pytest

GUIDELLM = os.environ.get("JAXPAGED_GUIDELLM")
if not (GUIDELLM and os.access(GUIDELLM, os.X_OK)):  # shown as skipped, with why (CI's stage 3 runs it)
    pytest.skip(
        "needs guidellm in a venv of its own (it needs torch): see this file's docstring", allow_module_level=True
    )

from jaxpaged.entrypoints.cli_flags import DEMO_MODEL_DIR  # noqa: E402 (after the skip)

KEY = "sk-tools"


@pytest.fixture(scope="module")
def served(demo_server):
    served = demo_server.serve("demo", api_key=KEY)
    yield served
    served.close()


def guidellm(url: str, out: str, request_format: str, profile: str, requests: int) -> dict:
    """One guidellm run of `requests` synthetic requests (32 prompt tokens, 8 out, the demo model's
    tokenizer); its JSON report's first benchmark."""
    argv = [
        GUIDELLM,
        "run",
        f"--backend=kind=openai_http,target={url},request_format={request_format},api_key={KEY}",
        f"--profile=kind={profile}",
        f"--constraint=kind=max_requests,count={requests}",
        "--data=kind=synthetic_text,prompt_tokens=32,output_tokens=8",
        f"--tokenizer=kind=hf_auto,model={DEMO_MODEL_DIR}",
        f"--output=kind=json,path={out}",
        "--disable-console",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    with open(out) as f:
        return json.load(f)["benchmarks"][0]


@pytest.mark.parametrize(
    ("request_format", "profile"),
    [
        ("/v1/chat/completions", "concurrent,streams=4"),
        ("/v1/completions", "synchronous"),
        ("/v1/responses", "concurrent,streams=2"),
    ],
)
def test_guidellm_completes_its_run_with_no_errors(served, tmp_path, request_format, profile):
    report = guidellm(served.url, str(tmp_path / "report.json"), request_format, profile, requests=8)
    assert report["scheduler_metrics"]["requests_made"] == {"successful": 8, "errored": 0, "incomplete": 0, "total": 8}
    output_tokens = report["metrics"]["output_token_count"]["successful"]  # counted from our usage
    assert output_tokens["total_sum"] == 8 * 8, output_tokens
