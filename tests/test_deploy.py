"""deploy/ agrees with Kubernetes and with the server (no GPU, docker or network needed).

- Every manifest in deploy/kubernetes/ validates, strictly (unknown fields fail), against the
  Kubernetes OpenAPI schemas that kubernetes-validate bundles.
- The container's args parse with `jaxpaged serve`'s own parser (flags spelt out in full); the
  container port, probe ports, Service target and Prometheus port are that `--port`; probes use
  `/health` (readiness) and `/live` (liveness, startup), routes of the app that need no API key;
  the grace period outlasts preStop plus `--shutdown-timeout`; the model and the compilation cache
  lie on the PVCs of pvc.yaml; the GPU limit is set; the API key reaches the server through its
  environment variable from secret.yaml's Secret, never through the process arguments; the HPA
  scales this Deployment on a gauge the server exports.
- deploy/Dockerfile installs `[cuda12,server]`, runs as uid 1000, keeps the cache on a VOLUME,
  and its ENTRYPOINT + CMD parse with the same parser.
"""

import asyncio
import functools
import inspect
import json
import os
import re
import shlex
import unittest.mock
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import jaxpaged.server.app
import jaxpaged.server.metrics
from jaxpaged.cli import _subparser, build_parser
from jaxpaged.server.cli import API_KEY_ENV

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
ROUTER_MANIFESTS = sorted((DEPLOY / "kubernetes" / "router").glob("*.yaml"))
K8S_VERSION = "1.37"  # the newest Kubernetes that kubernetes-validate 1.37 bundles schemas for
RESOURCES = [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]
(DEPLOYMENT,) = [r for r in RESOURCES if r["kind"] == "Deployment"]
POD = DEPLOYMENT["spec"]["template"]["spec"]
CONTAINER = POD["containers"][0]
ROUTES = set(re.findall(r"@app\.(?:get|api_route)\(\s*\"(/[^\"]*)\"", inspect.getsource(jaxpaged.server.app)))


def of_kind(kind: str) -> list[dict]:
    return [r for r in RESOURCES if r["kind"] == kind]


def serve_args(argv: list[str], env: dict[str, str]):
    """`jaxpaged serve ARGV` parsed (no abbreviated flags) in the container's environment,
    `$(VAR)` replaced as the kubelet does."""
    with unittest.mock.patch.dict(os.environ, env):
        parser = build_parser()
        _subparser(parser, "serve").allow_abbrev = False
        return parser.parse_args(["serve", *(re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in argv)])


@functools.cache
def args():
    """The Deployment's container args, parsed with its env vars set; each `$(VAR)` must be one of them."""
    return serve_args(CONTAINER["args"], {e["name"]: "sk-test" for e in CONTAINER.get("env", [])})


@pytest.mark.parametrize("path", MANIFESTS + ROUTER_MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas(path):
    docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    assert docs
    for doc in docs:
        assert kubernetes_validate.validate(doc, K8S_VERSION, strict=True) == K8S_VERSION


def test_validation_rejects_a_misspelt_field():
    broken = {**DEPLOYMENT, "spec": {**DEPLOYMENT["spec"], "replica": 1}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_every_kind_is_there():
    assert sorted(r["kind"] for r in RESOURCES) == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PersistentVolumeClaim",
        "PersistentVolumeClaim",
        "Secret",
        "Service",
    ]


def test_container_runs_jaxpaged_serve_on_a_gpu():
    assert CONTAINER.get("command") in (None, ["jaxpaged", "serve"])  # None: the image's ENTRYPOINT
    a = args()
    assert a.command == "serve" and a.host == "0.0.0.0" and a.model_tag and a.api_key == "sk-test"
    assert CONTAINER["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_ports_and_probes_match_the_server():
    port = args().port
    (named,) = CONTAINER["ports"]
    assert named["containerPort"] == port
    probes = {kind: CONTAINER[f"{kind}Probe"]["httpGet"] for kind in ("readiness", "liveness", "startup")}
    assert {kind: p["path"] for kind, p in probes.items()} == {
        "readiness": "/health",
        "liveness": "/live",
        "startup": "/live",
    }
    assert all(p["port"] in (port, named["name"]) for p in probes.values())
    assert {p["path"] for p in probes.values()} <= ROUTES, f"routes of jaxpaged.server.app: {sorted(ROUTES)}"
    startup = CONTAINER["startupProbe"]
    assert startup["failureThreshold"] * startup["periodSeconds"] >= 600  # compiling takes minutes
    (service,) = of_kind("Service")
    assert service["spec"]["selector"].items() <= DEPLOYMENT["spec"]["template"]["metadata"]["labels"].items()
    assert [p["targetPort"] for p in service["spec"]["ports"]] in ([port], [named["name"]])
    annotations = DEPLOYMENT["spec"]["template"]["metadata"].get("annotations", {})
    assert annotations.get("prometheus.io/port", str(port)) == str(port)
    assert annotations.get("prometheus.io/path", "/metrics") in ROUTES


def test_grace_period_outlasts_the_drain():
    pre_stop = CONTAINER.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert POD["terminationGracePeriodSeconds"] > sleep + args().shutdown_timeout


def test_model_and_cache_lie_on_the_claims():
    claims = {r["metadata"]["name"] for r in of_kind("PersistentVolumeClaim")}
    volumes = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in POD["volumes"]}
    for path in (args().model_tag, args().compilation_cache_dir):
        mounts = [m for m in CONTAINER["volumeMounts"] if f"{path}/".startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts and volumes[mounts[0]["name"]] in claims, path


def test_api_key_comes_from_the_secret():
    (secret,) = of_kind("Secret")
    assert "--api-key" not in CONTAINER["args"]  # the server reads it from the environment, not argv
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in CONTAINER["env"] if e["name"] == API_KEY_ENV]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]


def test_probe_paths_need_no_api_key():
    async def route(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def status(path: str) -> int:
        sent = []
        guard = jaxpaged.server.app._Guard(route, api_key="sk-test", max_body_bytes=1024)
        scope = {"type": "http", "method": "GET", "path": path, "headers": []}  # as ASGI servers send it
        await guard(scope, None, lambda m: asyncio.sleep(0, sent.append(m)))
        return sent[0]["status"]

    assert {path: asyncio.run(status(path)) for path in ("/health", "/live", "/v1/models")} == {
        "/health": 200,
        "/live": 200,
        "/v1/models": 401,
    }


def test_hpa_scales_the_deployment_on_an_exported_gauge():
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
    assert target["name"] == DEPLOYMENT["metadata"]["name"]
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]  # the Prometheus adapter renames `vllm:x` to `vllm_x`
    assert metric["type"] == "Pods" and name.startswith("vllm_")
    assert f'"{name.replace("vllm_", "vllm:", 1)}", "gauge"' in inspect.getsource(jaxpaged.server.metrics)


def test_dockerfile():
    text = re.sub(r"\\\n", " ", (DEPLOY / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    instructions = [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]
    last = dict(instructions)

    def exec_form(value: str) -> list[str]:
        return json.loads(value) if value.startswith("[") else shlex.split(value)

    assert any(n == "RUN" and "pip install" in v and "[cuda12,server]" in v for n, v in instructions)
    uid = last["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) == POD["securityContext"]["runAsUser"] == 1000
    volumes = [v for n, value in instructions if n == "VOLUME" for v in exec_form(value)]
    assert "/cache" in volumes
    entrypoint, cmd = exec_form(last["ENTRYPOINT"]), exec_form(last["CMD"])
    assert entrypoint[:2] == ["jaxpaged", "serve"]
    a = serve_args(entrypoint[2:] + cmd, {})
    assert a.host == "0.0.0.0" and str(a.port) in last["EXPOSE"].split()
    assert any(f"{a.compilation_cache_dir}/".startswith(f"{v.rstrip('/')}/") for v in volumes)


ROUTER_RESOURCES = [doc for path in ROUTER_MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def router_resource(kind: str) -> dict:
    (resource,) = [r for r in ROUTER_RESOURCES if r["kind"] == kind]
    return resource


def router_flags() -> dict[str, str | None]:
    """The router container's flags: each `--flag` to the value after it (None for a switch)."""
    argv = router_resource("Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
    flags = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            flags[arg] = None if following.startswith("--") else following
    return flags


def test_the_router_finds_every_server_pod_by_itself():
    """deploy/kubernetes/router/: vllm-router's Kubernetes mode selects the pods of deployment.yaml
    (their labels, their `--port`) in its own namespace, with the rights to watch them; it sends
    the servers' API key from the same Secret; its Service reaches its port; its probes are the
    router's own routes (the flags parse with the router's parser: tests/test_vllm_tools.py)."""
    flags = router_flags()
    assert "--service-discovery" in flags and flags["--policy"] == "cache_aware"
    key, _, value = flags["--selector"].partition("=")
    assert DEPLOYMENT["spec"]["template"]["metadata"]["labels"][key] == value
    assert int(flags["--service-discovery-port"]) == args().port
    pod = router_resource("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["valueFrom"] for e in container["env"]}
    assert flags["--service-discovery-namespace"] == "$(POD_NAMESPACE)"
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    (server_key,) = [e["valueFrom"] for e in CONTAINER["env"] if e["name"] == API_KEY_ENV]
    assert flags["--api-key"] == f"$({API_KEY_ENV})" and env[API_KEY_ENV] == server_key
    role, binding = router_resource("Role"), router_resource("RoleBinding")
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]} in role["rules"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"kind": "ServiceAccount", "name": pod["serviceAccountName"]} in binding["subjects"]
    assert router_resource("ServiceAccount")["metadata"]["name"] == pod["serviceAccountName"]
    service = router_resource("Service")
    labels = router_resource("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (port,) = container["ports"]
    assert port["containerPort"] == int(flags["--port"]) and service["spec"]["ports"][0]["targetPort"] == port["name"]
    assert {container[f"{k}Probe"]["httpGet"]["path"] for k in ("liveness", "readiness")} == {"/liveness", "/readiness"}


def test_the_router_image_is_the_router_ci_runs_behind():
    pinned = re.findall(r"vllm-router==([\w.]+)", (DEPLOY / "Dockerfile.router").read_text())
    in_ci = re.findall(r"vllm-router==([\w.]+)", (DEPLOY.parent / ".ci" / "run").read_text())
    assert pinned and pinned == in_ci[:1]
    assert router_resource("Deployment")["spec"]["template"]["spec"]["containers"][0].get("command") is None
