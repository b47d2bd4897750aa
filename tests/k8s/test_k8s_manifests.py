"""The rendered overlays of k8s/ against the Kubernetes schema (kubernetes-validate, strict: unknown
fields are errors), the RayService against tests/k8s/rayservice.schema.json, and the project's rules:
GPUs where they belong, probes, the drain on stop, resources on every container, no secret in the
manifests, pinned images, the admin port inside the cluster."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import kubernetes_validate
import pytest
import yaml

from target_service.serving.serve_args import DRAIN_TIMEOUT_S
from tests.k8s.kustomize_render import split_image
from tests.k8s.manifests import (
    GPU,
    K8S,
    OVERLAY_IDS,
    OVERLAYS,
    ROOT,
    looks_like_secret,
    names_a_secret,
    rendered,
    string_leaves,
)

KUBERNETES_VERSION = "1.32.0"  # the schema version the manifests must satisfy (grpc probes GA in 1.27)
SCHEMA = json.loads((ROOT / "tests/k8s/rayservice.schema.json").read_text())
SECRET_NAME = "dflash-secrets"
RAY_TOKEN_SECRET = "dflash-ray-token"  # Ray's token, key auth_token (KubeRay's name for it)

overlays = pytest.mark.parametrize("overlay", OVERLAYS, ids=OVERLAY_IDS)


def _quantity(value: str | int) -> float:
    """A Kubernetes quantity in base units: "500m" -> 0.5, "2Gi" -> 2**31, "8" -> 8."""
    value = str(value)
    units = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40}
    number, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", value).groups()
    return float(number) * units.get(unit, 1)


def _k8s_validate(document: dict) -> None:
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        name = document["metadata"]["name"]
        pytest.fail(f"{document['kind']} {name}: {error.message} at {error.json_path}")


def _as_pod_template(name: str, template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


@overlays
def test_builtin_kinds_and_the_rayservice_pod_templates_satisfy_the_kubernetes_schema(overlay):
    result = rendered(overlay)
    builtin = [resource for resource in result.resources if resource["kind"] != "RayService"]
    assert {resource["kind"] for resource in builtin} >= {"Service", "PodDisruptionBudget", "ConfigMap"}
    for resource in builtin:
        _k8s_validate(resource)
    # Inside the custom resource: each pod template as a core/v1 PodTemplate, the serve Service as a
    # Service (KubeRay fills in its selector).
    for pod in result.pod_templates:
        _k8s_validate(_as_pod_template(f"{overlay}-{pod.group}", pod.template))
    serve_service = result.rayservice["spec"]["serveService"]
    _k8s_validate({"apiVersion": "v1", "kind": "Service", **serve_service})


def test_strict_kubernetes_schema_catches_a_misspelt_field():
    pod = rendered("gpu").workers[0]
    pod.ray_container["resourcez"] = pod.ray_container.pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError, match="resourcez"):
        kubernetes_validate.validate(_as_pod_template("typo", pod.template), KUBERNETES_VERSION, strict=True)


@overlays
def test_rayservice_satisfies_its_schema(overlay):
    jsonschema.validate(rendered(overlay).rayservice, SCHEMA)


@pytest.mark.parametrize("mutate, message", [
    (lambda spec: spec["rayClusterConfig"]["workerGroupSpecs"][0].update(replica=2), "replica"),
    (lambda spec: spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": 1}),
     "is not of type 'string'"),
    (lambda spec: spec["rayClusterConfig"]["workerGroupSpecs"][0].pop("maxReplicas"), "maxReplicas"),
    (lambda spec: spec.update(serveConfigV2=""), "serveConfigV2|should be non-empty|too short"),
])
def test_rayservice_schema_refuses_what_kuberay_would_prune_or_reject(mutate, message):
    rayservice = rendered("gpu").rayservice
    mutate(rayservice["spec"])
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(rayservice, SCHEMA)


def test_gpu_overlay_asks_for_gpus_on_the_workers_only():
    result = rendered("gpu")
    for pod in result.workers:
        resources = pod.ray_container["resources"]
        assert int(resources["limits"][GPU]) >= 1
        assert resources["requests"][GPU] == resources["limits"][GPU]  # extended resources: equal
        toleration = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}
        assert toleration in pod.template["spec"]["tolerations"]
        assert pod.template["spec"]["nodeSelector"]
    head = result.head.ray_container["resources"]
    assert GPU not in head["requests"] and GPU not in head["limits"]
    assert result.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"


def test_cpu_demo_asks_for_no_gpu_anywhere():
    result = rendered("cpu-demo")
    assert not [path for resource in result.resources for path, _ in string_leaves(resource) if GPU in path]
    assert all(GPU not in str(pod.template) for pod in result.pod_templates)
    assert result.serve_args["device"] == "cpu"
    assert result.serve_args["num_gpus_per_replica"] == 0


@overlays
def test_serve_replicas_fill_the_worker_pods_exactly(overlay):
    """Every worker pod must host replicas: a pod without one never passes its startup probe (the
    admin port answers only where a replica runs). Replicas per pod = what its CPU and GPU limits
    hold of one replica's num_cpus_per_replica and num_gpus_per_replica."""
    result = rendered(overlay)
    args = result.serve_args
    slots = 0
    for group, pod in zip(result.worker_groups, result.workers, strict=True):
        assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]  # fixed size
        limits = pod.ray_container["resources"]["limits"]
        cpus = _quantity(group["rayStartParams"].get("num-cpus", limits["cpu"]))
        per_pod = math.floor(cpus / args.get("num_cpus_per_replica", 1.0))
        if args.get("num_gpus_per_replica"):
            per_pod = min(per_pod, math.floor(int(limits.get(GPU, 0)) / args["num_gpus_per_replica"]))
        assert per_pod >= 1
        slots += group["replicas"] * per_pod
    assert args["replicas"] == slots
    # the head takes none: no CPU for Ray to schedule on
    assert result.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


@overlays
def test_workers_probe_health_over_http_and_the_admin_port_over_grpc(overlay):
    result = rendered(overlay)
    admin_port, http_port = result.serve_args["admin_port"], result.serve_config["http_options"]["port"]
    for pod in result.workers:
        container = pod.ray_container
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": http_port}
        assert container["startupProbe"]["grpc"] == {"port": admin_port, "service": "dflash.kvpool.v1.KVPool"}
        assert {admin_port, http_port} <= {port["containerPort"] for port in container["ports"]}
        # liveness tolerates longer than readiness before it restarts the pod
        live, ready = container["livenessProbe"], container["readinessProbe"]
        patience = {name: probe["periodSeconds"] * probe["failureThreshold"]
                    for name, probe in (("live", live), ("ready", ready))}
        assert patience["live"] > patience["ready"]
    # the head hosts no replica: KubeRay's own probes (raylet, GCS) apply there
    assert "readinessProbe" not in result.head.ray_container


@overlays
def test_workers_drain_before_they_stop(overlay):
    for pod in rendered(overlay).workers:
        script = pod.ray_container["lifecycle"]["preStop"]["exec"]["command"][-1]
        assert "ray drain-node" in script
        deadline = int(re.search(r"--deadline-remaining-seconds (\d+)", script).group(1))
        wait = int(re.search(r"sleep (\d+)", script).group(1))
        # Serve stops a draining node's replicas gracefully, DRAIN_TIMEOUT_S each, before the deadline
        assert deadline >= DRAIN_TIMEOUT_S and wait >= deadline
        assert pod.template["spec"]["terminationGracePeriodSeconds"] > wait


@overlays
def test_every_container_has_requests_and_limits(overlay):
    for pod in rendered(overlay).pod_templates:
        for container in pod.containers + pod.template["spec"].get("initContainers", []):
            resources = container["resources"]
            for kind in ("cpu", "memory"):
                assert _quantity(resources["requests"][kind]) <= _quantity(resources["limits"][kind]), \
                    (pod.group, container["name"], kind)


@overlays
def test_shared_memory_is_memory_backed_bounded_and_holds_the_object_store(overlay):
    result = rendered(overlay)
    groups = [result.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"], *result.worker_groups]
    for group, pod in zip(groups, result.pod_templates, strict=True):
        empty_dir = pod.volume("dshm")["emptyDir"]
        assert empty_dir["medium"] == "Memory"
        assert pod.mount("dshm")["mountPath"] == "/dev/shm"
        size = _quantity(empty_dir["sizeLimit"])
        assert _quantity(group["rayStartParams"]["object-store-memory"]) < size
        assert size < _quantity(pod.ray_container["resources"]["limits"]["memory"])  # counted in it


@overlays
def test_no_secret_literal_in_the_manifests(overlay):
    result = rendered(overlay)
    for secret in result.of_kind("Secret"):
        assert not secret.get("data") and not secret.get("stringData"), secret["metadata"]["name"]
    for pod in result.pod_templates:
        for container in pod.containers:
            for env in container.get("env", []):
                assert not (names_a_secret(env["name"]) and "value" in env), env["name"]
        # the keys arrive as files from a Secret made out of band (k8s/README.md)
        assert pod.volume(SECRET_NAME)["secret"]["secretName"] == SECRET_NAME
    for resource in result.resources:
        leaks = [path for path, value in string_leaves(resource) if looks_like_secret(value)]
        assert not leaks, (resource["kind"], leaks)
    committed = [path for path in K8S.rglob("*") if path.is_file() and looks_like_secret(path.read_text())]
    assert not committed


@overlays
def test_ray_runs_with_token_authentication_from_the_secret(overlay):
    result = rendered(overlay)
    auth = result.rayservice["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token", "secretName": RAY_TOKEN_SECRET}  # KubeRay reads the token there
    for pod in result.pod_templates:  # head and workers: every Ray process needs the same token
        env = {item["name"]: item for item in pod.ray_container["env"]}
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": RAY_TOKEN_SECRET, "key": "auth_token"}}  # the key KubeRay reads
        modes = [item.get("value") for container in pod.containers for item in container.get("env", [])
                 if item["name"] == "RAY_AUTH_MODE"]
        assert set(modes) == {"token"}  # no container turns it off


def test_secret_detector_flags_keys_and_passes_names():
    assert looks_like_secret("sk-proj-abc")
    assert looks_like_secret("Bearer 8f14e45fceea167a5a36dedd4bea2543")
    assert not looks_like_secret("/models/qwen3-8b-dflash-b16")
    assert not looks_like_secret("registry.example.com/dflash/dflash-serve:0.1.0")
    assert names_a_secret("DFLASH_API_KEY") and names_a_secret("DFLASH_KVPOOL_TOKEN")
    assert not names_a_secret("RAY_ADDRESS")


@overlays
def test_serve_args_read_the_keys_from_the_mounted_secret(overlay):
    result = rendered(overlay)
    args = result.serve_args
    for pod in result.pod_templates:  # the head too: Serve may build the application there
        mount = pod.mount(SECRET_NAME)
        assert mount["readOnly"] is True
        files = {f"{mount['mountPath']}/{item['path']}": item["key"]
                 for item in pod.volume(SECRET_NAME)["secret"]["items"]}
        assert files[args["api_key_file"]] == "api-key"
        assert files[args["admin_token_file"]] == "admin-token"


@overlays
def test_images_are_pinned(overlay):
    for pod in rendered(overlay).pod_templates:
        for container in pod.containers:
            _, tag, digest = split_image(container["image"])
            assert digest or (tag and tag != "latest"), container["image"]


@overlays
def test_admin_service_stays_inside_the_cluster_and_reaches_the_replicas(overlay):
    result = rendered(overlay)
    admin = result.one("Service", "dflash-admin")
    assert admin["spec"]["type"] == "ClusterIP"
    ports = {port["port"]: port["targetPort"] for port in admin["spec"]["ports"]}
    assert ports[result.serve_args["admin_port"]] == result.serve_args["admin_port"]
    assert result.serve_args["host"] == "0.0.0.0"  # the admin server binds ServeArgs.host
    for pod in result.workers:
        labels = pod.template["metadata"]["labels"]
        assert admin["spec"]["selector"].items() <= labels.items()
        container_ports = {port["containerPort"] for port in pod.ray_container["ports"]}
        assert set(ports.values()) <= container_ports
    assert not admin["spec"]["selector"].items() <= result.head.template["metadata"]["labels"].items()


@overlays
def test_http_service_and_budget_cover_the_worker_pods(overlay):
    result = rendered(overlay)
    spec = result.rayservice["spec"]
    (port,) = spec["serveService"]["spec"]["ports"]
    assert port["port"] == port["targetPort"] == result.serve_config["http_options"]["port"]
    assert port["name"] == "serve"  # KubeRay finds the serving port by this name
    assert spec["excludeHeadPodFromServeSvc"] is True
    budget = result.one("PodDisruptionBudget", "dflash-workers")
    for pod in result.workers:
        assert budget["spec"]["selector"]["matchLabels"].items() <= pod.template["metadata"]["labels"].items()


@overlays
def test_ray_version_is_the_images(overlay):
    dockerfile = (ROOT / "Dockerfile").read_text()
    (pinned,) = set(re.findall(r"ray\[serve\]==([0-9.]+)", dockerfile))
    assert rendered(overlay).rayservice["spec"]["rayClusterConfig"]["rayVersion"] == pinned


def test_gpu_overlay_reads_the_models_from_a_read_only_volume():
    result = rendered("gpu")
    args = result.serve_args
    for pod in result.workers:
        mount = pod.mount("models")
        assert mount["readOnly"] is True
        claim = pod.volume("models")["persistentVolumeClaim"]
        assert claim == {"claimName": "dflash-models", "readOnly": True}
        for field in ("target", "drafter"):
            assert args[field].startswith(mount["mountPath"] + "/")
    claim = result.one("PersistentVolumeClaim", "dflash-models")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # old and new cluster mount it during an upgrade


def test_gpu_workers_keep_their_compile_cache_on_a_volume_triton_writes_to():
    """A pod that restarts loads the kernels its replicas compiled before (issue 31)."""
    result = rendered("gpu")
    for pod in result.workers:
        mount = pod.mount("compile-cache")
        assert not mount.get("readOnly")
        assert pod.volume("compile-cache")["persistentVolumeClaim"] == {"claimName": "dflash-compile-cache"}
        env = {item["name"]: item.get("value") for item in pod.ray_container["env"]}
        assert env["TRITON_CACHE_DIR"] == mount["mountPath"]
    claim = result.one("PersistentVolumeClaim", "dflash-compile-cache")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker pod, old and new, writes it


def test_optional_service_monitor_scrapes_the_serve_service():
    monitor = yaml.safe_load((K8S / "optional/servicemonitor.yaml").read_text())
    serve_service = rendered("cpu-demo").rayservice["spec"]["serveService"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= serve_service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["port"] in {port["name"] for port in serve_service["spec"]["ports"]}
