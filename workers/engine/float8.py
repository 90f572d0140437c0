"""``training.float8``: the blocks' matmuls in float8 (torchao), the way torchtitan runs them.

Why torchao: float8 training needs per-tensor scaling, float8 casts fused into the matmul (``torch._scaled_mm``)
and, under FSDP2, all-gathering the weights already cast to float8 (half the bytes of bf16); torchao's
``convert_to_float8_training`` does all of that and is what torchtitan measured +25-28% with on H100s.

Which matmuls: every block projection whose two sizes are multiples of 16 (``_scaled_mm``'s rule) and at
least :data:`MIN_FEATURES` (below that the casts cost more than float8 saves); the output projection
stays in bf16 (its logits feed the loss, where float8's 3-bit mantissa costs accuracy, as torchtitan
leaves it). Parameters stay fp32 masters with their names unchanged, so checkpoints and Hugging Face
exports are the same as without float8.

On a device without float8 tensor cores torchao's emulation (``emulate=True``) computes the same
scaled float8 numerics with ordinary matmuls: the service refuses such jobs
(``etrain.workers.protocol.layout_rules.float8_problems``), the CPU tests use it to check the numerics.
"""

from __future__ import annotations

import torch
from torch import nn

from etrain.workers.protocol import layout_rules
from etrain.workers.protocol.errors import ConfigError

__all__ = ["MIN_FEATURES", "apply_float8", "float8_eligible"]

#: Smallest in/out features a projection needs to run in float8.
MIN_FEATURES = 256


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether ``module`` (at ``fqn``) becomes a float8 linear."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "output":
        return False
    sizes = (module.in_features, module.out_features)
    return all(size % 16 == 0 and size >= MIN_FEATURES for size in sizes)


def apply_float8(
    module: nn.Module, *, device: torch.device, fsdp: bool, precision: str, tp: int, sequence_parallel: bool = False
) -> int:
    """Swap the eligible projections of ``module`` (a whole model or a stage) for torchao's float8 linears,
    before any parallelism wraps them; returns how many were converted. ``fsdp``: cast the weights to
    float8 before FSDP2's all-gather."""
    emulate = device.type != "cuda"
    layout_rules.check(
        layout_rules.float8_problems(
            device=device.type, precision=precision, tp=tp, sequence_parallel=sequence_parallel, emulate=emulate
        )
    )
    if not emulate and torch.cuda.get_device_capability(device) < (8, 9):
        raise ConfigError(
            f"training.float8 needs float8 tensor cores (compute capability 8.9+); "
            f"{torch.cuda.get_device_name(device)} has {torch.cuda.get_device_capability(device)}.",
            field="training.float8",
            fix="run on H100/H200/L40S-class GPUs, or set training.float8: false",
        )
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:
        raise ConfigError(
            "training.float8 needs torchao on the workers.",
            field="training.float8",
            fix="pip install 'etrain[float8]' where the Ray workers run",
        ) from err
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    before = sum(isinstance(m, nn.Linear) for m in module.modules())
    convert_to_float8_training(module, config=config, module_filter_fn=float8_eligible)
    return before - sum(type(m) is nn.Linear for m in module.modules())
