"""The benchmark suite's result files: one JSON per figure, raw samples first, every number derived.

A figure (``benchmarks/results/<figure>.json``) holds one or more *rows*. A row is one comparison:
etrain's raw samples against a reference measured in the same run (a peer: Ray Train, torchrun, a bare
DDP loop) or against a formula (the pipeline bubble, the heartbeat timeout). Nothing derived is stored
as the truth: benchmarks/README.md's table recomputes medians and ratios from the samples (:func:`row_summary`), so
a hand-edited median cannot drift from its samples, and a test can check the arithmetic.

Why the ratio of medians (not the median of per-pair ratios): runs alternate etrain / peer, but a
pair is not a controlled experiment on a shared 2-core machine (a burst of load can hit one side of a
pair), and the median of each side is robust to one bad run on either side independently.

``ratio`` says which way round: ``"etrain/reference"`` for times (lower is better: 0.3x means etrain
takes 30% of the peer's time), ``"reference/etrain"`` for step times compared as speed (0.97x means
etrain runs at 97% of the peer's speed). A goal applies to the ``ratio``, to etrain's own median
(``"etrain"``, e.g. goodput >= 90%), or to ``|etrain - reference|`` (``"difference"``, e.g. a bubble
within 0.12 of its formula).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "FORMAT_VERSION",
    "Goal",
    "Row",
    "RowSummary",
    "figure_document",
    "format_value",
    "load_figure",
    "machine_info",
    "median",
    "ratio_of_medians",
    "row_summary",
    "write_figure",
]

FORMAT_VERSION = 1
#: The suite's figures, in the order the suite measures them and the README's table lists them.
SUITE_FIGURES = (
    "startup",
    "recovery",
    "goodput",
    "stragglers",
    "hang",
    "checkpoint",
    "pipeline_bubble",
    "steady_state",
    "resize",
    "node_loss",
)

RatioKind = Literal["etrain/reference", "reference/etrain"]
GoalOn = Literal["ratio", "etrain", "difference"]


def median(samples: list[float]) -> float:
    """The median of finite samples; NaN when there are none (a run that produced nothing)."""
    finite = [float(s) for s in samples if s is not None and math.isfinite(float(s))]
    return statistics.median(finite) if finite else math.nan


def ratio_of_medians(numerator: list[float], denominator: list[float]) -> float:
    """``median(numerator) / median(denominator)``; NaN if either side has no finite sample or the
    denominator's median is zero (a ratio to nothing is not a number, not infinity)."""
    top, bottom = median(numerator), median(denominator)
    if math.isnan(top) or math.isnan(bottom) or bottom == 0:
        return math.nan
    return top / bottom


@dataclass(frozen=True)
class Goal:
    """``on`` (ratio | etrain | difference) ``op`` (<= | >=) ``value``; ``text`` as the issue states it."""

    on: GoalOn
    op: Literal["<=", ">="]
    value: float
    text: str

    def met(self, measured: float) -> bool | None:
        if math.isnan(measured):
            return None
        return measured <= self.value if self.op == "<=" else measured >= self.value

    def shortfall(self, measured: float, unit: str) -> str:
        """How far ``measured`` misses the goal, in the goal's own terms (a factor for ratios)."""
        if self.on == "ratio":
            factor = measured / self.value if self.op == "<=" else self.value / measured
            return f"{factor:.1f}× {'over' if self.op == '<=' else 'under'} the goal"
        gap = abs(measured - self.value)
        side = "over" if self.op == "<=" else "short"
        if unit == "fraction":  # a gap between percentages is in points, not a percentage of anything
            return f"{100 * gap:.1f} points {side}"
        return f"{format_value(gap, unit)} {side}"

    def as_dict(self) -> dict[str, Any]:
        return {"on": self.on, "op": self.op, "value": self.value, "text": self.text}

    @classmethod
    def of(cls, raw: dict[str, Any] | None) -> Goal | None:
        return None if raw is None else cls(on=raw["on"], op=raw["op"], value=float(raw["value"]), text=raw["text"])


@dataclass(frozen=True)
class Row:
    """One comparison: etrain's samples against a reference's samples (a peer's runs, or a formula's
    value repeated once) in ``unit``. ``pending``: why the row could not be measured (then no samples)."""

    label: str
    unit: str  # "s", "ms", "MB/s", "fraction", "steps", ...
    etrain: list[float]
    reference_name: str | None = None
    reference: list[float] | None = None
    ratio: RatioKind = "etrain/reference"
    goal: Goal | None = None
    pending: str | None = None
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "label": self.label,
            "unit": self.unit,
            "etrain": list(self.etrain),
            "reference_name": self.reference_name,
            "reference": None if self.reference is None else list(self.reference),
            "ratio": self.ratio,
            "goal": None if self.goal is None else self.goal.as_dict(),
            "pending": self.pending,
            "note": self.note,
        }

    @classmethod
    def of(cls, raw: dict[str, Any]) -> Row:
        return cls(
            label=raw["label"],
            unit=raw["unit"],
            etrain=[float(x) for x in raw.get("etrain") or []],
            reference_name=raw.get("reference_name"),
            reference=None if raw.get("reference") is None else [float(x) for x in raw["reference"]],
            ratio=raw.get("ratio", "etrain/reference"),
            goal=Goal.of(raw.get("goal")),
            pending=raw.get("pending"),
            note=raw.get("note"),
        )


@dataclass(frozen=True)
class RowSummary:
    etrain_median: float
    reference_median: float
    ratio: float
    met: bool | None  # None: no goal, or nothing measured
    verdict: str  # "yes" | "no: <by how much>" | "—" | "pending: <why>"
    n: str  # "etrain/reference" sample counts


def row_summary(row: Row) -> RowSummary:
    """Medians, the ratio of medians, and whether (and by how much) the goal is met."""
    etrain = median(row.etrain)
    reference = median(row.reference or [])
    if row.reference is None:
        ratio = math.nan
    elif row.ratio == "etrain/reference":
        ratio = ratio_of_medians(row.etrain, row.reference)
    else:
        ratio = ratio_of_medians(row.reference, row.etrain)
    n = f"{_count(row.etrain)}/{_count(row.reference or [])}" if row.reference is not None else str(_count(row.etrain))
    if row.pending:
        return RowSummary(etrain, reference, ratio, None, f"pending: {row.pending}", n)
    if row.goal is None:
        return RowSummary(etrain, reference, ratio, None, "—", n)
    measured = {"ratio": ratio, "etrain": etrain, "difference": abs(etrain - reference)}[row.goal.on]
    met = row.goal.met(measured)
    if met is None:
        verdict = "not measured"
    elif met:
        verdict = "yes"
    else:
        unit = "×" if row.goal.on == "ratio" else row.unit
        verdict = f"no: {row.goal.shortfall(measured, unit)}"
    return RowSummary(etrain, reference, ratio, met, verdict, n)


def _count(samples: list[float]) -> int:
    return sum(1 for s in samples if s is not None and math.isfinite(float(s)))


#: unit -> how a median of it is written in the table
_FORMATS = {
    "fraction": "{:.1%}",
    "×": "{:.2f}×",
    "s": "{:.2f} s",
    "steps": "{:g} steps",
    "ms": "{:.1f} ms",
    "MB/s": "{:.0f} MB/s",
}


def format_value(value: float, unit: str) -> str:
    """A median for the table: seconds with 2 decimals, fractions as percentages, rates as integers."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return _FORMATS.get(unit, "{:.3g} " + unit).format(value).strip()


# -- files -------------------------------------------------------------------------------------------------


def figure_document(
    figure: str,
    title: str,
    rows: list[Row],
    *,
    quick: bool,
    machine: dict[str, Any],
    seconds: float,
    raw: dict[str, Any] | None = None,
    notes: list[str] | None = None,
) -> dict:
    """The JSON of one figure: its rows (samples), the raw per-run records behind them, the machine."""
    return {
        "format": FORMAT_VERSION,
        "figure": figure,
        "title": title,
        "quick": quick,
        "seconds": round(seconds, 1),
        "rows": [row.as_dict() for row in rows],
        "notes": notes or [],
        "raw": raw or {},
        "machine": machine,
    }


def write_figure(directory: Path, document: dict) -> Path:
    """Write ``<directory>/<figure>.json`` atomically (a killed suite never leaves half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{document['figure']}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=1, default=_jsonable) + "\n")
    os.replace(tmp, path)
    return path


def load_figure(path: Path) -> tuple[dict, list[Row]]:
    document = json.loads(Path(path).read_text())
    if document.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: format {document.get('format')!r}, expected {FORMAT_VERSION}; re-run the suite")
    return document, [Row.of(raw) for raw in document["rows"]]


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


# -- the machine -------------------------------------------------------------------------------------------


def machine_info(note: str = "", load_samples: list[float] | None = None) -> dict[str, Any]:
    """What ran the figure: cores, CPU, memory, versions, the commit, and the load the machine was under
    (1-minute load averages sampled during the run: the machine may be shared)."""
    info: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": _versions(),
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain")),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "note": note,
    }
    if load_samples:
        info["load_1min"] = {
            "min": min(load_samples),
            "median": statistics.median(load_samples),
            "max": max(load_samples),
            "samples": len(load_samples),
        }
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "ray", "etrain"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return out


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).resolve().parents[1]
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


if __name__ == "__main__":  # pragma: no cover - a quick look at this machine's record
    json.dump(machine_info(), sys.stdout, indent=1)
