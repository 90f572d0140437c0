"""How many writer threads (a file each) an async save should use per rank: measured, not guessed.

    python -m benchmarks.gpu.write_threads [--gib 4] [--threads 1,2,4,8,16] [--dir /tmp/...] [--tiny]

An async save's background write is DCP's ``FileSystemWriter`` (``thread_count`` files per rank, each
fsynced) through etrain's recording writer (``workers/checkpoints/checkpoint_io.dcp_writer``), which
hashes each file as it is written (the shard report's SHA-256s). This writes a host-memory state
shaped like a Llama-1B rank's (fp32 matrices of the model's widths, the embedding the largest) of
``--gib`` GiB once per thread count, into a fresh folder on the disk under test, and times the write to
durable storage (fsync included). The page cache is dropped before each run where this process may
(root). (``make gpu-check`` of 2026-11-27 measured the writes alone, while the report still read the
files back for their hashes.)

Results: ``benchmarks/results/gpu_write_threads.json`` (``--results-dir``), a line per thread count on
stdout. ``make gpu-check`` runs it on the GPU machine's disk before the service jobs, so the figure that
chose ``CUDA_WRITE_THREADS`` (``workers/rank/rank_saves.py``) comes from the machine the jobs ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

#: Llama-3.2-1B's widths (d_model 2048, kv 512, d_ff 8192, vocab 128256): the tensor sizes of a rank's state.
_SHAPES = [
    (128256, 2048),
    (2048, 2048),
    (512, 2048),
    (512, 2048),
    (2048, 2048),
    (8192, 2048),
    (8192, 2048),
    (2048, 8192),
]


def host_state(gib: float) -> dict[str, Any]:
    """fp32 host tensors of a 1B model's shapes (the embedding first, then layers' matrices) up to
    ``gib`` GiB, filled with non-constant values (no file system compresses them away)."""
    import torch

    target = int(gib * 2**30)
    state: dict[str, Any] = {}
    total = index = 0
    generator = torch.Generator().manual_seed(0)
    while total < target:
        rows, cols = _SHAPES[index % len(_SHAPES)]
        rows = min(rows, max(1, (target - total) // (4 * cols)))
        tensor = torch.empty(rows, cols, dtype=torch.float32)
        tensor.uniform_(generator=generator)
        state[f"t{index:04d}"] = tensor
        total += tensor.numel() * 4
        index += 1
    return state


def _drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def measure(state: dict[str, Any], threads: int, folder: Path) -> dict[str, Any]:
    """One save of ``state`` with ``threads`` writer threads into ``folder`` (then removed), as an async
    save's background write does it: seconds until every file is durable and hashed (the shard report's
    hashes are taken as the files are written, ``checkpoint_io._hashing``)."""
    import torch.distributed.checkpoint as dcp

    from etrain.workers.checkpoints.checkpoint_io import dcp_writer

    folder.mkdir(parents=True)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    dropped = _drop_page_cache()
    started = time.perf_counter()
    writer = dcp_writer(str(folder), threads=threads)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=writer)
    written_s = time.perf_counter() - started
    shards = sorted(p.name for p in folder.iterdir() if p.suffix == ".distcp")
    shutil.rmtree(folder)
    return {
        "threads": threads,
        "files": len(shards),
        "hashed_files": len(getattr(writer.fs, "written", {})),
        "gib": round(nbytes / 2**30, 3),
        "write_s": round(written_s, 3),
        "write_gib_per_s": round(nbytes / 2**30 / written_s, 3),
        "page_cache_dropped": dropped,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="size of the state written per run (GiB)")
    parser.add_argument("--threads", default="1,2,4,8,16", help="comma-separated writer thread counts")
    parser.add_argument(
        "--dir", type=Path, default=None, help="a folder on the disk under test (default: a new /tmp one)"
    )
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--tiny", action="store_true", help="0.05 GiB, threads 1,4: the script's own check")
    args = parser.parse_args()
    gib, counts = (0.05, [1, 4]) if args.tiny else (args.gib, [int(n) for n in args.threads.split(",") if n])
    root = Path(tempfile.mkdtemp(prefix="write-threads-", dir=args.dir))
    try:
        state = host_state(gib)
        rows = []
        for threads in counts:
            row = measure(state, threads, root / f"threads_{threads}")
            rows.append(row)
            print(
                f"write threads {threads:>2}: {row['gib']:.2f} GiB in {row['write_s']:.2f} s "
                f"({row['write_gib_per_s']:.2f} GiB/s), {row['files']} files hashed as written",
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = min(rows, key=lambda r: r["write_s"])
    import torch

    result = {
        "file": "gpu_write_threads.json",
        "kind": "async save writer threads",
        "tiny": args.tiny,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "dir": str(args.dir or tempfile.gettempdir()),
        "cpus": os.cpu_count(),
        "rows": rows,
        "fastest_threads": best["threads"],
    }
    if not args.tiny:
        args.results_dir.mkdir(parents=True, exist_ok=True)
        (args.results_dir / "gpu_write_threads.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"fastest: {best['threads']} thread(s), {best['write_s']:.2f} s for {best['gib']:.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
