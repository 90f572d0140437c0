"""Issue #19 item 4: ``training.float8`` numerics, with torchao's emulation on CPU.

Emulated float8 computes what an H100's float8 tensor cores compute (per-tensor scaled e4m3 inputs and
weights, e5m2 gradients) with ordinary matmuls, so these tests check etrain's wiring (which projections
convert, FSDP2's float8 all-gather, names, checkpoints), not the GPU's speed.

Stated tolerance: every step's loss within 2% (relative) of the same run in bf16. Float8 keeps 3
mantissa bits against bf16's 7; measured here the gap is at most 0.5% over 6 steps.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from etrain.workers.protocol.run_config import ParallelConfig, RunConfig
from tests.equivalence_utils import TINY_LLAMA, RunResult, run_layout, small_config

FLOAT8_RTOL = 0.02

#: Wide enough that the attention output and MLP projections qualify (both sizes >= MIN_FEATURES = 256);
#: k and v (256 -> 128) stay bf16, as small projections do, and so does the output projection.
MODEL = dataclasses.replace(TINY_LLAMA, n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512)


def _config(float8: bool, parallel: ParallelConfig | None = None, **training) -> RunConfig:
    config = small_config(steps=6, model=MODEL, precision="bf16", float8=float8, lr=1e-3, **training)
    return dataclasses.replace(config, parallel=parallel or ParallelConfig())


def _assert_close(got: RunResult, want: RunResult, label: str) -> None:
    for step, (a, b) in enumerate(zip(got.losses, want.losses)):
        assert abs(a - b) <= FLOAT8_RTOL * abs(b), f"{label} step {step}: float8 {a} vs bf16 {b}"
    assert got.losses[-1] < got.losses[0], f"{label}: float8 did not learn"


@pytest.fixture(scope="module")
def bf16() -> RunResult:
    (result,) = run_layout(_config(float8=False), timeout_s=240)
    return result


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float8_trains_like_bf16_with_the_same_names(bf16, compiled, monkeypatch):
    monkeypatch.setenv("ETRAIN_COMPILE_BACKEND", "aot_eager")  # see tests/integration/test_throughput_options.py
    (float8,) = run_layout(_config(float8=True, compile=compiled), timeout_s=240)
    _assert_close(float8, bf16, f"one process, compile={compiled}")
    assert float8.params.keys() == bf16.params.keys()  # checkpoints and exports see the same names


@pytest.mark.parametrize("zero", [0, 3])
def test_float8_under_ddp_and_fsdp_float8_all_gather(bf16, zero):
    results = run_layout(_config(float8=True, parallel=ParallelConfig(dp=2, zero=zero)), timeout_s=240)
    for result in results:
        _assert_close(result, bf16, f"dp2 zero={zero} rank {result.rank}")
    assert all(torch.equal(results[0].params[k], results[1].params[k]) for k in results[0].params)


def test_which_projections_convert():
    from torch import nn

    from etrain.workers.engine.float8 import apply_float8
    from etrain.workers.families.model import build_model_skeleton

    model = build_model_skeleton(MODEL)
    converted = apply_float8(model, device=torch.device("cpu"), fsdp=False, precision="bf16", tp=1)
    float8 = {name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    plain = {name for name, m in model.named_modules() if type(m) is nn.Linear}
    assert converted == len(float8) == 2 * 5  # wq, wo, w1, w2, w3 in each of 2 blocks
    assert plain == {"output"} | {f"layers.{i}.attention.{p}" for i in range(2) for p in ("wk", "wv")}


def test_float8_under_tensor_parallelism_uses_torchaos_styles_and_trains_like_bf16(bf16):
    """tp=2: the float8 projections take torchao's float8 column-/row-wise styles (their weights float8-cast
    DTensors), the bf16 ones (k, v, the output) etrain's own; both ranks train within the tolerance of one
    bf16 process, on identical losses."""
    results = run_layout(_config(float8=True, parallel=ParallelConfig(tp=2)), timeout_s=300)
    for result in results:
        _assert_close(result, bf16, f"tp2 rank {result.rank}")
    assert results[0].losses == results[1].losses


def test_float8_with_sequence_parallelism_is_refused_naming_the_fix():
    from etrain.workers.protocol.layout_rules import float8_problems

    problems = float8_problems(device="cuda", precision="bf16", tp=2, sequence_parallel=True)
    assert [p.field for p in problems] == ["training.float8"]
    assert "sequence parallelism" in problems[0].message and "sequence_parallel: false" in problems[0].fix
    assert float8_problems(device="cuda", precision="bf16", tp=2) == []  # tp alone composes


def test_a_float8_projection_gets_torchaos_tp_style_and_a_bf16_one_keeps_etrains():
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from etrain.workers.engine.float8 import apply_float8
    from etrain.workers.engine.parallelize import _float8_style
    from etrain.workers.families.model import build_model_skeleton

    model = build_model_skeleton(MODEL)
    apply_float8(model, device=torch.device("cpu"), fsdp=False, precision="bf16", tp=2)
    block = model.layers["0"]
    colwise = _float8_style(ColwiseParallel(use_local_output=False), block.get_submodule("attention.wq"))
    rowwise = _float8_style(RowwiseParallel(output_layouts=Shard(1)), block.get_submodule("attention.wo"))
    assert type(colwise) is Float8ColwiseParallel and colwise.use_local_output is False
    assert type(rowwise) is Float8RowwiseParallel and rowwise.output_layouts == (Shard(1),)
    assert rowwise.input_layouts == (Shard(-1),) and colwise.input_layouts == (Replicate(),)
    plain = ColwiseParallel()
    assert _float8_style(plain, block.get_submodule("attention.wk")) is plain  # k stays bf16 (256 -> 128)
    assert isinstance(block.get_submodule("attention.wk"), nn.Linear)


def test_a_tensor_parallel_model_without_float8_never_imports_torchao():
    """Asking whether a projection is a float8 linear must not import torchao to find out: that cost every
    TP rank 0.7 s of CPU at start-up (and torchao's native-library warnings in its log) in jobs without
    float8. A fresh interpreter applies a TP plan to a model that was not converted."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel\n"
        "from etrain.workers.engine.parallelize import _float8_style\n"
        "from etrain.workers.families.model import build_model_skeleton\n"
        "from tests.integration.test_float8 import MODEL\n"
        "block = build_model_skeleton(MODEL).layers['0']\n"
        "for name, style in (('attention.wq', ColwiseParallel()), ('attention.wo', RowwiseParallel())):\n"
        "    assert _float8_style(style, block.get_submodule(name)) is style\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao'))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_selective_checkpointing_keeps_float8s_scales_so_the_backward_takes_no_extra_reductions():
    """``activation_checkpointing: selective`` with float8: the policy keeps the absolute maxima torchao's casts
    scale by (torchtitan keeps them too), so recomputing a block's casts in the backward runs no reduction the
    backward without checkpointing does not run: the same count of ``aten.max`` (it was 12 against 8)."""
    import collections

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from etrain.workers.engine.parallelize import _selective_contexts

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[func] += 1
            return func(*args, **(kwargs or {}))

    def backward_ops(selective: bool) -> collections.Counter:
        torch.manual_seed(0)
        mlp = torch.nn.Sequential(
            torch.nn.Linear(256, 512, bias=False), torch.nn.GELU(), torch.nn.Linear(512, 256, bias=False)
        )
        convert_to_float8_training(mlp, config=Float8LinearConfig(emulate=True))
        run = checkpoint_wrapper(mlp, preserve_rng_state=False, context_fn=_selective_contexts) if selective else mlp
        x = torch.randn(4, 64, 256, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = run(x)
            ops = Ops()
            with ops:
                out.float().sum().backward()
        return ops.count

    plain, selective = backward_ops(False), backward_ops(True)
    amax, matmul = torch.ops.aten.max.default, torch.ops.aten.mm.default
    assert plain[amax] > 0 and selective[amax] == plain[amax], (plain[amax], selective[amax])
    assert selective[matmul] == plain[matmul]  # the float8 matmuls' outputs are kept, not recomputed
