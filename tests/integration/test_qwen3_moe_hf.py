"""Qwen3-MoE through the engine: Hugging Face weights in and out, and data parallelism equal to one process.

In and out (one process), for Qwen3-MoE and Mixtral: a tiny random ``Qwen3MoeForCausalLM`` /
``MixtralForCausalLM`` made by ``transformers`` and saved with ``save_pretrained`` (which writes the hub's
layout: one tensor per expert and projection, ``model.layers.N.mlp.experts.E.gate_proj.weight`` /
``model.layers.N.block_sparse_moe.experts.E.w1.weight``) loads into a ``Trainer`` with the same logits;
trained two steps, saved, committed and exported, the folder has the hub's names, ``from_pretrained`` loads
it with bit-equal weights, the same logits, and the same training loss (``output_router_logits=True``: LM
loss plus the weighted load-balancing loss) on the trainer's batch; a Trainer reading the export exports it
again bit for bit.

Throughput options (one process, both families): compiled blocks (``fullgraph=True``: the routing and the grouped-matmul
op trace as one graph) with selective checkpointing (which keeps the grouped matmuls' outputs), and full
checkpointing with the chunked loss, train the losses of the eager run.

Data parallelism (two gloo ranks, from the same folder): DDP (zero 0) and FSDP2 (zero 3, which shards the
stacked experts by expert, so each rank reads only its experts' tensors) train the same losses, gradient
norms and parameters as one process within the equivalence tolerances (1e-5 relative on losses): the
load-balancing loss is taken per micro-batch and averaged like the LM loss, so gradient accumulation 4 on
one process and 2 on each of two ranks agree.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir  # noqa: E402
from etrain.workers.checkpoints.hf_config import model_config_from_hf, read_hf_config  # noqa: E402
from etrain.workers.checkpoints.hf_io import export_hf, load_hf_weights  # noqa: E402
from etrain.workers.families import MODEL_PRESETS, family  # noqa: E402
from etrain.workers.protocol.run_config import (  # noqa: E402
    DataConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
)
from tests.dist_utils import run_distributed  # noqa: E402
from tests.equivalence_utils import LOSS_RTOL, RunResult, assert_equivalent, run_reference, small_config  # noqa: E402
from tests.state_utils import full_state_dict  # noqa: E402

SEQ = 16
TOL = 1e-5
CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    router_aux_loss_coef=0.01,
    max_position_embeddings=64,
)
_QWEN3_MOE_ONLY = ("intermediate_size", "moe_intermediate_size", "num_experts", "norm_topk_prob")
#: Per family: its transformers model and config, and two of the tensor names the hub's files hold (an
#: expert's projection, a router).
MODELS = {
    "qwen3_moe": (
        transformers.Qwen3MoeForCausalLM,
        transformers.Qwen3MoeConfig(**CONFIG),
        ("model.layers.1.mlp.experts.7.gate_proj.weight", "model.layers.0.mlp.gate.weight"),
    ),
    "mixtral": (
        transformers.MixtralForCausalLM,
        transformers.MixtralConfig(
            **{name: value for name, value in CONFIG.items() if name not in _QWEN3_MOE_ONLY},
            intermediate_size=32,  # each expert's width: Mixtral has no dense MLP
            num_local_experts=8,
        ),
        ("model.layers.1.block_sparse_moe.experts.7.w1.weight", "model.layers.0.block_sparse_moe.gate.weight"),
    ),
}


def _save_random(folder: str, arch: str) -> str:
    """A random model of ``arch``'s family (N(0, 0.1) weights), saved by ``save_pretrained``."""
    model_class, config, _ = MODELS[arch]
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    model.float().eval().save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    return _save_random(str(tmp_path_factory.mktemp("hf") / "qwen3-moe"), "qwen3_moe")


def _run_config(folder: str, parallel: ParallelConfig | None = None, **training) -> RunConfig:
    model = dataclasses.replace(model_config_from_hf(read_hf_config(folder), seq_len=SEQ), hf_path=folder)
    settings = dict(steps=2, global_batch=4, micro_batch=2, lr=1e-2, seed=7)
    return RunConfig(
        job_id="moe",
        model=model,
        data=DataConfig(kind="synthetic", seed=3),
        parallel=parallel or ParallelConfig(),
        training=TrainingConfig(**{**settings, **training}),
    )


def _trainer(config: RunConfig, rank: int = 0, world_size: int = 1):
    from etrain.workers.engine.train import Trainer

    return Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _save_committed(trainer, root: str, step: int) -> str:
    directory = step_dir(root, step)
    commit(directory, step, trainer.config.parallel.describe(), 1, [trainer.save(directory)])
    return directory


@pytest.mark.parametrize("arch", list(MODELS))
def test_hf_weights_in_and_out(arch, request, tmp_path):
    hf_folder = (
        request.getfixturevalue("hf_folder") if arch == "qwen3_moe" else _save_random(str(tmp_path / "hf"), arch)
    )
    found = family(arch)
    source = _tensors(hf_folder)
    # what transformers 5 writes: the hub's per-expert tensors, not its in-memory fused gate_up_proj
    expert_name, router_name = MODELS[arch][2]
    assert expert_name in source and router_name in source
    assert found.etrain_slice(expert_name) == ("layers.1.feed_forward.experts.w1", 7)
    assert found.etrain_slice(router_name) == ("layers.0.feed_forward.router.weight", None)
    assert not [name for name in source if "gate_up_proj" in name]
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    config = _run_config(hf_folder)
    trainer = _trainer(config)
    (model,) = trainer.model_parts
    tokens = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - reference(tokens).logits).abs().max().item()
    report = load_hf_weights(trainer.model_parts, hf_folder, config.model)
    assert report.elements_read == report.local_elements == families.num_params(config.model)
    assert report.tensors == len(source)  # one per expert and projection
    print(f"{arch} load: max|logit diff| = {diff:.3g}")
    assert diff <= TOL

    trainer.run(0, 2)
    saved = _save_committed(trainer, str(tmp_path / "ckpt"), 2)
    out = export_hf(saved, str(tmp_path / "export"), config.model)
    exported_tensors = _tensors(out)
    assert exported_tensors.keys() == source.keys()  # the hub's names, one tensor per expert
    assert json.load(open(os.path.join(out, "config.json")))["architectures"] == [MODELS[arch][0].__name__]
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported) is MODELS[arch][0] and exported.config.num_experts == 8
    ours = dict(model.named_parameters())
    for name, tensor in exported_tensors.items():
        fqn, expert = found.etrain_slice(name)
        assert torch.equal(tensor, ours[fqn] if expert is None else ours[fqn][expert]), name
    down = found.expert_template("layers.0.feed_forward.experts.w2").format(expert=3)
    assert (exported_tensors[down] - source[down]).abs().max().item() > 1e-4  # two steps at lr 1e-2 moved them
    inputs, targets = trainer.dataset.batch([0, 1, 2, 3])
    with torch.no_grad():
        want = model(inputs, targets=targets).item()
        theirs = exported(inputs, labels=targets, shift_labels=targets, output_router_logits=True)
        logit_diff = (model(inputs) - theirs.logits).abs().max().item()
    print(f"{arch} export: trainer loss {want:.6f}, transformers {theirs.loss.item():.6f}, logits {logit_diff:.3g}")
    assert abs(theirs.loss.item() - want) <= TOL and logit_diff <= TOL

    # a Trainer that loads the export exports it again, bit for bit
    second = _run_config(out)
    again = export_hf(_save_committed(_trainer(second), str(tmp_path / "ckpt2"), 0), tmp_path / "again", second.model)
    assert all(torch.equal(t, exported_tensors[k]) for k, t in _tensors(again).items())


def _train_dp2(rank: int, world_size: int, folder: str) -> dict:
    """DDP and FSDP2 (ZeRO-3) from the Hugging Face folder, each trained its steps."""
    results = {}
    for zero in (0, 3):
        config = _run_config(folder, ParallelConfig(dp=2, zero=zero), **_EQUIVALENCE)
        trainer = _trainer(config, rank, world_size)
        report = load_hf_weights(trainer.model_parts, folder, config.model)  # each rank its own slices
        history = trainer.run(0, config.training.steps)
        result = RunResult(
            rank=rank,
            losses=[m.loss for m in history],
            grad_norms=[m.grad_norm for m in history],
            params=full_state_dict(trainer),
        )
        results[zero] = (result, report)
    return results


#: global batch 8 in micro-batches of 2: gradient accumulation 4 on one process, 2 on each of 2 ranks
_EQUIVALENCE = dict(steps=3, global_batch=8, micro_batch=2, lr=3e-3, warmup_steps=1, grad_clip=0.5, weight_decay=0.1)


def test_data_parallel_trains_like_one_process(hf_folder):
    reference = run_reference(_run_config(hf_folder, **_EQUIVALENCE))
    per_rank = run_distributed(_train_dp2, 2, hf_folder, timeout_s=240.0)
    num_params = families.num_params(_run_config(hf_folder).model)
    for zero in (0, 3):
        results = [ranks[zero][0] for ranks in per_rank]
        print(f"qwen3_moe dp2 zero={zero}: losses {results[0].losses} vs one process {reference.losses}")
        assert_equivalent(reference, results, layout=f"qwen3_moe dp2 zero={zero}")
        for _, report in (ranks[zero] for ranks in per_rank):
            assert report.elements_read == report.local_elements
            if zero == 3:  # FSDP2 shards every parameter, the stacked experts by expert
                assert report.local_elements < 0.6 * num_params


@pytest.mark.parametrize(
    "options",
    [
        {"compile": True, "activation_checkpointing": "selective"},
        {"activation_checkpointing": "full", "loss_chunk_tokens": 8},
    ],
    ids=["compile+selective", "full+chunked"],
)
@pytest.mark.parametrize("preset", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_throughput_options_train_the_eager_losses(preset, options, monkeypatch):
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # inductor's graphs, without its C++ build
    model = dataclasses.replace(ModelConfig(**MODEL_PRESETS[preset]), seq_len=SEQ, router_aux_loss_coef=0.01)
    config = small_config(steps=3, model=model)
    reference = run_reference(config)
    trainer = _trainer(dataclasses.replace(config, training=dataclasses.replace(config.training, **options)))
    losses = [m.loss for m in trainer.run(0, 3)]
    print(f"{preset} {options}: {losses} vs eager {reference.losses}")
    assert all(abs(a - b) <= LOSS_RTOL * b for a, b in zip(losses, reference.losses))
