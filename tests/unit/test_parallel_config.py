"""Layout validation and the single-process Trainer path (no process group needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from etrain.workers.engine.parallelize import ParallelDims
from etrain.workers.engine.torchrun import load_run_config, main
from etrain.workers.engine.train import Trainer
from etrain.workers.families.layout import tp_problems
from etrain.workers.protocol.errors import ConfigError
from etrain.workers.protocol.layout_rules import sequence_parallel_problems
from etrain.workers.protocol.run_config import ModelConfig, ParallelConfig
from tests.equivalence_utils import small_config
from tests.state_utils import full_state_dict


def test_parallel_dims_must_multiply_to_the_world_and_the_message_prints_every_degree() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelDims(pp=2, dp=3, tp=2, world_size=8)
    assert "pp=2 × dp=3 × tp=2 = 12 ranks, but the world size is 8" in str(info.value)
    dims = ParallelDims(pp=1, dp=2, tp=2, world_size=4)
    assert (dims.dp_enabled, dims.tp_enabled, dims.pp_enabled) == (True, True, False)


@pytest.mark.parametrize(
    "model, tp, sp, field, size",
    [
        (
            ModelConfig(n_layers=1, d_model=24, n_heads=3, vocab_size=64, seq_len=8),
            2,
            False,
            "parallelism.tp",
            "model.n_heads=3",
        ),
        (
            ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=64, seq_len=8, d_ff=9),
            2,
            False,
            "parallelism.tp",
            "model.ffn_dim=9",
        ),
        (
            ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=63, seq_len=8),
            2,
            False,
            "parallelism.tp",
            "model.vocab_size=63",
        ),
        (
            ModelConfig(n_layers=1, d_model=8, n_heads=2, vocab_size=64, seq_len=7),
            2,
            True,
            "parallelism.sequence_parallel",
            "model.seq_len=7",
        ),
    ],
)
def test_tensor_parallel_shape_rules_name_the_setting(model, tp, sp, field, size) -> None:
    """The rules parallelize_stage checks (etrain.workers.families.layout, etrain.workers.protocol.layout_rules):
    one problem, naming the size."""
    problems = tp_problems(model, tp) + sequence_parallel_problems(seq_len=model.seq_len, tp=tp, enabled=sp)
    assert [p.field for p in problems] == [field]
    assert size in problems[0].message and "parallelism.tp=2" in problems[0].message


def test_trainer_rejects_a_layout_of_another_world_size() -> None:
    config = small_config(parallel=ParallelConfig(dp=2))
    with pytest.raises(ConfigError, match="pp=1 × dp=2 × tp=1 = 2 ranks, but the world size is 1"):
        Trainer(config, rank=0, world_size=1, device=torch.device("cpu"))


def test_sequence_parallel_needs_tensor_parallel() -> None:
    config = small_config(parallel=ParallelConfig(sequence_parallel=True))
    with pytest.raises(ConfigError, match="sequence_parallel=true needs tp > 1"):
        Trainer(config, rank=0, world_size=1, device=torch.device("cpu"))


def test_single_process_trainer_learns_and_reports_state() -> None:
    config = small_config(steps=6)
    trainer = Trainer(config, rank=0, world_size=1, device=torch.device("cpu"))
    history = trainer.run(0, 6)
    assert history[-1].loss < history[0].loss - 0.2
    assert [m.step for m in history] == list(range(6))
    parts, optimizers, extra = trainer.state_for_checkpoint()
    assert extra["step"] == 6 and extra["data"]["next_step"] == 6 and "rng" in extra
    assert set(full_state_dict(trainer)) == {n for n, _ in parts[0].named_parameters()}


def test_torchrun_entry_point_runs_a_config_file(tmp_path, capsys) -> None:
    config = small_config(steps=2)
    raw = {k: v for k, v in dataclasses.asdict(config).items()}
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    assert load_run_config(str(path)) == config
    metrics_path = tmp_path / "metrics.json"
    assert main(["--config", str(path), "--metrics-out", str(metrics_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["step"] for line in lines] == [0, 1]
    assert json.loads(metrics_path.read_text()) == lines


def test_torchrun_refuses_a_config_file_of_an_unknown_family(tmp_path) -> None:
    """The run config names a family without asking the registry: the entry point asks it."""
    raw = dataclasses.asdict(small_config(steps=2))
    raw["model"]["arch"] = "mamba"
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as info:
        load_run_config(str(path))
    assert info.value.field == "model.kind" and "gpt, llama, olmo2, qwen3_moe, mixtral" in info.value.fix


def test_bf16_autocast_trains_close_to_fp32() -> None:
    fp32 = Trainer(small_config(steps=2), rank=0, world_size=1, device=torch.device("cpu")).run(0, 2)
    config = small_config(steps=2, precision="bf16")
    bf16 = Trainer(config, rank=0, world_size=1, device=torch.device("cpu")).run(0, 2)
    for a, b in zip(fp32, bf16):
        assert a.loss != b.loss and abs(a.loss - b.loss) < 0.02 * a.loss
