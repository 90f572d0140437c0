"""Hugging Face weights in and out of the torch engine, against ``transformers`` itself.

In: tiny random Llama / Mistral / Qwen2 / Qwen3 / OLMo 2 models are made by ``transformers`` (fp32, weights
perturbed with N(0, 0.1) so no norm is trivially one), saved with ``save_pretrained``, and a
``Trainer`` whose ``model.hf_path`` points at the folder must give the same logits (1e-5) in one
process, on DP2×TP2 (DDP-style replicate and ZeRO-3 with activation checkpointing) and on PP2 (the
last stage's logits, the hidden state passed stage to stage). Each rank must read only the slices it
owns (elements read == elements of its shards, fewer than the model's), and DCP must fill the
parameters in place. One 4-rank and one 2-rank spawn cover every model; the 4 ranks also save their
ZeRO-3×TP shards, and that checkpoint exports back to tensors bit-equal to the source files.

Out: a Llama and an OLMo 2 trained two steps are saved and committed like the supervisor does, exported, loaded by
``AutoModelForCausalLM.from_pretrained`` (loss on a fixed batch equal within 1e-5, weights bit-equal
to the trainer's); exporting again through a Trainer that loads the export gives bit-identical
tensors and the same config.json; a sharded export (index + several files) loads the same.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

from etrain.workers import families  # noqa: E402
from etrain.workers.checkpoints.checkpoint_commit import commit, step_dir  # noqa: E402
from etrain.workers.checkpoints.hf_config import hf_name, model_config_from_hf, read_hf_config  # noqa: E402
from etrain.workers.checkpoints.hf_io import export_hf, find_step_dir, load_hf_weights  # noqa: E402
from etrain.workers.families.model import cross_entropy_loss  # noqa: E402
from etrain.workers.protocol.errors import CheckpointError, ConfigError  # noqa: E402
from etrain.workers.protocol.run_config import DataConfig, ModelConfig, ParallelConfig, RunConfig, TrainingConfig  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)
SEQ = 16
TOL = 1e-5
TIMEOUT_S = 300.0
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "olmo2")


def _hf_model(arch: str, *, tied: bool | None = None):
    """A tiny ``transformers`` model of ``arch`` with perturbed fp32 weights (eval mode)."""
    if arch == "llama":
        config = transformers.LlamaConfig(
            **COMMON,
            attention_bias=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        config, cls = transformers.MistralConfig(**COMMON, sliding_window=64), transformers.MistralForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**COMMON, tie_word_embeddings=True if tied is None else tied)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "olmo2":  # post-norms and q/k norms over the whole (tp-sharded) width; biases everywhere
        config = transformers.Olmo2Config(**COMMON, attention_bias=True, rope_theta=500000.0, rms_norm_eps=1e-6)
        cls = transformers.Olmo2ForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**COMMON, head_dim=32), transformers.Qwen3ForCausalLM
    torch.manual_seed(0)
    model = cls(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model.float().eval()


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (batch, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory) -> dict[str, tuple[str, torch.Tensor]]:
    """``{case: (folder, transformers' logits on _tokens())}``; ``qwen2-untied`` is for the pipeline."""
    root = tmp_path_factory.mktemp("hf")
    cases = {arch: _hf_model(arch) for arch in ARCHS}
    cases["qwen2-untied"] = _hf_model("qwen2", tied=False)
    folders = {}
    for case, model in cases.items():
        folder = str(root / case)
        model.save_pretrained(folder, safe_serialization=True)
        with torch.no_grad():
            folders[case] = (folder, model(_tokens()).logits)
    return folders


def _run_config(folder: str, parallel: ParallelConfig | None = None, **training) -> RunConfig:
    parallel = parallel or ParallelConfig()
    model = dataclasses.replace(model_config_from_hf(read_hf_config(folder), seq_len=SEQ), hf_path=folder)
    return RunConfig(
        job_id="hf",
        model=model,
        data=DataConfig(kind="synthetic", seed=3),
        parallel=parallel,
        training=TrainingConfig(**{"steps": 2, "global_batch": 4, "micro_batch": 2, "lr": 1e-2, **training}),
    )


def _trainer(config: RunConfig, rank: int = 0, world_size: int = 1):
    from etrain.workers.engine.train import Trainer

    return Trainer(config, rank=rank, world_size=world_size, device=torch.device("cpu"))


# -- loading: one process ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_single_process_trainer_loads_hf_weights(hf_folders, arch):
    folder, want = hf_folders[arch]
    config = _run_config(folder)
    trainer = _trainer(config)
    (model,) = trainer.model_parts
    with torch.no_grad():
        got = model(_tokens())
    diff = (got - want).abs().max().item()
    print(f"single {arch}: max|logit diff| = {diff:.3g}")
    assert diff <= TOL
    if config.model.tie_embeddings:
        assert model.output.weight is model.tok_embeddings.weight
    report = load_hf_weights(trainer.model_parts, folder, config.model)  # again: in place, everything read once
    assert report.elements_read == report.local_elements == families.num_params(config.model)


def test_a_trainer_about_to_resume_does_not_read_the_hf_weights(hf_folders):
    """The worker builds with load_pretrained=False when it restores a checkpoint next: the weights
    stay the seeded initialisation (identical to an HF-less build), not the folder's."""
    from etrain.workers.engine.init import build_model
    from etrain.workers.engine.train import Trainer

    folder, want = hf_folders["llama"]
    config = _run_config(folder)
    trainer = Trainer(config, rank=0, world_size=1, device=torch.device("cpu"), load_pretrained=False)
    (model,) = trainer.model_parts
    seeded = build_model(config.model, seed=config.training.seed)
    for (name, got), expected in zip(model.named_parameters(), seeded.parameters()):
        assert torch.equal(got, expected), name
    with torch.no_grad():
        assert (model(_tokens()) - want).abs().max().item() > 1e-2  # not the Hugging Face model


# -- loading: DP2×TP2 and PP2 on gloo ranks ------------------------------------------------------


def _logits_dp2_tp2(rank: int, world_size: int, folders: dict[str, str], ckpt_root: str) -> dict:
    """Every model under replicate×TP (zero=0) and ZeRO-3×TP with activation checkpointing; the
    ZeRO-3 ones are also saved (step 0) for the parent to commit and export. OLMo 2 (its q/k norms over
    the tp-sharded width) runs under ZeRO-3×TP only, the layout that also shards those norms' weights
    with FSDP2 and recomputes them (the suite's time: replicate×TP adds nothing that one does not test)."""
    results = {}
    layouts = {
        "zero0": (ParallelConfig(dp=2, tp=2, zero=0), "none"),
        "zero3+ac": (ParallelConfig(dp=2, tp=2, zero=3), "full"),
    }
    for layout, (parallel, ac) in layouts.items():
        for arch, folder in folders.items():
            if arch == "olmo2" and layout == "zero0":
                continue
            config = _run_config(folder, parallel, activation_checkpointing=ac)
            trainer = _trainer(config, rank, world_size)
            (module,) = trainer.modules
            with torch.no_grad():
                logits = module(_tokens())
            if isinstance(logits, DTensor):  # the TP output projection's Replicate() logits
                logits = logits.full_tensor()
            report = load_hf_weights(trainer.model_parts, folder, config.model)
            (part,) = trainer.model_parts
            tied = part.output.weight is part.tok_embeddings.weight
            results[(layout, arch)] = (logits, report, tied)
            if layout == "zero3+ac":
                results[("saved", arch)] = trainer.save(step_dir(os.path.join(ckpt_root, arch), 0))
    return results


def _logits_pp2(rank: int, world_size: int, folders: dict[str, str]) -> dict:
    """Every (untied) model on two pipeline stages; stage 1 returns the logits."""
    results = {}
    for arch, folder in folders.items():
        config = _run_config(folder, ParallelConfig(pp=2))
        trainer = _trainer(config, rank, world_size)
        (stage,) = trainer.model_parts
        with torch.no_grad():
            if rank == 0:
                dist.send(stage(_tokens()).contiguous(), dst=1)
                logits = None
            else:
                hidden = torch.empty(2, SEQ, config.model.d_model)
                dist.recv(hidden, src=0)
                logits = stage(hidden)
        report = load_hf_weights(trainer.model_parts, folder, config.model)
        layers = sorted(int(k) for k in stage.layers.keys())
        results[arch] = (logits, report, layers)
    return results


def test_dp2_tp2_replicate_and_zero3_load_hf_weights(hf_folders, tmp_path):
    folders = {arch: hf_folders[arch][0] for arch in ARCHS}
    per_rank = run_distributed(_logits_dp2_tp2, 4, folders, str(tmp_path), timeout_s=TIMEOUT_S)
    for layout, arch in [key for key in per_rank[0] if key[0] != "saved"]:
        want = hf_folders[arch][1]
        config = _run_config(folders[arch]).model
        diffs = []
        for rank, results in enumerate(per_rank):
            logits, report, tied = results[(layout, arch)]
            diffs.append((logits - want).abs().max().item())
            # each rank read exactly its shards, a fraction of the model
            assert report.elements_read == report.local_elements, (layout, arch, rank)
            assert report.local_elements < 0.6 * families.num_params(config), (layout, arch, rank, report)
            assert tied == config.tie_embeddings, (layout, arch, rank)
        reads = [results[(layout, arch)][1].elements_read for results in per_rank]
        print(
            f"dp2·tp2 {layout} {arch}: max|logit diff| = {max(diffs):.3g}; elements read per rank {reads} "
            f"of {families.num_params(config)}"
        )
        assert max(diffs) <= TOL, (layout, arch, diffs)
    # ZeRO-3 × TP shards every matrix four ways: a rank holds about a quarter of the model
    zero3 = per_rank[0][("zero3+ac", "llama")][1]
    assert zero3.local_elements < 0.3 * families.num_params(_run_config(folders["llama"]).model)
    # a checkpoint saved in shards by the 4 ranks exports back to the very tensors that were loaded
    for arch in ARCHS:
        directory = step_dir(tmp_path / arch, 0)
        commit(directory, 0, "pp1·dp2·tp2 zero=3", 4, [results[("saved", arch)] for results in per_rank])
        out = export_hf(directory, tmp_path / f"{arch}-export", _run_config(folders[arch]).model)
        source, exported = _tensors(folders[arch]), _tensors(out)
        assert source.keys() == exported.keys(), arch
        assert all(torch.equal(source[k], exported[k]) for k in source), arch


def test_pp2_loads_hf_weights_per_stage(hf_folders):
    cases = ("llama", "mistral", "qwen2-untied", "qwen3", "olmo2")
    folders = {case: hf_folders[case][0] for case in cases}
    stage0, stage1 = run_distributed(_logits_pp2, 2, folders, timeout_s=TIMEOUT_S)
    for case in cases:
        _, report0, layers0 = stage0[case]
        logits, report1, layers1 = stage1[case]
        assert (layers0, layers1) == ([0], [1])
        diff = (logits - hf_folders[case][1]).abs().max().item()
        total = families.num_params(_run_config(folders[case]).model)
        print(
            f"pp2 {case}: max|logit diff| = {diff:.3g}; elements read per stage "
            f"{[report0.elements_read, report1.elements_read]} of {total}"
        )
        assert diff <= TOL
        for report in (report0, report1):
            assert report.elements_read == report.local_elements < total
        assert report0.local_elements + report1.local_elements == total  # stages partition the model


# -- loading: refusals -----------------------------------------------------------------------------


def test_wrong_weight_files_are_refused_naming_the_tensors(hf_folders, tmp_path):
    from safetensors.torch import load_file, save_file

    folder, _ = hf_folders["llama"]
    config = _run_config(folder)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 64)
    tensors["model.layers.0.mlp.gate_proj.lora_A"] = torch.zeros(2, 2)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        _trainer(dataclasses.replace(config, model=dataclasses.replace(config.model, hf_path=str(broken))))
    error = info.value
    assert error.field == "model.hf"
    assert "1 tensors missing: model.layers.1.mlp.up_proj.weight" in error.message
    assert "1 tensors unexpected: model.layers.0.mlp.gate_proj.lora_A" in error.message
    assert "model.layers.0.self_attn.q_proj.weight [3, 64] (model needs [64, 64])" in error.message


# -- exporting -------------------------------------------------------------------------------------


def _save_committed(trainer, root: str, step: int) -> str:
    directory = step_dir(root, step)
    report = trainer.save(directory)
    commit(directory, step, trainer.config.parallel.describe(), 1, [report])
    return directory


def _tensors(folder: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, name)))
    return out


def _with_tokenizer(folder: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(COMMON["vocab_size"] - 1)} | {"[UNK]": COMMON["vocab_size"] - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(folder)


@pytest.mark.parametrize(("arch", "hf_class"), [("llama", "LlamaForCausalLM"), ("olmo2", "Olmo2ForCausalLM")])
def test_export_round_trip(tmp_path, arch, hf_class):
    source = str(tmp_path / "source")
    original = _hf_model(arch)
    original.save_pretrained(source, safe_serialization=True)
    _with_tokenizer(source)
    config = _run_config(source)
    trainer = _trainer(config)
    trainer.run(0, 2)
    root = str(tmp_path / "ckpt")
    saved = _save_committed(trainer, root, 2)
    assert find_step_dir(root) == saved == find_step_dir(root, 2)

    out1 = export_hf(find_step_dir(root), str(tmp_path / "export1"), config.model)
    assert out1 == os.path.abspath(tmp_path / "export1")
    assert sorted(os.listdir(out1)) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]
    assert transformers.AutoTokenizer.from_pretrained(out1)("w1 w5")["input_ids"] == [1, 5]

    # the export is the trained model, bit for bit, and transformers computes the same loss with it
    (model,) = trainer.model_parts
    exported = transformers.AutoModelForCausalLM.from_pretrained(out1).eval()
    assert type(exported).__name__ == hf_class and exported.dtype == torch.float32
    ours = dict(model.named_parameters())
    theirs = exported.state_dict()
    assert torch.equal(theirs["model.layers.1.self_attn.o_proj.bias"], ours["layers.1.attention.wo.bias"])
    assert torch.equal(theirs["lm_head.weight"], ours["output.weight"])
    assert all(torch.equal(theirs[hf_name(name, arch)], param) for name, param in ours.items())
    trained_away = (theirs["model.embed_tokens.weight"] - original.state_dict()["model.embed_tokens.weight"]).abs()
    assert trained_away.max().item() > 1e-3  # two steps at lr 1e-2 moved the weights
    inputs, targets = trainer.dataset.batch([0, 1, 2, 3])
    with torch.no_grad():
        want = cross_entropy_loss(model(inputs), targets).item()
        got = cross_entropy_loss(exported(inputs).logits, targets).item()
    print(f"export {arch}: trainer loss {want:.6f}, transformers loss {got:.6f}, diff {abs(got - want):.3g}")
    assert abs(got - want) <= TOL

    # export -> Trainer loading the export -> export again: bit-identical
    config2 = _run_config(out1)
    second = _trainer(config2)
    out2 = export_hf(_save_committed(second, str(tmp_path / "ckpt2"), 0), str(tmp_path / "export2"), config2.model)
    first_tensors, second_tensors = _tensors(out1), _tensors(out2)
    per_layer = {"llama": 13, "olmo2": 15}[arch]  # with biases on q, k, v and o
    assert first_tensors.keys() == second_tensors.keys() and len(first_tensors) == 3 + 2 * per_layer
    assert all(torch.equal(first_tensors[k], second_tensors[k]) for k in first_tensors)
    assert json.load(open(os.path.join(out1, "config.json"))) == json.load(open(os.path.join(out2, "config.json")))

    # a sharded export: several files and an index, the same tensors, loadable as is
    sharded = export_hf(saved, str(tmp_path / "sharded"), config.model, max_shard_bytes=60_000)
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    files = sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert len(files) >= 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == 4 * families.num_params(config.model)
    assert all(torch.equal(t, first_tensors[k]) for k, t in _tensors(sharded).items())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(sharded).eval()
    with torch.no_grad():
        assert torch.equal(reloaded(inputs).logits, exported(inputs).logits)

    # checkpoint.export_dtype: bfloat16, each weight rounded to nearest, half the bytes, config.json says so
    half = export_hf(saved, str(tmp_path / "bf16"), config.model, max_shard_bytes=30_000, dtype="bfloat16")
    halved = _tensors(half)
    assert halved.keys() == first_tensors.keys() and {t.dtype for t in halved.values()} == {torch.bfloat16}
    assert all(torch.equal(halved[k], first_tensors[k].to(torch.bfloat16)) for k in halved)
    half_index = json.load(open(os.path.join(half, "model.safetensors.index.json")))
    assert half_index["metadata"]["total_size"] == 2 * families.num_params(config.model)
    assert len(set(half_index["weight_map"].values())) == len(files)  # half the bytes, half the shard size
    assert json.load(open(os.path.join(half, "config.json")))["torch_dtype"] == "bfloat16"
    rounded = transformers.AutoModelForCausalLM.from_pretrained(half, dtype=torch.bfloat16).eval()
    assert rounded.dtype == torch.bfloat16
    with torch.no_grad():
        got_bf16 = cross_entropy_loss(rounded(inputs).logits.float(), targets).item()
    print(f"export {arch} bfloat16: transformers loss {got_bf16:.6f} against {got:.6f} in float32")
    assert abs(got_bf16 - got) <= 0.02 * abs(got)  # bf16 weights and compute: within 2%
    with pytest.raises(ConfigError) as refused:
        export_hf(saved, str(tmp_path / "int8"), config.model, dtype="int8")
    assert refused.value.field == "checkpoint.export_dtype" and not os.path.exists(tmp_path / "int8")

    # float16: within its range each weight rounds like bf16's; one beyond it (inf once written) is refused.
    assert {
        t.dtype for t in _tensors(export_hf(saved, str(tmp_path / "fp16"), config.model, dtype="float16")).values()
    } == {torch.float16}
    with torch.no_grad():
        model.output.weight[0, 0] = 1e5
    big = _save_committed(trainer, str(tmp_path / "ckpt-big"), 3)
    with pytest.raises(
        ConfigError, match="output.weight holds a weight of magnitude 1e\\+05, beyond float16"
    ) as refused:
        export_hf(big, str(tmp_path / "fp16-big"), config.model, dtype="float16")
    assert refused.value.field == "checkpoint.export_dtype" and not os.path.exists(tmp_path / "fp16-big")
    big_bf16 = _tensors(export_hf(big, str(tmp_path / "bf16-big"), config.model, dtype="bfloat16"))
    assert big_bf16["lm_head.weight"][0, 0].item() == torch.tensor(1e5).bfloat16().item() and all(
        t.isfinite().all() for t in big_bf16.values()
    )


def test_export_refusals(hf_folders, tmp_path):
    root = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        find_step_dir(root)
    trainer = _trainer(_run_config(hf_folders["qwen2"][0]))
    directory = step_dir(root, 1)
    trainer.save(directory)  # never committed
    with pytest.raises(CheckpointError, match="not committed"):
        find_step_dir(root, 1)
    with pytest.raises(CheckpointError, match="not committed"):
        export_hf(directory, tmp_path / "out", trainer.config.model)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        find_step_dir(root)
    assert not (tmp_path / "out").exists()
    commit(directory, 1, "single", 1, [trainer.save(step_dir(root, 1))])
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("mine")
    with pytest.raises(ConfigError) as info:
        export_hf(directory, occupied, trainer.config.model)
    assert info.value.field == "checkpoint.export" and (occupied / "keep.txt").read_text() == "mine"
    gpt = ModelConfig(n_layers=2, d_model=64, n_heads=4, vocab_size=128, seq_len=SEQ)
    with pytest.raises(ConfigError) as info:
        export_hf(directory, tmp_path / "gpt", gpt)
    assert info.value.field == "checkpoint.export"
    wrong = dataclasses.replace(trainer.config.model, d_ff=128)
    with pytest.raises(ConfigError, match="wrong shape: layers.0.feed_forward.w1.weight"):
        export_hf(directory, tmp_path / "wrong", wrong)
    # the tied Qwen2's checkpoint lists output.weight (the embedding's tensor); the export leaves it out
    (tmp_path / "empty-is-fine").mkdir()
    out = export_hf(directory, tmp_path / "empty-is-fine", trainer.config.model)
    assert "lm_head.weight" not in _tensors(out) and len(_tensors(out)) == 1 + 2 * 12 + 1
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_compiled_checkpointed_chunked_run_saves_and_exports_the_same_names(tmp_path, monkeypatch):
    """Issue #19: compile (in place), selective checkpointing and the chunked loss leave the checkpoint's
    and the export's tensor names as an eager run writes them (no ``_orig_mod``, no wrapper segments)."""
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # see tests/integration/test_throughput_options.py
    source = str(tmp_path / "source")
    _hf_model("llama").save_pretrained(source, safe_serialization=True)
    exports = {}
    for label, options in {
        "eager": {},
        "compiled": {"compile": True, "activation_checkpointing": "selective", "loss_chunk_tokens": 8},
    }.items():
        config = _run_config(source, **options)
        trainer = _trainer(config)
        trainer.run(0, 2)
        saved = _save_committed(trainer, str(tmp_path / f"ckpt-{label}"), 2)
        exports[label] = _tensors(export_hf(saved, str(tmp_path / f"export-{label}"), config.model))
    assert exports["compiled"].keys() == exports["eager"].keys()
    assert not [name for name in exports["compiled"] if "_orig_mod" in name or "wrapped" in name]
    for name, tensor in exports["eager"].items():  # and the same training, to fp32 reordering
        assert torch.allclose(exports["compiled"][name], tensor, atol=1e-5), name
