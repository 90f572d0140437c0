"""Hugging Face checkpoints in and out, end to end: a transformers model fine-tuned through REST.

A tiny random ``transformers.LlamaForCausalLM`` (grouped-query attention, untied, fp32, every weight
perturbed so that a norm left at 1 or a swapped projection shows) is saved with ``save_pretrained``
and submitted as ``model: {hf: DIR, seq_len: 16}`` on DP2×TP2 (four CPU ranks on a real local Ray,
a real uvicorn control plane and SQLite). In this process, transformers' own model trains on the
same batches with the same learning-rate schedule, AdamW settings and global-norm clipping; every
step's loss of the job must match it. The job succeeds only after its final checkpoint is written
as a Hugging Face folder (``artifacts.hf``), which ``AutoModelForCausalLM.from_pretrained`` loads
as is and which computes the reference model's loss; ``etrain export`` writes an earlier committed
step the same way.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LOSS_RTOL = 1e-4  # etrain (DP2×TP2, gloo) vs transformers in one process, per step
STEPS, CHECKPOINT_EVERY = 6, 3
TRAINING = {
    "steps": STEPS,
    "global_batch": 8,
    "micro_batch": 2,
    "lr": 3e-3,
    "warmup_steps": 2,
    "grad_clip": 0.5,
    "weight_decay": 0.1,
    "seed": 5,
}


def make_hf_model(folder) -> None:
    """A random tiny Llama, perturbed so that no weight keeps its structured initial value."""
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(1234)
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.add_(0.05 * torch.randn_like(param))
    model.save_pretrained(folder, safe_serialization=True)


def load(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def dtypes_of(folder) -> set[str]:
    """The safetensors dtypes of a folder's weights (read from the headers)."""
    from safetensors import safe_open

    found = set()
    for file in Path(folder).glob("*.safetensors"):
        with safe_open(str(file), "pt") as weights:
            found |= {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
    return found


def loss_of(model, inputs, targets) -> float:
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1)).item()


def reference_run(folder, config, fixed_batch):
    """transformers' model trained on the job's batches: per-step losses and gradient norms, and the
    fixed batch's loss after every step (index = optimizer steps done)."""
    from etrain.workers.engine.data import GlobalSampler, build_dataset
    from etrain.workers.engine.optim import build_optimizer, lr_at, set_lr

    training = config.training
    dataset = build_dataset(config.data, config.model)
    sampler = GlobalSampler(len(dataset), training.global_batch, training.seed)
    model = load(folder).train()
    optimizer = build_optimizer(model.parameters(), training)  # AdamW: same group, betas, eps, decay
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    losses, grad_norms, fixed_losses = [], [], [loss_of(model, *fixed_batch)]
    try:
        for step in range(training.steps):
            set_lr(optimizer, lr_at(step, training))
            optimizer.zero_grad(set_to_none=True)
            inputs, targets = dataset.batch(sampler.indices(step))
            logits = model(input_ids=inputs).logits
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
            loss.backward()
            grad_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), training.grad_clip).item())
            optimizer.step()
            losses.append(loss.item())
            fixed_losses.append(loss_of(model, *fixed_batch))
    finally:
        torch.set_num_threads(threads)
    return losses, grad_norms, fixed_losses


def test_fine_tune_a_transformers_llama_through_rest_and_load_the_result(plane, tmp_path):
    from etrain.api import cli
    from etrain.service.planning.spec import JobSpec
    from etrain.workers.engine.data import build_dataset

    source = tmp_path / "tiny-llama"
    make_hf_model(source)
    body = {
        "name": "hf-finetune",
        "model": {"hf": str(source), "seq_len": 16},
        "data": {"kind": "synthetic", "seed": 3},
        "parallelism": {"dp": 2, "tp": 2},
        "resources": {"cpus_per_worker": 0.5},
        "training": TRAINING,
        # the job's own export in bf16 (the float32 ones below are asked for by name)
        "checkpoint": {"every_steps": CHECKPOINT_EVERY, "export_dtype": "bfloat16"},
    }
    job = plane.submit(body)
    assert job["spec"]["model"]["kind"] == "llama" and job["world_size"] == 4

    # The reference runs while the job trains (both are small; the machine has spare cores).
    config = JobSpec.model_validate(body).to_run_config(job_id="reference", checkpoint_root="/unused")
    dataset = build_dataset(config.data, config.model)
    fixed_batch = dataset.batch(list(range(8)))
    ref_losses, ref_norms, ref_fixed = reference_run(source, config, fixed_batch)
    assert max(ref_norms) > TRAINING["grad_clip"], f"clipping must bind: norms {ref_norms}"

    final = plane.wait_terminal(job["id"], timeout_s=240)
    assert final["status"] == "SUCCEEDED", final
    kinds = [event["kind"] for event in plane.events(job["id"])]
    assert (
        kinds.index("training_finished") < kinds.index("exporting") < kinds.index("exported") < kinds.index("succeeded")
    )
    losses = [row["loss"] for row in plane.steps(job["id"])]
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, ref_losses), start=1):
        assert abs(got - want) <= LOSS_RTOL * abs(want), f"step {step}: etrain {got!r} vs transformers {want!r}"

    # The job's own export (checkpoint.export_dtype: bfloat16): a folder transformers loads as is, holding the
    # reference's final weights rounded to bf16.
    exported = final["artifacts"]["hf"]
    checkpoint_root = plane.data_dir / "checkpoints" / job["id"]
    assert exported == str((checkpoint_root / "hf-export").resolve())
    config_json = json.loads((Path(exported) / "config.json").read_text())
    assert config_json["architectures"] == ["LlamaForCausalLM"] and config_json["num_key_value_heads"] == 2
    assert config_json["torch_dtype"] == "bfloat16" and dtypes_of(exported) == {"BF16"}
    rounded = loss_of(load(exported), *fixed_batch)
    assert abs(rounded - ref_fixed[STEPS]) <= 0.01 * ref_fixed[STEPS], (rounded, ref_fixed)
    assert abs(rounded - ref_fixed[0]) > 1e-3, "the exported model must differ from the one we started from"

    # `etrain export` of an earlier committed step, and POST /export of the last one, to new folders.
    out = io.StringIO()
    earlier_dir = tmp_path / "exports" / f"step{CHECKPOINT_EVERY}"
    code = cli.main(
        [
            "--url",
            plane.url,
            "--token",
            plane.token,
            "export",
            job["id"],
            "--step",
            str(CHECKPOINT_EVERY),
            "--out",
            str(earlier_dir),
            "--dtype",
            "float32",
        ],
        out=out,
        err=out,
    )
    assert code == 0, out.getvalue()
    assert out.getvalue().strip() == str(earlier_dir)
    earlier_loss = loss_of(load(earlier_dir), *fixed_batch)
    want = ref_fixed[CHECKPOINT_EVERY]
    assert abs(earlier_loss - want) <= LOSS_RTOL * want, (earlier_loss, ref_fixed)

    body = {"out": str(tmp_path / "latest"), "dtype": "float32"}
    response = plane.client.post(f"/v1/jobs/{job['id']}/export", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json() == {"hf": str(tmp_path / "latest"), "step": STEPS, "dtype": "float32"}
    final_loss = loss_of(load(tmp_path / "latest"), *fixed_batch)  # the final weights exactly
    assert abs(final_loss - ref_fixed[STEPS]) <= LOSS_RTOL * ref_fixed[STEPS], (final_loss, ref_fixed)

    # The same checkpoint with no dtype asked: the job's checkpoint.export_dtype (bf16), the same bytes as the
    # job's own export, half the float32 folder's.
    half = plane.client.post(f"/v1/jobs/{job['id']}/export", json={"out": str(tmp_path / "bf16")}, timeout=120)
    assert half.json() == {"hf": str(tmp_path / "bf16"), "step": STEPS, "dtype": "bfloat16"}, half.text
    weights = "model.safetensors"
    assert (tmp_path / "bf16" / weights).read_bytes() == (Path(exported) / weights).read_bytes()
    assert (tmp_path / "bf16" / weights).stat().st_size < 0.55 * (tmp_path / "latest" / weights).stat().st_size

    # What cannot be exported is refused before any work: an uncommitted step, a non-empty folder.
    uncommitted = plane.client.post(f"/v1/jobs/{job['id']}/export", json={"step": 4, "out": str(tmp_path / "s4")})
    assert uncommitted.status_code == 409
    assert f"committed steps: [{CHECKPOINT_EVERY}, {STEPS}]" in uncommitted.json()["message"]
    occupied = plane.client.post(f"/v1/jobs/{job['id']}/export", json={"out": str(earlier_dir)})
    assert occupied.status_code == 409 and occupied.json()["detail"][0]["field"] == "out"
