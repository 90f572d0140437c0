"""``etrain plot JOB -o FILE.png``: the curves and marks computed from a job's REST history, and the
PNG itself, read back pixel by pixel (a missing curve or mark changes what is on it)."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from etrain.api import cli
from etrain.api.cli.plot import MARKS, PANELS, History, render, series
from etrain.service.decisions.goodput import StepTime, goodput, productive_seconds
from etrain.service.store.job_store import JobStore
from etrain.service.store.records import JobStatus, StepRecord
from tests.api.test_cli import serving, write_spec
from tests.fakes import InMemoryManager

T0 = 1_000.0  # the submit time of the synthetic job


def row(step: int, ts: float, attempt: int = 1, **fields) -> dict:
    return {
        "step": step,
        "ts": ts,
        "attempt": attempt,
        "loss": 5.0 - step / 10,
        "tokens_per_s": 1000.0 + step,
        "step_s": 0.5,
        "mfu": 0.3,
        **fields,
    }


def event(kind: str, ts: float, message: str) -> dict:
    return {"kind": kind, "ts": ts, "detail": {"message": message}}


def restarted_job() -> History:
    """30 steps; attempt 1 ran steps 1-12 and died, attempt 2 resumed from the step-10 checkpoint, re-ran 11-12
    (their rows replaced, as the store keeps them) and went on; the job was resized before step 25."""
    rows = [row(s, T0 + 10 + s) for s in range(1, 11)]
    rows += [row(s, T0 + 40 + s, attempt=2) for s in range(11, 31)]
    events = [
        event("submitted", T0, "accepted"),
        event("checkpoint_committed", T0 + 20.5, "step 10, 2 ranks"),
        event("worker_failed", T0 + 23, "rank 1 died"),
        event("restarting", T0 + 23.1, "restart 1/3 from step 10 in 1s"),
        event("checkpoint", T0 + 60.5, "committed step 20"),  # the in-memory manager's name for it
        event("resized", T0 + 64.5, "attempt 2: dp=1 world_size=1, from step 20"),
    ]
    return History(
        job={
            "id": "tiny-1",
            "name": "tiny",
            "status": "RUNNING",
            "step": 30,
            "restarts": 1,
            "created_at": T0,
            "spec": {"training": {"steps": 30}},
        },
        steps=rows,
        events=events,
    )


def test_the_series_follow_the_steps_and_the_marks_sit_where_things_happened():
    history = restarted_job()
    data = series(history)
    assert data.steps == list(range(1, 31))
    assert data.loss == [pytest.approx(5.0 - s / 10) for s in range(1, 31)]
    assert data.mfu == [0.3] * 30
    # a restart sits at the last step still in the history before it (10: 11-12 were re-run later)
    assert (data.restarts, data.resizes, data.checkpoints) == ([10], [24], [10, 20])
    # goodput: the control plane's definition at each report; the last point is the job's goodput
    last = goodput(
        productive_seconds(StepTime(r["step"], r["attempt"], r["step_s"]) for r in history.steps),
        submitted_at=T0,
        now=T0 + 70,
    )
    assert data.goodput[-1] == pytest.approx(last) == pytest.approx(15 / 70)
    assert data.goodput[9] == pytest.approx(5 / 20)  # step 10 at T0+20: 10 steps of 0.5 s in 20 s
    assert data.goodput[10] < data.goodput[9]  # the restart's lost time shows as a dip


def test_a_missing_value_is_a_gap_not_a_zero():
    rows = [row(1, T0 + 1), row(2, T0 + 2, loss=math.nan, mfu=None), row(3, T0 + 3)]
    data = series(History(job={"created_at": T0}, steps=rows, events=[]))
    assert data.loss[1] is None and data.mfu == [0.3, None, 0.3]


def pixels_near(image: np.ndarray, color: str, tolerance: float = 0.09) -> int:
    rgb = np.array([int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(image[..., :3] - rgb).max(axis=-1) < tolerance).sum())


def test_the_figure_has_four_panels_with_each_curve_and_every_mark_on_each(tmp_path):
    data = series(restarted_job())
    figure = render(data, tmp_path / "job.png", title="tiny")
    assert [ax.get_title(loc="left") for ax in figure.axes] == list(PANELS)
    curves = {
        line.get_gid(): list(line.get_ydata()) for ax in figure.axes for line in ax.lines if line.get_gid() in PANELS
    }
    assert curves["loss"] == pytest.approx(data.loss)
    assert curves["MFU (%)"] == pytest.approx([30.0] * 30)
    assert curves["goodput (%)"] == pytest.approx([100 * g for g in data.goodput])
    marks = [(line.get_gid(), line.get_xdata()[0]) for ax in figure.axes for line in ax.lines]
    assert sorted(x for gid, x in marks if gid == "restart") == [10] * 4  # once per panel
    assert sorted(x for gid, x in marks if gid == "resize") == [24] * 4
    assert sorted(x for gid, x in marks if gid == "checkpoint") == [10] * 4 + [20] * 4


def test_etrain_plot_writes_a_png_of_the_jobs_rest_history(tmp_path, monkeypatch):
    """Over the REST API of a real server: steps and events in its store, the PNG read back."""
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("ETRAIN_API_TOKEN", raising=False)
    with JobStore(tmp_path / "etrain.db") as store:
        manager = InMemoryManager(store, base_dir=str(tmp_path))
        with serving(manager, tmp_path) as url:
            plain, marked = (_submit(url, tmp_path, name) for name in ("plain", "marked"))
            for job_id, marks in ((plain, False), (marked, True)):
                created = store.get_job(job_id).created_at
                store.add_steps(
                    job_id,
                    [
                        StepRecord(
                            job_id=job_id,
                            step=s,
                            loss=4.0 - s / 20,
                            tokens_per_s=2000.0 + 10 * s,
                            step_s=0.5,
                            compute_s=0.4,
                            comm_wait_s=0.1,
                            ts=created + s,
                            attempt=1,
                            mfu=0.2 + s / 200,
                        )
                        for s in range(1, 41)
                    ],
                )
                if marks:
                    store.add_events(
                        job_id,
                        [
                            (created + 10.5, "checkpoint_committed", {"message": "step 10"}),
                            (created + 20.5, "restarting", {"message": "restart 1/3"}),
                            (created + 30.5, "resized", {"message": "dp=1"}),
                        ],
                    )
                store.update_job(job_id, step=40, status=JobStatus.SUCCEEDED)
            outputs = {}
            for job_id in (plain, marked):
                out, err = io.StringIO(), io.StringIO()
                code = cli.main(["--url", url, "plot", job_id, "-o", str(tmp_path / f"{job_id}.png")], out=out, err=err)
                assert code == 0, err.getvalue()
                outputs[job_id] = out.getvalue()
            missing = io.StringIO()
            assert (
                cli.main(
                    ["--url", url, "plot", marked, "-o", str(tmp_path / "nope" / "x.png")],
                    out=io.StringIO(),
                    err=missing,
                )
                == 1
            )
            assert "the folder" in missing.getvalue() and "does not exist" in missing.getvalue()

    assert outputs[marked].strip() == (
        f"wrote {tmp_path / f'{marked}.png'}: steps 1..40 (40 reported), 1 restarts, 1 resizes, 1 checkpoints marked"
    )
    images = {job_id: imread(tmp_path / f"{job_id}.png") for job_id in (plain, marked)}
    for image in images.values():
        assert image.shape == (1100, 1000, 4)  # 10 x 11 inches at 100 dpi
        assert (image[..., :3] < 0.5).any(axis=-1).mean() > 0.005  # text, axes and curves: not blank
        assert pixels_near(image, "#1f77b4") > 2000  # the four curves (matplotlib's C0 blue)
    for kind, (color, _, _) in MARKS.items():
        assert pixels_near(images[plain], color) == 0, kind  # nothing marked where nothing happened
        assert pixels_near(images[marked], color) > 100, kind  # four panels' worth of its line


def _submit(url: str, tmp_path: Path, name: str) -> str:
    out = io.StringIO()
    assert cli.main(["--url", url, "submit", str(write_spec(tmp_path, name))], out=out, err=io.StringIO()) == 0
    return out.getvalue().split()[1].rstrip(":")


def test_a_job_without_steps_has_nothing_to_plot(tmp_path, monkeypatch):
    monkeypatch.setenv("ETRAIN_DATA_DIR", str(tmp_path))
    with JobStore(tmp_path / "etrain.db") as store:
        with serving(InMemoryManager(store, base_dir=str(tmp_path)), tmp_path) as url:
            job_id = _submit(url, tmp_path, "fresh")
            err = io.StringIO()
            assert (
                cli.main(["--url", url, "plot", job_id, "-o", str(tmp_path / "x.png")], out=io.StringIO(), err=err) == 1
            )
    assert f"job {job_id} has no step metrics yet (RUNNING)" in err.getvalue()
    assert not (tmp_path / "x.png").exists()


def test_the_history_follows_next_since_over_every_page():
    """Metrics and events come in pages (``?since=N`` -> ``next_since``); a plot needs all of them."""
    from etrain.api.cli.plot import fetch_history

    steps = [{"step": n, "loss": 1.0 / (n + 1)} for n in range(7)]
    events = [{"id": n + 1, "kind": "checkpoint_committed"} for n in range(5)]

    class PagedClient:
        calls: list[tuple[str, int]] = []

        def get(self, path: str, **params):
            if path.endswith("/metrics"):
                self.calls.append(("metrics", params["since"]))
                page = [row for row in steps if row["step"] > params["since"]][:3]
                return {"steps": page, "next_since": page[-1]["step"] if page else params["since"]}
            if path.endswith("/events"):
                self.calls.append(("events", params["since"]))
                page = [row for row in events if row["id"] > params["since"]][:2]
                return {"events": page, "next_since": page[-1]["id"] if page else params["since"]}
            return {"id": "job-1", "status": "SUCCEEDED"}

    client = PagedClient()
    history = fetch_history(client, "job-1")
    assert history.steps == steps and history.events == events and history.job["id"] == "job-1"
    assert client.calls == [
        ("metrics", -1),
        ("metrics", 2),
        ("metrics", 5),
        ("metrics", 6),
        ("events", 0),
        ("events", 2),
        ("events", 4),
        ("events", 5),
    ]
