"""The offline kustomize renderer (tests/k8s/kustomize_render.py): a hand-made base and overlay with
their expected output written out, the refusals that keep k8s/ within what it renders, and, where
`kubectl kustomize` is on the machine, the same output as kustomize itself for the hand-made case and
every kustomization under k8s/."""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import pytest
import yaml

from tests.k8s.kustomize_render import KustomizeError, apply_json6902, render, split_image
from tests.k8s.manifests import K8S, OVERLAY_IDS, OVERLAYS

KUBECTL = shutil.which("kubectl")


def _write(directory, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


@pytest.fixture
def hand_made(tmp_path):
    """A base (a Deployment and a custom resource holding a pod template) and an overlay using every
    supported feature once."""
    _write(tmp_path, {
        "base/kustomization.yaml": """
            resources:
            - app.yaml
        """,
        "base/app.yaml": """
            apiVersion: apps/v1
            kind: Deployment
            metadata: {name: web}
            spec:
              template:
                spec:
                  containers:
                  - {name: web, image: web:1.0}
                  - {name: side, image: "registry.local:5000/tools/side:2"}
                  volumes:
                  - {name: a, emptyDir: {}}
            ---
            apiVersion: example.com/v1
            kind: Widget
            metadata: {name: w}
            spec:
              config: placeholder
              nested:
                template:
                  spec:
                    initContainers:
                    - {name: init, image: web}
        """,
        "overlay/kustomization.yaml": """
            namespace: demo
            resources:
            - ../base
            - extra.yaml
            images:
            - {name: web, newName: example.org/web, newTag: "1.1"}
            configMapGenerator:
            - name: settings
              files:
              - conf=settings.yaml
              - settings.yaml
              literals:
              - mode=fast
              options: {disableNameSuffixHash: true}
            patches:
            - path: ops.yaml
              target: {kind: Deployment, name: web}
            - target: {kind: Widget}
              patch: |
                - {op: remove, path: /spec/nested/template/spec/initContainers/0/name}
            replacements:
            - source: {kind: ConfigMap, name: settings, fieldPath: data.conf}
              targets:
              - select: {kind: Widget, name: w}
                fieldPaths: [spec.config]
        """,
        "overlay/extra.yaml": """
            apiVersion: v1
            kind: Namespace
            metadata: {name: demo}
        """,
        "overlay/settings.yaml": "a: 1\n",
        "overlay/ops.yaml": """
            - {op: add, path: /spec/template/spec/volumes/-, value: {name: b, emptyDir: {}}}
            - {op: add, path: /spec/template/spec/containers/0/args, value: [--x]}
            - {op: replace, path: /spec/template/spec/containers/1/name, value: sidecar}
            - {op: test, path: /spec/template/spec/volumes/0/name, value: a}
            - {op: add, path: /spec/template/spec/volumes/0, value: {name: first, emptyDir: {}}}
        """,
    })
    return tmp_path


EXPECTED = [
    {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web", "namespace": "demo"},
     "spec": {"template": {"spec": {
         "containers": [{"name": "web", "image": "example.org/web:1.1", "args": ["--x"]},
                        {"name": "sidecar", "image": "registry.local:5000/tools/side:2"}],
         "volumes": [{"name": "first", "emptyDir": {}}, {"name": "a", "emptyDir": {}},
                     {"name": "b", "emptyDir": {}}]}}}},
    {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w", "namespace": "demo"},
     "spec": {"config": "a: 1\n",
              "nested": {"template": {"spec": {"initContainers": [{"image": "example.org/web:1.1"}]}}}}},
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}},
    {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "settings", "namespace": "demo"},
     "data": {"conf": "a: 1\n", "settings.yaml": "a: 1\n", "mode": "fast"}},
]


def _keyed(resources) -> dict:
    return {(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]): r for r in resources}


def test_hand_made_overlay_renders_every_supported_feature(hand_made):
    # JSON 6902 ops in order, namespace on all but the Namespace, images at any depth (a custom
    # resource's initContainers too) and past a registry port, files and literals in the ConfigMap,
    # and the replacement carrying the file's text into the custom resource.
    assert render(hand_made / "overlay") == EXPECTED


@pytest.mark.parametrize("kustomization, message", [
    ("resources: [../base]\nnamePrefix: x-\n", "unsupported kustomization fields"),
    ("resources: [../base]\npatches:\n- target: {kind: Deployment}\n  patch: 'spec: {replicas: 2}'\n",
     "not strategic merge"),
    ("resources: [../base]\nconfigMapGenerator:\n- {name: c, literals: [a=b]}\n", "disableNameSuffixHash"),
    ("resources: [../base]\npatches:\n- target: {kind: Deployment}\n"
     "  patch: '[{op: replace, path: /spec/nope, value: 1}]'\n", "no field 'nope'"),
    ("resources: [../base]\npatches:\n- target: {kind: Gadget}\n  patch: '[{op: remove, path: /spec}]'\n",
     "matches no resource"),
    ("resources: [../base]\nreplacements:\n- source: {kind: Deployment, name: web, fieldPath: spec}\n"
     "  targets:\n  - select: {kind: Widget}\n    fieldPaths: [spec.missing]\n", "does not exist"),
    ("resources: [../base, ../base]\n", "defined twice"),
])
def test_refuses_what_it_does_not_render_like_kustomize(hand_made, kustomization, message):
    (hand_made / "other").mkdir()
    (hand_made / "other" / "kustomization.yaml").write_text(kustomization)
    with pytest.raises(KustomizeError, match=message):
        render(hand_made / "other")


def test_json6902_add_inserts_and_appends_replace_needs_the_field():
    document = {"a": [1, 2]}
    apply_json6902(document, {"op": "add", "path": "/a/1", "value": 9})
    apply_json6902(document, {"op": "add", "path": "/a/-", "value": 3})
    apply_json6902(document, {"op": "add", "path": "/b~1c", "value": {}})
    assert document == {"a": [1, 9, 2, 3], "b/c": {}}
    with pytest.raises(KustomizeError):
        apply_json6902(document, {"op": "replace", "path": "/a/4", "value": 0})
    with pytest.raises(KustomizeError):
        apply_json6902(document, {"op": "test", "path": "/a/0", "value": 2})


@pytest.mark.parametrize("reference, parts", [
    ("web", ("web", None, None)),
    ("web:1.0", ("web", "1.0", None)),
    ("registry.local:5000/tools/side", ("registry.local:5000/tools/side", None, None)),
    ("registry.local:5000/tools/side:2", ("registry.local:5000/tools/side", "2", None)),
    ("web:1@sha256:abc", ("web", "1", "sha256:abc")),
])
def test_split_image_tells_a_registry_port_from_a_tag(reference, parts):
    assert split_image(reference) == parts


def _kubectl_kustomize(directory) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True,
                            timeout=60, check=True)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize built in) is not on this machine")
@pytest.mark.parametrize("directory", ["base", *(f"overlays/{name}" for name in OVERLAYS)],
                         ids=["base", *OVERLAY_IDS])
def test_renders_k8s_like_kubectl_kustomize(directory):
    assert _keyed(render(K8S / directory)) == _keyed(_kubectl_kustomize(K8S / directory))


@pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize built in) is not on this machine")
def test_hand_made_expectations_are_kustomizes(hand_made):
    assert _keyed(_kubectl_kustomize(hand_made / "overlay")) == _keyed(EXPECTED)
