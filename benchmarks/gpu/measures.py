"""The GPU check's figures, computed from what the service and the probe hand back: pure functions.

Everything here is a function of plain values (step rows and events as ``GET /v1/jobs/{id}/metrics`` and
``/events`` return them, rank-log lines as ``/logs`` returns them, step times measured by the probe), so
``tests/unit/test_gpu_check.py`` checks each figure against hand-computed numbers without torch, Ray or a GPU.
The formulas are not written again here: MFU is ``etrain.workers.engine.metrics`` (the trainer's own FLOPs per
token and peak table), start-up and recovery are ``benchmarks.peers.common.recovery_measures`` (the
benchmark suite's arithmetic), medians are ``benchmarks.figures.median``.

Clocks: step rows carry the supervisor's receive time and events their record time (both
``time.time()`` on the control plane's machine), and the driver notes ``time.time()`` just before each
submit, on the same machine; rank-log lines carry the rank's local wall clock (ISO, milliseconds), used
only for differences between two lines of one rank.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from benchmarks.figures import median
from benchmarks.peers.common import recovery_measures
from etrain.workers import families
from etrain.workers.engine.metrics import flops_per_token, mfu, peak_flops_per_s
from etrain.workers.families import MODEL_PRESETS
from etrain.workers.protocol.layout_rules import auto_loss_chunk_tokens
from etrain.workers.protocol.run_config import ModelConfig

__all__ = [
    "BENCH_ROWS",
    "BENCH_SHAPES",
    "FULL",
    "LLAMA8B_WIDTHS",
    "ROWS",
    "TINY",
    "TINY_WIDE",
    "FIT_FRACTION",
    "FIT_SHAPES",
    "CheckSizes",
    "bench_loss_chunk",
    "compile_lines",
    "device_peak",
    "job_figures",
    "kill_ts",
    "layers_that_fit",
    "model_config",
    "model_summary",
    "planned_eager_peak",
    "probe_figures",
    "row_plan",
    "save_blocking",
    "shape_label",
    "startup_phases",
    "step_median",
    "timeline",
]


@dataclass(frozen=True)
class CheckSizes:
    """The model and batch of every part of the check: the probe's rows and both service jobs."""

    preset: str
    seq_len: int
    micro_batch: int
    global_batch: int
    precision: str
    device: str
    #: Fewer layers than the preset (the 8B widths on one GPU); None: the preset's.
    n_layers: int | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: Issue 16's job: Llama-3.2-1B shapes (16 layers, d 2048, 32 heads, 8 KV heads, d_ff 8192, vocabulary
#: 128256, tied embeddings), 2048 tokens, micro-batch 4, global batch 8, bf16, one GPU.
FULL = CheckSizes(preset="llama3-1b", seq_len=2048, micro_batch=4, global_batch=8, precision="bf16", device="cuda")
#: ``--tiny``: the same code paths on CPU with a model that trains in milliseconds.
TINY = CheckSizes(preset="llama-tiny", seq_len=64, micro_batch=4, global_batch=8, precision="fp32", device="cpu")
#: ``make bench-gpu``'s second shape: Llama-3.1-8B's widths (d 4096, 32 heads, 8 KV heads, d_ff 14336,
#: vocabulary 128256, untied embeddings). On a GPU it runs as many of its 32 layers as fit
#: (:func:`layers_that_fit`; ``--layers`` sets a count); these sizes hold the 4 layers of the first runs
#: and of ``--tiny``'s arithmetic: 1.92 B parameters, 16 bytes each as fp32 weights, gradients and AdamW's
#: two moments (30.7 GB). Micro-batch 2 (4,096 tokens), global batch 8, 2048 tokens, bf16.
LLAMA8B_WIDTHS = CheckSizes(
    preset="llama3-8b", seq_len=2048, micro_batch=2, global_batch=8, precision="bf16", device="cuda", n_layers=4
)
#: ``--tiny``'s second shape: fewer layers and a smaller micro-batch, as the GPU shape has.
TINY_WIDE = CheckSizes(
    preset="llama-tiny", seq_len=64, micro_batch=2, global_batch=8, precision="fp32", device="cpu", n_layers=2
)
#: ``--shapes moe`` (issue #21's one-GPU MoE step): Qwen3-30B-A3B's widths (d 2048, 32 heads, 4 KV heads, 128
#: experts of width 768, 8 picked per token, vocabulary 151936) with 2 of its 48 layers: 1.87 B parameters
#: (1.21 B of them experts, 0.62 B the embedding and head), 30 GB of fp32 weights, gradients and AdamW moments.
#: Micro-batch 2, global batch 8, 2048 tokens, bf16. MFU counts the active parameters (8 of 128 experts).
QWEN3_MOE_WIDTHS = CheckSizes(
    preset="qwen3-30b-a3b", seq_len=2048, micro_batch=2, global_batch=8, precision="bf16", device="cuda", n_layers=2
)
#: ``--tiny``'s MoE shape.
TINY_MOE = CheckSizes(
    preset="qwen3-moe-tiny", seq_len=64, micro_batch=2, global_batch=8, precision="fp32", device="cpu"
)
#: ``make bench-gpu``'s shapes: name -> (label, the GPU sizes, the ``--tiny`` sizes).
BENCH_SHAPES: dict[str, tuple[str, CheckSizes, CheckSizes]] = {
    "1b": ("Llama-3.2-1B shapes", FULL, TINY),
    "8b-widths": ("Llama-3.1-8B widths", LLAMA8B_WIDTHS, TINY_WIDE),
    "moe": ("Qwen3-30B-A3B widths", QWEN3_MOE_WIDTHS, TINY_MOE),
}
#: The shapes that run fewer layers than their preset and, on a GPU, as many as fit
#: (:func:`layers_that_fit`), as issue #19 asks of the 8B widths. The MoE shape keeps its 2 layers: the
#: planner's expert memory is not what these rows were measured against.
FIT_SHAPES = ("8b-widths",)
#: The share of a GPU's memory :func:`layers_that_fit` plans for: the planner's eager peak was within 1%
#: of transformers eager at 8B widths (42.2 GiB planned, 42.1 measured on the H200), the hungriest row;
#: the rest is room for the allocator's fragmentation and the compiled rows' workspaces.
FIT_FRACTION = 0.85


def shape_label(label: str, sizes: CheckSizes) -> str:
    """``label`` with the layer count where the shape runs fewer layers than its preset."""
    total = model_config(replace(sizes, n_layers=None)).n_layers
    if sizes.n_layers and sizes.n_layers < total:
        return f"{label}, {sizes.n_layers} of its {total} layers"
    return label


def planned_eager_peak(sizes: CheckSizes) -> int:
    """Bytes the planner gives one GPU for ``sizes`` trained eagerly with whole logits and every activation
    kept (``service/planning/plan_memory.py``): the peak of the hungriest rows (etrain and transformers
    eager)."""
    from etrain.service.planning.plan_activations import layer_chunks_in_flight
    from etrain.service.planning.plan_memory import RUNTIME_OVERHEAD_GIB, GiB, stage_memory

    model = model_config(sizes)
    microbatches = sizes.global_batch // sizes.micro_batch
    memory = stage_memory(
        model,
        stage=0,
        pp=1,
        layers=model.n_layers,
        virtual_stages=1,
        held=layer_chunks_in_flight("1f1b", pp=1, microbatches=microbatches, virtual_stages=1, stage=0),
        dp=1,
        tp=1,
        zero=0,
        micro_batch=sizes.micro_batch,
        microbatches=microbatches,
        precision=sizes.precision,
        checkpointing="none",
        device=sizes.device,
        overhead=RUNTIME_OVERHEAD_GIB[sizes.device] * GiB,
    )
    return memory.total


def layers_that_fit(sizes: CheckSizes, device_bytes: int, *, fraction: float = FIT_FRACTION) -> int:
    """The most layers of ``sizes``' preset (1 to all of them) whose :func:`planned_eager_peak` fits
    ``fraction`` of a GPU's ``device_bytes``: "as many layers as fit one GPU" (issue #19). At 8B widths,
    micro-batch 2: 9 layers on an 80 GB H100, 20 on a 141 GB H200."""
    total = model_config(replace(sizes, n_layers=None)).n_layers
    fitting = 1
    for layers in range(1, total + 1):
        if planned_eager_peak(replace(sizes, n_layers=layers)) > fraction * device_bytes:
            break
        fitting = layers
    return fitting


#: The engine probe's rows: the engine each runs and the options it trains with (none: eager, whole
#: logits, every activation kept). etrain's options are ``TrainingConfig`` fields (``loss_chunk_tokens:
#: "auto"``: :func:`bench_loss_chunk`); transformers' are ``compile`` (each ``model.model.layers[i]``
#: compiled in place, as etrain does its blocks) and ``activation_checkpointing: "full"``
#: (``gradient_checkpointing_enable``). A row whose option ``TrainingConfig`` does not have (yet) is
#: skipped with a note (:func:`row_plan`).
ROWS: dict[str, dict[str, Any]] = {
    "etrain": {"engine": "etrain", "label": "etrain eager", "options": {}},
    "etrain-ac": {
        "engine": "etrain",
        "label": "etrain eager + full AC",
        "options": {"activation_checkpointing": "full"},
    },
    "etrain-compile": {"engine": "etrain", "label": "etrain compile", "options": {"compile": True}},
    "etrain-compile-chunked": {
        "engine": "etrain",
        "label": "etrain compile + chunked loss",
        "options": {"compile": True, "loss_chunk_tokens": "auto"},
    },
    "etrain-compile-chunked-sac": {
        "engine": "etrain",
        "label": "etrain compile + chunked loss + selective AC",
        "options": {"compile": True, "loss_chunk_tokens": "auto", "activation_checkpointing": "selective"},
    },
    "etrain-compile-chunked-float8": {
        "engine": "etrain",
        "label": "etrain compile + chunked loss + float8",
        # float8 runs the rest in bf16 (the GPU shapes' precision; --tiny's model is fp32 otherwise)
        "options": {"compile": True, "loss_chunk_tokens": "auto", "float8": True, "precision": "bf16"},
    },
    "etrain-compile-float8": {
        "engine": "etrain",
        "label": "etrain compile + float8",
        # the float8 row to set beside "etrain-compile": the same options but the linears' float8
        "options": {"compile": True, "float8": True, "precision": "bf16"},
    },
    "hf": {"engine": "hf", "label": "transformers eager", "options": {}},
    "hf-ac": {"engine": "hf", "label": "transformers eager + full AC", "options": {"activation_checkpointing": "full"}},
    "hf-compile": {"engine": "hf", "label": "transformers per-block compile", "options": {"compile": True}},
}
#: ``make bench-gpu``'s rows, in order.
BENCH_ROWS = (
    "etrain",
    "etrain-compile",
    "etrain-compile-chunked",
    "etrain-compile-chunked-sac",
    "etrain-compile-chunked-float8",
    "hf",
    "hf-compile",
)
_HF_OPTIONS = {"compile": (True, False), "activation_checkpointing": ("none", "full")}


def model_config(sizes: CheckSizes) -> ModelConfig:
    """The preset at the check's sequence length (and layer count): what the service builds for
    ``model: {preset, seq_len[, n_layers]}``."""
    layers = {"n_layers": sizes.n_layers} if sizes.n_layers else {}
    return ModelConfig(**{**MODEL_PRESETS[sizes.preset], "seq_len": sizes.seq_len, **layers})


def model_summary(sizes: CheckSizes) -> dict[str, Any]:
    """The model's shape and parameter count, as the result files record it."""
    model = model_config(sizes)
    fields = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len", "tie_embeddings")
    return {"params": families.num_params(model), **{k: getattr(model, k) for k in fields}}


def bench_loss_chunk(sizes: CheckSizes) -> int:
    """``loss_chunk_tokens: auto`` for a micro-batch of ``sizes``, as the service resolves it on one GPU; where
    ``auto`` keeps the logits whole (the tiny model's fit its budget), a quarter of the micro-batch's tokens,
    so that the row still runs the chunked path."""
    tokens = sizes.micro_batch * sizes.seq_len
    chunk = auto_loss_chunk_tokens(tokens=tokens, vocab_size=model_config(sizes).vocab_size, tp=1)
    return chunk or max(1, tokens // 4)


def row_plan(name: str, sizes: CheckSizes, training_fields: Iterable[str]) -> dict[str, Any]:
    """What row ``name`` of :data:`ROWS` runs on ``sizes``: ``engine``, ``label``, ``options`` resolved (etrain:
    ``TrainingConfig`` keywords) and ``skip``, a note when ``TrainingConfig`` (whose field names are
    ``training_fields``) lacks one of the row's options, else None. Unknown rows and options an engine does
    not have raise ``ValueError``."""
    if name not in ROWS:
        raise ValueError(f"unknown probe row {name!r}; rows: {', '.join(ROWS)}")
    spec = ROWS[name]
    options = dict(spec["options"])
    skip = None
    if spec["engine"] == "etrain":
        missing = sorted(set(options) - set(training_fields))
        if missing:
            skip = "needs " + ", ".join(f"training.{field}" for field in missing)
        if options.get("loss_chunk_tokens") == "auto":
            options["loss_chunk_tokens"] = bench_loss_chunk(sizes)
    else:
        wrong = {k: v for k, v in options.items() if v not in _HF_OPTIONS.get(k, ())}
        if wrong:
            raise ValueError(f"row {name!r}: transformers runs none of {wrong}")
    return {"row": name, "engine": spec["engine"], "label": spec["label"], "options": options, "skip": skip}


def device_peak(device_name: str | None, precision: str) -> float | None:
    """Dense peak FLOP/s of the device (``torch.cuda.get_device_name()``); None on CPU or an unknown part."""
    if not device_name or device_name == "cpu":
        return None
    return peak_flops_per_s(device_name, precision)


def probe_figures(times: list[float], *, sizes: CheckSizes, device_name: str | None, warmup: int = 3) -> dict[str, Any]:
    """A probe row's figures from its per-step times (seconds, device synchronised): the median after
    ``warmup`` steps (allocator and kernel autotuning settle there), tokens/s, model FLOP/s and MFU."""
    step_s = median(times[warmup:] or times)
    if not step_s == step_s or step_s <= 0:  # NaN: no finite sample
        return {"step_s_median": None, "tokens_per_s": None, "flops_per_s": None, "mfu": None}
    tokens = sizes.tokens_per_step / step_s
    flops = tokens * flops_per_token(model_config(sizes))
    return {
        "step_s_median": step_s,
        "tokens_per_s": tokens,
        "flops_per_s": flops,
        "mfu": mfu(flops, 1, device_peak(device_name, sizes.precision)),
    }


# -- the service jobs --------------------------------------------------------------------------------------


def _message(event: dict[str, Any]) -> str:
    detail = event.get("detail") or {}
    return str(detail.get("message", "")) if isinstance(detail, dict) else str(detail)


def kill_ts(events: list[dict[str, Any]]) -> float | None:
    """When the rank was killed: the first ``chaos_fired`` (the rank waits for the supervisor to record
    it, then SIGKILLs itself), else the first ``worker_failed`` (the loss as the service saw it)."""
    for kind in ("chaos_fired", "worker_failed"):
        stamps = [e["ts"] for e in events if e["kind"] == kind]
        if stamps:
            return min(stamps)
    return None


def step_median(steps: list[dict[str, Any]], *, skip: int = 3) -> float | None:
    """Median ``step_s`` over the rows after the first ``skip`` steps (warm-up); None without rows."""
    values = [row["step_s"] for row in steps if row.get("step_s") is not None and row["step"] > skip]
    if not values:
        values = [row["step_s"] for row in steps if row.get("step_s") is not None]
    value = median(values)
    return None if value != value else value


_STAMP = r"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)"
_READY = re.compile(r"attempt (?P<attempt>\d+): ready after (?P<total>[\d.]+)s(?: \((?P<phases>[^)]*)\))?")
_WOUND_DOWN = re.compile(r"attempt (?P<attempt>\d+): wound down in (?P<total>[\d.]+)s(?: \((?P<phases>[^)]*)\))?")
_WARMUP = re.compile(r"; cuda warm-up (?P<outcome>.+?) in (?P<s>[\d.]+)s \(driver without the GIL: (?P<driver>[^)]*)\)")
_DIGEST = re.compile(r"attempt (?P<attempt>\d+): param digest (?P<s>[\d.]+)s")
_HOST_MEMORY = re.compile(
    r"attempt (?P<attempt>\d+): host memory: peak RSS (?P<peak_rss>[\d.]+) GiB"
    r"(?:, now PSS (?P<pss>[\d.]+) GiB \(private (?P<private>[\d.]+) GiB\))?; "
    r"(?:reserved (?P<reserved>[\d.]+) GiB|none reserved)"
)
_PHASE = re.compile(r"(?P<name>[A-Za-z][\w -]*?) (?P<s>[\d.]+)s")
_STEP_LINE = re.compile(_STAMP + r" step (?P<step>\d+)/\d+ ")
_SAVE_LINE = re.compile(_STAMP + r" checkpoint step (?P<step>\d+) (?P<what>.*)$")
_BLOCKED = re.compile(r"block(?:ed|ing)[^\d]{0,20}(?P<s>\d+(?:\.\d+)?)\s*(?P<unit>ms|s)\b")


_COMPILE = re.compile(r"attempt (?P<attempt>\d+): compile (?P<s>[\d.]+)s \(first step (?P<first>[\d.]+)s")
_COMPILE_SHARING = re.compile(r"attempt (?P<attempt>\d+): (?P<what>compile cache .*)$")


def compile_lines(lines: list[str]) -> list[dict[str, Any]]:
    """Each attempt's compile figures from a rank log: the seconds compiling and the first step
    (``attempt N: compile X s (first step Y s; ...)``), and what the attempt did with the job's shared
    compiled code (``attempt N: compile cache loaded|shared|not loaded ...``, in order)."""
    by_attempt: dict[int, dict[str, Any]] = {}
    for line in lines:
        timed, sharing = _COMPILE.search(line), _COMPILE_SHARING.search(line)
        found = timed or sharing
        if found is None:
            continue
        entry = by_attempt.setdefault(int(found["attempt"]), {"attempt": int(found["attempt"]), "sharing": []})
        if timed is not None:
            entry.update(compile_s=float(timed["s"]), first_step_s=float(timed["first"]))
        else:
            entry["sharing"].append(sharing["what"][:300])
    return [by_attempt[attempt] for attempt in sorted(by_attempt)]


def startup_phases(lines: list[str]) -> list[dict[str, Any]]:
    """Each attempt's start-up line of a rank log (``attempt N: ready after T s (phase s, ...)``, then on a
    GPU ``; cuda warm-up OUTCOME in T s (driver without the GIL: ...)``): attempt, total seconds, seconds
    per phase, the CUDA warm-up (None without one), and the line itself."""
    out = []
    for line in lines:
        found = _READY.search(line)
        if found is None:
            continue
        phases = {m["name"].strip(): float(m["s"]) for m in _PHASE.finditer(found["phases"] or "")}
        warmup = _WARMUP.search(line, found.end())
        out.append(
            {
                "attempt": int(found["attempt"]),
                "total_s": float(found["total"]),
                "phases": phases,
                "cuda_warmup": None
                if warmup is None
                else {"outcome": warmup["outcome"], "s": float(warmup["s"]), "driver": warmup["driver"]},
                "line": line[found.start() :][:400],
            }
        )
    return out


def wind_down(lines: list[str]) -> list[dict[str, Any]]:
    """Where each attempt's end went, from a rank log: the parameter digest (``attempt N: param digest
    T s``) and the wind-down after it (``attempt N: wound down in T s (reports s, saves closed s, process
    groups s)``: the last reports, the last async save landing and its host buffers released, the groups), and
    what the rank held in host memory against its reservation (``attempt N: host memory: peak RSS X GiB, now PSS
    Y GiB (private Z GiB); reserved R GiB``: ``workers/rank/host_memory.py``; None before that line existed)."""
    digests = {int(m["attempt"]): float(m["s"]) for m in map(_DIGEST.search, lines) if m}
    held = {
        int(m["attempt"]): {
            f"{name}_gib": float(m[name]) if m[name] is not None else None
            for name in ("peak_rss", "pss", "private", "reserved")
        }
        for m in map(_HOST_MEMORY.search, lines)
        if m
    }
    out = []
    for line in lines:
        found = _WOUND_DOWN.search(line)
        if found is None:
            continue
        attempt = int(found["attempt"])
        phases = {m["name"].strip(): float(m["s"]) for m in _PHASE.finditer(found["phases"] or "")}
        out.append(
            {
                "attempt": attempt,
                "param_digest_s": digests.get(attempt),
                "total_s": float(found["total"]),
                "phases": phases,
                "host_memory": held.get(attempt),
            }
        )
    return out


def _when(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


def save_blocking(lines: list[str]) -> list[dict[str, Any]]:
    """Training time each checkpoint blocked, per save, from a rank log: the seconds a save line states
    (``blocked 1.2s``) when it says, else the time from the step's line to its ``checkpoint step N ...``
    line (the rank writes the step line, saves, then writes the checkpoint line; with an asynchronous
    save that is the device -> host copy, the write goes on in the background)."""
    step_at: dict[int, float] = {}
    out = []
    for line in lines:
        step = _STEP_LINE.match(line)
        if step:
            step_at[int(step["step"])] = _when(step["ts"])
            continue
        save = _SAVE_LINE.match(line)
        if save is None:
            continue
        number, what = int(save["step"]), save["what"]
        stated = _BLOCKED.search(what)
        if stated:
            seconds = float(stated["s"]) / (1000.0 if stated["unit"] == "ms" else 1.0)
            source = "stated"
        elif number in step_at:
            seconds, source = _when(save["ts"]) - step_at[number], "log lines"
        else:
            continue
        out.append({"step": number, "blocked_s": seconds, "source": source, "what": what[:120]})
    return out


def first_step_logged_ts(lines: list[str]) -> float | None:
    """When the rank log says its first attempt's step 1 ended (its first ``step 1/N`` line), or None. The
    job's step rows keep one row per step, the latest attempt's: after a kill before any checkpoint, step 1's
    row is the replacement's and the first attempt's start-up is read here instead."""
    for line in lines:
        step = _STEP_LINE.match(line)
        if step and step["step"] == "1":
            return _when(step["ts"])
    return None


def timeline(events: list[dict[str, Any]], origin: float, *, limit: int = 80) -> list[dict[str, Any]]:
    """Events as seconds after ``origin`` (the submit, or the kill), with their messages, oldest first."""
    return [
        {"t": round(e["ts"] - origin, 3), "kind": e["kind"], "message": _message(e)[:300]}
        for e in sorted(events, key=lambda e: e["ts"])
    ][:limit]


def _submit_to_first_step(
    from_rows: float | None, steps: list[dict[str, Any]], log_lines: list[str], submit_ts: float
) -> float | None:
    first_row = next((row for row in steps if row.get("step") == 1), None)
    if first_row is not None and first_row.get("attempt", 1) == 1:
        return from_rows
    logged = first_step_logged_ts(log_lines)
    return None if logged is None else logged - submit_ts


def job_figures(
    *,
    submit_ts: float,
    job: dict[str, Any],
    steps: list[dict[str, Any]],
    events: list[dict[str, Any]],
    log_lines: list[str],
    kill_at: int | None = None,
) -> dict[str, Any]:
    """One service job's figures.

    * ``submit_to_first_step_s``: step 1's row (supervisor receive time) minus the moment before the POST;
      where that row is a later attempt's, the first attempt's ``step 1/N`` line in the rank log;
    * ``step_s_median``: the rows' ``step_s`` after warm-up; ``goodput``, ``restarts``: the job's own fields;
    * ``startup``: the rank-0 start-up line of every attempt (where the seconds before step 1 went);
    * ``wind_down``: the same for the seconds after the last step (:func:`wind_down`);
    * ``save_blocking``: per save, training time the checkpoint blocked (rank 0's log), and their median;
    * with ``kill_at``: ``kill_to_next_step_s`` (the kill, see :func:`kill_ts`, to the first row of a
      later attempt), ``detect_s`` (``chaos_fired`` -> ``worker_failed``), ``resumed_from``, ``recomputed``.
    """
    measures = recovery_measures(
        steps, start_ts=submit_ts, kill_ts=kill_ts(events) if kill_at is not None else None, kill_at=kill_at
    )
    saves = save_blocking(log_lines)
    blocked = median([s["blocked_s"] for s in saves])
    out: dict[str, Any] = {
        "status": job.get("status"),
        "error": job.get("error"),
        "restarts": job.get("restarts"),
        "attempt": job.get("attempt"),
        "goodput": job.get("goodput"),
        "last_step": job.get("step"),
        "submit_to_first_step_s": _submit_to_first_step(measures["startup_s"], steps, log_lines, submit_ts),
        "step_s_median": step_median(steps),
        "steps_recorded": len(steps),
        "wall_s": (job["updated_at"] - submit_ts) if job.get("updated_at") else None,
        "startup": startup_phases(log_lines),
        "compile": compile_lines(log_lines),
        "wind_down": wind_down(log_lines),
        "save_blocking": saves,
        "save_blocking_median_s": None if blocked != blocked else blocked,
        # checkpoint.every_steps: auto re-evaluates its interval as step and save times are measured
        "checkpoint_intervals": [
            _message(e)[:300] for e in sorted(events, key=lambda e: e["ts"]) if e["kind"] == "checkpoint_interval"
        ],
    }
    if kill_at is not None:
        killed = kill_ts(events)
        fired = [e["ts"] for e in events if e["kind"] == "chaos_fired"]
        failed = [e["ts"] for e in events if e["kind"] == "worker_failed" and (not fired or e["ts"] >= min(fired))]
        out.update(
            kill_at=kill_at,
            kill_ts=killed,
            kill_to_next_step_s=measures["recovery_s"],
            detect_s=(min(failed) - min(fired)) if fired and failed else None,
            resumed_from=measures["resumed_from"],
            recomputed=measures["recomputed"],
            back_at_kill_step_s=measures["progress_s"],
        )
    return out
