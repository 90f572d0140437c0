"""The engine probe: etrain's ``Trainer`` against the same loop written with transformers, on one device.

Every row trains the check's model (``measures.FULL``: Llama-3.2-1B shapes, 2048 tokens, micro-batch 4,
global batch 8; ``--tiny``: ``measures.TINY`` on CPU) from random initialisation on synthetic tokens:
fp32 master weights, bf16 autocast on CUDA, AdamW (fused on CUDA), gradient clipping at 1.0, gradient
accumulation over global / micro micro-batches. The transformers rows are what a user writes by hand:
``AutoModelForCausalLM.from_config`` (SDPA attention) built on the device, ``model(input_ids,
labels).loss`` per micro-batch. Its config comes from ``etrain.workers.checkpoints.hf_config.hf_config_dict``, so
both engines train the same model. A row is data (``measures.ROWS``: the engine and its options, e.g.
``etrain-compile-chunked`` = ``compile: true, loss_chunk_tokens: auto``), resolved by ``measures.row_plan``.

Per row: build seconds (the ``Trainer`` constructor / model + optimizer construction, device
synchronised; the CUDA context is created before any row and timed on its own), per-step seconds
(synchronised; the first includes compilation), the median after 3 warm-up steps, tokens/s, MFU
(``measures.probe_figures``) and the peak device memory. Prints one JSON line per row and writes
``gpu_probe.json`` (to ``--results-dir`` and to ``$OUT`` when set) after every row, so a time-boxed run
keeps what it measured. ``make bench-gpu`` (``benchmarks/gpu/throughput.py``) runs more rows on two shapes.

    python -m benchmarks.gpu.probe [--tiny] [--steps 12] [--rows etrain,hf] [--results-dir DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.gpu.measures import (
    FULL,
    ROWS,
    TINY,
    CheckSizes,
    device_peak,
    model_config,
    model_summary,
    probe_figures,
    row_plan,
)

REPO = Path(__file__).resolve().parents[2]
RESULT_NAME = "gpu_probe.json"


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def etrain_config(sizes: CheckSizes, steps: int, device, options: dict[str, Any]) -> Any:
    """The ``RunConfig`` of the check's model in one process on ``device``; ``options``: ``TrainingConfig``
    fields (``measures.row_plan``)."""
    from etrain.workers.protocol.run_config import DataConfig, ParallelConfig, RunConfig, TrainingConfig

    return RunConfig(
        job_id="gpu-probe",
        model=model_config(sizes),
        data=DataConfig(kind="synthetic", seed=0),
        parallel=ParallelConfig(),
        training=TrainingConfig(
            steps=steps,
            global_batch=sizes.global_batch,
            micro_batch=sizes.micro_batch,
            lr=3e-4,
            **{"precision": sizes.precision, **options},
        ),
        device=device.type,
    )


def etrain_row(sizes: CheckSizes, steps: int, device, options: dict[str, Any]) -> dict[str, Any]:
    """etrain's ``Trainer`` in one process (world size 1, no process group), as a rank builds it;
    ``options``: ``TrainingConfig`` fields (``measures.row_plan``)."""
    from etrain.workers.engine.train import Trainer

    config = etrain_config(sizes, steps, device, options)
    _reset_peak(device)
    started = time.perf_counter()
    trainer = Trainer(config, rank=0, world_size=1, device=device)
    _sync(device)
    build_s = time.perf_counter() - started
    times, losses, own_mfu = [], [], []
    for step in range(steps):
        started = time.perf_counter()
        metrics = trainer.train_step(step)
        _sync(device)
        times.append(time.perf_counter() - started)
        losses.append(metrics.loss)
        own_mfu.append(metrics.mfu)
    peak = _peak_gib(device)
    del trainer
    return {"build_s": build_s, "times": times, "losses": losses, "peak_gib": peak, "trainer_reported_mfu": own_mfu[-1]}


def hf_row(sizes: CheckSizes, steps: int, device, options: dict[str, Any]) -> dict[str, Any]:
    """The loop a user writes with transformers, on the same model. ``options``: ``compile`` (each decoder
    layer compiled in place with ``training.compile``'s backend, as etrain compiles its blocks),
    ``activation_checkpointing: "full"`` (transformers' gradient checkpointing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from etrain.workers.checkpoints.hf_config import hf_config_dict

    raw = hf_config_dict(model_config(sizes))
    config = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
    cuda = device.type == "cuda"
    _reset_peak(device)
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if options.get("activation_checkpointing", "none") == "full":
        model.gradient_checkpointing_enable()
    if options.get("compile"):
        from etrain.workers.engine.compile import compile_backend, use_node_cache

        use_node_cache()
        for layer in model.model.layers:
            layer.compile(backend=compile_backend())
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=cuda, foreach=not cuda)
    _sync(device)
    build_s = time.perf_counter() - started
    accumulation = sizes.global_batch // sizes.micro_batch
    vocab = config.vocab_size
    generator = torch.Generator(device="cpu").manual_seed(0)
    times, losses = [], []
    for _ in range(steps):
        started = time.perf_counter()
        total = torch.zeros((), device=device)
        for _ in range(accumulation):
            tokens = torch.randint(0, vocab, (sizes.micro_batch, sizes.seq_len), generator=generator)
            tokens = tokens.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and sizes.precision == "bf16"):
                loss = model(input_ids=tokens, labels=tokens).loss / accumulation
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(total))
        _sync(device)
        times.append(time.perf_counter() - started)
    peak = _peak_gib(device)
    del model, optimizer
    return {"build_s": build_s, "times": times, "losses": losses, "peak_gib": peak}


def write_result(document: dict[str, Any], results_dir: Path) -> list[str]:
    """``gpu_probe.json`` / ``gpu_service.json`` into ``results_dir`` and ``$OUT`` (what a device run hands back)."""
    paths = []
    for folder in dict.fromkeys([results_dir] + ([Path(os.environ["OUT"])] if os.environ.get("OUT") else [])):
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / document["file"]
        path.write_text(json.dumps(document, indent=1, default=str))
        paths.append(str(path))
    return paths


RUNNERS = {"etrain": etrain_row, "hf": hf_row}


def run_row(name: str, sizes: CheckSizes, steps: int, device, device_name: str) -> dict[str, Any]:
    """One row of ``measures.ROWS`` on ``sizes``: its plan, what it measured and its figures, or why it was
    skipped, or the error it stopped on (the next row still runs)."""
    import dataclasses

    import torch

    from etrain.workers.protocol.run_config import TrainingConfig

    plan = row_plan(name, sizes, [f.name for f in dataclasses.fields(TrainingConfig)])
    record: dict[str, Any] = {k: plan[k] for k in ("row", "label", "engine", "options")}
    if plan["skip"]:
        return record | {"skipped": plan["skip"]}
    torch._dynamo.reset()  # each row compiles afresh (in memory; inductor's disk cache stays)
    try:
        raw = RUNNERS[plan["engine"]](sizes, steps, device, plan["options"])
        record |= raw | {"first_step_s": raw["times"][0] if raw["times"] else None}
        record |= probe_figures(raw["times"], sizes=sizes, device_name=device_name)
    except Exception as err:  # report and go on with the next row
        record |= {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-2000:]}
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def row_line(record: dict[str, Any]) -> str:
    """A row's JSON line for the console: its figures, the first and last loss, not every sample."""
    short = {k: v for k, v in record.items() if k not in ("times", "losses", "traceback")}
    if record.get("losses"):
        short |= {"first_loss": record["losses"][0], "last_loss": record["losses"][-1]}
    return json.dumps(short, default=str)


def open_device(tiny: bool):
    """The device of the run (CUDA, or CPU for ``--tiny``), its context created and timed; torch's threads
    set as a rank sets them (workers/rank/worker.py), so build times are the ones a job's rank pays.
    Returns (device, its name, seconds to create the context)."""
    import torch

    device = torch.device("cpu" if tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --tiny, or on a GPU machine")
    torch.set_num_threads(max(1, int(os.environ.get("ETRAIN_TORCH_THREADS", "1"))))
    started = time.perf_counter()
    torch.zeros(1, device=device)
    _sync(device)
    init_s = time.perf_counter() - started
    return device, torch.cuda.get_device_name() if device.type == "cuda" else "cpu", init_s


def versions() -> dict[str, Any]:
    import torch

    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = None
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    return {"torch": torch.__version__, "transformers": hf_version, "torchao": torchao_version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the tiny model on CPU (tests the probe anywhere)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", default="etrain,hf", help="comma-separated, of: " + ", ".join(ROWS))
    parser.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()

    from benchmarks.figures import machine_info

    begun = time.time()
    sizes = TINY if args.tiny else FULL
    device, name, init_s = open_device(args.tiny)
    summary = model_summary(sizes)
    document: dict[str, Any] = {
        "file": RESULT_NAME,
        "kind": "engine probe",
        "tiny": args.tiny,
        "device": name,
        **versions(),
        "sizes": sizes.as_dict(),
        "params": summary.pop("params"),
        "model": summary,
        "peak_flops_per_s": device_peak(name, sizes.precision),
        "device_init_s": init_s,
        "steps": args.steps,
        "rows": [],
        "machine": machine_info(note="make gpu-check" + (" --tiny" if args.tiny else "")),
    }
    print(
        json.dumps(
            {k: document[k] for k in ("device", "torch", "sizes", "params", "peak_flops_per_s", "device_init_s")}
        ),
        flush=True,
    )
    paths: list[str] = []
    for row in args.rows.split(","):
        record = run_row(row, sizes, args.steps, device, name)
        document["rows"].append(record)
        document["elapsed_s"] = time.time() - begun
        print(row_line(record), flush=True)
        paths = write_result(document, args.results_dir)
    print(json.dumps({"probe_written": paths, "elapsed_s": round(time.time() - begun, 1)}), flush=True)


if __name__ == "__main__":
    main()
