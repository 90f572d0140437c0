"""The benchmark suite's pure parts: ratios of medians, goals, the recovery arithmetic, the table in
benchmarks/README.md."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.figures import (
    Goal,
    Row,
    figure_document,
    load_figure,
    median,
    ratio_of_medians,
    row_summary,
    write_figure,
)
from benchmarks.peers.common import Job, etrain_spec, recovery_measures
from benchmarks.readme_table import BEGIN, END, README, render, update_readme

MACHINE = {
    "cpus": 2,
    "cpu_model": "Test CPU",
    "memory_gib": 8.0,
    "versions": {"torch": "2.13.0", "ray": "2.60.0"},
    "commit": "0123456789abcdef",
    "dirty": False,
    "date": "2026-11-23 10:00:00 +0000",
    "note": "shared machine",
    "load_1min": {"min": 1.0, "median": 3.5, "max": 7.25, "samples": 4},
}


def test_ratio_of_medians_is_not_the_median_of_ratios():
    etrain = [1.0, 2.0, 9.0]
    peer = [10.0, 4.0, 20.0]
    assert median(etrain) == 2.0 and median(peer) == 10.0
    assert ratio_of_medians(etrain, peer) == 0.2
    assert statistics_median_of_ratios(etrain, peer) == 0.45  # what it is not


def statistics_median_of_ratios(a, b):
    import statistics

    return statistics.median(x / y for x, y in zip(a, b))


def test_ratio_of_medians_ignores_missing_samples_and_refuses_nothing():
    assert ratio_of_medians([2.0, None, float("nan"), 4.0], [6.0]) == 0.5
    assert math.isnan(ratio_of_medians([], [1.0]))
    assert math.isnan(ratio_of_medians([1.0], [0.0]))
    assert median([3.0, 1.0, 2.0, 10.0]) == 2.5


def test_a_time_goal_says_by_how_much_it_is_missed():
    row = Row(
        label="recovery",
        unit="s",
        etrain=[6.0, 5.0, 7.0],
        reference_name="Ray Train",
        reference=[12.0, 10.0],
        goal=Goal(on="ratio", op="<=", value=0.3, text="≤ 0.3×"),
    )
    s = row_summary(row)
    assert (s.etrain_median, s.reference_median) == (6.0, 11.0)
    assert s.ratio == pytest.approx(6.0 / 11.0)
    assert s.met is False
    assert s.verdict == "no: 1.8× over the goal"  # 0.545 / 0.3
    assert s.n == "3/2"


def test_a_speed_ratio_is_peer_over_etrain():
    row = Row(
        label="steady",
        unit="ms",
        etrain=[100.0, 104.0],
        reference=[98.0, 102.0],
        reference_name="DDP",
        ratio="reference/etrain",
        goal=Goal(on="ratio", op=">=", value=0.97, text="≥ 0.97×"),
    )
    s = row_summary(row)
    assert s.ratio == pytest.approx(100.0 / 102.0)
    assert s.met is True and s.verdict == "yes"


def test_goals_on_etrain_alone_and_on_a_difference():
    goodput = Row(
        label="goodput", unit="fraction", etrain=[0.8], goal=Goal(on="etrain", op=">=", value=0.9, text="≥ 90%")
    )
    assert row_summary(goodput).verdict == "no: 10.0 points short"
    assert row_summary(goodput).n == "1"
    bubble = Row(
        label="bubble",
        unit="fraction",
        etrain=[0.40, 0.36, 0.38],
        reference=[1 / 3],
        reference_name="f",
        goal=Goal(on="difference", op="<=", value=0.12, text="±0.12"),
    )
    assert row_summary(bubble).met is True  # |0.38 - 0.333| = 0.047
    pending = Row(label="stragglers", unit="steps", etrain=[], pending="not yet")
    assert row_summary(pending).verdict == "pending: not yet"


def test_recovery_measures_from_step_rows():
    # rank killed at the start of step index 19 (19 steps done); the next attempt resumes after step 10
    steps = [{"step": s, "ts": 100.0 + s, "attempt": 0} for s in range(1, 20)]
    steps += [{"step": s, "ts": 130.0 + s, "attempt": 1} for s in range(11, 25)]
    m = recovery_measures(steps, start_ts=95.0, kill_ts=119.5, kill_at=19)
    assert m == {
        "startup_s": 6.0,
        "recovery_s": 141.0 - 119.5,
        "resumed_from": 10,
        "recomputed": 9,
        "progress_s": 150.0 - 119.5,
    }
    # a late report of the first attempt after the kill is not the recovery
    late = steps + [{"step": 19, "ts": 119.7, "attempt": 0}]
    assert recovery_measures(late, start_ts=95.0, kill_ts=119.5, kill_at=19)["recovery_s"] == 141.0 - 119.5
    assert recovery_measures(steps[:19], start_ts=95.0, kill_ts=119.5, kill_at=19)["recovery_s"] is None


def test_the_etrain_spec_is_the_job_the_peers_run():
    job = Job(steps=24)
    spec = etrain_spec(job, "bench", fault_tolerance={"heartbeat_timeout_s": 5.0})
    assert spec["parallelism"] == {"dp": 2}
    assert spec["training"] == {"steps": 24, "global_batch": 8, "micro_batch": 2, "lr": 1e-3, "seed": 5}
    assert spec["checkpoint"] == {"every_steps": 10, "keep_last": 3}
    assert spec["fault_tolerance"] == {"heartbeat_timeout_s": 5.0}
    assert spec["model"] == {"preset": "gpt-tiny"}
    from etrain.service.planning.spec import JobSpec

    JobSpec.model_validate(spec)  # a spec the service accepts


def _write(tmp_path, name, rows, quick=True):
    document = figure_document(
        name,
        f"Title {name}",
        rows,
        quick=quick,
        machine=MACHINE,
        seconds=12.3,
        raw={"runs": [1, 2]},
        notes=["Where the time goes:", "+0.19 s `worker_failed`"],
    )
    return write_figure(tmp_path, document)


def test_the_table_is_rendered_from_a_results_file(tmp_path):
    rows = [
        Row(
            label="2. recovery vs Ray Train",
            unit="s",
            etrain=[6.0, 5.0, 7.0],
            reference_name="Ray Train v2",
            reference=[12.0, 10.0, 11.0],
            goal=Goal(on="ratio", op="<=", value=0.3, text="≤ 0.3× of the best peer"),
            note="rank 1 killed at step 19",
        ),
        Row(
            label="2. recovery: steps recomputed",
            unit="steps",
            etrain=[9, 9],
            reference_name="Ray Train v2",
            reference=[9, 9],
            goal=Goal(on="etrain", op="<=", value=10, text="≤ 10"),
        ),
    ]
    path = _write(tmp_path, "recovery", rows)
    document, loaded = load_figure(path)
    assert loaded == rows and document["raw"] == {"runs": [1, 2]}
    assert json.loads(path.read_text())["rows"][0]["etrain"] == [6.0, 5.0, 7.0]  # raw samples, not medians
    text = render(tmp_path)
    lines = text.splitlines()
    assert lines[0] == "| figure | etrain (median) | peer / formula (median) | ratio | goal | met? | n (etrain/peer) |"
    assert lines[2] == (
        "| 2. recovery vs Ray Train | 6.00 s | Ray Train v2: 11.00 s | 0.55× | ≤ 0.3× of the best peer | "
        "no: 1.8× over the goal | 3/3 |"
    )
    assert lines[3] == "| 2. recovery: steps recomputed | 9 steps | Ray Train v2: 9 steps | 1.00× | ≤ 10 | yes | 2/2 |"
    assert (
        "Measured (`--quick`) on 2 CPU cores (Test CPU), 8.0 GiB, torch 2.13.0, ray 2.60.0, commit 0123456789, "
        "2026-11-23 10:00:00 +0000 to 2026-11-23 10:00:00 +0000. 1-minute load average during the figures: "
        "median 3.5–3.5, max 7.2. shared machine"
    ) in text
    assert "- *2. recovery vs Ray Train*: rank 1 killed at step 19" in text
    assert "Where the time goes:\n- +0.19 s `worker_failed`" in text


def test_files_render_in_the_issue_order(tmp_path):
    for name in ("steady_state", "startup", "zz_extra"):
        _write(tmp_path, name, [Row(label=f"row {name}", unit="ms", etrain=[1.0])])
    labels = [line.split("|")[1].strip() for line in render(tmp_path).splitlines()[2:5]]
    assert labels == ["row startup", "row steady_state", "row zz_extra"]


def test_the_readme_region_is_replaced_between_the_markers(tmp_path):
    _write(
        tmp_path,
        "goodput",
        [
            Row(
                label="3. goodput",
                unit="fraction",
                etrain=[0.75],
                goal=Goal(on="etrain", op=">=", value=0.9, text="≥ 90%"),
            )
        ],
    )
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Benchmarks\n\nintro\n\n{BEGIN}\nold table\n{END}\n\n## Limits\n")
    assert update_readme(readme, tmp_path) is True
    text = readme.read_text()
    assert "old table" not in text
    assert "| 3. goodput | 75.0% | – | – | ≥ 90% | no: 15.0 points short | 1 |" in text
    assert text.startswith("# x\n\n## Benchmarks\n\nintro\n\n" + BEGIN + "\n")
    assert text.endswith(END + "\n\n## Limits\n")
    assert update_readme(readme, tmp_path) is False  # idempotent
    readme.write_text("no markers")
    with pytest.raises(SystemExit, match="no benchmark-suite region"):
        update_readme(readme, tmp_path)


def test_the_table_lives_in_the_benchmarks_readme():
    """The suite's table is in benchmarks/README.md (the top README only links it), once."""
    assert README == Path(__file__).resolve().parents[2] / "benchmarks" / "README.md"
    text = README.read_text()
    assert text.count(BEGIN) == text.count(END) == 1
    assert text.index(BEGIN) < text.index(END)
    assert BEGIN not in (README.parents[1] / "README.md").read_text()


def test_the_straggler_grid_becomes_notes():
    from benchmarks.suite import stragglers_notes

    def cell(layout, f, latency):
        return {"layout": layout, "slowdown": f, "detection_latency_steps": latency, "basis": "peers"}

    raw = {"layouts": ["DP ×2"], "grid": [cell("DP ×2", 1.5, None), cell("DP ×2", 2.0, 30), cell("DP ×2", 4.0, 20.0)]}
    assert stragglers_notes(raw) == [
        "Straggler detection latency in training steps (–: not reported in most replays), per slowdown 1.5× / 2× / 4×:",
        "DP ×2: – / 30 / 20 (basis: peers)",
    ]
    assert stragglers_notes({}) == []
