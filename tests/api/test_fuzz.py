"""Schemathesis fuzzes every operation of the OpenAPI document against the real ASGI app.

The app is ``create_app(Settings(api_token=...), manager=...)`` with the REAL ``etrain.service.manager.JobManager``
(real SQLite store, real spec checks and planner, real admission, device-memory and cross-field rules)
whose Ray side is ``tests.fakes.FakeRuntime`` (simulated supervisors). Not a real local Ray: it costs
~10 s to start on the 2-core CI machine, and every fuzzed spec that passes validation would launch real
training ranks; the manager's code, which answers every request, runs here exactly as in production.

Every operation, schema-valid (positive) and schema-violating (negative) data, ``MAX_EXAMPLES`` each,
derandomized (the same cases on every run), ~20 s in all. Half of the cases of a job-scoped operation
address a real job (one finished, one running, made for the test) instead of a random id, so the routes'
state rules run too, not only their 404. Calls carry the admin bearer token.

Checks, on every response:

* ``not_a_server_error``: no 5xx, ever.
* ``status_code_conformance``: every status the server answers is declared for the operation.
* ``content_type_conformance``: the media type is the declared one.
* ``response_schema_conformance``: the body validates against the declared schema (every error body
  is ``ErrorOut``).
* ``negative_data_rejection``: a request that violates the document is refused with a 4xx, so the
  document says everything the server enforces per field (bounds, types, required and unknown fields).
* ``positive_data_acceptance``: a request the document allows is not refused as malformed. Where the
  answer legitimately depends on more than the request's shape the operation's extra statuses are
  listed in ``STATE_DEPENDENT`` with the reason; nowhere is 422 allowed for a rule the document could
  state (the model's required sizes, a chaos action's fields, an integer's bounds).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.config import PositiveDataAcceptanceConfig  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from etrain.api.app import create_app  # noqa: E402
from etrain.service.settings import Settings  # noqa: E402
from tests.fakes import FakeRuntime  # noqa: E402

TOKEN = "fuzz-token-5b1d9e"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: Cases per operation and mode; ETRAIN_FUZZ_EXAMPLES=500 ETRAIN_FUZZ_RANDOM=1 hunts longer, with new cases.
MAX_EXAMPLES = int(os.environ.get("ETRAIN_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("ETRAIN_FUZZ_RANDOM", "") != "1"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
    positive_data_acceptance,
]
#: schemathesis' default statuses for positive_data_acceptance (a 5xx is not_a_server_error's to report).
ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]
#: Statuses a schema-valid request may also get where the answer depends on more than its shape.
STATE_DEPENDENT = {
    # The spec's cross-field rules: batch divisible by dp·micro_batch, files that exist inside the storage
    # roots, the planner's memory estimate, backoff_max_s >= backoff_base_s... (JSON Schema cannot say them).
    "POST /v1/jobs": ["422"],
    # A legal dp divides the job's micro-batches within its own min_dp..max_dp.
    "POST /v1/jobs/{job_id}/scale": ["422"],
    # The rank must be one of the job's ranks.
    "POST /v1/jobs/{job_id}/chaos": ["422"],
    # A GPT job has no Hugging Face format; ``out`` must be inside the server's storage roots (a setting).
    "POST /v1/jobs/{job_id}/export": ["400", "422"],
    # Paths must be inside the server's storage roots (the rest of an infeasible spec is a 200 answer).
    "POST /v1/plan": ["422"],
}

SPEC = {
    "name": "fuzz",
    "model": {"preset": "llama-tiny"},
    "parallelism": {"dp": 2},
    "resources": {"min_dp": 1, "max_dp": 4},
    "training": {"micro_batch": 1, "global_batch": 8},
}


def _document() -> dict[str, Any]:
    """The OpenAPI document, from an app with no manager (nothing starts at import)."""
    return create_app(Settings(api_token=TOKEN), manager=None).openapi()


def _operations() -> list[tuple[str, str]]:
    """(label, mode) for every operation and mode that has cases: negative data needs something the
    document constrains (a body, a query or header parameter); a lone string path parameter has none."""
    cases = []
    for path, item in _document()["paths"].items():
        for method, operation in item.items():
            label = f"{method.upper()} {path}"
            cases.append((label, "positive"))
            params = [p for p in operation.get("parameters", []) if p["in"] in ("query", "header")]
            if "requestBody" in operation or params:
                cases.append((label, "negative"))
    return cases


@pytest.fixture(scope="module")
def fuzz_env(tmp_path_factory):
    """The app, its schemathesis schema, and the ids of a finished and a running job."""
    from etrain.service.manager import JobManager  # imports Ray (never started: FakeRuntime)

    data_dir = tmp_path_factory.mktemp("fuzz")
    settings_ = Settings(data_dir=data_dir, api_token=TOKEN, enable_chaos=True, poll_interval_s=0.05)
    manager = JobManager(settings_, runtime=FakeRuntime(), base_dir=str(data_dir))
    app = create_app(settings_, manager=manager)
    client = TestClient(app, headers=AUTH, raise_server_exceptions=False)
    done = _submit(client, {**SPEC, "name": "done", "training": {**SPEC["training"], "steps": 2}})
    _wait(client, done, {"SUCCEEDED"})
    running = _submit(client, {**SPEC, "name": "running", "training": {**SPEC["training"], "steps": 10**8}})
    _wait(client, running, {"RUNNING"})
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    yield schema, done, running
    manager.close()


def _submit(client: TestClient, spec: dict[str, Any]) -> str:
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 201, response.text
    return response.json()["id"]


def _wait(client: TestClient, job_id: str, statuses: set[str], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (status := client.get(f"/v1/jobs/{job_id}").json()["status"]) not in statuses:
        assert time.monotonic() < deadline, f"{job_id} is {status}, not {statuses} after {timeout_s} s"
        time.sleep(0.05)


OPERATIONS = _operations()


@pytest.mark.parametrize(("label", "mode"), OPERATIONS, ids=[f"{mode}-{label}" for label, mode in OPERATIONS])
def test_every_operation_conforms(fuzz_env, label: str, mode: str) -> None:
    schema, done, running = fuzz_env
    operation = schema.find_operation_by_label(label)
    assert operation is not None, label
    schema.config.checks.positive_data_acceptance = PositiveDataAcceptanceConfig(
        expected_statuses=ACCEPTED + STATE_DEPENDENT.get(label, [])
    )
    # The token is fixed in the strategy (not added at call time), so a negative case never counts a
    # dropped Authorization header as its violation while the call sends one.
    cases = operation.as_strategy(generation_mode=GenerationMode(mode), headers=AUTH)
    # A following event stream of a running job lasts until the job ends: give it the finished one.
    jobs = [done] if label.endswith("/events") else [done, running]
    real_job = st.sampled_from([None, *jobs]) if "{job_id}" in label else st.none()

    @given(case=cases, job=real_job)
    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=DERANDOMIZE,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def run(case: Any, job: str | None) -> None:
        if job is not None:
            case.path_parameters = {**(case.path_parameters or {}), "job_id": job}
        case.call_and_validate(checks=CHECKS)

    run()
