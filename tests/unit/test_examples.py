"""Every shipped example is a valid, feasible spec (the README and `make run` depend on them)."""

from pathlib import Path

import pytest
import yaml

from etrain.service.planning import planner
from etrain.service.planning.spec import JobSpec
from etrain.service.planning.spec_checks import check_spec
from etrain.service.planning.spec_paths import resolve_paths

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def test_examples_exist():
    assert {p.name for p in EXAMPLES} >= {"quickstart.yaml", "3d.yaml", "elastic.yaml", "llama-70b-plan.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_validates_and_plans(path):
    spec = resolve_paths(JobSpec.model_validate(yaml.safe_load(path.read_text())), REPO)
    assert check_spec(spec) == []
    report = planner.plan_report(spec)
    assert report["feasible"], report["problems"]


def test_quickstart_trains_on_the_repository_as_bytes():
    spec = resolve_paths(JobSpec.model_validate(yaml.safe_load((REPO / "examples/quickstart.yaml").read_text())), REPO)
    assert spec.data.kind == "text" and Path(spec.data.path) == REPO
    assert spec.layout.dp == 2 and spec.model.resolved()["vocab_size"] == 256
