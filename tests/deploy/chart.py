"""The Helm chart (helm/etrain) rendered and linted by the real Helm engine, for the chart tests.

``helm-python-sdk`` binds Helm's own Go SDK (``libhelm_c``): values are coalesced with the chart's
defaults, checked against values.schema.json and the templates executed exactly as ``helm install``
would, offline (``lookup`` returns nothing, as under ``helm template``). Nothing here parses a Go
template. Renders are cached per (values, release, namespace): each matrix entry renders once.

Objects are checked with ``kubernetes-validate`` against the Kubernetes 1.30 schemas in strict mode
(unknown fields are errors). The RayCluster is a custom resource those schemas do not know: its pod
templates are validated as core ``PodTemplate`` objects, and its own fields against the names KubeRay
documents (:mod:`tests.deploy.kuberay_fields`).
"""

from __future__ import annotations

import base64
import copy
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "etrain"
KUBE_VERSION = "1.30"
RELEASE = "etrain"
NAMESPACE = "etrain"
#: Kinds that are not core Kubernetes (no schema in kubernetes-validate): checked separately.
CUSTOM_KINDS = {
    ("ray.io/v1", "RayCluster"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PodMonitor"),
}


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` over ``base``, maps merged key by key (how Helm coalesces values); inputs untouched."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


@dataclass(frozen=True)
class Rendered:
    """One render: the user-supplied values, every manifest object, and NOTES.txt."""

    values: dict[str, Any]
    objects: tuple[dict[str, Any], ...]
    notes: str
    release: str
    namespace: str

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict[str, Any]:
        found = [obj for obj in self.all(kind) if name is None or obj["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
        return found[0]

    def has(self, kind: str, name: str | None = None) -> bool:
        return any(name is None or obj["metadata"]["name"] == name for obj in self.all(kind))

    def pod_templates(self) -> dict[str, dict[str, Any]]:
        """Every pod the release runs, by role: ``control-plane``, ``ray-head``, ``worker/<group>``."""
        pods = {"control-plane": self.one("Deployment")["spec"]["template"]}
        for cluster in self.all("RayCluster"):
            pods["ray-head"] = cluster["spec"]["headGroupSpec"]["template"]
            for group in cluster["spec"].get("workerGroupSpecs", []):
                pods[f"worker/{group['groupName']}"] = group["template"]
        return pods

    def secret_data(self, name: str) -> dict[str, str] | None:
        for secret in self.all("Secret"):
            if secret["metadata"]["name"] == name:
                return {key: base64.b64decode(value).decode() for key, value in (secret.get("data") or {}).items()}
        return None


def _values_key(values: Mapping[str, Any] | None) -> str:
    return json.dumps(values or {}, sort_keys=True)


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@functools.cache
def _render(values_json: str, release: str, namespace: str, upgrade: bool) -> Rendered:
    values = json.loads(values_json)
    manifests = _chart().render(values, name=release, namespace=namespace, is_install=not upgrade, is_upgrade=upgrade)
    objects: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return Rendered(values=values, objects=tuple(objects), notes=notes, release=release, namespace=namespace)


def render(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = RELEASE,
    namespace: str = NAMESPACE,
    upgrade: bool = False,
) -> Rendered:
    """The chart rendered by Helm with ``values`` over its defaults (cached). Raises Helm's errors:
    ``helm_python.HelmValuesError`` (schema) or ``HelmRenderError`` (a template's ``fail``)."""
    return _render(_values_key(values), release, namespace, upgrade)


@functools.cache
def _lint(values_json: str) -> dict[str, Any]:
    return helm.lint(
        CHART, json.loads(values_json), strict=True, namespace=NAMESPACE, kube_version=f"v{KUBE_VERSION}.0"
    )


def lint(values: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``helm lint --strict --kube-version v1.30.0`` of the chart with ``values`` (cached)."""
    return _lint(_values_key(values))


def validate(obj: Mapping[str, Any]) -> None:
    """Strict validation against the Kubernetes 1.30 schema of the object's kind; raises
    ``kubernetes_validate.ValidationError`` naming the path of the first problem."""
    kubernetes_validate.validate(dict(obj), KUBE_VERSION, strict=True)


def as_pod_template(name: str, template: Mapping[str, Any]) -> dict[str, Any]:
    """A pod template (``metadata`` + ``spec``) as a core ``v1/PodTemplate`` object, so the 1.30 schema checks it."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": dict(template)}


def containers(template: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = template["spec"]
    return list(spec.get("initContainers") or []) + list(spec["containers"])


def resolve_env(
    container: Mapping[str, Any], rendered: Rendered, secrets: Mapping[str, Mapping[str, str]] = {}
) -> dict[str, str]:
    """The container's environment as the kubelet builds it: ``value``s, and ``secretKeyRef``s read from
    the rendered Secrets or from ``secrets`` (Secrets that exist outside the chart). A missing key of an
    ``optional`` reference is left out; a missing required one fails."""
    env: dict[str, str] = {}
    for var in container.get("env") or []:
        if "value" in var:
            env[var["name"]] = str(var["value"])
            continue
        ref = (var.get("valueFrom") or {}).get("secretKeyRef")
        assert ref is not None, f"env {var['name']}: only value and secretKeyRef are expected, got {var}"
        data = rendered.secret_data(ref["name"])
        if data is None:
            data = secrets.get(ref["name"])
        assert data is not None, f"env {var['name']}: Secret {ref['name']!r} is neither rendered nor given"
        if ref["key"] in data:
            env[var["name"]] = data[ref["key"]]
        else:
            assert ref.get("optional"), f"env {var['name']}: Secret {ref['name']!r} has no key {ref['key']!r}"
    return env


def labels_match(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())
