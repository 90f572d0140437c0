"""``make bench-gpu``: etrain against transformers on one GPU, row by row, on two model shapes.

Rows (``measures.BENCH_ROWS``, each a ``measures.ROWS`` entry: an engine and its options): etrain eager,
etrain compile, + chunked loss, + selective activation checkpointing, + float8 (compile + chunked loss +
``training.float8``; skipped, "needs training.float8", where ``TrainingConfig`` has no such field),
transformers eager, transformers with each decoder layer compiled. Shapes (``measures.BENCH_SHAPES``):
Llama-3.2-1B (``measures.FULL``) and Llama-3.1-8B's widths with as many of its 32 layers as fit the GPU
(``measures.LLAMA8B_WIDTHS``, ``measures.layers_that_fit``: 9 on an 80 GB H100, 20 on an H200; ``--layers``
sets the count; micro-batch 2). Each row is the engine
probe's (``benchmarks/gpu/probe.py``): same loop, same synthetic tokens, median step after 3 warm-up steps
(the first includes compilation), tokens/s, MFU, peak device memory.

Writes ``gpu_throughput.json`` (``--results-dir``, default ``benchmarks/results``; ``--tiny``: a temporary
folder; and ``$OUT`` when set) after every row, then prints the markdown table
(``benchmarks.gpu.table.render_throughput``; ``python -m benchmarks.gpu.table --throughput`` prints it again).

    python -m benchmarks.gpu.throughput [--tiny] [--shapes 1b,8b-widths,moe] [--rows ...] [--steps 10]

Without CUDA (and without ``--tiny``) it says so and exits 0. ``--tiny``: every row on CPU with the tiny
model; compiled rows use ``ETRAIN_COMPILE_BACKEND=aot_eager`` unless set (inductor's C++ build takes ~90 s
per shape on a 2-core machine). Imports torch, transformers and etrain's ``workers/`` only: where
``etrain`` is not installed (the GPU machines), a temporary folder links ``etrain/workers`` to this checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULT_NAME = "gpu_throughput.json"


def _etrain_importable() -> None:
    """``import etrain.workers`` (and the planner in ``etrain.service.planning``) without an install: pyproject
    maps ``workers/`` to ``etrain.workers`` (as ``benchmarks/gpu/run.sh`` does it, a temporary folder holds
    the links)."""
    try:
        importlib.import_module("etrain.workers")
        return
    except ImportError:
        pass
    folder = Path(tempfile.mkdtemp(prefix="etrain-pkg-"))
    (folder / "etrain").mkdir()
    (folder / "etrain" / "workers").symlink_to(REPO / "workers")
    (folder / "etrain" / "service").symlink_to(REPO / "service")  # the planner (layers_that_fit): pure Python
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    importlib.import_module("etrain.workers")


def device_bytes(device) -> int:
    """The GPU's whole memory (``--tiny``: the machine's, which no tiny model comes near)."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _torchao_importable(rows: list[str]) -> str | None:
    """Make ``import torchao`` work for the float8 rows where the machine's Python lacks it: the GPU
    machines have PyTorch and transformers, no torchao and no network, so ``make gpu-wheels`` brings
    torchao's wheel in ``.whl/`` (the release built for the GPU machine's torch) and it is installed here
    into a temporary folder. Returns what was done, or None when nothing was needed."""
    from benchmarks.gpu.measures import ROWS

    if not any(ROWS.get(row, {}).get("options", {}).get("float8") for row in rows):
        return None
    if importlib.util.find_spec("torchao") is not None:
        return None
    wheels = sorted((Path(os.environ.get("GPU_WHEELS_DIR") or REPO / ".whl")).glob("torchao-*.whl"))
    if not wheels:
        return "torchao is not installed and .whl/ holds no torchao wheel (make gpu-wheels): float8 rows will fail"
    folder = tempfile.mkdtemp(prefix="etrain-torchao-")
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    command += ["--disable-pip-version-check", "--target", folder, str(wheels[-1])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        return f"installing {wheels[-1].name} failed: {done.stderr.strip()[-400:]}"
    sys.path.insert(0, folder)
    importlib.invalidate_caches()
    return f"torchao from {wheels[-1].name}, installed into {folder}"


def _no_gpu() -> str | None:
    """Why this machine cannot run the GPU benchmark, or None."""
    try:
        import torch
    except ImportError:
        return f"no PyTorch for {sys.executable}"
    return None if torch.cuda.is_available() else "torch.cuda finds none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="every row on CPU with the tiny model")
    parser.add_argument("--shapes", default="1b,8b-widths", help="comma-separated: 1b, 8b-widths, moe")
    parser.add_argument("--rows", default=None, help="comma-separated rows of measures.ROWS (default: BENCH_ROWS)")
    parser.add_argument("--steps", type=int, default=10, help="steps per row (the first 3 are warm-up)")
    parser.add_argument("--results-dir", type=Path, default=None)
    parser.add_argument(
        "--layers",
        default="fit",
        help="layers of the shapes that run fewer than their preset (8b-widths): a number, or 'fit' (default: "
        "as many as fit the GPU's memory, measures.layers_that_fit; --tiny keeps its tiny model's)",
    )
    parser.add_argument(
        "--micro-batch",
        type=int,
        default=None,
        help="every shape's micro-batch (the global batch, so the tokens per step, stay the shape's)",
    )
    args = parser.parse_args()

    if not args.tiny:
        why = _no_gpu()
        if why:
            print(f"no GPU on this machine: make bench-gpu skipped ({why})")
            return 0
    else:
        os.environ.setdefault("ETRAIN_COMPILE_BACKEND", "aot_eager")
    _etrain_importable()
    from benchmarks.gpu.measures import BENCH_ROWS

    rows = args.rows.split(",") if args.rows else list(BENCH_ROWS)
    torchao_note = _torchao_importable(rows)  # before anything imports torchao's absence
    if torchao_note:
        print(torchao_note, flush=True)

    from benchmarks.figures import machine_info
    from benchmarks.gpu.measures import (
        BENCH_SHAPES,
        FIT_SHAPES,
        device_peak,
        layers_that_fit,
        model_summary,
        shape_label,
    )
    from benchmarks.gpu.probe import open_device, row_line, run_row, versions, write_result
    from benchmarks.gpu.table import render_throughput

    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in BENCH_SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; shapes: {', '.join(BENCH_SHAPES)}")
    results_dir = args.results_dir or (
        Path(tempfile.gettempdir()) / "etrain-bench-gpu-tiny" if args.tiny else REPO / "benchmarks" / "results"
    )

    begun = time.time()
    device, name, init_s = open_device(args.tiny)
    first = BENCH_SHAPES[shapes[0]][2 if args.tiny else 1]
    document: dict[str, Any] = {
        "file": RESULT_NAME,
        "kind": "throughput: etrain vs transformers",
        "tiny": args.tiny,
        "device": name,
        **versions(),
        "compile_backend": os.environ.get("ETRAIN_COMPILE_BACKEND", "inductor"),
        "peak_flops_per_s": device_peak(name, first.precision),
        "device_init_s": init_s,
        "steps": args.steps,
        "warmup": 3,
        "shapes": [],
        "rows": [],
        "machine": machine_info(note="make bench-gpu" + (" --tiny" if args.tiny else "")),
    }
    print(json.dumps({k: document[k] for k in ("device", "torch", "transformers", "compile_backend")}), flush=True)
    for shape in shapes:
        label, gpu_sizes, tiny_sizes = BENCH_SHAPES[shape]
        sizes = tiny_sizes if args.tiny else gpu_sizes
        if args.micro_batch:
            if sizes.global_batch % args.micro_batch:
                parser.error(
                    f"--micro-batch {args.micro_batch} does not divide {shape}'s global batch {sizes.global_batch}"
                )
            sizes = dataclasses.replace(sizes, micro_batch=args.micro_batch)
        if shape in FIT_SHAPES and (args.layers != "fit" or not args.tiny):
            layers = layers_that_fit(sizes, device_bytes(device)) if args.layers == "fit" else int(args.layers)
            sizes = dataclasses.replace(sizes, n_layers=layers)
        label = shape_label(label, sizes)
        label = f"tiny stand-in for {label}" if args.tiny else label
        document["shapes"].append({"shape": shape, "label": label, "sizes": sizes.as_dict(), **model_summary(sizes)})
        for row in rows:
            record = {"shape": shape, **run_row(row, sizes, args.steps, device, name)}
            document["rows"].append(record)
            document["elapsed_s"] = time.time() - begun
            print(row_line(record), flush=True)
            paths = write_result(document, results_dir)
    text = render_throughput(document)
    for path in paths:
        Path(path).with_suffix(".md").write_text(text)
    print(text)
    print(json.dumps({"written": paths, "elapsed_s": round(time.time() - begun, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
