"""The Grafana dashboard (deploy/grafana/etrain-dashboard.json) against what the control plane's
``/metrics`` actually exports, and its ConfigMap in the Helm chart (``monitoring.grafanaDashboard``).

Every metric a panel's PromQL (or the job selector's query) names must be a family ``GET /metrics``
serves, with a sample for a job that has every field set (steps with MFU, straggler findings, a restart,
a checkpoint); every label a panel groups by or shows in its legend must be one of that family's labels,
and every ``status`` it matches a status the service has."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus, StepRecord
from tests.deploy import chart
from tests.deploy.chart import ROOT, render
from tests.fakes import InMemoryManager

DASHBOARD = ROOT / "deploy" / "grafana" / "etrain-dashboard.json"
CHART_COPY = chart.CHART / "dashboards" / "etrain-dashboard.json"
TOKEN = "dashboard-token-0123456789"
#: PromQL words that are not metric names.
PROMQL = {
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "increase",
    "rate",
    "irate",
    "delta",
    "changes",
    "label_values",
    "and",
    "or",
    "unless",
    "offset",
    "avg_over_time",
    "max_over_time",
    "min_over_time",
    "topk",
    "bottomk",
    "clamp_min",
    "clamp_max",
}
#: What the dashboard must show (the issue's list), as the metrics that carry it.
REQUIRED = {
    "jobs by status": "etrain_jobs",
    "loss": "etrain_job_loss",
    "tokens/s": "etrain_tokens_per_second",
    "MFU": "etrain_mfu",
    "goodput": "etrain_goodput",
    "restarts": "etrain_restarts_total",
    "stragglers": "etrain_straggler_factor",
    "straggler count": "etrain_job_stragglers",
    "host memory": "etrain_host_memory_bytes",
    "host memory reserved": "etrain_host_memory_reserved_bytes",
}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(board: dict) -> list[tuple[str, str, str]]:
    """(panel title, expr, legendFormat) of every query: panel targets and templating variables."""
    found = [
        (panel["title"], target["expr"], target.get("legendFormat", ""))
        for panel in board["panels"]
        for target in panel["targets"]
    ]
    found += [
        (f"variable {var['name']}", var["definition"], "")
        for var in board["templating"]["list"]
        if var["type"] == "query"
    ]
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges,
    grouping clauses, variables and functions are taken out."""
    text = re.sub(r'"[^"]*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    text = re.sub(r"\$\w+", "", text)
    return {word for word in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", text) if word not in PROMQL}


def grouped_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr)
        for label in group.split(",")
        if label.strip()
    }


def status_values(expr: str) -> set[str]:
    return {value for regex in re.findall(r'status=~?"([^"]*)"', expr) for value in regex.split("|")}


def test_the_metric_name_reader_finds_names_and_only_names():
    assert metric_names('sum by (job_id) (increase(etrain_restarts_total{job_id=~"$job_id"}[$__rate_interval]))') == {
        "etrain_restarts_total"
    }
    assert metric_names('max by (job_id) (ray_etrain_straggler_factor or etrain_straggler_factor{rank="1"})') == {
        "ray_etrain_straggler_factor",
        "etrain_straggler_factor",
    }
    assert metric_names("label_values(etrain_job_step, job_id)") == {"etrain_job_step", "job_id"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Metric family -> its label names, from ``GET /metrics`` (admin token) of a server whose store holds
    a running job with every field set and a queued one."""
    data_dir = tmp_path_factory.mktemp("metrics")
    with JobStore(data_dir / "etrain.db") as store:
        manager = InMemoryManager(store, base_dir=str(data_dir))
        client = TestClient(
            create_app(Settings(data_dir=data_dir, api_token=TOKEN), manager=manager),
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        spec = {
            "name": "full",
            "model": {"preset": "gpt-tiny"},
            "parallelism": {"dp": 2},
            "training": {"steps": 100, "global_batch": 8, "micro_batch": 2},
            "resources": {"host_memory_gb": 2},
        }
        job_id = client.post("/v1/jobs", json=spec).json()["id"]
        client.post("/v1/jobs", json={**spec, "name": "second"})
        now = time.time()
        store.add_steps(
            job_id,
            [
                StepRecord(
                    job_id=job_id,
                    step=s,
                    loss=3.0,
                    tokens_per_s=1e4,
                    step_s=0.5,
                    compute_s=0.4,
                    comm_wait_s=0.1,
                    ts=now,
                    attempt=1,
                    mfu=0.4,
                )
                for s in (1, 2, 3)
            ],
        )
        store.update_job(
            job_id,
            step=3,
            loss=3.0,
            tokens_per_s=1e4,
            restarts=1,
            goodput=0.8,
            goodput_breakdown={"queued": 0.2, "startup": 1.0, "productive": 1.5, "checkpoint": 0.3},
            last_checkpoint_step=2,
            stragglers=[{"rank": 1, "factor": 1.9, "step": 3, "node": "n1"}],
            host_memory_gib=0.5,
        )
        text = client.get("/metrics").text
    families: dict[str, set[str]] = {}
    for name in re.findall(r"^# TYPE (\S+) \w+$", text, re.M):
        samples = re.findall(rf"^{name}(?:\{{([^}}]*)\}})? \S+$", text, re.M)
        assert samples, f"{name} is declared but has no sample: the test job misses a field"
        families[name] = {pair.split("=", 1)[0] for labels in samples if labels for pair in labels.split(",")}
    assert families["etrain_mfu"] == {"job_id", "name"}
    assert f'etrain_mfu{{job_id="{job_id}",name="full"}} 0.4' in text
    assert f'etrain_straggler_factor{{job_id="{job_id}",name="full",rank="1"}} 1.9' in text
    assert f'etrain_job_stragglers{{job_id="{job_id}",name="full"}} 1.0' in text
    assert f'etrain_host_memory_bytes{{job_id="{job_id}",name="full"}} 5.36870912e+08' in text  # 0.5 GiB
    assert f'etrain_host_memory_reserved_bytes{{job_id="{job_id}",name="full"}} 2.147483648e+09' in text  # 2 GiB
    return families


def test_every_panel_reads_only_metrics_that_metrics_exports(exported):
    used: set[str] = set()
    for title, expr, _ in queries(dashboard()):
        names = metric_names(expr) - {"job_id"}  # label_values(metric, label): its second argument
        assert names, f"{title}: no metric in {expr!r}"
        assert names <= set(exported), f"{title}: {sorted(names - set(exported))} not exported by /metrics"
        used |= names
    assert {what: metric in used for what, metric in REQUIRED.items()} == dict.fromkeys(REQUIRED, True)


def test_every_label_a_panel_groups_by_or_shows_is_on_its_metric(exported):
    for title, expr, legend in queries(dashboard()):
        labels = set().union(*(exported[name] for name in metric_names(expr) - {"job_id"}))
        wanted = grouped_labels(expr) | set(re.findall(r"\{\{(\w+)\}\}", legend))
        assert wanted <= labels, f"{title}: {sorted(wanted - labels)} not labels of {sorted(metric_names(expr))}"
        assert status_values(expr) <= {status.value for status in JobStatus}, title


def test_active_and_queued_count_the_statuses_they_name():
    panels = {panel["title"]: panel["targets"] for panel in dashboard()["panels"]}
    assert status_values(panels["Active jobs"][0]["expr"]) == {s.value for s in JobStatus if not s.is_terminal}
    assert status_values(panels["Queued jobs"][0]["expr"]) == {"QUEUED"}
    assert [status_values(t["expr"]) for t in panels["Queue"]][:2] == [
        {"QUEUED"},
        {s.value for s in JobStatus if not s.is_terminal} - {"QUEUED"},
    ]


def test_panels_do_not_overlap_and_fill_the_grid():
    cells: set[tuple[int, int]] = set()
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine
    ids = [panel["id"] for panel in dashboard()["panels"]]
    assert len(ids) == len(set(ids)) >= 12


# -- the chart's ConfigMap -------------------------------------------------------------------------------------------


def test_the_chart_carries_the_same_dashboard():
    assert CHART_COPY.read_bytes() == DASHBOARD.read_bytes(), (
        f"copy {DASHBOARD.relative_to(ROOT)} to {CHART_COPY.relative_to(ROOT)} (Helm reads only the chart's files)"
    )


def test_the_dashboard_configmap_is_rendered_only_when_enabled_and_labelled_for_the_sidecar():
    assert not render().all("ConfigMap")  # default: off
    rendered = render(
        {"monitoring": {"grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "Training"}}}}
    )
    [config_map] = rendered.all("ConfigMap")
    metadata = config_map["metadata"]
    assert metadata["name"] == "etrain-grafana-dashboard" and metadata["labels"]["grafana_dashboard"] == "1"
    assert metadata["labels"]["app.kubernetes.io/instance"] == "etrain"
    assert metadata["annotations"] == {"grafana_folder": "Training"}
    assert json.loads(config_map["data"]["etrain-dashboard.json"]) == dashboard()
    relabelled = render(
        {"monitoring": {"grafanaDashboard": {"enabled": True, "label": "team/dashboards", "labelValue": "etrain"}}}
    )
    assert relabelled.one("ConfigMap")["metadata"]["labels"]["team/dashboards"] == "etrain"


def test_the_dashboard_is_valid_json_for_grafana():
    board = dashboard()
    assert board["uid"] == "etrain-jobs" and board["schemaVersion"] >= 36
    assert all(
        target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        for panel in board["panels"]
        for target in panel["targets"]
    )
    assert Path(DASHBOARD).read_text().endswith("}\n")
