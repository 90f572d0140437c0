"""The table of ``make gpu-check`` (docs/gpu.md), from ``gpu_probe.json`` and ``gpu_service.json``; and
``make bench-gpu``'s (:func:`render_throughput`, from ``gpu_throughput.json``).

    python -m benchmarks.gpu.table [--results-dir benchmarks/results] [--check] [--throughput]

Prints markdown: one line naming the device, torch and the date, then a row per figure with issue 16's
goal beside it where it sets one. ``--check`` also exits 1 unless both jobs SUCCEEDED and every probe
row ran (what ``make gpu-check`` reports as its exit status). ``--throughput``: ``make bench-gpu``'s table
instead. Pure: reads JSON files, imports nothing but the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["GOALS", "passed", "render", "render_throughput"]

#: Issue 16's goals on one H100 (the figures without one are reported as measured).
GOALS: dict[str, tuple[str, float, str]] = {
    "build": ("<=", 1.5, "≤ 1.5 s"),
    "first_step": ("<=", 5.0, "≤ 5 s"),
    "recovery": ("<=", 10.0, "≤ 10 s"),
    "save_blocking": ("<=", 1.5, "≤ 1.5 s"),
    "goodput_kill": (">=", 0.85, "≥ 85%"),
}


def _s(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _verdict(goal: str, value: float | None) -> str:
    op, bound, _ = GOALS[goal]
    if value is None:
        return "not measured"
    ok = value <= bound if op == "<=" else value >= bound
    return "yes" if ok else "no"


def _row(what: str, measured: str, goal: str | None = None, value: float | None = None) -> str:
    if goal is None:
        return f"| {what} | {measured} | — | — |"
    return f"| {what} | {measured} | {GOALS[goal][2]} | {_verdict(goal, value)} |"


def _job(service: dict[str, Any], label: str) -> dict[str, Any] | None:
    return next((j for j in service.get("jobs", []) if j.get("job") == label), None)


def _probe_rows(probe: dict[str, Any]) -> list[str]:
    rows = {r["row"]: r for r in probe.get("rows", [])}
    etrain, hf = rows.get("etrain", {}), rows.get("hf", {})
    params = probe.get("params")
    size = f"{params / 1e9:.2f} B parameters" if params and params >= 1e8 else f"{params:,} parameters"
    lines = []
    for name, row in (("etrain", etrain), ("transformers", hf)):
        if row.get("error"):
            lines.append(_row(f"engine, {name}", f"failed: {row['error'][:160]}"))
    lines += [
        _row(
            f"engine: `Trainer` build ({size}; transformers: {_s(hf.get('build_s'))})",
            _s(etrain.get("build_s")),
            "build",
            etrain.get("build_s"),
        ),
        _row(
            "engine: step, etrain / transformers", f"{_s(etrain.get('step_s_median'))} / {_s(hf.get('step_s_median'))}"
        ),
        _row(
            "engine: tokens/s, etrain / transformers",
            f"{etrain.get('tokens_per_s') or 0:,.0f} / {hf.get('tokens_per_s') or 0:,.0f}",
        ),
        _row("engine: MFU, etrain / transformers", f"{_pct(etrain.get('mfu'))} / {_pct(hf.get('mfu'))}"),
    ]
    if etrain.get("peak_gib") is not None or hf.get("peak_gib") is not None:
        lines.append(
            _row(
                "engine: peak device memory, etrain / transformers",
                f"{etrain.get('peak_gib') or 0:.1f} / {hf.get('peak_gib') or 0:.1f} GiB",
            )
        )
    return lines


def _startup(figures: dict[str, Any], attempt: int | None = None) -> str:
    lines = [s for s in figures.get("startup", []) if attempt is None or s["attempt"] == attempt]
    if not lines:
        return "–"
    first = lines[0]
    phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in first["phases"].items())
    shown = f"{first['total_s']:.2f} s ({phases})" if phases else f"{first['total_s']:.2f} s"
    warmup = first.get("cuda_warmup")
    if warmup:
        shown += f"; CUDA warm-up {warmup['outcome']} in {warmup['s']:.2f} s (driver: {warmup['driver']})"
    return shown


def _service_rows(service: dict[str, Any]) -> list[str]:
    lines = []
    clean, kill = _job(service, "clean"), _job(service, "kill")
    if clean and "figures" in clean:
        f = clean["figures"]
        saves = f.get("save_blocking", [])
        each = ", ".join(f"{s['blocked_s']:.2f}" for s in saves)
        lines += [
            _row(
                f"clean job ({clean['steps']} steps, a checkpoint every {clean['every_steps']}): status",
                f"{f.get('status')}" + (f": {str(f.get('error'))[:160]}" if f.get("error") else ""),
            ),
            _row(
                "clean job: submit → first step (warm spare pool at rest; on a GPU, the node's compile cache cold)",
                _s(f.get("submit_to_first_step_s")),
                "first_step",
                f.get("submit_to_first_step_s"),
            ),
            _row("clean job: rank 0's start-up (`attempt 1: ready after`)", _startup(f, 1)),
            _row("clean job: median step", _s(f.get("step_s_median"))),
            _row(
                f"clean job: training blocked per save ({len(saves)} saves: {each or '–'} s)",
                _s(f.get("save_blocking_median_s")),
                "save_blocking",
                f.get("save_blocking_median_s"),
            ),
            _row("clean job: goodput", _pct(f.get("goodput"))),
        ]
    elif clean:
        lines.append(_row("clean job", str(clean.get("status") or clean.get("skipped"))))
    if kill and "figures" in kill:
        f = kill["figures"]
        every = kill.get("every_steps")
        chosen = f.get("checkpoint_intervals") or []
        interval = (
            f"`{every}`"
            + (f", last of {len(chosen)} `checkpoint_interval` events: {chosen[-1][:160]}" if chosen else "")
            + (" (`auto` refused: 422)" if kill.get("every_steps_note") else "")
        )
        lines += [
            _row(
                f"kill job ({kill['steps']} steps, rank 0 SIGKILLed at step {kill['kill_at']}): status",
                f"{f.get('status')}, {f.get('restarts')} restart(s)"
                + (f": {str(f.get('error'))[:160]}" if f.get("error") else ""),
            ),
            _row(
                "kill job: submit → first step (after the clean job: on a GPU, the node's compile cache warm)",
                _s(f.get("submit_to_first_step_s")),
                "first_step",
                f.get("submit_to_first_step_s"),
            ),
            _row("kill job: checkpoint interval", interval),
            _row(
                "kill job: SIGKILL → next completed step",
                _s(f.get("kill_to_next_step_s")),
                "recovery",
                f.get("kill_to_next_step_s"),
            ),
            _row(
                "kill job: kill → `worker_failed`; resumed from step",
                f"{_s(f.get('detect_s'))}; {f.get('resumed_from')}",
            ),
            _row("kill job: replacement's start-up (`attempt 2: ready after`)", _startup(f, 2)),
            _row(
                "kill job: training blocked per save (median)",
                _s(f.get("save_blocking_median_s")),
                "save_blocking",
                f.get("save_blocking_median_s"),
            ),
            _row("kill job: goodput", _pct(f.get("goodput")), "goodput_kill", f.get("goodput")),
        ]
    elif kill:
        lines.append(_row("kill job", str(kill.get("status") or kill.get("skipped"))))
    if kill and "figures" in kill:
        lines.append(_row("kill job: the replacement's compile (the node's cache warm)", _compile(kill["figures"], 2)))
    lines += _new_node_rows(_job(service, "kill-new-node"))
    return lines


def _compile(figures: dict[str, Any], attempt: int) -> str:
    """An attempt's compile seconds and first step, and what it did with the job's shared compiled code."""
    found = [entry for entry in figures.get("compile", []) if entry["attempt"] == attempt]
    if not found:
        return "–"
    entry = found[0]
    shown = (
        f"compile {entry['compile_s']:.2f} s, first step {entry['first_step_s']:.2f} s"
        if "compile_s" in entry
        else "no compile line"
    )
    return "; ".join([shown, *entry["sharing"]])


def _new_node_rows(job: dict[str, Any] | None) -> list[str]:
    """The kill-new-node job: the replacement starts after the node's compile cache was deleted."""
    if not job:
        return []
    if "figures" not in job:
        return [_row("kill-new-node job", str(job.get("status") or job.get("skipped")))]
    f = job["figures"]
    forgot = job.get("forgot_node_cache") or {}
    return [
        _row(
            f"kill-new-node job ({job['steps']} steps, the node's compile cache deleted at step "
            f"{forgot.get('at_step', '–')}, rank 0 SIGKILLed at step {job['kill_at']}): status",
            f"{f.get('status')}, {f.get('restarts')} restart(s)"
            + (f": {str(f.get('error'))[:160]}" if f.get("error") else ""),
        ),
        _row("kill-new-node job: what the first rank shared", _compile(f, 1)),
        _row(
            "kill-new-node job: SIGKILL → next completed step (the set loaded from the checkpoint folder)",
            _s(f.get("kill_to_next_step_s")),
        ),
        _row("kill-new-node job: the replacement's compile", _compile(f, 2)),
        _row("kill-new-node job: replacement's start-up (`attempt 2: ready after`)", _startup(f, 2)),
    ]


def render(probe: dict[str, Any] | None, service: dict[str, Any] | None) -> str:
    """The markdown: the device line, then the table."""
    first = probe or service or {}
    machine = first.get("machine", {})
    device = (probe or {}).get("device") or (service or {}).get("device") or "an unnamed device"
    tiny = " (`--tiny`: the tiny model on CPU, a test of the check, not a measurement)" if first.get("tiny") else ""
    head = (
        f"Measured by `make gpu-check` on {device}{tiny}, torch {first.get('torch')}, "
        f"{machine.get('cpus')} CPU cores, commit {str(machine.get('commit') or 'unknown')[:10]}, "
        f"{machine.get('date', '')}."
    )
    lines = [head, "", "| figure | measured | goal (issue 16) | met? |", "|---|---|---|---|"]
    if probe:
        lines += _probe_rows(probe)
    if service:
        lines += _service_rows(service)
    return "\n".join(lines) + "\n"


def passed(
    probe: dict[str, Any] | None,
    service: dict[str, Any] | None,
    *,
    probe_asked: bool = True,
    jobs: tuple[str, ...] = ("clean", "kill"),
) -> list[str]:
    """What failed the check (empty: it passed): a probe row with an error (or no probe where one was
    asked for), a job of ``jobs`` (those the run was asked for) not SUCCEEDED."""
    problems = []
    if probe is None:
        if probe_asked:
            problems.append("no probe result")
    else:
        problems += [f"probe row {r['row']}: {r['error'][:200]}" for r in probe.get("rows", []) if r.get("error")]
    if service is None:
        problems.append("no service result")
    else:
        for label in jobs:
            job = _job(service, label)
            status = (
                (job or {}).get("figures", {}).get("status") or (job or {}).get("status") or (job or {}).get("skipped")
            )
            if status != "SUCCEEDED":
                problems.append(f"{label} job: {status}")
    return problems


#: The row each other row of ``make bench-gpu`` is compared with (tokens/s, on the same shape).
THROUGHPUT_BASELINE = "hf"


def _step(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f} s"


def _shape_line(shape: dict[str, Any]) -> str:
    sizes = shape.get("sizes", {})
    params = shape.get("params") or 0
    size = f"{params / 1e9:.2f} B parameters" if params >= 1e8 else f"{params:,} parameters"
    tokens = sizes.get("global_batch", 0) * sizes.get("seq_len", 0)
    return (
        f"**{shape.get('label', shape.get('shape'))}**: {shape.get('n_layers')} layers, d_model {shape.get('d_model')}, "
        f"{shape.get('n_heads')} heads / {shape.get('n_kv_heads')} KV heads, d_ff {shape.get('ffn_dim')}, "
        f"vocabulary {shape.get('vocab_size') or 0:,}{', tied' if shape.get('tie_embeddings') else ''}; {size}; "
        f"{sizes.get('seq_len')} tokens × micro-batch {sizes.get('micro_batch')}, global batch "
        f"{sizes.get('global_batch')} ({tokens:,} tokens per step), {sizes.get('precision')}."
    )


def _options(record: dict[str, Any]) -> str:
    chunk = (record.get("options") or {}).get("loss_chunk_tokens")
    return f" ({chunk:,}-token chunks)" if isinstance(chunk, int) and chunk > 0 else ""


def _throughput_row(record: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    label = f"{record.get('label') or record['row']}{_options(record)}"
    if record.get("skipped"):
        return f"| {label} | skipped: {record['skipped']} | | | | | | |"
    if record.get("error"):
        return f"| {label} | failed: {record['error'][:160]} | | | | | | |"
    tokens, base = record.get("tokens_per_s"), (baseline or {}).get("tokens_per_s")
    ratio = f"{tokens / base:.2f}×" if tokens and base else "–"
    peak = record.get("peak_gib")
    losses = record.get("losses") or []
    loss = f"{losses[0]:.3f} → {losses[-1]:.3f}" if losses else "–"
    return (
        f"| {label} | {_step(record.get('step_s_median'))} | {tokens or 0:,.0f} | {_pct(record.get('mfu'))} | "
        f"{'–' if peak is None else f'{peak:.1f} GiB'} | {_step(record.get('first_step_s'))} | {ratio} | {loss} |"
    )


def render_throughput(document: dict[str, Any]) -> str:
    """``make bench-gpu``'s markdown: a line naming the device and versions, then per shape a line of its
    sizes and a table, one line per row (skipped and failed rows say why), tokens/s against the
    transformers-eager row of that shape."""
    machine = document.get("machine", {})
    tiny = (
        " (`--tiny`: the tiny model on CPU, a test of the benchmark, not a measurement)" if document.get("tiny") else ""
    )
    peak = document.get("peak_flops_per_s")
    backend = document.get("compile_backend")
    lines = [
        f"Measured by `make bench-gpu` on {document.get('device') or 'an unnamed device'}{tiny}, torch "
        f"{document.get('torch')}, transformers {document.get('transformers')}, {machine.get('cpus')} CPU cores, "
        f"commit {str(machine.get('commit') or 'unknown')[:10]}, {machine.get('date', '')}. Median step after "
        f"{document.get('warmup', 3)} warm-up steps of {document.get('steps')}; the first step includes compilation"
        + (f" (backend {backend})" if backend and backend != "inductor" else "")
        + "; MFU against "
        + (f"{peak / 1e12:,.0f} TFLOP/s dense" if peak else "no known peak (–)")
        + "; ×: tokens/s against transformers eager.",
    ]
    for shape in document.get("shapes", []):
        records = [r for r in document.get("rows", []) if r.get("shape") == shape.get("shape")]
        baseline = next((r for r in records if r.get("row") == THROUGHPUT_BASELINE), None)
        lines += [
            "",
            _shape_line(shape),
            "",
            "| row | step | tokens/s | MFU | peak memory | first step | × | loss, first → last step |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_throughput_row(r, baseline) for r in records]
    return "\n".join(lines) + "\n"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--check", action="store_true", help="exit 1 unless both jobs SUCCEEDED and the probe ran")
    parser.add_argument("--throughput", action="store_true", help="make bench-gpu's table (gpu_throughput.json)")
    parser.add_argument("--no-probe", action="store_true", help="the probe was left out: --check does not ask for it")
    parser.add_argument("--jobs", default="clean,kill", help="the jobs the run was asked for (GPU_CHECK_JOBS)")
    args = parser.parse_args()
    if args.throughput:
        document = _load(args.results_dir / "gpu_throughput.json")
        if document is None:
            print(f"no gpu_throughput.json in {args.results_dir}: run make bench-gpu")
            return 1
        print(render_throughput(document))
        return 0
    probe, service = _load(args.results_dir / "gpu_probe.json"), _load(args.results_dir / "gpu_service.json")
    print(render(probe, service))
    jobs = tuple(job for job in args.jobs.split(",") if job)
    problems = passed(probe, service, probe_asked=not args.no_probe, jobs=jobs)
    if args.check and problems:
        print("gpu-check FAILED: " + "; ".join(problems))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
