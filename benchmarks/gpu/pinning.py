"""What pinning an async save's host buffers costs the training that runs beside it, per way of pinning.

    python -m benchmarks.gpu.pinning [--steps-max 40] [--results-dir DIR] [--tiny]

An async checkpoint on CUDA copies the rank's state (a 1B model's fp32 weights and AdamW moments:
15.9 GB) into pinned host buffers; pinning them is slow, and on an H100 it stalled the training step it
ran beside by 6.1-6.6 s (``make gpu-check``, 2026-11-27). This trains the check's model eagerly (Llama-3.2-1B
shapes, bf16 autocast, fused AdamW; its state made first) and, for each way below, prepares buffers for
the whole state on a background thread while steps run; per way: the preparation's seconds, the steps it
overlapped and how much longer they took than the median step without it (the stall), and the blocking
copy of the state into the prepared buffers afterwards (what each later save costs the training):

* ``dcp``: what etrain does (DCP's ``DefaultStager`` with pinned memory: ``cudaHostRegister`` of each
  freshly allocated, untouched storage, then the copy);
* ``touch-register``: pageable buffers written once (their pages faulted in) on the background thread,
  then each registered whole (``cudaHostRegister``);
* ``touch-register-chunks``: the same, registered in 64 MiB pieces with a 2 ms pause between pieces
  (the copy into such a buffer spans pieces: is it still a pinned-speed copy?);
* ``cuda-host-alloc``: ``torch.empty(pin_memory=True)`` per tensor (``cudaHostAlloc`` through PyTorch's
  caching host allocator).

Prints a JSON line per way and writes ``gpu_pinning.json``. Without CUDA it says so and exits 0
(``--tiny`` runs the ``dcp`` and pageable ways on CPU with the tiny model: the script's own check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

PIECE_BYTES = 64 << 20
WAYS = ("dcp", "touch-register", "touch-register-chunks", "cuda-host-alloc")


class _Buffers:
    """Host buffers for ``tensors`` prepared one way; ``copy()`` stages the tensors into them (blocking
    until the copy is done, as a save's staging does); ``release()`` unpins and frees them."""

    def __init__(self, way: str, state: dict[str, Any], tensors: list[Any], cuda: bool):
        self.way, self.state, self.tensors, self.cuda = way, state, tensors, cuda
        self.buffers: list[Any] = []
        self.registered: list[int] = []
        self.stager = None

    def prepare(self) -> None:
        import torch

        if self.way == "dcp":
            from etrain.workers.checkpoints.checkpoint import _reused_stager

            self.stager = _reused_stager(self.cuda)
            self.stager.stage(self.state)
            return
        cudart = torch.cuda.cudart() if self.cuda else None
        for tensor in self.tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if self.way == "cuda-host-alloc":
                self.buffers.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda))
                continue
            buffer = torch.empty(nbytes, dtype=torch.uint8)
            buffer.fill_(0)  # fault every page in, off any driver lock
            self.buffers.append(buffer)
            if cudart is None or nbytes == 0:
                continue
            if self.way == "touch-register":
                self._register(cudart, buffer.data_ptr(), nbytes)
            else:
                # Pieces end on page boundaries (the buffer itself need not start on one): no page is
                # registered twice.
                at, end = buffer.data_ptr(), buffer.data_ptr() + nbytes
                while at < end:
                    cut = min(end, (at + PIECE_BYTES) // 4096 * 4096)
                    cut = end if cut <= at else cut
                    self._register(cudart, at, cut - at)
                    at = cut
                    time.sleep(0.002)

    def _register(self, cudart: Any, pointer: int, nbytes: int) -> None:
        code = int(cudart.cudaHostRegister(pointer, nbytes, 0))
        if code != 0:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
        self.registered.append(pointer)

    def copy(self) -> float:
        import torch

        started = time.perf_counter()
        if self.stager is not None:
            self.stager.stage(self.state)
        else:
            for tensor, buffer in zip(self.tensors, self.buffers):
                if tensor.numel():
                    buffer.view(tensor.dtype).view(tensor.shape).copy_(tensor, non_blocking=self.cuda)
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started

    def pinned(self) -> bool | None:
        if self.stager is not None or not self.buffers:
            return None
        return all(b.is_pinned() for b in self.buffers if b.numel())

    def release(self) -> float:
        import torch

        started = time.perf_counter()
        if self.stager is not None:
            self.stager.release()
        if self.registered:
            cudart = torch.cuda.cudart()
            for pointer in self.registered:
                cudart.cudaHostUnregister(pointer)
        self.buffers.clear()
        self.registered.clear()
        return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps-max", type=int, default=40, help="most steps run beside one preparation")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args()

    import torch

    if not args.tiny and not torch.cuda.is_available():
        print("no GPU on this machine: the pinning measurement skipped")
        return 0
    from benchmarks.gpu.throughput import _etrain_importable

    _etrain_importable()  # before measures, which imports etrain (a GPU machine has no install of it)
    from benchmarks.gpu.measures import FULL, TINY
    from benchmarks.gpu.probe import etrain_config, open_device
    from etrain.workers.checkpoints.checkpoint import local_tensors
    from etrain.workers.checkpoints.checkpoint_state import collect_state
    from etrain.workers.engine.train import Trainer

    sizes = TINY if args.tiny else FULL
    device, name, _ = open_device(args.tiny)
    cuda = device.type == "cuda"
    trainer = Trainer(etrain_config(sizes, 10_000, device, {}), rank=0, world_size=1, device=device)
    trainer.materialize_optimizer_state()
    step = 0

    def one_step() -> float:
        nonlocal step
        started = time.perf_counter()
        trainer.train_step(step)  # one host read per step: its time is the step's, GPU included
        step += 1
        return time.perf_counter() - started

    for _ in range(3):
        one_step()
    baseline = statistics.median(one_step() for _ in range(6))
    state = collect_state(trainer.model_parts, trainer.optimizers).state
    tensors = local_tensors(state)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    document: dict[str, Any] = {
        "file": "gpu_pinning.json",
        "kind": "pinning an async save's host buffers beside training",
        "device": name,
        "torch": torch.__version__,
        "state_gib": round(nbytes / 2**30, 3),
        "tensors": len(tensors),
        "step_s_median": round(baseline, 4),
        "ways": [],
    }
    print(json.dumps({k: v for k, v in document.items() if k != "ways"}), flush=True)
    for way in args.ways.split(","):
        if args.tiny and way in ("touch-register", "touch-register-chunks", "cuda-host-alloc"):
            way_cuda = False
        else:
            way_cuda = cuda
        buffers = _Buffers(way, state, tensors, way_cuda)
        errors: list[str] = []

        def prepare(buffers=buffers, errors=errors) -> None:
            try:
                buffers.prepare()
            except Exception as err:  # noqa: BLE001 - reported in the row
                errors.append(repr(err)[:300])

        thread = threading.Thread(target=prepare, daemon=True)
        started = time.perf_counter()
        thread.start()
        beside: list[float] = []
        while thread.is_alive() and len(beside) < args.steps_max:
            beside.append(one_step())
        thread.join()
        prepare_s = time.perf_counter() - started
        after = [one_step() for _ in range(3)]
        row = {
            "way": way,
            "prepare_s": round(prepare_s, 3),
            "steps_beside": len(beside),
            "stall_s": round(sum(max(0.0, t - baseline) for t in beside), 3),
            "longest_step_s": round(max(beside), 3) if beside else None,
            "steps_after_s": [round(t, 3) for t in after],
            "error": errors[0] if errors else None,
        }
        if not errors:
            row["copy_s"] = [round(buffers.copy(), 3) for _ in range(2)]
            row["pinned"] = buffers.pinned()
        row["release_s"] = round(buffers.release(), 3)
        document["ways"].append(row)
        print(json.dumps(row), flush=True)
        if not args.tiny:
            args.results_dir.mkdir(parents=True, exist_ok=True)
            (args.results_dir / "gpu_pinning.json").write_text(json.dumps(document, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
