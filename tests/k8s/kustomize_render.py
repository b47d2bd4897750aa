"""Render a kustomization the way `kustomize build` does, for exactly the features k8s/ uses.

No kustomize binary installs from the registries this project reaches (PyPI, Debian, npm), so CI
renders with this instead; where `kubectl kustomize` happens to be on the machine, a test renders
every overlay with both and compares them (tests/k8s/test_kustomize_render.py).

Supported, and nothing else (anything else in a kustomization.yaml is an error, so the manifests
cannot drift past what this renders):

- `resources`: YAML files (one or more documents) and directories holding a kustomization.yaml,
  rendered recursively;
- `configMapGenerator`: `files` (`key=path` or `path`) and `literals` (`key=value`), only with
  `options: {disableNameSuffixHash: true}` (kustomize's name hash is not reproduced);
- `patches`: JSON 6902 operations (add, remove, replace, test), from `path` or inline `patch`, on
  the resources matching `target` (kind, name); strategic-merge patches are refused;
- `namespace`: set on every namespaced resource;
- `images`: `name` -> `newName`, `newTag`, `digest`, on every `image` of a `containers` or
  `initContainers` list at any depth (custom resources included, as kustomize does);
- `replacements`: a `source` (kind, name, dotted `fieldPath`) copied into `targets` (`select`
  kind and name; dotted `fieldPaths`); the target fields must exist.

Order, as kustomize applies them within one kustomization: resources (each base fully rendered),
generators, patches, namespace, images, replacements.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "namespace", "images",
                  "replacements"}
CLUSTER_SCOPED_KINDS = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                        "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass",
                        "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}

Resource = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render (or kustomize would refuse)."""


def render(directory: str | Path) -> list[Resource]:
    """The resources `kustomize build directory` prints, in the order they were accumulated."""
    directory = Path(directory)
    kustomization = _load_kustomization(directory)
    resources: list[Resource] = []
    for entry in kustomization.get("resources", []):
        resources.extend(_load_resource(directory / entry))
    for generator in kustomization.get("configMapGenerator", []):
        resources.append(_config_map(directory, generator))
    _check_unique(resources, directory)
    for patch in kustomization.get("patches", []):
        _apply_patch(directory, patch, resources)
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED_KINDS:
                resource.setdefault("metadata", {})["namespace"] = kustomization["namespace"]
    for image in kustomization.get("images", []):
        for resource in resources:
            _set_images(resource, image)
    for replacement in kustomization.get("replacements", []):
        _replace(replacement, resources)
    return resources


def render_text(directory: str | Path) -> str:
    """`render` as one multi-document YAML text."""
    return yaml.safe_dump_all(render(directory), sort_keys=False)


def _load_kustomization(directory: Path) -> dict:
    for name in KUSTOMIZATION_FILES:
        path = directory / name
        if path.is_file():
            kustomization = yaml.safe_load(path.read_text()) or {}
            unknown = set(kustomization) - SUPPORTED_KEYS
            if unknown:
                raise KustomizeError(f"{path}: unsupported kustomization fields {sorted(unknown)}")
            return kustomization
    raise KustomizeError(f"{directory} has no kustomization.yaml")


def _load_resource(path: Path) -> list[Resource]:
    if path.is_dir():
        return render(path)
    if not path.is_file():
        raise KustomizeError(f"resource {path} does not exist")
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for doc in documents:
        if not isinstance(doc, dict) or "kind" not in doc or "name" not in doc.get("metadata", {}):
            raise KustomizeError(f"{path}: every document needs a kind and metadata.name")
    return documents


def _config_map(directory: Path, generator: dict) -> Resource:
    unknown = set(generator) - {"name", "files", "literals", "options"}
    if unknown:
        raise KustomizeError(f"configMapGenerator {generator.get('name')}: unsupported fields "
                             f"{sorted(unknown)}")
    if generator.get("options") != {"disableNameSuffixHash": True}:
        raise KustomizeError(f"configMapGenerator {generator['name']}: only options {{disableNameSuffixHash: "
                             "true}} is supported (the name hash is not reproduced)")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, file = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / file).read_text()
    for entry in generator.get("literals", []):
        key, _, value = entry.partition("=")
        data[key] = value
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]}, "data": data}


def _check_unique(resources: list[Resource], directory: Path) -> None:
    seen = set()
    for resource in resources:
        key = (resource["kind"], resource["metadata"].get("namespace"), resource["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{directory}: {key} is defined twice")
        seen.add(key)


def _matches(resource: Resource, selector: dict) -> bool:
    unknown = set(selector) - {"kind", "name"}
    if unknown:
        raise KustomizeError(f"unsupported selector fields {sorted(unknown)}")
    return (selector.get("kind", resource["kind"]) == resource["kind"]
            and selector.get("name", resource["metadata"]["name"]) == resource["metadata"]["name"])


def _apply_patch(directory: Path, patch: dict, resources: list[Resource]) -> None:
    if set(patch) - {"path", "patch", "target"} or ("path" in patch) == ("patch" in patch):
        raise KustomizeError(f"a patch needs exactly one of path or patch, and a target: {patch}")
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    operations = yaml.safe_load(text)
    if not isinstance(operations, list):
        raise KustomizeError(f"{patch.get('path', 'inline patch')}: only JSON 6902 patches (a list of "
                             "operations) are supported, not strategic merge")
    if "target" not in patch:
        raise KustomizeError("a JSON 6902 patch needs a target")
    targets = [resource for resource in resources if _matches(resource, patch["target"])]
    if not targets:
        raise KustomizeError(f"patch target {patch['target']} matches no resource")
    for resource in targets:
        for operation in operations:
            apply_json6902(resource, operation)


def apply_json6902(document: Any, operation: dict) -> None:
    """One RFC 6902 operation (add, remove, replace, test) on `document`, in place."""
    op, tokens = operation["op"], _pointer(operation["path"])
    if not tokens:
        raise KustomizeError("operations on the whole document are not supported")
    parent = document
    for token in tokens[:-1]:
        parent = _child(parent, token, operation["path"])
    last = tokens[-1]
    if op == "add":
        if isinstance(parent, list):
            index = len(parent) if last == "-" else _index(parent, last, operation["path"], inclusive=True)
            parent.insert(index, copy.deepcopy(operation["value"]))
        else:
            parent[last] = copy.deepcopy(operation["value"])
    elif op in ("remove", "replace"):
        _child(parent, last, operation["path"])  # must exist
        key = _index(parent, last, operation["path"]) if isinstance(parent, list) else last
        if op == "remove":
            del parent[key]
        else:
            parent[key] = copy.deepcopy(operation["value"])
    elif op == "test":
        if _child(parent, last, operation["path"]) != operation["value"]:
            raise KustomizeError(f"test failed at {operation['path']}")
    else:
        raise KustomizeError(f"unsupported JSON 6902 operation {op!r}")


def _pointer(path: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"{path!r} is not a JSON pointer")
    return [token.replace("~1", "/").replace("~0", "~") for token in path[1:].split("/")]


def _index(values: list, token: str, path: str, inclusive: bool = False) -> int:
    if not token.isdigit() or int(token) > len(values) - (0 if inclusive else 1):
        raise KustomizeError(f"{path}: no list index {token}")
    return int(token)


def _child(parent: Any, token: str, path: str) -> Any:
    if isinstance(parent, list):
        return parent[_index(parent, token, path)]
    if not isinstance(parent, dict) or token not in parent:
        raise KustomizeError(f"{path}: no field {token!r}")
    return parent[token]


def _set_images(node: Any, image: dict) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    if isinstance(container, dict) and "image" in container:
                        container["image"] = _new_image(container["image"], image)
            _set_images(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_images(item, image)


def split_image(reference: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of an image reference; a registry port is not a tag."""
    name, _, digest = reference.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = None
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest or None


def _new_image(reference: str, image: dict) -> str:
    name, tag, digest = split_image(reference)
    if name != image["name"]:
        return reference
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"images: unsupported fields {sorted(unknown)}")
    name = image.get("newName", name)
    if "digest" in image:
        return f"{name}@{image['digest']}"
    tag = image.get("newTag", tag)
    reference = name if tag is None else f"{name}:{tag}"
    return reference if digest is None else f"{reference}@{digest}"


def _replace(replacement: dict, resources: list[Resource]) -> None:
    source = replacement["source"]
    matches = [resource for resource in resources if _matches(resource, _selector(source))]
    if len(matches) != 1:
        raise KustomizeError(f"replacement source {source} matches {len(matches)} resources, not 1")
    value = _get_field(matches[0], source["fieldPath"])
    for target in replacement["targets"]:
        if set(target) - {"select", "fieldPaths"}:
            raise KustomizeError(f"unsupported replacement target fields {sorted(target)}")
        selected = [resource for resource in resources if _matches(resource, target["select"])]
        if not selected:
            raise KustomizeError(f"replacement target {target['select']} matches no resource")
        for resource in selected:
            for field_path in target["fieldPaths"]:
                *parents, last = _field_path(field_path)
                parent = _get_field(resource, ".".join(parents)) if parents else resource
                if not isinstance(parent, dict) or last not in parent:
                    raise KustomizeError(f"replacement target field {field_path} does not exist")
                parent[last] = copy.deepcopy(value)


def _selector(source: dict) -> dict:
    if set(source) - {"kind", "name", "fieldPath"}:
        raise KustomizeError(f"unsupported replacement source fields {sorted(source)}")
    return {key: source[key] for key in ("kind", "name") if key in source}


def _field_path(path: str) -> list[str]:
    if "[" in path or "\\" in path:
        raise KustomizeError(f"field path {path!r}: only plain dotted keys are supported")
    return path.split(".")


def _get_field(resource: Resource, path: str) -> Any:
    node: Any = resource
    for key in _field_path(path):
        if not isinstance(node, dict) or key not in node:
            name = resource["metadata"]["name"]
            raise KustomizeError(f"field {path} not found in {resource['kind']} {name}")
        node = node[key]
    return node
