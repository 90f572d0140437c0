"""Every command of the deployment guide works verbatim against the chart.

The guide ("## Kubernetes (`helm/etrain`)" in deploy/README.md) is walked in order, the way a new user runs it:
each ``helm install|upgrade|template|lint|uninstall`` of ``helm/etrain`` is mapped to the real Helm
engine with the values its ``--set``/``-f`` flags give (an upgrade with ``--reset-then-reuse-values``
or ``--reuse-values`` starts from the release's previous values, as Helm does), rendered and linted.
The ``kubectl`` lines must name objects those renders produce (the Service and the Ray head Service
they port-forward, the Secret and key they read the token from, the Secret a release expects), and the
job the guide submits must be a valid spec that fits the default CPU worker. The KubeRay operator
lines cannot render offline (they install a chart from the network): they must be exactly the
commands KubeRay documents. No other page shows a ``helm`` or ``kubectl`` command the walk does not run.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

import helm_python as helm
import pytest
import yaml

from etrain.api.cli.jobs import load_spec
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from tests.deploy import chart

README = chart.ROOT / "deploy" / "README.md"
GUIDE_HEADING = "## Kubernetes (`helm/etrain`)\n"
#: every page that may show commands: the top README, docs/, deploy/ and benchmarks/
PAGES = [
    chart.ROOT / "README.md",
    *sorted((chart.ROOT / "docs").glob("*.md")),
    README,
    chart.ROOT / "benchmarks" / "README.md",
    chart.ROOT / "CONTRIBUTING.md",
]
CHART_REF = "helm/etrain"
#: The KubeRay operator install as KubeRay documents it (Helm method), verbatim:
#: https://docs.ray.io/en/master/cluster/kubernetes/getting-started/kuberay-operator-installation.html
KUBERAY_COMMANDS = [
    "helm repo add kuberay https://ray-project.github.io/kuberay-helm/",
    "helm repo update",
    "kubectl create namespace ray-system",
    "helm install kuberay-operator kuberay/kuberay-operator --version 1.7.0 -n ray-system",
]
#: Ports of the Ray head container a user may port-forward to through KubeRay's `<cluster>-head-svc`.
HEAD_SERVICE_PORTS = {6379, 8265, 10001}


def guide() -> str:
    text = README.read_text()
    start = text.index(GUIDE_HEADING)
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def shell_commands(text: str) -> list[str]:
    """Every command line of the text's shell blocks, continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def guide_commands() -> list[str]:
    """Every command line of the guide's shell blocks."""
    return shell_commands(guide())


@dataclass
class Release:
    namespace: str
    values: dict[str, Any]
    rendered: chart.Rendered


@dataclass
class Walk:
    """What the guide has done so far: releases by name, Secrets created with kubectl, namespaces created,
    and the helm verbs run against the chart, in order."""

    releases: dict[str, Release] = field(default_factory=dict)
    secrets: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    namespaces: set[str] = field(default_factory=set)
    verbs: list[str] = field(default_factory=list)


def parse_helm(words: list[str]) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """(positionals, flags, values) of a helm command line; the values merged as Helm merges them
    (-f files first, then --set, then --set-string). Unknown flags fail: the test must understand
    every flag the guide uses."""
    positionals, flags = [], {}
    files, sets, set_strings = [], [], []
    words = list(words)
    while words:
        word = words.pop(0)
        if not word.startswith("-"):
            positionals.append(word)
            continue
        name, _, inline = word.partition("=")
        if name in (
            "--reuse-values",
            "--reset-then-reuse-values",
            "--reset-values",
            "--create-namespace",
            "--strict",
            "--wait",
            "--atomic",
            "--install",
        ):
            flags[name] = True
            continue
        value = inline or words.pop(0)
        if name in ("-n", "--namespace"):
            flags["namespace"] = value
        elif name in ("-f", "--values"):
            files.append(value)
        elif name == "--set":
            sets.append(value)
        elif name == "--set-string":
            set_strings.append(value)
        elif name in ("--version", "--timeout"):
            flags[name] = value
        else:
            raise AssertionError(f"the guide uses a helm flag this test does not model: {word}")
    values: dict[str, Any] = {}
    for path in files:
        values = chart.deep_merge(values, helm.values_from_yaml((chart.ROOT / path).read_text()))
    for expression in sets:
        values = chart.deep_merge(values, helm.parse_set_string(expression))
    for expression in set_strings:
        values = chart.deep_merge(values, helm.parse_set_string_values(expression))
    return positionals, flags, values


def run_helm(walk: Walk, line: str, words: list[str]) -> None:
    verb, *rest = words[1:]
    walk.verbs.append(verb)
    positionals, flags, values = parse_helm(rest)
    namespace = flags.get("namespace", "default")
    if verb == "lint":
        assert positionals == [CHART_REF], line
        report = chart.lint(values)
        assert report["errors"] == [] and not [m for m in report["messages"] if m["severity"] >= 2], (line, report)
        return
    if verb == "uninstall":
        [name] = positionals
        assert name in walk.releases and walk.releases[name].namespace == namespace, f"{line}: no such release"
        del walk.releases[name]
        return
    assert verb in ("install", "upgrade", "template"), f"unexpected helm command: {line}"
    name, chart_ref = positionals
    assert chart_ref == CHART_REF, f"{line}: not this repository's chart"
    upgrade = verb == "upgrade"
    if verb == "install":
        assert flags.get("--create-namespace") or namespace in walk.namespaces, (
            f"{line}: namespace {namespace} was never created (add --create-namespace)"
        )
        walk.namespaces.add(namespace)
    if upgrade:
        assert name in walk.releases and walk.releases[name].namespace == namespace, (
            f"{line}: upgrades a release the guide has not installed in {namespace}"
        )
        if flags.get("--reuse-values") or flags.get("--reset-then-reuse-values") or not values:
            values = chart.deep_merge(walk.releases[name].values, values)
    rendered = chart.render(values, release=name, namespace=namespace, upgrade=upgrade)
    for obj in rendered.objects:
        if (obj["apiVersion"], obj["kind"]) not in chart.CUSTOM_KINDS:
            chart.validate(obj)
    report = chart.lint(values)
    assert report["errors"] == [], (line, report)
    if verb != "template":
        for container in rendered.pod_templates()["control-plane"]["spec"]["containers"]:
            external = {secret: keys for (ns, secret), keys in walk.secrets.items() if ns == namespace}
            chart.resolve_env(container, rendered, external)  # every Secret it reads exists, with the keys
        walk.releases[name] = Release(namespace, values, rendered)


def run_kubectl(walk: Walk, line: str, words: list[str]) -> None:
    args = words[1:]
    namespace = "default"
    if args[:1] == ["-n"]:
        namespace, args = args[1], args[2:]
    if args[:2] == ["create", "namespace"]:
        walk.namespaces.add(args[2])
        return
    assert namespace in walk.namespaces, f"{line}: namespace {namespace} does not exist yet"
    if args[:3] == ["create", "secret", "generic"]:
        keys = dict(arg.removeprefix("--from-literal=").split("=", 1) for arg in args[4:])
        walk.secrets[(namespace, args[3])] = keys
        return
    release = next(r for r in reversed(walk.releases.values()) if r.namespace == namespace)
    rendered = release.rendered
    if args[0] == "port-forward":
        kind, name = args[1].split("/")
        local, remote = (int(port) for port in args[2].split(":"))
        assert kind == "svc", line
        heads = {f"{c['metadata']['name']}-head-svc" for c in rendered.all("RayCluster")}
        if name in heads:
            assert remote in HEAD_SERVICE_PORTS, line
        else:
            service = rendered.one("Service", name)
            assert remote in {port["port"] for port in service["spec"]["ports"]}, line
        return
    if args[:2] == ["get", "secret"]:
        name = args[2]
        key = re.fullmatch(r"\{\.data\.([\w.-]+)\}", args[args.index("-o") + 1].removeprefix("jsonpath=")).group(1)
        data = rendered.secret_data(name)
        assert data is not None and data.get(key), f"{line}: the release has no Secret {name} with key {key}"
        token_ref = next(
            var
            for var in rendered.pod_templates()["control-plane"]["spec"]["containers"][0]["env"]
            if var["name"] == "ETRAIN_API_TOKEN"
        )
        assert token_ref["valueFrom"]["secretKeyRef"] == {"name": name, "key": key}, line
        return
    raise AssertionError(f"the guide uses a kubectl command this test does not model: {line}")


def shell_words(line: str) -> list[str]:
    """The words of one command; a `$(...)` substitution is run on its own (as a command) by the caller."""
    return shlex.split(line.removesuffix("&").strip())


def test_the_guide_covers_install_submit_dashboard_scaling_upgrade_and_uninstall():
    commands = guide_commands()
    text = "\n".join(commands)
    assert re.search(r"^helm install etrain helm/etrain ", text, re.M)
    assert re.search(r"^etrain submit \S+ --watch$", text, re.M)
    assert re.search(r"^kubectl -n etrain port-forward svc/etrain-ray-head-svc 8265:8265$", text, re.M)
    assert re.search(r"^helm upgrade etrain helm/etrain .*rayCluster\.workerGroups\.gpu\.enabled=true", text, re.M)
    assert re.search(r"^helm upgrade etrain helm/etrain .*--set image\.tag=", text, re.M)
    assert re.search(r"^helm uninstall etrain ", text, re.M)
    assert "rayCluster.gpuWorkers" not in guide()


def test_every_helm_and_kubectl_command_shown_anywhere_is_walked():
    """A helm or kubectl line on any page (the top README, docs/, deploy/, benchmarks/) is one the walk
    below runs, so no command a reader may copy escapes the test."""
    walked = set(guide_commands())
    shown = {
        (page.relative_to(chart.ROOT).as_posix(), line)
        for page in PAGES
        for line in shell_commands(page.read_text())
        if line.split()[0] in ("helm", "kubectl")
    }
    tools = {line for line in walked if line.split()[0] in ("helm", "kubectl")}
    assert {line for page, line in shown if page == "deploy/README.md"} == tools  # the scan sees the guide
    assert sorted(item for item in shown if item[1] not in walked) == []


def test_the_kuberay_lines_are_exactly_the_documented_commands():
    commands = guide_commands()
    start = commands.index(KUBERAY_COMMANDS[0])
    assert commands[start : start + len(KUBERAY_COMMANDS)] == KUBERAY_COMMANDS
    others = [
        c
        for c in commands
        if c.startswith("helm ") and CHART_REF not in c and not c.startswith("helm uninstall etrain")
    ]
    assert [c for c in others if c not in KUBERAY_COMMANDS] == []


def test_every_command_of_the_guide_runs_against_the_chart():
    walk = Walk()
    kuberay = set(KUBERAY_COMMANDS)
    for line in guide_commands():
        if line in kuberay:
            if line.startswith("kubectl create namespace"):
                walk.namespaces.add(line.split()[-1])
            continue
        # the token export runs its $(kubectl ...) substitution
        substitution = re.fullmatch(r"export (\w+)=\$\((.*?) \| base64 -d\)", line)
        if substitution:
            line = substitution.group(2)
        words = shell_words(line)
        if words[0] == "helm":
            run_helm(walk, line, words)
        elif words[0] == "kubectl":
            run_kubectl(walk, line, words)
        elif words[0] == "etrain":
            assert words[1] == "submit", line
            spec = JobSpec.model_validate(load_spec(str(chart.ROOT / words[2])))
            assert check_spec(spec) == [], line
            assert spec.data.kind == "synthetic", "the cluster has none of this repository's files"
            values = yaml.safe_load((chart.CHART / "values.yaml").read_text())
            cpus = float(values["rayCluster"]["workerGroups"]["cpu"]["resources"]["limits"]["cpu"])
            world = spec.parallelism.dp * spec.parallelism.tp * spec.parallelism.pp
            assert world * spec.resources.cpus_per_worker <= cpus, "the job does not fit one default CPU worker"
        elif words[0] in ("docker", "export"):
            continue  # image builds: deploy/README.md and tests/deploy/test_images.py; plain variables
        else:
            raise AssertionError(f"a command this test does not know: {line}")
    # install (default, storage class, existing claim, S3), scale GPU workers (autoscaler on, off),
    # upgrade the image, uninstall, then lint and render without a cluster: each run by the engine above
    assert walk.verbs == ["install"] * 4 + ["upgrade"] * 3 + ["uninstall", "lint", "template"]
    assert walk.releases == {}, "the guide ends with the release uninstalled"


@pytest.mark.parametrize(
    "line", [line for line in guide_commands() if line.startswith(f"helm install etrain {CHART_REF}")]
)
def test_every_install_line_mounts_one_checkpoint_store_everywhere(line):
    _, _, values = parse_helm(shell_words(line)[3:])
    rendered = chart.render(values, namespace="etrain")
    path = chart.deep_merge(yaml.safe_load((chart.CHART / "values.yaml").read_text()), values)["checkpoint"]["path"]
    for role, template in rendered.pod_templates().items():
        container = template["spec"]["containers"][0]
        mounts = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "checkpoints"]
        names = {var["name"] for var in container["env"]}
        assert mounts == ([] if path.startswith("s3://") else [path]), role
        assert ("AWS_ACCESS_KEY_ID" in names) is path.startswith("s3://"), role
