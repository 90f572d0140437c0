"""The Helm chart (helm/etrain) holds together without a Kubernetes cluster.

Pure-Python checks of what `helm lint` would not catch on its own: every value is documented
(`# --`, helm-docs style), validated by values.schema.json and actually declared where a template
reads it, and templates use only helpers that exist. When a `helm` binary is on PATH the chart is
also linted and rendered for real.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "helm" / "etrain"
TEMPLATES = CHART / "templates"

# Maps handed to Kubernetes verbatim: documented as a whole, their inner keys are not chart values.
PASSTHROUGH = {
    "resources",
    "podSecurityContext",
    "securityContext",
    "startupProbe",
    "readinessProbe",
    "livenessProbe",
    "rayStartParams",
    "nodeSelector",
    "affinity",
    "annotations",
    "labels",
    "podAnnotations",
    "podLabels",
    "commonLabels",
    "autoscalerOptions",
    "gcsFaultToleranceOptions",
}

ACTION = re.compile(r"\{\{-?\s*(.*?)\s*-?\}\}", re.S)
VALUES_REF = re.compile(r"\.Values((?:\.[A-Za-z0-9_]+)+)")
ALIAS = re.compile(r"\$(\w+)\s*:=\s*\$?\.Values((?:\.[A-Za-z0-9_]+)+)")
HELPER_USE = re.compile(r"\b(?:include|template)\s+\"([^\"]+)\"")
HELPER_DEF = re.compile(r"\bdefine\s+\"([^\"]+)\"")


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _templates() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(TEMPLATES.iterdir()) if p.is_file()}


def _actions(text: str) -> list[str]:
    """Template actions without comments."""
    return [a for a in ACTION.findall(text) if not a.startswith("/*")]


def _has_path(values: dict, dotted: str) -> bool:
    node = values
    for part in dotted.strip(".").split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_chart_yaml_declares_an_application_chart():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["name"] == "etrain"
    assert chart["type"] == "application"
    assert chart["appVersion"] == "0.1.0"
    assert re.fullmatch(r"\d+\.\d+\.\d+", chart["version"])


def test_values_yaml_parses_with_the_expected_sections():
    values = _values()
    assert {"image", "auth", "controlPlane", "service", "persistence", "rayCluster", "monitoring"} <= set(values)
    assert values["rayCluster"]["rayVersion"] == "2.60.0"
    assert set(values["rayCluster"]["workerGroups"]) >= {"cpu", "gpu"}
    gpu = values["rayCluster"]["workerGroups"]["gpu"]
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] >= 1


def test_values_validate_against_the_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(_values())


@pytest.mark.parametrize(
    "override",
    [
        {"controlPlane": {"replicas": 2}},  # unknown key: SQLite allows one control plane
        {"service": {"port": 0}},
        {"image": {"pullPolicy": "Sometimes"}},
        {"rayCluster": {"workerGroups": {"cpu": {"enabled": True, "minReplicas": -1, "maxReplicas": 1}}}},
        {"rayCluster": {"workerGroups": {"Big_GPUs": {"enabled": True, "minReplicas": 0, "maxReplicas": 1}}}},
    ],
)
def test_schema_rejects_bad_values(override):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = _values()
    for section, patch in override.items():
        values[section] = {**values[section], **patch}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schema).validate(values)


def test_every_value_is_preceded_by_a_doc_comment():
    text = (CHART / "values.yaml").read_text()
    lines = text.splitlines()
    undocumented: list[str] = []

    def documented(line_no: int) -> bool:
        i = line_no - 1
        while i >= 0 and lines[i].lstrip().startswith("#"):
            if lines[i].lstrip().startswith("# --"):
                return True
            i -= 1
        return False

    def walk(node: yaml.MappingNode, prefix: str) -> None:
        for key_node, value_node in node.value:
            path = f"{prefix}{key_node.value}"
            if not documented(key_node.start_mark.line):
                undocumented.append(f"{path} (line {key_node.start_mark.line + 1})")
            if isinstance(value_node, yaml.MappingNode) and key_node.value not in PASSTHROUGH:
                walk(value_node, path + ".")

    walk(yaml.compose(text), "")
    assert not undocumented, "values without a `# --` comment right above them: " + ", ".join(undocumented)


def test_every_value_a_template_reads_is_declared_in_values_yaml():
    values = _values()
    missing: list[str] = []
    for name, text in _templates().items():
        actions = _actions(text)
        aliases = {m.group(1): m.group(2) for a in actions for m in ALIAS.finditer(a)}
        for action in actions:
            refs = [m.group(1) for m in VALUES_REF.finditer(action)]
            for var, base in aliases.items():
                refs += [base + m.group(1) for m in re.finditer(rf"\${var}((?:\.[A-Za-z0-9_]+)+)", action)]
            missing += [f"{name}: .Values{ref}" for ref in refs if not _has_path(values, ref)]
    assert not missing, "templates read values that values.yaml does not declare: " + ", ".join(sorted(set(missing)))


def test_worker_group_fields_read_by_the_template_exist_in_every_default_group():
    used = set(re.findall(r"\$group\.(\w+)", (TEMPLATES / "raycluster.yaml").read_text()))
    assert used, "raycluster.yaml no longer ranges over worker groups as $group"
    for name, group in _values()["rayCluster"]["workerGroups"].items():
        assert used <= set(group), f"worker group {name!r} lacks {sorted(used - set(group))}"


def test_templates_only_include_helpers_defined_in_helpers_tpl():
    templates = _templates()
    defined = set(HELPER_DEF.findall(templates["_helpers.tpl"]))
    used: set[str] = set()
    for name, text in templates.items():
        if name != "_helpers.tpl":
            assert not HELPER_DEF.findall(text), f"{name} defines helpers; they belong in _helpers.tpl"
        used |= set(HELPER_USE.findall(text))
    assert used <= defined, f"undefined helpers: {sorted(used - defined)}"
    assert defined <= used, f"unused helpers in _helpers.tpl: {sorted(defined - used)}"
    assert all(n.startswith("etrain.") for n in defined), "helpers are namespaced etrain.*"


def test_every_block_in_every_template_is_closed():
    for name, text in _templates().items():
        depth = 0
        for action in _actions(text):
            word = action.split(None, 1)[0] if action else ""
            if word in {"if", "with", "range", "define"}:
                depth += 1
            elif word == "end":
                depth -= 1
                assert depth >= 0, f"{name}: `end` without a block"
        assert depth == 0, f"{name}: {depth} block(s) left open"


def test_manifests_are_namespaced_by_the_release_and_labelled():
    for name, text in _templates().items():
        if name.endswith(".yaml"):
            assert 'include "etrain.labels"' in text, f"{name} does not use the common labels"
            assert "name: {{ include" in text, f"{name} spells a resource name instead of using a helper"


# ---------------------------------------------------------------- the real thing, when available

helm = shutil.which("helm")
needs_helm = pytest.mark.skipif(helm is None, reason="helm binary not on PATH")


def _helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([helm, *args], capture_output=True, text=True, timeout=120, check=check)


@needs_helm
def test_helm_lint_passes_strict():
    result = _helm("lint", "--strict", str(CHART), check=False)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_helm
@pytest.mark.parametrize(
    ("sets", "expected_kinds"),
    [
        ([], {"Deployment", "Service", "Secret", "PersistentVolumeClaim", "ServiceAccount", "RayCluster"}),
        (
            [
                "rayCluster.workerGroups.gpu.enabled=true",
                "monitoring.serviceMonitor.enabled=true",
                "monitoring.podMonitor.enabled=true",
                "checkpoints.existingClaim=shared-ckpt",
            ],
            {"Deployment", "RayCluster", "ServiceMonitor", "PodMonitor"},
        ),
        (
            ["rayCluster.enabled=false", "controlPlane.rayAddress=ray://ray-head.ray.svc:10001",
             "auth.enabled=false", "persistence.enabled=false"],
            {"Deployment", "Service", "ServiceAccount"},
        ),
    ],
)
def test_helm_template_renders_valid_manifests(sets, expected_kinds):
    args = ["template", "t", str(CHART), "--namespace", "train"]
    for s in sets:
        args += ["--set", s]
    docs = [d for d in yaml.safe_load_all(_helm(*args).stdout) if d]
    kinds = {d["kind"] for d in docs}
    assert expected_kinds <= kinds
    if "rayCluster.enabled=false" in sets:
        assert "RayCluster" not in kinds and "Secret" not in kinds and "PersistentVolumeClaim" not in kinds
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    args_ = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args_[:4] == ["serve", "--host=0.0.0.0", "--port=8000", "--data-dir=/data"]
    assert args_[4].startswith("--ray-address=ray://")


@needs_helm
def test_helm_template_fails_without_any_ray_address():
    result = _helm("template", "t", str(CHART), "--set", "rayCluster.enabled=false", check=False)
    assert result.returncode != 0
    assert "controlPlane.rayAddress" in result.stderr
