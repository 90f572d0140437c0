"""The REST API through FastAPI's TestClient, over the named fake ``InMemoryManager`` (real SQLite store,
real spec and planner checks, simulated training), plus a contract check of the real ``JobManager``
driven by ``FakeRuntime``."""

from __future__ import annotations

import json
import logging
import sys
import types
from typing import Any

import pytest
from fastapi.testclient import TestClient

from etrain.api.app import create_app
from etrain.api.routes import get_manager
from etrain.service.errors import ServiceUnavailable
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus
from tests.fakes import FakeRuntime, InMemoryManager, simulated_loss
from tests.service_harness import admin_headers

TOKEN = "test-token-0123456789"


def tiny_spec(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tiny",
        "model": {"preset": "gpt-tiny"},
        "training": {"steps": 20, "global_batch": 8, "micro_batch": 2},
        "parallelism": {"dp": 2},
    }
    spec.update(overrides)
    return spec


@pytest.fixture
def store(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        yield store


@pytest.fixture
def manager(store, tmp_path):
    return InMemoryManager(store, base_dir=str(tmp_path))


def make_client(tmp_path, manager, **settings: Any) -> TestClient:
    """A client of the app; it sends the admin token the app generated unless the test sets api_token."""
    app = create_app(Settings(data_dir=tmp_path, **settings), manager=manager)
    headers = {} if settings.get("api_token") else admin_headers(tmp_path)
    return TestClient(app, raise_server_exceptions=False, headers=headers)


@pytest.fixture
def client(tmp_path, manager):
    return make_client(tmp_path, manager)


@pytest.fixture
def chaos_client(tmp_path, store):
    return make_client(tmp_path, InMemoryManager(store, base_dir=str(tmp_path), enable_chaos=True), enable_chaos=True)


def submit(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=tiny_spec(**overrides))
    assert response.status_code == 201, response.text
    return response.json()


def problems(response) -> dict[str, dict[str, Any]]:
    """field -> problem, from a 422."""
    assert response.status_code == 422, response.text
    return {item["field"]: item for item in response.json()["detail"]}


# -- submit and read --------------------------------------------------------------------------------------


def test_submit_returns_the_new_job(client):
    response = client.post("/v1/jobs", json=tiny_spec())

    assert response.status_code == 201
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["id"].startswith("tiny-")
    assert set(job) == {
        "id",
        "name",
        "status",
        "spec",
        "step",
        "loss",
        "tokens_per_s",
        "world_size",
        "restarts",
        "created_at",
        "updated_at",
        "error",
        "layout",
        "last_checkpoint_step",
        "stragglers",
        "goodput",
        "attempt",
        "artifacts",
        "tenant",
        "priority",
        "mfu",
        "goodput_breakdown",
        "host_memory_gib",
    }
    assert (job["name"], job["status"], job["step"], job["world_size"]) == ("tiny", "RUNNING", 0, 2)
    assert job["mfu"] is None and job["goodput_breakdown"] is None  # no step yet, no refresh yet
    assert job["host_memory_gib"] is None  # no sample yet
    assert job["spec"]["training"]["global_batch"] == 8
    # Stored by alias (it validates again as a JobSpec); unset, it is decided by the device (off on CPU).
    assert "async_save" not in job["spec"]["checkpoint"] and job["spec"]["checkpoint"]["async"] is None
    assert "dp2" in job["layout"]


def test_get_shows_progress(client, manager):
    job_id = submit(client)["id"]
    manager.advance(job_id, 7)

    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["step"], job["loss"], job["last_checkpoint_step"]) == (7, simulated_loss(7), 5)
    assert job["tokens_per_s"] == pytest.approx(8 * 64 / 0.1)
    assert job["mfu"] is None  # a CPU job: no known peak FLOP/s

    manager.MFU = 0.42  # a GPU job's steps report it; the job shows its latest
    manager.advance(job_id, 1)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["mfu"] == 0.42
    assert client.get(f"/v1/jobs/{job_id}/metrics").json()["steps"][-1]["mfu"] == 0.42


def test_list_filters_by_status_and_pages(client, manager):
    first, second, third = (submit(client, name=f"job{n}")["id"] for n in range(3))
    client.post(f"/v1/jobs/{second}/cancel")

    listed = client.get("/v1/jobs").json()
    assert [job["id"] for job in listed["jobs"]] == [third, second, first]
    assert (listed["limit"], listed["offset"]) == (100, 0)
    assert [job["id"] for job in client.get("/v1/jobs?status=CANCELLED").json()["jobs"]] == [second]
    assert [job["id"] for job in client.get("/v1/jobs?status=running").json()["jobs"]] == [third, first]
    assert [job["id"] for job in client.get("/v1/jobs?limit=1&offset=1").json()["jobs"]] == [second]


@pytest.mark.parametrize(
    ("query", "field"), [("status=EXPLODED", "status"), ("limit=0", "limit"), ("offset=-1", "offset")]
)
def test_bad_list_queries_are_422_naming_the_parameter(client, query, field):
    response = client.get(f"/v1/jobs?{query}")
    assert field in problems(response)
    assert response.json()["error"] == "invalid_request"


def test_events_and_metrics_page_with_since(client, manager):
    job_id = submit(client)["id"]
    manager.advance(job_id, 6)

    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert [e["kind"] for e in events["events"]] == ["submitted", "started", "checkpoint"]
    assert [e["seq"] for e in events["events"]] == [1, 2, 3] and events["next_since"] == 3
    assert events["events"][2]["detail"] == {"message": "committed step 5"}
    assert client.get(f"/v1/jobs/{job_id}/events?since=3").json() == {"job_id": job_id, "events": [], "next_since": 3}

    metrics = client.get(f"/v1/jobs/{job_id}/metrics?since=4").json()
    assert [s["step"] for s in metrics["steps"]] == [5, 6] and metrics["next_since"] == 6
    assert metrics["steps"][0] == {
        "step": 5,
        "loss": simulated_loss(5),
        "tokens_per_s": pytest.approx(5120.0),
        "step_s": 0.1,
        "compute_s": pytest.approx(0.08),
        "comm_wait_s": pytest.approx(0.02),
        "ts": metrics["steps"][0]["ts"],
        "attempt": 1,
        "mfu": None,
    }
    assert len(client.get(f"/v1/jobs/{job_id}/metrics").json()["steps"]) == 6


def test_a_nan_loss_is_sent_as_null(client, manager, store):
    job_id = submit(client)["id"]
    store.update_job(job_id, loss=float("nan"), tokens_per_s=float("inf"))
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["loss"], job["tokens_per_s"]) == (None, None)


# -- bad specs: 422 naming the field --------------------------------------------------------------------


def test_an_unknown_field_is_named_with_the_allowed_ones(client):
    response = client.post("/v1/jobs", json=tiny_spec(training={"steps": 5, "global_batch": 8, "stepz": 1}))
    body = response.json()
    problem = problems(response)["training.stepz"]
    assert body["error"] == "invalid_spec"
    assert problem["message"] == "training.stepz is not a known field."
    assert "steps" in problem["fix"] and "global_batch" in problem["fix"]


def test_a_negative_step_count_is_named_with_its_value(client):
    response = client.post("/v1/jobs", json=tiny_spec(training={"steps": -5, "global_batch": 8}))
    assert problems(response)["training.steps"]["message"] == (
        "training.steps=-5: Input should be greater than or equal to 1."
    )


def test_a_global_batch_not_divisible_by_dp_times_micro_batch_says_by_how_much(client):
    response = client.post("/v1/jobs", json=tiny_spec(training={"steps": 5, "global_batch": 10, "micro_batch": 4}))
    problem = problems(response)["training.global_batch"]
    assert "parallelism.dp * training.micro_batch = 2 * 4 = 8" in problem["message"]
    assert "multiple of 8" in problem["fix"]
    assert response.json()["error"] == "invalid_spec"


@pytest.mark.parametrize(
    ("data", "words"),
    [({"kind": "tokens"}, "needs a data.path"), ({"kind": "tokens", "path": "missing/tokens.bin"}, "does not exist")],
)
def test_a_missing_data_path_is_named(client, data, words):
    response = client.post("/v1/jobs", json=tiny_spec(data=data))
    problem = problems(response)["data.path"]
    assert words in problem["message"] and problem["fix"]


def test_every_problem_is_reported_at_once(client):
    spec = tiny_spec(training={"steps": 0, "global_batch": 8})
    del spec["model"]
    assert set(problems(client.post("/v1/jobs", json=spec))) == {"model", "training.steps"}


def test_a_union_field_reports_only_the_branch_the_client_meant(client):
    assert list(problems(client.post("/v1/jobs", json=tiny_spec(parallelism={"dp": 0})))) == ["parallelism.dp"]
    auto = problems(client.post("/v1/jobs", json=tiny_spec(parallelism={"auto": True})))
    assert list(auto) == ["parallelism.max_workers"]
    typo = problems(client.post("/v1/jobs", json=tiny_spec(parallelism={"dp": 2, "Zero": 1})))
    assert list(typo) == ["parallelism.Zero"] and "zero" in typo["parallelism.Zero"]["fix"]
    text = problems(client.post("/v1/jobs", json=tiny_spec(parallelism="automatic")))
    assert text["parallelism"]["message"] == "parallelism='automatic': Input should be 'auto'."


@pytest.mark.parametrize(
    ("content", "content_type", "words"),
    [
        (b'{"name": "tiny", ', "application/json", "not valid JSON"),
        (b"", "application/json", "body is missing"),
        (b"name: tiny", "application/yaml", "not JSON"),
        (b"[1, 2]", "application/json", "must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_clear_422(client, content, content_type, words):
    response = client.post("/v1/jobs", content=content, headers={"content-type": content_type})
    problem = problems(response)["body"]
    assert words in problem["message"]


# -- job state rules ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/jobs/nope", None),
        ("GET", "/v1/jobs/nope/events", None),
        ("GET", "/v1/jobs/nope/metrics", None),
        ("POST", "/v1/jobs/nope/cancel", None),
        ("POST", "/v1/jobs/nope/scale", {"dp": 2}),
    ],
)
def test_an_unknown_job_is_404(client, method, path, body):
    response = client.request(method, path, json=body)
    assert response.status_code == 404
    assert response.json()["error"] == "job_not_found"
    assert "'nope'" in response.json()["message"]


def test_cancel_twice_is_a_conflict(client):
    job_id = submit(client)["id"]
    first = client.post(f"/v1/jobs/{job_id}/cancel")
    assert first.status_code == 202  # accepted; the fake's simulated supervisor stops at once
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "CANCELLED"
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job_id}/events").json()["events"]]
    assert kinds[-2:] == ["cancel_requested", "cancelled"]

    second = client.post(f"/v1/jobs/{job_id}/cancel")
    assert second.status_code == 409
    assert second.json()["error"] == "conflict" and "already CANCELLED" in second.json()["message"]


def test_scale_resizes_within_the_elastic_range(client):
    job_id = submit(client, resources={"min_dp": 1, "max_dp": 4})["id"]
    response = client.post(f"/v1/jobs/{job_id}/scale", json={"dp": 4})
    assert response.status_code == 202
    assert (response.json()["world_size"], "dp4" in response.json()["layout"]) == (4, True)


def test_scale_outside_the_range_or_of_a_finished_job_is_refused(client, manager):
    job_id = submit(client)["id"]
    assert "dp" in problems(client.post(f"/v1/jobs/{job_id}/scale", json={"dp": 3}))
    assert "dp" in problems(client.post(f"/v1/jobs/{job_id}/scale", json={"dp": 0}))
    assert "dp" in problems(client.post(f"/v1/jobs/{job_id}/scale", json={}))
    manager.advance(job_id, 20)
    assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "SUCCEEDED"
    assert client.post(f"/v1/jobs/{job_id}/scale", json={"dp": 1}).status_code == 409


# -- chaos ----------------------------------------------------------------------------------------------------


def test_chaos_is_forbidden_unless_enabled_whatever_the_body(client):
    job_id = submit(client)["id"]
    for body in ({"action": "kill_rank", "rank": 0}, {"action": "explode"}):
        response = client.post(f"/v1/jobs/{job_id}/chaos", json=body)
        assert response.status_code == 403
        assert response.json()["error"] == "chaos_disabled"
        assert "ETRAIN_ENABLE_CHAOS=1" in response.json()["fix"]


def test_chaos_when_enabled_passes_the_validated_request_on(chaos_client):
    job_id = submit(chaos_client)["id"]
    response = chaos_client.post(f"/v1/jobs/{job_id}/chaos", json={"action": "slow_rank", "rank": 1, "factor": 3})
    assert response.status_code == 200
    assert response.json() == {"id": 1, "action": "slow_rank", "rank": 1, "factor": 3.0, "armed": True}
    manager = chaos_client.app.state.manager
    assert manager.chaos_orders == [(job_id, {"action": "slow_rank", "rank": 1, "factor": 3.0})]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"action": "kill_rank"}, "rank"),
        ({"action": "slow_rank", "rank": 0, "factor": 0.5}, "factor"),
        ({"action": "corrupt_checkpoint"}, "step"),
        ({"action": "kill_rank", "rank": 5}, "rank"),  # valid request, but the job has 2 ranks
    ],
)
def test_bad_chaos_requests_name_the_field(chaos_client, body, field):
    job_id = submit(chaos_client)["id"]
    assert field in problems(chaos_client.post(f"/v1/jobs/{job_id}/chaos", json=body))


# -- Hugging Face models in and out ------------------------------------------------------------------------------


def hf_folder(path, **config: Any):
    """A model folder as far as the service reads it: config.json only (the workers read the weights)."""
    path.mkdir(parents=True, exist_ok=True)
    body = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    body.update(config)
    (path / "config.json").write_text(json.dumps(body))
    return path


def test_an_unsupported_hf_architecture_is_a_422_naming_model_hf_and_the_supported_ones(client, tmp_path):
    hf_folder(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    response = client.post("/v1/jobs", json=tiny_spec(model={"hf": "gpt2", "seq_len": 16}))
    problem = problems(response)["model.hf"]
    assert "GPT2LMHeadModel is not supported" in problem["message"]
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in problem["fix"]
    assert response.json()["error"] == "invalid_spec"


def test_plan_of_an_unreadable_hf_model_is_an_infeasible_report_naming_model_hf(client, tmp_path):
    hf_folder(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"], model_type="gpt2")
    response = client.post("/v1/plan", json=tiny_spec(model={"hf": "gpt2", "seq_len": 16}))
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["feasible"] is False and report["estimate"] is None
    assert [p["field"] for p in report["problems"]] == ["model.hf"]


@pytest.mark.parametrize(
    ("config", "kind"),
    [
        ({}, "llama"),
        ({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 4}, "mixtral"),
    ],
    ids=["llama", "mixtral"],
)
def test_a_hf_job_reads_its_sizes_from_the_folder_and_pins_its_path(client, tmp_path, config, kind):
    hf_folder(tmp_path / f"tiny-{kind}", **config)
    job = submit(
        client, model={"hf": f"tiny-{kind}", "seq_len": 16}, training={"steps": 4, "global_batch": 4, "micro_batch": 2}
    )
    model = job["spec"]["model"]
    assert (model["hf"], model["kind"], model["seq_len"]) == (str(tmp_path / f"tiny-{kind}"), kind, 16)
    assert job["artifacts"] == {}


@pytest.mark.parametrize(
    ("model", "field", "words"),
    [
        ({"hf": "tiny-llama", "preset": "llama-tiny"}, "model.preset", "model.hf and model.preset are exclusive"),
        ({"hf": "tiny-llama", "d_model": 64}, "model.d_model", "model.hf and model.d_model are exclusive"),
        ({"hf": "tiny-llama", "kind": "gpt"}, "model.kind", "model.kind='gpt'"),
        ({"hf": "tiny-llama", "seq_len": 256}, "model.seq_len", "exceeds the model's max_position_embeddings=128"),
        ({"hf": "missing"}, "model.hf", "is not a folder"),
        ({"preset": "llama-tiny", "kind": "gpt"}, "model.kind", "is a llama model"),
    ],
)
def test_bad_hf_model_specs_name_the_field(client, tmp_path, model, field, words):
    hf_folder(tmp_path / "tiny-llama")
    problem = problems(client.post("/v1/jobs", json=tiny_spec(model=model)))[field]
    assert words in problem["message"] and problem["fix"]


@pytest.mark.parametrize(
    ("parallelism", "compile"), [({"cp": 2}, False), ({"cp": 2}, True), ({"dp": 2, "ep": 2}, True)]
)
def test_an_unreadable_model_hf_beside_cp_or_ep_is_its_own_problem_not_a_400(client, parallelism, compile):
    """The cp and ep rules ask the model's family; with no readable model they wait for it (found by
    schemathesis: a missing model.hf beside parallelism.cp answered 400 bad_request; ep's rule for
    training.compile, since lifted, likewise)."""
    training = {"steps": 20, "global_batch": 8, "micro_batch": 2, "compile": compile}
    body = tiny_spec(model={"hf": "missing"}, parallelism=parallelism, training=training)
    problem = problems(client.post("/v1/jobs", json=body))["model.hf"]
    assert "is not a folder" in problem["message"]
    plan = client.post("/v1/plan", json=body)
    assert plan.status_code == 200, plan.text
    assert [p["field"] for p in plan.json()["problems"]] == ["model.hf"], plan.text


def test_an_unregistered_model_kind_is_refused_at_submit_and_plan(client):
    """The run config names a family without asking the registry: the spec refuses the name, with the families."""
    model = {"kind": "mamba", "n_layers": 2, "d_model": 32, "n_heads": 4, "vocab_size": 64, "seq_len": 16}
    for route in ("/v1/jobs", "/v1/plan"):
        problem = problems(client.post(route, json=tiny_spec(model=model)))["model.kind"]
        assert "'gpt', 'llama', 'olmo2', 'qwen3_moe' or 'mixtral'" in problem["message"], (route, problem)
    assert client.get("/v1/jobs").json()["jobs"] == []


def test_export_hf_of_a_gpt_is_refused_at_submit(client):
    problem = problems(client.post("/v1/jobs", json=tiny_spec(checkpoint={"export": "hf"})))["checkpoint.export"]
    assert "built-in GPT" in problem["message"]
    dtype = problems(client.post("/v1/jobs", json=tiny_spec(checkpoint={"export_dtype": "bfloat16"})))
    assert "model.kind='gpt' has none" in dtype["checkpoint.export_dtype"]["message"]
    assert client.post("/v1/jobs", json=tiny_spec(checkpoint={"export_dtype": "float32"})).status_code == 201


def test_export_writes_a_committed_step_and_refuses_what_it_cannot(client, manager, tmp_path):
    job_id = submit(client, model={"preset": "llama-tiny"})["id"]
    manager.advance(job_id, 12)  # the fake checkpoints every 5 steps: 5 and 10 are committed

    response = client.post(f"/v1/jobs/{job_id}/export", json={"step": 5, "out": "exports/s5"})
    assert response.status_code == 200, response.text
    assert response.json() == {"hf": str(tmp_path / "exports" / "s5"), "step": 5, "dtype": "float32"}
    newest = client.post(f"/v1/jobs/{job_id}/export", json={"out": str(tmp_path / "newest"), "dtype": "bfloat16"})
    assert (newest.json()["step"], newest.json()["dtype"]) == (10, "bfloat16")
    assert [e["kind"] for e in client.get(f"/v1/jobs/{job_id}/events").json()["events"]].count("exported") == 2
    halved = submit(client, name="bf16", model={"preset": "llama-tiny"}, checkpoint={"export_dtype": "bfloat16"})
    manager.advance(halved["id"], 5)
    by_default = client.post(f"/v1/jobs/{halved['id']}/export", json={"out": str(tmp_path / "default")}).json()
    assert by_default["dtype"] == "bfloat16"  # the job's checkpoint.export_dtype

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    conflict = client.post(f"/v1/jobs/{job_id}/export", json={"out": str(tmp_path / "full")})
    assert conflict.status_code == 409 and conflict.json()["detail"][0]["field"] == "out"
    uncommitted = client.post(f"/v1/jobs/{job_id}/export", json={"step": 7, "out": str(tmp_path / "s7")})
    assert uncommitted.status_code == 409 and uncommitted.json()["detail"][0]["field"] == "step"

    gpt = submit(client, name="gpt")["id"]
    manager.advance(gpt, 5)
    refused = client.post(f"/v1/jobs/{gpt}/export", json={"out": str(tmp_path / "gpt")})
    assert refused.status_code == 400 and refused.json()["detail"][0]["field"] == "model.kind"
    assert client.post("/v1/jobs/nope/export", json={"out": "x"}).status_code == 404


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "out"),
        ({"out": ""}, "out"),
        ({"out": "x", "step": -1}, "step"),
        ({"out": "x", "bogus": 1}, "bogus"),
        ({"out": "x", "dtype": "int8"}, "dtype"),
    ],
)
def test_bad_export_requests_name_the_field(client, body, field):
    job_id = submit(client, model={"preset": "llama-tiny"})["id"]
    response = client.post(f"/v1/jobs/{job_id}/export", json=body)
    assert field in problems(response)


# -- plan -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "feasible", "params"),
    [
        ({"preset": "gpt-tiny"}, True, None),
        # Mixtral, counted through the family registry: its preset (46.7 B parameters: dp=2 without ZeRO does
        # not fit, which the report says) and its kind with sizes of the spec's own
        ({"preset": "mixtral-8x7b"}, False, 46_702_792_704),
        (
            {"kind": "mixtral", "n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 256, "seq_len": 32}
            | {"d_ff": 32, "n_experts": 4, "experts_per_token": 2},
            True,
            115_520,
        ),
    ],
    ids=["gpt-tiny", "mixtral-8x7b", "mixtral-kind"],
)
def test_plan_explains_a_spec_and_starts_nothing(client, model, feasible, params):
    response = client.post("/v1/plan", json=tiny_spec(model=model))
    assert response.status_code == 200
    report = response.json()
    assert report["feasible"] is feasible
    assert [problem["field"] for problem in report["problems"]] == ([] if feasible else ["parallelism"])
    assert params is None or report["estimate"]["params"]["total"] == params
    assert client.get("/v1/jobs").json()["jobs"] == []


def test_plan_with_auto_answers_context_parallelism_for_a_long_context(client):
    """Llama 3 8B at 131072 tokens on 32 GPUs, compiled (CUDA's default): no layout fits without cp, cp=2 does
    (test_auto_plan_cp_ep.py), each block one graph with the ring inside."""
    spec = tiny_spec(
        model={"preset": "llama3-8b", "seq_len": 131072},
        parallelism={"auto": True, "max_workers": 32},
        training={"steps": 10, "global_batch": 16, "micro_batch": 1, "precision": "bf16"},
        resources={"device": "cuda", "gpus_per_worker": 1},
    )
    response = client.post("/v1/plan", json=spec)
    assert response.status_code == 200
    report = response.json()
    assert report["feasible"] is True and report["layout"] == "pp1·dp2·tp8 cp2 zero=2 sp"
    assert report["auto"]["layout"]["cp"] == 2 and report["estimate"]["training"]["compiled_blocks"] == "whole"
    assert any(reason.startswith("cp=2: ") for reason in report["auto"]["reasons"])


def test_plan_answers_an_infeasible_spec_with_its_problems(client):
    response = client.post("/v1/plan", json=tiny_spec(training={"steps": 5, "global_batch": 10, "micro_batch": 4}))
    assert response.status_code == 200
    report = response.json()
    assert report["feasible"] is False
    assert "training.global_batch" in {problem["field"] for problem in report["problems"]}


def test_plan_still_rejects_a_body_that_is_not_a_spec(client):
    assert "bogus" in problems(client.post("/v1/plan", json=tiny_spec(bogus=1)))


# -- health and metrics ------------------------------------------------------------------------------------------


def test_healthz_reports_the_database_and_ray(tmp_path, manager, store):
    client = make_client(tmp_path, manager, health_cache_s=0)  # every request probes: the change shows at once
    response = client.get("/healthz")
    assert response.status_code == 200
    body = response.json()
    assert body == {"db": "ok", "ray": "ok", "runtime": "fake", "ok": True, "status": "ok", "age_s": body["age_s"]}
    store.close()
    response = client.get("/healthz")
    assert (response.status_code, response.json()["db"], response.json()["ok"]) == (503, "error", False)
    assert response.json()["status"] == "unavailable"


def test_metrics_are_prometheus_text(client, manager):
    job_id = submit(client)["id"]
    manager.advance(job_id, 3)
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = _samples(response.text)
    assert samples[f'etrain_job_step{{job_id="{job_id}",name="tiny"}}'] == 3.0
    assert samples[f'etrain_job_loss{{job_id="{job_id}",name="tiny"}}'] == pytest.approx(simulated_loss(3))
    assert samples['etrain_jobs{status="RUNNING"}'] == 1.0
    assert samples['etrain_jobs{status="FAILED"}'] == 0.0
    assert "# TYPE etrain_tokens_per_second gauge" in response.text


def _samples(text: str) -> dict[str, float]:
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines}


# -- gates: auth and size ------------------------------------------------------------------------------------------


@pytest.fixture
def token_client(tmp_path, manager):
    return make_client(tmp_path, manager, api_token=TOKEN)


@pytest.mark.parametrize("header", [None, "Bearer wrong", f"Basic {TOKEN}", f"Bearer {TOKEN}x", TOKEN])
def test_v1_needs_the_bearer_token(token_client, header):
    headers = {"Authorization": header} if header else {}
    response = token_client.get("/v1/jobs", headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"] == "unauthorized" and "ETRAIN_API_TOKEN" in response.json()["fix"]


def test_the_right_token_opens_v1_and_health_stays_open(token_client):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    assert token_client.get("/v1/jobs", headers=headers).status_code == 200
    assert token_client.post("/v1/jobs", json=tiny_spec(), headers=headers).status_code == 201
    assert token_client.get("/healthz").status_code == 200
    assert token_client.get("/metrics").status_code == 200


def test_unauthenticated_requests_learn_nothing_about_validation(token_client):
    response = token_client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 401


def test_an_oversized_body_is_413(tmp_path, manager):
    client = make_client(tmp_path, manager, max_request_bytes=2_000)
    spec = tiny_spec(name="x" * 10)
    spec["padding"] = "y" * 5_000
    response = client.post("/v1/jobs", json=spec)
    assert response.status_code == 413
    assert response.json()["error"] == "request_too_large" and "2000 bytes" in response.json()["message"]
    assert client.post("/v1/jobs", json=tiny_spec()).status_code == 201


def test_an_oversized_body_without_a_length_is_413_too(tmp_path, manager):
    client = make_client(tmp_path, manager, max_request_bytes=2_000)
    chunks = iter([b'{"name": "' + b"x" * 1_500, b"x" * 1_500 + b'"}'])
    response = client.post("/v1/jobs", content=chunks, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"] == "request_too_large"


# -- errors nobody planned for ------------------------------------------------------------------------------------


class _BrokenManager(InMemoryManager):
    def list(self, status=None, limit=100, offset=0, *, principal=None):
        raise RuntimeError("secret internals: /etc/passwd")

    def get(self, job_id, *, principal=None):
        raise ServiceUnavailable("Ray did not answer within 10s", fix="check the cluster and retry")


def test_an_unexpected_error_is_a_500_without_internals(tmp_path, store, caplog):
    client = make_client(tmp_path, _BrokenManager(store))
    with caplog.at_level(logging.ERROR, logger="etrain.api"):
        response = client.get("/v1/jobs")
    assert response.status_code == 500
    body = response.json()
    assert body["error"] == "internal" and "secret" not in json.dumps(body)
    error_id = body["message"].split("(id ")[1].split(")")[0]
    assert any(error_id in record.getMessage() for record in caplog.records)


def test_an_unreachable_backend_is_503(tmp_path, store):
    response = make_client(tmp_path, _BrokenManager(store)).get("/v1/jobs/any")
    assert (response.status_code, response.json()["error"]) == (503, "service_unavailable")
    assert response.json()["fix"] == "check the cluster and retry"


def test_unknown_endpoints_and_methods_answer_in_the_error_shape(client):
    assert client.get("/v2/jobs").json()["error"] == "not_found"
    response = client.put("/v1/jobs")
    assert (response.status_code, response.json()["error"]) == (405, "method_not_allowed")


# -- wiring: dependency override and the lazily built manager --------------------------------------------------------


def test_the_manager_dependency_can_be_overridden(tmp_path, manager):
    app = create_app(Settings(data_dir=tmp_path))  # no manager and no lifespan run: the override serves
    app.dependency_overrides[get_manager] = lambda: manager
    assert TestClient(app, headers=admin_headers(tmp_path)).get("/v1/jobs").json()["jobs"] == []


def test_without_a_manager_routes_answer_503_not_500(tmp_path):
    response = TestClient(create_app(Settings(data_dir=tmp_path)), headers=admin_headers(tmp_path)).get("/v1/jobs")
    assert (response.status_code, response.json()["error"]) == (503, "service_unavailable")


def test_the_app_builds_its_own_manager_in_the_lifespan_and_closes_it(tmp_path, monkeypatch):
    built: list[Any] = []

    class StubJobManager(InMemoryManager):
        def __init__(self, settings: Settings):
            super().__init__(JobStore(settings.db_path))
            self.settings = settings
            built.append(self)

    module = types.ModuleType("etrain.service.manager")
    module.JobManager = StubJobManager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etrain.service.manager", module)
    ready: list[Any] = []
    settings = Settings(data_dir=tmp_path)
    app = create_app(settings, on_ready=ready.append)

    with TestClient(app, headers=admin_headers(tmp_path)) as client:
        assert client.post("/v1/jobs", json=tiny_spec()).status_code == 201
        assert len(built) == 1 and built[0].settings is settings and ready == built
    assert built[0].closed and app.state.manager is None


# -- contract: the real JobManager behind the same routes, Ray replaced by FakeRuntime -----------------------------


@pytest.fixture
def real_manager(tmp_path):
    manager_module = pytest.importorskip("etrain.service.manager")  # imports Ray (not started)
    settings = Settings(data_dir=tmp_path, enable_chaos=True, poll_interval_s=0.05)
    manager = manager_module.JobManager(settings, runtime=FakeRuntime(steps_per_update=2), base_dir=str(tmp_path))
    yield manager
    manager.close()


def test_the_real_manager_fits_the_routes(tmp_path, real_manager):
    import time

    client = make_client(tmp_path, real_manager, enable_chaos=True)
    job_id = submit(client, training={"steps": 6, "global_batch": 8, "micro_batch": 2})["id"]

    deadline = time.monotonic() + 30
    while client.get(f"/v1/jobs/{job_id}").json()["status"] != "SUCCEEDED":
        assert time.monotonic() < deadline, "the poller never finished the simulated job"
        time.sleep(0.05)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert (job["step"], job["loss"]) == (6, simulated_loss(6))
    assert [s["step"] for s in client.get(f"/v1/jobs/{job_id}/metrics").json()["steps"]] == [1, 2, 3, 4, 5, 6]
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job_id}/events").json()["events"]]
    assert kinds[0] == "submitted" and "succeeded" in kinds
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409
    assert client.post(f"/v1/jobs/{job_id}/scale", json={"dp": 1}).status_code == 409

    other = submit(client, name="other", training={"steps": 10_000, "global_batch": 8, "micro_batch": 2})["id"]
    order = client.post(f"/v1/jobs/{other}/chaos", json={"action": "kill_rank", "rank": 1, "at_step": 3})
    assert order.status_code == 200 and order.json()["armed"] is True
    assert real_manager.runtime.jobs[other]["chaos"] == [{"action": "kill_rank", "rank": 1, "at_step": 3}]
    assert "rank" in problems(client.post(f"/v1/jobs/{other}/chaos", json={"action": "kill_rank", "rank": 9}))
    cancelled = client.post(f"/v1/jobs/{other}/cancel")  # answered at once; delivered off the request thread
    assert cancelled.status_code == 202 and not JobStatus(cancelled.json()["status"]).is_terminal
    deadline = time.monotonic() + 10
    while client.get(f"/v1/jobs/{other}").json()["status"] != JobStatus.CANCELLED:
        assert time.monotonic() < deadline, "the cancel never reached the simulated supervisor"
        time.sleep(0.05)
    assert ("cancel", other) in real_manager.runtime.calls
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{other}/events").json()["events"]]
    assert kinds.index("cancel_requested") < kinds.index("cancelled")

    assert client.get("/healthz").status_code == 200
    assert 'etrain_jobs{status="SUCCEEDED"} 1.0' in client.get("/metrics").text
    assert "training.global_batch" in problems(
        client.post("/v1/jobs", json=tiny_spec(training={"steps": 5, "global_batch": 10, "micro_batch": 4}))
    )


def test_the_real_manager_records_artifacts_and_refuses_exports_it_cannot_do(tmp_path, real_manager):
    import time

    hf_folder(tmp_path / "tiny-llama")
    client = make_client(tmp_path, real_manager, enable_chaos=True)
    training = {"steps": 4, "global_batch": 4, "micro_batch": 2}
    job_id = submit(client, model={"hf": "tiny-llama", "seq_len": 16}, training=training)["id"]
    deadline = time.monotonic() + 30
    while (job := client.get(f"/v1/jobs/{job_id}").json())["status"] != "SUCCEEDED":
        assert time.monotonic() < deadline, "the poller never finished the simulated job"
        time.sleep(0.05)
    checkpoint_root = real_manager.settings.checkpoint_root(job_id).resolve()
    assert job["artifacts"] == {"hf": str(checkpoint_root / "hf-export")}  # policy: export defaults to hf
    assert real_manager.runtime.jobs[job_id]["policy"].export is True

    none_committed = client.post(f"/v1/jobs/{job_id}/export", json={"out": str(tmp_path / "out")})
    assert none_committed.status_code == 409
    assert "nothing is committed yet" in none_committed.json()["message"]
    gpt = submit(client, name="gpt", training=training)["id"]
    assert real_manager.runtime.jobs[gpt]["policy"].export is False
    refused = client.post(f"/v1/jobs/{gpt}/export", json={"out": str(tmp_path / "out")})
    assert refused.status_code == 400 and "built-in GPT" in refused.json()["message"]
    assert not any(call[0] == "export" for call in real_manager.runtime.calls)
