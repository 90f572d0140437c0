"""Bounds on every input (service/planning/bounds.py) and the divisor searches that keep every request cheap.

* the largest real model (Llama 3.1 405B, 128k context, 16384 GPUs) passes every bound;
* one past each bound is a 422 naming the field (through the real app);
* absurd sizes (n_layers=10**12, max_workers=10**9, global_batch=10**15) are answered in under 100 ms
  by check_spec, the planner, POST /v1/plan and POST /v1/jobs, even on a spec that skipped validation;
* the supervisor's constructor rules (``backoff_max_s >= backoff_base_s``, the elastic dp range) are a
  422 at submit, and no job is recorded;
* the planner's and the elastic policy's searches enumerate divisors, so their cost does not grow with
  the size of the numbers.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.service.decisions.elastic import ElasticPolicy, legal_dp_sizes
from etrain.service.errors import SpecRejected
from etrain.service.planning import bounds
from etrain.service.planning.bounds import MAX_GLOBAL_BATCH, MAX_WORKERS, spread
from etrain.service.planning.plan_search import MAX_AUTO_LAYOUTS
from etrain.service.planning.planner import check_plan, plan_report, resolve_auto
from etrain.service.planning.spec import (
    AutoParallelismSpec,
    JobSpec,
    ModelSpec,
    TrainingSpec,
)
from etrain.service.planning.spec_checks import check_spec, field_problems
from etrain.service.settings import Settings
from etrain.workers.protocol.layout_rules import divisors
from tests.fakes import FakeRuntime

TOKEN = "bounds-token-31c4"
LLAMA_405B = {
    "kind": "llama",
    "n_layers": 126,
    "d_model": 16384,
    "n_heads": 128,
    "n_kv_heads": 8,
    "d_ff": 53248,
    "vocab_size": 128256,
    "seq_len": 131072,
}


def spec_dict(**sections: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "bounds",
        "model": {"preset": "gpt-tiny"},
        "parallelism": {"dp": 2},
        "training": {"steps": 10, "global_batch": 8, "micro_batch": 2},
    }
    for name, value in sections.items():  # training is merged (steps and batch are required), the rest replaced
        spec[name] = {**spec[name], **value} if name == "training" else value
    return spec


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """The real app over the real JobManager (SQLite, spec checks, planner); Ray replaced by FakeRuntime."""
    from etrain.service.manager import JobManager

    data_dir = tmp_path_factory.mktemp("bounds")
    settings = Settings(data_dir=data_dir, api_token=TOKEN)
    manager = JobManager(settings, runtime=FakeRuntime(), base_dir=str(data_dir))
    with TestClient(
        create_app(settings, manager=manager),
        headers={"Authorization": f"Bearer {TOKEN}"},
        raise_server_exceptions=False,
    ) as test_client:
        yield test_client
    manager.close()


def fields_of(response) -> list[str]:
    assert response.status_code == 422, response.text
    return [item["field"] for item in response.json()["detail"]]


# -- the search cap -----------------------------------------------------------------------------


def test_spread_keeps_both_ends_and_at_most_limit():
    assert spread([1, 2, 3], 8) == [1, 2, 3]
    assert spread(list(range(1, 11)), 4) == [1, 4, 7, 10]
    picked = spread(divisors(14414400), 16)
    assert len(picked) == 16 and picked[0] == 1 and picked[-1] == 14414400 and picked == sorted(picked)
    with pytest.raises(ValueError):
        spread([1, 2, 3], 1)


# -- real models pass ---------------------------------------------------------------------------------


def test_llama_405b_at_full_context_on_thousands_of_gpus_passes_every_bound():
    spec = JobSpec.model_validate(
        spec_dict(
            model=LLAMA_405B,
            parallelism={"dp": 128, "tp": 8, "pp": 14, "zero": 1},
            resources={"device": "cuda", "gpus_per_worker": 1, "min_dp": 64, "max_dp": 128},
            training={
                "steps": 1_000_000,
                "global_batch": 2048,
                "micro_batch": 1,
                "precision": "bf16",
                "activation_checkpointing": True,
                "warmup_steps": 8000,
                "seed": 2**40,
            },
            checkpoint={"every_steps": 500, "keep_last": 5},
            fault_tolerance={"max_restarts": 1000, "heartbeat_timeout_s": 3600, "backoff_max_s": 3600},
        )
    )
    assert field_problems(spec) == [] and check_spec(spec) == []
    assert spec.layout.dp * spec.layout.tp * spec.layout.pp == 14336  # ranks, within MAX_WORKERS
    report = plan_report(spec)  # answered, whether 80 GiB holds a 128k context or not
    assert report["estimate"]["world_size"] == 14336
    assert report["estimate"]["params"]["total"] == 405_853_388_800


def test_the_planner_places_the_405b_on_16384_gpus_quickly():
    spec = JobSpec.model_validate(
        spec_dict(
            model={**LLAMA_405B, "seq_len": 8192},
            parallelism={"auto": True, "max_workers": 16384},
            resources={"device": "cuda", "gpus_per_worker": 1},
            training={"global_batch": 2048, "micro_batch": 1, "precision": "bf16", "activation_checkpointing": True},
        )
    )
    started = time.perf_counter()
    plan = resolve_auto(spec)
    elapsed = time.perf_counter() - started
    assert plan.estimate.layout == "pp1·dp2048·tp8 zero=3 sp" and plan.estimate.world_size == 16384
    assert plan.candidates_considered <= MAX_AUTO_LAYOUTS
    assert elapsed < 2.0, f"{elapsed:.2f} s for {plan.candidates_considered} layouts"


def test_the_worst_auto_search_within_the_bounds_is_capped():
    """840 layers (32 divisors) x a 14414400-sequence batch (504 divisors) x 65536 workers: the search
    stops at MAX_AUTO_LAYOUTS layouts and says so, instead of the ~270,000 a range search tried."""
    spec = JobSpec.model_validate(
        spec_dict(
            model={**LLAMA_405B, "n_layers": 840, "seq_len": 8192},
            parallelism={"auto": True, "max_workers": MAX_WORKERS},
            resources={"device": "cuda", "gpus_per_worker": 1},
            training={
                "global_batch": 14414400,
                "micro_batch": 1,
                "precision": "bf16",
                "activation_checkpointing": True,
            },
        )
    )
    started = time.perf_counter()
    with pytest.raises(SpecRejected) as rejected:
        resolve_auto(spec)
    assert time.perf_counter() - started < 5.0
    problem = rejected.value.problems[0]
    assert problem.field == "parallelism.max_workers"
    assert f"the search stopped after {MAX_AUTO_LAYOUTS} layouts" in problem.message
    assert "explicit layout" in problem.fix


# -- one past each bound is a 422 naming the field ----------------------------------------------------

PAST_BOUNDS = [
    ("model.n_layers", {"model": {**LLAMA_405B, "n_layers": bounds.MAX_LAYERS + 1}}),
    ("model.d_model", {"model": {**LLAMA_405B, "d_model": bounds.MAX_D_MODEL + 1}}),
    ("model.n_heads", {"model": {**LLAMA_405B, "n_heads": bounds.MAX_HEADS + 1}}),
    ("model.n_kv_heads", {"model": {**LLAMA_405B, "n_kv_heads": bounds.MAX_HEADS + 1}}),
    ("model.vocab_size", {"model": {**LLAMA_405B, "vocab_size": bounds.MAX_VOCAB + 1}}),
    ("model.d_ff", {"model": {**LLAMA_405B, "d_ff": bounds.MAX_D_FF + 1}}),
    ("model.seq_len", {"model": {**LLAMA_405B, "seq_len": bounds.MAX_SEQ_LEN + 1}}),
    ("model.n_experts", {"model": {"preset": "qwen3-moe-tiny", "n_experts": bounds.MAX_EXPERTS + 1}}),
    ("model.experts_per_token", {"model": {"preset": "qwen3-moe-tiny", "experts_per_token": bounds.MAX_EXPERTS + 1}}),
    ("model.moe_d_ff", {"model": {"preset": "qwen3-moe-tiny", "moe_d_ff": bounds.MAX_D_FF + 1}}),
    (
        "model.router_aux_loss_coef",
        {"model": {"preset": "qwen3-moe-tiny", "router_aux_loss_coef": bounds.MAX_AUX_LOSS_COEF * 2}},
    ),
    ("model.router_aux_loss_coef", {"model": {"preset": "qwen3-moe-tiny", "router_aux_loss_coef": float("nan")}}),
    ("model.hf", {"model": {"hf": "x" * (bounds.MAX_PATH + 1)}}),
    ("model.hf", {"model": {"hf": "bad\x00path"}}),
    ("training.steps", {"training": {"steps": bounds.MAX_STEPS + 1}}),
    ("training.global_batch", {"training": {"global_batch": MAX_GLOBAL_BATCH + 1}}),
    ("training.micro_batch", {"training": {"micro_batch": MAX_GLOBAL_BATCH + 1}}),
    ("training.lr", {"training": {"lr": bounds.MAX_LR * 2}}),
    ("training.warmup_steps", {"training": {"warmup_steps": bounds.MAX_STEPS + 1}}),
    ("training.seed", {"training": {"seed": bounds.MAX_SEED + 1}}),
    ("training.seed", {"training": {"seed": -1}}),
    ("training.steps", {"training": {"steps": "10"}}),  # a string is not a number, strictly
    ("parallelism.dp", {"parallelism": {"dp": MAX_WORKERS + 1}}),
    ("parallelism.tp", {"parallelism": {"tp": bounds.MAX_HEADS + 1}}),
    ("parallelism.pp", {"parallelism": {"pp": bounds.MAX_LAYERS + 1}}),
    ("parallelism.dp_replicate", {"parallelism": {"dp_replicate": MAX_WORKERS + 1}}),
    ("parallelism.microbatches", {"parallelism": {"microbatches": MAX_GLOBAL_BATCH + 1}}),
    ("parallelism.virtual_stages", {"parallelism": {"virtual_stages": bounds.MAX_LAYERS + 1}}),
    ("parallelism.max_workers", {"parallelism": {"auto": True, "max_workers": MAX_WORKERS + 1}}),
    ("resources.min_dp", {"resources": {"min_dp": MAX_WORKERS + 1}}),
    ("resources.max_dp", {"resources": {"max_dp": MAX_WORKERS + 1}}),
    ("resources.cpus_per_worker", {"resources": {"cpus_per_worker": bounds.MAX_CPUS_PER_WORKER + 1}}),
    ("resources.device_memory_gb", {"resources": {"device_memory_gb": bounds.MAX_DEVICE_MEMORY_GB + 1}}),
    # Found by the fuzzer: 5e-324 CPUs per rank made "ranks per node" infinite (a 500 in admission).
    ("resources.cpus_per_worker", {"resources": {"cpus_per_worker": 5e-324}}),
    ("resources.gpus_per_worker", {"resources": {"gpus_per_worker": 5e-324}}),
    ("training.lr", {"training": {"lr": float("nan")}}),  # Python's JSON reads NaN; a rate never is one
    ("fault_tolerance.backoff_base_s", {"fault_tolerance": {"backoff_base_s": float("inf")}}),
    ("elastic.check_interval_s", {"elastic": {"check_interval_s": 0.01}}),
    ("checkpoint.keep_last", {"checkpoint": {"keep_last": 1001}}),
    ("checkpoint.every_steps", {"checkpoint": {"every_steps": bounds.MAX_STEPS + 1}}),
    ("checkpoint.path", {"checkpoint": {"path": "c" * (bounds.MAX_PATH + 1)}}),
    ("fault_tolerance.max_restarts", {"fault_tolerance": {"max_restarts": bounds.MAX_RESTARTS + 1}}),
    ("fault_tolerance.heartbeat_timeout_s", {"fault_tolerance": {"heartbeat_timeout_s": bounds.MAX_SECONDS + 1}}),
    ("fault_tolerance.backoff_max_s", {"fault_tolerance": {"backoff_max_s": bounds.MAX_SECONDS + 1}}),
    ("stragglers.window", {"stragglers": {"window": 10_001}}),
    ("stragglers.patience", {"stragglers": {"patience": 10_001}}),
    ("elastic.check_interval_s", {"elastic": {"check_interval_s": bounds.MAX_SECONDS + 1}}),
    ("data.path", {"data": {"kind": "tokens", "path": "d" * (bounds.MAX_PATH + 1)}}),
    ("name", {"name": "n" * 65}),
    ("model.preset", {"model": {"preset": [None]}}),  # found by the fuzzer: a 500 (unhashable) before
    ("model.preset", {"model": {"preset": {"gpt": 1}}}),
]


@pytest.mark.parametrize(("field", "sections"), PAST_BOUNDS, ids=[f for f, _ in PAST_BOUNDS])
def test_one_past_each_bound_is_a_422_naming_the_field(client, field, sections):
    # json.dumps writes NaN and Infinity as Python's JSON parser (the server's) reads them
    body = {"content": json.dumps(spec_dict(**sections)), "headers": {"Content-Type": "application/json"}}
    response = client.post("/v1/jobs", **body)
    assert fields_of(response) == [field]
    assert client.post("/v1/plan", **body).status_code == 422


REQUEST_BOUNDS = [
    ("GET", "/v1/jobs?offset=61174361396107534336", None, "offset"),  # the known 500: SQLite's int64
    ("GET", f"/v1/jobs?offset={bounds.MAX_CURSOR + 1}", None, "offset"),
    ("GET", "/v1/jobs?limit=1001", None, "limit"),
    ("GET", "/v1/jobs/some-job/events?since=61174361396107534336", None, "since"),
    ("GET", "/v1/jobs/some-job/metrics?since=61174361396107534336", None, "since"),
    ("POST", "/v1/jobs/some-job/scale", {"dp": MAX_WORKERS + 1}, "dp"),
    ("POST", "/v1/jobs/some-job/scale", {"dp": "2"}, "dp"),
    ("POST", "/v1/jobs/some-job/export", {"out": "o" * (bounds.MAX_PATH + 1)}, "out"),
    ("POST", "/v1/jobs/some-job/export", {"out": "x", "step": bounds.MAX_STEPS + 1}, "step"),
]


@pytest.mark.parametrize(("method", "url", "body", "field"), REQUEST_BOUNDS, ids=[r[1] for r in REQUEST_BOUNDS])
def test_query_parameters_and_request_bodies_are_bounded(client, method, url, body, field):
    response = client.request(method, url, json=body)
    assert fields_of(response) == [field]


def test_the_bounds_are_in_the_openapi_document(client):
    document = client.get("/openapi.json").json()
    spec_schema = document["components"]["schemas"]
    steps = spec_schema["TrainingSpec"]["properties"]["steps"]
    assert (steps["minimum"], steps["maximum"]) == (1, bounds.MAX_STEPS)
    listing = {p["name"]: p["schema"] for p in document["paths"]["/v1/jobs"]["get"]["parameters"]}
    assert listing["offset"] == {
        "type": "integer",
        "minimum": 0,
        "maximum": bounds.MAX_CURSOR,
        "default": 0,
        "title": "Offset",
    }
    assert "null" not in str(listing["status"])  # optional parameters are absent or a value, never null


# -- absurd values: answered at once ------------------------------------------------------------------

ABSURD = {
    "model": {"preset": "gpt-tiny", "n_layers": 10**12},
    "parallelism": {"auto": True, "max_workers": 10**9},
    "training": {"global_batch": 10**15, "micro_batch": 1},
}


def _unvalidated_absurd_spec() -> JobSpec:
    """The absurd sizes in a JobSpec built without validation (as code could, with model_construct)."""
    valid = JobSpec.model_validate(spec_dict(parallelism={"auto": True, "max_workers": 8}))
    return valid.model_copy(
        update={
            "model": ModelSpec.model_construct(**{**valid.model.__dict__, "n_layers": 10**12}),
            "parallelism": AutoParallelismSpec.model_construct(auto=True, max_workers=10**9),
            "training": TrainingSpec.model_construct(**{**valid.training.__dict__, "global_batch": 10**15}),
        }
    )


def test_absurd_sizes_are_refused_in_under_100_ms_everywhere(client):
    absurd_fields = {"model.n_layers", "parallelism.max_workers", "training.global_batch"}
    spec = _unvalidated_absurd_spec()

    def timed(call):
        started = time.perf_counter()
        result = call()
        return result, time.perf_counter() - started

    problems, elapsed = timed(lambda: check_spec(spec))
    assert {p.field for p in problems} == absurd_fields and elapsed < 0.1
    problems, elapsed = timed(lambda: check_plan(spec))
    assert {p.field for p in problems} == absurd_fields and elapsed < 0.1
    report, elapsed = timed(lambda: plan_report(spec))
    assert report["feasible"] is False and {p["field"] for p in report["problems"]} == absurd_fields
    assert elapsed < 0.1
    started = time.perf_counter()
    with pytest.raises(SpecRejected) as rejected:
        resolve_auto(spec)
    assert time.perf_counter() - started < 0.1
    assert {p.field for p in rejected.value.problems} == absurd_fields

    for url in ("/v1/plan", "/v1/jobs"):
        response, elapsed = timed(lambda: client.post(url, json=spec_dict(**ABSURD)))
        assert set(fields_of(response)) == absurd_fields, response.text
        assert elapsed < 0.1, f"{url}: {elapsed * 1000:.0f} ms"


# -- the supervisor's rules, at submit ----------------------------------------------------------------


def test_the_supervisors_rules_are_a_422_at_submit_and_no_job_is_made(client):
    before = client.get("/v1/jobs").json()["jobs"]
    response = client.post("/v1/jobs", json=spec_dict(fault_tolerance={"backoff_base_s": 30, "backoff_max_s": 5}))
    assert fields_of(response) == ["fault_tolerance.backoff_max_s"]
    problem = response.json()["detail"][0]
    assert "backoff_max_s=5.0 must be >= backoff_base_s=30.0" in problem["message"]
    assert "at least fault_tolerance.backoff_base_s" in problem["fix"]
    plan = client.post("/v1/plan", json=spec_dict(fault_tolerance={"backoff_base_s": 30, "backoff_max_s": 5})).json()
    assert plan["feasible"] is False and [p["field"] for p in plan["problems"]] == ["fault_tolerance.backoff_max_s"]
    # global_batch / micro_batch = 4 micro-batches: no dp in 3..3 divides it (ElasticPolicy's rule)
    response = client.post(
        "/v1/jobs",
        json=spec_dict(
            parallelism={"dp": 4}, resources={"min_dp": 3, "max_dp": 4}, training={"global_batch": 8, "micro_batch": 2}
        ),
    )
    assert response.status_code == 201, response.text  # dp=4 is legal, 3 is skipped: fine
    response = client.post(
        "/v1/jobs",
        json=spec_dict(parallelism={"auto": True, "max_workers": 4}, training={"global_batch": 9, "micro_batch": 2}),
    )
    assert fields_of(response) == ["training.global_batch"]
    assert "global_batch=9 is not a multiple of micro_batch=2" in response.json()["detail"][0]["message"]
    after = client.get("/v1/jobs").json()["jobs"]
    assert len(after) == len(before) + 1  # only the legal one was recorded


def test_device_memory_cannot_be_raised_above_what_the_operator_allows(tmp_path):
    from etrain.service.manager import JobManager

    runtime = FakeRuntime()
    runtime.gpu_memory_gb = 79.1  # what the cluster's H100s report
    settings = Settings(data_dir=tmp_path, api_token=TOKEN)
    manager = JobManager(settings, runtime=runtime, base_dir=str(tmp_path))
    try:
        client = TestClient(create_app(settings, manager=manager), headers={"Authorization": f"Bearer {TOKEN}"})
        cuda = {"device": "cuda", "gpus_per_worker": 1}
        raised = client.post("/v1/jobs", json=spec_dict(resources={**cuda, "device_memory_gb": 141}))
        assert fields_of(raised) == ["resources.device_memory_gb"]
        assert "141 GiB exceeds the 79.1 GiB per GPU" in raised.json()["detail"][0]["message"]
        assert "at most 79.1" in raised.json()["detail"][0]["fix"]
        lowered = client.post("/v1/jobs", json=spec_dict(resources={**cuda, "device_memory_gb": 40}))
        assert lowered.status_code == 201, lowered.text
        assert client.get("/v1/jobs").json()["jobs"][0]["id"] == lowered.json()["id"]
    finally:
        manager.close()


# -- the elastic policy searches divisors -------------------------------------------------------------


def test_legal_dp_sizes_enumerate_divisors_not_the_range():
    started = time.perf_counter()
    sizes = legal_dp_sizes(MAX_GLOBAL_BATCH, 1, 1, MAX_WORKERS)
    assert sizes == [2**k for k in range(17)]  # 1 .. 65536
    assert legal_dp_sizes(MAX_GLOBAL_BATCH, 1, 1, MAX_WORKERS, dp_multiple=1024) == [2**k for k in range(10, 17)]
    policy = ElasticPolicy(global_batch=MAX_GLOBAL_BATCH, micro_batch=1, min_dp=3, max_dp=MAX_WORKERS)
    assert policy.choose(available_dp=50_000) == 32768 and policy.is_legal(4096) and not policy.is_legal(4095)
    assert time.perf_counter() - started < 0.05
