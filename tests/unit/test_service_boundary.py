"""Values that cross the service's boundary: settings from the environment, errors across pickling
(a supervisor actor raises them over Ray), and the chaos request's validation."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from pydantic import ValidationError

from etrain.service.errors import (
    ChaosDisabled,
    JobConflict,
    JobNotFound,
    ServiceUnavailable,
    SettingsError,
    SpecRejected,
)
from etrain.service.planning.spec import SpecProblem
from etrain.service.ports import ChaosRequest
from etrain.service.settings import Settings
from etrain.workers.protocol.errors import EtrainError

# -- settings -----------------------------------------------------------------------------------------


def test_defaults_bind_to_loopback_with_no_token_and_no_chaos():
    settings = Settings.from_env({})
    assert (settings.host, settings.port, settings.ray_address) == ("127.0.0.1", 8000, None)
    assert (settings.api_token, settings.enable_chaos) == (None, False)
    assert settings.db_path == Path(".etrain/etrain.db")
    assert settings.checkpoint_root("job-1") == Path(".etrain/checkpoints/job-1")
    assert settings.api_url == "http://127.0.0.1:8000"
    assert settings.dashboard_url == "http://127.0.0.1:8265"


def test_environment_then_overrides_and_none_means_not_given():
    env = {
        "ETRAIN_HOST": "0.0.0.0",
        "ETRAIN_PORT": "9000",
        "ETRAIN_DATA_DIR": "/srv/etrain",
        "ETRAIN_RAY_ADDRESS": "ray://head:10001",
        "ETRAIN_API_TOKEN": "s3cret-0123456789",
        "ETRAIN_ENABLE_CHAOS": "1",
    }
    settings = Settings.from_env(env, port=9100, host=None)
    assert (settings.host, settings.port) == ("0.0.0.0", 9100)
    assert settings.data_dir == Path("/srv/etrain") and settings.db_path == Path("/srv/etrain/etrain.db")
    assert (settings.ray_address, settings.api_token, settings.enable_chaos) == (
        "ray://head:10001",
        "s3cret-0123456789",
        True,
    )


def test_the_token_never_shows_in_repr_and_empty_means_unset():
    assert "s3cret-0123456789" not in repr(Settings(api_token="s3cret-0123456789"))
    assert Settings.from_env({"ETRAIN_API_TOKEN": "", "ETRAIN_RAY_ADDRESS": ""}).api_token is None


@pytest.mark.parametrize(
    ("env", "field"),
    [
        ({"ETRAIN_PORT": "eighty"}, "ETRAIN_PORT"),
        ({"ETRAIN_ENABLE_CHAOS": "maybe"}, "ETRAIN_ENABLE_CHAOS"),
        ({"ETRAIN_PORT": "70000"}, "port"),
    ],
)
def test_bad_settings_name_the_variable(env, field):
    with pytest.raises(SettingsError) as raised:
        Settings.from_env(env)
    assert raised.value.field == field


def test_unknown_overrides_are_a_programming_error():
    with pytest.raises(TypeError, match="unknown settings"):
        Settings.from_env({}, hots="x")


# -- errors ---------------------------------------------------------------------------------------------

PROBLEMS = [
    SpecProblem(field="training.global_batch", message="not divisible", fix="use 8"),
    SpecProblem(field="data.path", message="missing"),
]


@pytest.mark.parametrize(
    "error",
    [
        SpecRejected(PROBLEMS),
        JobNotFound("job-7"),
        JobConflict("job job-7 is SUCCEEDED", job_id="job-7", status="SUCCEEDED", fix="nothing to cancel"),
        ChaosDisabled(),
        ServiceUnavailable("Ray is down", fix="retry"),
        SettingsError("bad port", field="port", fix="use 8000"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_errors_survive_pickling_with_every_field(error):
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and isinstance(copy, EtrainError)
    assert vars(copy) == vars(error)
    assert str(copy) == str(error)


def test_spec_rejected_summarises_every_problem():
    error = SpecRejected(PROBLEMS)
    assert error.problems == PROBLEMS
    assert error.message == "the job spec has 2 problems: training.global_batch: not divisible; data.path: missing"
    assert (error.field, error.fix) == ("training.global_batch", "use 8")


def test_not_found_names_the_job_and_how_to_list_jobs():
    error = JobNotFound("job-7")
    assert "'job-7'" in error.message and "etrain list" in error.fix


# -- chaos requests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_body",
    [
        {"action": "kill_rank", "rank": 0},
        {"action": "kill_actor", "rank": 1, "at_step": 5},
        {"action": "slow_rank", "rank": 2, "factor": 3.0},
        {"action": "slow_rank", "rank": 2, "factor": 1.0},  # ends an earlier slowdown
        {"action": "hang_rank", "rank": 0, "at_step": 0},
        {"action": "corrupt_checkpoint", "step": 10},
        {"action": "hold_host_memory", "rank": 1, "gib": 2.5},
        {"action": "hold_host_memory", "rank": 1, "gib": 0.0},  # lets go of it
    ],
)
def test_valid_chaos_requests(request_body):
    assert ChaosRequest.model_validate(request_body).model_dump(exclude_none=True) == request_body


@pytest.mark.parametrize(
    ("request_body", "field", "words"),
    [
        ({"action": "kill_rank"}, "rank", "needs a rank"),
        ({"action": "slow_rank", "rank": 0}, "factor", "factor >= 1"),
        ({"action": "slow_rank", "rank": 0, "factor": 0.5}, "factor", "factor >= 1"),
        ({"action": "kill_rank", "rank": 0, "factor": 2.0}, "factor", "only to slow_rank"),
        ({"action": "corrupt_checkpoint"}, "step", "needs the step"),
        ({"action": "corrupt_checkpoint", "step": 3, "rank": 0}, "rank", "takes no rank"),
        ({"action": "hang_rank", "rank": 0, "step": 3}, "step", "use at_step"),
        ({"action": "kill_rank", "rank": -1}, "rank", "greater than or equal to 0"),
        ({"action": "explode", "rank": 0}, "action", "kill_rank"),
        ({"action": "kill_rank", "rank": 0, "when": 3}, "when", "Extra inputs"),
        ({"action": "hold_host_memory", "rank": 0}, "gib", "needs gib"),
        ({"action": "hold_host_memory", "rank": 0, "gib": -1.0}, "gib", "greater than or equal to 0"),
        ({"action": "hold_host_memory", "rank": 0, "gib": 5000.0}, "gib", "less than or equal to 4096"),
        ({"action": "slow_rank", "rank": 0, "factor": 2.0, "gib": 1.0}, "gib", "only to hold_host_memory"),
    ],
)
def test_invalid_chaos_requests_name_the_field(request_body, field, words):
    with pytest.raises(ValidationError) as raised:
        ChaosRequest.model_validate(request_body)
    errors = raised.value.errors()
    assert [error["loc"] for error in errors] == [(field,)]
    assert words in errors[0]["msg"]
