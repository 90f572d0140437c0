"""`make bench`: issue #9's benchmark suite, each figure against a peer or a formula in the same run.

    python -m benchmarks.suite [--quick] [--only FIGURE ...] [--note TEXT]     # make bench [QUICK=1]

Figures (``benchmarks/results/<figure>.json``, raw samples + the machine; then the table in
``benchmarks/README.md`` is regenerated from them by ``benchmarks.readme_table``):

1. ``startup``   submit → first step: etrain vs Ray Train v2 ``TorchTrainer.fit`` (and torchrun);
2. ``recovery``  SIGKILL of rank 1 → next completed step, steps recomputed: vs Ray Train v2 with
   ``FailureConfig`` and torchrun's elastic agent (1 and 2 come from the same alternating runs,
   ``benchmarks/recovery.py``);
3. ``goodput``   with rank 1 killed every 60 s, 4 kills (quick: 2 kills), a checkpoint every
   ``GOODPUT_EVERY_STEPS`` steps (``benchmarks/recovery.py``);
4. ``stragglers`` detection latency and false positives under DP, TP, PP (and ZeRO-3, PP·DP in the full
   run): ``benchmarks/stragglers.py``'s ``bench_all`` when that module exists; otherwise marked pending;
5. ``hang``      hang → detected → next step, against the heartbeat timeout;
6. ``checkpoint`` sync vs async save overhead, save/load MB/s, restore into another layout;
7. ``pipeline_bubble`` measured idle fraction vs (P-1)/(M+P-1) at M = 2, 4, 8, 16;
8. ``steady_state`` step time vs a bare torch DDP loop;
9. ``resize``    ``scale`` dp 2 → 1 → 2 on a running job → first step at the new size (in place);
10. ``node_loss`` a node of a DP ×2 · TP ×2 job removed → next completed step, repaired in place vs every
   rank relaunched (``in_place: false``), on a three-node local cluster (``benchmarks/node_loss.py``).

``--quick`` is sized to finish within 15 minutes on 2 CPU cores (fewer rounds, a 24-step job, a
180-second goodput window, three straggler layouts); the full run is about three times longer. A figure that fails is written
with its error as a pending row, and the suite goes on; the exit status is 1 if any figure failed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.figures import SUITE_FIGURES, Goal, Row, figure_document, machine_info, write_figure
from benchmarks.peers.common import Job
from benchmarks.procs import LoadSampler

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
FIGURES = SUITE_FIGURES
TITLES = {
    "startup": "1. Startup: submit → first completed step",
    "recovery": "2. Recovery: SIGKILL of one rank → next completed step",
    "goodput": "3. Goodput under repeated rank kills",
    "stragglers": "4. Straggler detection latency and false positives",
    "hang": "5. Hang → detected → next step",
    "checkpoint": "6. Checkpoints: sync vs async overhead, save/load speed, restore into another layout",
    "pipeline_bubble": "7. Pipeline bubble vs (P-1)/(M+P-1)",
    "steady_state": "8. Steady-state step time vs a bare torch DDP loop",
    "resize": "9. Resize: scale request → first step at the new size",
    "node_loss": "10. Node loss → next completed step: in place vs every rank relaunched",
}


@dataclass(frozen=True)
class Sizes:
    """How much of each figure a run measures."""

    recovery_steps: int
    recovery_rounds: int
    run_timeout_s: float
    goodput_interval_s: float
    goodput_kills: int
    hang_repeats: int
    checkpoint_rounds: int
    checkpoint_steps_between: int
    checkpoint_loads: int
    bubble_steps: int
    bubble_budget_s: float
    steady_reps: int
    steady_steps: int
    node_loss_rounds: int


QUICK = Sizes(
    recovery_steps=24,
    recovery_rounds=2,
    run_timeout_s=360,
    goodput_interval_s=60,
    goodput_kills=2,
    hang_repeats=1,
    checkpoint_rounds=3,
    checkpoint_steps_between=3,
    checkpoint_loads=3,
    bubble_steps=4,
    bubble_budget_s=20,
    steady_reps=2,
    steady_steps=12,
    node_loss_rounds=1,
)
FULL = Sizes(
    recovery_steps=40,
    recovery_rounds=5,
    run_timeout_s=600,
    goodput_interval_s=60,
    goodput_kills=4,
    hang_repeats=3,
    checkpoint_rounds=8,
    checkpoint_steps_between=5,
    checkpoint_loads=5,
    bubble_steps=8,
    bubble_budget_s=90,
    steady_reps=5,
    steady_steps=30,
    node_loss_rounds=3,
)
HEARTBEAT_TIMEOUT_S = 5.0


STRAGGLER_LAYOUTS_QUICK = ("DP ×2", "TP ×2", "PP ×2")  # one measured run each; the full run takes every layout
STRAGGLER_SLOWDOWN = 2.0  # the false-positive row's run; the notes give the whole grid
#: Issue #20's goals: a straggler found within this many steps at each slowdown (rows in this order).
STRAGGLER_GOALS = {2.0: 20, 1.5: 40}


def stragglers_figure(quick: bool, log: Callable[[str], None]) -> tuple[list[Row], dict[str, Any]]:
    """Figure 4 from ``benchmarks/stragglers.py``'s ``bench_all`` (owned by the stragglers work), or a
    pending row while that module does not exist. Per layout: the detection latency at 2x (its per-trial
    samples) and the false positives per 1,000 healthy steps (goal 0); the full grid goes to the notes."""
    try:
        module = importlib.import_module("benchmarks.stragglers")
    except ModuleNotFoundError as exc:
        if exc.name != "benchmarks.stragglers":
            raise
        return [
            Row(
                label="4. straggler detection latency / false positives",
                unit="steps",
                etrain=[],
                pending="benchmarks/stragglers.py does not exist yet",
            )
        ], {}
    layouts = STRAGGLER_LAYOUTS_QUICK if quick else tuple(module.LAYOUTS)
    grid = module.bench_all(layouts=layouts, quick=quick)
    rows: list[Row] = []
    for layout in layouts:
        cells = {cell["slowdown"]: cell for cell in grid if cell["layout"] == layout}
        for slowdown, most in STRAGGLER_GOALS.items():
            if slowdown not in cells:
                continue
            slowed = cells[slowdown]
            latencies = [v for v in slowed["latency_samples_steps"] if v is not None]
            found = slowed["detection_latency_steps"] is not None
            rows.append(
                Row(
                    label=f"4. stragglers, {layout}: detection latency at {slowdown:g}× (steps)",
                    unit="steps",
                    etrain=latencies if found else [],
                    goal=Goal(on="etrain", op="<=", value=most, text=f"≤ {most}"),
                    pending=None
                    if found
                    else f"not found: flagged in only {slowed['detected_fraction']:.0%} of the replays",
                    note=(
                        f"detected in {slowed['detected_fraction']:.0%} of {len(slowed['latency_samples_steps'])} "
                        f"replays (compared with {slowed['basis']}); the drill measured "
                        f"{slowed['measured_factor']:.2f}× against {slowed['healthy_factor']:.2f}× healthy noise"
                    ),
                )
            )
        cell = cells[STRAGGLER_SLOWDOWN]
        rows.append(
            Row(
                label=f"4. stragglers, {layout}: false positives per 1,000 healthy steps",
                unit="per 1,000 steps",
                etrain=[cell["false_positives_per_1000_steps"]],
                goal=Goal(on="etrain", op="<=", value=0.0, text="0"),
            )
        )
        log(
            f"  stragglers {layout}: "
            + ", ".join(
                f"{f:g}× {'–' if c['detection_latency_steps'] is None else c['detection_latency_steps']}"
                for f, c in sorted(cells.items())
            )
            + f" steps; false positives {cell['false_positives_per_1000_steps']:g}/1000"
        )
    return rows, {"grid": grid, "layouts": list(layouts)}


def stragglers_notes(raw: dict[str, Any]) -> list[str]:
    """The whole grid: detection latency (training steps) per layout and slowdown."""
    grid = raw.get("grid") or []
    if not grid:
        return []
    slowdowns = sorted({cell["slowdown"] for cell in grid})
    lines = [
        "Straggler detection latency in training steps (–: not reported in most replays), per slowdown "
        + " / ".join(f"{f:g}×" for f in slowdowns)
        + ":"
    ]
    for layout in raw["layouts"]:
        cells = {cell["slowdown"]: cell for cell in grid if cell["layout"] == layout}
        lines.append(
            f"{layout}: "
            + " / ".join(
                "–" if cells[f]["detection_latency_steps"] is None else f"{cells[f]['detection_latency_steps']:g}"
                for f in slowdowns
            )
            + f" (basis: {cells[slowdowns[0]]['basis']})"
        )
    return lines


def measure(
    selected: list[str], sizes: Sizes, quick: bool, workdir: Path, out: Path, note: str, log: Callable[[str], None]
) -> list[str]:
    """Measure the ``selected`` figures, writing each result file as soon as it exists; the failed ones."""
    from benchmarks import engine, node_loss, recovery

    failed: list[str] = []
    job = Job(steps=sizes.recovery_steps)

    def emit(
        name: str,
        rows: list[Row],
        raw: dict[str, Any],
        started: float,
        sampler: LoadSampler,
        notes: list[str] | None = None,
    ) -> None:
        document = figure_document(
            name,
            TITLES[name],
            rows,
            quick=quick,
            seconds=time.monotonic() - started,
            raw=raw,
            notes=notes,
            machine=machine_info(note, list(sampler.samples)),
        )
        log(f"  -> {write_figure(out, document)}")

    def group(names: list[str], produce: Callable[[], dict[str, tuple[list[Row], dict[str, Any]]]]) -> None:
        wanted = [n for n in names if n in selected]
        if not wanted:
            return
        log(f"\n== {', '.join(TITLES[n] for n in wanted)}")
        started = time.monotonic()
        with LoadSampler() as sampler:
            try:
                produced = produce()
            except Exception as exc:  # noqa: BLE001 - one figure failing must not lose the others
                log(traceback.format_exc())
                failed.extend(wanted)
                for name in wanted:
                    emit(
                        name,
                        [
                            Row(
                                label=TITLES[name],
                                unit="",
                                etrain=[],
                                pending=f"failed: {type(exc).__name__}: {str(exc)[:300]}",
                            )
                        ],
                        {"error": traceback.format_exc()[-5000:]},
                        started,
                        sampler,
                    )
                return
        for name in wanted:
            rows, raw = produced[name]
            notes = {
                "startup": recovery.startup_profile,
                "recovery": recovery.recovery_profile,
                "stragglers": stragglers_notes,
            }.get(name, lambda _: None)(raw)
            emit(name, rows, raw, started, sampler, notes)
        log(f"   ({time.monotonic() - started:.0f} s)")

    group(
        ["startup", "recovery"],
        lambda: recovery.recovery_figures(
            job=job, rounds=sizes.recovery_rounds, workdir=workdir / "recovery", timeout_s=sizes.run_timeout_s, log=log
        ),
    )
    group(
        ["goodput", "hang", "resize"],
        lambda: recovery.fault_figures(
            job=job,
            interval_s=sizes.goodput_interval_s,
            kills=sizes.goodput_kills,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            hang_repeats=sizes.hang_repeats,
            scenarios=[name for name in ("goodput", "hang", "resize") if name in selected],
            workdir=workdir / "faults",
            timeout_s=sizes.goodput_interval_s * (sizes.goodput_kills + 1) + 400 + 150 * sizes.hang_repeats,
            log=log,
        ),
    )
    group(["stragglers"], lambda: {"stragglers": stragglers_figure(quick, log)})
    group(
        ["checkpoint"],
        lambda: {
            "checkpoint": engine.checkpoint_figure(
                rounds=sizes.checkpoint_rounds,
                steps_between=sizes.checkpoint_steps_between,
                loads=sizes.checkpoint_loads,
                log=log,
            )
        },
    )
    group(
        ["pipeline_bubble"],
        lambda: {
            "pipeline_bubble": engine.bubble_figure(wanted=sizes.bubble_steps, budget_s=sizes.bubble_budget_s, log=log)
        },
    )
    group(
        ["steady_state"],
        lambda: {"steady_state": engine.steady_state_figure(reps=sizes.steady_reps, steps=sizes.steady_steps, log=log)},
    )
    group(
        ["node_loss"],
        lambda: {
            "node_loss": node_loss.node_loss_figure(
                rounds=sizes.node_loss_rounds, workdir=workdir / "node_loss", timeout_s=sizes.run_timeout_s, log=log
            )
        },
    )
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 15-minute version (2 CPU cores)")
    parser.add_argument("--only", action="append", choices=FIGURES, help="measure only this figure (repeatable)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the result files go")
    parser.add_argument("--note", default="", help="recorded with the machine, e.g. 'shared with 6 test runs'")
    parser.add_argument("--no-readme", action="store_true", help="do not regenerate the table in benchmarks/README.md")
    parser.add_argument("--keep", action="store_true", help="keep the runs' working directories (logs)")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    selected = args.only or list(FIGURES)
    started = time.monotonic()

    def log(message: str) -> None:
        print(
            f"[{time.monotonic() - started:6.0f} s] {message}" if not message.startswith("\n") else message, flush=True
        )

    log(f"benchmark suite ({'quick' if args.quick else 'full'}): {', '.join(selected)}")
    workdir = Path(tempfile.mkdtemp(prefix="etrain-bench-suite-"))
    try:
        failed = measure(selected, sizes, args.quick, workdir, args.out, args.note, log)
    finally:
        if args.keep:
            log(f"run directories kept in {workdir}")
        else:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
    if not args.no_readme:
        from benchmarks.readme_table import update_readme

        update_readme(results=args.out)
        log("benchmarks/README.md: the suite's table regenerated")
    log(f"done in {(time.monotonic() - started) / 60:.1f} min" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
