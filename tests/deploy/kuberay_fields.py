"""The fields KubeRay's ``ray.io/v1`` API documents for a RayCluster, and a checker of a rendered one.

A hand list, copied from the json tags of ``ray-operator/apis/ray/v1/raycluster_types.go`` in
github.com/ray-project/kuberay (commit 3275ee09f6a6c899c37e82ea6349785536de6bd4, the API with
``gcsFaultToleranceOptions``, ``managedBy`` and per-group ``idleTimeoutSeconds``: KubeRay >= 1.3).
A field without ``omitempty`` in the Go struct is required. The embedded Kubernetes types
(``template``: PodTemplateSpec, ``headService``: Service, ``autoscalerOptions.securityContext`` ...)
are not listed here: the chart tests validate them against the Kubernetes schemas instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

RAYCLUSTER_SPEC = {
    "suspend",
    "managedBy",
    "autoscalerOptions",
    "headServiceAnnotations",
    "enableInTreeAutoscaling",
    "gcsFaultToleranceOptions",
    "headGroupSpec",
    "rayVersion",
    "workerGroupSpecs",
}
RAYCLUSTER_SPEC_REQUIRED = {"headGroupSpec"}

HEAD_GROUP_SPEC = {"template", "headService", "enableIngress", "rayStartParams", "serviceType"}
HEAD_GROUP_SPEC_REQUIRED = {"template", "rayStartParams"}

WORKER_GROUP_SPEC = {
    "suspend",
    "groupName",
    "replicas",
    "minReplicas",
    "maxReplicas",
    "idleTimeoutSeconds",
    "rayStartParams",
    "template",
    "scaleStrategy",
    "numOfHosts",
}
WORKER_GROUP_SPEC_REQUIRED = {"groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"}

AUTOSCALER_OPTIONS = {
    "resources",
    "image",
    "imagePullPolicy",
    "securityContext",
    "idleTimeoutSeconds",
    "upscalingMode",
    "env",
    "envFrom",
    "volumeMounts",
}
UPSCALING_MODES = {"Default", "Aggressive", "Conservative"}

GCS_FAULT_TOLERANCE_OPTIONS = {"redisUsername", "redisPassword", "externalStorageNamespace", "redisAddress"}
GCS_FAULT_TOLERANCE_OPTIONS_REQUIRED = {"redisAddress"}

SERVICE_TYPES = {"ClusterIP", "NodePort", "LoadBalancer", "ExternalName"}


def _fields(where: str, obj: Any, allowed: set[str], required: set[str] = frozenset()) -> list[str]:
    if not isinstance(obj, Mapping):
        return [f"{where}: expected an object, got {type(obj).__name__}"]
    problems = [f"{where}.{key}: not a field KubeRay documents" for key in sorted(set(obj) - allowed)]
    problems += [f"{where}.{key}: required" for key in sorted(required - set(obj))]
    return problems


def _int32(where: str, value: Any, minimum: int = 0) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value < 2**31:
        return [f"{where}: {value!r} is not an int32 >= {minimum}"]
    return []


def _start_params(where: str, params: Any) -> list[str]:
    if not isinstance(params, Mapping):
        return [f"{where}: expected map[string]string"]
    return [
        f"{where}.{key}: {value!r} is not a string (map[string]string)"
        for key, value in params.items()
        if not isinstance(value, str)
    ]


def check_raycluster(obj: Mapping[str, Any]) -> list[str]:
    """Problems of a RayCluster against the documented ray.io/v1 fields; empty when it conforms."""
    problems = []
    if obj.get("apiVersion") != "ray.io/v1" or obj.get("kind") != "RayCluster":
        return [f"not a ray.io/v1 RayCluster: {obj.get('apiVersion')}/{obj.get('kind')}"]
    problems += _fields("", obj, {"apiVersion", "kind", "metadata", "spec"}, {"metadata", "spec"})
    spec = obj.get("spec") or {}
    problems += _fields("spec", spec, RAYCLUSTER_SPEC, RAYCLUSTER_SPEC_REQUIRED)
    if "rayVersion" in spec and not isinstance(spec["rayVersion"], str):
        problems.append(f"spec.rayVersion: {spec['rayVersion']!r} is not a string")
    if "enableInTreeAutoscaling" in spec and not isinstance(spec["enableInTreeAutoscaling"], bool):
        problems.append("spec.enableInTreeAutoscaling: not a boolean")
    options = spec.get("autoscalerOptions")
    if options is not None:
        problems += _fields("spec.autoscalerOptions", options, AUTOSCALER_OPTIONS)
        if "upscalingMode" in options and options["upscalingMode"] not in UPSCALING_MODES:
            problems.append(f"spec.autoscalerOptions.upscalingMode: not one of {sorted(UPSCALING_MODES)}")
        if "idleTimeoutSeconds" in options:
            problems += _int32("spec.autoscalerOptions.idleTimeoutSeconds", options["idleTimeoutSeconds"])
    if "gcsFaultToleranceOptions" in spec:
        problems += _fields(
            "spec.gcsFaultToleranceOptions",
            spec["gcsFaultToleranceOptions"],
            GCS_FAULT_TOLERANCE_OPTIONS,
            GCS_FAULT_TOLERANCE_OPTIONS_REQUIRED,
        )
    head = spec.get("headGroupSpec") or {}
    problems += _fields("spec.headGroupSpec", head, HEAD_GROUP_SPEC, HEAD_GROUP_SPEC_REQUIRED)
    problems += _start_params("spec.headGroupSpec.rayStartParams", head.get("rayStartParams", {}))
    if "serviceType" in head and head["serviceType"] not in SERVICE_TYPES:
        problems.append(f"spec.headGroupSpec.serviceType: not one of {sorted(SERVICE_TYPES)}")
    names = set()
    for index, group in enumerate(spec.get("workerGroupSpecs") or []):
        where = f"spec.workerGroupSpecs[{index}]"
        problems += _fields(where, group, WORKER_GROUP_SPEC, WORKER_GROUP_SPEC_REQUIRED)
        problems += _start_params(f"{where}.rayStartParams", group.get("rayStartParams", {}))
        for key in ("replicas", "minReplicas", "maxReplicas", "numOfHosts", "idleTimeoutSeconds"):
            if key in group:
                problems += _int32(f"{where}.{key}", group[key])
        if group.get("groupName") in names:
            problems.append(f"{where}.groupName: {group['groupName']!r} is used twice")
        names.add(group.get("groupName"))
    return problems
