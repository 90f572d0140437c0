"""The engine probe: etrain's ``Trainer`` against the same loop written with transformers, on one device.

Every row trains the check's model (``measures.FULL``: Llama-3.2-1B shapes, 2048 tokens, micro-batch 4,
global batch 8; ``--tiny``: ``measures.TINY`` on CPU) from random initialisation on synthetic tokens:
fp32 master weights, bf16 autocast on CUDA, AdamW (fused on CUDA), gradient clipping at 1.0, gradient
accumulation over global / micro micro-batches. The transformers rows are what a user writes by hand:
``AutoModelForCausalLM.from_config`` (SDPA attention) built on the device, ``model(input_ids)`` and
transformers' own loss per micro-batch. Its config comes from
``etrain.workers.checkpoints.hf_config.hf_config_dict``, and it starts from etrain's initial weights on
etrain's micro-batches with etrain's optimizer recipe, so both engines train the same numbers and their
losses check each other step by step (tests/integration/test_bench_gpu_rows.py). A row is data (``measures.ROWS``: the engine and its options, e.g.
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
import tempfile
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


def _start_like_etrain(model: Any, config: Any, sizes: CheckSizes, device) -> tuple[Any, list[list[tuple[Any, Any]]]]:
    """The transformers ``model`` with etrain's initial weights, and etrain's micro-batches by step.

    So that the two loops train the same numbers from the same start and their losses can be compared
    step by step: the rows measure speed, and this makes them check each other too. (Before, the
    transformers loop started from its own random weights on uniformly random tokens, so its losses
    said nothing about etrain's.) The weights come from an etrain ``Trainer`` built as the etrain row
    builds it, under transformers' names (``hf_name``), then the Trainer is dropped. Where the model's
    modules are not laid out as the hub's files (transformers 5 fuses a mixture's experts into one
    ``gate_up_proj`` per layer), the weights go through the hub's layout: written to a temporary folder,
    loaded with ``from_pretrained``, which converts them.
    """
    from etrain.workers import families
    from etrain.workers.engine.train import Trainer
    from etrain.workers.families.model import canonical_fqn

    trainer = Trainer(config, rank=0, world_size=1, device=device)
    steps = config.training.steps
    found = families.family(config.model.arch)
    weights = {}
    for fqn, tensor in trainer.model_parts[0].state_dict().items():
        fqn = canonical_fqn(fqn)
        if config.model.tie_embeddings and fqn == "output.weight":
            continue
        # a stacked expert parameter is one tensor per expert in transformers
        for name, _, expert in found.hf_tensors(fqn, tuple(tensor.shape), config.model):
            weights[name] = tensor if expert is None else tensor[expert]
    outcome = model.load_state_dict(weights, strict=False)
    missing = [name for name in outcome.missing_keys if not name.endswith("rotary_emb.inv_freq")]
    if config.model.tie_embeddings:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or outcome.unexpected_keys:
        model = _through_the_hub_layout(model, weights, device)
    micro = sizes.micro_batch
    batches = [
        [trainer.dataset.batch(indices) for indices in trainer.sampler.local_micro_batches(step, 0, 1, micro)]
        for step in range(steps)
    ]
    del trainer, weights
    return model, batches


def _through_the_hub_layout(model: Any, weights: dict[str, Any], device) -> Any:
    """``model``'s class loaded by ``from_pretrained`` from ``weights`` written as the hub's files."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    folder = tempfile.mkdtemp(prefix="etrain-probe-hf-")
    try:
        # copies: safetensors refuses tensors that share memory (one expert of a stacked parameter)
        save_file(
            {name: tensor.detach().cpu().clone() for name, tensor in weights.items()}, f"{folder}/model.safetensors"
        )
        model.config.save_pretrained(folder)
        dtype = next(model.parameters()).dtype
        del model
        loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return loaded.to(device)


def hf_row(sizes: CheckSizes, steps: int, device, options: dict[str, Any]) -> dict[str, Any]:
    """The loop a user writes with transformers, on the same model, from etrain's initial weights on
    etrain's batches (:func:`_start_like_etrain`). ``options``: ``compile`` (each decoder layer compiled
    in place with ``training.compile``'s backend, as etrain compiles its blocks),
    ``activation_checkpointing: "full"`` (transformers' gradient checkpointing)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig, AutoModelForCausalLM

    from etrain.workers.checkpoints.hf_config import hf_config_dict

    raw = hf_config_dict(model_config(sizes))
    config = AutoConfig.for_model(raw.pop("model_type"), **{k: v for k, v in raw.items() if k != "architectures"})
    cuda = device.type == "cuda"
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    creation_s = time.perf_counter() - started
    etrain = etrain_config(sizes, steps, device, {})  # the etrain row's run: its start, batches and recipe
    model, batches = _start_like_etrain(model, etrain, sizes, device)  # not part of the build: etrain's side
    _reset_peak(device)  # the peak from here: the etrain Trainer that gave the weights is gone
    started = time.perf_counter() - creation_s
    if options.get("activation_checkpointing", "none") == "full":
        model.gradient_checkpointing_enable()
    if options.get("compile"):
        from etrain.workers.engine.compile import compile_backend, use_node_cache

        use_node_cache()
        for layer in model.model.layers:
            layer.compile(backend=compile_backend())
    model.train()
    # etrain's recipe written out: AdamW (betas, eps, weight decay), the per-step learning rate (warmup,
    # cosine), clipping at 1.0
    from etrain.workers.engine.optim import ADAM_BETAS, lr_at

    training = etrain.training
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=training.lr,
        betas=ADAM_BETAS,
        eps=1e-8,
        weight_decay=training.weight_decay,
        fused=True,  # as etrain's build_optimizer, on CUDA and CPU alike
    )
    _sync(device)
    build_s = time.perf_counter() - started
    accumulation = len(batches[0])
    routed = {"output_router_logits": True} if hasattr(config, "router_aux_loss_coef") else {}
    times, losses = [], []
    for step in range(steps):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, training)
        total = torch.zeros((), device=device)
        for inputs, targets in batches[step]:
            inputs = inputs.to(device, non_blocking=True)
            targets = targets.to(device, non_blocking=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda and sizes.precision == "bf16"):
                out = model(input_ids=inputs, **routed)
                # what transformers' own loss does (fp32 upcast, mean over tokens, plus a mixture's
                # load-balancing loss), on etrain's shifted targets
                loss = F.cross_entropy(out.logits.float().flatten(0, 1), targets.flatten(0, 1))
                if routed:
                    loss = loss + config.router_aux_loss_coef * out.aux_loss
                loss = loss / accumulation
            loss.backward()
            total += loss.detach()
        if training.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip)
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
