"""``etrain plot JOB -o FILE.png``: a job's loss, tokens/s, MFU and goodput over its steps, with its
restarts, resizes and checkpoints marked.

Everything comes over the REST API, as for any other command: ``GET /v1/jobs/{id}`` (submit time,
status), ``GET /v1/jobs/{id}/metrics`` (the per-step rows, paged with ``?since=``) and
``GET /v1/jobs/{id}/events`` (paged likewise). Three steps, each testable on its own:

* :func:`fetch_history`: the job, all its step rows and all its events;
* :func:`series`: the curves and the marks, pure. Goodput at a step uses the control plane's own
  definition (``service/decisions/goodput.py``): the kept step time reported up to that step's report,
  over the wall time since the submit, so the last point is the job's ``goodput``. A mark sits at the
  last step (of those the history keeps) reported before its event: a restart at the step it resumed
  from, since the rows of the steps it re-ran were replaced; a checkpoint at the step its message names;
* :func:`render`: the figure, drawn with matplotlib's Agg canvas (no display, no pyplot state) and
  saved by extension (PNG; .svg and .pdf work too). matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import argparse
import bisect
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from etrain.api.cli.client import EXIT_OK, Client, CliError
from etrain.api.cli.output import total_steps
from etrain.service.decisions.goodput import ProductiveTally, StepTime, goodput

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Event kinds marked on the plot. ``restarting``: a restart from the last checkpoint (the supervisor's
#: fault and in-place repair paths); ``node_lost`` and ``supervisor_lost``: a relaunch that spends no
#: budget. ``resized``: a new data-parallel degree is up. ``checkpoint_committed``: a step every rank
#: saved (``checkpoint``: the same, as the in-memory test manager names it).
RESTART_KINDS = frozenset({"restarting", "node_lost", "supervisor_lost"})
RESIZE_KINDS = frozenset({"resized"})
CHECKPOINT_KINDS = frozenset({"checkpoint_committed", "checkpoint"})
#: The panels, top to bottom (their titles).
PANELS = ("loss", "tokens/s", "MFU (%)", "goodput (%)")
#: Mark colours and line styles (none is a curve's colour: the curves are drawn in matplotlib's "C0").
MARKS = {"restart": ("#d62728", "--", 1.6), "resize": ("#ff7f0e", "-.", 1.6), "checkpoint": ("#2ca02c", ":", 1.0)}
FIGSIZE = (10.0, 11.0)  # inches: 1000 x 1100 pixels at the default 100 dpi


@dataclass(frozen=True)
class History:
    job: dict[str, Any]
    steps: list[dict[str, Any]]
    events: list[dict[str, Any]]


@dataclass(frozen=True)
class Series:
    """The curves (one value per step; None where a row has none) and the steps each mark sits at."""

    steps: list[int]
    loss: list[float | None]
    tokens_per_s: list[float | None]
    mfu: list[float | None]  # fraction, 0..1
    goodput: list[float | None]  # fraction, 0..1
    restarts: list[int]
    resizes: list[int]
    checkpoints: list[int]


def fetch_history(client: Client, job_id: str) -> History:
    """The job, every step row (in step order) and every event (in order), page by page."""
    return History(
        job=client.get(f"/v1/jobs/{job_id}"),
        steps=_all_pages(client, f"/v1/jobs/{job_id}/metrics", "steps", since=-1),
        events=_all_pages(client, f"/v1/jobs/{job_id}/events", "events", since=0),
    )


def _all_pages(client: Client, path: str, key: str, *, since: int) -> list[dict[str, Any]]:
    """Every ``key`` row of a ``?since=N`` route, following ``next_since`` until a page is empty."""
    rows: list[dict[str, Any]] = []
    while True:
        page = client.get(path, since=since)
        if not page[key] or page["next_since"] <= since:
            return rows
        rows += page[key]
        since = page["next_since"]


def series(history: History) -> Series:
    """The curves and marks of a job's history (see the module docstring)."""
    rows = sorted(history.steps, key=lambda row: row["step"])
    by_time = sorted(rows, key=lambda row: row["ts"])
    tally = ProductiveTally()
    goodput_at: dict[int, float | None] = {}
    for row in by_time:
        tally.add(StepTime(step=row["step"], attempt=row.get("attempt", 0), step_s=row.get("step_s")))
        goodput_at[row["step"]] = goodput(tally.value, submitted_at=history.job["created_at"], now=row["ts"])
    times = [row["ts"] for row in by_time]

    def step_at(ts: float) -> int:
        """The last step reported at or before ``ts`` (0 before the first)."""
        i = bisect.bisect_right(times, ts) - 1
        return by_time[i]["step"] if i >= 0 else 0

    marks: dict[str, list[int]] = {"restart": [], "resize": [], "checkpoint": []}
    for event in history.events:
        kind = event["kind"]
        if kind in RESTART_KINDS:
            marks["restart"].append(step_at(event["ts"]))
        elif kind in RESIZE_KINDS:
            marks["resize"].append(step_at(event["ts"]))
        elif kind in CHECKPOINT_KINDS:
            named = re.search(r"\bstep (\d+)", _message(event))
            marks["checkpoint"].append(int(named.group(1)) if named else step_at(event["ts"]))
    return Series(
        steps=[row["step"] for row in rows],
        loss=[_finite(row.get("loss")) for row in rows],
        tokens_per_s=[_finite(row.get("tokens_per_s")) for row in rows],
        mfu=[_finite(row.get("mfu")) for row in rows],
        goodput=[goodput_at.get(row["step"]) for row in rows],
        restarts=marks["restart"],
        resizes=marks["resize"],
        checkpoints=sorted(set(marks["checkpoint"])),
    )


def _message(event: dict[str, Any]) -> str:
    detail = event.get("detail")
    return str(detail.get("message", "")) if isinstance(detail, dict) else str(detail or "")


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _nan(values: list[float | None], scale: float = 1.0) -> list[float]:
    return [math.nan if value is None else value * scale for value in values]


def render(data: Series, path: str | Path, *, title: str = "", dpi: float = 100.0) -> Figure:
    """Draw ``data`` into ``path`` (format by extension) and return the figure: four panels (:data:`PANELS`)
    sharing the step axis; every mark a vertical line with ``gid`` restart / resize / checkpoint on each."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    figure = Figure(figsize=FIGSIZE, dpi=dpi, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(PANELS), 1, sharex=True)
    curves = (_nan(data.loss), _nan(data.tokens_per_s), _nan(data.mfu, 100.0), _nan(data.goodput, 100.0))
    for ax, name, values in zip(axes, PANELS, curves, strict=True):
        ax.set_title(name, loc="left", fontsize=10)
        ax.grid(True, alpha=0.3)
        if all(math.isnan(value) for value in values):
            why = "no peak FLOP/s known for this device (CPU)" if name.startswith("MFU") else "no data"
            ax.text(
                0.5, 0.5, f"{name.split(' ')[0]}: {why}", transform=ax.transAxes, ha="center", va="center", color="0.4"
            )
        ax.plot(data.steps, values, color="C0", linewidth=1.2, gid=name)
    axes[1].ticklabel_format(axis="y", style="plain")
    axes[3].set_ylim(0, 105)
    axes[-1].set_xlabel("step")
    handles = []
    for kind, steps in (("restart", data.restarts), ("resize", data.resizes), ("checkpoint", data.checkpoints)):
        color, style, width = MARKS[kind]
        for step in steps:
            for ax in axes:
                ax.axvline(step, color=color, linestyle=style, linewidth=width, gid=kind)
        if steps:
            handles.append(
                Line2D([], [], color=color, linestyle=style, linewidth=width, label=f"{kind} ({len(steps)})")
            )
    if handles:
        axes[0].legend(handles=handles, loc="upper right", fontsize=8)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.savefig(path, dpi=dpi)
    return figure


def cmd_plot(client: Client, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "`etrain plot` needs matplotlib, which is not installed.",
            fix="pip install 'etrain[plot]' (`make install` has it)",
        ) from None
    path = Path(args.out).expanduser()
    if not path.parent.is_dir():
        raise CliError(f"cannot write {path}: the folder {path.parent} does not exist.", fix="create it first")
    history = fetch_history(client, args.job_id)
    if not history.steps:
        raise CliError(
            f"job {args.job_id} has no step metrics yet ({history.job['status']}).",
            fix=f"plot it once it has run a step (`etrain watch {args.job_id}`)",
        )
    data = series(history)
    job = history.job
    title = (
        f"{job['name']} ({job['id']}): {job['status']}, step {job['step']}/{total_steps(job)}, "
        f"restarts {job['restarts']}"
    )
    try:
        render(data, path, title=title, dpi=args.dpi)
    except (ValueError, OSError) as error:  # an unknown extension, an unwritable file
        raise CliError(f"cannot write {path}: {error}", fix="give a writable .png (or .svg, .pdf) path") from error
    print(
        f"wrote {path}: steps {data.steps[0]}..{data.steps[-1]} ({len(data.steps)} reported), "
        f"{len(data.restarts)} restarts, {len(data.resizes)} resizes, {len(data.checkpoints)} checkpoints marked",
        file=out,
    )
    return EXIT_OK
