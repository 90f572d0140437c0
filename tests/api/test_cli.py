"""The ``etrain`` CLI against a real uvicorn server on a free loopback port, serving the app over the
named fake ``InMemoryManager``. The server runs in a thread; start and stop both have timeouts."""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import uvicorn
import yaml

from etrain.api import cli
from etrain.api.app import create_app
from etrain.api.cli.client import EXIT_TIMEOUT, EXIT_USAGE
from etrain.service.settings import Settings
from etrain.service.store.job_store import JobStore
from tests.fakes import InMemoryManager, simulated_loss
from tests.service_harness import serve_app

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0
TOKEN = "cli-token-0123456789"
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serving(manager: InMemoryManager, data_dir: Path, **settings: Any):
    port = free_port()
    app = create_app(Settings(data_dir=data_dir, port=port, **settings), manager=manager)
    return serve_app(app, port, start_timeout_s=START_TIMEOUT_S, stop_timeout_s=STOP_TIMEOUT_S)


@pytest.fixture(autouse=True)
def client_data_dir(tmp_path, monkeypatch):
    """The CLI reads a local server's token from $ETRAIN_DATA_DIR/api-token: point it at the test server's."""
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ETRAIN_API_TOKEN", raising=False)


@pytest.fixture
def manager(tmp_path):
    with JobStore(tmp_path / "etrain.db") as store:
        # every GET of a running job trains 4 more steps: a polling client sees it run to the end
        yield InMemoryManager(store, base_dir=str(tmp_path), steps_per_poll=4)


@pytest.fixture
def url(manager, tmp_path):
    with serving(manager, tmp_path) as url:
        yield url


class Result:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err

    def __repr__(self) -> str:
        return f"Result(code={self.code}, out={self.out!r}, err={self.err!r})"


def etrain(url: str, *args: str, token: str | None = None) -> Result:
    out, err = io.StringIO(), io.StringIO()
    argv = ["--url", url, *(["--token", token] if token else []), *args]
    return Result(cli.main(argv, out=out, err=err), out.getvalue(), err.getvalue())


def write_spec(tmp_path: Path, name: str = "tiny", suffix: str = ".yaml", **overrides: Any) -> Path:
    spec: dict[str, Any] = {
        "name": name,
        "model": {"preset": "gpt-tiny"},
        "training": {"steps": 10, "global_batch": 4},
        "parallelism": {"dp": 2},
        "resources": {"min_dp": 1, "max_dp": 2},
    }
    spec.update(overrides)
    path = tmp_path / f"{name}{suffix}"
    path.write_text(json.dumps(spec) if suffix == ".json" else yaml.safe_dump(spec))
    return path


def submitted_id(result: Result) -> str:
    assert result.code == 0, result
    return result.out.split()[1].rstrip(":")


# -- happy paths --------------------------------------------------------------------------------------------


def test_submit_list_status_events(url, tmp_path):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    assert job_id.startswith("tiny-")

    listing = etrain(url, "list")
    assert listing.code == 0
    header, row = listing.out.splitlines()
    assert header.split()[:4] == ["ID", "NAME", "STATUS", "STEP"]
    assert row.split()[:3] == [job_id, "tiny", "RUNNING"]

    status = etrain(url, "status", job_id)
    assert status.code == 0
    assert f"id:          {job_id}" in status.out and "world size 2" in status.out

    events = etrain(url, "events", job_id)
    assert events.code == 0
    assert "submitted: accepted" in events.out.splitlines()[0]


def test_a_json_spec_and_json_output(url, tmp_path):
    result = etrain(url, "--json", "submit", str(write_spec(tmp_path, "jsonjob", suffix=".json")))
    assert result.code == 0
    assert json.loads(result.out)["name"] == "jsonjob"


def test_submit_watch_follows_the_job_to_success(url, tmp_path):
    result = etrain(url, "submit", str(write_spec(tmp_path)), "--watch", "--interval", "0.05")

    assert result.code == 0, result
    lines = result.out.splitlines()
    step_lines = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in step_lines] == [f"{n}/10" for n in range(1, 11)]
    assert step_lines[-1].startswith(f"step 10/10  loss {simulated_loss(10):.4f}  ")
    assert step_lines[-1].endswith(" tokens/s")
    assert any(line.endswith("checkpoint: committed step 5") for line in lines)
    assert "status: SUCCEEDED" in lines
    assert lines[-1].startswith("job tiny-") and "SUCCEEDED at step 10/10" in lines[-1]


def test_watch_exits_1_when_the_job_is_cancelled_or_fails(url, tmp_path, manager):
    cancelled = submitted_id(etrain(url, "submit", str(write_spec(tmp_path, "a"))))
    assert etrain(url, "cancel", cancelled).out.strip() == f"{cancelled}: CANCELLED"
    watched = etrain(url, "watch", cancelled, "--interval", "0.05")
    assert watched.code == 1 and "CANCELLED" in watched.out.splitlines()[-1]

    failed = submitted_id(etrain(url, "submit", str(write_spec(tmp_path, "b"))))
    manager.fail(failed, "loss became NaN at step 3")
    watched = etrain(url, "watch", failed, "--interval", "0.05")
    assert watched.code == 1 and watched.out.splitlines()[-1].endswith("FAILED at step 0/10: loss became NaN at step 3")


def test_watch_gives_up_after_max_wait(tmp_path):
    with JobStore(tmp_path / "still.db") as store:
        still = InMemoryManager(store, base_dir=str(tmp_path))  # no simulated progress
        with serving(still, tmp_path) as url:
            job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
            started = time.monotonic()
            result = etrain(url, "watch", job_id, "--interval", "0.05", "--max-wait", "0.3")
            assert result.code == EXIT_TIMEOUT
            assert time.monotonic() - started < 5
            assert "gave up waiting after 0.3s" in result.err and "still RUNNING" in result.err


def test_scale_and_plan(url, tmp_path):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    scaled = etrain(url, "scale", job_id, "--dp", "1")
    assert scaled.code == 0 and "world size 1" in scaled.out

    plan = etrain(url, "plan", str(write_spec(tmp_path, "planned")))
    assert plan.code == 0, plan
    assert plan.out.splitlines()[0] == "feasible: yes"


def test_export_prints_the_folder_and_its_refusals(url, tmp_path, manager, monkeypatch):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path, "llama", model={"preset": "llama-tiny"}))))
    manager.advance(job_id, 10)  # the fake checkpoints every 5 steps
    monkeypatch.chdir(tmp_path)

    exported = etrain(url, "export", job_id, "--step", "5", "--out", "exports/step5")
    assert exported.code == 0, exported
    assert exported.out == f"{tmp_path / 'exports' / 'step5'}\n"  # made absolute where the command runs
    assert manager.exports == [(job_id, 5, str(tmp_path / "exports" / "step5"))]
    as_json = etrain(url, "--json", "export", job_id, "--out", "newest", "--dtype", "bfloat16")
    assert json.loads(as_json.out) == {"hf": str(tmp_path / "newest"), "step": 10, "dtype": "bfloat16"}

    refused = etrain(url, "export", job_id, "--step", "7", "--out", "s7")
    assert refused.code == 1 and refused.out == ""
    assert refused.err.splitlines()[0] == "error (HTTP 409, conflict):"
    assert "fix: pass a committed step" in refused.err
    assert etrain(url, "export", job_id).code == EXIT_USAGE  # --out is required


def test_the_cli_offers_the_choices_the_api_takes():
    """The CLI keeps its imports light (no pydantic models), so its choices are written out: they must be the
    API's own (``ExportDtype`` for ``export --dtype``, the chaos actions for ``chaos``)."""
    import argparse
    import typing

    from etrain.api.cli.parser import build_parser
    from etrain.service.ports import ChaosAction
    from etrain.workers.protocol.run_config import ExportDtype

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    [dtype] = [a for a in commands["export"]._actions if a.dest == "dtype"]
    [action] = [a for a in commands["chaos"]._actions if a.dest == "action"]
    assert tuple(dtype.choices) == typing.get_args(ExportDtype)
    flat = [name for arg in typing.get_args(ChaosAction) for name in (typing.get_args(arg) or (arg,))]
    assert sorted(action.choices) == sorted(flat)


def test_status_shows_the_artifacts_of_a_job(url, tmp_path, manager):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    assert "artifacts:   -" in etrain(url, "status", job_id).out
    manager.store.update_job(job_id, artifacts={"hf": "/ckpt/job/hf-export"})
    assert "artifacts:   hf: /ckpt/job/hf-export" in etrain(url, "status", job_id).out


# -- errors: printed as field + message + fix, non-zero exit ---------------------------------------------------


def test_an_invalid_spec_prints_each_field_with_its_fix(url, tmp_path):
    spec = write_spec(tmp_path, training={"steps": 10, "global_batch": 5, "stepz": 1})
    result = etrain(url, "submit", str(spec))
    assert result.code == 1 and result.out == ""
    assert result.err.splitlines()[0] == "error (HTTP 422, invalid_spec):"
    assert "  training.stepz is not a known field." in result.err
    assert "    fix: remove it or fix the spelling" in result.err


def test_a_spec_rule_problem_prints_field_and_fix(url, tmp_path):
    result = etrain(url, "submit", str(write_spec(tmp_path, training={"steps": 10, "global_batch": 5})))
    assert result.code == 1
    assert "  training.global_batch=5 is not divisible by parallelism.dp * training.micro_batch" in result.err
    assert "    fix: use a multiple of 2" in result.err


def test_an_infeasible_plan_exits_1_with_the_problems(url, tmp_path):
    result = etrain(url, "plan", str(write_spec(tmp_path, training={"steps": 10, "global_batch": 5})))
    assert result.code == 1
    assert result.out.splitlines()[0] == "feasible: no"
    assert "  training.global_batch: training.global_batch=5 is not divisible" in result.out


def test_unknown_jobs_and_conflicts(url, tmp_path):
    missing = etrain(url, "status", "nope")
    assert missing.code == 1 and "no job with id 'nope'" in missing.err and "etrain list" in missing.err

    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    assert etrain(url, "cancel", job_id).code == 0
    again = etrain(url, "cancel", job_id)
    assert again.code == 1
    assert again.err.splitlines()[0] == f"error (HTTP 409, conflict): job {job_id} is already CANCELLED."


@pytest.mark.parametrize(
    ("content", "words"),
    [(None, "cannot read the spec file"), ("name: [unclosed", "is not valid YAML"), ("- a\n- b\n", "one job spec")],
)
def test_a_bad_spec_file_is_reported_before_any_request(url, tmp_path, content, words):
    path = tmp_path / "spec.yaml"
    if content is not None:
        path.write_text(content)
    result = etrain(url, "submit", str(path))
    assert result.code == 1 and words in result.err


def test_an_unreachable_server_is_reported_with_a_fix():
    result = etrain(f"http://127.0.0.1:{free_port()}", "list")
    assert result.code == 1
    assert "cannot reach the etrain server" in result.err and "etrain serve" in result.err


def test_bad_usage_exits_2(url):
    assert etrain(url, "scale", "job-1").code == 2  # --dp is required


# -- token -------------------------------------------------------------------------------------------------------


def test_the_token_comes_from_the_flag_or_the_environment(manager, tmp_path, monkeypatch):
    with serving(manager, tmp_path, api_token=TOKEN) as url:
        refused = etrain(url, "list")
        assert refused.code == 1 and "HTTP 401" in refused.err and "ETRAIN_API_TOKEN" in refused.err
        assert etrain(url, "list", token=TOKEN).code == 0
        monkeypatch.setenv("ETRAIN_API_TOKEN", TOKEN)
        assert etrain(url, "list").code == 0


# -- the installed entry points -----------------------------------------------------------------------------------


def test_python_m_api_cli_runs_as_a_program(url, tmp_path):
    spec = write_spec(tmp_path)
    completed = subprocess.run(
        [sys.executable, "-m", "etrain.api.cli", "--url", url, "submit", str(spec)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.startswith("submitted tiny-")


def test_serve_builds_settings_from_flags_and_prints_the_urls(monkeypatch, tmp_path):
    calls: dict[str, Any] = {}

    def fake_run(app, **kwargs):  # instead of serving forever: run the lifespan once
        calls["app"], calls["kwargs"] = app, kwargs

    monkeypatch.setattr(uvicorn, "run", fake_run)
    monkeypatch.setenv("ETRAIN_PORT", "9999")
    out = io.StringIO()
    code = cli.main(
        ["serve", "--host", "127.0.0.2", "--port", "8123", "--data-dir", str(tmp_path), "--enable-chaos"], out=out
    )
    assert code == 0
    settings: Settings = calls["app"].state.settings
    assert (settings.host, settings.port, settings.data_dir, settings.enable_chaos) == (
        "127.0.0.2",
        8123,
        tmp_path,
        True,
    )
    assert calls["kwargs"]["host"] == "127.0.0.2" and calls["kwargs"]["port"] == 8123
    assert "starting etrain on http://127.0.0.2:8123" in out.getvalue()


def test_demo_serves_submits_and_follows_the_job(monkeypatch, tmp_path):
    """``make run``: the server (its manager built in the lifespan) and the job, in one command."""

    class StubJobManager(InMemoryManager):
        def __init__(self, settings: Settings):
            super().__init__(JobStore(settings.db_path), base_dir=str(tmp_path), steps_per_poll=5)

    module = types.ModuleType("etrain.service.manager")
    module.JobManager = StubJobManager  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "etrain.service.manager", module)
    out, err = io.StringIO(), io.StringIO()
    port = free_port()

    code = cli.main(
        [
            "demo",
            str(write_spec(tmp_path)),
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--interval",
            "0.05",
            "--exit-when-done",
            "--start-timeout",
            "30",
        ],
        out=out,
        err=err,
    )

    assert code == 0, (out.getvalue(), err.getvalue())
    text = out.getvalue()
    assert f"etrain API:     http://127.0.0.1:{port}" in text and "Ray dashboard:  http://127.0.0.1:8265" in text
    assert "submitted tiny-" in text and "status: SUCCEEDED" in text
    with socket.socket() as sock:  # the server is gone
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_status_shows_the_most_host_memory_a_rank_held_against_its_reservation(url, tmp_path, manager):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    spec = manager.store.get_job(job_id).spec
    manager.store.update_job(job_id, spec={**spec, "resources": {**spec.get("resources", {}), "host_memory_gb": 0.29}})
    assert "host memory: 0.29 GiB reserved a rank\n" in etrain(url, "status", job_id).out  # nothing sampled yet
    manager.store.update_job(job_id, host_memory_gib=1.118)
    expected = "host memory: 0.29 GiB reserved a rank; the largest rank holds 1.12 GiB (latest sample)\n"
    assert expected in etrain(url, "status", job_id).out


def test_status_shows_where_the_time_went_largest_first(url, tmp_path, manager):
    job_id = submitted_id(etrain(url, "submit", str(write_spec(tmp_path))))
    assert "time lost:   -" in etrain(url, "status", job_id).out
    breakdown = {
        "queued": 0.01,
        "startup": 2.0,
        "productive": 30.0,
        "recovery": 4.25,
        "recomputed": 3.1,
        "resizing": 0.5,
    }
    breakdown |= {"checkpoint": 1.0}
    manager.store.update_job(job_id, goodput_breakdown=breakdown)
    assert (
        "time lost:   recovery 4.2s, recomputed 3.1s, startup 2.0s, checkpoint 1.0s (+1 more)"
        in etrain(url, "status", job_id).out
    )
