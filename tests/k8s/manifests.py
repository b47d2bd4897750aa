"""The rendered overlays of k8s/ and the parts of them the tests look at.

Each overlay is rendered once (tests/k8s/kustomize_render.py) and handed out as a `Rendered`: the
resources, the RayService, its pod templates, and the Ray Serve config it carries.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from typing import Any

import yaml
from tiers import ROOT

from tests.k8s.kustomize_render import render

K8S = ROOT / "k8s"
OVERLAYS = ("cpu-demo", "gpu")
# Test ids: tests/conftest.py skips every test with a keyword "gpu" on machines without CUDA.
OVERLAY_IDS = [f"{name}-overlay" for name in OVERLAYS]
GPU = "nvidia.com/gpu"


@dataclass(frozen=True)
class PodTemplate:
    group: str  # "head", or the worker group's name
    template: dict
    replicas: int  # pods of this template

    @property
    def containers(self) -> list[dict]:
        return self.template["spec"]["containers"]

    @property
    def ray_container(self) -> dict:  # KubeRay runs Ray in the first container
        return self.containers[0]

    def volume(self, name: str) -> dict:
        return next(volume for volume in self.template["spec"].get("volumes", []) if volume["name"] == name)

    def mount(self, name: str) -> dict:
        return next(mount for mount in self.ray_container.get("volumeMounts", []) if mount["name"] == name)


@dataclass(frozen=True)
class Rendered:
    overlay: str
    resources: list[dict]

    def of_kind(self, kind: str) -> list[dict]:
        return [resource for resource in self.resources if resource["kind"] == kind]

    def one(self, kind: str, name: str) -> dict:
        (resource,) = [r for r in self.of_kind(kind) if r["metadata"]["name"] == name]
        return resource

    @property
    def rayservice(self) -> dict:
        (rayservice,) = self.of_kind("RayService")
        return rayservice

    @property
    def head(self) -> PodTemplate:
        head = self.rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
        return PodTemplate("head", head["template"], 1)

    @property
    def worker_groups(self) -> list[dict]:
        return self.rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]

    @property
    def workers(self) -> list[PodTemplate]:
        return [PodTemplate(group["groupName"], group["template"], group.get("replicas", 0))
                for group in self.worker_groups]

    @property
    def pod_templates(self) -> list[PodTemplate]:
        return [self.head, *self.workers]

    @property
    def serve_config(self) -> dict:
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def serve_args(self) -> dict:
        (application,) = self.serve_config["applications"]
        return application["args"]


@functools.cache
def _render(overlay: str) -> tuple[dict, ...]:
    return tuple(render(K8S / "overlays" / overlay))


def rendered(overlay: str) -> Rendered:
    """A fresh copy of the overlay's resources (tests may change theirs)."""
    return Rendered(overlay, copy.deepcopy(list(_render(overlay))))


def string_leaves(node: Any, path: str = ""):
    """(path, value) of every string in a document, keys excluded."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield from string_leaves(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from string_leaves(value, f"{path}[{index}]")
    elif isinstance(node, str):
        yield path, node


# A key is a long run without separators: 20+ characters of base64 or hex with letters and digits.
# Names (qwen3-8b-dflash-b16, registry.example.com/...) are short runs between "-", "_", "." or "/".
_RUN = re.compile(r"[A-Za-z0-9+]{20,}")
_KEY_PREFIXES = ("sk-", "ghp_", "xoxb-", "AKIA", "eyJ")  # OpenAI, GitHub, Slack, AWS, a JWT
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIALS?)$", re.IGNORECASE)


def looks_like_secret(value: str) -> bool:
    """Whether a string holds something shaped like an API key or token (an image digest is not)."""
    value = re.sub(r"sha256:[0-9a-f]{64}", "", value)
    if any(prefix in value for prefix in _KEY_PREFIXES):
        return True
    return any(re.search(r"[A-Za-z]", run) and re.search(r"[0-9]", run) for run in _RUN.findall(value))


def names_a_secret(name: str) -> bool:
    """Whether an environment variable's name says it holds a secret (DFLASH_API_KEY, ..._TOKEN)."""
    return bool(_SECRET_NAME.search(name))
